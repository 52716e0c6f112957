"""Which rank holds which part of every tensor, and gathering full tensors from those parts.

``ShardLayout.build`` runs one collective when the averager is built: every rank reports the
range ``[start, end)`` of each flattened tensor it holds. Identical ranges on several ranks
are replicas (DDP, HSDP, every buffer); the lowest such rank *owns* the range.
The owned ranges of a tensor must tile it exactly, which is checked here, so a mistake in an
adapter becomes a clear error instead of a wrong export.

``iter_gathered`` then rebuilds full tensors from the owners' pieces with point-to-point
sends, a bounded bucket of tensors at a time: the receiving rank holds at most one bucket
(or one tensor, if larger) beyond what it already had. This one mechanism serves every
engine, for averaged and live values alike.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .errors import CheckpointError, LayoutError
from .strategies.base import TensorInfo

Chunk = tuple[int, int, int]  # (owner rank, start, end) in the flattened global tensor

DEFAULT_BUCKET_BYTES = 64 * 2**20


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if distributed() else 1


def all_gathered(value: object) -> list:
    """Collective: every rank's ``value`` (small, plain data), in rank order."""
    values = [value]
    if distributed():
        values = [None] * dist.get_world_size()
        dist.all_gather_object(values, value)
    return values


def gather_or_raise(error: BaseException | None, value: object, what: str) -> list:
    """Collective: every rank's ``value``, or raise everywhere if any rank failed, naming the
    ranks and their errors."""
    reports = all_gathered((None if error is None else f"{type(error).__name__}: {error}", value))
    failed = "; ".join(f"rank {r}: {e}" for r, (e, _) in enumerate(reports) if e is not None)
    if failed:
        raise CheckpointError(f"{what} failed: {failed}") from error
    return [value for _, value in reports]


def agree_or_raise(error: BaseException | None, what: str) -> None:
    """Collective: raise everywhere if any rank failed, naming the ranks and their errors."""
    gather_or_raise(error, None, what)


def tiles(numel: int, spans: Sequence[tuple[int, int]]) -> bool:
    """Whether the non-empty ``[start, end)`` spans cover ``[0, numel)`` exactly, each once.

    The one tiling check: the layout applies it to the ranks' shards, and every checkpoint
    reader to the chunk table it is given, so a partial or overlapping table is refused."""
    position = 0
    for start, end in sorted(spans):
        if start != position or end <= start:
            return False
        position = end
    return position == numel


def _tiling(name: str, numel: int, ranges: Sequence[tuple[int, int]]) -> tuple[Chunk, ...]:
    """Owned chunks of one tensor from every rank's range, checked to tile ``[0, numel)``."""
    owned: dict[tuple[int, int], int] = {}
    for holder, (start, end) in enumerate(ranges):
        if end > start:
            owned.setdefault((start, end), holder)
    chunks = sorted(((owner, start, end) for (start, end), owner in owned.items()), key=lambda chunk: chunk[1])
    if not tiles(numel, [(start, end) for _, start, end in chunks]):
        raise LayoutError(
            f"the shards of {name!r} ({numel} elements) do not tile it: "
            + ", ".join(f"rank {holder} holds [{start}, {end})" for holder, (start, end) in enumerate(ranges))
        )
    return tuple(chunks)


@dataclass(frozen=True)
class ShardLayout:
    """Every rank's range of every tensor, and the owned chunks that tile each tensor."""

    ranges: tuple[tuple[tuple[int, int], ...], ...]  # [tensor][rank] -> (start, end)
    chunks: tuple[tuple[Chunk, ...], ...]  # [tensor] -> owned chunks, in order

    @classmethod
    def build(cls, infos: Sequence[TensorInfo]) -> ShardLayout:
        """Collective: agree with every rank on the tensors and their shards."""
        mine = [(info.name, tuple(info.shape), info.start, info.end) for info in infos]
        everyone: list[list[tuple[str, tuple[int, ...], int, int]]] = [mine]
        if distributed():
            everyone = [None] * dist.get_world_size()  # type: ignore[list-item]
            dist.all_gather_object(everyone, mine)
        mine_keys = [entry[:2] for entry in mine]
        for other, theirs in enumerate(everyone):
            their_keys = [entry[:2] for entry in theirs]
            if mine_keys != their_keys:
                only_mine = sorted({k[0] for k in mine_keys} - {k[0] for k in their_keys})
                only_theirs = sorted({k[0] for k in their_keys} - {k[0] for k in mine_keys})
                reshaped = sorted(a[0] for a, b in zip(mine_keys, their_keys) if a[0] == b[0] and a != b)
                raise LayoutError(
                    f"rank {rank()} and rank {other} track different tensors: only on rank {rank()}: {only_mine}; "
                    f"only on rank {other}: {only_theirs}; other shape: {reshaped}"
                )
        ranges = tuple(tuple(theirs[index][2:] for theirs in everyone) for index in range(len(infos)))
        chunks = tuple(_tiling(info.name, info.numel, ranges[index]) for index, info in enumerate(infos))
        return cls(ranges=ranges, chunks=chunks)

    def holds_whole(self, index: int, holder: int) -> bool:
        """Whether rank ``holder`` has all of tensor ``index`` locally."""
        numel = self.chunks[index][-1][2] if self.chunks[index] else 0
        return self.ranges[index][holder] == (0, numel)


