"""torchrun scenarios for the averager inside one asynchronous DCP save with the model and optimizer.

    torchrun --standalone --nproc_per_node N tests_distributed/scenario_async.py MODE ROOT

``inflight``: for each DCP engine, ``dcp.async_save`` of model, optimizer and averager in one
request, held in flight by a gate on the storage writer (DCP's own extension point) while three
more training steps and updates run; once the gate opens and the save completes, a fresh engine
and averager load it: model, optimizer and every average equal, bitwise, what they were when
``async_save`` was called. Both of DCP's stagers are used (the writer's own and ``DefaultStager``).

``kill``: an FSDP2 run saves asynchronously at step 3 (completed), writes the reference of that
step, then starts a second asynchronous save at step 6 and SIGKILLs rank 1 while it is in flight.
``resume`` (a later launch): the half-written checkpoint is refused by the checker, and the one of
step 3 loads and equals the reference bitwise. ``resume+inflight`` runs both in turn in one launch.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

import harness
import scenario_checkpoint
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import shardavg
from shardavg import EMA, SWA, WeightAverager
from shardavg.strategies.base import canonical_name

RULES = {"ema": EMA(decay=0.9), "swa": SWA()}
ENGINES = ["replicated", "fsdp2", "fsdp1"]  # (ZeRO-3's model and optimizer go through DeepSpeed's own checkpoint)


class GatedWriter(dcp.FileSystemWriter):
    """A file-system writer that writes nothing until ``gate`` opens: the request stays in flight."""

    def __init__(self, path: Path, gate: threading.Event) -> None:
        super().__init__(str(path))
        self.gate = gate

    def write_data(self, plan, planner):
        self.gate.wait(timeout=120)
        return super().write_data(plan, planner)


def request(engine: harness.Engine, avg: WeightAverager) -> dict:
    """Model, optimizer and averager, as one DCP state dict."""
    model, optimizer = get_state_dict(engine.model, engine.optimizer)
    return {"model": model, "optimizer": optimizer, "avg": avg}


def build(kind: str) -> harness.Engine:
    """The checkpoint scenarios' engines; FSDP1 over a device mesh, whose sharded state dicts hold
    DTensors: DCP's ``DefaultStager`` cannot copy the ``ShardedTensor``s FSDP1 gives without one
    (in torch 2.13 it asks them for a ``data_ptr``)."""
    if kind == "fsdp1":
        return harness.build_fsdp1(torch.float32, use_orig_params=dist.get_world_size() % 4 == 0, mesh=True)
    return scenario_checkpoint.build(kind)


def restore(engine: harness.Engine, state: dict) -> None:
    """The model and optimizer from a loaded request."""
    set_state_dict(engine.model, engine.optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])  # fmt: skip


def snapshot(engine: harness.Engine, avg: WeightAverager) -> dict[str, torch.Tensor]:
    """Collective: the full live parameters (not the BatchNorm buffers, which each rank keeps its
    own of and DCP saves one of) and every full average, every rank."""
    live = engine.gather_live()
    own = {canonical_name(n).removeprefix("module.") for n, _ in engine.model.named_buffers()}
    state = {f"live.{k}": v for k, v in live.items() if k not in own}
    for name in RULES:
        full = avg.full_state_dict(name)
        state |= {f"{name}.{k}": v for k, v in full.items()}
    return state


def full(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rank 0's full averages reach every rank (full_state_dict gives them to rank 0 alone)."""
    objects = [state]
    dist.broadcast_object_list(objects, src=0)
    return objects[0]


def train(engine: harness.Engine, avg: WeightAverager, steps: range) -> None:
    for step in steps:
        engine.step(step)
        avg.update()


def assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert set(got) == set(want), f"{what}: {sorted(set(got) ^ set(want))}"
    wrong = [k for k in want if not torch.equal(got[k], want[k])]
    assert not wrong, f"{what}: {wrong} differ"


STAGERS = {  # DCP's DefaultStager as async_save builds it, and staging in a background thread (torchtitan's)
    "default": StagingOptions(False, False, False, False),
    "background": StagingOptions(False, False, True, False),
}


