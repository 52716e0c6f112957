"""The integrations hand ``update(finite=...)`` the verdict their engine already has: a step the
optimizer skipped (a ``GradScaler`` that found an infinite gradient) is neither averaged nor counted,
and a non-finite gradient norm the loop clipped with skips the update and has the weights screened
at that step: the NaN the optimizer wrote with it raises there under ``on_nonfinite="raise"`` (the
default), and under ``"skip"`` every later update is skipped while it stays. Each engine
runs here in one process on the CPU; a ``GradScaler`` runs on the CPU too (accelerate and the Trainer
make none there: one is installed by hand). The average is compared bitwise with an EMA of the
weights after the applied steps only."""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("lightning", reason="lightning is not installed (pip install -e '.[lightning]')")
pytest.importorskip("accelerate", reason="accelerate is not installed (pip install -e '.[accelerate]')")
pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[transformers]')")
import lightning as L  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402
from scenario_hf_trainer import Tokens, tiny_gpt2  # noqa: E402
from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from launch.engines import Wrapped  # noqa: E402
from shardavg import EMA, NonFiniteError, WeightAverager  # noqa: E402
from shardavg.integrations import accelerate, lightning, transformers  # noqa: E402

DECAY = 0.5


def poison_at(parameter: torch.nn.Parameter, steps: set[int], value: float) -> list[int]:
    """Make ``parameter``'s gradient hold ``value`` in the backward passes numbered in ``steps``
    (from 1); returns the counter."""
    count = [0]

    def hook(grad: torch.Tensor) -> torch.Tensor:
        count[0] += 1
        if count[0] in steps:
            grad = grad.clone()
            grad.view(-1)[0] = value
        return grad

    parameter.register_hook(hook)
    return count


def weights_of(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in module.named_parameters()}


def assert_ema_of(avg: WeightAverager, recorded: list[dict[str, torch.Tensor]]) -> None:
    """``avg`` holds, bitwise, the EMA (``get_ema_multi_avg_fn``'s lerp) of ``recorded`` in order."""
    names = list(recorded[0])
    reference = [recorded[0][n].float().clone() for n in names]
    for live in recorded[1:]:
        torch._foreach_lerp_(reference, [live[n].float() for n in names], 1 - DECAY)
    got = avg.full_state_dict()
    for name, want in zip(names, reference):
        assert torch.equal(got[name], want), name


# ----------------------------------------------------------------------------- accelerate


def test_accelerate_never_counts_a_step_its_scaler_skipped() -> None:
    accelerator = Accelerator(cpu=True)
    accelerator.scaler = torch.amp.GradScaler("cpu")  # (accelerate makes none on the CPU; the same skip)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    avg = WeightAverager(model, EMA(decay=DECAY))
    accelerate.attach(accelerator, avg)
    poison_at(model[0].weight, {3}, float("inf"))
    applied, norms = [], []
    for step in range(1, 6):
        optimizer.zero_grad()
        accelerator.backward(model(torch.randn(3, 4)).pow(2).mean())
        norms.append(accelerator.clip_grad_norm_(model.parameters(), 1.0))
        optimizer.step()
        finite = accelerate.verdict(accelerator)
        if step == 3:
            assert finite is False and accelerator.optimizer_step_was_skipped
        else:
            assert finite is norms[-1]  # the norm as clip_grad_norm_ returned it, not read
            applied.append(weights_of(model))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            avg.update(finite=finite)
        assert any("3" in str(w.message) for w in caught) == (step == 3)
        if step != 3:
            assert accelerate.verdict(accelerator) is None  # the norm is taken once
    assert (avg.num_updates, avg.num_skipped) == (4, 1)
    assert_ema_of(avg, applied)


