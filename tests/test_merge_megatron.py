"""``shardavg merge`` on Megatron-Core ``torch_dist`` checkpoints, built here as ``dist_checkpointing.save``
lays them out (without Megatron): flat keys, layer stacks ``[L, ...]`` stored in chunks by layer and
tensor-parallel offset, the optimizer under ``optimizer.state.*``, pickled objects as bytes entries, the
ranks' save plans in DCP's metadata (``all_local_plans``), ``metadata.json`` and ``common.pt`` beside it,
``iter_NNNNNNN`` folders and ``latest_checkpointed_iteration.txt``; and saved by a live Megatron-Core run
(megatron-core, from the ``test`` extra, in a gloo group of one) with its averager beside the model, as
docs/megatron.md shows, then resumed from the merge."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import pickle
import queue
import re
import tracemalloc
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from helpers import Payload
from test_merge import Refusals, read_model
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

import shardavg
import shardavg.cli
from shardavg.offline import megatron
from shardavg.offline.saved_average import DcpFolder
from shardavg.output import dcp_checkpoint
from shardavg.output.megatron_run import TRACKER

LAYERS = 3


def model(seed: int) -> dict[str, torch.Tensor]:
    """A GPT's tensors as Megatron-Core names them: the layers stacked ``[L, ...]``."""
    g = torch.Generator().manual_seed(seed)
    return {
        "embedding.word_embeddings.weight": torch.randn(8, 4, generator=g),
        "decoder.layers.self_attention.linear_qkv.weight": torch.randn(LAYERS, 6, 4, generator=g),
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight": torch.randn(LAYERS, 4, generator=g),
        "decoder.layers.mlp.linear_fc2.weight": torch.randn(LAYERS, 4, 8, generator=g).to(torch.bfloat16),
        "decoder.final_layernorm.weight": torch.randn(4, generator=g),
    }


def chunks(name: str, tensor: torch.Tensor, tp: int) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """``(offsets, chunk)`` as ``tp`` ranks save it: a stack by layer (``decoder.layers.``, after an averager's
    prefix too) and, within a layer, by its tensor-parallel offset along its first dim; a replicated vector whole."""
    if tensor.dim() == 1:
        return [((0,), tensor)]
    if "decoder.layers." not in name:
        rows = tensor.shape[0] // tp
        return [((r * rows, 0), tensor[r * rows : (r + 1) * rows]) for r in range(tp)]
    found = []
    for layer in range(tensor.shape[0]):
        if tensor.dim() == 2:
            found.append(((layer, 0), tensor[layer : layer + 1]))
            continue
        rows = tensor.shape[1] // tp
        for r in range(tp):
            found.append(((layer, r * rows, 0), tensor[layer : layer + 1, r * rows : (r + 1) * rows]))
    return found


def megatron_save(
    folder: Path, tensors: dict[str, torch.Tensor], marker: Path, tp: int, extra: dict[str, bytes] | None = None
) -> None:
    """``folder`` as ``dist_checkpointing.save`` writes it with the torch_dist backend at ``tp`` ranks;
    ``extra``: more pickled objects (``{key: bytes}``), Transformer Engine's ``*._extra_state`` of other layers."""
    pieces, where = {}, {}
    for name, tensor in tensors.items():
        for offsets, chunk in chunks(name, tensor, tp):
            pieces[f"piece{len(pieces)}"] = chunk.clone()
            where[f"piece{len(pieces) - 1}"] = (name, offsets)
    optimizer = {
        f"optimizer.state.{k}.{n}": t.float() * 0.5 for n, t in tensors.items() for k in ("exp_avg", "fp32_param")
    }
    evil = pickle.dumps(Payload(marker))
    objects = {
        "rng_state/shard_0.0_1.2": io.BytesIO(evil),
        "rng_state/shard_0.1_1.2": io.BytesIO(evil),
        "common_state": io.BytesIO(evil),
        "decoder.layers.self_attention.linear_proj._extra_state/shard_0_3": io.BytesIO(evil),
        "optimizer.param_groups/shard_0_1": io.BytesIO(evil),
    } | {key: io.BytesIO(data) for key, data in (extra or {}).items()}
    dcp.save(pieces | optimizer | objects, checkpoint_id=str(folder), no_dist=True)
    with open(folder / ".metadata", "rb") as handle:
        metadata = pickle.load(handle)  # (our own, just written)
    entries, storage = metadata.state_dict_metadata, metadata.storage_data
    plans: list[list[WriteItem]] = [[] for _ in range(tp)]
    for piece, (name, offsets) in where.items():
        stored = entries.pop(piece)
        tensor = tensors[name]
        chunk = ChunkStorageMetadata(torch.Size(offsets), stored.size)
        entry = entries.setdefault(name, TensorStorageMetadata(TensorProperties(tensor.dtype), tensor.shape, []))
        entry.chunks.append(chunk)
        storage[MetadataIndex(name, offsets)] = storage.pop(MetadataIndex(piece, (0,) * tensor.dim()))
        data = TensorWriteData(chunk=chunk, properties=TensorProperties(tensor.dtype), size=tensor.shape)
        plans[len(entry.chunks) % tp].append(
            WriteItem(MetadataIndex(name, offsets), WriteItemType.SHARD, tensor_data=data)
        )
    metadata.planner_data = {}  # (Megatron flattens the state dict itself: DCP records no nesting)
    metadata.all_local_plans = [SavePlan(items, planner_data={}) for items in plans]
    metadata.mcore_data = {}
    with open(folder / ".metadata", "wb") as handle:
        pickle.dump(metadata, handle)
    (folder / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1}))
    (folder / "common.pt").write_bytes(evil)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A Megatron-LM run folder: iterations 100, 200, 300 finished, 400 written after the tracker (in flight),
    saved at TP1 and TP2 in turn (a run resumed at another layout)."""
    root = tmp_path_factory.mktemp("megatron")
    for seed, step in enumerate((100, 200, 300, 400)):
        megatron_save(root / f"iter_{step:07d}", model(seed), root / "unpickled", tp=1 + seed % 2)
    (root / "latest_checkpointed_iteration.txt").write_text("300")
    return root


def numpy_mean(states: list[dict[str, torch.Tensor]], shares: list[float]) -> dict[str, np.ndarray]:
    """sum(w_i * x_i) in fp32, input order, by numpy; the output in the inputs' dtype."""
    out = {}
    for name in states[0]:
        total = np.zeros(states[0][name].shape, dtype=np.float32)
        for state, share in zip(states, shares):
            total = total + state[name].float().numpy() * np.float32(share)
        out[name] = total
    return out