def inflight(root: Path, group: dist.ProcessGroup) -> None:
    for kind in ENGINES:
        for stager, options in STAGERS.items():
            engine = build(kind)
            avg = WeightAverager(engine.model, RULES)
            train(engine, avg, range(1, 4))
            want = full(snapshot(engine, avg))
            optimizer_before = _optimizer_state(engine)
            folder = root / f"{kind}-{stager}-ws{dist.get_world_size()}"
            gate, staging = threading.Event(), DefaultStager(options)
            response = dcp.async_save(
                request(engine, avg), storage_writer=GatedWriter(folder, gate), async_stager=staging,
                process_group=group,
            )  # fmt: skip
            if options.use_async_staging:  # staged in the background: wait for it, as before an optimizer step
                response.staging_completion.result()
                response = response.upload_completion
            train(engine, avg, range(4, 7))  # while the request waits at the gate
            assert not response.done(), "the save finished before the gate opened"
            gate.set()
            response.result()
            staging.close()

            fresh = build(kind)
            loaded = WeightAverager(fresh.model, RULES)
            state = request(fresh, loaded)
            dcp.load(state, checkpoint_id=str(folder), process_group=group)
            restore(fresh, state)
            assert loaded.num_updates == 3, loaded.num_updates
            assert_equal(full(snapshot(fresh, loaded)), want, f"{kind} ({stager} stager): loaded vs at async_save")
            assert_equal(_optimizer_state(fresh), optimizer_before, f"{kind} ({stager} stager): optimizer")
            harness.report("INFLIGHT", {"engine": kind, "stager": stager})
    refused_by_the_writers_own_stager(root, group)


def refused_by_the_writers_own_stager(root: Path, group: dist.ProcessGroup) -> None:
    """A ``FileSystemWriter`` passed without ``async_stager`` stages with its own copier, which
    cannot copy a shard list (torch's ``LocalShardsWrapper``): the request fails in the caller
    before anything is written, and training goes on (at any world size under a process group;
    without one the averager offers plain tensors, which that copier handles)."""
    engine = build("fsdp2")
    avg = WeightAverager(engine.model, RULES)
    train(engine, avg, range(1, 3))
    folder = root / "writer-stager"
    with harness.expect_raises(NotImplementedError, "LocalShardsWrapper"):
        dcp.async_save(request(engine, avg), storage_writer=dcp.FileSystemWriter(str(folder)), process_group=group)
    assert not folder.exists() or not any(folder.iterdir()), sorted(folder.iterdir())
    train(engine, avg, range(3, 4))
    harness.report("WRITER_STAGER_REFUSED", {})


def _optimizer_state(engine: harness.Engine) -> dict[str, torch.Tensor]:
    """This rank's optimizer tensors (momentum buffers), by parameter and key."""
    _, optimizer = get_state_dict(engine.model, engine.optimizer)
    found = {}
    for name, entry in optimizer["state"].items():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                local = value.to_local() if hasattr(value, "to_local") else value
                found[f"{name}.{key}"] = local.detach().clone()
    return found


def kill(root: Path, group: dist.ProcessGroup) -> None:
    engine = build("fsdp2")
    avg = WeightAverager(engine.model, RULES)
    train(engine, avg, range(1, 4))
    dcp.async_save(request(engine, avg), checkpoint_id=str(root / "step-3"), process_group=group).result()
    reference = snapshot(engine, avg)
    if dist.get_rank() == 0:
        save_file({k: v.clone() for k, v in reference.items()}, str(root / "reference.safetensors"))  # (ties apart)
    dist.barrier()
    train(engine, avg, range(4, 7))
    gate = threading.Event()
    if dist.get_rank() == 0:
        gate.set()  # rank 0 writes its part; rank 1 never does
    future = dcp.async_save(
        request(engine, avg), storage_writer=GatedWriter(root / "step-6", gate),
        async_stager=DefaultStager(STAGERS["default"]), process_group=group,
    )  # fmt: skip
    train(engine, avg, range(7, 8))
    if dist.get_rank() == 1:
        assert not future.done()
        print('SHARDAVG_KILLING {"rank": 1}', flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    future.result()  # rank 0 waits for rank 1's part, until torchrun stops it
    raise AssertionError("the save completed although rank 1 was killed")


def resume(root: Path, group: dist.ProcessGroup) -> None:
    with harness.expect_raises(shardavg.CheckpointError, "step-6"):
        shardavg.check_dcp(root / "step-6")
    shardavg.check_dcp(root / "step-3")
    engine = build("fsdp2")
    avg = WeightAverager(engine.model, RULES)
    state = request(engine, avg)
    dcp.load(state, checkpoint_id=str(root / "step-3"), process_group=group)
    restore(engine, state)
    assert avg.num_updates == 3, avg.num_updates
    assert_equal(full(snapshot(engine, avg)), load_file(str(root / "reference.safetensors")), "step 3 after the kill")
    harness.report("RESUMED", {"world_size": dist.get_world_size()})


def main() -> None:
    modes, root = sys.argv[1].split("+"), Path(sys.argv[2])  # several: in turn, in this launch
    harness.init_distributed()
    group = dist.new_group(backend="gloo")  # the checkpoint's own: its background collectives never meet training's
    for mode in modes:
        {"inflight": inflight, "kill": kill, "resume": resume}[mode](root, group)
    harness.finish()


if __name__ == "__main__":
    main()
