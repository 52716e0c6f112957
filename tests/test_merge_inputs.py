"""``shardavg merge`` on checkpoints as other tools write them: torchtitan's DCP layouts, Transformers'
folders (tied models, carried tokenizer files, the dtype ``config.json`` declares), and an fp16
output that would overflow. References are the state dicts kept in memory (summed here in fp32)
and Transformers loading the result.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import Trainer
from harness import TiedNet
from safetensors.torch import save_file
from test_merge import read_model, reference

import shardavg
import shardavg.cli
from shardavg import EMA, WeightAverager

transformers = pytest.importorskip("transformers")


def mean(states: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The uniform average in fp32, input order; integer tensors from the last state."""
    return reference(states, [1 / len(states)] * len(states))


def assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want), sorted(set(got) ^ set(want))
    for name, value in want.items():
        assert got[name].dtype == value.dtype and torch.equal(got[name], value), name


# --------------------------------------------------------------------------- torchtitan


def flat_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer as torchtitan 0.3.0 saves it (``get_flat_optim_state_dict``): ``state.{fqn}.{key}``
    and ``param_groups.{fqn}.{key}``, keyed by the parameters' names."""
    names = {id(p): n for n, p in model.named_parameters()}
    flat = {}
    for param, state in optimizer.state.items():
        for key, value in state.items():
            flat[f"state.{names[id(param)]}.{key}"] = value
    for group in optimizer.param_groups:
        for param in group["params"]:
            for key, value in group.items():
                if key != "params":
                    flat[f"param_groups.{names[id(param)]}.{key}"] = value
    return flat


class TitanRun:
    """Steps 1..4 saved as torchtitan writes them: ``RUN/checkpoint/step-N`` holding the model's
    tensors at the top level (0.3.0, ``_flattened_model_states_sd``) beside ``optimizer`` (Adam's
    ``exp_avg``, ``exp_avg_sq``, ``step`` tensors), ``lr_scheduler``, ``dataloader`` and
    ``train_state`` (its step a tensor, as releases before 0.3 kept it); the same states under
    ``model.`` as torchtitan wrote them before 2025; and a last save of the model only in bf16
    (``last_save_model_only``, ``export_dtype``)."""

    def __init__(self, root: Path) -> None:
        torch.manual_seed(0)
        self.root, model = root, TiedNet()
        trainer = Trainer(model)
        trainer.optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.01)
        self.states = {}
        for step in range(1, 5):
            trainer.step()
            self.states[step] = {k: v.detach().clone() for k, v in model.state_dict().items()}
            training = {
                "optimizer": flat_optimizer_state(model, trainer.optimizer),
                "lr_scheduler": {"last_epoch": step},
                "dataloader": {"world_size": 1, "dp_rank_0": b"position"},
                "train_state": {"step": torch.tensor(step, dtype=torch.int32), "ntokens_seen": 40 * step},
            }
            dcp.save(self.states[step] | training, checkpoint_id=str(self.new(step)), no_dist=True)
            dcp.save({"model": self.states[step]} | training, checkpoint_id=str(self.old(step)), no_dist=True)
        self.bf16 = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in self.states[4].items()}
        dcp.save(self.bf16, checkpoint_id=str(root / "model-only" / "checkpoint" / "step-4"), no_dist=True)

    def new(self, step: int) -> Path:
        return self.root / "new" / "checkpoint" / f"step-{step}"

    def old(self, step: int) -> Path:
        return self.root / "old" / "checkpoint" / f"step-{step}"


@pytest.fixture(scope="module")
def titan(tmp_path_factory) -> TitanRun:
    return TitanRun(tmp_path_factory.mktemp("titan"))


def test_a_torchtitan_run_merges_its_model_and_never_its_optimizer(titan: TitanRun, tmp_path: Path) -> None:
    want = mean([titan.states[3], titan.states[4]])
    assert len(want) < 20  # the model alone; the checkpoint holds 3 optimizer tensors per parameter beside it
    assert_equal(read_model(shardavg.merge(titan.root / "new", tmp_path / "new", last=2)), want)
    assert_equal(read_model(shardavg.merge(titan.root / "old", tmp_path / "old", last=2)), want)
    explicit = shardavg.merge([titan.new(3), titan.new(4)], tmp_path / "top", prefix="")  # the top level, by name
    assert_equal(read_model(explicit), want)
    with_last = shardavg.merge([titan.new(3), titan.root / "model-only" / "checkpoint" / "step-4"], tmp_path / "bf16")
    assert_equal(read_model(with_last), mean([titan.states[3], titan.bf16]))
    with pytest.raises(shardavg.CheckpointError, match="'optimizer' holds training state, not a model"):
        shardavg.merge([titan.new(4)], tmp_path / "refused", prefix="optimizer.")


