"""The masked lerp as one Triton kernel: the update skipped on the device, by a flag the host never reads.

Why a kernel: on CUDA the non-finite check's verdict is a device flag, and the update must be
skipped on it without the host waiting for it. ATen offers no lerp that a device flag can skip:
the way through ATen is ``lerp_(where(ok, live, shadow), w)``, a ``where`` scratch the size of
each shard written and read again, measured 2-4x slower than the lerp alone on an H200
(docs/benchmarks.md, "On a GPU"). Here one launch reads each live element once, and reads and
writes each shadow of it once (up to ``MAX_SHADOWS`` averages per launch), with the flag in every
mask: where it is false no shadow byte is written and no live byte is read, so a live shard
holding NaN or infinity leaves every average as it was.

Exactness: each element is ATen's ``lerp`` in fp32 opmath, in the fused form both of ATen's
builds compile it to (CPU: ``lerp_vec``'s ``fmadd``; CUDA: ``nvcc`` contracting the expression):
``|w| < 0.5 ? fma(w, l - s, s) : fma(-(l - s), 1 - w, l)``, with ``s``, ``l`` and ``w`` widened to
fp32 exactly, and the result rounded to the shadow's dtype to nearest even (for bfloat16 by the
same integer rounding as ``c10::BFloat16``, which the Triton interpreter's own cast does not
do). So an fp32 shadow lerped toward fp32 live values is bitwise ``torch._foreach_lerp_``; toward
bf16/fp16 live values, bitwise ``_foreach_lerp_(shadow, live.float(), w)``. The tests prove it on
a CPU through the Triton interpreter (``TRITON_INTERPRET=1``, tests/test_kernels.py; Triton 3.9 or
later, whose interpreter rounds an fma once); on CUDA, compiled, only
``tests_gpu/test_kernels_cuda.py`` on a device does.

One launch per piece costs 10-20 us of host time, more than a small shard's bytes take on a GPU
(under FSDP2 a rank holds one piece per parameter): ``plan`` builds once, on the device, the
tables of a list of pieces (each one's address, and per program of ``PROGRAM_NUMEL`` elements the piece it
belongs to), and ``masked_update_many_`` then updates all of them in one launch, element by
element the same arithmetic as ``masked_update_``.

Triton is imported on first use only (``shardavg`` imports without it), and the kernel is built
then too, so that ``TRITON_INTERPRET`` set before the first call decides how it runs; ``reset``
forgets both, for tests that switch it.
"""

from __future__ import annotations

import functools
import importlib
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

MAX_SHADOWS = 4  # averages updated by one launch (one read of the live piece); more take another launch
PROGRAM_NUMEL = 1024  # elements per program
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
EXACT_INTERPRETER = (3, 9)  # the first Triton whose interpreter computes an fp32 fma with one rounding


def usable(device: torch.device) -> bool:
    """Whether ``masked_update_`` runs on ``device``: Triton importable and a CUDA device (not under
    ``TRITON_INTERPRET=1``, where every launch would copy through the host), or the CPU under
    ``TRITON_INTERPRET=1`` (how the tests run it) with an interpreter whose ``fma`` rounds once
    (Triton 3.9 and later; before, it multiplied then added, which loses the bits of ATen's lerp).
    Never raises; cached per device type (``reset``)."""
    return _usable(torch.device(device).type)


@functools.cache
def _usable(device_type: str) -> bool:
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if device_type != ("cpu" if interpreted else "cuda"):
        return False  # (before importing Triton, which a CPU run never needs)
    try:
        import triton
    except Exception:  # (a broken install is as good as none)
        return False
    return not interpreted or _version(triton.__version__) >= EXACT_INTERPRETER


def _version(text: str) -> tuple[int, ...]:
    """``3.9.0+git1a2b`` as (3, 9): the release's major and minor."""
    return tuple(int("".join(c for c in field if c.isdigit()) or 0) for field in text.split(".")[:2])


def reset() -> None:
    """Forget the built kernel and the ``usable`` answers (tests that set ``TRITON_INTERPRET``)."""
    _module.cache_clear()
    _usable.cache_clear()


