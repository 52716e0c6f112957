"""The fused update: neighbours in memory run as one kernel, with the same bits as one call per tensor."""

from __future__ import annotations

import pytest
import torch

from shardavg.update.fused import FUSED_PIECE, LERP_PIECE, SUMMED_NUMEL, apply, fuse, group_tensors, nonfinite
from shardavg.update.staging import Stager

SHAPES = [(3, 4), (0,), (5,), (2, 2), (7,)]


def carved(flat: torch.Tensor, shapes=SHAPES) -> list[torch.Tensor]:
    """Views of ``flat`` laid back to back, as FSDP1's flat shard or ZeRO-3's flattened partitions are."""
    views, start = [], 0
    for shape in shapes:
        numel = torch.Size(shape).numel()
        views.append(flat[start : start + numel].view(shape))
        start += numel
    return views


def test_back_to_back_tensors_fuse_into_one_view_and_empty_ones_are_left_out() -> None:
    total = sum(torch.Size(s).numel() for s in SHAPES)
    shadows, lives = carved(torch.zeros(total)), carved(torch.randn(total))
    (fused_shadows,), fused_lives = fuse([shadows], lives)
    assert len(fused_lives) == len(fused_shadows) == 1 and fused_lives[0].numel() == total
    assert fused_lives[0].data_ptr() == lives[0].data_ptr()
    apart = [torch.randn(s) for s in SHAPES]  # separate storages: nothing to fuse
    assert len(fuse([shadows], apart)[1]) == len([s for s in SHAPES if torch.Size(s).numel()])
    big = torch.randn(FUSED_PIECE + 5)  # a large tensor is cut into pieces, the same on both sides
    (pieces_shadows,), pieces_lives = fuse([[torch.zeros_like(big)]], [big])
    assert [p.numel() for p in pieces_lives] == [p.numel() for p in pieces_shadows] == [FUSED_PIECE, 5]
    gap = carved(torch.randn(total + 1), [(3, 4), (1,), (5,)])  # a hole between two lives breaks the run
    assert len(fuse([carved(torch.zeros(17), [(3, 4), (5,)])], [gap[0], gap[2]])[1]) == 2
    other = carved(torch.zeros(total + 1), [(3, 4), (1,), (0,), (5,), (2, 2), (7,)])  # a second average
    second = [other[0], *other[2:]]  # whose shadows have a hole after the first: the run breaks there
    assert len(fuse([shadows, second], lives)[1]) == 2


def test_the_fused_update_has_the_bits_of_one_call_per_tensor() -> None:
    total = sum(torch.Size(s).numel() for s in SHAPES)
    torch.manual_seed(0)
    for live_dtype in (torch.float32, torch.bfloat16):
        lives = carved(torch.randn(total).to(live_dtype))
        (fused,) = group_tensors(["average"] * len(SHAPES), [carved(torch.zeros(total))], lives)
        plain = [torch.zeros(s) for s in SHAPES]
        assert len(fused.fused_live) == 1
        apply(fused, [None], Stager())
        torch._foreach_copy_(plain, lives)
        for weight in (0.1, 0.25, 0.001):
            with torch.no_grad():
                torch._foreach_add_(lives, 0.5)
            apply(fused, [weight], Stager())
            torch._foreach_lerp_(plain, [live.float() for live in lives], weight)  # bf16: one pass, cast in cache
        assert all(torch.equal(a, b) for a, b in zip(fused.shadows[0], plain))


def test_several_averages_take_the_bits_each_would_alone_in_cache_sized_batches() -> None:
    """Two averages over one staged read give each average exactly what a lone update gives it,
    also when the fused pieces are walked in batches (a local shard larger than a batch)."""
    torch.manual_seed(0)
    shapes = [(FUSED_PIECE + 3,), (5,), (2 * FUSED_PIECE,)]
    total = sum(torch.Size(s).numel() for s in shapes)
    lives = carved(torch.randn(total), shapes)
    pool = torch.zeros(2 * total)
    both = [carved(pool[:total], shapes), carved(pool[total:], shapes)]
    (group,) = group_tensors(["average"] * 3, both, lives)
    assert len(group.fused_live) == 4 and [len(s) for s in group.fused_shadows] == [4, 4]
    alone = [group_tensors(["average"] * 3, [carved(torch.zeros(total), shapes)], lives)[0] for _ in range(2)]
    apply(group, [None, None], Stager())
    for single in alone:
        apply(single, [None], Stager())
    for weights in ((0.1, 0.3), (0.2, 0.01)):
        with torch.no_grad():
            torch._foreach_add_(lives, 0.25)
        apply(group, weights, Stager())
        for single, weight in zip(alone, weights):
            apply(single, [weight], Stager())
    for shadows, single in zip(group.shadows, alone):
        assert all(torch.equal(a, b) for a, b in zip(shadows, single.shadows[0]))


