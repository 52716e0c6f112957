"""The Hugging Face Trainer callback in one process: an average is never paired with other weights
on resume (a copied checkpoint, an earlier run's folder at the same step, a checkpoint without
an average), and the export is what ``from_pretrained`` loads, the best checkpoint's average with
``load_best_model_at_end``; more than one process taking itself for the Trainer's process zero (of
the run, or of one node with ``save_on_each_node``) is refused under ``save_total_limit``. (Training
under DDP and ZeRO-3, and that refusal under ZeRO-3, are tested under torchrun.)"""

from __future__ import annotations

import shutil
import socket
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[transformers]')")
pytest.importorskip("accelerate", reason="accelerate is not installed (pip install -e '.[transformers]')")
from scenario_hf_trainer import Tokens, tiny_gpt2  # noqa: E402
from transformers import GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402

import shardavg.integrations.transformers as hf  # noqa: E402
from shardavg import EMA, CheckpointError  # noqa: E402
from shardavg.integrations.transformers import WeightAveragingCallback, with_weight_averaging  # noqa: E402
from shardavg.offline.saved_average import SavedAverage  # noqa: E402

STEPS = 6


def trainer(out: Path, data_seed: int = 1, steps: int = STEPS, **extra) -> Trainer:
    args = TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=4, per_device_eval_batch_size=4, max_steps=steps,
        learning_rate=1e-2, lr_scheduler_type="constant", save_strategy="steps", save_steps=2, eval_strategy="steps",
        eval_steps=2, logging_steps=2, report_to=[], seed=0, use_cpu=True, disable_tqdm=True, **extra,
    )  # fmt: skip
    return Trainer(model=tiny_gpt2(), args=args, train_dataset=Tokens(64, data_seed), eval_dataset=Tokens(8, 2))


@pytest.fixture(scope="module")
def first(tmp_path_factory) -> tuple[Path, dict]:
    """One run of 6 steps (checkpoints 2, 4, 6), keeping the best by eval loss."""
    root = tmp_path_factory.mktemp("hf")
    run = trainer(root / "out", load_best_model_at_end=True, metric_for_best_model="eval_loss")
    with_weight_averaging(run, EMA(decay=0.9), export_dir=root / "export")
    run.train()
    return root, {"best": run.state.best_model_checkpoint}


def test_the_export_is_the_best_checkpoints_average_and_loads_with_from_pretrained(first) -> None:
    root, seen = first
    exported = load_file(str(root / "export" / "model.safetensors"))
    best = SavedAverage(Path(seen["best"]) / "shardavg")
    assert all(torch.equal(exported[name], best.read(name)) for name in best.tensors if name in exported)
    model = GPT2LMHeadModel.from_pretrained(root / "export")  # config.json written beside the weights
    assert torch.equal(model.transformer.wte.weight, exported["transformer.wte.weight"])


def test_resuming_from_a_copy_loads_the_copys_average_not_an_earlier_runs(first, tmp_path) -> None:
    root, seen = first
    copy = tmp_path / "copy" / "checkpoint-4"
    shutil.copytree(root / "out" / "checkpoint-4", copy)
    other = trainer(tmp_path / "out", data_seed=7, steps=4)  # an earlier run left output_dir/checkpoint-4
    with_weight_averaging(other, EMA(decay=0.9))
    other.train()
    resumed = trainer(tmp_path / "out")
    averaging = with_weight_averaging(resumed, EMA(decay=0.9))
    resumed.train(resume_from_checkpoint=str(copy))
    want = SavedAverage(root / "out" / "checkpoint-6" / "shardavg")  # the uninterrupted run's, at the end
    got = averaging.averager.full_state_dict()
    assert all(torch.equal(got[name], want.read(name)) for name in want.tensors)  # before: off by 8e-2

    unbound = trainer(tmp_path / "out")  # a callback that cannot see the path looks in output_dir: refused
    unbound.add_callback(WeightAveragingCallback(EMA(decay=0.9)))
    shutil.rmtree(tmp_path / "out" / "checkpoint-6")  # (the resumed run's, so that checkpoint-4 is the other run's)
    with pytest.raises(
        CheckpointError, match=r"checkpoint-4 is not the checkpoint the Trainer resumed .*bind|with_weight"
    ):
        unbound.train(resume_from_checkpoint=str(copy))


def test_a_checkpoint_without_its_average_is_refused_or_restarted_with_strict_false(first, tmp_path) -> None:
    root, _ = first
    bare = tmp_path / "bare" / "checkpoint-4"
    shutil.copytree(root / "out" / "checkpoint-4", bare, ignore=shutil.ignore_patterns("shardavg"))
    refusing = trainer(tmp_path / "refusing")
    with_weight_averaging(refusing, EMA(decay=0.9))
    with pytest.raises(CheckpointError, match=r"holds no average \(shardavg/\): copy it with the checkpoint.*strict"):
        refusing.train(resume_from_checkpoint=str(bare))
    restarting = trainer(tmp_path / "restarting")
    averaging = with_weight_averaging(restarting, EMA(decay=0.9), strict=False)
    with pytest.warns(UserWarning, match="holds no average: restarted from the loaded weights"):
        restarting.train(resume_from_checkpoint=str(bare))
    assert (averaging.averager.step, averaging.averager.num_updates) == (STEPS, 1 + STEPS - 4)


