"""The Triton source of ``kernels.masked_update_`` and ``kernels.masked_update_many_`` (read the
``kernels`` docstring for why and how exact).

Imported by ``kernels`` only, at the first masked update, never by ``import shardavg``: it
imports Triton at the top, and ``triton.jit`` decides when it decorates whether the kernel is
compiled or interpreted (``TRITON_INTERPRET=1``), so ``kernels.reset`` has it imported again.
The Triton interpreter resolves the kernels' names in this module's globals only (no closures).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def load_f32(pointer, mask):
    """Values widened to fp32 exactly (bf16: its bits moved up, as ATen widens it)."""
    if pointer.dtype.element_ty == tl.bfloat16:
        bits = tl.load(pointer, mask=mask).to(tl.uint16, bitcast=True).to(tl.uint32)
        value = (bits << 16).to(tl.float32, bitcast=True)
    else:
        value = tl.load(pointer, mask=mask).to(tl.float32)
    return value


@triton.jit
def store_from_f32(pointer, value, mask):
    """``value`` rounded to the pointer's dtype, to nearest even; bf16 by ``c10::BFloat16``'s
    integer rounding (the interpreter's own cast to bf16 truncates)."""
    if pointer.dtype.element_ty == tl.bfloat16:
        bits = value.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(value != value, 0x7FC0, rounded)  # NaN: the canonical one, never a carry into the sign
        tl.store(pointer, rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask)
    else:
        tl.store(pointer, value.to(pointer.dtype.element_ty), mask=mask)


@triton.jit
def as_stored(pointer, value):
    """``value`` (fp32) rounded to the pointer's dtype and widened back exactly: what the host path
    lerps toward, the live value cast to the average's dtype first (fp32 weights into a bf16
    average: ``lerp(shadow, live.to(bf16), w)``, ATen's bf16 lerp in fp32 opmath)."""
    if pointer.dtype.element_ty == tl.bfloat16:
        bits = value.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(value != value, 0x7FC0, rounded)  # (NaN: the canonical one, as store_from_f32)
        result = (rounded << 16).to(tl.float32, bitcast=True)
    elif pointer.dtype.element_ty == tl.float16:
        result = value.to(tl.float16).to(tl.float32)
    else:
        result = value
    return result


@triton.jit
def one_shadow(shadow, weight, live_values, offsets, mask, COPY: tl.constexpr):
    """One average's shadow: a copy of the live values, or ATen's lerp in fp32 opmath toward the
    live values in the shadow's dtype (``as_stored``), fused."""
    if COPY:
        result = live_values
    else:
        w = load_f32(weight, None)
        s = load_f32(shadow + offsets, mask)
        target = as_stored(shadow, live_values)
        diff = target - s
        result = tl.where(tl.abs(w) < 0.5, tl.fma(w, diff, s), tl.fma(-diff, 1.0 - w, target))
    store_from_f32(shadow + offsets, result, mask)


@triton.jit
def masked_lerp(
    live, ok, numel, s0, w0, s1, w1, s2, w2, s3, w3,
    COUNT: tl.constexpr, COPY: tl.constexpr, PROGRAM_NUMEL: tl.constexpr,
):  # fmt: skip
    """``COUNT`` shadows (``s0``..) updated from one read of ``live``, each with its weight (``w0``..;
    bit k of ``COPY``: copy into shadow k); where ``ok`` is false every access is masked off."""
    offsets = tl.program_id(0).to(tl.int64) * PROGRAM_NUMEL + tl.arange(0, PROGRAM_NUMEL)
    mask = offsets < tl.where(tl.load(ok) != 0, numel, 0)  # (the interpreter widens a mask & a scalar flag to int32)
    live_values = load_f32(live + offsets, mask)
    one_shadow(s0, w0, live_values, offsets, mask, COPY & 1)
    if COUNT > 1:
        one_shadow(s1, w1, live_values, offsets, mask, (COPY >> 1) & 1)
    if COUNT > 2:
        one_shadow(s2, w2, live_values, offsets, mask, (COPY >> 2) & 1)
    if COUNT > 3:
        one_shadow(s3, w3, live_values, offsets, mask, (COPY >> 3) & 1)


# the element type a piece's address is cast to (a constexpr of ``masked_lerp_many``)
TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def address(table, piece, DTYPE: tl.constexpr, ALIGN: tl.constexpr):
    """Entry ``piece`` of the int64 ``table`` as a pointer to ``DTYPE``, which the compiler is told
    is a multiple of ``ALIGN`` bytes (so that a whole program's elements load and store in vectors)."""
    return tl.multiple_of(tl.load(table + piece).to(tl.pointer_type(DTYPE)), ALIGN)


@triton.jit
def one_program(
    live_table, t0, w0, t1, w1, t2, w2, t3, w3, piece, offsets, mask,
    LIVE: tl.constexpr, S0: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr, S3: tl.constexpr,
    ALIGN: tl.constexpr, COUNT: tl.constexpr, COPY: tl.constexpr,
):  # fmt: skip
    """One program's elements of piece ``piece``: its live values read once, each of ``COUNT`` shadows updated."""
    live_values = load_f32(address(live_table, piece, LIVE, ALIGN) + offsets, mask)
    one_shadow(address(t0, piece, S0, ALIGN), w0, live_values, offsets, mask, COPY & 1)
    if COUNT > 1:
        one_shadow(address(t1, piece, S1, ALIGN), w1, live_values, offsets, mask, (COPY >> 1) & 1)
    if COUNT > 2:
        one_shadow(address(t2, piece, S2, ALIGN), w2, live_values, offsets, mask, (COPY >> 2) & 1)
    if COUNT > 3:
        one_shadow(address(t3, piece, S3, ALIGN), w3, live_values, offsets, mask, (COPY >> 3) & 1)


@triton.jit
def masked_lerp_many(
    live_table, piece_of_program, index_in_piece, numels, ok, t0, w0, t1, w1, t2, w2, t3, w3,
    LIVE: tl.constexpr, S0: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr, S3: tl.constexpr,
    ALIGN: tl.constexpr, COUNT: tl.constexpr, COPY: tl.constexpr, PROGRAM_NUMEL: tl.constexpr,
):  # fmt: skip
    """``masked_lerp`` over many pieces in one launch: program ``p`` updates the
    ``index_in_piece[p]``-th ``PROGRAM_NUMEL`` elements of piece ``piece_of_program[p]``, whose addresses it reads from
    ``live_table`` and each shadow's table (``t0``..; int64, one entry per piece, elements of
    ``LIVE``, ``S0``..). A program inside its piece (all but a piece's last) goes unmasked, in
    vectors; where ``ok`` is false every program is masked off whole."""
    program = tl.program_id(0)
    piece = tl.load(piece_of_program + program)
    first = tl.load(index_in_piece + program) * PROGRAM_NUMEL  # (int64: a piece may hold 2**31 elements or more)
    offsets = first + tl.arange(0, PROGRAM_NUMEL)
    limit = tl.where(tl.load(ok) != 0, tl.load(numels + piece), 0)
    if first + PROGRAM_NUMEL <= limit:
        one_program(live_table, t0, w0, t1, w1, t2, w2, t3, w3, piece, offsets, None,
                  LIVE, S0, S1, S2, S3, ALIGN, COUNT, COPY)  # fmt: skip
    else:
        one_program(live_table, t0, w0, t1, w1, t2, w2, t3, w3, piece, offsets, offsets < limit,
                  LIVE, S0, S1, S2, S3, ALIGN, COUNT, COPY)  # fmt: skip
