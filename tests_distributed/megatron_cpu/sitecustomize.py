"""TEST-ONLY: Megatron-Core on CPU for a process that does not know it is tested (``examples/megatron_gpt.py``).

``tests_distributed/test_examples.py`` puts this folder first on ``PYTHONPATH`` for one torchrun
launch, so every process of it imports this at start-up. Once Megatron's ``parallel_state`` is
imported, its ``initialize_model_parallel`` is wrapped to apply the harness's test-only shims right
after it (``megatron_harness.cpu_shims`` and ``checkpoint_shims``: the RNG tracker's ``fork``, the
attention's scratch buffer, ``dist_checkpointing``'s CUDA calls and its writer's queue), for the
process's life. Nothing is imported until Megatron is (torchrun's own process never imports it),
and nothing of this is in the example or the package.
"""

import functools
import importlib.abc
import importlib.machinery
import sys
from pathlib import Path

TESTS = str(Path(__file__).resolve().parents[1])  # tests_distributed/: megatron_harness
TARGET = "megatron.core.parallel_state"


class MegatronOnCpu(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            initialize = module.initialize_model_parallel

            @functools.wraps(initialize)
            def initialize_then_shim(*args, **kwargs):
                initialize(*args, **kwargs)
                sys.path.insert(0, TESTS)
                import megatron_harness

                megatron_harness.cpu_shims()
                megatron_harness.checkpoint_shims()
                print("MEGATRON_CPU shims in effect", flush=True)

            module.initialize_model_parallel = initialize_then_shim

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, MegatronOnCpu())
