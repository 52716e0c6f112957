"""The masked lerp as one Triton kernel: the update skipped on the device, by a flag the host never reads.

Why a kernel: on CUDA the non-finite check's verdict is a device flag, and the update must be
skipped on it without the host waiting for it. ATen offers no lerp that a device flag can skip:
the way through ATen is ``lerp_(where(ok, live, shadow), w)``, a ``where`` scratch the size of
each shard written and read again, measured 2-4x slower than the lerp alone on an H200
(docs/benchmarks.md, "On a GPU"). Here one launch reads each live element once, and reads and
writes each shadow of it once (up to ``MAX_SHADOWS`` averages per launch), with the flag in every
mask: where it is false no shadow byte is written and no live byte is read, so a local shard
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

A kernel that cannot run never takes a training run down. On CUDA it is compiled by the user's
Triton and ``ptxas`` for the user's GPU, which no test here can do for them (an old ``ptxas``, a
driver or Triton version skew, an architecture it cannot target): so at its first use on a
device, and only then, ``usable`` compiles and launches it on a small plan of every dtype
pairing it runs (fp32, bf16 and fp16 live pieces each into one fp32 average, and into four at
once: fp32, bf16 and fp16 lerps and a copy, the flag false then true: six compiles, which Triton
caches on disk) and compares its bits with ATen's lerp of the same pieces (``self_check``, one
host read, when the averager groups its tensors). If the compile, a launch or a bit differs, one
``RuntimeWarning`` names the device, the Triton version and the error, and ``usable`` answers
False for that device from then on: the update's groups are built for ATen. A specialization
compiled later (another count of averages) can still fail: ``masked_update_many_`` then warns
the same way, marks the device, and raises ``KernelFailed`` saying which averages its earlier
launches wrote; a compile error is raised before its launch, and a launch error by the driver
before the grid runs, so the others hold what they held, and ``fused.apply_masked`` finishes
them through ATen. ``SHARDAVG_KERNEL=0`` in the environment turns the kernel off by hand (no
Triton import, no self-check: the ATen path on every device), for a user who must bisect; so do
``false``, ``off`` and ``no``, in any case and with spaces around (``switched_off``). A value
it does not know is warned about once and leaves the kernel on: a setting read as a wish to
turn it off, and silently ignored, would send that user bisecting the wrong path.
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

from ..base import deferred

MAX_SHADOWS = 4  # averages updated by one launch (one read of the live piece); more take another launch
PROGRAM_NUMEL = 1024  # elements per program
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
EXACT_INTERPRETER = (3, 9)  # the first Triton whose interpreter computes an fp32 fma with one rounding
SWITCH = "SHARDAVG_KERNEL"  # one of OFF in the environment: no kernel on any device, the ATen path everywhere
OFF = ("0", "false", "off", "no")  # SWITCH's values that turn the kernel off (in any case, spaces around)
ON = ("1", "true", "on", "yes")  # its values that leave it on, as unset (or empty) does
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}

# Per device (``cuda:0``, ``cpu``), whether the kernel passed its self-check; False once it failed
# there (the check, or a later launch): set by ``usable`` and ``_disabled`` alone, forgotten by ``reset``.
_working: dict[str, bool] = {}


class KernelFailed(Exception):
    """A launch of the kernel failed on ``device`` (warned once, ``usable`` False there from now on):
    the plan's averages before ``done`` were written by earlier launches, the others not at all."""

    def __init__(self, device: torch.device, done: int) -> None:
        super().__init__(f"the Triton kernel failed on {device}: averages {done} and later were not written")
        self.device, self.done = device, done


def usable(device: torch.device) -> bool:
    """Whether the update runs ``masked_update_many_`` on ``device``: not turned off by hand
    (``SHARDAVG_KERNEL=0``: ``switched_off``), Triton importable and a CUDA device (not under
    ``TRITON_INTERPRET=1``, where every launch would copy through the host), or the CPU under
    ``TRITON_INTERPRET=1`` (how the tests run it) with an interpreter whose ``fma`` rounds once
    (Triton 3.9 and later; before, it multiplied then added, which loses the bits of ATen's lerp);
    and the kernel passed its self-check there (``self_check``, run at the first call for each
    device, warning once if it fails) and no launch failed there since. Never raises; cached per
    device (``reset``)."""
    device = torch.device(device)
    if switched_off() or not _available(device.type):
        return False
    key = _key(device)
    if key not in _working:
        _working[key] = self_check(device)
    return _working[key]


