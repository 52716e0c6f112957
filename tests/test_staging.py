"""The staging path of offloaded shadows, run on the CPU: bounded buckets through two reused
buffers, each bucket copied ahead of its use, and the same bits as the update without staging."""

from __future__ import annotations

import pytest
import torch

import shardavg.update.fused
import shardavg.update.staging
from shardavg import EMA, SWA, PowerEMA, WeightAverager
from shardavg.update.staging import Stager, _plan

RULES = {"ema": EMA(decay=0.9), "swa": SWA(), "power": PowerEMA(gamma=4.0)}


def test_the_plan_tiles_every_shard_in_bounded_buckets() -> None:
    lives = [torch.zeros(10), torch.zeros(3), torch.zeros(4, 6).t(), torch.zeros(25), torch.zeros(0)]
    shadows = [[torch.zeros(t.shape) for t in lives]]
    buckets = _plan(lives, shadows, capacity=8, split=True)
    covered: dict[int, list[tuple[int, int]]] = {}
    for bucket in buckets:
        size = sum(s.stop - s.start for s in bucket)
        assert size <= 8 or (len(bucket) == 1 and bucket[0].whole), bucket
        for segment in bucket:
            covered.setdefault(segment.position, []).append((segment.start, segment.stop))
    assert covered[2] == [(0, 24)]  # strided: whole, alone in its bucket
    for position in (0, 1, 3):
        spans = sorted(covered[position])
        assert spans[0][0] == 0 and spans[-1][1] == lives[position].numel()
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    assert 4 not in covered  # nothing to stage in an empty shard
    assert all(s.whole for b in _plan(lives, shadows, capacity=8, split=False) for s in b)


def test_each_bucket_is_copied_ahead_into_the_other_buffer(monkeypatch) -> None:
    events: list[tuple[str, int, int]] = []
    real_issue = Stager._issue

    def issue(self, bucket, lives, buffer, stream):
        events.append(("copy", bucket[0].position, buffer.data_ptr()))
        return real_issue(self, bucket, lives, buffer, stream)

    monkeypatch.setattr(Stager, "_issue", issue)
    monkeypatch.setattr(shardavg.update.staging, "STAGING_BYTES", 4 * 4)  # four fp32 elements per bucket
    lives = [torch.full((4,), float(k)) for k in range(4)]
    shadows = [[torch.zeros(4) for _ in lives]]
    stager = Stager()
    for _, staged in stager.stage(shadows, lives, torch.float32, split=True):
        events.append(("use", int(staged[0][0]), staged[0].data_ptr()))
        assert torch.equal(staged[0], lives[int(staged[0][0])])
    order = [(kind, position) for kind, position, _ in events]
    assert order == [("copy", 0), ("copy", 1), ("use", 0), ("copy", 2), ("use", 1), ("copy", 3), ("use", 2), ("use", 3)]
    buffers = [pointer for kind, _, pointer in events if kind == "copy"]
    assert buffers[0] == buffers[2] != buffers[1] == buffers[3]  # two buffers, taking turns
    assert stager.buffer_bytes() == 2 * 4 * 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("on_device", [False, True])
def test_a_staged_update_has_the_bits_of_the_unstaged_one(model, trainer, monkeypatch, on_device, dtype) -> None:
    """Every local shard staged (as for shadows on the host) in buckets of 40 bytes, smaller than
    most shards: each average is bitwise the one updated in place, and the buffers stay bounded
    (bf16 weights too: staged in bf16, cast piece by piece on the host as beside the shards)."""
    model.to(dtype)
    direct = WeightAverager(model, RULES, buffers="average")
    staged = WeightAverager(model, RULES, buffers="average")
    staged.updater.on_device = on_device
    staged_buckets = []
    real_stage = Stager.stage

    def counted_stage(self, *args, **kwargs):
        for bucket in real_stage(self, *args, **kwargs):
            staged_buckets.append(len(bucket[1]))
            yield bucket

    monkeypatch.setattr(shardavg.update.staging, "STAGING_BYTES", 40)
    monkeypatch.setattr(Stager, "stage", counted_stage)
    for _ in range(6):
        trainer.step()
        direct.update()
        with monkeypatch.context() as forced:  # as if every local shard were on another device
            forced.setattr(shardavg.update.fused, "needs_staging", lambda group, dtype: True)
            staged.update()
    assert len(staged_buckets) > 6 * 10, "few buckets were staged: the check is vacuous"
    assert 0 < staged.updater.stager.buffer_bytes() <= 2 * 40 * 2  # two buckets each of fp32 and int64 (a counter)
    for name in RULES:
        got, want = staged.full_state_dict(name), direct.full_state_dict(name)
        for key in want:
            assert torch.equal(got[key], want[key]), f"{name}: {key}"
