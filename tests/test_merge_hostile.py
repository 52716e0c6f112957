"""``shardavg merge`` on inputs that try to reach outside themselves, and on arguments at the edges:
links out of an input folder (refused by name; the Hugging Face cache's links to its blobs
followed), a large carried file (streamed, never held whole), an input's unreadable provenance
(the merge's own written all the same), weights beyond a float's range, one input named twice,
a DCP prefix that is not whole components of the names, and a merge started by a torchrun
worker (alone, never joining its parent's group)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from test_merge import Refusals, listing, read_model

import shardavg
import shardavg.cli
from shardavg.output.record import FolderRecord

SHAPES = {"embed.weight": (8, 4), "norm.weight": (4,)}


def model(folder: Path, seed: int) -> Path:
    """A small Hugging Face model folder: its weights, a config and a tokenizer."""
    folder.mkdir(parents=True)
    generator = torch.Generator().manual_seed(seed)
    save_file({n: torch.randn(s, generator=generator) for n, s in SHAPES.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text('{"model_type": "tiny"}')
    (folder / "tokenizer.json").write_text('{"vocab": {}}')
    return folder


def uniform(folders: list[Path]) -> dict[str, torch.Tensor]:
    """sum(x_i / n) in fp32, in input order (the merge's own arithmetic)."""
    states = [load_file(str(f / "model.safetensors")) for f in folders]
    return {n: sum((s[n] * (1 / len(states)) for s in states[1:]), states[0][n] * (1 / len(states))) for n in SHAPES}


# --------------------------------------------------------------------------- links


@pytest.mark.parametrize(
    "name, target",
    [
        ("tokenizer.json", "/etc/passwd"),  # an absolute link to a system file
        ("modeling_custom.py", str(Path("..") / "private.py")),  # to a private file beside the input
        ("special_tokens_map.json", "../secret"),  # a relative one, up and out
        ("model.safetensors", "../other/model.safetensors"),  # the weights themselves
    ],
)
def test_a_link_out_of_an_input_is_refused_by_name_and_nothing_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture, name: str, target: str
) -> None:
    folder = model(tmp_path / "input", 0)
    model(tmp_path / "other", 1)
    (tmp_path / "private.py").write_text("TOKEN = 'mine'")
    (tmp_path / "secret").write_text("secret")
    (folder / name).unlink(missing_ok=True)
    (folder / name).symlink_to(target)
    real = (folder / name).resolve()
    refused = Refusals(capsys)
    refused(str(folder), "--out", str(tmp_path / "out"), match=f"{folder / name} links to {real}, outside {folder}")
    with pytest.raises(shardavg.CheckpointError, match="shardavg reads and carries only a checkpoint's own files"):
        shardavg.merge([folder], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def hub_snapshot(cache: Path, folder: Path, rev: str = "0123abcd") -> Path:
    """``folder`` moved into a fake Hugging Face cache as ``models--org--NAME``: each file a blob,
    linked from ``snapshots/REV/`` as the hub writes them (``../../blobs/HASH``)."""
    repository = cache / f"models--org--{folder.name}"
    snapshot = repository / "snapshots" / rev
    (repository / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for number, file in enumerate(sorted(folder.iterdir())):
        file.rename(repository / "blobs" / f"{number:040x}")
        (snapshot / file.name).symlink_to(Path("../../blobs") / f"{number:040x}")
    return snapshot


def test_a_hub_snapshot_links_into_its_own_repository_only(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    cache = tmp_path / "hub"
    first = hub_snapshot(cache, model(tmp_path / "a", 0))
    second = hub_snapshot(cache, model(tmp_path / "b", 1))
    out = shardavg.merge([first, second], tmp_path / "out")
    assert torch.equal(read_model(out)["embed.weight"], uniform([first, second])["embed.weight"])
    assert not (out / "tokenizer.json").is_symlink() and (out / "tokenizer.json").read_text() == '{"vocab": {}}'

    nested = cache / "models--org--pipe" / "snapshots" / "feed" / "unet"  # a pipeline's part, a folder deeper
    model(tmp_path / "c", 2).rename(tmp_path / "unet")
    blobs = cache / "models--org--pipe" / "blobs"
    blobs.mkdir(parents=True)
    nested.mkdir(parents=True)
    for file in (tmp_path / "unet").iterdir():
        file.rename(blobs / file.name)
        (nested / file.name).symlink_to(Path("../../../blobs") / file.name)
    assert read_model(shardavg.merge([nested], tmp_path / "unet-out")).keys() == SHAPES.keys()

    stolen = first / "tokenizer.json"  # a link into another repository's blobs: not this input's
    stolen.unlink()
    stolen.symlink_to(Path("../../../models--org--b/blobs") / f"{2:040x}")  # (b's tokenizer.json)
    Refusals(capsys)(str(first), "--out", str(tmp_path / "refused"), match=f"{stolen} links to ")
    with pytest.raises(shardavg.CheckpointError) as refused:
        shardavg.merge([first], tmp_path / "refused")
    assert f"outside {first} or {cache / 'models--org--a' / 'blobs'}:" in str(refused.value)


def test_a_large_carried_file_is_streamed_not_held(tmp_path: Path) -> None:
    """Two inputs with a 64 MiB ``tokenizer.model`` (sparse: no disk is filled): comparing and
    carrying it holds a chunk at a time (the Python heap's peak well under the file's size; it
    was read whole, twice, before)."""
    size = 64 * 2**20
    folders = [model(tmp_path / f"in{i}", i) for i in range(2)]
    for folder in folders:
        with open(folder / "tokenizer.model", "wb") as handle:
            handle.truncate(size)
    tracemalloc.start()
    try:
        out = shardavg.merge(folders, tmp_path / "out")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert (out / "tokenizer.model").stat().st_size == size
    assert peak < 8 * 2**20, f"carrying a {size}-byte file peaked at {peak} bytes"
    with open(out / "tokenizer.model", "rb") as handle:
        assert not any(handle.read(2**20).strip(b"\0") for _ in range(size // 2**20))


# --------------------------------------------------------------------------- provenance


def nested(depth: int) -> str:
    return '{"made": "merge", "shardavg": "0.7", "inputs": [{"path": "x", "provenance": ' * depth + "{}" + "}]}" * depth


@pytest.mark.parametrize("output", ["safetensors", "shardavg"])
def test_an_inputs_unreadable_provenance_leaves_the_merges_own(tmp_path: Path, caplog, output: str) -> None:
    """An input whose ``provenance.json`` is nested 10^5 deep is merged and recorded without it, with
    a warning; the output's provenance is the merge's own, never the input's file."""
    deep = model(tmp_path / "deep", 0)
    (deep / "provenance.json").write_text(nested(10**5))
    plain = model(tmp_path / "plain", 1)
    (plain / "provenance.json").write_text('{"made": "export", "shardavg": "0.7", "by": "plain"}')
    out = shardavg.merge([deep, plain], tmp_path / "out", output=output)
    if output == "shardavg":
        record = json.loads((out / "shardavg.json").read_text())["provenance"]
    else:
        record = json.loads((out / "provenance.json").read_text())
        assert torch.equal(read_model(out)["norm.weight"], uniform([deep, plain])["norm.weight"])
    assert record["made"] == "merge" and [i["path"] for i in record["inputs"]] == [str(deep), str(plain)]
    assert not isinstance(record["inputs"][0].get("provenance"), dict), "the unreadable provenance was recorded"
    assert record["inputs"][1]["provenance"]["by"] == "plain"
    assert [r.levelname for r in caplog.records if str(deep) in r.getMessage()] == ["WARNING"], caplog.text


@pytest.mark.parametrize("depth", [150, 100_000])  # (under Python's recursion limit, and far past it)
def test_a_weights_record_nested_too_deep_is_refused_in_one_line(tmp_path: Path, depth: int) -> None:
    """A model folder whose weights' shardavg record nests 100,000 arrays deep ended the merge in a
    ``RecursionError`` traceback: refused in one line instead, the file named where it is known."""
    deep = tmp_path / "deep"
    deep.mkdir()
    record = "[" * depth + "]" * depth
    save_file({n: torch.zeros(s) for n, s in SHAPES.items()}, str(deep / "model.safetensors"), {"shardavg": record})
    deeper = r"JSON nested more than 100 levels deep \(JSON_DEPTH\)"
    with pytest.raises(shardavg.CheckpointError, match=deeper) as refused:
        shardavg.merge([deep, model(tmp_path / "plain", 1)], tmp_path / "out")
    assert "\n" not in str(refused.value) and not (tmp_path / "out").exists()
    with pytest.raises(shardavg.CheckpointError, match=rf"^the shardavg record in {deep}/model.safetensors: {deeper}"):
        FolderRecord.from_metadata({"shardavg": record}, where=deep / "model.safetensors")


# --------------------------------------------------------------------------- weights, inputs, prefix


def test_weights_beyond_a_floats_range_are_scaled_or_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    folders = [model(tmp_path / f"in{i}", i) for i in range(3)]
    huge = shardavg.merge(folders, tmp_path / "huge", weights=[1e308, 1e308, 1e308])  # their sum overflows
    same = shardavg.merge(folders, tmp_path / "ones", weights=[1, 1, 1])
    assert all(torch.equal(read_model(huge)[n], read_model(same)[n]) for n in SHAPES)
    assert [i["weight"] for i in json.loads((huge / "provenance.json").read_text())["inputs"]] == [1 / 3] * 3
    refused = Refusals(capsys)
    args = [str(f) for f in folders]
    refused(*args, "--raw-weights", "--weights", "1e39", "1", "1", "--out", str(tmp_path / "raw"),
            match="reach beyond float32's range (up to 3.40282e+38), in which the merge accumulates")  # fmt: skip


def test_weights_beyond_a_floats_range_merge_from_the_command_line(tmp_path: Path) -> None:
    folders = [model(tmp_path / f"in{i}", i) for i in range(3)]
    code = shardavg.cli.main(["merge", *map(str, folders), "--weights", "1e308", "1e308", "1e308", "--out",
                              str(tmp_path / "out")])  # fmt: skip
    assert code == 0
    assert torch.equal(read_model(tmp_path / "out")["embed.weight"], uniform(folders)["embed.weight"])


def test_one_input_named_as_its_folder_and_its_weights_is_refused(tmp_path: Path, capsys) -> None:
    folder = model(tmp_path / "in", 0)
    other = model(tmp_path / "other", 1)
    (tmp_path / "alias.safetensors").symlink_to(folder / "model.safetensors")
    refused = Refusals(capsys)
    out = str(tmp_path / "out")
    weights = folder / "model.safetensors"
    refused(str(folder), str(other), str(weights), "--out", out,
            match=f"{folder} and {weights} are one checkpoint (both read {weights})")  # fmt: skip
    refused(str(tmp_path / "alias.safetensors"), str(folder), "--out", out, match="are one checkpoint")
    with pytest.raises(ValueError, match="name it once, and weight an input with weights="):
        shardavg.merge([folder, weights], out)


def test_a_prefix_is_whole_components_of_the_names(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    states = []
    for step in (1, 2):
        generator = torch.Generator().manual_seed(step)
        states.append({"blocks.0.weight": torch.randn(3, 2, generator=generator), "head.bias": torch.randn(3)})
        dcp.save({"model": states[-1], "modelx": {"w": torch.ones(1)}}, checkpoint_id=str(tmp_path / f"step-{step}"),
                 no_dist=True)  # fmt: skip
    paths = [str(tmp_path / f"step-{step}") for step in (1, 2)]
    refused = Refusals(capsys)
    refused(*paths, "--prefix", "mod", "--out", str(tmp_path / "out"), match="holds no model tensor under 'mod.'")
    whole = shardavg.merge(paths, tmp_path / "whole", prefix="model")  # "model" is "model."
    dotted = shardavg.merge(paths, tmp_path / "dotted", prefix="model.")
    assert sorted(read_model(whole)) == ["blocks.0.weight", "head.bias"]
    assert all(torch.equal(read_model(whole)[n], read_model(dotted)[n]) for n in ["blocks.0.weight", "head.bias"])
    assert sorted(read_model(shardavg.merge(paths, tmp_path / "x", prefix="modelx"))) == ["w"]


# --------------------------------------------------------------------------- torchrun's environment


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_merge_run_by_a_torchrun_worker_merges_alone(tmp_path: Path) -> None:
    """A training script's rank 0 (under torchrun, of 2 workers) runs ``shardavg merge``: the command
    inherits RANK=0, WORLD_SIZE=2, MASTER_ADDR/PORT and the run id, and no peer will ever come.
    It merges alone, at once (it hung, or failed to connect, joining its parent's group)."""
    folders = [model(tmp_path / f"in{i}", i) for i in range(2)]
    worker = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0",
              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "TORCHELASTIC_RUN_ID": "none"}  # fmt: skip
    command = [sys.executable, "-m", "shardavg", "merge", *map(str, folders), "--out", str(tmp_path / "out")]
    script = f"import subprocess, sys; sys.exit(subprocess.run({command!r}).returncode)"  # (the worker)
    process = subprocess.Popen([sys.executable, "-c", script], env=os.environ | worker, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    try:
        stdout, stderr = process.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # (the merge too, waiting for a peer)
        process.communicate()
        raise AssertionError("the merge joined its parent's process group and waited for a peer") from None
    assert process.returncode == 0, stderr
    assert "wrote the merge of 2 checkpoints" in stdout, (stdout, stderr)
    assert all(torch.equal(read_model(tmp_path / "out")[n], uniform(folders)[n]) for n in SHAPES)
    assert json.loads((tmp_path / "out" / "provenance.json").read_text())["world_size"] == 1


@pytest.fixture
def parent(monkeypatch: pytest.MonkeyPatch):
    """Make a process of the given environment this process's parent, as ``cli`` sees it."""
    started = []

    def make(env: dict[str, str]) -> None:
        process = subprocess.Popen(["sleep", "60"], env=env)
        started.append(process)
        while not Path(f"/proc/{process.pid}/environ").read_bytes():  # (empty until its exec is done)
            time.sleep(0.01)
        monkeypatch.setattr(shardavg.cli.os, "getppid", lambda: process.pid)

    yield make
    for process in started:
        process.kill()
        process.wait()


def test_only_a_process_torchrun_started_joins_its_group(monkeypatch: pytest.MonkeyPatch, parent) -> None:
    from shardavg.cli import _started_by_torchrun

    worker = {"RANK": "1", "WORLD_SIZE": "4", "TORCHELASTIC_RUN_ID": "run-7"}
    for name in ("TORCHELASTIC_RUN_ID", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "1")
    assert not _started_by_torchrun()  # RANK alone: set by hand or by another launcher; --collective asks
    for name, value in worker.items():
        monkeypatch.setenv(name, value)
    parent({"PATH": os.environ["PATH"]})  # torchrun's agent: it sets the run id for its workers only
    assert _started_by_torchrun()
    parent({"PATH": os.environ["PATH"], "TORCHELASTIC_RUN_ID": "outer"})  # a torchrun started inside a worker
    assert _started_by_torchrun()
    parent({"PATH": os.environ["PATH"], **worker})  # a worker: this process inherited its variables
    assert not _started_by_torchrun()
    monkeypatch.setenv("WORLD_SIZE", "1")
    parent({"PATH": os.environ["PATH"]})
    assert not _started_by_torchrun()  # one worker: nothing to split


def test_collective_needs_a_launchs_variables(tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    folder = model(tmp_path / "in", 0)
    Refusals(capsys)(str(folder), "--collective", "--out", str(tmp_path / "out"),
                     match="--collective joins the writers of a launch, but RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT "
                     "not set")  # fmt: skip
    assert listing(tmp_path / "out") is None