def switched_off() -> bool:
    """Whether ``SHARDAVG_KERNEL`` in the environment turns the kernel off by hand (one of ``OFF``);
    read at each call, so a test or a user may change it between averagers."""
    value = os.environ.get(SWITCH)
    return value is not None and _means_off(value)


@functools.cache
def _means_off(value: str) -> bool:
    """Whether ``SHARDAVG_KERNEL=value`` turns the kernel off; a value in neither ``OFF`` nor ``ON``
    is warned about once (cached per value, until ``reset``) and leaves it on, the default."""
    spelled = value.strip().lower()
    if spelled and spelled not in OFF + ON:
        deferred.warn(
            RuntimeWarning(
                f"shardavg: {SWITCH}={value!r} in the environment is not understood, so the Triton kernel of the "
                f"update stays on where it can run: set {SWITCH} to {'/'.join(OFF)} (in any case) to turn it off, "
                f"to {'/'.join(ON)} or unset it to leave it on"
            ),
            stacklevel=4,
        )
    return spelled in OFF


def _key(device: torch.device) -> str:
    """``device`` with its index (``cuda`` is the current CUDA device), the self-check's key."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return str(device)


@functools.cache
def _available(device_type: str) -> bool:
    """Whether Triton can launch the kernel on ``device_type`` at all (before any self-check)."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if device_type != ("cpu" if interpreted else "cuda") or (device_type == "cuda" and not torch.cuda.is_available()):
        return False  # (before importing Triton, which a CPU run never needs)
    try:
        import triton
    except Exception:  # (a broken install is as good as none)
        return False
    return not interpreted or _version(triton.__version__) >= EXACT_INTERPRETER


def self_check(device: torch.device) -> bool:
    """Compile and launch ``masked_update_many_`` on ``device`` over a small plan for every dtype
    pairing it runs, and compare the bits with ATen's lerp of the same pieces; True when they are
    the same, else warn once (``_disabled``) and False. One host read, once per device (``usable``)."""
    try:
        differing = _differences(torch.device(device))
    except Exception as error:  # (a compile, a launch, or the Triton import itself)
        return _disabled(device, error)
    if differing:
        return _disabled(device, AssertionError(f"its bits differ from ATen's lerp for {', '.join(differing)}"))
    return True


def _differences(device: torch.device) -> list[str]:
    """The pairings whose bits the kernel got wrong on ``device``: each live dtype into one fp32
    average, and into four at once (fp32, bf16 and fp16 lerps on either side of the weight 0.5,
    where the lerp changes form, and a copy; launched with the flag false first, which must change
    nothing), over a piece masked at its end and one whose program goes unmasked, in vectors. Two
    programs a launch: the interpreter takes ~20 ms a program, the tests check it often."""
    generator = torch.Generator().manual_seed(0)

    def pieces(dtype: torch.dtype) -> list[torch.Tensor]:
        return [(torch.randn(n, generator=generator) * 3).to(device, dtype) for n in (5, PROGRAM_NUMEL)]

    four = (torch.float32, torch.bfloat16, torch.float16, torch.float32)
    setups = [((torch.float32,), (0.75,)), (four, (0.25, 0.75, 0.25, None))]  # (shadow dtypes, weights)
    flags = [torch.full((1,), value, dtype=torch.bool, device=device) for value in (False, True)]
    compared: list[tuple[str, torch.Tensor, torch.Tensor]] = []  # (what, got, wanted)
    for live_dtype in DTYPES:
        reads = pieces(live_dtype)
        for shadow_dtypes, given in setups:
            shadow_sets = [pieces(dtype) for dtype in shadow_dtypes]
            before = [[shadow.clone() for shadow in shadows] for shadows in shadow_sets]
            planned = plan(reads, shadow_sets)
            weights = [None if w is None else torch.full((1,), w, device=device) for w in given]
            if len(given) > 1:  # (the flag is read at run time: one compiled kernel takes both)
                _launch(planned, weights, flags[0], 0)
                compared += [
                    (f"{live_dtype} live, the flag false", shadow.clone(), old)
                    for shadows, olds in zip(shadow_sets, before)
                    for shadow, old in zip(shadows, olds)
                ]
            _launch(planned, weights, flags[1], 0)
            for shadows, olds, w in zip(shadow_sets, before, given):
                what = f"{live_dtype} live into {olds[0].dtype} shadows ({len(given)} averages)"
                for shadow, old, read in zip(shadows, olds, reads):
                    wanted = read.to(old.dtype) if w is None else torch.lerp(old, read.to(old.dtype), w)  # (the host's)
                    compared.append((what, shadow, wanted))
    counts = torch.stack([(got.view(BITS[got.dtype]) != want.view(BITS[got.dtype])).sum() for _, got, want in compared])
    return list(dict.fromkeys(what for (what, _, _), count in zip(compared, counts.tolist()) if count))


