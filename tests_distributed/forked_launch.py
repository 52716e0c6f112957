"""Launch a scenario's ranks through torchrun's own launcher, forked from one process that has
imported what the scenario imports, so that a launch pays for its imports once, not once per rank.

    python tests_distributed/forked_launch.py NPROC [--preload=MODULE,...] SCRIPT [ARGS...]
    python tests_distributed/forked_launch.py NPROC [--preload=MODULE,...] -m MODULE [ARGS...]

Why: the suite's ~110 launches are mostly imports (torch, DeepSpeed and the ``torch.compile``
its ``initialize`` pulls in, Lightning, transformers), paid by every rank of every launch; on a
2-core machine that was about a third of the torchrun tier. Here the imports at the top of the
script (or module) run once, and the ranks are forked after them; ``--preload`` names modules
the ranks will import later, inside functions (DeepSpeed's, for a launch that builds ZeRO engines).

What stays torchrun's: the elastic agent, the c10d rendezvous of ``--standalone``, the ranks'
environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``...), how a failing rank ends the launch
(the others are stopped, its traceback reported through ``@record``), the exit status. What a
rank sees as it would under the ``torchrun`` command: ``sys.argv``, ``sys.path[0]``, ``__main__``,
default signal handlers, and at the end the interpreter's exit (threads joined, ``atexit``
run); an ``os._exit(0)`` (the scenarios' ``harness.finish``) still skips that exit, as it does
there. ``SHARDAVG_TEST_LAUNCHER=torchrun`` makes tests_distributed/launcher.py use the
``torchrun`` command instead (docs/testing.md); some tests run that command themselves.
"""

from __future__ import annotations

import ast
import atexit
import importlib.util
import os
import runpy
import signal
import sys
import threading
import traceback
import uuid

from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.launcher.api import LaunchConfig, elastic_launch


class _Finished(BaseException):
    """``os._exit(0)`` inside a rank: end the rank here, with no interpreter exit, as there."""


def import_what_it_imports(path: str) -> None:
    """Run the top-level ``import`` statements of the file at ``path`` (nothing else of it); one
    that fails is left for the rank to meet, where it fails as it would have."""
    tree = ast.parse(open(path).read(), path)
    for node in tree.body:
        absolute = isinstance(node, ast.ImportFrom) and node.level == 0 and node.module != "__future__"
        if isinstance(node, ast.Import) or absolute:
            try:
                exec(compile(ast.Module([node], type_ignores=[]), path, "exec"), {"__name__": "__imports__"})
            except Exception:  # noqa: BLE001 (the rank imports it again and says why)
                pass


def rank(target: str, is_module: bool, argv: list[str]) -> None:
    """One rank: the script (or module) as ``__main__``, then the interpreter's exit."""
    for number in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # the agent's handlers are not a rank's
        signal.signal(number, signal.SIG_DFL)
    real_exit, rank_pid = os._exit, os.getpid()

    def exit_now(code: int) -> None:  # (a process the rank forks, as multiprocessing does, exits for real)
        if code == 0 and os.getpid() == rank_pid:
            raise _Finished
        real_exit(code)

    os._exit = exit_now
    sys.argv = [target, *argv]
    try:
        if is_module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(target, run_name="__main__")
        threading._shutdown()  # what the interpreter's exit does first: wait for non-daemon threads
        atexit._run_exitfuncs()
    except _Finished:
        pass
    except SystemExit as exit_:
        if exit_.code not in (0, None):
            raise
    except BaseException:
        traceback.print_exc()  # as `python SCRIPT` prints what escapes it (the agent shows the first only)
        raise
    finally:
        os._exit = real_exit
        sys.stdout.flush()
        sys.stderr.flush()


@record
def main() -> None:
    nproc, rest = int(sys.argv[1]), sys.argv[2:]
    preload = rest.pop(0).removeprefix("--preload=").split(",") if rest[0].startswith("--preload=") else []
    if rest[0] == "-m":
        target, is_module, argv = rest[1], True, rest[2:]
        sys.path[0] = os.getcwd()  # as for `python -m MODULE`
        spec = importlib.util.find_spec(target)
        if spec is None or spec.origin is None:
            raise SystemExit(f"no module named {target!r}")
        path = spec.origin
    else:
        target = path = os.path.abspath(rest[0])
        is_module, argv = False, rest[1:]
        sys.path[0] = os.path.dirname(target)  # as for `python SCRIPT`: the script's folder first
    import_what_it_imports(path)
    for module in preload:
        try:
            importlib.import_module(module)
        except ImportError:  # (another DeepSpeed: the ranks import what theirs needs)
            pass
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()), rdzv_backend="c10d",
        rdzv_endpoint="localhost:0", max_restarts=0, start_method="fork",
    )  # fmt: skip
    elastic_launch(config, rank)(target, is_module, argv)


if __name__ == "__main__":
    main()
