"""Several named averages in one averager: each exactly what it would be alone, one read of the
local shards per update for all of them, and every use (swap, gather, export, save, load, CLI) by name."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from harness import TiedNet
from helpers import assert_same_average, in_process_cli
from safetensors.torch import load_file
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils._python_dispatch import TorchDispatchMode

from shardavg import EMA, SWA, CheckpointError, PowerEMA, WeightAverager

CUSTOM = get_ema_multi_avg_fn(0.8)


def several() -> dict:
    return {"ema": EMA(decay=0.9), "swa": SWA(), "power": PowerEMA(gamma=5.0), "fn": CUSTOM}


class OpCount(TorchDispatchMode):
    """How many times each aten op ran."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def untrained() -> TiedNet:
    """The trainer's model before training (same frozen weights): what a load fills came from the checkpoint."""
    torch.manual_seed(0)
    return TiedNet()


def run(trainer, averagers, steps: int) -> None:
    for _ in range(steps):
        trainer.step()
        for averager in averagers:
            averager.update()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_named_average_is_bitwise_what_it_is_alone(model, trainer, dtype) -> None:
    model.to(dtype)
    kwargs = {"buffers": "average", "include_frozen": True, "every_n_steps": 2, "start_step": 3}
    together = WeightAverager(model, several(), **kwargs)
    alone = {name: WeightAverager(model, rule, **kwargs) for name, rule in several().items()}
    reference = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)
    for step in range(1, 14):
        trainer.step()
        together.update()
        for averager in alone.values():
            averager.update()
        if step >= 3 and (step - 3) % 2 == 0:
            reference.update_parameters(model)
    assert together.rules == {name: alone[name].rule for name in alone}
    for name, averager in alone.items():
        got, want = together.full_state_dict(name), averager.full_state_dict()
        assert set(got) == set(want) == set(TiedNet().state_dict())
        for key in want:
            assert torch.equal(got[key], want[key]), f"{name}: {key}"
    if dtype == torch.float32:  # and the EMA is AveragedModel's, bit for bit
        got = together.full_state_dict("ema")
        for key, value in reference.module.state_dict().items():
            if value.is_floating_point():
                assert torch.equal(got[key], value), key
    averaged = sum(p.numel() for p in model.parameters()) + sum(
        b.numel() for b in model.buffers() if b.is_floating_point()
    )
    copied = sum(b.numel() * b.element_size() for b in model.buffers() if not b.is_floating_point())
    assert together.shadow_bytes() == 4 * averaged * 4 + copied  # four fp32 averages, integer buffers once


def test_the_live_shards_are_screened_and_staged_once_for_all_averages(model, trainer) -> None:
    """bf16 live weights under a custom rule are cast to the fp32 shadow dtype: one cast and one
    non-finite screen per update whether one average or three take them in."""
    model.to(torch.bfloat16)
    one = WeightAverager(model, {"a": CUSTOM})
    three = WeightAverager(model, {"a": CUSTOM, "b": get_ema_multi_avg_fn(0.5), "c": EMA(decay=0.9)})
    run(trainer, [one, three], 2)
    counts = []
    for averager in (one, three):
        with OpCount() as ops:
            averager.update()
        counts.append(ops.counts)
    assert counts[0].get("copy_", 0) > 0, "the bf16 shards were never staged: the check is vacuous"
    assert counts[1].get("copy_") == counts[0]["copy_"]
    screen = ("cat", "dot", "sum", "aminmax", "_foreach_norm")  # (what the non-finite screen reads with)
    screened = [sum(count.get(op, 0) for op in screen) for count in counts]
    assert screened[1] == screened[0] >= 1, counts


def test_uses_by_name_and_what_is_refused(model, trainer, tmp_path, tokens) -> None:
    averager = WeightAverager(model, several())
    run(trainer, [averager], 4)
    with pytest.raises(ValueError, match=r"keeps several averages \['ema', 'swa', 'power', 'fn'\]: name one"):
        averager.full_state_dict()
    with pytest.raises(ValueError, match=r"no average called 'slow': this averager keeps \['ema'"):
        with averager.swapped("slow"):
            pass
    with pytest.raises(ValueError, match="keeps several averages"):
        averager.rule  # noqa: B018
    live = model(tokens)
    for name in ("swa", "power"):
        plain = TiedNet()
        averager.copy_to(plain, name)
        with averager.swapped(name):
            assert torch.equal(model(tokens), plain(tokens))
    assert torch.equal(model(tokens), live)
    averager.export(tmp_path / "power", average="power")
    exported = load_file(tmp_path / "power" / "model.safetensors")
    want = averager.full_state_dict("power")
    assert all(torch.equal(exported[k], want[k]) for k in want)

    for bad in ({}, {"a.b": SWA()}, {"": SWA()}, {"x/y": SWA()}, {1: SWA()}):
        with pytest.raises(ValueError, match="names no average|not plain names"):
            WeightAverager(model, bad)
    unnamed = WeightAverager(model, SWA())
    assert unnamed.rules == {None: SWA()}
    with pytest.raises(ValueError, match="keeps one, unnamed"):
        unnamed.full_state_dict("swa")


