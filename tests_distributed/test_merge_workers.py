"""``torchrun -m shardavg merge`` across 2 and 4 workers writes what one process writes, byte for
byte; workers that disagree on an input refuse together, writing nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from export_ids import alike
from launcher import Launch, torchrun
from safetensors.torch import save_file

pytestmark = pytest.mark.slow  # a torchrun launch: python -m pytest -m "not slow" leaves it out

SHAPES = {"embed.weight": (300, 64), "blocks.0.up.weight": (256, 64), "blocks.0.norm.weight": (64,),
          "blocks.1.up.weight": (256, 64), "blocks.1.norm.weight": (64,), "head.weight": (1000, 64),
          "step": ()}  # fmt: skip


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    """Three Hugging Face checkpoints (fp32 weights, an integer counter, a config carried along)."""
    root = tmp_path_factory.mktemp("merge-workers")
    for index in range(3):
        folder = root / "inputs" / f"checkpoint-{index + 1}"
        folder.mkdir(parents=True)
        generator = torch.Generator().manual_seed(index)
        tensors = {name: torch.randn(shape, generator=generator) for name, shape in SHAPES.items() if shape}
        save_file(tensors | {"step": torch.tensor(index)}, str(folder / "model.safetensors"))
        (folder / "config.json").write_text('{"model_type": "tiny", "torch_dtype": "float32"}')
    return root


def files(folder: Path) -> dict[str, bytes]:
    """Every file the merge wrote but its provenance (which records the command and the workers),
    its export id made alike (each write has its own)."""
    return alike(folder)


@pytest.mark.parametrize("split", ["5GB", "40KB"])
def test_workers_write_what_one_process_writes(inputs: Path, split: str) -> None:
    paths = [str(p) for p in sorted((inputs / "inputs").iterdir())]
    one = inputs / f"one-{split}"
    args = ["merge", *paths, "--out", str(one), "--max-shard-size", split, "--weights", "1", "2", "3"]
    subprocess.run([sys.executable, "-m", "shardavg", *args], check=True, capture_output=True)
    want = files(one)
    assert (len(want) > 3) == (split == "40KB"), sorted(want)
    for workers in (2, 4):
        out = inputs / f"workers{workers}-{split}"
        launch = torchrun("scenario_merge.py", workers, "cli", str(inputs), *args[1:-6], "--out", str(out),
                          "--max-shard-size", split, "--weights", "1", "2", "3", timeout=300)  # fmt: skip
        assert launch.returncode == 0, launch.output[-20000:]
        assert [r["code"] for r in launch.reports("EXIT")] == [0] * workers, launch.output[-5000:]
        assert launch.output.count("wrote the merge of 3 checkpoints") == 1, "not only the first worker reports"
        got = files(out)
        assert sorted(got) == sorted(want), (sorted(got), sorted(want))
        for name, content in want.items():
            assert got[name] == content, f"{workers} workers: {name} differs from the one-process merge"
        made = json.loads((out / "provenance.json").read_text())
        assert made["world_size"] == workers and made["made"] == "merge", made


@pytest.fixture(scope="module")
def refusals(inputs: Path) -> Launch:
    """One launch in which the workers disagree on the weights, then one names a missing input."""
    return torchrun("scenario_merge.py", 2, "disagree+missing", str(inputs), timeout=120)


@pytest.mark.parametrize("mode", ["disagree", "missing"])
def test_workers_that_disagree_refuse_together(refusals: Launch, mode: str) -> None:
    assert refusals.returncode == 0, refusals.output[-20000:]
    refused = refusals.reports("REFUSED")  # (one report per refusal, from rank 0)
    assert [r for r in refused if r["mode"] == mode] == [{"mode": mode, "world_size": 2}], refusals.output[-5000:]
