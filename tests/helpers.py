"""Helpers shared by the single-process checkpoint tests."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import torch
from harness import TiedNet
from safetensors.torch import save_file

from shardavg import EMA, WeightAverager
from shardavg.checkpoints.description import with_checksum


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
    rank = int(name.split("-")[1])
    meta["digests"][rank] = [len(data), hashlib.sha256(data).hexdigest()]
    meta.pop("checksum")
    (checkpoint / "shardavg.json").write_text(json.dumps(with_checksum(meta)))
    return shard


def as_chunk_tables(meta: dict) -> dict:
    """A manifest of format 6 rewritten as format 5 wrote it: each tensor's chunk table (every
    owner's boxes, back to back in its file) in place of its layout, files by name, and no grids;
    in place."""
    from shardavg.checkpoints.format import chunk_table
    from shardavg.layouts.tensor_layout import grid_from_json, layout_from_json

    if isinstance(meta.get("files"), int):  # each file by name, each digest spelt out
        meta["files"] = [f"rank-{r:05d}-of-{meta['files']:05d}.safetensors" for r in range(meta["files"])]
        if "digests" in meta:
            meta["digests"] = [{"bytes": size, "sha256": sha} for size, sha in meta["digests"]]
    grids = [grid_from_json(grid) for grid in meta.pop("grids", [])]
    for entry in meta["tensors"]:
        if "layout" in entry:
            owned = layout_from_json(entry.pop("layout"), entry["shape"], grids).owned
            entry["chunks"] = [chunk.to_json() for chunk in chunk_table(owned)]
    meta["version"] = 5
    return meta


def as_flat_ranges(meta: dict, version: int) -> dict:
    """A manifest of this version rewritten as format ``version`` (4 or earlier) wrote it: each
    chunk a range of the flattened tensor (``{file, start, end}``), not a box."""
    from shardavg.layouts.parts import box_range

    meta = as_chunk_tables(meta)
    for entry in meta["tensors"]:
        ranges = [(c["file"], box_range(entry["shape"], c["offsets"], c["sizes"])) for c in entry["chunks"]]
        assert all(span is not None for _, span in ranges), "only boxes that are ranges have a flat form"
        entry["chunks"] = [{"file": file, "start": start, "end": end} for file, (start, end) in ranges]
    return meta | {"version": version}


def in_process_cli(*args: str) -> subprocess.CompletedProcess:
    """``shardavg ARGS`` run in this process (``cli.main``), its output captured: what
    ``python -m shardavg ARGS`` prints and returns, without a second start of torch per call
    (``test_the_module_runs_as_a_command`` runs the real ``python -m shardavg``)."""
    from shardavg import cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(list(args))
    return subprocess.CompletedProcess(["shardavg", *args], code, out.getvalue(), err.getvalue())


class Payload:
    """Pickled into what a reader must never unpickle (an optimizer state, a crafted file): loading
    it writes ``marker``, so a test sees whether anything unpickled it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "unpickled"))
