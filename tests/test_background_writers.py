"""Writers of the live weights other than the optimizer, while an update runs in the background:
a forward that writes its weights (an embedding with ``max_norm``) and a second averager's
``swapped()`` or ``copy_into_model()`` wait for it, so the average stays bitwise the update in
the loop; what does not wait (``load_state_dict``, a hand-written update) is seen and refused."""

from __future__ import annotations

import gc
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from shardavg import EMA, WeightAverager

ROOT = Path(__file__).resolve().parents[1]


def lerp(shadows, lives, num_updates) -> None:
    """An EMA of decay 0.9 as a ``multi_avg_fn``: the reference, in the loop."""
    torch._foreach_lerp_(shadows, lives, 0.1)


def slow_lerp(shadows, lives, num_updates) -> None:
    """``lerp`` that reads the live weights 0.1 s late: whatever writes them meanwhile shows."""
    time.sleep(0.1)
    lerp(shadows, lives, num_updates)


class Gated:
    """``lerp`` that reads the live weights only once ``gate`` is open."""

    def __init__(self) -> None:
        self.gate = threading.Event()

    def __call__(self, shadows, lives, num_updates) -> None:
        assert self.gate.wait(timeout=30), "the gate was never opened"
        lerp(shadows, lives, num_updates)

    def later(self, seconds: float = 0.2) -> None:
        """Open the gate from another thread, after whatever the caller blocks on next."""
        threading.Timer(seconds, self.gate.set).start()


def same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def steps(net: nn.Module, averagers: list[WeightAverager], first: int, last: int) -> None:
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(first, last + 1):
        optimizer.zero_grad()
        net(torch.randn(8, 16, generator=torch.Generator().manual_seed(step))).square().mean().backward()
        optimizer.step()
        for averager in averagers:
            averager.update(step)


def test_a_forward_that_writes_its_weights_waits_for_the_update() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Embedding(64, 8, max_norm=0.5), nn.Flatten(), nn.Linear(32, 4))
    background, loop = WeightAverager(net, slow_lerp, background=True), WeightAverager(net, lerp)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.5)
    for step in range(1, 5):
        tokens = torch.arange(16).view(4, 4) + 16 * (step - 1)  # rows never looked up: each forward renormalises
        optimizer.zero_grad()
        net(tokens).square().mean().backward()  # the embedding's forward writes rows the update reads
        optimizer.step()
        background.update(step)
        loop.update(step)
    assert same(background.full_state_dict(), loop.full_state_dict())
    assert len(net[0]._forward_pre_hooks) == 1 and not net._forward_pre_hooks and not net[2]._forward_pre_hooks
    del background
    gc.collect()
    assert not net[0]._forward_pre_hooks, "the hook outlived its averager"


def test_a_second_averagers_writes_into_the_model_wait_for_the_update() -> None:
    net, gated = mlp(), Gated()
    gated.gate.set()
    first = WeightAverager(net, EMA(decay=0.5), background=True)
    second, reference = WeightAverager(net, gated, background=True), WeightAverager(net, lerp)
    steps(net, [first, second, reference], 1, 2)
    first.wait()
    second.wait()
    gated.gate.clear()

    second.update(3)  # reads the live weights once the gate opens
    reference.update(3)
    gated.later()
    with first.swapped():  # entering writes the first average into the live weights
        gated.gate.set()
        second.wait()
    assert same(second.full_state_dict(), reference.full_state_dict()), "swapped() entry"

    gated.gate.clear()
    with first.swapped():
        second.update(4)  # in the block it reads the first average, as the reference does
        reference.update(4)
        gated.later()
    gated.gate.set()  # (leaving writes the live weights back)
    assert same(second.full_state_dict(), reference.full_state_dict()), "swapped() exit"

    gated.gate.clear()
    second.update(5)
    reference.update(5)
    gated.later()
    first.copy_into_model()
    gated.gate.set()
    assert same(second.full_state_dict(), reference.full_state_dict()), "copy_into_model()"

    steps(net, [first], 6, 6)
    gated.gate.clear()
    second.update(7)
    reference.update(7)
    gated.later()
    first.copy_to(net)  # (into a plain module: here the very model the second averager reads)
    gated.gate.set()
    assert same(second.full_state_dict(), reference.full_state_dict()), "copy_to()"


