"""The digest the replicated strategy compares replicas by (``strategies/replicated.py``): equal
bytes give equal digests, whatever the chunk read at a time; a change anywhere, a permutation or
a sign of zero gives another; every dtype; no process group means nothing is compared."""

from __future__ import annotations

import pytest
import torch

import shardavg
from shardavg.strategies.replicated import MASK, value_digests


def digest(tensor: torch.Tensor, bucket_bytes: int = 2**20) -> int:
    (found,) = value_digests([tensor], bucket_bytes)
    assert found is not None and found.dtype == torch.int64 and found.dim() == 0
    return int(found)


def test_equal_bytes_give_equal_digests_whatever_the_chunk() -> None:
    values = torch.randn(100_003, generator=torch.Generator().manual_seed(0))
    digests = {digest(values.clone(), bucket_bytes) for bucket_bytes in (1, 2**16, 2**20, 2**30)}
    assert len(digests) == 1
    assert 0 <= digests.pop() <= MASK


def test_any_change_gives_another_digest() -> None:
    values = torch.randn(100_003, generator=torch.Generator().manual_seed(0))
    nudged = values.clone()
    nudged[77_777] = torch.nextafter(nudged[77_777], torch.tensor(float("inf")))
    swapped = values.clone()
    swapped[[5, 90_000]] = swapped[[90_000, 5]]
    assert len({digest(values), digest(nudged), digest(values.flip(0)), digest(swapped)}) == 4
    assert digest(torch.tensor([0.0])) != digest(torch.tensor([-0.0]))


@pytest.mark.parametrize(
    "dtype",
    [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int8, torch.bool, torch.complex64],
)
def test_every_dtype(dtype: torch.dtype) -> None:
    values = (torch.randn(1001, generator=torch.Generator().manual_seed(1)) * 5).to(dtype)
    changed = values.clone()
    changed[500] = values[499] if values[499] != values[500] else ~values[500] if dtype == torch.bool else 7
    assert digest(values) == digest(values.clone())
    assert digest(values) != digest(changed)


def test_nothing_held_and_nothing_empty() -> None:
    none, empty = value_digests([None, torch.empty(0)], 2**20)
    assert none is None and int(empty) == 0


def test_one_process_takes_a_megatron_slice_whole() -> None:
    """Without a process group the one rank holds the whole tensor: nothing to refuse."""
    model = torch.nn.Linear(4, 2)
    model.weight.tensor_model_parallel = True
    averager = shardavg.WeightAverager(model, shardavg.EMA(decay=0.9))
    averager.update()
    assert torch.equal(averager.full_state_dict()["weight"], model.weight.detach())
