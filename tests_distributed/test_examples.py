"""Every script of ``examples/`` run as a user runs it (torchrun, CPU, gloo; Megatron-Core's with the test-only
CPU shims of ``megatron_cpu/`` applied from outside it) at a tiny size, and its
results checked from the outside: exports loaded with ``strict=True`` into the example's own plain
model, a resumed run going on from its checkpoint (bitwise where the example's loop allows), the
post-hoc sweep's choice, the merge against a mean computed here."""

from __future__ import annotations

import importlib.util
import re
import sys
import types
from pathlib import Path

import pytest
import torch
from launcher import Launch, torchrun
from safetensors.torch import load_file

pytestmark = pytest.mark.slow  # a torchrun launch: python -m pytest -m "not slow" leaves it out

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def run(script: str, nproc: int, out: Path, *args: str, timeout: float = 180, env: dict | None = None) -> str:
    """Launch ``examples/<script>`` and return its output, failing with its tail if it failed."""
    launch: Launch = torchrun(str(EXAMPLES / script), nproc, "--out", str(out), *args, timeout=timeout, env=env)
    assert launch.returncode == 0, launch.output[-20000:]
    return launch.output


def example(script: str) -> types.ModuleType:
    """The example as a module (its model classes), under a name of its own."""
    name = f"example_{script.removesuffix('.py')}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, EXAMPLES / script)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def load_strictly(folder: Path, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The export in ``folder``, loaded into ``model`` with strict=True; every value finite."""
    tensors = load_file(str(folder / "model.safetensors"))
    model.load_state_dict(tensors, strict=True)
    assert all(torch.isfinite(t).all() for t in tensors.values() if t.is_floating_point()), folder
    return tensors


# Megatron-Core has no trainer to lean on: its recipe builds the model, reduces and clips the gradients
# and lays out the checkpoint itself, as Megatron-LM's training loop does.
LONGER = {"megatron_gpt.py": 190}


def test_the_examples_are_short_marked_and_stand_alone() -> None:
    scripts = sorted(EXAMPLES.glob("*.py"))
    assert len(scripts) == 9, scripts
    readme = (EXAMPLES / "README.md").read_text()
    for script in scripts:
        text = script.read_text()
        lines = len(text.splitlines())
        assert lines <= LONGER.get(script.name, 125), f"{script.name}: {lines} lines"
        assert f"examples/{script.name}" in text.split('"""')[1], f"{script.name}: no command in its docstring"
        assert "# shardavg" in text, script.name
        assert not re.search(r"sys\.path|from (launch|tests|harness)|import (launch|harness)", text), script.name
        assert f"({script.name})" in readme, f"examples/README.md does not list {script.name}"


def test_fsdp2_dcp_resumes_bitwise_and_exports(tmp_path: Path) -> None:
    args = ("--save-every", "2", "--dim", "16")
    run("fsdp2_dcp.py", 2, tmp_path / "a", "--steps", "4", *args)
    resumed = run("fsdp2_dcp.py", 2, tmp_path / "a", "--steps", "6", *args)
    assert re.search(r"resumed from \S+step-000004 at step 4 \(average of 4 updates\)", resumed), resumed[-3000:]
    assert "done at step 6: 6 updates" in resumed, resumed[-3000:]
    run("fsdp2_dcp.py", 2, tmp_path / "b", "--steps", "6", *args)  # the same 6 steps, uninterrupted
    net = example("fsdp2_dcp.py").Net
    got = load_strictly(tmp_path / "a" / "ema", net(16))
    want = load_strictly(tmp_path / "b" / "ema", net(16))
    assert all(torch.equal(got[k], want[k]) for k in want), "the resumed run's average differs"
    steps = sorted(p.name for p in (tmp_path / "a" / "checkpoints").iterdir())
    assert steps == ["step-000002", "step-000004", "step-000006"], steps


def test_fsdp2_tp_on_a_2x2_mesh_exports_the_whole_model(tmp_path: Path) -> None:
    output = run("fsdp2_tp.py", 4, tmp_path, "--tp", "2", "--steps", "3", "--dim", "16", timeout=240)
    assert "mesh (2, 2) (dp, tp)" in output and "_StridedShard" in output, output[-3000:]
    load_strictly(tmp_path / "ema", example("fsdp2_tp.py").Net(dim=16))


# Imported at start-up from PYTHONPATH: DeepSpeed's CPU accelerator then says it lacks oneDNN fp16, as on
# CPUs where zero.Init(dtype=torch.float32) partitions in bf16 (DeepSpeed 0.19's Init._set_dtype).
WITHOUT_FP16 = """
import importlib.abc, importlib.machinery, sys

class WithoutFp16(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "deepspeed.accelerator.cpu_accelerator":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            module.CPU_Accelerator.is_fp16_supported = lambda self: False
            print("WITHOUT_FP16 in effect", flush=True)

        spec.loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, WithoutFp16())
"""


