"""``background=True``: the update on a thread of its own, bitwise the update in the loop; the next
optimizer step and every reader wait for it; its errors surface at the next call; no thread
outlives it."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch import nn

import shardavg
from shardavg import EMA, WeightAverager


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 4))


def slow_ema(seconds: float):
    """An EMA of decay 0.9 as a ``multi_avg_fn`` that first sleeps: if anything wrote the live
    weights before the update had read them, the average would show it."""

    def fn(shadows, lives, num_updates) -> None:
        time.sleep(seconds)
        torch._foreach_lerp_(shadows, lives, 0.1)

    return fn


class Gated:
    """An EMA of decay 0.9 as a ``multi_avg_fn`` that runs only once its gate is opened (after the
    test's ``update()`` has returned): a ``update()`` that waited for it would find it shut."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.found_shut = 0

    def __call__(self, shadows, lives, num_updates) -> None:
        if not self.gate.wait(timeout=30):
            self.found_shut += 1
        self.gate.clear()
        torch._foreach_lerp_(shadows, lives, 0.1)


def train(net: nn.Module, averagers: list[WeightAverager], steps: int, dtype=torch.float32, after_update=None) -> None:
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for step in range(1, steps + 1):
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(step)).to(dtype)
        net(x).square().mean().backward()  # (the forward writes BatchNorm's statistics)
        optimizer.step()
        optimizer.zero_grad()
        for averager in averagers:
            averager.update(step)
        if after_update is not None:
            after_update()


@pytest.mark.parametrize("live_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("device", [None, "cpu"])
@pytest.mark.parametrize("buffers", ["copy", "average"])
def test_the_background_average_is_bitwise_the_one_in_the_loop(live_dtype, device, buffers) -> None:
    net = model().to(live_dtype)
    options = {"device": device, "buffers": buffers, "include_frozen": True}
    rules = {"ema": EMA(decay=0.9), "power": shardavg.PowerEMA(sigma_rel=0.1)}
    loop, background = WeightAverager(net, rules, **options), WeightAverager(net, rules, background=True, **options)
    train(net, [loop, background], steps=12, dtype=live_dtype)
    assert background.num_updates == loop.num_updates == 12
    for name in rules:
        got, want = background.full_state_dict(name), loop.full_state_dict(name)
        assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want), name


def updating() -> list[threading.Thread]:
    """The background updates running now."""
    return [thread for thread in threading.enumerate() if thread.name.startswith("shardavg-update-")]


def same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_the_next_optimizer_step_and_every_reader_wait_for_the_update(tmp_path: Path) -> None:
    net = model()
    gated = Gated()
    loop, background = WeightAverager(net, slow_ema(0.0)), WeightAverager(net, gated, background=True)
    opened_later = lambda: threading.Timer(0.3, gated.gate.set).start()  # noqa: E731
    train(net, [background, loop], steps=3, after_update=opened_later)  # each optimizer step finds it shut
    assert same(background.full_state_dict(), loop.full_state_dict())

    def reloaded(avg: WeightAverager, load) -> dict[str, torch.Tensor]:
        fresh = WeightAverager(model(), avg.rule)
        load(fresh)
        return fresh.full_state_dict()

    def swapped(avg: WeightAverager) -> dict[str, torch.Tensor]:
        with avg.swapped():
            return {k: v.clone() for k, v in net.state_dict().items()}

    def copied(avg: WeightAverager) -> dict[str, torch.Tensor]:
        target = model()
        avg.copy_to(target)
        return target.state_dict()

    def exported(avg: WeightAverager) -> dict[str, torch.Tensor]:
        return load_file(str(avg.export(tmp_path / "export") / "model.safetensors"))

    def dcp_saved(avg: WeightAverager) -> dict[str, torch.Tensor]:
        path = str(tmp_path / f"dcp-{avg.step}-{id(avg)}")
        dcp.save({"ema": avg}, checkpoint_id=path, no_dist=True)
        return reloaded(avg, lambda fresh: dcp.load({"ema": fresh}, checkpoint_id=path, no_dist=True))

    readers = {  # each reads what the update in flight writes
        "num_updates": lambda avg: {"n": torch.tensor(avg.num_updates)},
        "full_state_dict": lambda avg: avg.full_state_dict(),
        "shadows": lambda avg: {str(i): s for i, s in enumerate(avg.shadows()) if s is not None},
        "save": lambda avg: reloaded(avg, lambda fresh: fresh.load(avg.save(tmp_path / f"saved-{id(avg)}"))),
        "dcp": dcp_saved,
        "export": exported,
        "swapped": swapped,
        "copy_to": copied,
    }
    for name, read in readers.items():
        background.update()
        gated.gate.set()  # (had update() waited for its own update, the gate would have been shut)
        loop.update()
        got, want = read(background), read(loop)
        if name == "export":  # (what the loop's export found in the folder was the background's)
            want = loop.full_state_dict()
        assert same(got, want), name
    assert gated.found_shut == 0, "update() waited for the update it started"
    assert background.num_updates == loop.num_updates == 3 + len(readers)


