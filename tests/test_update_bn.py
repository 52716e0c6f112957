"""``update_bn``: BatchNorm statistics recomputed under the average and kept in it (SWA's last step),
bitwise torch's ``update_bn`` on ``AveragedModel``. At 2 ranks under FSDP2:
``tests_distributed/scenario_averager.py`` (``check_update_bn``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn, get_swa_avg_fn

import shardavg
from shardavg import EMA, SWA, WeightAverager

STATISTICS = ["norm.num_batches_tracked", "norm.running_mean", "norm.running_var"]


class Net(nn.Module):
    """A linear layer, a BatchNorm and another."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up, self.norm, self.down = nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.norm(self.up(inputs))))


def batches(seed: int, count: int = 5) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(16, 6, generator=generator), torch.randint(0, 3, (16,), generator=generator)) for _ in range(count)
    ]


def train(model: nn.Module, steps: int, after_each) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for inputs, targets in batches(1, steps):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(inputs), targets).backward()
        optimizer.step()
        after_each()


@pytest.mark.parametrize("rule", ["ema", "swa"])
def test_the_statistics_are_torchs_update_bn_on_averaged_model_and_the_live_buffers_come_back(rule) -> None:
    model = Net()
    averager = (  # (torch's SWA divides where SWA() lerps: its own avg_fn, for the bits)
        WeightAverager(model, EMA(decay=0.9)) if rule == "ema" else WeightAverager(model, avg_fn=get_swa_avg_fn())
    )
    reference = (
        AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
        if rule == "ema"
        else AveragedModel(model, avg_fn=get_swa_avg_fn())
    )

    def both() -> None:
        averager.update()
        reference.update_parameters(model)

    train(model, 6, both)
    live = {name: buffer.clone() for name, buffer in model.named_buffers()}
    loader = batches(2)  # (input, target) pairs: torch's update_bn takes the first
    assert sorted(shardavg.update_bn(loader, averager)) == STATISTICS
    torch.optim.swa_utils.update_bn(loader, reference)
    got, want = averager.full_state_dict(), reference.module.state_dict()
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name].to(got[name].dtype)), name
    assert got["norm.num_batches_tracked"].item() == len(loader)
    for name, buffer in model.named_buffers():  # the live statistics as training left them
        assert torch.equal(buffer, live[name]), name
    with averager.swapped():  # and swapped() has them
        assert torch.equal(model.norm.running_mean, want["norm.running_mean"])


def test_the_next_update_copies_the_live_buffers_again_as_after_torchs() -> None:
    model = Net()
    averager = WeightAverager(model, EMA(decay=0.9))
    train(model, 2, averager.update)
    averager.update_bn(batches(2))
    averager.update()
    assert torch.equal(averager.full_state_dict()["norm.running_mean"], model.norm.running_mean)


def test_nothing_to_keep_where_no_buffer_is_stored_or_there_is_no_batchnorm() -> None:
    model = Net()
    ignoring = WeightAverager(model, EMA(decay=0.9), buffers="ignore")
    plain = nn.Sequential(nn.Linear(6, 3))
    no_norm = WeightAverager(plain, EMA(decay=0.9))
    ignoring.update()
    no_norm.update()
    before = {name: buffer.clone() for name, buffer in model.named_buffers()}
    assert ignoring.update_bn(batches(2)) == [] and no_norm.update_bn(batches(2)) == []
    for name, buffer in model.named_buffers():
        assert torch.equal(buffer, before[name]), name


def test_before_any_update_or_inside_swapped_it_is_refused() -> None:
    model = Net()
    averager = WeightAverager(model, EMA(decay=0.9))
    with pytest.raises(RuntimeError, match="update"):
        averager.update_bn(batches(2))
    averager.update()
    with averager.swapped(), pytest.raises(RuntimeError, match="swapped"):
        averager.update_bn(batches(2))


def test_one_of_several_averages_by_name_where_each_keeps_its_own_buffers() -> None:
    model = Net()
    averager = WeightAverager(model, {"ema": EMA(decay=0.9), "swa": SWA()}, buffers="average")
    train(model, 3, averager.update)
    with pytest.raises(ValueError, match="name one"):
        averager.update_bn(batches(2))
    before = averager.full_state_dict("ema")["norm.running_mean"]
    averager.update_bn(batches(2), average="swa")
    assert torch.equal(averager.full_state_dict("ema")["norm.running_mean"], before)
    assert not torch.equal(averager.full_state_dict("swa")["norm.running_mean"], before)
    sharing = WeightAverager(model, {"ema": EMA(decay=0.9), "swa": SWA()})  # buffers="copy": one copy for all
    sharing.update()
    with pytest.raises(ValueError, match=r"share one copy of \['norm.running_mean'.*buffers='average'"):
        sharing.update_bn(batches(2), average="swa")
