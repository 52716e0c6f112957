"""Checkpoints, resharding, resume, export and faults under torchrun (CPU, gloo).

Each launch runs every engine in turn, so a world size costs one launch per phase.
"""

from __future__ import annotations

import functools
import json
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from launcher import HERE, ZERO, Launch, torchrun
from safetensors.torch import load_file

pytestmark = pytest.mark.slow  # a torchrun launch: python -m pytest -m "not slow" leaves it out

ENGINES = ["replicated", "fsdp2", "fsdp1", "zero3"]
SCRIPT = "scenario_checkpoint.py"


def run_ok(mode: str, world_size: int, root: Path, engines: str = "all", timeout: float = 420):
    """Launch MODE (several modes joined by "+" run in turn in the launch) for ENGINES; every one done."""
    zero = engines == "all" or "zero3" in engines.split(",")
    launch = torchrun(SCRIPT, world_size, mode, engines, str(root), timeout=timeout, preload=ZERO if zero else ())
    assert launch.returncode == 0, launch.output[-20000:]
    done = {(r["mode"], r["engine"]) for r in launch.reports("DONE")}
    expected = ENGINES if engines == "all" else engines.split(",")
    assert done == {(m, e) for m in mode.split("+") for e in expected}, launch.output[-5000:]
    return launch


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """Checkpoints of every engine at world sizes 2 and 4 (both forms), with exports and references;
    and the first launch of the resume check at 1, 2 and 4, riding along where a launch is made
    anyway (a launch costs more than a mode)."""
    root = tmp_path_factory.mktemp("checkpoints")
    for world_size in (2, 4):
        run_ok("save+resume-first", world_size, root)
    run_ok("resume-first", 1, root)
    assert len(list((root / "saved").iterdir())) == 2 * len(ENGINES)
    return root


@pytest.fixture(scope="module")
def loaded(saved: Path) -> Callable[[int], Launch]:
    """The launch at a world size that loads every saved checkpoint, then resumes every engine from
    the checkpoint its first resume launch wrote at that world size; made once."""
    return functools.cache(lambda world_size: run_ok("load+resume-second", world_size, saved))


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_every_checkpoint_loads_at_any_world_size_under_any_strategy(saved: Path, loaded, world_size: int) -> None:
    launch = loaded(world_size)
    found = {(r["source"], r["how"], r["into"]) for r in launch.reports("LOADED")}
    sources = [p.name for p in (saved / "saved").iterdir()]
    assert found == {(s, how, e) for s in sources for how in ("avg", "dcp") for e in ENGINES}


VERIFY_EXPORT = """
import json, sys
from pathlib import Path
import torch
from safetensors.torch import load_file
sys.path.insert(0, {harness!r})
from harness import TiedNet


for source in sorted(Path({saved!r}).iterdir()):
    for export in ("export", "export-sharded"):
        folder = source / export
        index = folder / "model.safetensors.index.json"
        files = ["model.safetensors"]
        if index.exists():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        state = {{}}
        for name in files:
            state.update(load_file(str(folder / name)))
        model = TiedNet()
        model.load_state_dict(state, strict=True)
        reference = load_file(str(source / "reference.safetensors"))
        assert set(state) == set(reference), (source.name, set(state) ^ set(reference))
        assert all(torch.equal(state[k], reference[k]) for k in reference), (source.name, export)
        print(source.name, export, len(files), "file(s)")
assert not any(m.startswith("shardavg") for m in sys.modules), "shardavg was imported"
"""


def test_ranks_load_one_save_whole_while_another_process_saves_there(tmp_path: Path) -> None:
    """A process saves into the checkpoint every few milliseconds while two FSDP2 ranks load it
    again and again: every load is one save, the same on both ranks."""
    launch = run_ok("concurrent", 2, tmp_path, engines="fsdp2")
    assert [r["engine"] for r in launch.reports("CONCURRENT")] == ["fsdp2"]


def test_exports_load_strictly_in_a_process_without_shardavg(saved: Path) -> None:
    """Every engine's exports at 2 and 4 ranks, in one fresh process that never imports shardavg."""
    script = VERIFY_EXPORT.format(harness=str(HERE), saved=str(saved / "saved"))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    printed = dict((line.rsplit(" ", 2)[0], int(line.split()[2])) for line in result.stdout.splitlines())
    sources = sorted(p.name for p in (saved / "saved").iterdir())
    assert sorted(printed) == sorted(f"{s} {e}" for s in sources for e in ("export", "export-sharded")), printed
    for source in sources:
        assert printed[f"{source} export"] == 1, printed
        assert printed[f"{source} export-sharded"] > 1, f"{source}: the sharded export has one file"


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_resume_is_bitwise_an_uninterrupted_run(loaded, world_size: int) -> None:
    """Each engine checkpointed model, optimizer and average at step k in one launch and went on
    to 2k; a new launch restores it and ends bitwise where the first did."""
    launch = loaded(world_size)
    assert {r["engine"] for r in launch.reports("RESUMED")} == set(ENGINES)


def test_a_rank_killed_during_save_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    from harness import TiedNet

    from shardavg import EMA, SWA, CheckpointError, WeightAverager

    launch = torchrun(SCRIPT, 2, "kill", "fsdp2", str(tmp_path), timeout=180, forked=False)
    assert launch.returncode != 0
    assert f"Signal {int(signal.SIGKILL)} (SIGKILL)" in launch.output, launch.output[-5000:]
    parent = tmp_path / "killed"
    assert sorted(p.name for p in parent.iterdir() if p.is_dir()) == [".step-000000010.incomplete", "step-000000004"]

    torch.manual_seed(0)
    averager = WeightAverager(TiedNet(), {"ema": EMA(decay=0.9), "swa": SWA()})
    assert averager.load(parent) == parent / "step-000000004"
    counters = json.loads((parent / "counters.json").read_text())
    assert (averager.step, averager.num_updates) == (counters["step"], counters["num_updates"])
    for name, file in (("ema", "reference.safetensors"), ("swa", "reference-swa.safetensors")):
        reference = load_file(str(parent / file))
        got = averager.full_state_dict(name)
        assert all(torch.equal(got[k], reference[k]) for k in reference), name
    with pytest.raises(CheckpointError, match=r"save never completed"):
        averager.load(parent / ".step-000000010.incomplete")