def _disabled(device: torch.device, error: BaseException) -> bool:
    """Mark the kernel unusable on ``device``; warn the first time, naming the device, the Triton
    version and ``error``. Returns False (what ``usable`` answers from now on)."""
    key = _key(torch.device(device))
    if _working.get(key) is not False:
        try:
            import triton

            version = triton.__version__
        except Exception as import_error:  # (the reason the kernel failed, maybe)
            version = f"not importable ({import_error})"
        deferred.warn(
            RuntimeWarning(
                f"shardavg: the Triton kernel of the update failed on {key} (Triton {version}): "
                f"{type(error).__name__}: {error}. The update runs through ATen there from now on (its bits, a "
                f"slower update); nothing was lost. Set {SWITCH}=0 in the environment to turn the kernel off by hand "
                "(and skip this check); please report this error with the GPU and the Triton version."
            ),
            stacklevel=3,
        )
    _working[key] = False
    return False


def _version(text: str) -> tuple[int, ...]:
    """``3.9.0+git1a2b`` as (3, 9): the release's major and minor."""
    return tuple(int("".join(c for c in field if c.isdigit()) or 0) for field in text.split(".")[:2])


def reset() -> None:
    """Forget the built kernel, the ``usable`` answers, the self-checks and which ``SHARDAVG_KERNEL``
    values were warned about (tests that set ``TRITON_INTERPRET``, or stand in for the kernel)."""
    _module.cache_clear()
    _available.cache_clear()
    _means_off.cache_clear()
    _working.clear()


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
    if reads and not _available(device.type):  # (interpreted, a CUDA address would be read on the host)
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
        KernelFailed: The kernel did not compile or launch on the plan's device (warned, and
            ``usable`` False there from now on), or had already failed there: the averages before
            ``done`` were written, the others not at all.
    """
    _check_many(plan, weights, ok)
    if not plan.programs or not plan.averages:
        return
    device = plan.live_table.device
    for start in range(0, plan.averages, MAX_SHADOWS):
        if _working.get(_key(device)) is False:  # (failed before: by another plan, or this one's last launch)
            raise KernelFailed(device, start)
        try:
            _launch(plan, weights, ok, start)
        except Exception as error:  # (a compile error raises before the launch, a launch error before the grid runs)
            _disabled(device, error)
            raise KernelFailed(device, start) from error


def _launch(plan: Plan, weights: Sequence[torch.Tensor | None], ok: torch.Tensor, start: int) -> None:
    """One launch of the kernel: averages ``start`` to ``start + MAX_SHADOWS`` of ``plan``."""
    module = _module()
    launched = range(start, min(start + MAX_SHADOWS, plan.averages))
    slots: list[Any] = []
    dtypes: list[Any] = []
    for slot in range(MAX_SHADOWS):  # (unused slots are never touched: COUNT says how many are real)
        k = start + slot
        slots += [plan.shadow_tables[k], weights[k]] if k in launched else [None, None]
        dtypes.append(module.TL_DTYPES[plan.shadow_sets[k][0].dtype] if k in launched else None)
    copy = sum(1 << slot for slot, k in enumerate(launched) if weights[k] is None)
    options = {"ALIGN": plan.align, "COUNT": len(launched), "COPY": copy, "PROGRAM_NUMEL": PROGRAM_NUMEL}
    module.masked_lerp_many[(plan.programs,)](
        plan.live_table, plan.piece_of_program, plan.index_in_piece, plan.numels, ok, *slots,
        module.TL_DTYPES[plan.reads[0].dtype], *dtypes, **options, num_warps=4, enable_fp_fusion=False,
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