def test_deepspeed_zero3_resumes_from_latest_in_fp32_on_any_cpu_and_exports(tmp_path: Path) -> None:
    args = ("--save-every", "2", "--dim", "16")
    first = run("deepspeed_zero3.py", 2, tmp_path, "--steps", "2", *args)  # this CPU's own fp16 answer
    (tmp_path / "without-fp16").mkdir()
    (tmp_path / "without-fp16" / "sitecustomize.py").write_text(WITHOUT_FP16)
    without = {"PYTHONPATH": str(tmp_path / "without-fp16")}
    output = run("deepspeed_zero3.py", 2, tmp_path, "--steps", "4", *args, env=without)  # and the other one
    assert "WITHOUT_FP16 in effect" in output and "resumed at step 2 (average of 2 updates)" in output, output[-3000:]
    for launch in (first, output):
        assert "partitions held in ['torch.float32']" in launch, launch[-3000:]
    assert "done at step 4: 4 updates" in output, output[-3000:]
    checkpoints = tmp_path / "checkpoints"
    assert (checkpoints / "latest").read_text() == "global_step4"
    assert (checkpoints / "global_step4" / "shardavg" / "shardavg.json").is_file()
    tensors = load_strictly(tmp_path / "ema", example("deepspeed_zero3.py").Net(16))
    assert {t.dtype for t in tensors.values()} == {torch.float32}


def test_accelerate_resumes_with_the_average_and_exports(tmp_path: Path) -> None:
    args = ("--save-every", "2", "--dim", "16")
    run("accelerate_fsdp.py", 2, tmp_path, "--steps", "2", *args)
    output = run("accelerate_fsdp.py", 2, tmp_path, "--steps", "4", *args)
    assert re.search(r"resumed from \S+step-000002 at step 2 \(average of 2 updates\)", output), output[-3000:]
    assert "with 2 processes" in output and "done at step 4" in output, output[-3000:]
    assert (tmp_path / "checkpoints" / "step-000004" / "shardavg" / "shardavg.json").is_file()
    load_strictly(tmp_path / "ema", example("accelerate_fsdp.py").Net(16))


def test_hf_trainer_evaluates_the_average_resumes_and_exports_a_from_pretrained_folder(tmp_path: Path) -> None:
    from transformers import GPT2LMHeadModel

    args = ("--save-every", "2", "--dim", "16")
    run("hf_trainer.py", 2, tmp_path, "--steps", "2", *args, timeout=240)
    output = run("hf_trainer.py", 2, tmp_path, "--steps", "4", *args, timeout=240)
    for key in ("eval_loss", "eval_avg_loss"):  # the average evaluated beside the model, at the last step too
        assert re.search(rf"step 4: {key} \d+\.\d+", output), output[-3000:]
    assert re.search(r"done at step 4: resumed from \S+checkpoint-2, 4 updates", output), output[-3000:]
    kept = sorted(p.name for p in (tmp_path / "trainer").glob("checkpoint-*"))
    assert kept == ["checkpoint-2", "checkpoint-4"], kept
    assert all((tmp_path / "trainer" / k / "shardavg" / "shardavg.json").is_file() for k in kept)
    model = GPT2LMHeadModel.from_pretrained(tmp_path / "ema")
    exported = load_file(str(tmp_path / "ema" / "model.safetensors"))
    assert all(torch.equal(model.state_dict()[k], v) for k, v in exported.items())
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_lightning_fsdp2_validates_on_the_average_resumes_and_exports(tmp_path: Path) -> None:
    args = ("--save-every", "2", "--dim", "16")
    run("lightning_fsdp.py", 2, tmp_path, "--steps", "2", *args, timeout=240)
    output = run("lightning_fsdp.py", 2, tmp_path, "--steps", "4", *args, timeout=240)
    assert re.search(r"val_loss of the average \d+\.\d+", output), output[-3000:]
    assert re.search(r"done at step 4: resumed from \S+last\.ckpt, 4 updates", output), output[-3000:]
    assert (tmp_path / "checkpoints" / "last.ckpt.shardavg" / "shardavg.json").is_file()
    load_strictly(tmp_path / "ema", example("lightning_fsdp.py").LitNet(16))


