"""The main job (``launch.train``) with a crash in it, for tests: rank 1 is SIGKILLed right after
it starts the asynchronous checkpoint request of step ``$SHARDAVG_TEST_KILL_IN_FLIGHT``, with the
request in flight. Takes the job's own arguments::

    SHARDAVG_TEST_KILL_IN_FLIGHT=8 torchrun --nproc_per_node 2 tests_distributed/kill_in_flight.py --config ...
"""

from __future__ import annotations

import os
import runpy
import signal

import torch.distributed as dist

from launch import checkpoints

KILL_IN_FLIGHT = "SHARDAVG_TEST_KILL_IN_FLIGHT"  # at this step rank 1 is killed with its request in flight
save_async = checkpoints.save_async


def save_async_then_kill(root, step, *args, **kwargs):
    """``checkpoints.save_async``, then the kill at the chosen step (a crash with the request in flight)."""
    started = save_async(root, step, *args, **kwargs)
    if os.environ.get(KILL_IN_FLIGHT) == str(step) and dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return started


if __name__ == "__main__":
    checkpoints.save_async = save_async_then_kill  # (the Checkpointer calls it through the module's globals)
    runpy.run_module("launch.train", run_name="__main__", alter_sys=True)
