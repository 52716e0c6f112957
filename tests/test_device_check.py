"""The non-finite check as it runs on an accelerator, forced onto the CPU: the update turns no
tensor into a Python value, masks a non-finite update on the device, and the verdict, read
later, raises or skips exactly as the host-side check does at once."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from shardavg import EMA, SWA, NonFiniteError, PowerEMA, WeightAverager
from shardavg.rules import InverseGammaWarmup

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


def pair(model, policy: str, rules=RULES) -> tuple[WeightAverager, WeightAverager]:
    """The same averager twice: checked on the host, and checked on the 'device'."""
    on_host = WeightAverager(model, rules, on_nonfinite=policy, buffers="average")
    on_device = WeightAverager(model, rules, on_nonfinite=policy, buffers="average")
    on_device.updater.on_device = True
    return on_host, on_device


def assert_same(a: WeightAverager, b: WeightAverager) -> None:
    for name in a.rules:
        got, want = b.full_state_dict(name), a.full_state_dict(name)
        for key in want:
            assert torch.equal(got[key], want[key]), f"{name}: {key}"


def test_the_update_reads_nothing_back_and_equals_the_host_checked_one(model, trainer) -> None:
    on_host, on_device = pair(model, "raise")
    functions, scalars = HostReads(), ScalarReads()
    for step in range(1, 8):
        trainer.step()
        on_host.update()
        if step == 1:  # the first update is checked on the host (it copies)
            on_device.update()
            continue
        with functions, scalars:
            on_device.update()
    assert functions.seen == [] and scalars.count == 0, (functions.seen, scalars.count)
    assert len(on_device.updater.pending) == 6, "the updates did not take the device path: the check is vacuous"
    assert on_device.num_updates == 7 and not on_device.updater.pending
    assert_same(on_host, on_device)


def test_masked_updates_raise_or_skip_later_exactly_as_on_the_host(model, trainer) -> None:
    for policy in ("skip", "raise"):
        on_host, on_device = pair(model, policy)
        for step in range(1, 9):
            trainer.step()
            poisoned = step == 5
            if poisoned:
                with torch.no_grad():
                    model.block.up.weight[0, 0] = float("nan")
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
        assert len(on_device.updater.pending) == 7
        if policy == "skip":
            with pytest.warns(RuntimeWarning, match=r"skipped the update at step 5 on rank 0.*block.up.weight"):
                assert (on_device.num_updates, on_device.num_skipped) == (7, 1)
            assert (on_host.num_updates, on_host.num_skipped) == (7, 1)
        else:
            with pytest.raises(NonFiniteError, match=r"block.up.weight.*at step 5.*masked out"):
                on_device.num_updates  # noqa: B018
            assert on_device.num_updates == on_host.num_updates == 7
        assert_same(on_host, on_device)


@pytest.mark.parametrize("rule", [PowerEMA(gamma=5.0), EMA(decay=0.9)])
def test_bf16_live_weights_on_the_device_path_stay_close(model, trainer, rule) -> None:
    """bf16 lives lerp an fp32 masked copy there (the host path multiplies and adds): not the same
    bits, the same average to fp32 rounding."""
    model.to(torch.bfloat16)
    on_host, on_device = pair(model, "raise", {"a": rule})
    for _ in range(8):
        trainer.step()
        on_host.update()
        on_device.update()
    got, want = on_device.full_state_dict("a"), on_host.full_state_dict("a")
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-6, atol=1e-6)
