"""The Megatron-Core adapter in one process (a gloo group of one, TP1/PP1): detection, names, the
average exported and checkpointed by Megatron's own ``dist_checkpointing``, and every refusal,
each naming the tensor. Tensor and pipeline parallelism: ``tests_distributed/test_megatron.py``.

megatron-core is in the ``test`` extra (``pip install -e .[test]``); where it is missing (a Python it has
no wheel for), the module is skipped with the reason, as the DeepSpeed tests are without DeepSpeed."""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.optim.swa_utils import get_ema_multi_avg_fn

import shardavg
from shardavg import EMA, CheckpointError, StrategyError, WeightAverager

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e '.[megatron]')")
from megatron.core import dist_checkpointing  # noqa: E402
from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core.dist_checkpointing.strategies import filesystem_async  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

DECAY = 0.5


@pytest.fixture
def world_of_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """One gloo process, Megatron's groups at TP1/PP1 (its CPU initialization draws from torch's generator).
    TEST-ONLY: ``dist_checkpointing.save`` waits for its device-to-host copies with ``torch.cuda.synchronize()``
    and puts its failure flag on ``torch.cuda.current_device()``, which a CPU build of torch refuses: with
    tensors on the CPU there is nothing to wait for, and the flag lives on the CPU (gloo); its writer's results
    go through a plain queue, not a spawned Manager's (the save is synchronous: one process)."""
    monkeypatch.setattr(filesystem_async, "_results_queue", queue.Queue())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args, **kwargs: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    ps.initialize_model_parallel(1, 1)
    yield
    ps.destroy_model_parallel()
    dist.destroy_process_group()


def gpt(seed: int = 0, **options) -> GPTModel:
    torch.manual_seed(seed)
    config = TransformerConfig(
        num_layers=2, hidden_size=16, num_attention_heads=2, use_cpu_initialization=True, hidden_dropout=0.0,
        attention_dropout=0.0, **options,
    )  # fmt: skip
    return GPTModel(config, get_gpt_layer_local_spec(), vocab_size=32, max_sequence_length=8)


def tensors(model: GPTModel) -> dict[str, torch.Tensor]:
    """The model's state dict without Megatron's ``_extra_state`` objects (no tensors)."""
    return {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


def stepped(model: GPTModel, step: int) -> None:
    """A stand-in optimizer step: every weight moves, differently per step."""
    generator = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator))


def averaged(model: GPTModel, steps: int) -> tuple[WeightAverager, dict[str, torch.Tensor]]:
    """An averager updated ``steps`` times, and the reference: torch's own EMA function over copies."""
    averager = WeightAverager(model, EMA(decay=DECAY))
    ema = get_ema_multi_avg_fn(DECAY)
    reference: dict[str, torch.Tensor] = {}
    for step in range(steps):
        stepped(model, step)
        averager.update()
        live = tensors(model)
        if not reference:
            reference = {name: value.clone() for name, value in live.items()}
        else:
            names = list(reference)
            ema([reference[n] for n in names], [live[n] for n in names], step)
    return averager, reference


@pytest.mark.parametrize("gated", [False, True], ids=["gelu", "swiglu"])
def test_a_megatron_model_is_detected_and_named_as_the_full_model(
    world_of_one: None, tmp_path: Path, gated: bool
) -> None:
    """SwiGLU's fc1 is described by a ShardedTensorFactory (its two halves): read through what it builds."""
    model = gpt(gated_linear_unit=gated)
    assert shardavg.detect(model) == "megatron"
    averager, reference = averaged(model, 3)
    assert averager.strategy.name == "megatron"
    assert [info.name for info in averager.tensors] == list(reference)  # every tensor, the model's names
    assert averager.layout.gathered == ()  # derived from Megatron's groups, nothing gathered
    exported = load_file(str(averager.export(tmp_path / "export") / "model.safetensors"))
    fresh = gpt(seed=1, gated_linear_unit=gated)
    missing, unexpected = fresh.load_state_dict(exported, strict=False)
    assert not unexpected and all(name.endswith("._extra_state") for name in missing), (missing, unexpected)
    for name, value in reference.items():
        assert torch.equal(exported[name], value), name