def masked_update_(
    shadows: Sequence[torch.Tensor], live: torch.Tensor, weights: Sequence[torch.Tensor | None], ok: torch.Tensor
) -> None:
    """Where the device flag ``ok`` is true, lerp each shadow toward ``live`` by its weight (None:
    copy ``live``, cast); where it is false, write nothing. No host sync, no temporary.

    Args:
        shadows: One per average, flat, contiguous, ``live``'s size and device; fp32, bf16 or fp16.
        live: The live piece, flat and contiguous; fp32, bf16 or fp16.
        weights: Per shadow, its lerp weight as a 1-element tensor on the device (fp32 for
            bitwise ``_foreach_lerp_`` with a Python float weight: ATen widens that double to
            fp32 directly, a bf16 weight would round it first), or None to copy.
        ok: A 1-element bool tensor on the device: whether to update at all.

    Raises:
        ValueError: The tensors do not fit together as above.
    """
    _check(shadows, live, weights, ok)
    if not live.numel() or not shadows:
        return
    kernel = _module().masked_lerp
    grid = ((live.numel() + PROGRAM_NUMEL - 1) // PROGRAM_NUMEL,)
    for start in range(0, len(shadows), MAX_SHADOWS):
        launched, launched_weights = shadows[start : start + MAX_SHADOWS], weights[start : start + MAX_SHADOWS]
        slots: list[Any] = []
        for slot in range(MAX_SHADOWS):  # (unused slots are never touched: COUNT says how many are real)
            slots += [launched[slot], launched_weights[slot]] if slot < len(launched) else [None, None]
        copy = sum(1 << slot for slot, weight in enumerate(launched_weights) if weight is None)
        options = {"COUNT": len(launched), "COPY": copy, "PROGRAM_NUMEL": PROGRAM_NUMEL, "num_warps": 4}
        kernel[grid](live, ok, live.numel(), *slots, **options, enable_fp_fusion=False)  # (its fmas are explicit)


@dataclass(frozen=True, eq=False)
class Plan:
    """What one launch of ``masked_update_many_`` needs, built once by ``plan`` and reused by every
    update while the pieces stay where they are: it holds their addresses, so it holds the
    tensors too (none is freed under it), and is rebuilt when one is reallocated.

    The tables live on the pieces' device, int64: an address per piece for the live pieces and
    for each average's shadows, and per program (``PROGRAM_NUMEL`` elements) the piece it
    works on and which of its programs it is, so that one launch spends one program on a 5-element
    piece and thousands on a large one, none on padding."""

    reads: tuple[torch.Tensor, ...]  # the non-empty pieces, in order
    shadow_sets: tuple[tuple[torch.Tensor, ...], ...]  # per average, its shadows of ``reads``
    live_table: torch.Tensor  # (pieces,): each read's address
    shadow_tables: tuple[torch.Tensor, ...]  # per average, (pieces,): each shadow's address
    numels: torch.Tensor  # (pieces,)
    piece_of_program: torch.Tensor  # (programs,)
    index_in_piece: torch.Tensor  # (programs,)
    align: int  # bytes: the largest power of two, up to 16, that divides every address

    @property
    def averages(self) -> int:
        return len(self.shadow_sets)

    @property
    def programs(self) -> int:
        return self.piece_of_program.numel()


def plan(reads: Sequence[torch.Tensor], shadow_sets: Sequence[Sequence[torch.Tensor]]) -> Plan:
    """The tables of ``masked_update_many_`` over ``reads`` and their shadows, built once and
    copied to their device (from pinned memory: the host does not wait for the copy).

    Args:
        reads: The live pieces, flat and contiguous, of one dtype (fp32, bf16 or fp16) on one
            device; empty ones are left out.
        shadow_sets: Per average, its shadow of each piece: flat, contiguous, the piece's size
            and device, one dtype (fp32, bf16 or fp16) for all of an average's shadows. More than
            ``MAX_SHADOWS`` averages take one launch per ``MAX_SHADOWS``.

    Raises:
        ValueError: The tensors do not fit together as above (naming the first that does not),
            or the kernel does not run on their device (``usable``).
    """
    _check_plan(reads, shadow_sets)
    device = reads[0].device if reads else torch.device("cpu")
    if reads and not usable(device):  # (interpreted, a CUDA address would be read on the host)
        raise ValueError(
            f"plan: the kernel does not run on {device} here: check kernels.usable(device) first "
            "(CUDA compiled, or the CPU under TRITON_INTERPRET=1 with Triton 3.9 or later)"
        )
    kept = [position for position, read in enumerate(reads) if read.numel()]
    reads = [reads[p] for p in kept]
    shadow_sets = [[shadows[p] for p in kept] for shadows in shadow_sets]
    pointers = [[read.data_ptr() for read in reads]] + [[s.data_ptr() for s in shadows] for shadows in shadow_sets]
    addresses = to_device(torch.tensor(pointers, dtype=torch.int64).reshape(len(pointers), len(reads)), device)
    numels = torch.tensor([read.numel() for read in reads], dtype=torch.int64)
    counts = (numels + PROGRAM_NUMEL - 1) // PROGRAM_NUMEL
    pieces = torch.repeat_interleave(torch.arange(len(reads)), counts)
    firsts = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    programs = to_device(torch.stack([pieces, torch.arange(pieces.numel()) - firsts]), device)
    return Plan(
        reads=tuple(reads),
        shadow_sets=tuple(map(tuple, shadow_sets)),
        live_table=addresses[0],
        shadow_tables=tuple(addresses[1:]),
        numels=to_device(numels, device),
        piece_of_program=programs[0],
        index_in_piece=programs[1],
        align=math.gcd(16, *(pointer for row in pointers for pointer in row)),
    )


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` on ``device`` without the host waiting: through pinned memory to CUDA (torch's
    host allocator keeps the pinned block until the copy is done)."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def masked_update_many_(plan: Plan, weights: Sequence[torch.Tensor | None], ok: torch.Tensor) -> None:
    """``masked_update_`` of every piece of ``plan`` in one launch (one per ``MAX_SHADOWS``
    averages), where one launch per piece costs 10-20 us of host time each, more than a small
    shard's bytes take on a GPU: where the device flag ``ok`` is true, average ``k``'s shadow of
    each piece lerps toward it by ``weights[k]`` (None: copies it, cast), bitwise as
    ``masked_update_``; where it is false, nothing is written. No host sync, no allocation.

    Args:
        plan: From ``plan``, its tensors still where they were.
        weights: Per average, a 1-element float tensor on the pieces' device, or None to copy.
        ok: A 1-element bool tensor on the pieces' device: whether to update at all.

    Raises:
        ValueError: ``weights`` or ``ok`` do not fit the plan.
    """
    _check_many(plan, weights, ok)
    if not plan.programs or not plan.averages:
        return
    module = _module()
    live = module.TL_DTYPES[plan.reads[0].dtype]
    for start in range(0, plan.averages, MAX_SHADOWS):
        launched = range(start, min(start + MAX_SHADOWS, plan.averages))
        slots: list[Any] = []
        dtypes: list[Any] = []
        for slot in range(MAX_SHADOWS):  # (unused slots are never touched: COUNT says how many are real)
            k = start + slot
            slots += [plan.shadow_tables[k], weights[k]] if k in launched else [None, None]
            dtypes.append(module.TL_DTYPES[plan.shadow_sets[k][0].dtype] if k in launched else None)
        copy = sum(1 << slot for slot, k in enumerate(launched) if weights[k] is None)
        options = {
            "ALIGN": plan.align,
            "COUNT": len(launched),
            "COPY": copy,
            "PROGRAM_NUMEL": PROGRAM_NUMEL,
            "num_warps": 4,
        }
        module.masked_lerp_many[(plan.programs,)](
            plan.live_table, plan.piece_of_program, plan.index_in_piece, plan.numels, ok, *slots, live, *dtypes,
            **options, enable_fp_fusion=False,
        )  # fmt: skip


def _check_plan(reads: Sequence[torch.Tensor], shadow_sets: Sequence[Sequence[torch.Tensor]]) -> None:
    """Refuse pieces the kernel would read or write out of bounds, on another device, or through
    a pointer of another dtype."""
    if not reads:
        return
    first = reads[0]
    for index, read in enumerate(reads):
        if read.dtype not in DTYPES or read.dim() != 1 or not read.is_contiguous():
            raise ValueError(f"plan: read {index} is {_described(read)}: pass flat contiguous fp32/bf16/fp16 pieces")
        if read.dtype != first.dtype or read.device != first.device:
            raise ValueError(
                f"plan: read {index} is {_described(read)} but read 0 is {_described(first)}: "
                "plan pieces of one dtype and device together"
            )
    for k, shadows in enumerate(shadow_sets):
        if len(shadows) != len(reads):
            raise ValueError(f"plan: average {k} has {len(shadows)} shadows for {len(reads)} reads: give one per read")
        for index, (shadow, read) in enumerate(zip(shadows, reads)):
            if shadow.dtype not in DTYPES or shadow.dtype != shadows[0].dtype or shadow.device != read.device:
                raise ValueError(
                    f"plan: shadow {index} of average {k} is {_described(shadow)}: pass {shadows[0].dtype} "
                    f"(fp32/bf16/fp16, one dtype per average) on {read.device}"
                )
            if shadow.shape != read.shape or not shadow.is_contiguous():
                raise ValueError(
                    f"plan: shadow {index} of average {k} is {_described(shadow)}"
                    f"{'' if shadow.is_contiguous() else ', not contiguous'}: pass a dense flat view of {read.numel()}"
                )


def _check_many(plan: Plan, weights: Sequence[torch.Tensor | None], ok: torch.Tensor) -> None:
    """Refuse weights and flags the launch would read from another device, in O(averages)."""
    device = plan.live_table.device
    if len(weights) != plan.averages:
        raise ValueError(
            f"masked_update_many_: {len(weights)} weights for a plan of {plan.averages} averages: give one per average"
        )
    if not plan.reads:  # (an empty plan launches nothing, wherever its flag is)
        return
    if ok.device != device or ok.dtype != torch.bool or ok.numel() != 1:
        raise ValueError(f"masked_update_many_: ok is {_described(ok)}: pass one bool on {device}")
    for index, weight in enumerate(weights):
        if weight is not None and (weight.device != device or weight.numel() != 1 or not weight.is_floating_point()):
            raise ValueError(f"masked_update_many_: weight {index} is {_described(weight)}: pass one float on {device}")


def _check(
    shadows: Sequence[torch.Tensor], live: torch.Tensor, weights: Sequence[torch.Tensor | None], ok: torch.Tensor
) -> None:
    """Refuse what the kernel would read or write out of bounds, or on another device."""
    device, numel = live.device, live.numel()
    if len(weights) != len(shadows):
        raise ValueError(f"masked_update_: {len(shadows)} shadows but {len(weights)} weights: give one per shadow")
    if live.dtype not in DTYPES or live.dim() != 1 or not live.is_contiguous():
        raise ValueError(f"masked_update_: live is {_described(live)}: pass a flat contiguous fp32/bf16/fp16 piece")
    if ok.device != device or ok.dtype != torch.bool or ok.numel() != 1:
        raise ValueError(f"masked_update_: ok is {_described(ok)}: pass one bool on {device}")
    for index, (shadow, weight) in enumerate(zip(shadows, weights)):
        if shadow.dtype not in DTYPES or shadow.device != device or shadow.shape != live.shape:
            raise ValueError(
                f"masked_update_: shadow {index} is {_described(shadow)}: pass fp32/bf16/fp16 of {numel} on {device}"
            )
        if not shadow.is_contiguous():
            raise ValueError(f"masked_update_: shadow {index} is not contiguous: pass a dense flat view")
        if weight is not None and (weight.device != device or weight.numel() != 1 or not weight.is_floating_point()):
            raise ValueError(f"masked_update_: weight {index} is {_described(weight)}: pass one float on {device}")


def _described(tensor: torch.Tensor) -> str:
    return f"{tensor.dtype} of shape {tuple(tensor.shape)} on {tensor.device}"


@functools.cache
def _module() -> Any:
    """The kernels' module, imported (Triton with it) now, or again after ``reset``:
    ``triton.jit`` read ``TRITON_INTERPRET`` when it decorated."""
    imported = f"{__package__}.masked_lerp" in sys.modules
    from . import masked_lerp

    return importlib.reload(masked_lerp) if imported else masked_lerp
