"""WeightAverager on a plain module in one process: exactness, policies, swapping and bad input."""

from __future__ import annotations

import copy
import logging
import warnings
from unittest.mock import patch

import pytest
import torch
from harness import TiedNet
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import shardavg.update.staging
from shardavg import (
    EMA,
    SWA,
    InverseGammaWarmup,
    ModelChangedError,
    NonFiniteError,
    PowerEMA,
    StrategyError,
    WeightAverager,
)

FROZEN = {"frozen.proj.weight", "frozen.proj.bias"}
BUFFERS = {"block.norm.running_mean", "block.norm.running_var", "block.norm.num_batches_tracked"}


def live_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_ema_is_bitwise_averaged_model(model, trainer) -> None:
    averager = WeightAverager(model, EMA(decay=0.9))
    reference = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    for _ in range(25):
        trainer.step()
        averager.update()
        reference.update_parameters(model)
    got, want = averager.full_state_dict(), reference.module.state_dict()
    assert set(got) == set(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name
    assert averager.num_updates == 25
    TiedNet().load_state_dict(got, strict=True)


@pytest.mark.parametrize(
    "rule, weight",
    [
        (SWA(), lambda n: 1 / (n + 1)),
        (PowerEMA(gamma=5.0), lambda n: 1 - (1 - 1 / (n + 1)) ** 6.0),
        (EMA(decay=0.95, warmup=InverseGammaWarmup(1.0, 0.75)), lambda n: 1 - min(0.95, 1 - (1 + n) ** -0.75)),
    ],
)
def test_lerp_rules_match_plain_torch(model, trainer, rule, weight) -> None:
    averager = WeightAverager(model, rule)
    reference: dict[str, torch.Tensor] = {}
    for n in range(12):
        trainer.step()
        averager.update()
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            if n == 0:
                reference[name] = p.detach().clone()
            else:
                reference[name].lerp_(p.detach(), weight(n))
    got = averager.full_state_dict()
    for name, value in reference.items():
        assert torch.equal(got[name], value), name


def test_bf16_weights_get_an_fp32_shadow(model, trainer) -> None:
    model.to(torch.bfloat16)
    averager = WeightAverager(model, EMA(decay=0.9))
    kept = WeightAverager(model, EMA(decay=0.9), dtype=None)
    reference = AveragedModel(copy.deepcopy(model).float(), multi_avg_fn=get_ema_multi_avg_fn(0.9))
    same_dtype = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    for _ in range(20):
        trainer.step()
        averager.update()
        kept.update()
        reference.update_parameters(copy.deepcopy(model).float())
        same_dtype.update_parameters(model)
    got, want = averager.full_state_dict(), reference.module.state_dict()
    assert got["embed.weight"].dtype == torch.float32
    assert got["frozen.proj.weight"].dtype == torch.bfloat16  # not averaged: the live value
    for name in want:
        torch.testing.assert_close(got[name].float(), want[name].float(), rtol=1e-5, atol=1e-6)
    assert averager.shadow_bytes() == 2 * kept.shadow_bytes() - sum(b.nbytes for n, b in model.named_buffers())
    for name, value in kept.full_state_dict().items():  # dtype=None: bf16 shadow, lerp like AveragedModel
        assert torch.equal(value, same_dtype.module.state_dict()[name]), name


def test_custom_callable_rule_is_bitwise_averaged_model_also_on_bf16(model, trainer) -> None:
    model.to(torch.bfloat16)
    averager = WeightAverager(model, get_ema_multi_avg_fn(0.8))
    reference = AveragedModel(copy.deepcopy(model).float(), multi_avg_fn=get_ema_multi_avg_fn(0.8))
    for _ in range(10):
        trainer.step()
        averager.update()
        reference.update_parameters(copy.deepcopy(model).float())
    got = averager.full_state_dict()
    for name, _ in model.named_parameters():
        if name not in FROZEN:
            assert torch.equal(got[name], reference.module.state_dict()[name]), name


def test_custom_rule_gets_num_updates_like_averaged_model(model, trainer, monkeypatch) -> None:
    seen = []

    def record(shadows, lives, num_updates):
        seen.append((num_updates.item(), num_updates.dtype))

    monkeypatch.setattr(shardavg.update.staging, "STAGING_BYTES", 64)  # cast the bf16 lives in many buckets
    model.to(torch.bfloat16)
    averager = WeightAverager(model, record)
    for _ in range(4):
        trainer.step()
        averager.update()
    assert {n for n, _ in seen} == {1, 2, 3} and all(d == torch.int64 for _, d in seen)
    assert len(seen) > 3 * 2  # several buckets per update


def test_every_n_steps_and_start_step(model, trainer) -> None:
    averager = WeightAverager(model, SWA(), every_n_steps=3, start_step=5)
    applied = []
    for step in range(1, 15):
        trainer.step()
        if averager.update():
            applied.append(step)
    assert applied == [5, 8, 11, 14]
    assert averager.num_updates == 4 and averager.step == 14
    assert averager.update(step=20) and not averager.update(step=21)


def test_copied_buffers_are_the_values_at_the_last_update(model, trainer, tokens) -> None:
    averager = WeightAverager(model, EMA(decay=0.9))
    trainer.step()
    averager.update()
    snapshot = live_state(model)
    model(tokens)  # a forward in train mode moves the BatchNorm statistics
    got = averager.full_state_dict()
    for name in BUFFERS:
        assert torch.equal(got[name], snapshot[name]), name
    assert not torch.equal(model.block.norm.running_mean, snapshot["block.norm.running_mean"])


def test_averaged_buffers_average_floats_and_copy_integers(model, trainer) -> None:
    averager = WeightAverager(model, EMA(decay=0.5), buffers="average")
    trainer.step()
    averager.update()
    first = live_state(model)
    trainer.step()
    averager.update()
    second = live_state(model)
    got = averager.full_state_dict()
    assert torch.equal(
        got["block.norm.running_mean"], first["block.norm.running_mean"].lerp(second["block.norm.running_mean"], 0.5)
    )
    assert got["block.norm.num_batches_tracked"].item() == 2


def test_ignored_buffers_take_no_memory_and_export_live_values(model, trainer, tokens) -> None:
    averager = WeightAverager(model, EMA(decay=0.9), buffers="ignore")
    copying = WeightAverager(model, EMA(decay=0.9))
    trainer.step()
    averager.update()
    model(tokens)
    got = averager.full_state_dict()
    assert torch.equal(got["block.norm.running_mean"], model.block.norm.running_mean)
    assert copying.shadow_bytes() - averager.shadow_bytes() == sum(b.nbytes for b in model.buffers())


def test_frozen_parameters_are_exported_live_unless_included(model, trainer) -> None:
    averager = WeightAverager(model, EMA(decay=0.5))
    including = WeightAverager(model, EMA(decay=0.5), include_frozen=True)
    trainer.step()
    averager.update()
    including.update()
    before = model.frozen.proj.weight.detach().clone()
    with torch.no_grad():
        model.frozen.proj.weight.add_(1.0)  # changed by hand: only an averager that tracks it notices
    averager.update()
    including.update()
    assert torch.equal(averager.full_state_dict()["frozen.proj.weight"], model.frozen.proj.weight)
    torch.testing.assert_close(including.full_state_dict()["frozen.proj.weight"], before + 0.5)
    frozen_bytes = sum(p.nbytes for n, p in model.named_parameters() if n in FROZEN)
    assert including.shadow_bytes() - averager.shadow_bytes() == frozen_bytes


def test_tied_weights_are_tracked_once_and_exported_under_both_names(model, trainer) -> None:
    averager = WeightAverager(model, EMA(decay=0.9))
    trainer.step()
    averager.update()
    got = averager.full_state_dict()
    assert got["head.weight"] is got["embed.weight"]
    params = {id(p): p for p in model.parameters() if p.requires_grad}
    expected = sum(p.numel() * 4 for p in params.values()) + sum(b.nbytes for b in model.buffers())
    assert averager.shadow_bytes() == expected


def test_swapped_holds_the_average_and_restores_live_weights_bitwise(model, trainer, tokens) -> None:
    averager = WeightAverager(model, EMA(decay=0.9))
    reference = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    for _ in range(8):
        trainer.step()
        averager.update()
        reference.update_parameters(model)
    model.eval()
    reference.eval()
    before = live_state(model)
    with averager.swapped():
        assert torch.equal(model(tokens), reference.module(tokens))
    assert all(torch.equal(v, before[k]) for k, v in live_state(model).items())

    with pytest.raises(KeyError), averager.swapped():
        model(tokens)
        raise KeyError("boom")
    assert all(torch.equal(v, before[k]) for k, v in live_state(model).items())


def test_swapped_refuses_misuse(model, trainer) -> None:
    averager = WeightAverager(model, EMA(decay=0.9))
    with pytest.raises(RuntimeError, match="no update has been applied yet"), averager.swapped():
        pass
    with pytest.raises(RuntimeError, match="no update has been applied yet"):
        averager.full_state_dict()
    trainer.step()
    averager.update()
    with averager.swapped():
        with pytest.raises(RuntimeError, match="cannot be nested"), averager.swapped():
            pass
        with pytest.raises(RuntimeError, match="update\\(\\) inside swapped\\(\\)"):
            averager.update()


def test_update_refused_inside_swapped_changes_nothing(model, trainer) -> None:
    averager = WeightAverager(model, EMA(decay=0.9), every_n_steps=2)
    trainer.step()
    averager.update(step=2)
    kept = averager.full_state_dict()
    with averager.swapped():
        for step in (None, 3, 4):
            with pytest.raises(RuntimeError, match="update\\(\\) inside swapped\\(\\)"):
                averager.update(step)
    assert (averager.step, averager.num_updates) == (2, 1)
    assert all(torch.equal(v, kept[k]) for k, v in averager.full_state_dict().items())
    assert averager.update() is False and averager.step == 3  # the step count goes on from 2


def test_copy_to_writes_the_average_into_a_plain_module(model, trainer) -> None:
    averager = WeightAverager(model, EMA(decay=0.9))
    for _ in range(3):
        trainer.step()
        averager.update()
    target = TiedNet()
    averager.copy_to(target)
    for name, value in averager.full_state_dict().items():
        assert torch.equal(target.state_dict()[name], value.to(target.state_dict()[name].dtype)), name
    wrong = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"missing \['block.down.bias'.*unexpected \['0.bias', '0.weight'\]"):
        averager.copy_to(wrong)
    misshaped = TiedNet()
    misshaped.gain = nn.Parameter(torch.ones(3))
    with pytest.raises(ValueError, match=r"mis-shaped \['gain: \(3,\) vs \(1,\)'\]"):
        averager.copy_to(misshaped)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_live_weights_raise_and_leave_the_average_alone(model, trainer, bad) -> None:
    averager = WeightAverager(model, EMA(decay=0.9))
    trainer.step()
    averager.update()
    kept = averager.full_state_dict()
    with torch.no_grad():
        model.block.up.weight[0, 0] = bad
    with pytest.raises(NonFiniteError, match=r"non-finite live values in \['block.up.weight'\] at step 2 on rank 0"):
        averager.update()
    assert averager.num_updates == 1
    assert all(torch.equal(v, kept[k]) for k, v in averager.full_state_dict().items())