def test_an_unbound_callback_says_once_that_eval_avg_needs_binding(tmp_path) -> None:
    run = trainer(tmp_path / "out", steps=4)
    run.add_callback(WeightAveragingCallback(EMA(decay=0.9)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run.train()
    said = [str(w.message) for w in caught if "not bound to its Trainer" in str(w.message)]
    assert len(said) == 1 and "with_weight_averaging" in said[0], said


def test_an_average_not_saved_with_its_checkpoint_is_refused(first, tmp_path) -> None:
    root, _ = first
    mixed = tmp_path / "mixed" / "checkpoint-4"
    shutil.copytree(root / "out" / "checkpoint-4", mixed, ignore=shutil.ignore_patterns("shardavg"))
    shutil.copytree(root / "out" / "checkpoint-2" / "shardavg", mixed / "shardavg")  # another checkpoint's
    run = trainer(tmp_path / "out")
    with_weight_averaging(run, EMA(decay=0.9))
    with pytest.raises(CheckpointError, match=r"shardavg was not saved with .*checkpoint-4 \(its average is of step 2"):
        run.train(resume_from_checkpoint=str(mixed))


def two_processes_zero(monkeypatch) -> None:
    """What the callback sees on each of 2 ranks when accelerate takes every one for process 0 of 1
    (DeepSpeed on a machine without GPUs): both ranks' ``should_save`` true."""
    monkeypatch.setattr(hf, "distributed", lambda: True, raising=False)  # (absent before the check)
    monkeypatch.setattr(hf, "world_size", lambda: 2, raising=False)
    monkeypatch.setattr(hf, "all_gathered", lambda value: [value, value], raising=False)


def test_every_rank_rotating_checkpoints_is_refused_before_anything_is_written(tmp_path, monkeypatch) -> None:
    # Each rank would run the Trainer's rotate_checkpoints(use_mtime=True) on output_dir at once: one
    # rank's rmtree of checkpoint-3 makes it the newest by mtime to the other, which deletes checkpoint-6
    # (under load: a run kept only checkpoint-8 of a limit of 2). Before: trained, saved and rotated.
    two_processes_zero(monkeypatch)
    run = trainer(tmp_path / "out", steps=4, save_total_limit=2)
    with_weight_averaging(run, EMA(decay=0.9))
    with pytest.raises(CheckpointError) as refused:
        run.train()
    said = str(refused.value)
    assert "ranks [0, 1] of 2 each take themselves for the Trainer's process zero" in said, said
    assert f"rotates the checkpoints in {tmp_path / 'out'} at once" in said and "save_total_limit=2 keeps" in said, said
    assert 'PartialState(backend="gloo")' in said and '"use_configured_state": True' in said, said
    assert not list((tmp_path / "out").glob("checkpoint-*"))  # refused before the first step


def test_every_rank_saving_without_a_limit_is_said_once_per_run(tmp_path, monkeypatch) -> None:
    two_processes_zero(monkeypatch)
    run = trainer(tmp_path / "out", steps=2)
    averaging = with_weight_averaging(run, EMA(decay=0.9))
    with pytest.warns(UserWarning, match=r"each writes the same checkpoint files in .*out.*use_configured_state"):
        run.train()
    assert averaging.averager.num_updates == 2


def test_both_ranks_of_one_node_rotating_with_save_on_each_node_is_refused(tmp_path, monkeypatch) -> None:
    # Every rank is then also its node's local process zero: both ranks of this machine would rotate
    # output_dir as above. Before: the check trusted save_on_each_node, and the run trained.
    two_processes_zero(monkeypatch)
    run = trainer(tmp_path / "out", steps=4, save_total_limit=2, save_on_each_node=True)
    with_weight_averaging(run, EMA(decay=0.9))
    with pytest.raises(CheckpointError) as refused:
        run.train()
    said = str(refused.value)
    node = f"ranks [0, 1] on host {socket.gethostname()} (of 2) each take themselves for the Trainer's process zero"
    assert f"{node} of their node (save_on_each_node=True expects one per node" in said, said
    assert "save_total_limit=2 keeps" in said and '"use_configured_state": True' in said, said
    assert not list((tmp_path / "out").glob("checkpoint-*"))


def test_one_saver_on_each_node_with_save_on_each_node_trains_without_a_word(tmp_path, monkeypatch) -> None:
    # Two nodes (this machine and another), each with its local process zero saving: what
    # save_on_each_node asks for, so neither refused nor warned about.
    two_processes_zero(monkeypatch)
    monkeypatch.setattr(hf, "all_gathered", lambda value: [value, ("another-node", value[1])])
    run = trainer(tmp_path / "out", steps=4, save_total_limit=2, save_on_each_node=True)
    averaging = with_weight_averaging(run, EMA(decay=0.9))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run.train()
    assert not [w for w in caught if "process zero" in str(w.message)], [str(w.message) for w in caught]
    assert averaging.averager.num_updates == 4