def assert_matches(got: dict[str, torch.Tensor], want: dict[str, np.ndarray], dtypes: dict[str, torch.dtype]) -> None:
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert got[name].dtype == dtypes[name], name
        expected = torch.from_numpy(value).to(dtypes[name])
        assert torch.equal(got[name], expected), (name, (got[name].float() - expected.float()).abs().max())


def test_a_torch_dist_checkpoint_merges_exactly_and_leaves_its_training_state_unread(
    run: Path, tmp_path, caplog
) -> None:
    caplog.set_level(logging.INFO, logger="shardavg")
    out = shardavg.merge(run, tmp_path / "out", last=2)  # iterations 200 and 300: 400 is past the tracker
    dtypes = {name: t.dtype for name, t in model(0).items()}
    assert_matches(read_model(out), numpy_mean([model(1), model(2)], [0.5, 0.5]), dtypes)
    assert not (run / "unpickled").exists()  # no object, common.pt included, was unpickled
    said = caplog.text
    assert (
        "merged its 5 model tensors; left out 1 under '*._extra_state', 1 under 'common.pt', 1 under 'common_state', "
        "11 under 'optimizer', 2 under 'rng_state'" in said
    ), said


def test_ema_weights_follow_the_iterations(run: Path, tmp_path) -> None:
    out = shardavg.merge(run, tmp_path / "out", last=3, ema=0.99)
    weights = [0.99**200, 0.99**100, 0.99**0]
    shares = [w / math.fsum(weights) for w in weights]
    dtypes = {name: t.dtype for name, t in model(0).items()}
    assert_matches(read_model(out), numpy_mean([model(0), model(1), model(2)], shares), dtypes)


def test_iterations_are_steps_and_an_unfinished_one_is_left_out(run: Path) -> None:
    from shardavg.offline.sources import finished_checkpoints

    assert [step for step, _ in finished_checkpoints(run)] == [100, 200, 300]