def test_a_model_whose_own_names_begin_with_model_is_read_whole(tmp_path: Path) -> None:
    """``dcp.save(get_model_state_dict(llama))``: top-level keys ``model.layers.0...`` and ``lm_head.weight``,
    which DCP's metadata records as top-level names, not entries under ``model``."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    class Causal(torch.nn.Module):  # named as Transformers' Llama names its modules
        def __init__(self) -> None:
            super().__init__()
            self.model = torch.nn.ModuleDict({"embed_tokens": torch.nn.Embedding(5, 3)})
            self.lm_head = torch.nn.Linear(3, 5, bias=False)

    states = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        model = Causal()
        states.append(state(model))
        sd = get_model_state_dict(model) | {"optimizer": {"state.lm_head.weight.exp_avg": torch.ones(5, 3)}}
        dcp.save(sd, checkpoint_id=str(tmp_path / f"step-{seed}"), no_dist=True)
    merged = shardavg.merge([tmp_path / "step-0", tmp_path / "step-1"], tmp_path / "out")
    assert_equal(read_model(merged), mean(states))  # lm_head.weight too, and no optimizer state


def test_include_and_exclude_pick_tensors_by_name(titan: TitanRun, tmp_path: Path) -> None:
    want = mean([titan.states[2], titan.states[4]])
    picked = shardavg.merge(
        [titan.new(2), titan.new(4)], tmp_path / "blocks", include=["block.*"], exclude=["*.norm.*"]
    )
    assert_equal(read_model(picked), {k: v for k, v in want.items() if k.startswith("block.") and ".norm." not in k})
    with pytest.raises(ValueError, match="no tensor is left to merge"):
        shardavg.merge([titan.new(2)], tmp_path / "none", include=["nothing*"])


def test_the_command_line_says_what_it_left_out(titan: TitanRun, tmp_path: Path, capsys) -> None:
    assert shardavg.cli.main(["merge", "--last", "2", str(titan.root / "new"), "--out", str(tmp_path / "o")]) == 0
    err = capsys.readouterr().err
    assert "left out" in err and "under 'optimizer'" in err and "under 'train_state'" in err, err
    assert_equal(read_model(tmp_path / "o"), mean([titan.states[3], titan.states[4]]))


# --------------------------------------------------------------------------- Transformers folders


def gpt2(seed: int, tie: bool = True, dtype: torch.dtype = torch.float32):
    config = transformers.GPT2Config(
        n_layer=1, n_embd=16, n_head=2, vocab_size=40, n_positions=8, bos_token_id=0, eos_token_id=0,
        tie_word_embeddings=tie,
    )  # fmt: skip
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(config).to(dtype)


def state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_config_declares_the_dtype_of_the_files(tmp_path: Path) -> None:
    fp32, bf16 = tmp_path / "fp32", tmp_path / "bf16"
    gpt2(0).save_pretrained(fp32)
    gpt2(1, dtype=torch.bfloat16).save_pretrained(bf16)
    assert json.loads((bf16 / "config.json").read_text())["dtype"] == "bfloat16"
    merged = shardavg.merge([fp32, bf16], tmp_path / "mixed")  # bf16 last: the merge is fp32 all the same
    assert json.loads((merged / "config.json").read_text())["dtype"] == "float32"
    loaded = transformers.GPT2LMHeadModel.from_pretrained(merged)
    assert loaded.dtype == torch.float32
    files = read_model(merged)
    assert torch.equal(loaded.transformer.h[0].attn.c_attn.weight, files["transformer.h.0.attn.c_attn.weight"])
    narrow = shardavg.merge([fp32], tmp_path / "narrow", dtype=torch.bfloat16)
    assert json.loads((narrow / "config.json").read_text())["dtype"] == "bfloat16"
    assert transformers.GPT2LMHeadModel.from_pretrained(narrow).dtype == torch.bfloat16
    older = json.loads((fp32 / "config.json").read_text())  # Transformers before 4.56 wrote torch_dtype
    older = {k: v for k, v in older.items() if k != "dtype"} | {
        "torch_dtype": "float32",
        "transformers_version": "4.46.0",
    }
    (fp32 / "config.json").write_text(json.dumps(older))
    written = json.loads((shardavg.merge([fp32], tmp_path / "older", dtype=torch.float16) / "config.json").read_text())
    assert written["torch_dtype"] == "float16" and "dtype" not in written


def test_the_trainers_export_of_a_bf16_model_declares_the_averages_dtype(tmp_path: Path) -> None:
    from shardavg.integrations.transformers import WeightAveragingCallback

    model = gpt2(0, dtype=torch.bfloat16)
    callback = WeightAveragingCallback(EMA(decay=0.9), export_dir=tmp_path / "export")  # fp32 shadows
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "run"), report_to=[], use_cpu=True)
    state, control = transformers.TrainerState(), transformers.TrainerControl()
    callback.on_train_begin(args, state, control, model=model)
    callback.on_step_end(args, state, control)
    callback.on_train_end(args, state, control, model=model)  # the model's config.json says bfloat16
    assert json.loads((tmp_path / "export" / "config.json").read_text())["dtype"] == "float32"
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "export")
    assert loaded.dtype == torch.float32
    assert torch.equal(loaded.transformer.wte.weight, model.transformer.wte.weight.float())


def test_a_tied_model_merges_with_its_own_folder_and_its_averages(tmp_path: Path) -> None:
    model = gpt2(0)
    folder = tmp_path / "hf"
    model.save_pretrained(folder)
    assert "lm_head.weight" not in read_model(folder)  # Transformers saves the tied head once
    avg = WeightAverager(model, EMA(decay=0.5))
    avg.update()
    avg.save(tmp_path / "avg")
    dcp.save(state(model), checkpoint_id=str(tmp_path / "dcp"), no_dist=True)  # both names, one value
    avg.export(tmp_path / "export")  # the library's export writes every name
    for inputs in ([tmp_path / "avg", folder], [tmp_path / "dcp", folder], [tmp_path / "export", folder]):
        out = shardavg.merge(inputs, tmp_path / f"out-{inputs[0].name}")
        merged = read_model(out)
        want = mean([state(model), state(model)])
        assert sorted(merged) == sorted(read_model(folder))  # the Hugging Face folder's names
        assert all(torch.equal(merged[n], want[n]) for n in merged)
        loaded = transformers.GPT2LMHeadModel.from_pretrained(out)
        assert torch.equal(loaded.lm_head.weight, want["transformer.wte.weight"])
    both = shardavg.merge([tmp_path / "avg", tmp_path / "dcp"], tmp_path / "no-hf")  # no folder: every name
    assert {"transformer.wte.weight", "lm_head.weight"} <= set(read_model(both))


def test_inputs_that_disagree_on_tying_are_merged_name_by_name_and_written_untied(tmp_path: Path) -> None:
    tied, untied = gpt2(0), gpt2(1, tie=False)
    tied.save_pretrained(tmp_path / "tied")
    untied.save_pretrained(tmp_path / "untied")
    assert not torch.equal(untied.lm_head.weight, untied.transformer.wte.weight)
    out = shardavg.merge([tmp_path / "untied", tmp_path / "tied"], tmp_path / "out")
    tied_state = state(tied) | {"lm_head.weight": tied.transformer.wte.weight.detach().clone()}
    want = mean([state(untied), tied_state])
    assert_equal(read_model(out), want)
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    loaded = transformers.GPT2LMHeadModel.from_pretrained(out)
    assert torch.equal(loaded.lm_head.weight, want["lm_head.weight"])
    assert torch.equal(loaded.transformer.wte.weight, want["transformer.wte.weight"])


def test_a_folders_other_files_are_carried_and_its_adapter_is_not_the_model(tmp_path: Path) -> None:
    folders = [tmp_path / "step-1", tmp_path / "step-2"]
    models = [gpt2(0), gpt2(1)]
    for folder, model in zip(folders, models):
        model.save_pretrained(folder)
        model.generation_config.save_pretrained(folder)
        (folder / "tokenizer.json").write_text('{"model": {"vocab": {"a": 0}}}')
        (folder / "chat_template.jinja").write_text("{{ messages }}")
        (folder / "README.md").write_text("the model card of the model merged from")
        save_file({"base_model.lora_A.weight": torch.ones(2, 2)}, str(folder / "adapter_model.safetensors"))
        (folder / "adapter_config.json").write_text("{}")
    out = shardavg.merge(folders, tmp_path / "out")
    assert sorted(p.name for p in out.iterdir()) == [
        "chat_template.jinja", "config.json", "generation_config.json", "model.safetensors", "provenance.json",
        "tokenizer.json",
    ]  # fmt: skip
    assert (out / "tokenizer.json").read_bytes() == (folders[-1] / "tokenizer.json").read_bytes()
    want = {k: v for k, v in mean([state(m) for m in models]).items() if k != "lm_head.weight"}  # (saved once, tied)
    assert_equal(read_model(out), want)  # the model, not the adapter
    assert json.loads((out / "config.json").read_text()) == json.loads((folders[-1] / "config.json").read_text())
    named = shardavg.merge([f / "model.safetensors" for f in folders], tmp_path / "named")  # the files named
    assert sorted(p.name for p in named.iterdir()) == sorted(p.name for p in out.iterdir())  # (their folders')
    bare = tmp_path / "bare"  # a merge into the same folder of a model without a tokenizer: the old one goes
    gpt2(2).save_pretrained(bare)
    shardavg.merge([bare], out)
    assert not (out / "tokenizer.json").exists() and not (out / "chat_template.jinja").exists()
    (folders[0] / "tokenizer.json").write_text('{"model": {"vocab": {"b": 0}}}')
    with pytest.raises(shardavg.CheckpointError, match="the inputs disagree on the tokenizer: tokenizer.json"):
        shardavg.merge(folders, tmp_path / "refused")
    assert not (tmp_path / "refused").exists()


def test_models_in_the_hugging_face_cache_merge_through_their_links(tmp_path: Path) -> None:
    """The hub cache keeps each file once in ``blobs/`` and links to it from ``snapshots/REV/``."""
    snapshots, models = [], [gpt2(0), gpt2(1)]
    for number, model in enumerate(models):
        saved, cache = tmp_path / f"saved-{number}", tmp_path / f"models--tiny-{number}"
        model.save_pretrained(saved, max_shard_size="20KB")
        (saved / "tokenizer.json").write_text("{}")
        (cache / "blobs").mkdir(parents=True)
        snapshot = cache / "snapshots" / "0123abcd"
        snapshot.mkdir(parents=True)
        for file in saved.iterdir():
            blob = cache / "blobs" / f"{number}-{file.name}"
            file.rename(blob)
            (snapshot / file.name).symlink_to(Path("../../blobs") / blob.name)
        snapshots.append(snapshot)
    out = shardavg.merge(snapshots, tmp_path / "out")
    want = {k: v for k, v in mean([state(m) for m in models]).items() if k != "lm_head.weight"}
    assert_equal(read_model(out), want)
    assert (out / "tokenizer.json").is_file() and not (out / "tokenizer.json").is_symlink()
    assert not (out / "config.json").is_symlink()
    assert torch.equal(transformers.GPT2LMHeadModel.from_pretrained(out).lm_head.weight, want["transformer.wte.weight"])


def test_pickled_weights_are_refused_with_the_conversion_named(tmp_path: Path) -> None:
    folder = tmp_path / "bin"
    gpt2(0).save_pretrained(folder)
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")  # (its bytes matter not: never read)
    with pytest.raises(shardavg.CheckpointError, match="pytorch_model.bin, a pickle, which shardavg never loads"):
        shardavg.merge([folder], tmp_path / "out")
    adapter_only = tmp_path / "adapter"
    adapter_only.mkdir()
    save_file({"lora_A": torch.ones(2)}, str(adapter_only / "adapter_model.safetensors"))
    with pytest.raises(shardavg.CheckpointError, match="holds a PEFT adapter"):
        shardavg.merge([adapter_only], tmp_path / "out")


# --------------------------------------------------------------------------- fp16 overflow


def test_an_fp16_output_that_overflows_is_refused_by_name(tmp_path: Path, capsys) -> None:
    big = tmp_path / "big"
    big.mkdir()
    save_file({"w": torch.tensor([70000.0, 2.0, -90000.0]), "b": torch.ones(2)}, str(big / "model.safetensors"))
    with pytest.raises(shardavg.ExportError, match=r"w: 2 values overflow float16 \(largest magnitude 90000"):
        shardavg.merge([big], tmp_path / "out", dtype=torch.float16)
    assert not (tmp_path / "out").exists()
    earlier = shardavg.merge([big], tmp_path / "earlier", max_shard_size=4)  # one file per tensor, an index
    before = {p.name: p.read_bytes() for p in earlier.iterdir()}
    with pytest.raises(shardavg.ExportError, match="overflow float16"):  # found before anything is written
        shardavg.merge([big], earlier, dtype=torch.float16, max_shard_size=4)
    assert {p.name: p.read_bytes() for p in earlier.iterdir()} == before
    assert read_model(shardavg.merge([big], tmp_path / "bf16", dtype=torch.bfloat16))["w"].isfinite().all()
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    with torch.no_grad():
        model[1].weight.fill_(1e5)
    avg = WeightAverager(model, EMA(decay=0.5))
    avg.update()
    with pytest.raises(shardavg.ExportError, match="weight: 4 values overflow float16"):
        avg.export(tmp_path / "export", dtype=torch.float16)
    assert not (tmp_path / "export").exists()
    earlier = avg.export(tmp_path / "earlier", max_shard_size=4)  # a file per tensor, the large one last
    before = {p.name: p.read_bytes() for p in earlier.iterdir()}
    with pytest.raises(shardavg.ExportError, match="weight: 4 values overflow float16"):
        avg.export(earlier, dtype=torch.float16, max_shard_size=4)  # two files written, then the refusal
    assert {p.name: p.read_bytes() for p in earlier.iterdir()} == before
    avg.save(tmp_path / "ckpt")
    assert shardavg.cli.main(["export", str(tmp_path / "ckpt"), str(tmp_path / "cli"), "--dtype", "float16"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "weight: 4 values overflow float16" in err, err