def test_nonfinite_live_weights_can_be_skipped_with_a_warning(model, trainer) -> None:
    averager = WeightAverager(model, EMA(decay=0.9), on_nonfinite="skip")
    trainer.step()
    averager.update()
    with torch.no_grad():
        model.gain[0] = float("nan")
    with pytest.warns(
        RuntimeWarning, match=r"skipping the update at step 2 on rank 0: non-finite live values in \['gain'\]"
    ):
        assert averager.update() is False
    assert averager.num_updates == 1 and averager.num_skipped == 1


def host_reads(update) -> int:
    """How many tensors ``update()`` reads back on the host (``bool()`` or ``.item()``)."""
    reads = []
    as_bool, item = torch.Tensor.__bool__, torch.Tensor.item
    with (
        patch.object(torch.Tensor, "__bool__", lambda self: reads.append(1) or as_bool(self)),
        patch.object(torch.Tensor, "item", lambda self: reads.append(1) or item(self)),
    ):
        assert update() is True
    return len(reads)


def test_nonfinite_check_off_averages_what_is_there_and_reads_nothing_back(model, trainer) -> None:
    checked = WeightAverager(model, EMA(decay=0.9))
    unchecked = WeightAverager(model, EMA(decay=0.9), on_nonfinite="off")
    trainer.step()
    assert host_reads(checked.update) > 0  # the check reads its flags back: the count below means something
    assert host_reads(unchecked.update) == 0
    with torch.no_grad():
        model.gain[0] = float("nan")
    assert unchecked.update() is True and unchecked.num_updates == 2 and unchecked.num_skipped == 0
    assert torch.isnan(unchecked.full_state_dict()["gain"][0])


