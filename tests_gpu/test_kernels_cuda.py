"""The masked lerp kernel (``shardavg.kernels``) compiled for the GPU: bitwise ``torch._foreach_lerp_``
on the same device, nothing written when the device flag says no, and no wait for the host.
(tests/test_kernels.py checks the same kernel on the CPU through Triton's interpreter.)"""

from __future__ import annotations

import pytest
import torch
from conftest import no_sync

from shardavg.update import kernels

pytestmark = pytest.mark.usefixtures("compiled_kernels")

SIZES = (1, 1023, 1025, 2**20 + 3)  # around the kernel's block (1024), and a fused piece's size (2**20) and more
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def bitwise(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Same dtype and the same bits (``torch.equal`` takes -0.0 for 0.0)."""
    return got.dtype == want.dtype and torch.equal(got.view(BITS[got.dtype]), want.view(BITS[want.dtype]))


def values(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(numel, generator=generator, device="cuda") * 3).to(dtype)


def weight(value: float) -> torch.Tensor:
    return torch.full((1,), value, dtype=torch.float32, device="cuda")


def flag(value: bool) -> torch.Tensor:
    return torch.full((), value, dtype=torch.bool, device="cuda")


@pytest.mark.parametrize("w", [0.001, 0.7])
def test_fp32_is_bitwise_foreach_lerp_on_cuda(w: float) -> None:
    for numel in SIZES:
        live, shadow = values(numel, torch.float32, 1), values(numel, torch.float32, 2)
        want = [shadow.clone()]
        torch._foreach_lerp_(want, [live], w)
        kernels.masked_update_([shadow], live, [weight(w)], flag(True))
        assert bitwise(shadow, want[0]), (numel, w)


@pytest.mark.parametrize("w", [0.001, 0.7])
def test_bf16_live_weights_into_fp32_are_bitwise_the_lerp_toward_their_fp32_value(w: float) -> None:
    for numel in SIZES:
        live, shadow = values(numel, torch.bfloat16, 3), values(numel, torch.float32, 4)
        want = [shadow.clone()]
        torch._foreach_lerp_(want, [live.float()], w)
        kernels.masked_update_([shadow], live, [weight(w)], flag(True))
        assert bitwise(shadow, want[0]), (numel, w)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_shadows_are_bitwise_foreach_lerp_in_their_dtype_on_cuda(dtype: torch.dtype) -> None:
    """ATen's lerp computes bf16/fp16 in fp32 and rounds once (to nearest even), as the kernel does."""
    for w in (0.001, 0.7):
        live, shadow = values(2**20 + 3, dtype, 5), values(2**20 + 3, dtype, 6)
        want = [shadow.clone()]
        torch._foreach_lerp_(want, [live], w)
        kernels.masked_update_([shadow], live, [weight(w)], flag(True))
        assert bitwise(shadow, want[0]), (dtype, w)


def test_several_shadows_and_a_copy_from_one_read() -> None:
    live = values(300_001, torch.bfloat16, 7)
    shadows = [values(300_001, torch.float32, 8 + k) for k in range(5)]
    given = [weight(0.001), weight(0.7), None, weight(0.5), weight(1.0)]
    wants = [live.float() if w is None else torch.lerp(s, live.float(), w.item()) for s, w in zip(shadows, given)]
    kernels.masked_update_(shadows, live, given, flag(True))
    for index, (shadow, want) in enumerate(zip(shadows, wants)):
        assert bitwise(shadow, want), index


def test_a_false_device_flag_writes_no_byte_and_the_host_never_waits() -> None:
    """The flag computed on the device from live values holding NaN and infinity: every shadow
    keeps its bytes, and neither the flag nor the launch makes the host wait (after a first call
    that compiles the kernel)."""
    live = values(2**20 + 3, torch.float32, 20)
    live[::7] = float("nan")
    live[3::11] = float("inf")
    shadows = [values(2**20 + 3, torch.float32, 21), values(2**20 + 3, torch.bfloat16, 22)]
    before = [shadow.clone() for shadow in shadows]
    given = [weight(0.001), None]
    kernels.masked_update_(shadows, live, given, flag(False))  # (compiles this variant)
    with no_sync():
        ok = torch.isfinite(live).all()
        for _ in range(3):
            kernels.masked_update_(shadows, live, given, ok)
    for index, (shadow, old) in enumerate(zip(shadows, before)):
        assert bitwise(shadow, old), index


# The multi-tensor form: one launch for a whole list of pieces (``kernels.plan``, ``masked_update_many_``)

MANY_SIZES = (1, 5, 1023, 1024, 1025, 70000, 2**20 + 3)  # tiny and large pieces mixed in one launch


def pieces(dtype: torch.dtype, seed: int, offset: int = 0) -> list[torch.Tensor]:
    """One piece per ``MANY_SIZES``, each ``offset`` elements into its own allocation."""
    return [values(numel + offset, dtype, seed * 100 + index)[offset:] for index, numel in enumerate(MANY_SIZES)]


def foreach_lerped(shadows: list[torch.Tensor], reads: list[torch.Tensor], w: float | None) -> list[torch.Tensor]:
    """``torch._foreach_lerp_`` of copies of ``shadows`` toward ``reads`` (in the shadows' dtype
    where they are fp32: bitwise the kernel's widening), or a cast copy (``w`` None)."""
    if w is None:
        return [read.to(shadow.dtype) for shadow, read in zip(shadows, reads)]
    wants = [shadow.clone() for shadow in shadows]
    targets = [read.to(shadow.dtype) if shadow.dtype == torch.float32 else read for shadow, read in zip(shadows, reads)]
    torch._foreach_lerp_(wants, targets, w)
    return wants


@pytest.mark.parametrize("offset", [0, 1])  # (aligned: full blocks in 16-byte vectors; one element in: no vectors)
@pytest.mark.parametrize("live_dtype", [torch.float32, torch.bfloat16])
def test_many_pieces_in_one_launch_are_bitwise_foreach_lerp_on_cuda(live_dtype: torch.dtype, offset: int) -> None:
    """Four averages (fp32 lerps, a copy, and a bf16 shadow where the live pieces are bf16, which
    ATen lerps in bf16), over pieces from 1 element to 2**20 + 3."""
    reads = pieces(live_dtype, 1, offset)
    dtypes = [torch.float32, torch.float32, torch.float32, live_dtype]
    shadow_sets = [pieces(dtype, 2 + k, offset) for k, dtype in enumerate(dtypes)]
    given = [0.001, 0.7, None, 0.5]
    wants = [foreach_lerped(shadows, reads, w) for shadows, w in zip(shadow_sets, given)]
    planned = kernels.plan(reads, shadow_sets)
    assert planned.align == (16 if offset == 0 else live_dtype.itemsize)
    kernels.masked_update_many_(planned, [None if w is None else weight(w) for w in given], flag(True))
    for k, (shadows, want) in enumerate(zip(shadow_sets, wants)):
        for position, (shadow, expected) in enumerate(zip(shadows, want)):
            assert bitwise(shadow, expected), (k, position, shadow.numel())


def test_many_a_false_device_flag_writes_no_byte_and_a_reused_plan_never_waits() -> None:
    """The plan built (its tables copied to the device), then updates through it with the flag
    computed on the device from live values holding NaN: no byte written, and neither the plan
    nor the updates make the host wait (after a first update that compiles the kernel)."""
    reads = pieces(torch.bfloat16, 20)
    for read in reads:
        read[::7] = float("nan")
    shadow_sets = [pieces(torch.float32, 21), pieces(torch.bfloat16, 22)]
    before = [[shadow.clone() for shadow in shadows] for shadows in shadow_sets]
    given = [weight(0.001), None]
    kernels.masked_update_many_(kernels.plan(reads, shadow_sets), given, flag(False))  # (compiles this variant)
    with no_sync():
        planned = kernels.plan(reads, shadow_sets)
        ok = torch.stack([torch.isfinite(read).all() for read in reads]).all()
        for _ in range(3):
            kernels.masked_update_many_(planned, given, ok)
    for k, (shadows, old) in enumerate(zip(shadow_sets, before)):
        for position, (shadow, expected) in enumerate(zip(shadows, old)):
            assert bitwise(shadow, expected), (k, position)
