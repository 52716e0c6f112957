"""Replicated weights: a single process, DDP, or DeepSpeed ZeRO stages 0-2.

Every rank holds every tensor whole, so the local shard is the tensor itself; rank 0 owns
the export.

That is an assumption about the model, and a wrong one is silent: a module whose parameters
are slices (Megatron's ``ColumnParallelLinear``, hand-written tensor parallelism) looks like a
plain module, and its export would write one rank's slice as the whole tensor. So the
replicas are checked, at no cost to ``update()``:

- when the averager is built (a collective already): no tensor carries Megatron's
  ``tensor_model_parallel`` mark, and every rank holds each tensor in the same shape
  (``refuse_non_replicas``). Values are not compared there: they may differ legitimately until
  DDP broadcasts rank 0's weights, or until the first update copies them;
- where a collective export, ``full_state_dict``, ``copy_to`` or ``save`` begins: every rank
  holds the same values of each parameter that it writes (``refuse_unlike_values``), compared by
  a digest computed where the values lie (``value_digests``).

Each is one all-reduce of a small vector of integers, the same size on every rank whatever the
world size (the maximum of each value and of its negation: equal extremes mean every rank
agrees); only when ranks disagree are the few disagreeing tensors' digests gathered, to name
the ranks. Every rank raises the same error.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..base.dist import all_gathered, comm_device, digest, distributed, rank, world_size
from ..base.errors import StrategyError
from .base import ModuleStrategy, Strategy, TensorInfo, grouped_by_identity, persistent_buffers, tensor_info
from .fsdp1 import FSDP1
from .fsdp2 import FSDP2
from .zero3 import Zero3
from .zero12 import Zero12Master

TENSOR_PARALLEL_MARK = "tensor_model_parallel"  # what Megatron-Core's parallel layers set on their slices
MASK = 2**62 - 1  # digests below 2**62: their negations fit an int64 too
ABSENT = -1  # what a rank that holds no copy of a tensor reports (below every digest)
NAMED = 3  # tensors named in a refusal; the rest are counted
ADVICE = (
    "the 'replicated' strategy takes every rank's tensors for copies of one model; hand-written tensor "
    "parallelism? Hold the slices as DTensors (torch's parallelize_module), which shardavg places exactly"
)


class Replicated(ModuleStrategy):
    """Every tensor whole on every rank; the local shard is the tensor itself.

    Args:
        model: A plain module, a DDP module or a DeepSpeed ZeRO-0/1/2 engine.
    """

    name = "replicated"
    copies_everywhere = True

    @staticmethod
    def fits(model: nn.Module) -> bool:
        """Whether no sharded strategy (ZeRO-3, FSDP1, FSDP2) fits ``model``.

        Args:
            model: The model as the user passed it.

        Returns:
            Whether its tensors are held whole.
        """
        return not any(sharded.fits(model) for sharded in (Zero3, FSDP1, FSDP2))

    def _scan_params(self) -> list[TensorInfo]:
        groups = grouped_by_identity(self.module.named_parameters(remove_duplicate=False))
        self._params = [tensor for _, tensor in groups]
        return [tensor_info(names, tensor, "param") for names, tensor in groups]

    def _param_views(self) -> list[torch.Tensor]:
        return self._params


def refuse_non_replicas(strategies: Sequence[Strategy], compare_shapes: bool) -> None:
    """Collective when the averager is built: refuse a model that replicated strategies would take
    for copies of one model but whose tensors are slices.

    For the replicated and ZeRO-1/2 strategies among ``strategies`` (the others place their shards
    themselves): no tensor carries Megatron's ``tensor_model_parallel`` mark (a slice the strategy
    cannot place; its own ``partition_dim`` and ``partition_stride`` say how it was cut); and, with
    ``compare_shapes`` (one replicated model over the world, as its layout says), every rank holds
    each tensor in the same shape. One all-reduce of 17 integers; a refusal is raised on every rank,
    the same message. Values are not compared: they may differ until DDP broadcasts rank 0's.

    Args:
        strategies: The strategies built for this rank's model (its pipeline stages: several).
        compare_shapes: Compare the shapes across the world (not for pipeline stages, which
            compare their own ranks' tensors when they are scanned).

    Raises:
        StrategyError: A tensor is Megatron's slice, or the ranks hold a tensor in different shapes.
    """
    checked = [strategy for strategy in strategies if isinstance(strategy, (Replicated, Zero12Master))]
    if not checked or not distributed() or world_size() == 1:
        return
    error: BaseException | None = None
    infos: list[TensorInfo] = []
    try:
        _refuse_megatron_slices(checked)
        if compare_shapes:
            infos = [info for strategy in checked for info in strategy.tensors()]
    except Exception as caught:  # raised on every rank below, not here alone
        error = caught
    names = digest([info.names for info in infos])
    shapes = digest([(info.names, tuple(info.shape)) for info in infos])
    failed, highest, lowest = _extremes(error is not None, torch.tensor([*names, *shapes], dtype=torch.int64))
    if failed is not None:
        _raise_alike(failed, error, "building the averager")
    if highest[:4] != lowest[:4]:
        return  # the ranks track different tensors: the layout names them (``ShardLayout.build``)
    if highest[4:] != lowest[4:]:
        _raise_unlike_shapes(infos)


def _refuse_megatron_slices(strategies: Sequence[ModuleStrategy]) -> None:
    """Raise naming the first tensor Megatron marks as a tensor-parallel slice (and how many more)."""
    marked: list[tuple[str, torch.Tensor]] = []
    for strategy in strategies:
        named = [(names[0], tensor) for names, tensor in grouped_by_identity(strategy.module.named_parameters())]
        named += [(names[0], buffer) for names, _, _, buffer in persistent_buffers(strategy.module)]
        marked += [(name, tensor) for name, tensor in named if getattr(tensor, TENSOR_PARALLEL_MARK, False) is True]
    if marked:
        name, tensor = marked[0]
        more = f", and {len(marked) - 1} more" if len(marked) > 1 else ""
        raise StrategyError(
            f"{name!r} is a tensor-parallel slice on rank {rank()} (Megatron's {TENSOR_PARALLEL_MARK} attribute, "
            f"partition_dim={getattr(tensor, 'partition_dim', None)}, "
            f"partition_stride={getattr(tensor, 'partition_stride', None)}{more}), not a replica: the "
            f"{strategies[0].name!r} strategy would export one rank's slice as the whole tensor; a Megatron-Core "
            "model is averaged by strategy='auto' (the 'megatron' strategy places its slices from its "
            "sharded_state_dict()); a module marked by hand: hold its slices as DTensors"
        )


def _raise_unlike_shapes(infos: Sequence[TensorInfo]) -> None:
    """Collective (the ranks saw their shapes differ): name the tensors and two ranks that differ."""
    shapes = [tuple(info.shape) for info in infos]
    _, highest, lowest = _extremes(False, torch.tensor([digest(shape)[0] for shape in shapes], dtype=torch.int64))
    unlike = [index for index, (high, low) in enumerate(zip(highest, lowest)) if high != low]
    everyone = all_gathered([shapes[index] for index in unlike[:NAMED]])  # (only on this error path)
    index, theirs = unlike[0], [shown[0] for shown in everyone]
    other = next(holder for holder, shape in enumerate(theirs) if shape != theirs[0])
    raise StrategyError(
        f"not replicas: {infos[index].name!r} is {theirs[0]} on rank 0 but {theirs[other]} on rank {other}"
        f"{_also([repr(infos[i].name) for i in unlike[1:]])}: {ADVICE}"
    )


def value_digests(tensors: Sequence[torch.Tensor | None], bucket_bytes: int) -> list[torch.Tensor | None]:
    """Each tensor's digest: equal values give equal digests, different ones (almost surely) not.

    The bytes read as integers (so ``-0.0`` and ``0.0``, or two NaNs, are told apart as the files
    would), each weighted by its position, summed in int64 where the tensor lies: integer sums do
    not depend on the order of the reduction, so every rank's device computes the same digest of
    the same bytes, with no copy to the host and no gather. A bounded number of elements is read at
    a time (16 bytes of scratch each: about half of ``bucket_bytes`` in all), so the check holds no
    more than an export's bucket; the digest does not depend on that number.

    Args:
        tensors: Flat, contiguous tensors; None where nothing is compared.
        bucket_bytes: The scratch memory allowed (an export's gather bucket).

    Returns:
        Per tensor a 0-dim int64 tensor on its device in ``[0, 2**62)``; None where it was None.
    """
    step = max(2048, bucket_bytes // 32)  # (16 bytes of scratch per element: its word and its weight)
    digests: list[torch.Tensor | None] = []
    for tensor in tensors:
        if tensor is None:
            digests.append(None)
            continue
        words = _words(tensor)
        total = torch.zeros((), dtype=torch.int64, device=words.device)
        for start in range(0, words.numel(), step):
            piece = words[start : start + step].to(torch.int64)
            piece.mul_(_position_weights(start, piece.numel(), words.device))
            total += piece.sum()  # (wraps: a sum mod 2**64, whatever the order)
        digests.append(total.bitwise_and(MASK))
    return digests


def _words(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as integers of at most 32 bits (weighted, they stay below 2**62)."""
    flat = tensor.detach().reshape(-1)
    if flat.dtype == torch.bool:
        return flat.view(torch.uint8)
    size = flat.element_size()
    if size == 1:
        return flat.view(torch.uint8)
    if size == 2:
        return flat.view(torch.int16)
    return flat.view(torch.int32)


def _position_weights(start: int, length: int, device: torch.device) -> torch.Tensor:
    """Odd weights below 2**31 for the positions ``[start, start + length)``, the same on every
    rank: a product's low bits are defined although the product wraps."""
    weights = torch.arange(start, start + length, dtype=torch.int64, device=device)
    return weights.mul_(0x5851F42D).add_(0x14057B7E).bitwise_and_(2**31 - 1).bitwise_or_(1)  # (in place: one buffer)


def refuse_unlike_values(
    values: Sequence[torch.Tensor | None],
    labels: Sequence[str],
    what: str,
    bucket_bytes: int,
    extra: Sequence[int] = (),
    error: BaseException | None = None,
) -> None:
    """Collective: refuse ``what`` unless every rank holding a copy of a tensor holds the same values.

    One all-reduce of ``2 * len(values) + 2 * len(extra) + 1`` integers. ``extra``: integers the
    ranks may legitimately disagree on for a reason a later check names better (the number of
    updates applied); when they differ, nothing is refused here.

    Args:
        values: This rank's copy of each tensor (flat, contiguous), or None where it holds none.
            The same number on every rank.
        labels: How to name each tensor in the error.
        what: The collective that is refused, for the error.
        bucket_bytes: Scratch memory for the digests (``value_digests``).
        extra: Small integers below 2**62.
        error: What failed on this rank while reading ``values``: raised on every rank instead.

    Raises:
        StrategyError: Two ranks hold different values of a tensor, or a rank failed (on every
            rank, the same message).
    """
    vector = torch.full((len(values),), ABSENT, dtype=torch.int64)
    try:
        if error is not None:
            raise error
        digests = value_digests(values, bucket_bytes)
        held = [index for index, found in enumerate(digests) if found is not None]
        by_device: dict[torch.device, list[int]] = {}
        for index in held:
            by_device.setdefault(digests[index].device, []).append(index)  # type: ignore[union-attr]
        for indices in by_device.values():  # (one copy per device, not one per tensor)
            vector[indices] = torch.stack([digests[index] for index in indices]).cpu()  # type: ignore[misc]
    except Exception as caught:  # raised on every rank below, not here alone
        error = caught
    failed, highest, lowest = _extremes(
        error is not None, torch.cat([torch.tensor(list(extra), dtype=torch.int64), vector])
    )
    if failed is not None:
        _raise_alike(failed, error, what)
    if highest[: len(extra)] != lowest[: len(extra)]:
        return
    highest, lowest = highest[len(extra) :], lowest[len(extra) :]
    unlike = [index for index, (high, low) in enumerate(zip(highest, lowest)) if high != low]
    if not unlike:
        return
    named = unlike[:NAMED]
    everyone = all_gathered([int(vector[index]) for index in named])  # (only on this error path)
    seen = [theirs[0] for theirs in everyone]
    first = next(holder for holder, found in enumerate(seen) if found != ABSENT)
    other = next(holder for holder, found in enumerate(seen) if found not in (ABSENT, seen[first]))
    raise StrategyError(
        f"not replicas: rank {first} and rank {other} hold different values of {labels[unlike[0]]}"
        f"{_also([labels[index] for index in unlike[1:]])}, so {what} would write one rank's as the whole: {ADVICE}, "
        "or keep the replicas equal (DDP broadcasts rank 0's weights); nothing was written"
    )


def _extremes(failed: bool, values: torch.Tensor) -> tuple[int | None, list[int], list[int]]:
    """Collective: the lowest rank that failed (None if none did), and each value's highest and
    lowest across the ranks, in one all-reduce (of the values and their negations, for the maximum).

    ``values``: an int64 vector, the same length on every rank, each in ``[ABSENT, 2**62)``; a
    rank's ``ABSENT`` is left out of the lowest (a rank holding no copy has no say)."""
    me, world = rank(), world_size()
    negated = torch.where(values == ABSENT, torch.full_like(values, -MASK - 1), -values)
    both = torch.cat([torch.tensor([-(me if failed else world)]), values, negated])
    both = both.to(comm_device(torch.device("cpu")))
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    reduced = both.tolist()
    count = values.numel()
    lowest = [-value if value != -MASK - 1 else ABSENT for value in reduced[1 + count :]]
    return (None if reduced[0] == -world else -reduced[0]), reduced[1 : 1 + count], lowest


def _raise_alike(failed: int, error: BaseException | None, what: str) -> None:
    """Collective: raise on every rank the error of rank ``failed`` (the lowest that failed),
    sent from there: one message everywhere, whatever the number of ranks that failed."""
    sent = [None]
    if rank() == failed:
        sent = [str(error) if isinstance(error, StrategyError) else f"{what} failed on rank {failed}: {error!r}"]
    dist.broadcast_object_list(sent, src=failed)
    raise StrategyError(sent[0]) from error


def _also(names: Sequence[str]) -> str:
    """The other tensors refused, the first few by name."""
    if not names:
        return ""
    shown = ", ".join(names[: NAMED - 1])
    return f" (and {len(names)} more: {shown}{', ...' if len(names) > NAMED - 1 else ''})"