def load_state_dict(net: nn.Module) -> None:
    net.load_state_dict({k: v + 1 for k, v in net.state_dict().items()})


def hand_written(net: nn.Module) -> None:
    with torch.no_grad():
        net[2].weight.mul_(0.5)


@pytest.mark.parametrize(
    "write, written",
    [(load_state_dict, "['0.weight', '0.bias', '2.weight', '2.bias']"), (hand_written, "['2.weight']")],
)
def test_a_write_that_did_not_wait_is_seen_and_the_average_refused_until_restored(tmp_path, write, written) -> None:
    net, gated = mlp(), Gated()
    gated.gate.set()
    averager = WeightAverager(net, gated, background=True)
    steps(net, [averager], 1, 2)
    averager.wait()
    gated.gate.clear()
    averager.update(3)
    write(net)  # without averager.wait(): the update has not read the weights yet
    gated.gate.set()
    message = re.escape(f"{written} were written while the background update of step 3 read them on rank 0")
    with pytest.raises(RuntimeError, match=rf"^{message}, .*call avg\.wait\(\) before writing"):
        averager.wait()
    averager.wait()  # raised once
    refusals = {
        "update()": lambda: averager.update(4),
        "swapped()": lambda: averager.swapped().__enter__(),
        "copy_into_model()": averager.copy_into_model,
        "gathering the average": averager.full_state_dict,
        "save()": lambda: averager.save(tmp_path / "torn"),
        "state_dict()": averager.state_dict,
    }
    for what, refused in refusals.items():
        with pytest.raises(RuntimeError, match=rf"^{re.escape(what)} refused: the average cannot be trusted, "):
            refused()
    assert averager.num_updates == 3 and not (tmp_path / "torn").exists()
    averager.full_state_dict(live=True)  # (the live weights are not the average)
    averager.restart(4)  # restored: from the live weights on
    reference = WeightAverager(net, lerp)
    reference.update(4)
    averager.update(5)
    reference.update(5)
    assert averager.num_updates == 2 and same(averager.full_state_dict(), reference.full_state_dict())


FSDP2 = """
import sys, threading, torch, torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from shardavg import WeightAverager

dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
fully_shard(net, mesh=init_device_mesh("cpu", (1,)))
optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
gate = threading.Event()
def gated(shadows, lives, n):
    assert gate.wait(timeout=30)
    torch._foreach_lerp_(shadows, lives, 0.1)
averager = WeightAverager(net, gated, background=True)
averager.update(1)
for step, write in enumerate(sys.argv[1:], start=2):
    gate.clear()
    averager.update(step)  # in flight, reading once the gate opens
    exec(write)
    gate.set()
    try:
        averager.wait()
        print("NOT SEEN")
    except RuntimeError as error:
        print("SEEN", str(error).split(" were written")[0])
        averager.restart(step)
dist.destroy_process_group()
"""
WRITES = {  # a write while the update is in flight: what is seen of it
    "net(torch.randn(4, 8)).sum().backward(); threading.Timer(0.2, gate.set).start(); optimizer.step()": "NOT SEEN",
    "net.load_state_dict(net.state_dict())": "SEEN ['0.weight', '0.bias', '1.weight', '1.bias']",
    "with torch.no_grad(): net[1].weight.mul_(2)": "SEEN ['1.weight']",
    "with torch.no_grad(): net[0].bias.to_local().add_(1)": "SEEN ['0.bias']",
    "net[1].weight.data.mul_(2)": "NOT SEEN",  # (.data bypasses the version counters: documented)
}


@pytest.mark.slow
def test_under_fsdp2_writes_through_a_dtensor_or_its_shard_are_seen(tmp_path: Path) -> None:
    """A forward, backward and optimizer step (which waits) are not mistaken for a write."""
    script = tmp_path / "fsdp2_writes.py"
    script.write_text(FSDP2)
    done = subprocess.run([sys.executable, str(script), *WRITES], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines() == list(WRITES.values())
