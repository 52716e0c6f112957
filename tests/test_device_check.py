"""The non-finite check as it runs on an accelerator, forced onto the CPU: the update turns no
tensor it computes into a Python value, masks a non-finite update on the device, and the verdict,
read at the next call (the CPU's always by the next ``update()``), raises or skips exactly as the
host-side check does at once. Each test of the update's bits runs twice: the masked update in ATen
(``where`` then ``lerp``, where Triton does not run), and the Triton kernel that CUDA runs by
default, here through Triton's interpreter on the CPU."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from shardavg import EMA, SWA, NonFiniteError, PowerEMA, WeightAverager
from shardavg.rules import InverseGammaWarmup
from shardavg.update import kernels
from shardavg.update.updater import Updater

HOST_READS = {"item", "__bool__", "tolist", "__int__", "__float__", "__index__", "numpy"}


class HostReads(TorchFunctionMode):
    """Tensor methods that hand a value to Python (each one a device sync on CUDA)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_READS:
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


class ScalarReads(TorchDispatchMode):
    """The aten op every scalar read ends in, whatever Python spelled it."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ == "_local_scalar_dense":
            self.count += 1
        return func(*args, **(kwargs or {}))


RULES = {"ema": EMA(decay=0.9), "warm": EMA(decay=0.99, warmup=InverseGammaWarmup(1.0, 0.75)), "swa": SWA()}


@pytest.fixture(params=["aten", "kernel"])
def device_path(request, monkeypatch):
    """Which masked update the 'device' runs: ATen's, or the Triton kernel (interpreted), chosen
    by default as on CUDA."""
    if request.param == "kernel":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        monkeypatch.setattr(Updater, "kernel_devices", frozenset({"cpu", "cuda"}))
    kernels.reset()
    if request.param == "kernel" and not kernels.usable(torch.device("cpu")):
        pytest.skip("Triton's interpreter before 3.9 cannot show the kernel's bits (tests/test_kernels.py says why)")
    yield request.param
    kernels.reset()


def pair(model, policy: str, rules=RULES, path: str = "aten") -> tuple[WeightAverager, WeightAverager]:
    """The same averager twice: checked on the host, and checked on the 'device' (the ATen
    masked update forced, or the kernel chosen by default)."""
    with pytest.MonkeyPatch.context() as host_only:
        host_only.setattr(Updater, "kernel_devices", frozenset({"cuda"}))
        on_host = WeightAverager(model, rules, on_nonfinite=policy, buffers="average")
    on_device = WeightAverager(model, rules, on_nonfinite=policy, buffers="average")
    if path == "aten":
        on_device.updater.on_device = True
    else:
        assert all(g.kernel for g in on_device.updater.groups if g.live_tensors[0].dtype.is_floating_point)
    return on_host, on_device


def assert_same(a: WeightAverager, b: WeightAverager) -> None:
    for name in a.rules:
        got, want = b.full_state_dict(name), a.full_state_dict(name)
        for key in want:
            assert torch.equal(got[key], want[key]), f"{name}: {key}"


def test_the_update_reads_nothing_back_and_equals_the_host_checked_one(model, trainer, device_path) -> None:
    on_host, on_device = pair(model, "raise", path=device_path)
    functions, scalars = HostReads(), ScalarReads()
    for step in range(1, 8):
        trainer.step()
        on_host.update()
        if step == 1:  # the first update is checked on the host (it copies)
            on_device.update()
            continue
        on_device.updater.settle(block=False)  # (the last update's verdict, on the host: what update() reads first)
        with functions, scalars:
            on_device.update()
        assert len(on_device.updater.pending) == 1, "the update did not take the device path: the check is vacuous"
    assert functions.seen == [] and scalars.count == 0, (functions.seen, scalars.count)
    assert on_device.num_updates == 7 and not on_device.updater.pending
    assert_same(on_host, on_device)


def test_masked_updates_raise_or_skip_later_exactly_as_on_the_host(model, trainer, device_path) -> None:
    for policy in ("skip", "raise"):
        on_host, on_device = pair(model, policy, path=device_path)
        for step in range(1, 9):
            trainer.step()
            poisoned = step == 5
            if poisoned:
                with torch.no_grad():
                    model.block.up.weight[0, 0] = float("nan")
            if step == 6 and policy == "skip":  # the verdict of step 5, on the host: given at the next update()
                with pytest.warns(RuntimeWarning, match=r"skipped the update at step 5 on rank 0.*block.up.weight"):
                    on_device.update()
            elif step == 6:
                with pytest.raises(NonFiniteError, match=r"block.up.weight.*at step 5.*masked out"):
                    on_device.update()
                on_device.update()  # (the refused call took no step: this one takes step 6)
            else:
                on_device.updater.settle(block=False)  # (the last verdict, on the host: what update() reads first)
                with HostReads() as reads:
                    on_device.update()  # issued and masked on the device: no error yet
                assert reads.seen == [] or step == 1, reads.seen
            if poisoned and policy == "skip":
                with pytest.warns(RuntimeWarning, match=r"non-finite live values in \['block.up.weight'\]"):
                    on_host.update()
            elif poisoned:
                with pytest.raises(NonFiniteError, match=r"block.up.weight.*at step 5"):
                    on_host.update()
            else:
                on_host.update()
            if poisoned:
                with torch.no_grad():
                    model.block.up.weight[0, 0] = 0.5
        assert len(on_device.updater.pending) == 1, "the last update did not take the device path"
        assert (on_device.num_updates, on_device.num_skipped) == (on_host.num_updates, on_host.num_skipped)
        assert on_host.num_updates == 7 and on_host.num_skipped == (policy == "skip")
        assert_same(on_host, on_device)


@pytest.mark.parametrize("policy", ["raise", "skip"])
def test_the_next_update_gives_the_verdict_the_cpu_already_holds(model, trainer, policy) -> None:
    """Forced onto the CPU, the device path's verdict is on the host as soon as it is computed: the
    next ``update()`` raises or warns for it, once, not whatever call next reads the count. A
    refused call changes nothing: the step it was given is still to come."""
    averager = WeightAverager(model, EMA(decay=0.9), on_nonfinite=policy)
    averager.updater.on_device = True
    for _ in range(2):
        trainer.step()
        averager.update()
    with torch.no_grad():
        model.block.up.weight[0, 0] = float("nan")
    averager.update()  # step 3: issued and masked on the device, no error yet
    assert averager.updater.pending, "the update did not take the device path: the check is vacuous"
    with torch.no_grad():
        model.block.up.weight[0, 0] = 0.5
    trainer.step()
    if policy == "raise":
        with pytest.raises(NonFiniteError, match=r"\['block.up.weight'\] at step 3 on rank 0 .*masked out"):
            averager.update(4)
        assert averager.step == 3 and averager.update(4) is True  # refused before it took step 4
    else:
        with pytest.warns(RuntimeWarning, match=r"^skipped the update at step 3 on rank 0.*'block.up.weight'") as given:
            averager.update(4)
        assert len(given) == 1
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        assert (averager.num_updates, averager.num_skipped) == (3, policy == "skip")
    assert again == [], "the verdict was given twice"


@pytest.mark.parametrize("rule", [PowerEMA(gamma=5.0), EMA(decay=0.9)])
def test_bf16_live_weights_on_the_device_path_take_the_host_paths_bits(model, trainer, rule, device_path) -> None:
    """bf16 lives into fp32 averages: the host casts them piece by piece and lerps, ATen's masked
    update lerps an fp32 masked copy, the kernel casts as it reads: the same bits."""
    model.to(torch.bfloat16)
    on_host, on_device = pair(model, "raise", {"a": rule}, path=device_path)
    for _ in range(8):
        trainer.step()
        on_host.update()
        on_device.update()
    assert len(on_device.updater.pending) > 0, "the updates did not take the device path: the check is vacuous"
    assert_same(on_host, on_device)
