"""Helpers shared by the single-process checkpoint tests."""

from __future__ import annotations

import contextlib
import hashlib
import json
import signal
from collections.abc import Iterator
from pathlib import Path

import torch
from harness import TiedNet
from safetensors.torch import save_file

from shardavg import EMA, WeightAverager
from shardavg.format import with_checksum


def trained(trainer, steps: int = 5, **kwargs) -> WeightAverager:
    """An averager that followed ``steps`` real optimizer steps of the trainer's model."""
    averager = WeightAverager(trainer.model, kwargs.pop("rule", EMA(decay=0.9)), **kwargs)
    for _ in range(steps):
        trainer.step()
        averager.update()
    return averager


def fresh(rule=None, **kwargs) -> WeightAverager:
    """An averager on an untrained model: whatever it holds after a load came from the checkpoint."""
    torch.manual_seed(0)
    return WeightAverager(TiedNet(), rule or EMA(decay=0.9), **kwargs)


def assert_same_average(a: WeightAverager, b: WeightAverager) -> None:
    got, want = a.full_state_dict(), b.full_state_dict()
    assert set(got) == set(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name


@contextlib.contextmanager
def deadline(seconds: int) -> Iterator[None]:
    """Fail instead of hanging (a read from a FIFO blocks forever)."""

    def expire(signum, frame):
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def replace_shard(checkpoint: Path, name: str, tensors: dict[str, torch.Tensor]) -> Path:
    """Replace a shard file with ``tensors`` as someone who knows the format would: the file carries
    the save's id and the manifest its new size and hash (checksum recomputed), so only the checks
    behind those (names, dtypes, shapes) can catch it."""
    meta = json.loads((checkpoint / "shardavg.json").read_text())
    shard = checkpoint / name
    save_file(tensors, str(shard), metadata={"shardavg_save": meta["save_id"]})
    data = shard.read_bytes()
    meta["digests"][meta["files"].index(name)] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    meta.pop("checksum")
    (checkpoint / "shardavg.json").write_text(json.dumps(with_checksum(meta)))
    return shard


def as_flat_ranges(meta: dict, version: int) -> dict:
    """A manifest of this version rewritten as format ``version`` (4 or earlier) wrote it: each
    chunk a range of the flattened tensor (``{file, start, end}``), not a box."""
    from shardavg.parts import box_span

    for entry in meta["tensors"]:
        ranges = [(c["file"], box_span(entry["shape"], c["offsets"], c["sizes"])) for c in entry["chunks"]]
        assert all(span is not None for _, span in ranges), "only boxes that are ranges have a flat form"
        entry["chunks"] = [{"file": file, "start": start, "end": end} for file, (start, end) in ranges]
    return meta | {"version": version}