def test_a_rank_killed_during_export_leaves_the_previous_export(tmp_path: Path) -> None:
    """Every rank writes part of the export; rank 1 dies after writing one tensor of the second
    one: the folder still holds the first export, byte for byte (its files and index; rank 0, its
    collective broken, removes the temporary files), and the next export into it succeeds and
    leaves nothing temporary."""
    launch = torchrun(SCRIPT, 2, "kill-export", "fsdp2", str(tmp_path), timeout=180, forked=False)
    assert launch.returncode != 0
    assert f"Signal {int(signal.SIGKILL)} (SIGKILL)" in launch.output, launch.output[-5000:]
    folder = tmp_path / "export"
    final = sorted(p.name for p in folder.iterdir() if not p.name.startswith(".") and p.name != "provenance.json")
    assert "model.safetensors.index.json" in final and len(final) > 2, final
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(final) - {"model.safetensors.index.json"}
    reference = load_file(str(folder.parent / "killed-export-reference.safetensors"))
    exported = {}
    for name in final[:-1]:
        exported |= load_file(str(folder / name))
    assert set(exported) >= set(reference) and all(torch.equal(exported[k], reference[k]) for k in reference)
    run_ok("export-again", 2, tmp_path, engines="fsdp2")
    assert not [p.name for p in folder.iterdir() if p.name.startswith(".")], sorted(p.name for p in folder.iterdir())


def test_ranks_that_name_different_export_folders_refuse_together(tmp_path: Path) -> None:
    run_ok("export-apart", 2, tmp_path, engines="fsdp2")
    assert not list(tmp_path.glob("apart-*"))


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_export_holds_one_bucket_on_rank_zero(tmp_path: Path, world_size: int) -> None:
    launch = run_ok("export-memory", world_size, tmp_path, engines="replicated,fsdp2")
    peaks = launch.reports("EXPORT_PEAK")
    assert len(peaks) == 4
    for peak in peaks:
        assert peak["peak_bytes"] <= max(peak["bucket_bytes"], peak["largest_tensor_bytes"]) + 4096, peak
        assert peak["model_bytes"] >= 10 * peak["peak_bytes"], peak


def test_a_checkpoint_of_four_ranks_merges_with_one_of_two_offline(saved: Path, tmp_path: Path) -> None:
    """``shardavg merge`` of an FSDP2 checkpoint written at 4 ranks and a ZeRO-3 averager inside a
    DCP checkpoint written at 2, weighted 1:3, in one process: the fp32 weighted sum of their
    references, bitwise, as a model folder and as a checkpoint that loads whole."""
    import shardavg
    from shardavg.offline.saved_average import SavedAverage

    inputs = [saved / "saved" / "fsdp2-ws4" / "avg", saved / "saved" / "zero3-ws2" / "dcp"]
    references = [load_file(str(p.parent / "reference.safetensors")) for p in inputs]
    want = {
        name: references[0][name].float().mul(0.25).add_(references[1][name].float().mul(0.75))
        if value.is_floating_point()
        else references[1][name]
        for name, value in references[0].items()
    }
    out = shardavg.merge(inputs, tmp_path / "model", weights=[1, 3], key="ema", average="ema")
    got = load_file(str(out / "model.safetensors"))
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want), set(got) ^ set(want)
    checkpoint = shardavg.merge(inputs, tmp_path / "ckpt", weights=[1, 3], key="ema", average="ema", output="shardavg")
    merged = SavedAverage(checkpoint)
    try:
        assert merged.description.num_updates == 2
        assert all(torch.equal(merged.read(k).view(want[k].shape), want[k]) for k in want)
    finally:
        merged.close()


def test_rows_of_a_tensor_read_from_sharded_checkpoints_are_those_of_the_whole(saved: Path, tmp_path: Path) -> None:
    """What a merge worker reads of a tensor split between workers: its rows, from an FSDP2
    ``avg.save`` of 4 ranks (row shards), a ZeRO-3 averager inside DCP of 2 ranks (flat ranges)
    and a Hugging Face export; each range is what the whole tensor holds there, bitwise."""
    import shardavg
    from shardavg.offline.sources import open_source

    fsdp2 = saved / "saved" / "fsdp2-ws4" / "avg"
    model = shardavg.merge(fsdp2, tmp_path / "model", average="ema", max_shard_size="20KB")
    for path, options in [
        (fsdp2, {"average": "ema"}),
        (saved / "saved" / "zero3-ws2" / "dcp", {"key": "ema", "average": "ema"}),
        (model, {}),
    ]:
        source = open_source(path, **options)
        try:
            checked = 0
            for name, spec in source.specs.items():
                if len(spec.shape) and spec.shape[0] >= 3:
                    whole, rows = source.read(name), spec.shape[0]
                    for start, stop in [(0, 1), (1, rows - 1), (rows // 2, rows), (rows - 1, rows)]:
                        assert torch.equal(source.read(name, (start, stop)), whole[start:stop]), (path, name, start)
                    checked += 1
            assert checked >= 3, (path, source.specs)
        finally:
            source.close()