def test_save_load_dcp_and_the_cli_carry_every_average(trainer, tmp_path) -> None:
    averager = WeightAverager(trainer.model, several())
    run(trainer, [averager], 5)
    path = averager.save(tmp_path / "ckpt")

    restored = WeightAverager(untrained(), several())
    restored.load(path)
    assert restored.num_updates == 5
    for name in several():
        got, want = restored.full_state_dict(name), averager.full_state_dict(name)
        assert all(torch.equal(got[k], want[k]) for k in want), name

    dcp.save({"ema": averager}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    from_dcp = WeightAverager(untrained(), several())
    dcp.load({"ema": from_dcp}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    for name in several():
        got, want = from_dcp.full_state_dict(name), averager.full_state_dict(name)
        assert all(torch.equal(got[k], want[k]) for k in want), name

    fewer = WeightAverager(untrained(), {"ema": EMA(decay=0.9), "slow": EMA(decay=0.99)})
    with pytest.raises(CheckpointError, match=r"holds averages \['ema', 'swa', 'power', 'fn'\], this averager keeps"):
        fewer.load(path)
    assert fewer.num_updates == 0
    with pytest.warns(UserWarning, match="holds averages"):
        fewer.load(path, strict=False)
    got, want = fewer.full_state_dict("ema"), averager.full_state_dict("ema")
    assert all(torch.equal(got[k], want[k]) for k in want)
    slow = fewer.full_state_dict("slow")  # not in the checkpoint: restarted from the live weights
    assert torch.equal(slow["embed.weight"], fewer.strategy.model.embed.weight.float())
    with pytest.raises(
        CheckpointError, match=r"holds averages \['ema', 'swa', 'power', 'fn'\], this averager keeps \[None\]"
    ):
        WeightAverager(untrained(), EMA(decay=0.9)).load(path)

    inspect = in_process_cli("inspect", str(path))
    assert inspect.returncode == 0 and "average swa" in inspect.stdout and "average power" in inspect.stdout
    assert '"gamma": 5.0' in inspect.stdout
    refused = in_process_cli("export", str(path), str(tmp_path / "x"))
    assert refused.returncode == 2 and "holds averages ['ema', 'swa', 'power', 'fn']: name one" in refused.stderr
    for source, key in ((path, []), (tmp_path / "dcp", ["--key", "ema"])):
        out = tmp_path / f"swa-{source.name}"
        done = in_process_cli("export", str(source), str(out), "--average", "swa", *key)
        assert done.returncode == 0, done.stderr
        exported, want = load_file(out / "model.safetensors"), averager.full_state_dict("swa")
        assert set(exported) == set(want) and all(torch.equal(exported[k], want[k]) for k in want)
    wrong = in_process_cli("export", str(path), str(tmp_path / "y"), "--average", "slow")
    assert wrong.returncode == 2 and "has no average 'slow'" in wrong.stderr


def test_a_checkpoint_of_one_unnamed_average_still_loads(trainer, tmp_path) -> None:
    averager = WeightAverager(trainer.model, EMA(decay=0.9))
    run(trainer, [averager], 3)
    restored = WeightAverager(untrained(), EMA(decay=0.9))
    restored.load(averager.save(tmp_path / "ckpt"))
    assert_same_average(restored, averager)


def test_attaching_to_an_accelerator_twice_is_refused(model) -> None:
    from accelerate import Accelerator

    from shardavg.integrations.accelerate import attach

    accelerator = Accelerator(cpu=True)
    first, second = WeightAverager(model, SWA()), WeightAverager(model, SWA())
    save, load = attach(accelerator, first)
    with pytest.raises(ValueError, match="already attached"):
        attach(accelerator, first)
    with pytest.raises(ValueError, match="another averager is attached under 'shardavg'"):
        attach(accelerator, second)
    attach(accelerator, second, directory="second")
    save.remove()
    load.remove()
    attach(accelerator, first)  # detached by its handles: attaching again is fine