def test_posthoc_sweep_picks_the_best_sigma_rel_and_exports_what_the_cli_synthesizes(tmp_path: Path) -> None:
    from shardavg.cli import main as cli

    output = run("posthoc_sweep.py", 2, tmp_path, "--steps", "24", "--snapshot-every", "4", "--dim", "16")
    losses = {float(s): float(v) for s, v in re.findall(r"sigma_rel ([\d.]+): held-out loss ([\d.]+)", output)}
    assert len(losses) >= 3, output[-3000:]  # several lengths synthesized (those the snapshots fit)
    (best,) = re.findall(r"best sigma_rel ([\d.]+)", output)
    assert float(best) == min(losses, key=losses.__getitem__), (best, losses)
    got = load_strictly(tmp_path / f"ema-{best}", example("posthoc_sweep.py").Net(16))
    assert cli(["posthoc", str(tmp_path / "snapshots"), str(tmp_path / "offline"), "--sigma-rel", best]) == 0
    want = load_file(str(tmp_path / "offline" / "model.safetensors"))  # one process, from the snapshots on disk
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_merge_last_is_the_mean_of_the_newest_checkpoints(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    args = ("--steps", "8", "--save-every", "2", "--keep", "3", "--last", "2", "--dim", "16")
    output = run("merge_last.py", 2, tmp_path, *args)
    assert "merged the last 2" in output, output[-3000:]
    checkpoints = tmp_path / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-000004", "step-000006", "step-000008"]
    models = []
    for name in ("step-000006", "step-000008"):  # read here with DCP itself, in this process
        dcp_to_torch_save(checkpoints / name, tmp_path / f"{name}.pt")
        models.append(torch.load(tmp_path / f"{name}.pt", weights_only=True)["model"])
    got = load_strictly(tmp_path / "lawa-model", example("merge_last.py").Net(16))
    assert set(got) == set(models[0])
    for key, value in got.items():
        torch.testing.assert_close(value, (models[0][key] + models[1][key]) / 2, rtol=1e-6, atol=1e-7)
        assert not torch.equal(value, models[1][key]), f"{key}: the newest checkpoint, not the mean"


# Megatron's names for what the full model's state dict calls a layer's norms (its local spec maps them so)
NORMS = {
    "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
    "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
}


def megatron_key(name: str) -> tuple[str, int | None]:
    """The key a Megatron checkpoint stores the full model's ``name`` under, and its layer (the stacked index)."""
    found = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", name)
    if not found:
        return name, None
    rest = found[2]
    for norm, key in NORMS.items():
        rest = rest.replace(norm, key) if rest.startswith(norm) else rest
    return f"decoder.layers.{rest}", int(found[1])


def test_megatron_gpt_exports_and_checkpoints_the_average_at_tp2(tmp_path: Path) -> None:
    """On CPU, Megatron-Core needs test-only shims (``megatron_cpu/sitecustomize.py``, applied from outside
    the recipe): the export holds the full model under its own names, equal to the average Megatron's own
    checkpoint holds under ``ema.``, which differs from the raw weights beside it."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    shims = {"PYTHONPATH": str(Path(__file__).resolve().parent / "megatron_cpu")}
    args = ("--tp", "2", "--steps", "4", "--save-every", "2", "--layers", "2", "--dim", "32")
    output = run("megatron_gpt.py", 2, tmp_path, *args, env=shims)
    assert output.count("MEGATRON_CPU shims in effect") == 2, output[-3000:]
    assert "done at iteration 4: 4 updates" in output, output[-3000:]
    checkpoints = tmp_path / "checkpoints"
    assert (checkpoints / "latest_checkpointed_iteration.txt").read_text() == "4"
    assert sorted(p.name for p in checkpoints.glob("iter_*")) == ["iter_0000002", "iter_0000004"]
    dcp_to_torch_save(checkpoints / "iter_0000004", tmp_path / "iter.pt")  # Megatron's torch_dist: a DCP folder
    saved = torch.load(tmp_path / "iter.pt", weights_only=True)
    exported = load_file(str(tmp_path / "ema" / "model.safetensors"))
    layer = {
        f"decoder.layers.{i}.{part}" for i in range(2) for part in ("mlp.linear_fc1.weight", "input_layernorm.bias")
    }
    assert layer | {"embedding.word_embeddings.weight"} <= exported.keys(), sorted(exported)
    assert "output_layer.weight" not in exported  # tied: the full model's state dict names the word embeddings only
    assert exported["embedding.word_embeddings.weight"].shape == (128, 32)  # the whole vocabulary, not a TP slice
    assert exported["decoder.layers.1.mlp.linear_fc1.weight"].shape == (2 * 4 * 32, 32)  # SwiGLU's w and v
    for name, value in exported.items():
        key, index = megatron_key(name)
        ema, raw = saved[f"ema.{key}"], saved[key]
        ema, raw = (ema, raw) if index is None else (ema[index], raw[index])
        assert torch.equal(value, ema), f"{name}: the export differs from the checkpoint's ema.{key}"
        assert not torch.equal(value, raw), f"{name}: the average is the raw weights"
    assert len(exported) == 2 + 2 + 2 * 12, sorted(exported)  # embeddings, final norm, 2 layers
