"""The non-finite check (``shardavg/update/check.py``): one test per transition of its table, on
the object alone and through the averager, and the loops users run, where a step with an infinite
gradient has ``clip_grad_norm_`` scale it by 0 (inf * 0 = NaN) and the optimizer write NaN: the run
raises at that step under ``"raise"`` and never averages the NaN under ``"skip"``, in the loop, in
the background and on the device path (the CPU standing in for CUDA)."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from test_device_check import device_path  # noqa: F401 (a fixture)
from test_verdict import Screens

import shardavg.update.updater as updater_module
from shardavg import EMA, SWA, NonFiniteError, PowerEMA, WeightAverager
from shardavg.update.check import APPLY, SCREEN, SCREEN_AND_SKIP, SKIP, NonFiniteCheck
from shardavg.update.fused import Verdict
from shardavg.update.options import Options

DECAY = 0.9


def check(screen_every: int = 3, policy: str = "raise") -> NonFiniteCheck:
    return NonFiniteCheck(Options(screen_every=screen_every, on_nonfinite=policy))


# ----------------------------------------------------------------------------- the table, on the object


def test_built_untrusted_a_clean_screen_trusts_for_screen_every_updates() -> None:
    verdicts = check(screen_every=3)
    assert verdicts.due(True) is SCREEN  # built: untrusted
    verdicts.screened(clean=True)
    assert [verdicts.due(True) for _ in range(2)] == [APPLY, APPLY]  # updates 2 and 3
    assert verdicts.due(True) is SCREEN  # past n = 1 + 3 - 1


def test_no_verdict_is_always_screened() -> None:
    verdicts = check()
    verdicts.due(None)
    verdicts.screened(clean=True)
    assert verdicts.due(None) is SCREEN


def test_a_device_verdict_is_trusted_as_a_true_one_and_masks_there() -> None:
    verdicts = check()
    verdicts.due(None)
    verdicts.screened(clean=True)
    assert verdicts.due(torch.tensor(True)) is APPLY


def test_a_false_verdict_skips_and_screens_even_while_trusted() -> None:
    verdicts = check(screen_every=100)
    verdicts.due(None)
    verdicts.screened(clean=True)
    assert verdicts.due(False) is SCREEN_AND_SKIP
    verdicts.screened(clean=True)  # a loss scaler's overflow: the weights are as they were
    assert verdicts.due(True) is APPLY  # trusted again: a healthy skip costs one screen


def test_a_screen_that_found_nan_leaves_every_update_screened_until_a_clean_one() -> None:
    verdicts = check(screen_every=100)
    verdicts.due(None)
    verdicts.screened(clean=True)
    assert verdicts.due(False) is SCREEN_AND_SKIP
    verdicts.screened(clean=False)  # the optimizer wrote NaN
    assert [verdicts.due(True) for _ in range(2)] == [SCREEN, SCREEN]
    verdicts.screened(clean=True)
    assert verdicts.due(True) is APPLY


def test_a_step_between_updates_keeps_trust_with_a_true_verdict_screens_a_false_one_loses_it_without() -> None:
    verdicts = check(screen_every=100)
    verdicts.due(None)
    verdicts.screened(clean=True)
    assert verdicts.between(True) is False and verdicts.due(True) is APPLY
    assert verdicts.between(False) is True  # screen now
    verdicts.screened(clean=True)
    assert verdicts.due(True) is APPLY
    for unseen in (None, torch.tensor(True)):  # none, or one the host cannot read
        assert verdicts.between(unseen) is False
        assert verdicts.due(True) is SCREEN
        verdicts.screened(clean=True)


@pytest.mark.parametrize("stale", ["distrust", "restored", "step jump"])
def test_what_makes_trust_stale(stale) -> None:
    verdicts = check(screen_every=100)
    verdicts.due(None)
    verdicts.screened(clean=True)
    {"distrust": verdicts.distrust, "restored": verdicts.restored, "step jump": lambda: verdicts.stepped(5, 7)}[stale]()
    assert verdicts.due(True) is SCREEN
    verdicts.stepped(7, 8)  # (one step on: nothing lost)
    verdicts.screened(clean=True)
    assert verdicts.due(True) is APPLY


def test_a_screen_issued_before_trust_went_stale_vouches_for_nothing_when_read_after() -> None:
    verdicts = check(screen_every=100)
    verdicts.due(None)  # issued on the device, screened, not read yet
    verdicts.distrust()  # (say, copy_into_model)
    verdicts.screened(clean=True, ordinal=1)
    assert verdicts.due(True) is SCREEN


def test_on_the_device_a_false_verdict_read_late_leaves_the_updates_issued_since_masked() -> None:
    """The mirror of the device's ``vouched`` flag: an unscreened false verdict clears it, every
    update issued unscreened after it was masked there, and a clean screen sets it again."""
    verdicts = check(screen_every=100)
    verdicts.due(None)
    assert verdicts.settled(1, 1, screened_clean=True, refused=False) == "applied"
    for _ in range(3):
        assert verdicts.due(torch.tensor(True)) is APPLY  # issued before the host read anything
    assert verdicts.settled(2, 2, screened_clean=None, refused=True) == "refused"
    assert (verdicts.vouched, verdicts.unvouched_at) == (False, 2)
    assert verdicts.settled(3, 3, screened_clean=None, refused=False) == "unvouched"
    assert verdicts.settled(4, 4, screened_clean=None, refused=False) == "unvouched"
    assert verdicts.due(torch.tensor(True)) is SCREEN  # the host knows now: the next one is screened
    assert verdicts.settled(5, 5, screened_clean=True, refused=False) == "applied"
    assert verdicts.vouched and verdicts.due(torch.tensor(True)) is APPLY


def test_on_the_device_a_screen_that_found_nan_is_reported_and_keeps_the_updates_masked() -> None:
    verdicts = check(screen_every=100)
    verdicts.due(None)
    assert verdicts.settled(1, 1, screened_clean=False, refused=True) == "nonfinite"
    assert verdicts.vouched is False
    assert verdicts.settled(2, 2, screened_clean=None, refused=False) == "unvouched"


def test_with_the_check_off_nothing_is_screened_and_a_false_verdict_skips() -> None:
    verdicts = check(policy="off")
    assert [verdicts.due(None), verdicts.due(True), verdicts.due(False)] == [APPLY, APPLY, SKIP]
    assert verdicts.between(False) is False
    assert verdicts.settled(4, 4, screened_clean=None, refused=True) == "refused"
    assert verdicts.settled(5, 5, screened_clean=None, refused=False) == "applied"  # (no flag to mirror)


# ----------------------------------------------------------------------------- the loops users run


class Net(torch.nn.Module):
    """An embedding and a head: a row of the embedding only the poisoned batch looks up."""

    ROWS = 16

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(self.ROWS, 8)
        self.head = torch.nn.Linear(8, 4)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(tokens).mean(1))


POISONED_STEP = 4


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens from rows 0-14, and at the poisoned step also the last row, whose gradient is +inf then."""
    generator = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, Net.ROWS - 1, (6, 3), generator=generator)
    if step == POISONED_STEP:
        tokens[0, 0] = Net.ROWS - 1
    return tokens, torch.randint(0, 4, (6,), generator=generator)


