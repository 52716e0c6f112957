"""torchrun scenario: modules the replicated strategy would take whose parameters are not replicas.

    torchrun --standalone --nproc_per_node N tests_distributed/scenario_replicas.py OUT

The replicated strategy (a plain module, DDP) takes every rank's tensors for copies of one
model, and writes them once. Hand-written tensor parallelism (each rank holds a slice of a
``Linear``) and Megatron-Core's parallel layers look like plain modules; before this check their
export held one rank's slices as if whole. Checked here, each message exactly, on every rank:

- slices of different shapes: refused when the averager is built, naming the tensor, its
  shapes and two ranks;
- slices of one shape (different values): built (values may differ before DDP broadcasts), but
  ``export`` (averaged and live), ``full_state_dict``, ``copy_to`` and ``save`` are refused
  naming the tensors and two ranks, and nothing is written; a single parameter that differs on
  the last rank only is named with that rank;
- a parameter carrying Megatron's ``tensor_model_parallel`` mark (set as Megatron's layers set
  it; megatron-core is not needed): refused when the averager is built, on every rank alike
  even when only the last rank's carries it, bare or inside DDP;
- no false alarm: an averager built on an unseeded module before DDP broadcasts rank 0's
  weights (the ranks' values differ at construction), per-rank BatchNorm statistics, trained,
  exported, gathered and saved: exactly the reference average. ``update()`` issues no collective;
  each check issues one all-reduce.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

import harness
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from shardavg import EMA, StrategyError, WeightAverager

ADVICE = (
    "the 'replicated' strategy takes every rank's tensors for copies of one model; hand-written tensor "
    "parallelism? Hold the slices as DTensors (torch's parallelize_module), which shardavg places exactly"
)
IN = 4


class Sliced(nn.Module):
    """A column-parallel ``Linear`` written by hand: this rank's ``rows`` output rows of a larger
    one, then a replicated gain."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.fc = nn.Linear(IN, rows)
        self.gain = nn.Parameter(torch.ones(1))


