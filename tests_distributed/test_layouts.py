"""Tensor parallel, FSDP2 + TP, HSDP + TP, expert parallel and pipeline stages against references;
one checkpoint through every layout, world size and engine; the offline CLI on what they wrote."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
import subprocess

import pytest
import torch
from helpers import as_chunk_tables
from launcher import torchrun
from safetensors.torch import load_file

import shardavg.cli
from shardavg.checkpoints.description import with_checksum

pytestmark = pytest.mark.slow  # a torchrun launch: python -m pytest -m "not slow" leaves it out

LAYOUTS = {2: ["tp-2-float32", "tp-2-bfloat16", "ep-1x2-float32", "pp-2x1-float32"],
           4: ["fsdp2_tp-2x2-float32", "fsdp2_tp-2x2-bfloat16", "hsdp_tp-2x1x2-float32", "hsdp_tp-1x2x2-float32",
               "ep-2x2-float32", "pp-2x2-float32"]}  # fmt: skip


@pytest.mark.parametrize("world_size", [2, 4])
def test_every_layout_averages_exactly_without_communication(world_size: int, tmp_path) -> None:
    launch = torchrun("scenario_layouts.py", world_size, str(tmp_path), timeout=480)
    assert launch.returncode == 0, launch.output[-20000:]
    assert launch.reports("DONE") == [{"world_size": world_size}], launch.output[-5000:]
    measured = {report["config"]: report for report in launch.reports("LAYOUT")}
    assert sorted(measured) == sorted(LAYOUTS[world_size])
    for report in measured.values():
        assert report["steps"] >= 20 and len(report["shadow_bytes_per_rank"]) == world_size
    (pipeline,) = launch.reports("PIPELINE")
    assert pipeline["max_difference_to_unpipelined"] < 1e-5, pipeline


def cli(*args: str) -> subprocess.CompletedProcess:
    """The command line in this process (a process each would cost more than the work): its exit
    status and what it printed."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = shardavg.cli.main(list(args))
    return subprocess.CompletedProcess(["shardavg", *args], code, out.getvalue(), err.getvalue())


def test_one_checkpoint_loads_bitwise_under_every_layout_and_offline(tmp_path) -> None:
    """TP 2 x FSDP 2 -> FSDP2 at 4, 2 and 1 -> ZeRO-3 at 2 -> DDP -> PP 2 x DP 2 -> back to TP 2 x
    FSDP 2, both ``avg.save`` and DCP, two named averages; then the offline CLI reads what TP and
    PP wrote, and ``shardavg posthoc`` synthesizes from their snapshots what they did in process."""
    for mode, world_size in (("train", 4), ("load", 2), ("load", 1), ("load", 4)):
        launch = torchrun("scenario_reshard.py", world_size, mode, str(tmp_path), timeout=480)
        assert launch.returncode == 0, f"{mode} at {world_size}:\n{launch.output[-20000:]}"
        assert launch.reports("DONE") == [{"mode": mode, "world_size": world_size}], launch.output[-5000:]
        if mode == "load":
            (resharded,) = launch.reports("RESHARDED")
            assert resharded["loads"] >= 2 * 2 * len(resharded["layouts"]), resharded
    saved = sorted(p.name for p in (tmp_path / "saved").iterdir())
    assert saved == sorted(["fsdp2_tp-4", "pp-4", "fsdp2-4", "hsdp_tp-4", "ddp-4", "fsdp2-2", "ddp-2", "zero3-2",
                            "tp-2", "pp-2", "fsdp2-1", "ddp-1"])  # fmt: skip

    for label in ("fsdp2_tp-4", "pp-4"):  # the same checkpoints as format 5 wrote them: chunk tables
        shutil.copytree(tmp_path / "saved" / label, tmp_path / "v5" / label)
        meta = json.loads((tmp_path / "v5" / label / "shardavg.json").read_text())
        meta.pop("checksum")
        (tmp_path / "v5" / label / "shardavg.json").write_text(json.dumps(with_checksum(as_chunk_tables(meta))))

    cases = (("saved", "fsdp2_tp-4"), ("saved", "pp-4"), ("v5", "fsdp2_tp-4"), ("v5", "pp-4"), ("dcp", "pp-2"),
             ("dcp", "tp-2"))  # fmt: skip
    for kind, label in cases:
        checkpoint = tmp_path / kind / label
        source = (tmp_path / "origin" / label).read_text() if (tmp_path / "origin" / label).exists() else label
        key = ["--key", "avg"] if kind == "dcp" else []
        inspected = cli("inspect", str(checkpoint), *key)
        assert inspected.returncode == 0 and "ema" in inspected.stdout, inspected.stderr
        if kind == "saved":  # the layouts in words: FSDP2 rows split over the data-parallel ranks
            assert re.search(r"layout +\d+ tensors: dim 0 split in 2 as torch.chunk does", inspected.stdout), (
                inspected.stdout
            )
        for average in ("ema", "swa"):
            out = tmp_path / "exports" / f"{kind}-{label}-{average}"
            done = cli("export", str(checkpoint), str(out), "--average", average, *key)
            assert done.returncode == 0, done.stderr
            got = load_file(str(out / "model.safetensors"))
            want = load_file(str(tmp_path / f"reference-{source}-{average}.safetensors"))
            assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want), (kind, label, average)

    for label in ("fsdp2_tp-4", "pp-4"):  # snapshots written under TP and under PP
        out = tmp_path / "exports" / f"posthoc-{label}"
        done = cli("posthoc", str(tmp_path / f"posthoc-{label}"), str(out), "--sigma-rel", "0.08")
        assert done.returncode == 0, done.stderr
        got = load_file(str(out / "model.safetensors"))
        want = load_file(str(tmp_path / f"posthoc-{label}-in-process" / "model.safetensors"))
        assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want), label