class Loop:
    """``optimizer.step()`` after ``clip_grad_norm_``, the norm passed as the verdict, as docs/usage.md
    recommends; at ``POISONED_STEP`` the last embedding row's gradient is +inf."""

    def __init__(self, optimizer: str, poisoned_step: int | None = POISONED_STEP) -> None:
        self.net = Net()
        parameters = list(self.net.parameters())
        self.optimizer = (torch.optim.SGD(parameters, lr=0.1) if optimizer == "sgd" else torch.optim.AdamW(parameters))
        self.step = 0

        def poison(grad: torch.Tensor) -> torch.Tensor:
            if self.step != poisoned_step:
                return grad
            grad = grad.clone()
            grad[Net.ROWS - 1] = float("inf")
            return grad

        self.net.emb.weight.register_hook(poison)

    def train(self) -> torch.Tensor:
        self.step += 1
        tokens, targets = batch(self.step)
        self.optimizer.zero_grad()
        torch.nn.functional.cross_entropy(self.net(tokens), targets).backward()
        norm = torch.nn.utils.clip_grad_norm_(self.net.parameters(), 1.0)
        self.optimizer.step()
        return norm

    def weights(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.net.parameters()]


def ema_of(recorded: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """The EMA (``get_ema_multi_avg_fn``'s lerp) of ``recorded`` in order, computed here."""
    reference = [t.clone() for t in recorded[0]]
    for live in recorded[1:]:
        torch._foreach_lerp_(reference, live, 1 - DECAY)
    return reference


def assert_holds(averager: WeightAverager, recorded: list[list[torch.Tensor]]) -> None:
    got = averager.full_state_dict()
    for (name, want) in zip(("emb.weight", "head.weight", "head.bias"), ema_of(recorded)):
        assert got[name].isfinite().all(), f"{name}: NaN entered the average"
        assert torch.equal(got[name], want), name


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("background", [False, True], ids=["in the loop", "background"])
def test_the_loop_raises_at_the_step_its_optimizer_wrote_nan(optimizer, background) -> None:
    """The verdict at step 4 is false (the norm is inf); the optimizer writes NaN into the row; at
    step 5 the batch does not touch it and the norm is finite. The screen at step 4 finds it."""
    loop = Loop(optimizer)
    averager = WeightAverager(loop.net, EMA(decay=DECAY), background=background)
    recorded = []
    for _ in range(POISONED_STEP - 1):
        averager.update(finite=loop.train())
        recorded.append(loop.weights())
    found = r"\['emb.weight'\] at step 4 on rank 0, after the loop's verdict"  # (the other gradients scaled to 0)
    norm = loop.train()
    assert not norm.isfinite() and not loop.net.emb.weight.isfinite().all()  # what the optimizer wrote
    if background:
        assert averager.update(finite=norm) is True  # handed off; raised at the next call
        with pytest.raises(NonFiniteError, match=found):
            averager.wait()
    else:
        with pytest.raises(NonFiniteError, match=found):
            averager.update(finite=norm)
    assert (averager.num_updates, averager.num_skipped) == (3, 0)
    assert_holds(averager, recorded)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_under_skip_the_nan_is_never_averaged_and_every_step_it_stays_is_screened_and_warned(optimizer) -> None:
    loop = Loop(optimizer)
    averager = WeightAverager(loop.net, EMA(decay=DECAY), on_nonfinite="skip")
    recorded = []
    for step in range(1, 9):
        norm = loop.train()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            applied = averager.update(finite=norm)
        assert applied == (step < POISONED_STEP)
        if step < POISONED_STEP:
            recorded.append(loop.weights())
            assert caught == []
            continue
        assert norm.isfinite() == (step != POISONED_STEP)  # (the row is not looked up again)
        (warning,) = caught
        assert str(warning.message).startswith(f"skipping the update at step {step} on rank 0: non-finite live")
        assert "emb.weight" in str(warning.message) and warning.filename == __file__
    assert (averager.num_updates, averager.num_skipped) == (3, 5)
    assert_holds(averager, recorded)


def test_dead_weights_raise_at_the_first_skipped_step_not_a_warning_a_step_forever() -> None:
    """NaN in a weight every batch uses: every later norm is NaN, every verdict false."""
    loop = Loop("sgd")
    averager = WeightAverager(loop.net, EMA(decay=DECAY))
    averager.update(finite=loop.train())
    with torch.no_grad():
        loop.net.head.bias[0] = float("nan")  # (as an earlier skipped step would have left it)
    norm = loop.train()
    assert not norm.isfinite()
    with pytest.raises(NonFiniteError, match=r"\['emb.weight', 'head.weight', 'head.bias'\] at step 2"):
        averager.update(finite=norm)


def test_healthy_skips_pay_one_screen_each_and_nothing_on_the_other_steps(monkeypatch) -> None:
    """A loss scaler's overflows: the step is skipped (the weights unchanged) and the verdict False."""
    screens = Screens(monkeypatch)
    loop = Loop("sgd", poisoned_step=None)
    averager = WeightAverager(loop.net, EMA(decay=DECAY))  # screen_every=100
    recorded, ran = [], []
    for step in range(1, 11):
        overflow = step in (3, 7)
        if overflow:
            loop.step += 1  # (the scaler skipped optimizer.step(): nothing written)
        else:
            loop.train()
            recorded.append(loop.weights())
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            ran.append(screens.ran(functools.partial(averager.update, finite=not overflow)))
    assert [step for step, did in enumerate(ran, 1) if did] == [1, 3, 7]
    assert (averager.num_updates, averager.num_skipped) == (8, 2)
    assert_holds(averager, recorded)


def test_a_false_verdict_between_updates_is_screened_at_its_step() -> None:
    loop = Loop("sgd")
    averager = WeightAverager(loop.net, EMA(decay=DECAY), every_n_steps=2, start_step=1)
    averager.update(finite=loop.train())  # step 1: due
    averager.update(finite=loop.train())  # step 2
    averager.update(finite=loop.train())  # step 3: due
    with pytest.raises(NonFiniteError, match=r"'emb.weight'.* at step 4 on rank 0 \(between updates\), after"):
        averager.update(finite=loop.train())  # step 4: no update due, the NaN written
    assert (averager.num_updates, averager.num_skipped) == (2, 0)


# ----------------------------------------------------------------------------- the device path


class Late:
    """An event a device running behind would give: not done until ``land()`` (the CPU's verdicts
    are on the host at once, so a device that lags is stood in for by holding them back)."""

    held: list[Late] = []

    def __init__(self) -> None:
        self.done = False
        Late.held.append(self)

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True

    @classmethod
    def land(cls) -> None:
        for event in cls.held:
            event.done = True


def lagging(monkeypatch) -> None:
    """Every verdict the device path hands the host arrives late (``Late``)."""
    to_host = updater_module.to_host
    Late.held = []
    monkeypatch.setattr(updater_module, "to_host", lambda bad, indices: Verdict(*to_host(bad, indices)[:2], Late()))


def on_device(net: torch.nn.Module, path: str, **options) -> WeightAverager:
    averager = WeightAverager(net, EMA(decay=DECAY), **options)
    if path == "aten":
        averager.updater.on_device = True
    return averager


@pytest.mark.parametrize("policy", ["raise", "skip"])
def test_on_the_device_the_nan_is_masked_and_found_by_the_next_screen(device_path, policy) -> None:  # noqa: F811
    """The host reads step 4's false verdict at step 5's call, screens step 5 on the device, and its
    flag (read at step 6's call) raises or warns; no update averages the NaN."""
    loop = Loop("sgd")
    averager = on_device(loop.net, device_path, on_nonfinite=policy)
    recorded = []
    for _ in range(POISONED_STEP - 1):
        averager.update(finite=loop.train())
        recorded.append(loop.weights())
    averager.update(finite=loop.train())  # step 4: issued, masked by its verdict
    assert averager.updater.pending, "the update did not take the device path: the check is vacuous"
    with pytest.warns(RuntimeWarning, match=r"^skipped the update at step 4 on rank 0: the loop's verdict was false"):
        averager.update(finite=loop.train())  # step 5: screened on the device
    found = r"'emb.weight'.* at step 5 on rank 0"
    if policy == "raise":
        with pytest.raises(NonFiniteError, match=found + r" \(found on the device"):
            averager.update(finite=loop.train())
    else:
        skipped = r"^skipped the update at step 5 on rank 0: non-finite live values in \['emb"
        with pytest.warns(RuntimeWarning, match=skipped):
            averager.update(finite=loop.train())
        with pytest.warns(RuntimeWarning, match=r"^skipped the update at step 6 on rank 0: non-finite live values"):
            averager.updater.settle()  # (screened again: the NaN stays)
    assert_holds(averager, recorded)


def test_on_a_device_running_behind_the_updates_issued_after_a_false_verdict_are_masked(
    device_path,  # noqa: F811
    monkeypatch,
) -> None:
    """Step 4's verdict is still on its way when steps 5 and 6 are issued, unscreened: the device's
    ``vouched`` flag masks them (nothing unscreened after a false verdict is averaged); read, each is
    counted skipped with a warning naming step 4; the next update is screened and applied."""
    lagging(monkeypatch)
    loop = Loop("sgd", poisoned_step=None)
    averager = on_device(loop.net, device_path, on_nonfinite="skip")
    recorded = []
    for _ in range(POISONED_STEP - 1):
        averager.update(finite=loop.train())
        recorded.append(loop.weights())
    averager.updater.settle()
    for step in (4, 5, 6):  # none read yet; step 4's verdict false (as a loss scaler's, on the device)
        norm = loop.train()
        averager.update(finite=torch.tensor(False) if step == 4 else norm)
    assert len(averager.updater.pending) == 3
    Late.land()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        averager.updater.settle()
    assert [str(w.message)[:44] for w in caught] == [
        "skipped the update at step 4 on rank 0: the ",
        "skipped the update at step 5 on rank 0: it w",
        "skipped the update at step 6 on rank 0: it w",
    ]
    assert "false verdict of step 4" in str(caught[1].message)
    averager.update(finite=loop.train())  # step 7: screened on the device, clean
    recorded.append(loop.weights())
    Late.land()
    averager.updater.settle()
    assert (averager.num_updates, averager.num_skipped) == (4, 3)
    assert_holds(averager, recorded)


# ----------------------------------------------------------------------------- an update stopped part way


class InterruptAt(torch.utils._python_dispatch.TorchDispatchMode):
    """A KeyboardInterrupt raised at the ``at``-th kernel that writes shadows, as a signal lands."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at, self.seen = at, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in ("_foreach_lerp_", "_foreach_copy_", "_foreach_mul_", "_foreach_add_"):
            self.seen += 1
            if self.seen == self.at:
                raise KeyboardInterrupt
        return func(*args, **(kwargs or {}))


def test_an_interrupt_between_two_averages_marks_the_average_torn_until_restored(model, trainer, tmp_path) -> None:
    rules = {"fast": EMA(decay=0.5), "slow": EMA(decay=0.9), "power": PowerEMA(gamma=7.0), "swa": SWA()}
    averager = WeightAverager(model, rules)
    for _ in range(2):
        trainer.step()
        averager.update()
    saved = averager.save(tmp_path / "ckpt")
    trainer.step()
    with pytest.raises(KeyboardInterrupt), InterruptAt(3):
        averager.update()
    refused = r"the average cannot be trusted, the update of step 3 on rank 0 stopped part way \(KeyboardInterrupt\)"
    for use in (averager.update, averager.state_dict, lambda: averager.save(tmp_path / "other"),
                lambda: averager.full_state_dict("fast"), lambda: averager.swapped("fast").__enter__()):  # fmt: skip
        with pytest.raises(RuntimeError, match=refused):
            use()
    averager.load(saved)
    assert (averager.step, averager.num_updates) == (2, 2)
    averager.update(3)
    assert averager.num_updates == 3
    with pytest.raises(KeyboardInterrupt), InterruptAt(2):
        trainer.step()
        averager.update()
    averager.restart(averager.step)  # (restarted from the live weights: whole again)
    trainer.step()
    averager.update()
    assert averager.num_updates == 2  # the copy, and one update


# ----------------------------------------------------------------------------- refused at the boundary


def test_a_verdict_on_the_meta_device_is_refused_naming_finite(model) -> None:
    averager = WeightAverager(model, EMA(decay=DECAY))
    for verdict in (torch.tensor(1.0, device="meta"), torch.tensor(True, device="meta")):
        with pytest.raises(ValueError, match=r"^update\(finite=\.\.\.\) got a tensor on the meta device"):
            averager.update(finite=verdict)
    assert (averager.step, averager.num_updates) == (0, 0)


def test_a_bool_step_is_refused(model) -> None:
    averager = WeightAverager(model, EMA(decay=DECAY))
    for step in (True, False):
        with pytest.raises(ValueError, match=r"update\(step=\.\.\.\) takes the optimizer step, an int"):
            averager.update(step=step)
        with pytest.raises(ValueError, match=r"restart\(step=(True|False)\): a step is an int >= 0"):
            averager.restart(step)
    assert averager.step == 0
