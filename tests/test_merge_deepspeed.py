"""``shardavg merge`` on DeepSpeed's checkpoints, laid out here as ``engine.save_checkpoint`` (raw ZeRO-2
and ZeRO-3 tags at 2 ranks, with DeepSpeed's own data-only objects in the optimizer states) and
``ds_to_universal`` (``zero/<param>/fp32.pt``) write them, without an engine: each merge compared with
numpy. The refusals of known formats that cannot be read name the format and the command that works.
(tests_distributed/test_merge_engines.py checks real engines' saves against DeepSpeed's own reader.)"""

from __future__ import annotations

import os
import pickle
import shlex
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import Payload
from test_merge import read_model

import shardavg
from shardavg.offline.sources import finished_checkpoints, open_source

os.environ.setdefault("DS_ACCELERATOR", "cpu")
pytest.importorskip("deepspeed")
from deepspeed.runtime.fp16.loss_scaler import LossScaler  # noqa: E402
from deepspeed.runtime.zero.config import ZeroStageEnum  # noqa: E402
from deepspeed.utils.tensor_fragment import fragment_address  # noqa: E402

RANKS = 2
SHAPES = OrderedDict([("fc1.weight", (5, 6)), ("fc1.bias", (5,)), ("fc2.weight", (3, 5)), ("fc2.bias", (3,))])


def masters(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g) for name, shape in SHAPES.items()}


def optimizer_state(stage: int, flat: list[torch.Tensor], key: str) -> dict:
    """A rank's ``*_optim_states.pt`` as DeepSpeed 0.19 writes it: its fp32 partitions among
    DeepSpeed's own data-only objects and the base optimizer's moments."""
    inner = {
        "zero_stage": ZeroStageEnum(stage),
        "loss_scaler": LossScaler(1.0),
        "dynamic_loss_scale": False,
        "overflow": False,
        "partition_count": [RANKS] if stage < 3 else RANKS,
        key: flat,
        "base_optimizer_state": {"state": {0: {"exp_avg": torch.zeros_like(flat[0]), "step": torch.tensor(3.0)}}},
    }
    if stage < 3:
        inner["param_slice_mappings"] = [OrderedDict(fc1=fragment_address(numel=30, start=0))]
    return {"optimizer_state_dict": inner, "ds_config": {"train_batch_size": 2}, "ds_version": "0.19.8"}


def model_state(buffer: torch.Tensor) -> dict:
    return {
        "module": OrderedDict(running=buffer),
        "buffer_names": ["running"],
        "param_shapes": [OrderedDict((name, torch.Size(shape)) for name, shape in SHAPES.items())],
        "frozen_param_shapes": OrderedDict(),
        "frozen_param_fragments": OrderedDict(),
        "shared_params": {"head.weight": "fc2.weight"},  # (saved once, under fc2.weight)
        "global_steps": 3,
        "ds_version": "0.19.8",
    }