def test_an_error_surfaces_at_the_next_call_once_naming_the_step() -> None:
    net = model()
    averagers = {p: WeightAverager(net, EMA(decay=0.9), on_nonfinite=p, background=True) for p in ("raise", "skip")}
    train(net, list(averagers.values()), steps=2)
    for averager in averagers.values():  # (a write to the weights other than an optimizer step's waits by hand)
        averager.wait()
    with torch.no_grad():
        net[0].weight[0, 0] = float("nan")
    assert averagers["raise"].update(3) is True  # handed off
    optimizer = torch.optim.SGD(net.parameters(), lr=0.0)
    with pytest.raises(shardavg.NonFiniteError, match=r"0\.weight.*at step 3") as raised:
        optimizer.step()  # the next call: here the optimizer's, before it writes anything
    assert "background update of step 3" in "\n".join(getattr(raised.value, "__notes__", []))
    optimizer.step()  # raised once
    assert averagers["raise"].num_updates == 2 and not updating()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        averagers["skip"].update(3)
        assert averagers["skip"].num_skipped == 1 and averagers["skip"].num_updates == 2
    assert any("at step 3" in str(w.message) for w in caught), [str(w.message) for w in caught]
    with pytest.raises(ValueError, match="background must be True or False"):
        WeightAverager(net, background="yes")


def test_a_skipped_updates_warning_comes_in_the_loops_thread_at_the_next_call_once() -> None:
    """The thread keeps the warning: a ``catch_warnings`` (or ``pytest.warns``) around the loop's
    next call records it, attributed to the loop's line, once per skipped update."""
    net = model()
    averager = WeightAverager(net, EMA(decay=0.9), on_nonfinite="skip", background=True)
    train(net, [averager], steps=2)
    averager.wait()  # (a write to the weights other than an optimizer step's waits by hand)
    with torch.no_grad():
        net[0].weight[0, 0] = float("nan")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert averager.update(3) is True  # handed off
        while updating():  # the thread's work over, the update not yet collected
            time.sleep(0.005)
        assert [str(w.message) for w in caught] == [], "the update's thread issued the warning itself"
        averager.update(4)  # collects step 3 (still NaN: step 4 is skipped too, on the thread)
    given = [str(w.message) for w in caught]
    assert given == ["skipping the update at step 3 on rank 0: non-finite live values in ['0.weight']"], given
    assert caught[0].filename == __file__, "attributed to shardavg, not to the loop's update() call"
    with pytest.warns(RuntimeWarning, match=r"^skipping the update at step 4 on rank 0") as next_one:
        averager.wait()
    assert len(next_one) == 1
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        assert (averager.num_updates, averager.num_skipped) == (2, 2)
    assert again == [], "a skipped update warned twice"


def test_no_thread_outlives_its_update_and_an_exit_waits_for_it(tmp_path: Path) -> None:
    gated = Gated()
    averager = WeightAverager(model(), gated, background=True)
    averager.update()
    averager.update()  # (the first copies; the second waits for its gate)
    assert len(updating()) == 1
    gated.gate.set()
    averager.wait()
    assert not updating()
    script = tmp_path / "ends_while_averaging.py"
    script.write_text(
        "import time, torch, shardavg\n"
        "net = torch.nn.Linear(4, 4)\n"
        "def slow(shadows, lives, n):\n"
        "    time.sleep(0.5)\n"
        "    torch._foreach_copy_(shadows, lives)\n"
        f"    open({str(tmp_path / 'landed')!r}, 'w').close()\n"
        "avg = shardavg.WeightAverager(net, slow, background=True)\n"
        "avg.update()\n"
        "avg.update()  # (the first copies; the second calls slow)\n"
    )
    subprocess.run([sys.executable, str(script)], check=True, timeout=120)
    assert (tmp_path / "landed").exists(), "the interpreter exited before the update in flight had landed"
