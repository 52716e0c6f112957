"""``ShardedWeightAveraging``'s options that Lightning's and NeMo's own callbacks have, in one process
on the CPU, against Lightning 2.6's ``WeightAveraging`` and ``EMAWeightAveraging`` on the same
training: ``should_update`` asked with the same arguments at the same points (after each optimizer
step, at each epoch's end), so that their SWA recipe (one update an epoch) and
``update_starting_at_epoch`` give bitwise the same average; ``validate_original_weights``; and
``checkpoint_weights="average"``, whose checkpoint's ``state_dict`` is bitwise Lightning's callback's
and resumes bitwise. Lightning's side averages with torch's ``multi_avg_fn`` (the lerp shardavg
applies), not its default per-tensor function, so that the two are comparable bit for bit. (The same option
under FSDP at 2 processes: tests_distributed/test_lightning.py.)"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning", reason="lightning is not installed (pip install -e '.[lightning]')")
import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import EMAWeightAveraging, ModelCheckpoint, WeightAveraging  # noqa: E402
from torch.optim.swa_utils import get_ema_multi_avg_fn, get_swa_multi_avg_fn  # noqa: E402

from shardavg import CheckpointError  # noqa: E402
from shardavg.integrations.lightning import ShardedWeightAveraging, live_sidecar, sidecar  # noqa: E402

DECAY = 0.8
EPOCHS = 3  # of 4 optimizer steps each


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(4, 2)
        self.validated: list[torch.Tensor] = []  # the weight each validation ran with

    def training_step(self, batch, index):
        return self.layer(batch[0]).pow(2).mean()

    def validation_step(self, batch, index):
        self.validated.append(self.layer.weight.detach().clone())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def data(count: int = 16) -> torch.utils.data.DataLoader:
    inputs = torch.randn(count, 4, generator=torch.Generator().manual_seed(1))
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(inputs), batch_size=4)


def fit(callbacks: list, validate: bool = False, ckpt_path: str | None = None, **options) -> Tiny:
    """Train a new ``Tiny`` for ``EPOCHS`` epochs (validating at each epoch's end), from ``ckpt_path``."""
    module = Tiny()
    trainer = L.Trainer(
        max_epochs=EPOCHS, callbacks=callbacks, accelerator="cpu", logger=False, enable_progress_bar=False,
        enable_model_summary=False, **{"enable_checkpointing": False, **options},
    )  # fmt: skip
    trainer.fit(module, data(), data(4) if validate else None, ckpt_path=ckpt_path)
    return module


def their_ema(**options) -> EMAWeightAveraging:
    """Lightning's ``EMAWeightAveraging``, its schedule as it is, averaging with torch's lerp
    (``get_ema_multi_avg_fn``) in place of its per-tensor ``decay * ema + (1 - decay) * live``,
    which rounds differently (torch refuses both functions at once: the one it passes is replaced)."""
    callback = EMAWeightAveraging(use_buffers=False, **options)
    callback._kwargs = {"multi_avg_fn": get_ema_multi_avg_fn(options["decay"])}  # AveragedModel's, built at setup
    return callback


def theirs_average(callback: WeightAveraging) -> torch.Tensor:
    return callback._average_model.module.layer.weight.detach()


def ours_average(callback: ShardedWeightAveraging) -> torch.Tensor:
    return callback.averager.full_state_dict()["layer.weight"]


# ----------------------------------------------------------------------------- when it updates


class TheirSWA(WeightAveraging):
    """Lightning's SWA recipe: one update at the end of each epoch from the second on."""

    def __init__(self) -> None:
        super().__init__(use_buffers=False, multi_avg_fn=get_swa_multi_avg_fn())
        self.asked: list[tuple] = []

    def should_update(self, step_idx=None, epoch_idx=None) -> bool:
        self.asked.append((step_idx, epoch_idx))
        return epoch_idx is not None and epoch_idx >= 1


class OurSWA(ShardedWeightAveraging):
    """The same recipe, the same lines."""

    def __init__(self) -> None:
        super().__init__(rule=get_swa_multi_avg_fn())
        self.asked: list[tuple] = []

    def should_update(self, step_idx=None, epoch_idx=None) -> bool:
        self.asked.append((step_idx, epoch_idx))
        return epoch_idx is not None and epoch_idx >= 1


def test_lightnings_swa_recipe_runs_unchanged_and_gives_its_average() -> None:
    theirs, ours = TheirSWA(), OurSWA()
    fit([theirs])
    fit([ours])
    assert ours.asked == theirs.asked  # after each of the 12 steps, then at each epoch's end
    assert ours.asked.count((None, 2)) == 1 and len(ours.asked) == 4 * EPOCHS + EPOCHS
    assert (ours.averager.num_updates, ours.averager.step) == (EPOCHS - 1, 4 * EPOCHS)
    assert torch.equal(ours_average(ours), theirs_average(theirs))


@pytest.mark.parametrize(("every", "first_epoch"), [(2, 1), (0, 0)])
def test_update_starting_at_epoch_as_ema_weight_averaging(every: int, first_epoch: int) -> None:
    """Steps 0, 2, 4, ... and the ends of epochs 1 and 2 (never the same weights twice); with
    ``update_every_n_steps=0`` the epochs' ends only."""
    options = {"decay": DECAY, "update_every_n_steps": every, "update_starting_at_epoch": first_epoch}
    theirs = their_ema(**options)
    ours = ShardedWeightAveraging(**options)
    fit([theirs])
    fit([ours])
    step_updates = 4 * EPOCHS // every if every else 0
    assert ours.averager.num_updates == step_updates + EPOCHS - first_epoch
    assert torch.equal(ours_average(ours), theirs_average(theirs))


def test_an_epoch_whose_last_step_updated_is_not_averaged_again() -> None:
    """Lightning's callback would average the epoch's last weights a second time; here one update a step."""
    ours = ShardedWeightAveraging(decay=DECAY, update_starting_at_epoch=0)
    steps_only = their_ema(decay=DECAY)
    fit([ours])
    fit([steps_only])
    assert ours.averager.num_updates == 4 * EPOCHS
    assert torch.equal(ours_average(ours), theirs_average(steps_only))


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize("original", [False, True])
def test_validate_original_weights(original: bool) -> None:
    """The last validation (after the last step) ran on the average, or with the option on the live weights."""
    ours = ShardedWeightAveraging(decay=DECAY, validate_original_weights=original)
    module = fit([ours], validate=True, num_sanity_val_steps=0)
    assert len(module.validated) == EPOCHS
    live, average = module.layer.weight.detach(), ours_average(ours)
    assert not torch.equal(live, average)
    assert torch.equal(module.validated[-1], live if original else average)


def test_the_trainers_callback_evaluates_the_live_weights_only_with_validate_original_weights(tmp_path) -> None:
    pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[transformers]')")
    from scenario_hf_trainer import Tokens, tiny_gpt2
    from transformers import Trainer, TrainingArguments

    from shardavg import EMA
    from shardavg.integrations.transformers import with_weight_averaging

    for original in (False, True):
        args = TrainingArguments(
            output_dir=str(tmp_path / str(original)), per_device_train_batch_size=4, per_device_eval_batch_size=4,
            max_steps=2, eval_strategy="steps", eval_steps=2, save_strategy="no", report_to=[], use_cpu=True,
            disable_tqdm=True,
        )  # fmt: skip
        trainer = Trainer(model=tiny_gpt2(), args=args, train_dataset=Tokens(8, 1), eval_dataset=Tokens(4, 2))
        with_weight_averaging(trainer, EMA(decay=DECAY), validate_original_weights=original)
        trainer.train()
        evaluated = {key for entry in trainer.state.log_history for key in entry if key.startswith("eval_")}
        assert "eval_loss" in evaluated and ("eval_avg_loss" in evaluated) != original, evaluated


# ----------------------------------------------------------------------------- checkpoints


def checkpointing(folder: Path) -> ModelCheckpoint:
    return ModelCheckpoint(dirpath=folder, every_n_epochs=1, save_top_k=-1)


def state_dict_of(checkpoint: Path) -> dict[str, torch.Tensor]:
    return torch.load(checkpoint, weights_only=False)["state_dict"]  # (Lightning's own file, trusted here)


def test_a_checkpoint_whose_state_dict_is_the_average_as_lightnings(tmp_path) -> None:
    ours = ShardedWeightAveraging(decay=DECAY, checkpoint_weights="average")
    theirs = their_ema(decay=DECAY)
    fit([ours, checkpointing(tmp_path / "ours")], enable_checkpointing=True)
    fit([theirs, checkpointing(tmp_path / "theirs")], enable_checkpointing=True)
    for name in ("epoch=0-step=4.ckpt", f"epoch={EPOCHS - 1}-step={4 * EPOCHS}.ckpt"):
        mine, lightnings = state_dict_of(tmp_path / "ours" / name), state_dict_of(tmp_path / "theirs" / name)
        assert mine.keys() == lightnings.keys() and all(torch.equal(mine[k], lightnings[k]) for k in mine), name
        assert sidecar(tmp_path / "ours" / name).is_dir() and live_sidecar(tmp_path / "ours" / name).is_dir()
    last = tmp_path / "ours" / f"epoch={EPOCHS - 1}-step={4 * EPOCHS}.ckpt"
    assert torch.equal(Tiny.load_from_checkpoint(last).layer.weight, ours_average(ours))

    live = ShardedWeightAveraging(decay=DECAY)  # the default: the live weights, as before
    module = fit([live, checkpointing(tmp_path / "live")], enable_checkpointing=True)
    assert torch.equal(Tiny.load_from_checkpoint(tmp_path / "live" / last.name).layer.weight, module.layer.weight)
    assert not live_sidecar(tmp_path / "live" / last.name).exists()


@pytest.mark.parametrize("resumed_with", ["average", "live"])
def test_a_resume_from_the_average_goes_on_from_the_live_weights(tmp_path, resumed_with: str) -> None:
    """Resumed at the end of epoch 0 (with either setting: the checkpoint says what it holds), the
    live weights and the average end bitwise where the uninterrupted run's did."""
    whole = ShardedWeightAveraging(decay=DECAY, checkpoint_weights="average")
    uninterrupted = fit([whole, checkpointing(tmp_path)], enable_checkpointing=True)
    resumed = ShardedWeightAveraging(decay=DECAY, checkpoint_weights=resumed_with)
    module = fit([resumed], ckpt_path=str(tmp_path / "epoch=0-step=4.ckpt"))
    assert torch.equal(module.layer.weight, uninterrupted.layer.weight)
    assert torch.equal(ours_average(resumed), ours_average(whole))
    assert resumed.averager.num_updates == 4 * EPOCHS


def test_an_average_checkpoint_without_its_live_weights_is_refused_or_goes_on_from_the_average(tmp_path) -> None:
    fit([ShardedWeightAveraging(decay=DECAY, checkpoint_weights="average"), checkpointing(tmp_path / "run")],
        enable_checkpointing=True)  # fmt: skip
    copy = tmp_path / "copy" / "epoch=0-step=4.ckpt"
    copy.parent.mkdir()
    shutil.copy(tmp_path / "run" / copy.name, copy)
    shutil.copytree(sidecar(tmp_path / "run" / copy.name), sidecar(copy))  # the average, not the live weights
    with pytest.raises(CheckpointError, match=r"its live weights are not beside it: copy its sidecar .*shardavg-live"):
        fit([ShardedWeightAveraging(decay=DECAY)], ckpt_path=str(copy))
    with pytest.warns(UserWarning, match="training goes on from the average"):
        fit([ShardedWeightAveraging(decay=DECAY, strict=False)], ckpt_path=str(copy))


def test_bad_options_are_refused() -> None:
    with pytest.raises(ValueError, match='checkpoint_weights must be "live" or "average"'):
        ShardedWeightAveraging(checkpoint_weights="both")
    with pytest.raises(ValueError, match="update_every_n_steps must be >= 0"):
        ShardedWeightAveraging(update_every_n_steps=-1)


def test_an_override_of_should_update_written_for_step_idx_alone_is_asked_after_steps_only() -> None:
    """0.12's ``should_update(self, step_idx)``: never asked with ``epoch_idx`` (a TypeError at the
    first epoch's end otherwise), asked after every optimizer step as before."""

    class StepsOnly(ShardedWeightAveraging):
        def __init__(self) -> None:
            super().__init__(decay=DECAY)
            self.asked: list[int] = []

        def should_update(self, step_idx):
            self.asked.append(step_idx)
            return step_idx % 2 == 0

    callback = StepsOnly()
    fit([callback])
    assert callback.asked == list(range(EPOCHS * 4))
    assert callback.averager.num_updates == EPOCHS * 2