def test_one_average_lerps_in_long_pieces_while_the_screen_and_several_averages_keep_short_ones() -> None:
    """A lone average lerps each fused view in pieces of up to ``LERP_PIECE`` (fewer calls), with
    the bits of one lerp per tensor; two averages take ``FUSED_PIECE`` pieces (each read by both
    while in cache), and the screen reads ``FUSED_PIECE`` pieces either way (a bf16 sum needs them)."""
    torch.manual_seed(0)
    shapes = [(FUSED_PIECE + 3,), (5,), (FUSED_PIECE,)]
    total = sum(torch.Size(s).numel() for s in shapes)
    lives = carved(torch.randn(total), shapes)
    (lone,) = group_tensors(["average"] * 3, [carved(torch.zeros(total), shapes)], lives)
    assert [[read.numel() for read in batch.reads] for batch in lone.batches] == [[total]]
    assert [piece.numel() for piece in lone.screen.large] == [FUSED_PIECE, FUSED_PIECE]
    assert [scratch.numel() for _, scratch in lone.screen.buckets] == [8]  # the tail, read in the scratch
    pool = torch.zeros(2 * total)
    (pair,) = group_tensors(["average"] * 3, [carved(pool[:total], shapes), carved(pool[total:], shapes)], lives)
    assert [read.numel() for batch in pair.batches for read in batch.reads] == [FUSED_PIECE, FUSED_PIECE, 8]
    plain = [torch.zeros(s) for s in shapes]
    for weight in (None, 0.1, 0.003):
        with torch.no_grad():
            torch._foreach_add_(lives, 0.25)
        apply(lone, [weight], Stager())
        if weight is None:
            torch._foreach_copy_(plain, lives)
        else:
            torch._foreach_lerp_(plain, lives, weight)
    assert all(torch.equal(a, b) for a, b in zip(lone.shadows[0], plain))
    longest = torch.zeros(LERP_PIECE + 1)  # longer than a lone average's piece: cut there
    (long,) = group_tensors(["average"], [[torch.zeros_like(longest)]], [longest])
    assert [read.numel() for batch in long.batches for read in batch.reads] == [LERP_PIECE, 1]


def test_a_nonfinite_value_in_a_fused_run_is_named_by_its_own_tensor() -> None:
    total = sum(torch.Size(s).numel() for s in SHAPES)
    lives = carved(torch.randn(total))
    groups = group_tensors(["average"] * len(SHAPES), [carved(torch.zeros(total))], lives)
    assert nonfinite(groups) == []
    lives[3][1, 0] = float("nan")
    assert nonfinite(groups) == [3]


def test_a_strided_live_shard_is_updated_as_it_is_even_when_large() -> None:
    live = torch.randn(FUSED_PIECE // 512 + 1, 512).t()  # transposed: not dense, more than a piece
    (group,) = group_tensors(["average"], [[torch.zeros(live.shape)]], [live])
    assert group.fused_live == [live] and group.fused_shadows[0][0].shape == live.shape
    plain = torch.zeros(live.shape)
    apply(group, [None], Stager())
    plain.copy_(live)
    live.add_(1.0)
    apply(group, [0.1], Stager())
    assert torch.equal(group.shadows[0][0], plain.lerp_(live, 0.1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("numel", [SUMMED_NUMEL * 2, SUMMED_NUMEL * 2 + 1])  # halves dotted, or summed
def test_the_screen_of_large_pieces_finds_every_nonfinite_value_and_only_those(dtype, numel) -> None:
    """NaN, +inf and -inf anywhere in a large piece (the screen's dot of halves, sum, or fp16's
    min and max) name their tensor; finite values whose products or sums overflow do not."""
    torch.manual_seed(0)
    lives = [torch.randn(numel).to(dtype), torch.randn(5).to(dtype)]
    groups = group_tensors(["average"] * 2, [[torch.zeros(numel), torch.zeros(5)]], lives)
    assert nonfinite(groups) == []
    for bad in (float("nan"), float("inf"), float("-inf")):
        for where in (0, numel // 2, numel - 1):
            lives[0][where] = bad
            assert nonfinite(groups) == [0], (bad, where)
            lives[0][where] = 0.5
    huge = torch.finfo(dtype).max / 4
    lives[0].fill_(huge)  # every product and the sum overflow: flagged by the screen, cleared by the exact check
    assert nonfinite(groups) == []


def test_small_shards_apart_are_screened_in_runs_through_a_scratch(monkeypatch) -> None:
    """Shards too small to read alone and too large to gather (FSDP2's or an MoE's expert shards)
    are copied run by run into a scratch and screened there: a NaN or an infinity in any of them,
    in any run, names its own tensor."""
    import shardavg.update.fused

    monkeypatch.setattr(shardavg.update.fused, "SCREENED_ELEMENTS", 12_000)  # several buckets of two shards
    torch.manual_seed(0)
    lives = [torch.randn(5000) for _ in range(7)]  # apart in memory, each above GATHER_NUMEL
    groups = group_tensors(["average"] * 7, [[torch.zeros(5000) for _ in range(7)]], lives)
    (group,) = groups
    assert [len(bucket) for bucket, _ in group.screen.buckets] == [2, 2, 2, 1] and not group.screen.large
    assert nonfinite(groups) == []
    for index in (0, 3, 6):
        for bad in (float("nan"), float("-inf")):
            lives[index][4999] = bad
            assert nonfinite(groups) == [index]
            lives[index][4999] = 0.25


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_screen_dots_fp32_halves_and_sums_bf16(dtype) -> None:
    """The screen's one read of a large piece: a dot of its halves in fp32, a sum in bf16 (ATen's
    CPU dot is scalar for bf16: 340x a sum's time, which made a checked bf16 update 4x the
    unchecked one)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    lives = [torch.randn(SUMMED_NUMEL * 2).to(dtype)]
    groups = group_tensors(["average"], [[torch.zeros(SUMMED_NUMEL * 2)]], lives)
    with Ops() as ops:
        assert nonfinite(groups) == []
    assert ("dot" in ops.seen) == (dtype == torch.float32), ops.seen
    assert ("sum" in ops.seen) == (dtype == torch.bfloat16), ops.seen