@pytest.mark.parametrize("policy", ["raise", "skip"])
def test_accelerate_screens_at_the_norm_it_clipped_with(policy) -> None:
    """Without a scaler the optimizer applies a NaN gradient; the norm clipped with says so: the
    update is skipped and the weights screened at that step, which finds the NaN the optimizer
    wrote (raised, or warned at each later step it stays, never averaged)."""
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    avg = WeightAverager(model, EMA(decay=DECAY), on_nonfinite=policy)
    accelerate.attach(accelerator, avg)
    poison_at(model.weight, {3}, float("nan"))
    applied = []
    for step in range(1, 6):
        optimizer.zero_grad()
        accelerator.backward(model(torch.randn(3, 4)).pow(2).mean())
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step < 3:
            applied.append(weights_of(model))
        if step == 3 and policy == "raise":
            found = r"\['weight', 'bias'\] at step 3 on rank 0, after the loop's verdict"
            with pytest.raises(NonFiniteError, match=found):
                avg.update(finite=accelerate.verdict(accelerator))
            break
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            avg.update(finite=accelerate.verdict(accelerator))
        assert any(f"step {step}" in str(w.message) and "'weight'" in str(w.message) for w in caught) == (step >= 3)
    assert model.weight.isnan().any()  # the optimizer took the step
    assert (avg.num_updates, avg.num_skipped) == (2, 0 if policy == "raise" else 3)
    assert_ema_of(avg, applied)


# ----------------------------------------------------------------------------- Lightning


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(4, 2)

    def training_step(self, batch, index):
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Recorded(L.Callback):
    """The weights after each optimizer step, and whether it ran (before the averaging callback)."""

    def __init__(self) -> None:
        self.after: list[tuple[int, dict]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.after.append((trainer.global_step, weights_of(pl_module)))


@pytest.mark.parametrize(
    ("precision", "clip", "poison", "policy"),
    [
        ("16-mixed", None, float("inf"), "raise"),
        ("32-true", 1.0, float("nan"), "skip"),
        ("bf16-mixed", 1.0, float("nan"), "skip"),
        ("32-true", 1.0, float("nan"), "raise"),
    ],
)
def test_lightning_passes_the_scaler_skip_and_the_norm_it_clipped_with(precision, clip, poison, policy) -> None:
    """16-mixed: the GradScaler skips step 3 (Lightning still counts it), its weights screened
    finite; with ``gradient_clip_val`` the norm Lightning clipped with skips the last step, whose
    NaN the optimizer applied, and the screen at that step finds it: warned under "skip", raised
    out of ``fit`` under "raise"."""
    module, recorded = Tiny(), Recorded()
    bad = 3 if precision == "16-mixed" else 5
    poison_at(module.layer.weight, {bad}, poison)
    averaging = lightning.ShardedWeightAveraging(decay=DECAY, on_nonfinite=policy)
    # (Lightning turns precision="16-mixed" into bf16 on the CPU; its plugin, given, keeps a scaler, whose
    # scale is small enough that only the poisoned step overflows)
    scaler = torch.amp.GradScaler("cpu", init_scale=16.0)
    mixed = (
        {"plugins": [MixedPrecision(precision, "cpu", scaler)]} if precision == "16-mixed" else {"precision": precision}
    )
    trainer = L.Trainer(
        max_steps=5, callbacks=[recorded, averaging], accelerator="cpu", gradient_clip_val=clip, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **mixed,
    )  # fmt: skip
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(20, 4)), batch_size=4)
    written = precision != "16-mixed"  # (the scaler skipped its step: the weights stay finite)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if written and policy == "raise":
            found = rf"\['layer.weight', 'layer.bias'\] at step {bad} on rank 0, after the loop"
            with pytest.raises(NonFiniteError, match=found):
                trainer.fit(module, data)
            return
        trainer.fit(module, data)
    assert trainer.global_step == 5
    warned = [str(w.message) for w in caught if w.category is RuntimeWarning and f"step {bad}" in str(w.message)]
    assert len(warned) == 1 and ("'layer.weight'" in warned[0]) == written, warned
    avg = averaging.averager
    assert (avg.num_updates, avg.num_skipped) == (4, 1)
    assert_ema_of(avg, [weights for step, weights in recorded.after if step != bad])
    assert "clip_grad_by_norm" not in vars(trainer.precision_plugin)  # given back at teardown


