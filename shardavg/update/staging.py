"""Staging: local shards copied to where their shadows are (offloaded shadows) or cast to the shadow
dtype (custom rules), in bounded buckets through two reusable buffers.

From CUDA to the host the buffers are pinned and the copies run on a side stream that first
waits for the compute stream (the optimizer step that wrote the local shards); an event per
bucket tells the host when it has landed, so the host averages bucket k while bucket k + 1 is
still in flight. No scratch of the model's size is ever allocated, on the accelerator or on the
host: a bucket holds at most ``STAGING_BYTES``, or one whole shard where a rule needs whole
shards. The host finishes every bucket before ``update()`` returns, so nothing can read a
shadow before its update has landed. Elsewhere (CPU to CPU) the same buckets are filled with
plain copies, which is how the tests run this path.

(The CUDA side ran on one H200, bitwise the direct update: ``tests_gpu/``.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import torch

STAGING_BYTES = 64 * 2**20  # the most one staging buffer holds (two are kept per dtype and device)


class StagedRange(NamedTuple):
    """Elements ``[start, stop)`` of shard ``position`` (flattened); ``whole`` keeps its shape."""

    position: int
    start: int
    stop: int
    whole: bool


class Stager:
    """Two staging buffers per (device, dtype), kept between updates, and the side stream."""

    def __init__(self) -> None:
        self._buffers: dict[tuple, list[torch.Tensor]] = {}
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def stage(
        self,
        shadow_sets: Sequence[Sequence[torch.Tensor]],
        live_tensors: Sequence[torch.Tensor],
        dtype: torch.dtype,
        split: bool,
    ) -> Iterator[tuple[list[list[torch.Tensor]], list[torch.Tensor]]]:
        """Yield ``(shadows per average, staged live_tensors)`` bucket by bucket, the staged live_tensors on the
        shadows' device in ``dtype``. With ``split`` a shard larger than a bucket is cut into flat
        pieces (the shadows the same way); without, each shard stays whole."""
        device = shadow_sets[0][0].device
        capacity = max(1, STAGING_BYTES // dtype.itemsize)
        buckets = _plan(live_tensors, shadow_sets, capacity, split)
        if not buckets:
            return
        stream = self._side_stream(live_tensors[0].device, device)
        size = max(capacity, max(sum(s.stop - s.start for s in bucket) for bucket in buckets))
        buffers = self._take(device, dtype, size, pinned=stream is not None)
        issued = [self._issue(buckets[0], live_tensors, buffers[0], stream)]
        for number, bucket in enumerate(buckets):
            if number + 1 < len(buckets):  # the other buffer is free: its bucket was averaged
                issued.append(self._issue(buckets[number + 1], live_tensors, buffers[(number + 1) % 2], stream))
            staged, event = issued[number]
            if event is not None:
                event.synchronize()
            yield [[_staged_view(shadows[s.position], s) for s in bucket] for shadows in shadow_sets], staged

    def _side_stream(self, source: torch.device, target: torch.device) -> torch.cuda.Stream | None:
        """The copy stream for CUDA to host, ordered after the compute stream's work so far."""
        if source.type != "cuda" or target.type != "cpu":
            return None
        if source not in self._streams:
            self._streams[source] = torch.cuda.Stream(device=source)
        stream = self._streams[source]
        stream.wait_stream(torch.cuda.current_stream(source))
        return stream

    def _take(self, device: torch.device, dtype: torch.dtype, size: int, pinned: bool) -> list[torch.Tensor]:
        key = (device, dtype, pinned)
        buffers = self._buffers.get(key)
        if buffers is None or buffers[0].numel() < size:
            buffers = [torch.empty(size, dtype=dtype, device=device, pin_memory=pinned) for _ in range(2)]
            self._buffers[key] = buffers
        return buffers

    def _issue(
        self, bucket: list[StagedRange], live_tensors: Sequence[torch.Tensor], buffer: torch.Tensor, stream
    ) -> tuple[list[torch.Tensor], torch.Event | None]:
        """Start copying ``bucket`` into ``buffer``; return the staged views and the event to wait on."""
        staged, offset = [], 0
        context = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        with context:
            for staged_range in bucket:
                length = staged_range.stop - staged_range.start
                view = buffer[offset : offset + length]
                offset += length
                source = _staged_view(live_tensors[staged_range.position], staged_range)
                view = view.view(source.shape)
                view.copy_(source, non_blocking=stream is not None)
                staged.append(view)
            event = None
            if stream is not None:
                event = torch.cuda.Event()
                event.record(stream)
        return staged, event

    def buffer_bytes(self) -> int:
        """Bytes held by the staging buffers (bounded by two buckets per dtype and device)."""
        return sum(buffer.nbytes for buffers in self._buffers.values() for buffer in buffers)


def _staged_view(tensor: torch.Tensor, staged: StagedRange) -> torch.Tensor:
    return tensor if staged.whole else tensor.reshape(-1)[staged.start : staged.stop]


def _plan(
    live_tensors: Sequence[torch.Tensor], shadow_sets: Sequence[Sequence[torch.Tensor]], capacity: int, split: bool
) -> list[list[StagedRange]]:
    """Cut the shards into buckets of at most ``capacity`` elements (a whole shard may exceed it
    when it cannot be split: it then fills a bucket alone)."""
    buckets: list[list[StagedRange]] = [[]]
    room = capacity
    for position, live in enumerate(live_tensors):
        numel = live.numel()
        if numel == 0:
            continue
        dense = live.is_contiguous() and all(shadows[position].is_contiguous() for shadows in shadow_sets)
        if not (split and dense) or numel <= room:
            if numel > room and buckets[-1]:
                buckets.append([])
                room = capacity
            buckets[-1].append(StagedRange(position, 0, numel, whole=True))
            room = max(0, room - numel)
            continue
        start = 0
        while start < numel:
            if room == 0:
                buckets.append([])
                room = capacity
            stop = min(numel, start + room)
            buckets[-1].append(StagedRange(position, start, stop, whole=False))
            room -= stop - start
            start = stop
    return [bucket for bucket in buckets if bucket]
