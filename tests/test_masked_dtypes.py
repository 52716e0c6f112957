"""The device path's masked update in ATen (``fused._masked_lerp``: where Triton does not run, or
after the kernel failed) is bitwise the host path's update for every pair of live and average
dtypes the averager allows (fp32, bf16, fp16 live weights, each into an fp32, bf16 or fp16
average), forced onto the CPU as tests/test_device_check.py forces it (``on_device = True``).

Two slips it once made, each caught here: the live values were promoted with the shadow instead of
cast to its dtype (an fp32 local shard into a bf16 average: "expected dtype c10::BFloat16"), and
the lerp weight was rounded to a bf16 or fp16 shadow's dtype, where the host path's lerp by a
Python float runs in fp32. The Triton kernel's own bits for these pairs are tests/test_kernels.py's
and tests_gpu/'s concern: this file runs ATen only, so it is fast."""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch

from shardavg import EMA, SWA, WeightAverager
from shardavg.update.updater import Updater

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
PAIRS = list(itertools.product(DTYPES, DTYPES))
POISONED = 4  # the update whose live weights hold a NaN: masked out on the device, skipped on the host


class Mixed(torch.nn.Module):
    """Shards of every kind the groups walk: a large weight (fused pieces), enough small
    parameters apart in memory to be gathered into one staging buffer, and a 0-d scalar."""

    def __init__(self) -> None:
        super().__init__()
        self.large = torch.nn.Linear(160, 40)
        self.small = torch.nn.ModuleList(torch.nn.LayerNorm(7) for _ in range(9))
        self.scale = torch.nn.Parameter(torch.tensor(1.5))


def averager(model: torch.nn.Module, dtype: torch.dtype, on_device: bool) -> WeightAverager:
    """An EMA (weight 0.1, below 0.5, where ATen's lerp takes one form) and an SWA (weights 1/2,
    1/3, ...: 0.5 and above take the other) into ``dtype``, checked on the host or on the 'device'."""
    with pytest.MonkeyPatch.context() as patch, warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # (a bf16 average of fp32 weights says it is below them)
        patch.setattr(Updater, "kernel_devices", frozenset({"cuda"}))  # (ATen on the CPU whatever the interpreter)
        built = WeightAverager(model, {"ema": EMA(decay=0.9), "swa": SWA()}, dtype=dtype, on_nonfinite="skip")
    built.updater.on_device = on_device
    return built


@pytest.mark.parametrize(("live_dtype", "average_dtype"), PAIRS, ids=[f"{NAMES[a]}-into-{NAMES[b]}" for a, b in PAIRS])
def test_the_masked_aten_update_is_the_host_update_bitwise(live_dtype: torch.dtype, average_dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    model = Mixed().to(live_dtype)
    on_host, on_device = averager(model, average_dtype, False), averager(model, average_dtype, True)
    generator = torch.Generator().manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # (the skip of the poisoned update, said by both)
        for update in range(1, 8):
            with torch.no_grad():  # a step of random size: every bit of the live weights moves
                for parameter in model.parameters():
                    noise = torch.randn(parameter.shape, generator=generator) * 0.7
                    parameter.add_(noise.to(live_dtype))
                if update == POISONED:
                    model.large.weight[3, 5] = float("nan")
            on_host.update()
            on_device.update()
            if update > 1:  # (the first update copies, checked on the host)
                assert len(on_device.updater.pending) == 1, "the update did not take the device path: vacuous"
            if update == POISONED:
                with torch.no_grad():
                    model.large.weight[3, 5] = 0.25
    assert (on_device.num_updates, on_device.num_skipped) == (on_host.num_updates, on_host.num_skipped) == (6, 1)
    for name in ("ema", "swa"):
        want, got = on_host.full_state_dict(name), on_device.full_state_dict(name)
        for key in want:
            assert got[key].dtype == want[key].dtype == average_dtype, key
            assert torch.equal(got[key], want[key]), f"{name}: {key} ({live_dtype} live into {average_dtype})"
