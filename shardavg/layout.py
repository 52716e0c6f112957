"""Which rank holds which part of every tensor, and gathering full tensors from those parts.

``ShardLayout.build`` runs one collective when the averager is built: every rank reports the
``Part`` of each tensor it holds (``parts.py``: boxes of the global tensor, a flat range being
the one-dimensional case). Identical parts on several ranks are replicas (DDP, HSDP, tensor
parallel's replicated dims, every buffer); the lowest such rank *owns* the part. The owned
parts of a tensor must tile it exactly, which is checked here, so a mistake in an adapter
becomes a clear error instead of a wrong export.

``iter_gathered`` then rebuilds full tensors from the owners' pieces with point-to-point
sends, a bounded bucket of tensors at a time: the receiving rank holds at most one bucket
(or one tensor, if larger) beyond what it already had. A piece that is one range of the
flattened tensor is received in place; any other (columns, strided runs) is received into a
buffer of its own and its boxes copied into place, so such pieces can double what a bucket
holds while they are in flight. This one mechanism serves every engine and layout, for averaged and live values alike.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .dist import distributed, rank
from .errors import LayoutError
from .parts import Part, place, tiles
from .strategies.base import TensorInfo

Chunk = tuple[int, Part]  # (owner rank, the part of the tensor it owns)

DEFAULT_BUCKET_BYTES = 64 * 2**20


def tiling(info: TensorInfo, parts: Sequence[Part]) -> tuple[Chunk, ...]:
    """Owned chunks of one tensor from every rank's part, checked to tile it."""
    owned: dict[Part, int] = {}
    for holder, part in enumerate(parts):
        if part.numel:
            owned.setdefault(part, holder)
    chunks = tuple((owner, part) for part, owner in owned.items())
    if not tiles(info.shape, [box for _, part in chunks for box in part.boxes]):
        raise LayoutError(
            f"the shards of {info.name!r} (shape {tuple(info.shape)}) do not tile it: "
            + ", ".join(f"rank {holder} holds {part.shown()}" for holder, part in enumerate(parts))
        )
    return chunks


@dataclass(frozen=True)
class ShardLayout:
    """Every rank's part of every tensor, and the owned parts that tile each tensor."""

    parts: tuple[tuple[Part, ...], ...]  # [tensor][rank]
    chunks: tuple[tuple[Chunk, ...], ...]  # [tensor] -> (owner, part) for each distinct part held

    @classmethod
    def build(cls, infos: Sequence[TensorInfo]) -> ShardLayout:
        """Collective: agree with every rank on the tensors and their shards."""
        mine = [(info.name, tuple(info.shape), info.part) for info in infos]
        everyone: list[list[tuple[str, tuple[int, ...], Part]]] = [mine]
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
        parts = tuple(tuple(theirs[index][2] for theirs in everyone) for index in range(len(infos)))
        chunks = tuple(tiling(info, parts[index]) for index, info in enumerate(infos))
        return cls(parts=parts, chunks=chunks)

    def holds_whole(self, index: int, holder: int) -> bool:
        """Whether rank ``holder`` has all of tensor ``index`` locally, in its own order."""
        part = self.parts[index][holder]
        return part.span() == (0, int(torch.Size(part.shape).numel()))

    def owns(self, index: int, holder: int) -> bool:
        return any(owner == holder for owner, _ in self.chunks[index])

    def replicas(self, index: int, owner: int) -> list[int]:
        """The other ranks holding the very part ``owner`` owns of tensor ``index``."""
        part = self.parts[index][owner]
        return [r for r, held in enumerate(self.parts[index]) if held == part and r != owner]


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
    """Gather tensor ``index``, flat, on rank ``dst`` (every rank if None); point-to-point sends and
    receives go to ``pending`` as ``(work, buffer, into)``: a part that is not one range of the
    flattened tensor is received whole into ``buffer`` and placed (``into``: the output and the
    part) once its work has completed.

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
    shape = layout.parts[index][0].shape
    numel = int(torch.Size(shape).numel())
    if dst is None:  # each owner broadcasts its chunk to all
        out = torch.empty(numel, dtype=local.dtype, device=device)
        for owner, part in layout.chunks[index]:
            span = part.span()
            if span is not None:
                if owner == me:
                    out[span[0] : span[1]].copy_(local)
                dist.broadcast(out[span[0] : span[1]], src=owner)
            else:
                buffer = local.to(device) if owner == me else torch.empty(part.numel, dtype=local.dtype, device=device)
                dist.broadcast(buffer, src=owner)
                place(out.view(shape), part, buffer)
        return out
    out = torch.empty(numel, dtype=local.dtype, device=device) if me == dst else None
    for owner, part in layout.chunks[index]:
        span = part.span()
        if owner == me == dst:
            place(out.view(shape), part, local)  # type: ignore[union-attr]
        elif owner == me:
            buffer = local.to(device)
            pending.append((dist.isend(buffer, dst=dst), buffer, None))
        elif me == dst and span is not None:  # straight into its place
            pending.append((dist.irecv(out[span[0] : span[1]], src=owner), out, None))  # type: ignore[index]
        elif me == dst:
            buffer = torch.empty(part.numel, dtype=local.dtype, device=device)
            pending.append((dist.irecv(buffer, src=owner), buffer, (out, part)))
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

    ``piece(i)`` is this rank's part of tensor ``i`` (flat, contiguous, ``part.numel`` elements); every
    rank passes the same ``indices``. With ``dst`` set only that rank receives tensors (the
    others get ``None``); with ``dst=None`` every rank does. Tensors come back in their
    global shape, on the device of the pieces, never aliasing them.
    """
    for bucket in _buckets(indices, lambda i: infos[i].numel * infos[i].dtype.itemsize, bucket_bytes):
        pending: list = []
        pieces = {index: piece(index) for index in bucket}
        outputs = {index: _gather_one(layout, index, pieces[index], dst, pending) for index in bucket}
        while pending:  # (no loop variable may keep the last buffer alive)
            work, buffer, into = pending.pop()
            work.wait()
            if into is not None:  # a part that is no range of the flattened tensor: its boxes, one by one
                place(into[0].view(into[1].shape), into[1], buffer)
            del work, buffer, into
        for index in bucket:
            out = outputs.pop(index)  # released here, so at most one bucket is held at a time
            yield index, None if out is None else out.to(pieces[index].device).view(infos[index].shape)
        del out
