"""A Triton kernel that cannot run never takes a run down (issue 47): stand-ins for a kernel whose
launch fails (an old ``ptxas``, a driver or Triton skew, an architecture it cannot target) and for
one that compiles to wrong bits, forced onto the CPU through Triton's interpreter as
tests/test_device_check.py forces the kernel path. In each, ``update()`` returns, the averages are
bitwise those of the host-checked ATen path over several updates, and one warning names the
device, the Triton version and the error. The self-check runs once per device, and
``SHARDAVG_KERNEL=0`` turns the kernel off by hand (so do ``false``, ``off`` and ``no``, in any case;
a value not understood is warned about once)."""

from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from shardavg import EMA, SWA, WeightAverager
from shardavg.update import kernels
from shardavg.update.updater import Updater

# numpy, under the interpreter, about values the kernel's masked-off lanes hold
pytestmark = pytest.mark.filterwarnings("ignore:(overflow|invalid value) encountered:RuntimeWarning")

BROKEN = "ptxas fatal   : Value 'sm_121' is not defined for option 'gpu-name'"  # (what an old ptxas says)
WARNED = "shardavg: the Triton kernel of the update failed on cpu"
FLOAT_BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


class StandIn:
    """Stands in for the jitted ``masked_lerp_many`` (``kernel[grid](*args, **options)``): counts
    the launches and passes them to the real kernel, until ``fails`` says a launch fails (raising
    before anything is written, as a compile or launch error does) or ``wrong`` that its weights
    come one ulp off (a kernel compiled to wrong bits)."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self.launched: list[tuple[int, int, bool]] = []  # (averages, copy bits, whether it failed) per launch
        self.fails: Callable[[dict[str, Any]], bool] = lambda options: False
        self.wrong = False

    @property
    def launches(self) -> int:
        return len(self.launched)

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
        def launch(*args: Any, **options: Any) -> None:
            failed = self.fails(options)
            self.launched.append((options["COUNT"], options["COPY"], failed))
            if failed:
                raise RuntimeError(BROKEN)
            if self.wrong:  # (w0..w3 follow the five tables and the flag, each after its shadow table)
                args = tuple(
                    torch.nextafter(arg, torch.ones_like(arg)) if i in (6, 8, 10, 12) and arg is not None else arg
                    for i, arg in enumerate(args)
                )
            self.kernel[grid](*args, **options)

        return launch


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch) -> Iterator[StandIn]:
    """The kernel path on the CPU, as on CUDA by default, its kernel behind a ``StandIn``; the
    self-check not yet run."""
    if importlib.util.find_spec("triton") is None:
        pytest.fail("triton is not installed: it is a test dependency (pip install -e '.[test]'), see pyproject.toml")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv(kernels.SWITCH, raising=False)
    monkeypatch.setattr(Updater, "kernel_devices", frozenset({"cpu", "cuda"}))
    kernels.reset()
    if not kernels._available("cpu"):
        pytest.skip("Triton's interpreter before 3.9 cannot show the kernel's bits (tests/test_kernels.py says why)")
    module = kernels._module()
    standing = StandIn(module.masked_lerp_many)
    monkeypatch.setattr(module, "masked_lerp_many", standing)
    yield standing
    kernels.reset()


@pytest.fixture
def checks(monkeypatch: pytest.MonkeyPatch) -> list[torch.device]:
    """The devices ``kernels.self_check`` was called for, in order."""
    seen: list[torch.device] = []
    real = kernels.self_check

    def counted(device: torch.device) -> bool:
        seen.append(device)
        return real(device)

    monkeypatch.setattr(kernels, "self_check", counted)
    return seen


def averagers(model: torch.nn.Module, rules: Any) -> tuple[WeightAverager, WeightAverager]:
    """The host-checked ATen path (the kernel never chosen), and the default, on the 'device'."""
    with pytest.MonkeyPatch.context() as host_only:
        host_only.setattr(Updater, "kernel_devices", frozenset({"cuda"}))
        on_host = WeightAverager(model, rules, buffers="average")
    return on_host, WeightAverager(model, rules, buffers="average")


def assert_bitwise(want: WeightAverager, got: WeightAverager) -> None:
    assert (got.num_updates, got.num_skipped) == (want.num_updates, want.num_skipped)
    for name in want.rules:
        wanted, held = want.full_state_dict(name), got.full_state_dict(name)
        for key, tensor in wanted.items():
            bits = FLOAT_BITS.get(tensor.dtype, tensor.dtype)
            assert held[key].dtype == tensor.dtype and torch.equal(held[key].view(bits), tensor.view(bits)), (name, key)


def kernel_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if str(w.message).startswith("shardavg: the Triton kernel")]


def assert_one_warning(caught: list[warnings.WarningMessage], error: str) -> None:
    import triton

    given = kernel_warnings(caught)
    assert len(given) == 1, given
    assert given[0].startswith(f"{WARNED} (Triton {triton.__version__}): ") and error in given[0], given[0]
    assert f"{kernels.SWITCH}=0" in given[0], given[0]


def train(on_host: WeightAverager, on_device: WeightAverager, trainer: Any, steps: int) -> None:
    for _ in range(steps):
        trainer.step()
        on_host.update()
        on_device.update()


@pytest.mark.parametrize("broken", ["launch", "bits"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_kernel_that_fails_its_self_check_leaves_the_update_to_aten(
    model, trainer, stand_in: StandIn, dtype: torch.dtype, broken: str
) -> None:
    """Its first launch fails, or it writes wrong bits: caught at the kernel's first use, before any
    average is written; every update then takes the ATen path, with one warning."""
    model.to(dtype)
    if broken == "launch":
        stand_in.fails = lambda options: True
    else:
        stand_in.wrong = True
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        on_host, on_device = averagers(model, {"ema": EMA(decay=0.9), "swa": SWA()})
        train(on_host, on_device, trainer, 4)
    error = f"RuntimeError: {BROKEN}" if broken == "launch" else "AssertionError: its bits differ from ATen's lerp"
    assert_one_warning(caught, error)
    assert not any(group.kernel for group in on_device.updater.groups)
    assert not kernels.usable(torch.device("cpu")) and stand_in.launches > 0
    assert_bitwise(on_host, on_device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_later_launch_that_fails_finishes_that_update_through_aten(
    model, trainer, stand_in: StandIn, dtype: torch.dtype
) -> None:
    """The self-check passes, the kernel runs two updates (fp32: the check on the device, the
    kernel masking; bf16: the kernel casting), then a launch fails: that ``update()`` returns, with
    the bits of the ATen path, and the next ones take it."""
    model.to(dtype)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        on_host, on_device = averagers(model, {"ema": EMA(decay=0.9)})
        train(on_host, on_device, trainer, 3)
        assert all(g.kernel for g in on_device.updater.groups if g.live_tensors[0].dtype.is_floating_point)
        assert kernel_warnings(caught) == [] and stand_in.launches > 9  # (9: the self-check's)
        stand_in.fails = lambda options: True
        train(on_host, on_device, trainer, 3)
    assert_one_warning(caught, f"RuntimeError: {BROKEN}")
    assert not any(group.kernel for group in on_device.updater.groups)
    assert_bitwise(on_host, on_device)


def test_a_launch_that_fails_on_the_background_thread_warns_in_the_loop_at_collection(
    model, trainer, stand_in: StandIn
) -> None:
    """With ``background=True`` the failing launch runs on the update's thread: its warning is kept
    and given once, by the call that collects that update, in the loop's thread (so the loop's own
    ``catch_warnings`` sees it); that update and the later ones have the ATen path's bits."""
    with pytest.MonkeyPatch.context() as host_only:
        host_only.setattr(Updater, "kernel_devices", frozenset({"cuda"}))
        on_host = WeightAverager(model, EMA(decay=0.9), buffers="average")
    on_device = WeightAverager(model, EMA(decay=0.9), buffers="average", background=True)
    train(on_host, on_device, trainer, 2)
    on_device.wait()
    stand_in.fails = lambda options: True
    trainer.step()
    on_host.update()
    with warnings.catch_warnings(record=True) as during:
        warnings.simplefilter("always")
        on_device.update()  # (started: the launch fails on the thread)
        on_device.updater.background._landed.wait()  # (the thread is over: its warning was kept, not given)
    assert kernel_warnings(during) == []
    with warnings.catch_warnings(record=True) as collected:
        warnings.simplefilter("always")
        on_device.wait()
    assert_one_warning(collected, f"RuntimeError: {BROKEN}")
    assert collected[0].category is RuntimeWarning
    train(on_host, on_device, trainer, 2)
    on_device.wait()
    assert_bitwise(on_host, on_device)