def test_the_average_in_megatrons_own_checkpoints(world_of_one: None, tmp_path: Path) -> None:
    """``prefix=""``: a model checkpoint ``dist_checkpointing.load(model.sharded_state_dict())`` reads;
    ``"ema."`` beside the model, restored through the averager's own template with its counters."""
    model = gpt()
    averager, reference = averaged(model, 3)
    (tmp_path / "average").mkdir()
    dist_checkpointing.save(averager.sharded_state_dict(prefix=""), str(tmp_path / "average"))
    fresh = gpt(seed=1)
    missing, unexpected = fresh.load_state_dict(
        dist_checkpointing.load(fresh.sharded_state_dict(), str(tmp_path / "average")), strict=False
    )
    assert not unexpected and all(name.endswith("._extra_state") for name in missing), (missing, unexpected)
    assert all(torch.equal(tensors(fresh)[name], value) for name, value in reference.items())

    (tmp_path / "both").mkdir()
    dist_checkpointing.save({**model.sharded_state_dict(), **averager.sharded_state_dict()}, str(tmp_path / "both"))
    restored = WeightAverager(fresh, EMA(decay=DECAY))
    template = {**fresh.sharded_state_dict(), **restored.sharded_state_dict()}
    loaded = dist_checkpointing.load(template, str(tmp_path / "both"))
    restored.load_sharded_state_dict(loaded)
    assert (restored.num_updates, restored.step) == (averager.num_updates, averager.step) == (3, 3)
    assert all(torch.equal(restored.full_state_dict()[name], value) for name, value in reference.items())

    shadows = [s.clone() for s in restored.shadows()]
    with pytest.raises(CheckpointError, match=r"lacks \['ema\.shardavg\.counters'\]"):
        restored.load_sharded_state_dict({k: v for k, v in loaded.items() if "counters" not in k})
    with pytest.raises(CheckpointError, match=r"'ema\.embedding\.word_embeddings\.weight'"):
        restored.load_sharded_state_dict({k: v for k, v in loaded.items() if "word_embeddings" not in k})
    assert all(torch.equal(a, b) for a, b in zip(shadows, restored.shadows()))  # nothing changed


def test_a_prefix_that_is_not_a_str_is_refused_naming_prefix(world_of_one: None) -> None:
    """Not Python's ``TypeError`` of ``None + "key"``, which never says which argument: refused as it
    enters, naming ``prefix`` and what it takes, and nothing changes."""
    averager, _ = averaged(gpt(), 2)
    shadows = [s.clone() for s in averager.shadows()]
    for prefix in (None, 5, b"ema."):
        with pytest.raises(TypeError, match=rf"^sharded_state_dict\(prefix={re.escape(repr(prefix))}\): prefix must"):
            averager.sharded_state_dict(prefix=prefix)
        with pytest.raises(TypeError, match=r"^load_sharded_state_dict\(prefix=.*\): prefix must be a str, the one"):
            averager.load_sharded_state_dict(averager.sharded_state_dict(), prefix=prefix)
    assert averager.num_updates == 2 and all(torch.equal(a, b) for a, b in zip(shadows, averager.shadows()))


@contextlib.contextmanager
def described_otherwise(model: GPTModel, change) -> Iterator[None]:
    """The model's ``sharded_state_dict()`` passed through ``change`` (a module describing itself otherwise)."""
    original = model.sharded_state_dict
    model.sharded_state_dict = lambda *args, **kwargs: change(original(*args, **kwargs))
    yield


def test_what_the_description_does_not_place_is_refused_by_name(world_of_one: None) -> None:
    model = gpt()
    with described_otherwise(model, lambda sd: {k: v for k, v in sd.items() if k != "decoder.final_layernorm.bias"}):
        with pytest.raises(StrategyError, match=r"'decoder\.final_layernorm\.bias' of GPTModel has no ShardedTensor"):
            WeightAverager(model)

    def copied(sd: dict) -> dict:
        key = "output_layer.weight"
        return sd | {key: dataclasses.replace(sd[key], data=sd[key].data.clone())}

    model = gpt()
    with described_otherwise(model, copied):
        with pytest.raises(StrategyError, match=r"'output_layer\.weight' .*is not a parameter or persistent buffer"):
            WeightAverager(model)

    def renumbered(sd: dict) -> dict:
        return {k.replace("layers.1.mlp.linear_fc2", "layers.one.fc2"): v for k, v in sd.items()}

    model = gpt()
    with described_otherwise(model, renumbered):
        with pytest.raises(
            StrategyError, match=r"'decoder\.layers\.one\.fc2\.weight'.* 1 stacked axes but .* 0 numbered"
        ):
            WeightAverager(model)

    def factory_of_copies(sd: dict) -> dict:
        key = "decoder.layers.0.mlp.linear_fc1.weight"
        build = sd[key].build_fn
        copying = lambda k, t, replica, flat: build(k, t.clone(), replica, flat)  # noqa: E731
        return sd | {key: dataclasses.replace(sd[key], build_fn=copying)}

    model = gpt(gated_linear_unit=True)
    with described_otherwise(model, factory_of_copies):
        with pytest.raises(StrategyError, match=r"'decoder\.layers\.0\.mlp\.linear_fc1\.weight'.* not slices of"):
            WeightAverager(model)