def save_raw(tag: Path, stage: int, weights: dict[str, torch.Tensor], buffer: torch.Tensor) -> None:
    """A raw ZeRO tag of ``RANKS`` ranks holding ``weights`` as their fp32 masters."""
    tag.mkdir(parents=True)
    if stage < 3:  # one group, flattened, padded to 2 x RANKS, split evenly
        flat = torch.cat([w.reshape(-1) for w in weights.values()])
        flat = torch.cat([flat, torch.zeros(-len(flat) % (2 * RANKS))])
        parts = [[p.clone()] for p in flat.chunk(RANKS)]
        key = "single_partition_of_fp32_groups"
        torch.save(model_state(buffer), tag / "mp_rank_00_model_states.pt")
    else:  # each parameter split evenly over the ranks, the last part padded
        pieces = [[] for _ in range(RANKS)]
        for w in weights.values():
            part = -(-w.numel() // RANKS)
            padded = torch.cat([w.reshape(-1), torch.zeros(part * RANKS - w.numel())])
            for r in range(RANKS):
                pieces[r].append(padded[r * part : (r + 1) * part])
        parts = [[torch.cat(p)] for p in pieces]
        key = "fp32_flat_groups"
        for r in range(RANKS):
            torch.save(model_state(buffer), tag / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt")
    for r in range(RANKS):
        torch.save(optimizer_state(stage, parts[r], key), tag / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")


def save_universal(folder: Path, weights: dict[str, torch.Tensor], marker: Path) -> None:
    """``ds_to_universal``'s output at ZeRO-1/2: each master whole beside its moments."""
    for name, value in weights.items():
        (folder / "zero" / name).mkdir(parents=True)
        torch.save({"param": value, "cat_dim": 0}, folder / "zero" / name / "fp32.pt")
        for moment in ("exp_avg", "exp_avg_sq"):
            torch.save({"param": value * 0}, folder / "zero" / name / f"{moment}.pt")
    (folder / "zero" / "optimizer_state.pt").write_bytes(pickle.dumps(Payload(marker)))
    (folder / "mp_rank_00_model_states.pt").write_bytes(pickle.dumps(Payload(marker)))


def save_universal_zero3(
    folder: Path, weights: dict[str, torch.Tensor], buffer: torch.Tensor, frozen: torch.Tensor | None = None
) -> None:
    """``ds_to_universal``'s output at ZeRO-3 (``RANKS`` ranks): each master flat in ``zero/``, the ranks'
    model states copied beside it, holding the buffer whole and the frozen parameter ``embed`` (if any)
    in a flat part per rank, as the raw tag's do."""
    for name, value in weights.items():
        (folder / "zero" / name).mkdir(parents=True)
        torch.save(value.reshape(-1).clone(), folder / "zero" / name / "fp32.pt")
    flat = torch.zeros(0) if frozen is None else frozen.reshape(-1)
    parts = torch.cat([flat, flat.new_zeros(-len(flat) % RANKS)]).chunk(RANKS)
    for rank in range(RANKS):
        state = model_state(buffer)
        if frozen is not None:
            state["frozen_param_shapes"] = OrderedDict(embed=frozen.shape)
            state["frozen_param_fragments"] = OrderedDict(embed=parts[rank].clone())
        torch.save(state, folder / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt")


def numpy_mean(states: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    out = {}
    for name in states[0]:
        total = np.zeros(states[0][name].shape, dtype=np.float32)
        for state in states:
            total = total + state[name].numpy() * np.float32(1 / len(states))
        out[name] = torch.from_numpy(total)
    return out


def assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert got[name].dtype == value.dtype and torch.equal(got[name], value), name


@pytest.mark.parametrize("stage", [2, 3])
def test_raw_zero_tags_merge_their_fp32_masters_exactly(stage: int, tmp_path: Path) -> None:
    run = tmp_path / "run"
    for step in (1, 2, 3):
        save_raw(run / f"global_step{step}", stage, masters(step), torch.full((2,), float(step)))
    (run / "latest").write_text("global_step2")  # (global_step3: a save still being written)
    assert [step for step, _ in finished_checkpoints(run)] == [1, 2]
    source = open_source(run / "global_step1")
    assert source.ties == [("fc2.weight", "head.weight")] and source.step == 1
    assert source.left_out == {"optimizer states": 4}  # (each rank's exp_avg and step: never merged)
    got = read_model(shardavg.merge(run, tmp_path / "out", last=2))
    want = numpy_mean([masters(1), masters(2)])
    want["head.weight"] = want["fc2.weight"]  # (tied: written under both names)
    want |= numpy_mean([{"running": torch.full((2,), 1.0)}, {"running": torch.full((2,), 2.0)}])  # (the buffer)
    assert_equal(got, want)


def test_a_tag_holding_another_python_object_is_refused_naming_zero_to_fp32(tmp_path: Path) -> None:
    run = tmp_path / "run"
    save_raw(run / "global_step1", 2, masters(1), torch.zeros(2))
    state = optimizer_state(2, [torch.zeros(28)], "single_partition_of_fp32_groups")
    state["optimizer_state_dict"]["loss_scaler"] = Payload(tmp_path / "unpickled")
    torch.save(state, run / "global_step1" / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    (run / "zero_to_fp32.py").write_text("# DeepSpeed copies its script here\n")
    with pytest.raises(shardavg.CheckpointError) as refused:
        shardavg.merge([run / "global_step1"], tmp_path / "out")
    message = str(refused.value)
    assert "\n" not in message and not (tmp_path / "unpickled").exists()
    assert (
        "is a DeepSpeed checkpoint (mp_rank_00_model_states.pt, ...), raw ZeRO, which cannot be read as data" in message
    )
    want = f"python {run}/zero_to_fp32.py {run} {run}/global_step1_fp32 --tag global_step1 --safe_serialization"
    assert want in message, message


def test_universal_checkpoints_merge_and_leave_their_moments_unread(tmp_path: Path) -> None:
    run, marker = tmp_path / "run", tmp_path / "unpickled"
    for step in (10, 20):
        save_universal(run / f"global_step{step}_universal", masters(step), marker)
    (run / "latest_universal").write_text("global_step20_universal")
    assert [step for step, _ in finished_checkpoints(run)] == [10, 20]
    source = open_source(run / "global_step10_universal")
    assert source.left_out == {"optimizer moments": 8, "optimizer_state.pt": 1, "model states": 1}
    assert_equal(read_model(shardavg.merge(run, tmp_path / "out", last=2)), numpy_mean([masters(10), masters(20)]))
    assert not marker.exists()


def test_a_zero3_universal_checkpoint_is_shaped_by_its_model_states(tmp_path: Path) -> None:
    folder = tmp_path / "global_step5_universal"
    for name, value in masters(5).items():
        (folder / "zero" / name).mkdir(parents=True)
        torch.save(value.reshape(-1).clone(), folder / "zero" / name / "fp32.pt")  # (ZeRO-3: flat)
    torch.save(model_state(torch.zeros(2)), folder / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    got = open_source(folder)
    assert_equal({name: got.read(name) for name in got.specs}, masters(5) | {"running": torch.zeros(2)})
    (folder / "zero_pp_rank_0_mp_rank_00_model_states.pt").unlink()
    with pytest.raises(shardavg.CheckpointError, match="whose model states do not give fc1.bias's shape as data"):
        open_source(folder)


def test_a_zero3_universal_checkpoint_keeps_its_buffers_and_frozen_parameters_in_its_model_states(
    tmp_path: Path,
) -> None:
    """``ds_to_universal`` writes a ZeRO-3 tag's masters into ``zero/`` and copies its ranks' model states
    beside them, where the buffers (whole) and the frozen parameters (a flat part per rank) stay: the
    merge reads them there, as from the raw tag (it wrote the masters alone before, saying nothing)."""
    frozen = torch.randn(3, 3, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)  # (9 over 2 ranks)
    buffer = torch.tensor([1.5, -2.0])
    folder = tmp_path / "global_step5_universal"
    save_universal_zero3(folder, masters(5), buffer, frozen)
    assert "model states" not in open_source(folder).left_out  # (read, not left out)
    got = read_model(shardavg.merge([folder], tmp_path / "out"))
    assert_equal(got, masters(5) | {"running": buffer, "embed": frozen})


def test_a_run_folder_named_as_an_input_names_its_tags(tmp_path: Path) -> None:
    run = tmp_path / "run"
    save_raw(run / "global_step4", 2, masters(4), torch.zeros(2))
    with pytest.raises(
        shardavg.CheckpointError,
        match=r"a run folder of several saves: merge its tags by name \(.*global_step4\), or its newest K with --last",
    ):
        shardavg.merge([run], tmp_path / "out")


def test_lightning_and_accelerate_pickles_are_refused_with_the_command_that_converts_them(tmp_path: Path) -> None:
    ckpt = tmp_path / "epoch=0-step=10.ckpt"
    torch.save({"state_dict": {"w": torch.ones(2)}}, ckpt)
    with pytest.raises(shardavg.CheckpointError) as refused:
        shardavg.merge([ckpt], tmp_path / "out")
    message = str(refused.value)
    assert "is a Lightning checkpoint (.ckpt), a pickle" in message and "\n" not in message
    command = message.split("where you trust it: ")[1].split(", and merge")[0]
    assert command.startswith("python -c ") and "weights_only=False)['state_dict']" in command

    accelerate = tmp_path / "accelerate"
    accelerate.mkdir()
    torch.save({"w": torch.ones(2)}, accelerate / "pytorch_model.bin")
    torch.save({}, accelerate / "optimizer.bin")
    (accelerate / "random_states_0.pkl").write_bytes(b"")
    with pytest.raises(shardavg.CheckpointError) as refused:
        shardavg.merge([accelerate], tmp_path / "out")
    message = str(refused.value)
    assert "is an accelerate save_state folder saved with safe_serialization=False" in message and "\n" not in message
    command = message.split("convert it once: ")[1].split(", and merge")[0]
    exec(shlex.split(command)[2], {})  # (the command's program itself, run here: a new interpreter costs seconds)
    assert_equal(read_model(shardavg.merge([accelerate], tmp_path / "converted")), {"w": torch.ones(2)})