def test_a_failure_after_one_launch_of_four_averages_finishes_only_the_fifth(model, trainer, stand_in) -> None:
    """Five averages take two launches; the second (one lerp: a specialization of its own) fails:
    the four the first launch wrote are kept, the fifth is finished through ATen, nothing twice."""
    rules = {f"ema{k}": EMA(decay=0.5 + 0.1 * k) for k in range(5)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        on_host, on_device = averagers(model, rules)
        train(on_host, on_device, trainer, 2)
        stand_in.fails = lambda options: options["COUNT"] == 1 and options["COPY"] == 0
        launches = stand_in.launches
        train(on_host, on_device, trainer, 2)
    later = [launch for launch in stand_in.launched[launches:] if launch[1] == 0]  # (not the buffers' copies)
    assert later == [(4, 0, False), (1, 0, True)], "the failing update did not launch the four, then the fifth"
    assert_one_warning(caught, BROKEN)
    assert_bitwise(on_host, on_device)


def test_the_self_check_runs_once_per_device(model, trainer, stand_in, checks: list[torch.device]) -> None:
    """At the kernel's first use on a device, and never again: not for a second averager, nor
    when the groups are rebuilt (a live tensor moved), until ``kernels.reset``."""
    first, second = averagers(model, EMA(decay=0.9))
    assert checks == [torch.device("cpu")] and stand_in.launches == 9
    model.to(torch.bfloat16)  # (new live tensors: both averagers regroup)
    train(first, second, trainer, 2)
    third = WeightAverager(model, SWA())
    third.update()
    assert kernels.usable(torch.device("cpu")) and not kernels.usable(torch.device("cuda"))
    assert checks == [torch.device("cpu")] and any(g.kernel for g in third.updater.groups)
    kernels.reset()
    assert kernels.usable(torch.device("cpu")) and len(checks) == 2


def test_shardavg_kernel_0_turns_the_kernel_off(model, trainer, stand_in, checks, monkeypatch) -> None:
    """For a user who must bisect: no self-check, no launch, no warning, the ATen path's bits."""
    monkeypatch.setenv(kernels.SWITCH, "0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        on_host, on_device = averagers(model, {"ema": EMA(decay=0.9)})
        train(on_host, on_device, trainer, 3)
    assert kernel_warnings(caught) == [] and checks == [] and stand_in.launches == 0
    assert not kernels.usable(torch.device("cpu")) and not any(g.kernel for g in on_device.updater.groups)
    assert_bitwise(on_host, on_device)
    monkeypatch.setenv(kernels.SWITCH, "1")
    assert kernels.usable(torch.device("cpu")) and checks == [torch.device("cpu")]


@pytest.mark.parametrize("value", ["false", "off", "no", " 0", "FALSE", "Off\n"])
def test_the_usual_spellings_of_off_turn_the_kernel_off(stand_in, checks, monkeypatch, value: str) -> None:
    """In any case, with spaces around: no self-check, no launch, no warning."""
    monkeypatch.setenv(kernels.SWITCH, value)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not kernels.usable(torch.device("cpu"))
    assert checks == [] and stand_in.launches == 0


@pytest.mark.parametrize("value", ["", "1", "true", "ON", " yes "])
def test_the_usual_spellings_of_on_leave_the_kernel_on_without_a_word(monkeypatch, value: str) -> None:
    monkeypatch.setenv(kernels.SWITCH, value)
    kernels.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not kernels.switched_off()


def test_a_value_not_understood_is_warned_about_once_and_leaves_the_kernel_on(stand_in, checks, monkeypatch) -> None:
    """A user who meant "off" learns that the kernel still runs, and how to say it; once per value."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for value in ("disable", "disable", "2"):
            monkeypatch.setenv(kernels.SWITCH, value)
            assert kernels.usable(torch.device("cpu")) and kernels.usable(torch.device("cpu"))
    given = [w for w in caught if str(w.message).startswith(f"shardavg: {kernels.SWITCH}=")]
    assert [w.category for w in given] == [RuntimeWarning, RuntimeWarning], [str(w.message) for w in given]
    assert str(given[0].message).startswith(f"shardavg: {kernels.SWITCH}='disable' in the environment is not")
    assert str(given[1].message).startswith(f"shardavg: {kernels.SWITCH}='2' in the environment")
    assert "set SHARDAVG_KERNEL to 0/false/off/no (in any case) to turn it off" in str(given[0].message)
    assert checks == [torch.device("cpu")] and kernel_warnings(caught) == []
