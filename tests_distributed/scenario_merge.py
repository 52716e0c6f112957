"""torchrun scenario: ``shardavg merge`` split across workers.

    torchrun --standalone --nproc_per_node N tests_distributed/scenario_merge.py MODE ROOT [ARGS...]

MODE ``cli`` runs ``shardavg merge ARGS`` as ``torchrun -m shardavg merge`` does (each worker
writes its share of the model folder). MODE ``disagree`` has the last worker pass other weights
than the others, and MODE ``missing`` has it name an input that does not exist: every worker
must refuse together, before anything is written. ``disagree+missing`` runs both in turn.
"""

from __future__ import annotations

import sys
from pathlib import Path

import harness
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

import shardavg
from shardavg.cli import main as cli


@record
def main() -> None:
    mode, root, args = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
    if mode == "cli":
        code = cli(["merge", *args])  # (the CLI makes the workers' process group itself)
        harness.report("EXIT", {"code": code})
        raise SystemExit(code)
    dist.init_process_group("gloo")
    for refusal in mode.split("+"):  # several: in turn, in this launch
        inputs = sorted(p for p in (root / "inputs").iterdir())
        last = dist.get_rank() == dist.get_world_size() - 1
        weights = [1.0] * len(inputs)
        if refusal == "disagree" and last:
            weights[0] = 2.0
        if refusal == "missing" and last:
            inputs[0] = root / "no-such-checkpoint"
        with harness.expect_raises(shardavg.CheckpointError, "rank"):
            shardavg.merge(inputs, root / "refused", weights=weights, collective=True)
        assert not (root / "refused").exists(), "a refused merge wrote something"
        harness.report("REFUSED", {"mode": refusal, "world_size": dist.get_world_size()})
    harness.finish()


if __name__ == "__main__":
    main()