# ----------------------------------------------------------------------------- the HF Trainer


class Recorder(TrainerCallback):
    """The weights after each optimizer step (added before the averaging callback)."""

    def __init__(self) -> None:
        self.after: list[dict] = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.after.append(weights_of(model))


@pytest.mark.parametrize("policy", ["raise", "skip"])
def test_hf_trainer_screens_at_the_norm_it_clipped_with(tmp_path, policy) -> None:
    """The Trainer clips through its accelerator; bound, the callback gets that norm, and the last
    step, whose NaN gradient the optimizer applied, is skipped and its weights screened: the NaN
    raises out of ``train()`` under "raise", and is warned about, naming the tensor, under "skip"."""
    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=5, learning_rate=1e-2,
        lr_scheduler_type="constant", save_strategy="no", report_to=[], seed=0, use_cpu=True, disable_tqdm=True,
    )  # fmt: skip
    model = tiny_gpt2()
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(32, 1))
    recorder = Recorder()
    trainer.add_callback(recorder)
    averaging = transformers.with_weight_averaging(trainer, EMA(decay=DECAY), on_nonfinite=policy)
    poison_at(model.transformer.h[0].mlp.c_fc.weight, {5}, float("nan"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if policy == "raise":
            with pytest.raises(NonFiniteError, match=r"'transformer.h.0.mlp.c_fc.weight'.* at step 5 on rank 0, after"):
                trainer.train()
        else:
            trainer.train()
    assert not model.transformer.h[0].mlp.c_fc.weight.isfinite().all()  # the optimizer took the step
    if policy == "raise":
        return
    warned = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning) and "step 5" in str(w.message)]
    assert len(warned) == 1 and "transformer.h.0.mlp.c_fc.weight" in warned[0], warned
    avg = averaging.averager
    assert (avg.num_updates, avg.num_skipped) == (4, 1)
    assert_ema_of(avg, recorder.after[:4])


def test_hf_trainer_unbound_passes_the_skip_its_optimizer_reports() -> None:
    """Unbound, the callback sees the optimizer, not the accelerator: a skip it reports is False, and
    anything else no verdict (the screen runs)."""
    callback = transformers.WeightAveragingCallback(EMA(decay=DECAY))

    class Optimizer:
        step_was_skipped = True

    assert callback._verdict(Optimizer()) is False
    Optimizer.step_was_skipped = False
    assert callback._verdict(Optimizer()) is None


# ----------------------------------------------------------------------------- the main job


def test_main_job_passes_the_norm_it_clips_with() -> None:
    torch.manual_seed(0)
    module = torch.nn.Linear(4, 2)

    class Loss(torch.nn.Module):
        def forward(self, tokens, targets):
            return (module(tokens) - targets).pow(2).mean()

    wrapped = Wrapped("ddp", Loss(), module, torch.optim.SGD(module.parameters(), lr=0.1))
    poison_at(module.weight, {2}, float("nan"))
    avg = WeightAverager(module, EMA(decay=DECAY))
    applied = []
    for step in (1, 2):
        loss, finite = wrapped.train_step(torch.randn(3, 4), torch.randn(3, 2), 0.1, 1.0)
        assert isinstance(loss, float) and isinstance(finite, torch.Tensor) and finite.isfinite() == (step == 1)
        if step == 1:
            applied.append(weights_of(module))
            avg.update(step, finite=finite)
    with pytest.raises(NonFiniteError, match=r"\['weight', 'bias'\] at step 2 on rank 0, after the loop's verdict"):
        avg.update(2, finite=finite)  # (the optimizer applied the NaN gradient the norm saw)
    assert (avg.num_updates, avg.num_skipped) == (1, 0)
    assert_ema_of(avg, applied)