def test_other_plan_globals_are_still_refused(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    dcp.save({"w": torch.ones(2)}, checkpoint_id=str(folder), no_dist=True)
    with open(folder / ".metadata", "rb") as handle:
        metadata = pickle.load(handle)
    from torch.distributed.checkpoint.planner import LoadPlan

    metadata.all_local_plans = [LoadPlan([])]
    with open(folder / ".metadata", "wb") as handle:
        pickle.dump(metadata, handle)
    with pytest.raises(shardavg.CheckpointError, match="asks to load torch.distributed.checkpoint.planner.LoadPlan"):
        shardavg.merge([folder], tmp_path / "out")


def test_a_run_folder_and_the_legacy_format_are_refused_naming_what_works(run: Path, tmp_path: Path) -> None:
    with pytest.raises(shardavg.CheckpointError, match="is a Megatron-LM run folder of several checkpoints: merge"):
        shardavg.merge([run], tmp_path / "out")
    legacy = tmp_path / "legacy" / "iter_0000100"
    (legacy / "mp_rank_00").mkdir(parents=True)
    (legacy / "mp_rank_00" / "model_optim_rng.pt").write_bytes(pickle.dumps(Payload(tmp_path / "unpickled")))
    with pytest.raises(shardavg.CheckpointError) as refused:
        shardavg.merge([legacy], tmp_path / "out")
    message = str(refused.value)
    assert "in its legacy torch format (mp_rank_00/model_optim_rng.pt" in message and "\n" not in message
    assert f"--load {legacy.parent} --ckpt-convert-format torch_dist --ckpt-convert-save OUT" in message
    assert not (tmp_path / "unpickled").exists()


EXTRA = "decoder.layers.self_attention.linear_proj._extra_state/shard_0_3"  # (an object megatron_save writes)


def two_iterations(root: Path, extra: dict[str, bytes] | None = None) -> list[Path]:
    """``iter_0000010`` and ``iter_0000030`` of a run in ``root``, the newest with ``extra`` objects."""
    folders = [root / "iter_0000010", root / "iter_0000030"]
    for seed, folder in enumerate(folders):
        megatron_save(folder, model(seed), root / "unpickled", tp=1, extra=extra if seed else None)
    return folders


@pytest.mark.parametrize("name", ["common.pt", "metadata.json"])
def test_a_carried_file_linked_out_of_the_input_is_refused_by_name_before_anything_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture, name: str
) -> None:
    """``common.pt -> /etc/passwd`` (a file outside, here) was copied into OUT; ``metadata.json`` too."""
    older, newest = two_iterations(tmp_path / "run")
    outside = tmp_path / "outside.json"
    outside.write_bytes((newest / name).read_bytes())  # (metadata.json: still Megatron's, read through the link)
    (newest / name).unlink()
    (newest / name).symlink_to(outside)
    out = tmp_path / "out"
    refused = Refusals(capsys)
    refused(str(older), str(newest), "--format", "dcp", "--out", str(out), match=f"{newest / name} links to {outside}")
    with pytest.raises(shardavg.CheckpointError, match="shardavg reads and carries only a checkpoint's own files"):
        shardavg.merge([older, newest], out, output="dcp")
    assert not out.exists()


def aliased(folder: Path, count: int) -> list[str]:
    """``count`` more ``*._extra_state`` entries in ``folder``'s ``.metadata``, each pointing at the
    bytes of the one megatron_save stored (a crafted metadata: N entries, one range of bytes)."""
    with open(folder / ".metadata", "rb") as handle:
        metadata = pickle.load(handle)  # (our own, just written)
    keys = [f"decoder.layers.{n}.mlp._extra_state/shard_0_1" for n in range(count)]
    for key in keys:
        metadata.state_dict_metadata[key] = BytesStorageMetadata()
        metadata.storage_data[MetadataIndex(key)] = metadata.storage_data[MetadataIndex(EXTRA)]
    with open(folder / ".metadata", "wb") as handle:
        pickle.dump(metadata, handle)
    return keys


def test_carried_objects_that_alias_one_range_of_bytes_are_refused_naming_both(tmp_path: Path) -> None:
    """24 entries pointing at one 64 MiB range were each read into memory and written again (N x 64 MiB)."""
    inputs = two_iterations(tmp_path)
    keys = aliased(inputs[-1], 3)
    with pytest.raises(shardavg.CheckpointError) as refused:
        shardavg.merge(inputs, tmp_path / "out", output="dcp")
    message = str(refused.value)
    assert "are stored in the same bytes" in message and "\n" not in message, message
    named = [key for key in [EXTRA, *keys] if repr(key) in message]
    assert len(named) == 2, message  # (both of one overlapping pair)
    assert not (tmp_path / "out").exists()