def test_parameter_data_replaced_in_place_is_followed(model, trainer) -> None:
    """``param.data = other`` keeps the object (and here dtype and device): the next update reads ``other``."""
    averager = WeightAverager(model, EMA(decay=0.5))
    averager.update()
    weight = model.block.up.weight
    old = weight.detach().clone()
    weight.data = torch.full_like(old, 2.0)
    averager.update()
    assert torch.equal(averager.full_state_dict()["block.up.weight"], torch.lerp(old, torch.full_like(old, 2.0), 0.5))


def test_large_finite_weights_are_not_mistaken_for_nonfinite(model, trainer) -> None:
    averager = WeightAverager(model, EMA(decay=0.9))
    with torch.no_grad():
        model.block.up.weight.fill_(3e38)  # the squared norm overflows; the values are finite
    assert averager.update() is True


def test_a_changed_model_is_named(model, trainer) -> None:
    averager = WeightAverager(model, EMA(decay=0.9))
    trainer.step()
    averager.update()
    model.block.up = nn.Linear(6, 12)
    with pytest.raises(
        ModelChangedError,
        match=r"changed \[block.up.weight \(shape \(10, 6\) -> \(12, 6\), held on this rank \[0, 60\) -> \[0, 72\)\)",
    ):
        averager.update()
    model = TiedNet()
    averager = WeightAverager(model, EMA(decay=0.9))
    model.extra = nn.Parameter(torch.zeros(2))
    with pytest.raises(ModelChangedError, match=r"new \['extra'\]"):
        averager.update()