def test_what_is_not_built_is_refused(world_of_one: None) -> None:
    with pytest.raises(StrategyError, match="DistributedOptimizer's fp32 master shards"):
        WeightAverager(gpt(), source="master")
    plain = WeightAverager(torch.nn.Linear(2, 2))
    with pytest.raises(StrategyError, match="this averager uses the 'replicated' strategy"):
        plain.sharded_state_dict()


def test_a_float16_module_is_averaged_in_fp32_under_the_inner_models_names(world_of_one: None) -> None:
    from megatron.core.transformer.module import Float16Module

    inner = gpt(bf16=True)
    wrapped = Float16Module(inner.config, inner)
    assert shardavg.detect(wrapped) == "megatron"
    averager = WeightAverager(wrapped, EMA(decay=DECAY))
    ema = get_ema_multi_avg_fn(DECAY)
    reference: dict[str, torch.Tensor] = {}
    for step in range(3):
        stepped(inner, step)
        averager.update()
        live = {name: value.float() for name, value in tensors(inner).items()}
        if reference:
            ema([reference[n] for n in live], [live[n] for n in live], step)
        reference = reference or live
    assert {s.dtype for s in averager.shadows()} == {torch.float32}  # bf16 weights, fp32 shadows
    full = averager.full_state_dict()
    assert list(full) == list(reference)
    assert all(torch.equal(full[name], value) for name, value in reference.items())


def test_several_averages_in_the_background_each_saved_under_its_own_prefix(world_of_one: None, tmp_path: Path) -> None:
    """The adapter only says where the slices are: the update pipeline (background, several averages) is the
    same; each average goes into Megatron's checkpoint under its own prefix and comes back alone."""
    model = gpt()
    averager = WeightAverager(model, {"ema": EMA(decay=DECAY), "swa": shardavg.SWA()}, background=True)
    ema, lives = get_ema_multi_avg_fn(DECAY), []
    reference: dict[str, torch.Tensor] = {}
    for step in range(3):
        stepped(model, step)
        averager.update()
        averager.wait()
        lives.append({name: value.clone() for name, value in tensors(model).items()})
        if reference:
            ema([reference[n] for n in lives[-1]], [lives[-1][n] for n in lives[-1]], step)
        reference = reference or {n: v.clone() for n, v in lives[-1].items()}
    mean = {n: torch.stack([live[n] for live in lives]).mean(0) for n in reference}
    (tmp_path / "both").mkdir()
    state = {**averager.sharded_state_dict("ema.", average="ema"), **averager.sharded_state_dict("swa.", average="swa")}
    dist_checkpointing.save(state, str(tmp_path / "both"))
    restored = WeightAverager(gpt(seed=1), {"ema": EMA(decay=DECAY), "swa": shardavg.SWA()})
    template = {
        **restored.sharded_state_dict("ema.", average="ema"),
        **restored.sharded_state_dict("swa.", average="swa"),
    }
    loaded = dist_checkpointing.load(template, str(tmp_path / "both"))
    restored.load_sharded_state_dict(loaded, "ema.", average="ema")
    restored.load_sharded_state_dict(loaded, "swa.", average="swa")
    got = {name: restored.full_state_dict(average=name) for name in ("ema", "swa")}
    assert all(torch.equal(got["ema"][n], v) for n, v in reference.items())
    assert all(torch.allclose(got["swa"][n], v, atol=1e-6) for n, v in mean.items())  # (SWA's running mean)
    assert all(torch.equal(got["swa"][n], v) for n, v in averager.full_state_dict(average="swa").items())
