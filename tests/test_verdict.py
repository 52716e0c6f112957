"""``update(finite=...)``: the verdict the loop already has on its step (the total gradient norm, or
False for a step the optimizer skipped) stands in for the non-finite screen where it can be trusted:
the averages are bitwise those of the screened update, a false verdict skips the update (counted,
warned, never raised), the screen still runs at the first update, after a restore and every
``screen_every`` updates, and on the device path the verdict masks the update with no host read."""

from __future__ import annotations

import functools
import sys
import time
import warnings
from collections import Counter
from collections.abc import Callable

import pytest
import torch
from helpers import assert_same_average
from test_device_check import RULES, HostReads, ScalarReads, assert_same, device_path  # noqa: F401 (a fixture)

import shardavg.update.updater as updater_module
from shardavg import EMA, NonFiniteError, WeightAverager
from shardavg.update.options import Options


def grad_norm(model: torch.nn.Module) -> torch.Tensor:
    """The total gradient norm, as ``clip_grad_norm_`` returns it (a 0-d tensor, never read here)."""
    return torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])


class Screens:
    """Counts the runs of the non-finite screen, on the host (``nonfinite``) and on the device
    (``screen_on_device``), by patching the updater's references to them."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        for name in ("nonfinite", "screen_on_device"):
            monkeypatch.setattr(updater_module, name, self._counted(getattr(updater_module, name)))

    def _counted(self, function):
        def screen(*args, **kwargs):
            self.count += 1
            return function(*args, **kwargs)

        return screen

    def ran(self, call) -> bool:
        """Whether ``call()`` ran the screen (once at most)."""
        before = self.count
        call()
        assert self.count - before <= 1
        return self.count > before


@pytest.fixture
def screens(monkeypatch) -> Screens:
    return Screens(monkeypatch)


def test_a_true_verdict_stands_in_for_the_screen_and_gives_the_same_bits(model, trainer, screens) -> None:
    """With ``screen_every=4`` the screen runs at updates 1, 5, 9 only, verdict given or not."""
    screened = WeightAverager(model, RULES, buffers="average")
    taken = WeightAverager(model, RULES, buffers="average", screen_every=4)
    ran = []
    for step in range(1, 11):
        trainer.step()
        screened.update()
        verdict = grad_norm(model) if step % 2 else True  # a norm tensor, or a bool
        ran.append(screens.ran(functools.partial(taken.update, finite=verdict)))
    assert [step for step, did in enumerate(ran, 1) if did] == [1, 5, 9]
    assert (taken.num_updates, taken.num_skipped) == (10, 0)
    assert_same(screened, taken)


@pytest.mark.parametrize("policy", ["raise", "skip", "off"])
def test_a_false_verdict_skips_the_update_and_screens_the_weights_at_its_step(model, trainer, policy) -> None:
    """A false verdict skips the update and the weights are screened at that step: finite (a loss
    scaler's overflow, routine), a warning and no error; not finite (step 7: what a step with
    infinite gradients writes), ``on_nonfinite`` applies: "raise" raises naming the tensor, the step
    and the verdict, "skip" warns once with both. Silent under "off". The averages are those of a
    loop that did not call update() at those steps."""
    reference = WeightAverager(model, RULES, on_nonfinite=policy)
    averager = WeightAverager(model, RULES, on_nonfinite=policy, screen_every=3)
    false = {4: False, 6: torch.tensor(False), 7: torch.tensor([1.0, float("inf")]), 8: torch.tensor(float("nan"))}
    shown = {4: "False", 6: "tensor(False)", **dict.fromkeys((7, 8), "a torch.float32 tensor holding NaN or infinity")}
    for step in range(1, 10):
        trainer.step()
        if step not in false:
            reference.update(step)
            averager.update(step, finite=grad_norm(model))
            continue
        if step == 7:  # (as the optimizer writes it after infinite gradients)
            with torch.no_grad():
                model.block.up.weight[0, 0] = float("nan")
        with warnings.catch_warnings(record=True) as given:
            warnings.simplefilter("always")
            if step == 7 and policy == "raise":
                with pytest.raises(NonFiniteError) as raised:
                    averager.update(step, finite=false[step])
                assert str(raised.value).startswith(
                    f"non-finite live values in ['block.up.weight'] at step 7 on rank 0, after the loop's verdict "
                    f"on that step was false (finite={shown[7]}): a step with non-finite gradients writes NaN"
                )
            else:
                assert averager.update(step, finite=false[step]) is False
        if policy == "off":
            expected = []
        elif step == 7:
            expected = [] if policy == "raise" else [
                f"skipping the update at step 7 on rank 0: non-finite live values in ['block.up.weight'], after the "
                f"loop's verdict on that step was false (finite={shown[7]}): a step with non-finite gradients writes "
                "NaN (clip_grad_norm_ scales them by 1/inf = 0, and inf * 0 is NaN); every update is screened until "
                "they are finite"
            ]  # fmt: skip
        else:
            expected = [
                f"skipping the update at step {step} on rank 0: the loop's verdict was false (finite={shown[step]}): "
                "its optimizer step was skipped (a loss scaler's overflow) or its gradients were not finite"
            ]  # fmt: skip
        assert [str(w.message) for w in given] == expected
        assert all(w.category is RuntimeWarning and w.filename == __file__ for w in given)
        if step == 7:
            with torch.no_grad():
                model.block.up.weight[0, 0] = 0.5
    skipped = 3 if policy == "raise" else 4  # (the update that raised is neither applied nor counted)
    assert (averager.num_updates, averager.num_skipped, averager.step) == (5, skipped, 9)
    assert_same(reference, averager)


def test_the_screen_still_judges_the_weights_where_a_verdict_is_not_trusted(model, trainer, screens) -> None:
    """At the first update a true verdict does not hide NaN weights; within ``screen_every`` it
    does (a write outside the optimizer: what a verdict cannot see), until the next screen."""
    with torch.no_grad():
        model.block.up.weight[0, 0] = float("nan")
    averager = WeightAverager(model, EMA(decay=0.9), screen_every=3)
    with pytest.raises(NonFiniteError, match=r"\['block.up.weight'\] at step 1 on rank 0"):
        averager.update(finite=True)
    with torch.no_grad():
        model.block.up.weight[0, 0] = 0.5
    skipping = WeightAverager(model, EMA(decay=0.9), screen_every=3, on_nonfinite="skip")
    for step in (1, 2):
        trainer.step()
        assert screens.ran(lambda: skipping.update(finite=True)) == (step == 1)
    with torch.no_grad():
        model.block.up.weight[0, 0] = float("inf")  # by hand, outside the optimizer
    assert not screens.ran(lambda: skipping.update(finite=True))  # trusted: averaged in
    assert not skipping.shadows()[[t.name for t in skipping.tensors].index("block.up.weight")].isfinite().all()
    with pytest.warns(RuntimeWarning, match=r"^skipping the update at step 4 on rank 0: non-finite .*block.up.weight"):
        assert screens.ran(lambda: skipping.update(finite=True))  # the 4th update screens: found
    assert (skipping.num_updates, skipping.num_skipped) == (3, 1)


def test_a_restore_or_a_new_model_state_brings_the_screen_back(model, trainer, tmp_path, screens) -> None:
    averager = WeightAverager(model, EMA(decay=0.9))

    def step(**kwargs) -> bool:
        trainer.step()
        return screens.ran(lambda: averager.update(finite=grad_norm(model), **kwargs))

    assert [step(), step(), step()] == [True, False, False]
    path = averager.save(tmp_path / "ckpt")
    averager.load(path)
    assert [step(), step()] == [True, False]
    averager.load_state_dict(averager.state_dict())
    assert [step(), step()] == [True, False]
    averager.restart(averager.step)
    assert [step(), step()] == [True, False]
    averager.copy_into_model()
    assert [step(), step()] == [True, False]
    model.block.up.weight = torch.nn.Parameter(model.block.up.weight.detach().clone())  # new live tensors
    assert [step(), step()] == [True, False]
    assert step(step=averager.step + 2) is True  # a step the loop took without a word to us
    assert step() is False


def test_a_step_between_updates_needs_a_true_verdict_too(model, trainer, screens) -> None:
    """Steps that are not due change the weights as well: a step called without a verdict brings
    the screen back at the next update; one with a false verdict is screened at once, and its clean
    screen vouches for the weights from then on."""
    averager = WeightAverager(model, EMA(decay=0.9), every_n_steps=2, start_step=1)
    ran = []
    for step in range(1, 12):
        trainer.step()
        verdict = None if step == 6 else False if step == 8 else True
        ran.append(screens.ran(functools.partial(averager.update, finite=verdict)))
    assert [step for step, did in enumerate(ran, 1) if did] == [1, 7, 8]  # (8: screened at its false verdict)
    assert (averager.num_updates, averager.num_skipped) == (6, 0)


def test_on_the_device_path_the_verdict_masks_the_update_with_no_host_read(
    model,
    trainer,
    device_path,  # noqa: F811 (test_device_check's fixture)
    screens,
) -> None:
    """The CPU standing in for CUDA (ATen's masked update, or the Triton kernel interpreted): a
    tensor verdict is never read by update(); a false one leaves every shadow as it was, and the
    skip is reported at the next call; trusted, the device runs no screen."""
    reference = WeightAverager(model, RULES, buffers="average")
    averager = WeightAverager(model, RULES, buffers="average", screen_every=4)
    if device_path == "aten":
        averager.updater.on_device = True
    functions, scalars = HostReads(), ScalarReads()
    ran = []
    for step in range(1, 8):
        trainer.step()
        norm = grad_norm(model) if step != 5 else torch.tensor(float("nan"))
        if step != 5:
            reference.update(step)
        update = functools.partial(averager.update, step, finite=norm)
        if step == 6:  # (the verdict of step 5, on the host: read by the next update())
            with pytest.warns(RuntimeWarning, match=r"^skipped the update at step 5 on rank 0: the loop's verdict"):
                update()
            continue
        if step == 1:  # (the first update copies, its verdicts read on the host)
            ran.append(screens.ran(update))
            continue
        averager.updater.settle(block=False)  # (the last verdict, on the host: what update() reads first)
        with functions, scalars:
            ran.append(screens.ran(update))
        assert averager.updater.pending, "the update did not take the device path: the check is vacuous"
    assert functions.seen == [] and scalars.count == 0, (functions.seen, scalars.count)
    assert ran == [True, False, False, False, True, False]  # steps 1-5 and 7: updates 1 and 5 screen
    assert (averager.num_updates, averager.num_skipped) == (6, 1)
    assert_same(reference, averager)


def test_in_the_background_the_verdict_is_taken_when_update_is_called(model, trainer, monkeypatch) -> None:
    """The loop overwrites its verdict's tensor as soon as update() returns; the update, still to
    run on its thread, goes by the value it was given. A false one warns at the next call."""
    reference = WeightAverager(model, EMA(decay=0.9))
    averager = WeightAverager(model, EMA(decay=0.9), background=True)
    check_on_device = averager.updater.check_on_device

    def late(given=None) -> bool:  # (the thread reaches the verdict only once the loop has overwritten it)
        time.sleep(0.05)
        return check_on_device(given)

    monkeypatch.setattr(averager.updater, "check_on_device", late)
    verdict = torch.tensor(True)
    for step in range(1, 6):
        if step == 4:  # (the optimizer's step collects the update of step 3, and gives its warning)
            with pytest.warns(RuntimeWarning, match=r"^skipping the update at step 3 on rank 0: the loop's verdict"):
                trainer.step()
        else:
            trainer.step()
        if step != 3:
            reference.update(step)
        verdict.fill_(step != 3)
        averager.update(step, finite=verdict)
        verdict.fill_(step == 3)  # the loop reuses its tensor at once
    assert (averager.num_updates, averager.num_skipped) == (4, 1)
    assert_same_average(reference, averager)


def test_a_norm_on_the_cpu_costs_the_update_one_aten_call(model, trainer) -> None:
    """Where the update reads its verdict on the host, a 0-d norm is read by ``item()`` alone: a
    trusted update with it runs the unchecked update's ATen calls and that one, and gives the same
    bits. (What else it costs is Python's: attribute reads, cold after the weights streamed through
    the caches; tools/bench.py times it against the unchecked update.)"""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    unchecked = WeightAverager(model, EMA(decay=0.9), on_nonfinite="off")
    with_verdict = WeightAverager(model, EMA(decay=0.9))
    for step in range(1, 4):
        trainer.step()
        norm = grad_norm(model)
        with Ops() as off:
            unchecked.update(step)
        with Ops() as given:
            with_verdict.update(step, finite=norm)
    assert off.seen and given.seen == ["aten._local_scalar_dense.default", *off.seen], (off.seen, given.seen)
    assert_same_average(unchecked, with_verdict)


def python_calls(call: Callable[[], object]) -> Counter[str]:
    """The Python functions and builtins ``call`` calls, by name, as ``sys.setprofile`` sees them."""
    seen: Counter[str] = Counter()

    def profile(frame, event: str, arg) -> None:
        if event == "call":
            seen[f"{frame.f_code.co_filename}:{frame.f_code.co_name}"] += 1
        elif event == "c_call":
            seen[getattr(arg, "__name__", repr(arg))] += 1

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    seen.pop("setprofile", None)
    return seen


@pytest.mark.parametrize("kind", ["norm", "bool"])
def test_a_trusted_verdict_adds_only_its_read_to_the_update(model, trainer, kind) -> None:
    """An update runs just after the optimizer streamed the weights through the caches, where each
    distinct call costs 2-30 us instead of 0.1-1 (against updates of 3-10 ms over 1,200 small
    tensors: tools/bench.py times the ratio), so the trusted verdict's path is counted call by
    call: with a 0-d norm on the CPU, the unchecked update's calls and the norm's read (``numel``,
    ``item``, ``math.isfinite``); with a bool, the unchecked update's calls alone."""
    unchecked = WeightAverager(model, EMA(decay=0.9), on_nonfinite="off")
    with_verdict = WeightAverager(model, EMA(decay=0.9))
    for step in range(1, 5):
        trainer.step()
        verdict = grad_norm(model) if kind == "norm" else True
        off = python_calls(functools.partial(unchecked.update, step))
        given = python_calls(functools.partial(with_verdict.update, step, finite=verdict))
    read = Counter({"numel": 1, "item": 1, "isfinite": 1} if kind == "norm" else {})
    assert (given - off, off - given) == (read, Counter()), (given - off, off - given)
    assert (with_verdict.num_updates, with_verdict.num_skipped) == (4, 0)
    assert_same_average(unchecked, with_verdict)


@pytest.mark.parametrize(
    ("finite", "error", "message"),
    [
        (1, TypeError, r"takes a bool, .* got int$"),
        (0.5, TypeError, r"takes a bool, .* got float \(a Python number: pass math.isfinite\(x\)\)$"),
        ("yes", TypeError, r"takes a bool, .* got str$"),
        (torch.tensor(3), TypeError, r"takes a bool, .* got a torch.int64 tensor$"),
        (torch.tensor(1 + 2j), TypeError, r"takes a bool, .* got a torch.complex64 tensor$"),
        (torch.tensor([True, False]), ValueError, r"got a torch.bool tensor of shape \(2,\): a verdict is a 0-d"),
        (torch.tensor([True]), ValueError, r"got a torch.bool tensor of shape \(1,\): a verdict is a 0-d"),
        (torch.empty(0), ValueError, r"got a torch.float32 tensor of shape \(0,\)"),
    ],
)
def test_a_verdict_of_another_kind_is_refused_naming_finite(model, finite, error, message) -> None:
    averager = WeightAverager(model, EMA(decay=0.9))
    with pytest.raises(error, match=r"^update\(finite=\.\.\.\) " + message) as refused:
        averager.update(finite=finite)
    assert "\n" not in str(refused.value)
    assert (averager.step, averager.num_updates, averager.num_skipped) == (0, 0, 0)  # nothing changed


def test_screen_every_is_an_option_checked_where_it_enters_and_not_recorded(model) -> None:
    """Declared once in ``Options``: a count of at least 1, default 100; a policy of the running
    loop, not a property of the saved average, so descriptions do not record it (as ``on_nonfinite``)."""
    assert Options().screen_every == 100
    assert WeightAverager(model, EMA(decay=0.9), screen_every=7).options.screen_every == 7
    for bad in (0, True, 2.5, "10"):
        with pytest.raises(ValueError, match="screen_every") as refused:
            WeightAverager(model, EMA(decay=0.9), screen_every=bad)
        assert "\n" not in str(refused.value)
    written = Options(screen_every=7).to_json()
    assert "screen_every" not in written and written == Options().to_json()
    assert Options.from_json(written, "here") == Options()