def test_a_cast_model_is_followed(model, trainer) -> None:
    averager = WeightAverager(model, EMA(decay=0.5))
    trainer.step()
    averager.update()
    old = averager.full_state_dict()
    model.double()  # rebinds every parameter's .data: same objects, new dtype
    assert averager.update()
    got = averager.full_state_dict()
    assert got["embed.weight"].dtype == torch.float32
    assert got["frozen.proj.weight"].dtype == torch.float64
    torch.testing.assert_close(got["embed.weight"], old["embed.weight"].lerp(model.embed.weight.float(), 0.5))


def test_a_replaced_parameter_of_the_same_shape_is_followed(model, trainer) -> None:
    averager = WeightAverager(model, EMA(decay=0.5))
    trainer.step()
    averager.update()
    old = averager.full_state_dict()["gain"]
    model.gain = nn.Parameter(torch.full((1,), 3.0))  # e.g. load_state_dict(assign=True)
    averager.update()
    assert torch.equal(averager.full_state_dict()["gain"], old.lerp(torch.full((1,), 3.0), 0.5))


def test_bad_arguments_are_refused_with_clear_messages(model) -> None:
    cases = [
        ({"buffers": "mean"}, ValueError, "unknown buffers policy 'mean'"),
        ({"on_nonfinite": "ignore"}, ValueError, "unknown on_nonfinite policy 'ignore'"),
        ({"every_n_steps": 0}, ValueError, "every_n_steps must be an int >= 1"),
        ({"start_step": -1}, ValueError, "start_step must be an int >= 0"),
        ({"dtype": torch.int32}, ValueError, "dtype must be a floating torch.dtype"),
        ({"strategy": "fsdp3"}, StrategyError, "unknown strategy 'fsdp3'"),
        (
            {"strategy": "fsdp2"},
            StrategyError,
            "strategy 'fsdp2' does not fit this TiedNet: its parameters are held the 'replicated' way",
        ),
        ({"strategy": "zero3"}, StrategyError, "strategy 'zero3' does not fit"),
        ({"strategy": "fsdp1"}, StrategyError, "strategy 'fsdp1' does not fit"),
        ({"rule": 0.999}, TypeError, "rule must be EMA"),
    ]
    for kwargs, kind, message in cases:
        with pytest.raises(kind, match=message.replace("(", r"\(").replace(")", r"\)")):
            WeightAverager(model, **kwargs)


def test_lower_precision_shadow_warns(model) -> None:
    model.double()
    with pytest.warns(
        UserWarning, match=r"8 shadows are torch.float32, below their live dtype: \['gain', 'embed.weight', "
    ):
        WeightAverager(model, EMA(decay=0.9))


def test_wrapper_prefixes_are_not_in_names(model, trainer) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model.block = checkpoint_wrapper(model.block)
    compiled = torch.compile(model)  # an OptimizedModule; nothing is compiled until it is called
    averager = WeightAverager(compiled, EMA(decay=0.9))
    trainer.step()
    averager.update()
    assert set(averager.full_state_dict()) == set(TiedNet().state_dict())