def test_carried_objects_are_copied_a_piece_at_a_time_never_held(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four 8 MiB ``*._extra_state`` objects carried: the Python heap grows by less than one of them
    while the merge finds and writes them (each was read whole into a list before any was written:
    32 MiB). Measured over those two steps alone, whatever reading the inputs costs."""
    size = 8 * 2**20
    extra = {f"decoder.layers.{n}.mlp._extra_state/shard_0_1": bytes([n + 1]) * size for n in range(4)}
    inputs = two_iterations(tmp_path, extra)
    grown: dict[str, int] = {}

    def measured(module, name: str) -> None:
        original = getattr(module, name)

        def call(*args, **kwargs):
            before = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            try:
                return original(*args, **kwargs)
            finally:
                grown[name] = tracemalloc.get_traced_memory()[1] - before

        monkeypatch.setattr(module, name, call)

    measured(megatron, "carried")
    measured(dcp_checkpoint, "write_part")
    tracemalloc.start()
    try:
        out = shardavg.merge(inputs, tmp_path / "out", output="dcp")
    finally:
        tracemalloc.stop()
    assert sorted(grown) == ["carried", "write_part"] and max(grown.values()) < size, grown
    for key in extra:
        assert stored(out, key, 2 * size) == stored(inputs[-1], key, 2 * size), key  # (byte for byte)


def stored(folder: Path, key: str, limit: int) -> bytes:
    """An object's bytes as DCP stored them in ``folder`` (never unpickled)."""
    file, start, length = DcpFolder(folder).location(key, None, limit)
    with open(file, "rb") as handle:
        handle.seek(start)
        return handle.read(length)


@pytest.mark.parametrize("text", ["\u00b2", "9" * 5000, "300 # the newest", "\xff"])
def test_a_tracker_that_holds_no_iteration_is_refused_in_one_line_naming_it(tmp_path: Path, text: str) -> None:
    """``²`` (``str.isdigit`` says it is a digit) and 5,000 digits gave int()'s bare ValueError."""
    two_iterations(tmp_path)
    tracker = tmp_path / "latest_checkpointed_iteration.txt"
    tracker.write_bytes(text.encode("latin-1") if text == "\xff" else text.encode())
    with pytest.raises(shardavg.CheckpointError) as refused:
        shardavg.merge(tmp_path, tmp_path / "out", last=1)
    message = str(refused.value)
    assert message.startswith(f"{tracker} holds no iteration") and "\n" not in message, message
    assert "or remove it" in message


def test_a_step_folder_linked_out_of_its_run_is_refused(tmp_path: Path) -> None:
    """A run's ``iter_*`` linked to another run's checkpoint was merged as the run's own."""
    run = tmp_path / "run"
    older, newest = two_iterations(run)
    elsewhere = tmp_path / "elsewhere" / "iter_0000030"
    elsewhere.parent.mkdir()
    newest.rename(elsewhere)
    newest.symlink_to(elsewhere)
    with pytest.raises(shardavg.CheckpointError, match=f"{newest} links to {elsewhere}, outside {run}"):
        shardavg.merge(run, tmp_path / "out", last=2)
    assert not (tmp_path / "out").exists()
    newest.unlink()
    newest.symlink_to(older.name)  # (a link within the run: the same checkpoint twice, refused as such)
    with pytest.raises(ValueError, match="are one checkpoint"):
        shardavg.merge(run, tmp_path / "out", last=2)


def megatron_lm_tracked(run: Path) -> Path:
    """The checkpoint Megatron-LM's ``--load run`` finds, by its own rules (``get_checkpoint_tracker_filename``,
    ``read_metadata``, ``get_checkpoint_name``): the tracker's stripped text parsed as an int above 0, or
    ``release``; then ``iter_`` and the iteration in at least 7 digits."""
    text = (run / "latest_checkpointed_iteration.txt").read_text().strip()
    try:
        iteration, release = int(text), False
    except ValueError:
        iteration, release = 0, text == "release"
    assert iteration > 0 or release, f"Megatron-LM refuses the tracker {text!r}"
    return run / ("release" if release else f"iter_{iteration:07d}")


def benign_run(root: Path, steps: tuple[int, ...] = (100, 200, 300)) -> list[Path]:
    """Iterations of a run whose ``common.pt`` Megatron's load reads (``torch.load``, weights only): its
    common state as ``dist_checkpointing.save`` keeps it, the iteration among it; a tracker naming the newest."""
    folders = [root / f"iter_{step:07d}" for step in steps]
    for seed, (folder, step) in enumerate(zip(folders, steps)):
        megatron_save(folder, model(seed), root / "unpickled", tp=1 + seed % 2)
        torch.save({"iteration": step, "checkpoint_version": 3.0}, folder / "common.pt")
    (root / "latest_checkpointed_iteration.txt").write_text(str(steps[-1]))
    return folders


def megatron_load(folder: Path) -> dict:
    """``folder`` as Megatron-Core's own ``dist_checkpointing.load`` reads it into whole tensors (one process,
    a gloo group of one, which its load asks for)."""
    pytest.importorskip("megatron.core")
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    wanted = {
        name: ShardedTensor.from_rank_offsets(name, torch.empty(t.shape, dtype=t.dtype), replica_id=0)
        for name, t in model(0).items()
    }
    dist.init_process_group("gloo", store=dist.FileStore(str(folder.parent / ".store"), 1), rank=0, world_size=1)
    try:
        assert dist_checkpointing.check_is_distributed_checkpoint(str(folder))
        return dist_checkpointing.load(wanted, str(folder))
    finally:
        dist.destroy_process_group()
        (folder.parent / ".store").unlink(missing_ok=True)


def test_a_dcp_merge_is_a_megatron_lm_run_that_its_load_finds_and_dist_checkpointing_reads_exactly(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """``--load OUT`` found no tracker in a merge written as one DCP folder, warned, and trained from random
    weights; now OUT is a run: ``iter_NNNNNNN`` (the newest input's iteration) and the tracker naming it."""
    run = tmp_path / "run"
    inputs = benign_run(run)
    out = tmp_path / "merged"
    written = shardavg.merge(run, out, last=2, weights=[1, 3], output="dcp")
    assert written == out / "iter_0000300" == megatron_lm_tracked(out)
    assert sorted(p.name for p in out.iterdir()) == ["iter_0000300", "latest_checkpointed_iteration.txt"]
    assert (out / "latest_checkpointed_iteration.txt").read_text() == "300"  # (as Megatron-LM writes it)
    loaded = megatron_load(written)
    mean = numpy_mean([model(1), model(2)], [0.25, 0.75])
    dtypes = {name: t.dtype for name, t in model(0).items()}
    assert_matches({name: loaded[name] for name in mean}, mean, dtypes)
    assert loaded["iteration"] == 300  # (the newest input's common state, carried byte for byte)
    assert not (run / "unpickled").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged", "run"]  # no lock, no staging left
    args = [str(inputs[0]), str(inputs[1]), "--out", str(out), "--format", "dcp", "--iteration", "1000", "--quiet"]
    assert shardavg.cli.main(["merge", *args]) == 0  # a re-merge at another iteration replaces the earlier one
    said = capsys.readouterr().out
    assert f"to {out / 'iter_0001000'}, which latest_checkpointed_iteration.txt names" in said, said
    assert f"--load {out} --no-load-optim --no-load-rng" in said, said
    assert megatron_lm_tracked(out) == out / "iter_0001000"
    assert sorted(p.name for p in out.iterdir()) == ["iter_0001000", "latest_checkpointed_iteration.txt"]
    mean = numpy_mean([model(0), model(1)], [0.5, 0.5])
    loaded = megatron_load(out / "iter_0001000")
    assert_matches({name: loaded[name] for name in mean}, mean, dtypes)


def test_the_tracker_is_written_last_a_failure_leaving_the_earlier_merge_tracked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    inputs = benign_run(tmp_path / "run")
    out = tmp_path / "merged"
    shardavg.merge(inputs[:2], out, output="dcp")  # iteration 200
    before = {p.relative_to(out): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    monkeypatch.setattr(dcp_checkpoint, "swap", lambda out: (_ for _ in ()).throw(OSError("disk gone")))
    with pytest.raises(OSError, match="disk gone"):  # the iteration never committed: nothing changed
        shardavg.merge(inputs, out, output="dcp")
    assert {p.relative_to(out): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()} == before
    monkeypatch.undo()
    from shardavg.output import megatron_run

    def tracker_fails(path: Path):
        raise OSError("No space left on device")

    monkeypatch.setattr(megatron_run, "atomic_file", tracker_fails)
    with pytest.raises(OSError, match="No space left on device"):  # committed, but not yet tracked
        shardavg.merge(inputs, out, output="dcp")
    assert megatron_lm_tracked(out) == out / "iter_0000200"  # --load still finds the earlier merge, whole
    assert sorted(p.name for p in out.iterdir()) == [
        "iter_0000200",
        "iter_0000300",
        "latest_checkpointed_iteration.txt",
    ]
    monkeypatch.undo()
    killed = out / ".iter_0000050.incomplete"  # (what a merge of another iteration, killed, left)
    killed.mkdir()
    (killed / ".shardavg-staging").write_text("a killed merge's token")
    shardavg.merge(inputs, out, output="dcp")  # the next merge takes over the untracked iteration and the rest
    assert megatron_lm_tracked(out) == out / "iter_0000300"
    assert sorted(p.name for p in out.iterdir()) == ["iter_0000300", "latest_checkpointed_iteration.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged", "run"]


def test_a_megatron_lm_run_as_out_is_refused_and_left_as_it_was(tmp_path: Path) -> None:
    """A merge into a training run's folder would become the iteration its next restart resumes from."""
    run = tmp_path / "run"
    inputs = benign_run(run)
    before = {p: p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}
    other = tmp_path / "other"
    benign_run(other, (400,))
    with pytest.raises(shardavg.CheckpointError) as refused:
        shardavg.merge(inputs, other, output="dcp")
    message = str(refused.value)
    assert f"OUT {other} holds a Megatron-LM run (iter_0000400) that shardavg's merge did not write" in message
    assert "--load OUT --no-load-optim --no-load-rng" in message and "\n" not in message, message
    with pytest.raises(shardavg.CheckpointError, match="lie one inside the other"):  # (the inputs' own run)
        shardavg.merge(inputs, run, output="dcp")
    assert {p: p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()} == before
    out = tmp_path / "merged"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(shardavg.CheckpointError, match=r"holds files a merge into a Megatron-LM run folder did not"):
        shardavg.merge(inputs, out, output="dcp")
    (out / "notes.txt").unlink()
    (out / "latest_checkpointed_iteration.txt").write_text("100")  # (a tracker alone: a run's, not a merge's)
    with pytest.raises(shardavg.CheckpointError, match=r"holds a Megatron-LM run \(latest_checkpointed_iteration"):
        shardavg.merge(inputs, out, output="dcp")


def test_the_iteration_is_megatrons_own_and_only_a_megatron_merge_takes_one(tmp_path: Path) -> None:
    inputs = benign_run(tmp_path / "run", (100, 200))
    for wrong, refusal in ((0, "iteration must be"), (True, "iteration must be"), (10**18, "at most")):
        with pytest.raises(ValueError, match=refusal):
            shardavg.merge(inputs, tmp_path / "out", output="dcp", iteration=wrong)
    with pytest.raises(ValueError, match="only a merge of Megatron-Core torch_dist checkpoints written as DCP"):
        shardavg.merge(inputs, tmp_path / "out", iteration=5)  # (a model folder)
    unnamed = [tmp_path / "a", tmp_path / "b"]  # (folders whose names give no iteration)
    for folder, source in zip(unnamed, inputs):
        source.rename(folder)
    with pytest.raises(shardavg.CheckpointError, match=r"no input records one .* iteration=N \(--iteration N\)"):
        shardavg.merge(unnamed, tmp_path / "out", output="dcp")
    assert not (tmp_path / "out").exists()
    written = shardavg.merge(unnamed, tmp_path / "out", output="dcp", iteration=7)
    assert written == megatron_lm_tracked(tmp_path / "out") == tmp_path / "out" / "iter_0000007"


# ---------------------------------------------------------------------- an averager saved beside the model


def with_averager(seed: int, prefix: str, step: int) -> dict[str, torch.Tensor]:
    """A model's tensors and, under ``prefix``, an averager's, keyed as ``avg.sharded_state_dict(prefix)`` keys
    them: its averages (``model(seed + 10)``, the model's keys after the prefix; with ``prefix=""`` in the
    model's place) and its counters (step, updates, skipped updates)."""
    averages = {prefix + name: tensor for name, tensor in model(seed + 10).items()}
    return model(seed) | averages | {prefix + megatron.COUNTERS: torch.tensor([step, step, 0])}


def test_an_averager_is_found_by_its_counters_whatever_its_prefix_and_carried_whole_from_the_newest(
    tmp_path: Path,
) -> None:
    """The marker is the entry only an averager writes (its counters), not a prefix guessed: ``avg_`` here."""
    from shardavg.strategies import megatron as live

    assert megatron.COUNTERS == live.COUNTERS  # (the key avg.sharded_state_dict writes its counters under)
    inputs = [tmp_path / "iter_0000010", tmp_path / "iter_0000030"]
    for seed, (folder, step) in enumerate(zip(inputs, (10, 30))):
        megatron_save(folder, with_averager(seed, "avg_", step), tmp_path / "unpickled", tp=1 + seed)
    out = shardavg.merge(inputs, tmp_path / "out", output="dcp")
    merged = DcpFolder(out)
    dtypes = {name: t.dtype for name, t in model(0).items()}
    assert_matches({name: merged.read(name) for name in dtypes}, numpy_mean([model(0), model(1)], [0.5, 0.5]), dtypes)
    newest = {key: value for key, value in with_averager(1, "avg_", 30).items() if key.startswith("avg_")}
    for key, value in newest.items():  # the newest input's averager, unchanged: its averages and its counters
        assert merged.read(key).dtype == value.dtype and torch.equal(merged.read(key), value), key
    record = json.loads((out / "provenance.json").read_text())
    assert [i["left_out"]["avg_* (averager)"] for i in record["inputs"]] == [6, 6]  # (5 averages, its counters)
    assert [i.get("averagers_carried") for i in record["inputs"]] == [None, ["avg_"]]

    again = shardavg.merge(inputs, tmp_path / "averages", key="avg_", output="dcp")  # on purpose: as a model
    merged = DcpFolder(again)
    assert not [key for key in merged.metadata.state_dict_metadata if str(key).startswith("avg_")]
    averages = numpy_mean([model(10), model(11)], [0.5, 0.5])
    assert_matches({name: merged.read(name) for name in dtypes}, averages, dtypes)
    record = json.loads((again / "provenance.json").read_text())
    assert record["inputs"][-1]["left_out"]["avg_shardavg.counters"] == 1
    assert "averagers_carried" not in record["inputs"][-1]


def test_a_checkpoint_of_the_average_alone_is_merged_only_on_purpose(tmp_path: Path) -> None:
    """``avg.sharded_state_dict(prefix="")`` saves the average as the model: a merge of models refuses it by
    name; ``key=""`` merges the averages (its counters left out); the options that would mix them are refused."""
    inputs = [tmp_path / "iter_0000010", tmp_path / "iter_0000030"]
    for seed, (folder, step) in enumerate(zip(inputs, (10, 30))):
        megatron_save(folder, with_averager(seed, "", step), tmp_path / "unpickled", tp=1)
    with pytest.raises(shardavg.CheckpointError, match=r"holds no model tensor, only the averages of an averager"):
        shardavg.merge(inputs, tmp_path / "out")
    dtypes = {name: t.dtype for name, t in model(0).items()}
    out = shardavg.merge(inputs, tmp_path / "out", key="")
    assert_matches(read_model(out), numpy_mean([model(10), model(11)], [0.5, 0.5]), dtypes)  # (no counters)
    beside = tmp_path / "beside"
    megatron_save(beside / "iter_0000010", with_averager(0, "ema.", 10), tmp_path / "unpickled", tp=1)
    refused = {
        "key='emx'": ({"key": "emx"}, "holds no averager saved with avg.sharded_state_dict(prefix='emx')"),
        "prefix=''": ({"prefix": ""}, "holding averagers (prefixes ['ema.']): leave --prefix out"),
        "average='fast'": ({"key": "ema", "average": "fast"}, "holds one average under each averager's prefix"),
    }
    for given, (options, match) in refused.items():
        with pytest.raises(shardavg.CheckpointError, match=re.escape(match)):
            shardavg.merge([beside / "iter_0000010"], tmp_path / "refused", **options)
        assert not (tmp_path / "refused").exists(), given


DECAY = 0.5


@contextlib.contextmanager
def megatron_world(folder: Path) -> Iterator[None]:
    """One gloo process, Megatron's groups at TP1/PP1. TEST-ONLY, as ``test_megatron_strategy.py``'s
    ``world_of_one``: ``dist_checkpointing.save`` waits with ``torch.cuda.synchronize()`` and keeps its
    failure flag on ``torch.cuda.current_device()``, which a CPU build of torch refuses (the tensors are on
    the CPU: nothing to wait for), and its writer's results go through a plain queue (one process)."""
    pytest.importorskip("megatron.core")
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(filesystem_async, "_results_queue", queue.Queue())
        patch.setattr(torch.cuda, "synchronize", lambda *args, **kwargs: None)
        patch.setattr(torch.cuda, "current_device", lambda: "cpu")
        dist.init_process_group("gloo", store=dist.FileStore(str(folder / ".store"), 1), rank=0, world_size=1)
        parallel_state.initialize_model_parallel(1, 1)
        try:
            yield
        finally:
            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()
            (folder / ".store").unlink(missing_ok=True)


def live_gpt(seed: int):  # -> GPTModel (megatron-core is imported only where it is installed)
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(seed)
    config = TransformerConfig(
        num_layers=2, hidden_size=16, num_attention_heads=2, use_cpu_initialization=True, hidden_dropout=0.0,
        attention_dropout=0.0,
    )  # fmt: skip
    return GPTModel(config, get_gpt_layer_local_spec(), vocab_size=32, max_sequence_length=8)


def live_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors by its state-dict names, without Megatron's ``_extra_state`` objects."""
    return {name: value.clone() for name, value in module.state_dict().items() if isinstance(value, torch.Tensor)}


@dataclass
class LiveRun:
    """A Megatron-LM run folder a live run saved, and what it held at each save."""

    run: Path
    models: list[dict[str, torch.Tensor]]  # the live weights
    averages: list[dict[str, torch.Tensor]]  # the averager's ``full_state_dict()``


@pytest.fixture(scope="module")
def live_run(tmp_path_factory: pytest.TempPathFactory) -> LiveRun:
    """A Megatron-Core GPT updated 20 times, its averager after each update; at iterations 10 and 20 it and
    the averager are saved the documented way (docs/megatron.md) into ``iter_NNNNNNN`` folders and the
    tracker names the newest: 35 tensors each (17 of the model, 17 averages, the averager's counters)."""
    root = tmp_path_factory.mktemp("live-megatron")
    found = LiveRun(root / "run", [], [])
    with megatron_world(root):
        from megatron.core import dist_checkpointing

        gpt = live_gpt(seed=0)
        avg = shardavg.WeightAverager(gpt, shardavg.EMA(decay=DECAY))
        for iteration in range(1, 21):
            generator = torch.Generator().manual_seed(iteration)
            with torch.no_grad():  # (a stand-in for an optimizer step: every weight moves)
                for param in gpt.parameters():
                    param.add_(torch.randn(param.shape, generator=generator))
            avg.update()
            if iteration % 10:
                continue
            folder = found.run / f"iter_{iteration:07d}"
            folder.mkdir(parents=True)
            state = {"model": gpt.sharded_state_dict(), "iteration": iteration, **avg.sharded_state_dict(prefix="ema.")}
            dist_checkpointing.save(state, str(folder))
            (found.run / TRACKER).write_text(str(iteration))
            found.models.append(live_tensors(gpt))
            found.averages.append(avg.full_state_dict())
    return found


@dataclass
class Resumed:
    """What a run resuming from a checkpoint holds: its weights, its averager's average and counters."""

    weights: dict[str, torch.Tensor]
    average: dict[str, torch.Tensor]
    counters: tuple[int, int, int]  # step, updates, skipped updates


def resumed(folder: Path, world: Path) -> Resumed:
    """A fresh GPT and averager resumed from ``folder`` the documented way (docs/megatron.md): the model's and
    the averager's own sharded state dicts as the load's template, then ``avg.load_sharded_state_dict``."""
    with megatron_world(world):
        from megatron.core import dist_checkpointing

        gpt = live_gpt(seed=1)
        avg = shardavg.WeightAverager(gpt, shardavg.EMA(decay=DECAY))
        template = {"model": gpt.sharded_state_dict(), **avg.sharded_state_dict(prefix="ema.")}
        loaded = dist_checkpointing.load(template, str(folder))
        gpt.load_state_dict(loaded["model"])
        avg.load_sharded_state_dict(loaded)
        return Resumed(live_tensors(gpt), avg.full_state_dict(), (avg.step, avg.num_updates, avg.num_skipped))


def test_a_live_runs_averager_is_left_out_of_the_merge_by_name_and_the_log_counts_the_model(
    live_run: LiveRun, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """``shardavg merge --last 2 RUN --format dcp`` called all 35 tensors "model tensors" and averaged the
    averager's ``ema.*`` too; now it merges the model's 17 and names the averager it left out, in the log and
    in the record (as ``*._extra_state``), and says what became of it."""
    out = tmp_path / "merged"
    assert shardavg.cli.main(["merge", "--last", "2", str(live_run.run), "--format", "dcp", "--out", str(out)]) == 0
    said = capsys.readouterr().err
    for iteration in ("iter_0000010", "iter_0000020"):
        line = (
            f"{live_run.run / iteration}: merged its 17 model tensors; left out 8 under '*._extra_state', 1 under "
            "'common.pt', 26 under 'ema.* (averager)'"  # (17 averages, its counters, its 8 objects)
        )
        assert line in said, said
    assert (
        f"{out / 'iter_0000020'}: the averager saved beside the model under 'ema.' is left out of the merge of the "
        f"models; 'ema.' of the newest input, {live_run.run / 'iter_0000020'}, carried unchanged (averages and "
        "counters): a run resuming from OUT restores that run's average. To merge the averages themselves, as a "
        "model, pass key='ema.' (--key ema.)"
    ) in said, said
    record = json.loads((out / "iter_0000020" / "provenance.json").read_text())
    assert [i["left_out"]["ema.* (averager)"] for i in record["inputs"]] == [26, 26]
    assert [i.get("averagers_carried") for i in record["inputs"]] == [None, ["ema."]]

    folder = shardavg.merge(live_run.run, tmp_path / "model-folder", last=2)  # (a model folder: no averager)
    assert len(read_model(folder)) == 17 and not [name for name in read_model(folder) if name.startswith("ema.")]


def test_resuming_from_the_merge_restores_the_newest_runs_average_never_a_mean_of_averages(
    live_run: LiveRun, tmp_path: Path
) -> None:
    """The merge restored an averager with 20 updates whose average was the mean of two saved averages. The
    model is the merge; the averager is the newest input's, whole: its average and counters, as it saved them."""
    written = shardavg.merge(live_run.run, tmp_path / "merged", last=2, output="dcp")
    run = resumed(written, tmp_path)
    dtypes = {name: value.dtype for name, value in live_run.models[0].items()}
    assert_matches(run.weights, numpy_mean(live_run.models, [0.5, 0.5]), dtypes)
    assert run.counters == (20, 20, 0)
    average, newest = run.average, live_run.averages[-1]
    assert sorted(average) == sorted(newest)
    assert all(torch.equal(average[name], value) for name, value in newest.items())
    mean = numpy_mean(live_run.averages, [0.5, 0.5])
    assert not all(torch.equal(average[name], torch.from_numpy(value)) for name, value in mean.items())


def test_the_averages_are_merged_on_purpose_as_a_model_with_key(live_run: LiveRun, tmp_path: Path) -> None:
    """``key="ema."`` (``--key ema.``) merges the saved averages (an average of averages: a model to evaluate
    or start from), written under the model's keys, which Megatron's own load reads into the model; the
    averager's counters are left out by name, and the output holds no averager to resume."""
    written = shardavg.merge(live_run.run, tmp_path / "merged", last=2, key="ema.", output="dcp")
    keys = [str(key) for key in DcpFolder(written).metadata.state_dict_metadata]
    assert not [key for key in keys if key.startswith("ema.")]
    record = json.loads((written / "provenance.json").read_text())
    left_out = record["inputs"][-1]["left_out"]
    assert left_out["ema.shardavg.counters"] == 1 and left_out["model"] == 17
    with megatron_world(tmp_path):
        from megatron.core import dist_checkpointing

        gpt = live_gpt(seed=1)
        gpt.load_state_dict(dist_checkpointing.load({"model": gpt.sharded_state_dict()}, str(written))["model"])
        weights = live_tensors(gpt)
    dtypes = {name: value.dtype for name, value in live_run.averages[0].items()}
    assert_matches(weights, numpy_mean(live_run.averages, [0.5, 0.5]), dtypes)