def _comm_device(device: torch.device) -> torch.device:
    """Where a tensor must be for the default process group to send it (NCCL: CUDA only)."""
    backend = dist.get_backend()
    if device.type == "cpu" and "nccl" in backend and "cpu:" not in backend and backend != "gloo":
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _buckets(indices: Sequence[int], nbytes: Callable[[int], int], limit: int) -> Iterator[list[int]]:
    bucket: list[int] = []
    size = 0
    for index in indices:
        if bucket and size + nbytes(index) > limit:
            yield bucket
            bucket, size = [], 0
        bucket.append(index)
        size += nbytes(index)
    if bucket:
        yield bucket


def _gather_one(
    layout: ShardLayout, index: int, local: torch.Tensor, dst: int | None, pending: list
) -> torch.Tensor | None:
    """Gather flat tensor ``index`` on rank ``dst`` (every rank if None); point-to-point sends go to ``pending``.

    Every chunk comes from its owner: a rank holding its own copy of a replicated tensor
    (BatchNorm statistics without SyncBatchNorm) receives the owner's value like the others.
    Every rank takes the same branches: they depend on the shared layout only.
    """
    me = rank()
    if not distributed():  # one process holds everything
        return local.clone()
    if dst is not None and layout.holds_whole(index, dst):
        return local.clone() if me == dst else None
    device = _comm_device(local.device)
    numel = sum(end - start for _, start, end in layout.chunks[index])
    if dst is None:  # each owner broadcasts its chunk to all
        out = torch.empty(numel, dtype=local.dtype, device=device)
        for owner, start, end in layout.chunks[index]:
            if owner == me:
                out[start:end].copy_(local)
            dist.broadcast(out[start:end], src=owner)
        return out
    out = torch.empty(numel, dtype=local.dtype, device=device) if me == dst else None
    for owner, start, end in layout.chunks[index]:
        if owner == me == dst:
            out[start:end].copy_(local)  # type: ignore[index]
        elif owner == me:
            buffer = local.to(device)
            pending.append((dist.isend(buffer, dst=dst), buffer))
        elif me == dst:
            pending.append((dist.irecv(out[start:end], src=owner), out))  # type: ignore[index]
    return out


def iter_gathered(
    layout: ShardLayout,
    infos: Sequence[TensorInfo],
    piece: Callable[[int], torch.Tensor],
    indices: Sequence[int],
    *,
    dst: int | None = 0,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> Iterator[tuple[int, torch.Tensor | None]]:
    """Collective: yield ``(index, full tensor)`` for each of ``indices``, in order.

    ``piece(i)`` is this rank's part of tensor ``i`` (1-D, ``end - start`` elements); every
    rank passes the same ``indices``. With ``dst`` set only that rank receives tensors (the
    others get ``None``); with ``dst=None`` every rank does. Tensors come back in their
    global shape, on the device of the pieces, never aliasing them.
    """
    for bucket in _buckets(indices, lambda i: infos[i].numel * infos[i].dtype.itemsize, bucket_bytes):
        pending: list = []
        pieces = {index: piece(index) for index in bucket}
        outputs = {index: _gather_one(layout, index, pieces[index], dst, pending) for index in bucket}
        while pending:  # (no loop variable may keep the last buffer alive)
            pending.pop()[0].wait()
        for index in bucket:
            out = outputs.pop(index)  # released here, so at most one bucket is held at a time
            yield index, None if out is None else out.to(pieces[index].device).view(infos[index].shape)
        del out