def test_names_lose_wrapper_segments_only_whole() -> None:
    from shardavg.strategies import canonical_name

    cases = {
        "transformer.h.0._checkpoint_wrapped_module.ln_1.weight": "transformer.h.0.ln_1.weight",
        "transformer.h.0._checkpoint_wrapped_module": "transformer.h.0",  # an FSDP unit's path
        "h.1._orig_mod._fsdp_wrapped_module.attn.c_attn.weight": "h.1.attn.c_attn.weight",
        "_orig_mod.embed.weight": "embed.weight",
        "enc_orig_mod.weight": "enc_orig_mod.weight",
        "my_checkpoint_wrapped_module.x._fsdp_wrapped_modules": "my_checkpoint_wrapped_module.x._fsdp_wrapped_modules",
        "module.weight": "module.weight",  # a user's own submodule named "module" stays
    }
    assert {name: canonical_name(name) for name in cases} == cases


def test_a_parameter_named_like_a_wrapper_keeps_its_name() -> None:
    model = nn.Module()
    model.enc_orig_mod = nn.Linear(2, 2)
    model.add_module("x_checkpoint_wrapped_module", nn.Linear(2, 2))
    averager = WeightAverager(model, EMA(decay=0.9))
    averager.update()
    assert set(averager.full_state_dict()) == set(model.state_dict())


def test_local_views_before_a_scan_are_refused(model) -> None:
    from shardavg.strategies import make_strategy

    strategy = make_strategy(model)
    with pytest.raises(RuntimeError, match=r"Replicated.local_shards\(\) before tensors\(\)"):
        strategy.local_shards()
    infos = strategy.tensors()
    assert [tuple(v.shape) for v in strategy.local_shards()] == [tuple(i.shape) for i in infos]


def test_local_views_are_the_same_objects_until_the_engine_changes_them(model, trainer) -> None:
    averager = WeightAverager(model, EMA(decay=0.9))
    trainer.step()
    averager.update()
    views, groups = averager.strategy.local_shards(), averager.updater.groups
    for _ in range(3):
        trainer.step()
        averager.update()
        assert all(a is b for a, b in zip(averager.strategy.local_shards(), views))
        assert averager.updater.groups is groups
    model.double()  # buffers are replaced in their modules' dicts, parameters get new .data
    with torch.no_grad():
        model.block.norm.running_mean.add_(1.0)  # only the new buffer holds this
    after = averager.strategy.local_shards()
    assert averager.update() and averager.updater.groups is not groups
    assert {v.dtype for v in after if v.is_floating_point()} == {torch.float64}
    running_mean = averager.full_state_dict()["block.norm.running_mean"]  # copied into its fp32 shadow
    assert torch.equal(running_mean, model.block.norm.running_mean.float())


def test_construction_logs_on_rank_zero(model, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="shardavg"):
        WeightAverager(model, EMA(decay=0.9))
    assert "replicated strategy, 13 tensors (8 averaged)" in caplog.text


def test_a_healthy_update_warns_nothing(model, trainer) -> None:
    averager = WeightAverager(model, EMA(decay=0.9))
    trainer.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert averager.update()


def test_the_master_source_is_refused_where_there_is_no_zero3_master(model) -> None:
    with pytest.raises(StrategyError, match=r"source='master' averages the fp32 master weights of a DeepSpeed engine"):
        WeightAverager(model, source="master")
    with pytest.raises(StrategyError, match=r"unknown source 'fp32'"):
        WeightAverager(model, source="fp32")


def test_an_averager_whose_model_was_partitioned_after_it_was_built_says_so_at_the_next_update(model) -> None:
    """What deepspeed.initialize (ZeRO-3) and accelerator.prepare do to a module: every parameter's
    data replaced by an empty tensor. Before, updates went on without a word until save()."""
    averager = WeightAverager(model, EMA(decay=0.9))
    assert averager.update()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.data = torch.empty(0, dtype=parameter.dtype)
    with pytest.raises(
        ModelChangedError, match=r"changed size after the averager was built: .*'embed.weight: 66 -> 0 elements'"
    ):
        averager.update()
    with pytest.raises(ModelChangedError, match="build the averager on the model they return"):
        averager.update()
    assert averager.num_updates == 1