class Net(nn.Module):
    """A small replicated model with BatchNorm statistics (each rank's own under DDP without
    ``broadcast_buffers``)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(IN, 8)
        self.norm = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.norm(self.fc(x))))


@contextlib.contextmanager
def raises_exactly(message: str) -> Iterator[None]:
    """The block raises ``StrategyError`` with exactly ``message`` (on this rank)."""
    try:
        yield
    except StrategyError as error:
        assert str(error) == message, f"rank {dist.get_rank()}:\n got  {str(error)!r}\n want {message!r}"
    else:
        raise AssertionError(f"rank {dist.get_rank()}: expected StrategyError {message!r}")


def one_all_reduce() -> int:
    """How many events ``CollectiveCount`` sees for one all-reduce."""
    with harness.CollectiveCount() as count:
        dist.all_reduce(torch.ones(1))
    return count.count


def check_slices_of_different_shapes() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = Sliced(3 if rank == 0 else 2)  # 2 * world + 1 rows, cut unevenly by hand
    refused = f"not replicas: 'fc.weight' is (3, 4) on rank 0 but (2, 4) on rank 1 (and 1 more: 'fc.bias'): {ADVICE}"
    with raises_exactly(refused):
        WeightAverager(model)
    harness.report("REFUSED", {"case": "shapes", "world_size": world})


def check_slices_of_one_shape(out: Path) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    whole = nn.Linear(IN, 4 * world)
    model = Sliced(4)
    with torch.no_grad():
        model.fc.weight.copy_(whole.weight[4 * rank : 4 * rank + 4])
        model.fc.bias.copy_(whole.bias[4 * rank : 4 * rank + 4])
    averager = WeightAverager(model, EMA(decay=0.9))  # shapes agree: values are not compared here
    with harness.CollectiveCount() as count:
        for step in range(3):
            with torch.no_grad():
                model.fc.weight.add_(0.1 * step)
            averager.update()
    assert not count.names, f"update() issued collectives: {count.names}"

    def refused(what: str, live: bool = False) -> str:
        label = " (live)" if live else ""
        return (
            f"not replicas: rank 0 and rank 1 hold different values of 'fc.weight'{label} (and 1 more: "
            f"'fc.bias'{label}), so {what} would write one rank's as the whole: {ADVICE}, or keep the replicas "
            "equal (DDP broadcasts rank 0's weights); nothing was written"
        )

    target = out / "sliced-export"
    with raises_exactly(refused(f"exporting to {target}")):
        averager.export(target)
    with raises_exactly(refused(f"exporting to {target}", live=True)):
        averager.export(target, live=True)
    with raises_exactly(refused("full_state_dict()")):
        averager.full_state_dict()
    with raises_exactly(refused("copy_to()")):
        averager.copy_to(Sliced(4))
    saved = out / "sliced-save"
    with raises_exactly(refused(f"saving {saved}")):
        averager.save(saved)
    dist.barrier()
    assert not target.exists() and not saved.exists(), "a refused export or save wrote something"

    # One parameter that differs on the last rank only: that rank is named.
    torch.manual_seed(0)
    model = Sliced(4)
    averager = WeightAverager(model, EMA(decay=0.9))
    if rank == world - 1:
        with torch.no_grad():
            model.gain.mul_(2.0)
    averager.update()
    with raises_exactly(
        f"not replicas: rank 0 and rank {world - 1} hold different values of 'gain', so exporting to {target} "
        f"would write one rank's as the whole: {ADVICE}, or keep the replicas equal (DDP broadcasts rank 0's "
        "weights); nothing was written"
    ):
        averager.export(target)
    dist.barrier()
    assert not target.exists(), "a refused export wrote something"
    harness.report("REFUSED", {"case": "values", "world_size": world})


def mark_as_megatron(linear: nn.Linear) -> None:
    """What Megatron-Core's ``ColumnParallelLinear`` sets on its weight and bias
    (``set_tensor_model_parallel_attributes``), and on the rest (``tensor_model_parallel=False``)."""
    for tensor in (linear.weight, linear.bias):
        tensor.tensor_model_parallel = True
        tensor.partition_dim = 0
        tensor.partition_stride = 1


def check_megatron_mark() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()

    def refused(on: int) -> str:
        return (
            f"'fc.weight' is a tensor-parallel slice on rank {on} (Megatron's tensor_model_parallel attribute, "
            "partition_dim=0, partition_stride=1, and 1 more), not a replica: the 'replicated' strategy would "
            "export one rank's slice as the whole tensor; a Megatron-Core model is averaged by strategy='auto' (the "
            "'megatron' strategy places its slices from its sharded_state_dict()); a module marked by hand: hold its "
            "slices as DTensors"
        )

    torch.manual_seed(0)
    model = Net()
    mark_as_megatron(model.fc)
    model.head.weight.tensor_model_parallel = False  # (Megatron's default on replicated parameters)
    with raises_exactly(refused(0)):
        WeightAverager(model)
    with raises_exactly(refused(0)):
        WeightAverager(DDP(model))
    torch.manual_seed(0)
    model = Net()
    if rank == world - 1:  # only one rank's: every rank still raises, alike, and none hangs
        mark_as_megatron(model.fc)
    with raises_exactly(refused(world - 1)):
        WeightAverager(model)
    harness.report("REFUSED", {"case": "megatron", "world_size": world})


def check_no_false_alarm(out: Path) -> None:
    """Built before DDP on an unseeded module; per-rank BatchNorm statistics; exact export."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(100 + rank)  # unseeded, as far as the ranks are concerned: each its own init
    model = Net()
    firsts = [None] * world
    dist.all_gather_object(firsts, model.fc.weight.detach().clone())
    assert all(not torch.equal(firsts[0], other) for other in firsts[1:]), "the ranks' initial weights agree"
    averager = WeightAverager(model, EMA(decay=0.9))
    ddp = DDP(model, broadcast_buffers=False)  # broadcasts rank 0's weights, in place
    reference = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    collectives: list[str] = []
    for step in range(4):
        generator = torch.Generator().manual_seed(10 * step + rank)  # each rank its own data
        x, y = torch.randn(6, IN, generator=generator), torch.randint(0, 3, (6,), generator=generator)
        optimizer.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        optimizer.step()
        with harness.CollectiveCount() as count:
            averager.update()
        collectives += count.names
        reference.update_parameters(model)
    assert not collectives, f"update() issued collectives: {collectives}"
    norms = [None] * world
    dist.all_gather_object(norms, model.norm.running_mean.clone())
    assert world == 1 or not torch.equal(norms[0], norms[1]), "the ranks' BatchNorm statistics agree"

    want = dict(reference.module.named_parameters()) | dict(model.named_buffers())  # rank 0's buffers
    target = averager.export(out / "ddp-export")
    got = averager.full_state_dict()
    averager.save(out / "ddp-save")
    averager.copy_to(Net())
    if rank == 0:
        exported = load_file(str(target / "model.safetensors"))
        assert set(exported) == set(Net().state_dict()), sorted(exported)
        for name, value in want.items():
            assert torch.equal(exported[name], value.detach()), f"exported {name} differs from the reference"
            assert torch.equal(got[name], value.detach()), f"full_state_dict() {name} differs from the reference"

    # Each check is one all-reduce, whatever the number of tensors.
    from shardavg.strategies.replicated import Replicated, refuse_non_replicas, refuse_unlike_values

    one = one_all_reduce()
    strategy = Replicated(model)
    with harness.CollectiveCount() as count:
        refuse_non_replicas([strategy], compare_shapes=True)
    assert count.count == one, f"the construction check issued {count.names}"
    with harness.CollectiveCount() as count:
        refuse_unlike_values([p.detach() for p in model.parameters()], ["?"] * 6, "checking", 2**20, [4, 0])
    assert count.count == one, f"the value check issued {count.names}"
    harness.report("ACCEPTED", {"case": "ddp-unseeded", "world_size": world})


@record
def main() -> None:
    out = Path(sys.argv[1])
    harness.init_distributed()
    check_slices_of_different_shapes()
    check_slices_of_one_shape(out)
    check_megatron_mark()
    check_no_false_alarm(out)
    harness.finish()


if __name__ == "__main__":
    main()
