"""torchrun scenario: the every-rank export where OUT is not the same folder on every rank.

    torchrun --standalone --nproc_per_node 2 tests_distributed/scenario_export_disks.py BASE DISK

A node-local disk mounted at the same path on every node, simulated on one machine: rank 1 runs
in a mount namespace of its own where ``DISK`` is bind-mounted over ``BASE``, so ``BASE/model``
names rank 0's folder on rank 0 and another folder on rank 1 (done first, while the process is
single-threaded, as the namespace must be). An earlier export left its temporary
``.model.safetensors.incomplete`` on rank 1's disk. The export written by every rank must be
refused on every rank, naming rank 1 (its failure kept in ``failures`` too) and saying that the
ranks do not share OUT, with nothing committed on rank 0's side (its previous export byte for
byte); the same where rank 1's disk holds nothing under the names (a split export);
``writers=1`` (what the message suggests) then writes the new export.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

CLONE_NEWNS = 0x00020000


def own_disk(base: str, disk: str) -> None:
    """This process sees ``disk`` at ``base`` (a mount namespace of its own: no one else does)."""
    if ctypes.CDLL(None, use_errno=True).unshare(CLONE_NEWNS) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS)")
    subprocess.run(["mount", "--make-rprivate", "/"], check=True)
    subprocess.run(["mount", "--bind", disk, base], check=True)


if os.environ.get("RANK") == "1":
    own_disk(sys.argv[1], sys.argv[2])

# ruff: noqa: E402  (the imports below start threads: the namespace is made first)
from pathlib import Path

import harness
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.elastic.multiprocessing.errors import record

from shardavg import EMA, ExportError, WeightAverager
from shardavg.base.errors import RankFailure

STALE = ".model.safetensors.incomplete"


def contents(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def train(engine: harness.Engine, averager: WeightAverager, steps: range) -> None:
    for step in steps:
        engine.step(step)
        averager.update()


def refused(averager: WeightAverager, out: Path, *fragments: str, **options: object) -> str:
    """The every-rank export refused on every rank with ``fragments`` in the message, and rank 1's
    failure in ``failures`` on every rank; the message."""
    try:
        averager.export(out, **options)
    except ExportError as error:
        message, failures = str(error), error.failures
    else:
        raise AssertionError(f"rank {dist.get_rank()}: the export into {out} was not refused")
    missing = [f for f in (f"exporting to {out} failed: rank 1: ExportError", *fragments) if f not in message]
    assert not missing and "\n" not in message, f"{message!r} lacks {missing}"
    said = message.removeprefix(f"exporting to {out} failed: rank 1: ExportError: ")
    assert failures == {1: RankFailure("ExportError", said)}, f"rank {dist.get_rank()}: {failures}"
    return message


@record
def main() -> None:
    base, disk = Path(sys.argv[1]), Path(sys.argv[2])
    harness.init_distributed()
    me = dist.get_rank()
    engine = harness.build_fsdp2(torch.float32)
    averager = WeightAverager(engine.model, EMA(decay=0.9))
    train(engine, averager, range(3))
    out = base / "model"
    averager.export(out, writers=1)  # rank 0's disk: the previous export
    assert (out / "model.safetensors").is_file() == (me == 0), f"rank {me} sees rank 0's folder"
    previous = contents(out) if me == 0 else {}
    stale = [(out / "model.safetensors").read_bytes() if me == 0 else None]
    dist.broadcast_object_list(stale, src=0)
    if me == 1:  # an earlier export, killed, left its temporary file on rank 1's disk
        (disk / "model").mkdir(exist_ok=True)
        (disk / "model" / STALE).write_bytes(stale[0])
    dist.barrier()

    train(engine, averager, range(3, 5))
    messages = {}
    unshared = f"rank 1 does not share {out} with the committer (rank 0)"
    messages["stale"] = refused(averager, out, "is not this export's file", unshared, "writers=1")
    messages["missing"] = refused(averager, out, "is not there to write into", unshared, max_shard_size=300)
    if me == 0:
        assert contents(out) == previous, "rank 0's previous export changed"
    else:  # nothing written into the leftover, nothing left on rank 1's disk
        assert contents(disk / "model") == {STALE: stale[0]}, sorted(contents(disk / "model"))

    averager.export(out, writers=1)  # what the message suggests
    reference = averager.full_state_dict()
    if me == 0:
        written = load_file(str(out / "model.safetensors"))
        assert all(torch.equal(written[name], reference[name]) for name in reference)
    harness.report("DISKS", messages)
    harness.finish()


if __name__ == "__main__":
    main()
