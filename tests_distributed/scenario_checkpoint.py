"""torchrun scenarios for checkpoints and exports.

    torchrun --standalone --nproc_per_node N tests_distributed/scenario_checkpoint.py MODE ENGINES ROOT

ENGINES is a comma-separated list of replicated, fsdp2, fsdp1, zero3 (or "all"); MODE is one of
these, or several joined by "+" and run in turn in one launch (a launch costs more than a mode),
each for every engine:
  save           train, then write avg.save, a DCP checkpoint, two exports and the reference
  load           load every checkpoint under ROOT/saved (any engine, any world size) both ways
  kill           save once, then SIGKILL rank 1 in the middle of the next save
  kill-export    export once (split in files, every rank writing), then SIGKILL rank 1 in the middle
                 of its part of the next export into the same folder
  export-again   export into that folder again
  export-apart   each rank names another export folder: refused on every rank
  resume-first   train k steps, checkpoint model + optimizer + average, go on to 2k: the reference
  resume-second  restore from that checkpoint, train to 2k, compare with the uninterrupted run
  export-memory  export a model of many equal tensors, tracking rank 0's allocations
  concurrent     load again and again (verify=True every tenth time) while another process saves
                 into the checkpoint: every load is one save on every rank
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import harness
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import StateDictType

from shardavg import EMA, SWA, CheckpointError, WeightAverager
from tools.measure import allocated_peak  # (the bench's own measure of peak memory)

STEPS, RESUME_AT = 10, 6


def build(kind: str, use_orig_params: bool | None = None) -> harness.Engine:
    """fp32 engines; FSDP1 alternates use_orig_params with the world size unless told."""
    fp32 = torch.float32
    if use_orig_params is None:
        use_orig_params = dist.get_world_size() % 4 == 0
    return {
        "replicated": lambda: harness.build_ddp(fp32),
        "fsdp2": lambda: harness.build_fsdp2(fp32),
        "fsdp1": lambda: harness.build_fsdp1(fp32, use_orig_params=use_orig_params),
        "zero3": lambda: harness.build_zero3(fp32, 0, via_zero_init=False),
    }[kind]()


RULES = {"ema": EMA(decay=0.9), "swa": SWA()}  # two named averages: every checkpoint carries both


def averager(engine: harness.Engine) -> WeightAverager:
    return WeightAverager(engine.model, RULES)


def train(engine: harness.Engine, avg: WeightAverager, steps: range) -> None:
    """Real optimizer steps, each followed by an update."""
    for step in steps:
        engine.step(step)
        avg.update()


def write_reference(path: Path, avg: WeightAverager) -> None:
    """Collective: the full averages (rank 0 writes them: ``reference.safetensors`` is the EMA) and
    their counters, to compare loads with."""
    for name in RULES:
        state = avg.full_state_dict(name)
        if dist.get_rank() == 0:
            file = "reference.safetensors" if name == "ema" else f"reference-{name}.safetensors"
            save_file({key: tensor.clone() for key, tensor in state.items()}, str(path / file))
    if dist.get_rank() == 0:
        (path / "counters.json").write_text(json.dumps({"step": avg.step, "num_updates": avg.num_updates}))


def assert_equal_state(label: str, got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    if dist.get_rank() != 0:
        assert got == {}, f"{label}: rank {dist.get_rank()} got a state dict"
        return
    assert set(got) == set(want), f"{label}: names differ: {set(got) ^ set(want)}"
    for name, value in want.items():
        assert got[name].dtype == value.dtype and torch.equal(got[name], value), f"{label}: {name} differs"


def save(kind: str, root: Path) -> None:
    engine = build(kind)
    avg = averager(engine)
    train(engine, avg, range(1, STEPS + 1))
    out = root / "saved" / f"{kind}-ws{dist.get_world_size()}"
    avg.save(out / "avg")
    dcp.save({"ema": avg}, checkpoint_id=str(out / "dcp"))
    avg.export(out / "export", average="ema")
    avg.export(out / "export-sharded", max_shard_size=400, average="ema")
    write_reference(out, avg)


def assert_local_shards(label: str, avg: WeightAverager, want: dict[str, torch.Tensor], average: str) -> None:
    """Every rank's stored shard, replicas included, is its part of the reference."""
    for info, shadow in zip(avg.tensors, avg.shadows(average)):
        if shadow is not None:
            expected = info.part.take(want[info.name])
            assert torch.equal(shadow.reshape(-1), expected), f"{label}: rank {dist.get_rank()}'s {info.name}"


def load(kind: str, root: Path) -> None:
    engine = build(kind)  # untrained: every averaged value must come from the checkpoint
    for source in sorted((root / "saved").iterdir()):
        references = {
            name: load_file(
                str(source / ("reference.safetensors" if name == "ema" else f"reference-{name}.safetensors"))
            )
            for name in RULES
        }
        counters = json.loads((source / "counters.json").read_text())
        for how in ("avg", "dcp"):
            avg = averager(engine)
            if how == "avg":
                avg.load(source / "avg", verify=True)  # the ranks share the hashing
            else:
                dcp.load({"ema": avg}, checkpoint_id=str(source / "dcp"))
            assert (avg.step, avg.num_updates) == (counters["step"], counters["num_updates"]), source
            for name, reference in references.items():
                label = f"{source.name} via {how} into {kind}, average {name}"
                assert_local_shards(label, avg, reference, name)
                assert_equal_state(label, avg.full_state_dict(name), reference if dist.get_rank() == 0 else {})
            harness.report(
                "LOADED", {"source": source.name, "how": how, "into": kind, "world_size": dist.get_world_size()}
            )
    refused_on_one_rank(engine)


def refused_on_one_rank(engine: harness.Engine) -> None:
    """A state dict that one rank refuses (through DCP, its entry of another shape, say) makes every
    rank raise with that rank's reason, at once: none waits in the broadcast that follows."""
    avg = averager(engine)
    state, last = avg.state_dict(), dist.get_world_size() - 1
    if dist.get_rank() == last:
        state = {"tensors": state["tensors"]}  # its 'meta' lost
    started = time.monotonic()
    with harness.expect_raises(CheckpointError, "loading the averager's state dict failed", f"rank {last}: "):
        avg.load_state_dict(state)
    waited = time.monotonic() - started
    assert waited < 20, f"the ranks took {waited:.0f} s to agree (the process group's timeout is 120 s)"


def kill_export(kind: str, root: Path) -> None:
    engine = build(kind)
    avg = averager(engine)
    train(engine, avg, range(1, 5))
    avg.export(root / "export", max_shard_size=300, average="ema")
    full = avg.full_state_dict("ema")
    if dist.get_rank() == 0:
        save_file({k: v.clone() for k, v in full.items()}, str(root / "killed-export-reference.safetensors"))
    train(engine, avg, range(5, STEPS + 1))
    if dist.get_rank() == 1:
        import signal

        import shardavg.output.weight_files

        def first_then_sigkill(self, slot, flat, first):  # (every write, held or received, comes here)
            real_write(self, slot, flat, first)
            os.kill(os.getpid(), signal.SIGKILL)

        real_write = shardavg.output.weight_files.Slots.write_elements
        shardavg.output.weight_files.Slots.write_elements = first_then_sigkill
    avg.export(root / "export", max_shard_size=300, average="ema")
    raise AssertionError("rank 1 should have been killed during the export")


def export_apart(kind: str, root: Path) -> None:
    """Each rank names a folder of its own: every rank refuses, before anything is created."""
    engine = build(kind)
    avg = averager(engine)
    train(engine, avg, range(1, 2))
    mine = root / f"apart-{dist.get_rank()}"
    with harness.expect_raises(CheckpointError, "the ranks name different folders"):
        avg.export(mine, average="ema")
    assert not mine.exists(), f"rank {dist.get_rank()} created {mine}"


def export_again(kind: str, root: Path) -> None:
    engine = build(kind)
    avg = averager(engine)
    train(engine, avg, range(1, 3))
    avg.export(root / "export", max_shard_size=300, average="ema")


def kill(kind: str, root: Path) -> None:
    engine = build(kind)
    avg = averager(engine)
    train(engine, avg, range(1, 5))
    avg.save(root / "killed", keep_last=3)
    write_reference(root / "killed", avg)
    train(engine, avg, range(5, STEPS + 1))
    harness.die_while_writing_shards(rank=1)
    avg.save(root / "killed", keep_last=3)
    raise AssertionError("rank 1 should have been killed during the save")


def _save_everything(engine: harness.Engine, avg: WeightAverager, path: Path) -> None:
    """The model and optimizer through the engine's own checkpointing, the average beside them.

    (DCP keeps one arbitrary replica of a buffer that differs between ranks, so the resume
    scenarios give every rank the same data: BatchNorm statistics then agree everywhere.)
    """
    if engine.deepspeed_engine is not None:
        engine.deepspeed_engine.save_checkpoint(str(path), tag="resume")
        avg.save(path / "ema")
    elif isinstance(engine.model, FSDP):  # FSDP1's own sharded state dicts (its DCP recipe)
        with FSDP.state_dict_type(engine.model, StateDictType.SHARDED_STATE_DICT):
            optim_state = FSDP.optim_state_dict(engine.model, engine.optimizer)
            dcp.save({"model": engine.model.state_dict(), "optim": optim_state, "ema": avg}, checkpoint_id=str(path))
    else:
        model_state, optim_state = get_state_dict(engine.model, engine.optimizer)
        dcp.save({"model": model_state, "optim": optim_state, "ema": avg}, checkpoint_id=str(path))


def _load_everything(engine: harness.Engine, avg: WeightAverager, path: Path) -> None:
    if engine.deepspeed_engine is not None:
        engine.deepspeed_engine.load_checkpoint(str(path), tag="resume")
        avg.load(path / "ema")
    elif isinstance(engine.model, FSDP):
        from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict

        with FSDP.state_dict_type(engine.model, StateDictType.SHARDED_STATE_DICT):
            state = {"model": engine.model.state_dict(), "ema": avg}
            dcp.load(state, checkpoint_id=str(path))
            engine.model.load_state_dict(state["model"])
            optim_state = load_sharded_optimizer_state_dict(state["model"], "optim", dcp.FileSystemReader(str(path)))
            engine.optimizer.load_state_dict(
                FSDP.optim_state_dict_to_load(engine.model, engine.optimizer, optim_state["optim"])
            )
    else:
        model_state, optim_state = get_state_dict(engine.model, engine.optimizer)
        state = {"model": model_state, "optim": optim_state, "ema": avg}
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(engine.model, engine.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def resume_first(kind: str, root: Path) -> None:
    engine = build(kind, use_orig_params=True)
    avg = averager(engine)
    out = root / "resume" / f"{kind}-ws{dist.get_world_size()}"
    train(engine, avg, range(1, RESUME_AT + 1))
    _save_everything(engine, avg, out / "checkpoint")
    train(engine, avg, range(RESUME_AT + 1, 2 * RESUME_AT + 1))
    write_reference(out, avg)


def resume_second(kind: str, root: Path) -> None:
    engine = build(kind, use_orig_params=True)
    avg = averager(engine)
    out = root / "resume" / f"{kind}-ws{dist.get_world_size()}"
    _load_everything(engine, avg, out / "checkpoint")
    assert (avg.step, avg.num_updates) == (RESUME_AT, RESUME_AT), (avg.step, avg.num_updates)
    train(engine, avg, range(RESUME_AT + 1, 2 * RESUME_AT + 1))
    for name in RULES:
        file = out / ("reference.safetensors" if name == "ema" else f"reference-{name}.safetensors")
        want = load_file(str(file)) if dist.get_rank() == 0 else {}
        assert_equal_state(f"{kind} resumed at step {RESUME_AT}, average {name}", avg.full_state_dict(name), want)
    harness.report("RESUMED", {"engine": kind, "world_size": dist.get_world_size()})


class ManyTensors(nn.Module):
    """48 equal 256 KiB tensors: 12 MiB in all, far above the export's gather bound."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ParameterList(nn.Parameter(torch.randn(64, 1024)) for _ in range(48))


def export_memory(kind: str, root: Path) -> None:
    """Rank 0 holds at most one gather bucket (or the largest tensor, if larger), never the model."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = ManyTensors()
    if kind == "fsdp2":
        fully_shard(model)
    avg = WeightAverager(model, EMA(decay=0.9))
    avg.update()
    largest, model_bytes = 64 * 1024 * 4, 48 * 64 * 1024 * 4
    bookkeeping = 4096  # a few small tensors (gloo's, the profiler's)
    for bucket in (2**20, 1):  # four tensors per gather, or one
        avg.gather_bucket_bytes = bucket
        peak = allocated_peak(lambda: avg.export(root / "big-export"))
        if dist.get_rank() == 0:  # the export gathers onto rank 0
            harness.report(
                "EXPORT_PEAK",
                {
                    "engine": kind,
                    "world_size": dist.get_world_size(),
                    "peak_bytes": peak,
                    "model_bytes": model_bytes,
                    "largest_tensor_bytes": largest,
                    "bucket_bytes": bucket,
                },
            )
            bound = max(bucket, largest) + bookkeeping
            assert peak <= bound, f"rank 0 held {peak} bytes exporting a {model_bytes}-byte model (bound {bound})"
            written = load_file(str(root / "big-export" / "model.safetensors"))
            assert sorted(written) == sorted(f"blocks.{i}" for i in range(48))


def concurrent(kind: str, root: Path) -> None:
    import subprocess

    from concurrent_saves import OPTIONS, Reference

    engine = build(kind)
    avg = WeightAverager(engine.model, SWA(), **OPTIONS)
    target, stop, writer = root / f"concurrent-{kind}", root / f"stop-{kind}", None
    if dist.get_rank() == 0:
        script = Path(__file__).with_name("concurrent_saves.py")
        writer = subprocess.Popen(
            [sys.executable, str(script), str(target), str(stop), "single", "0.005"], stdout=subprocess.PIPE
        )
        assert writer.stdout.readline().strip() == b"saved"
    dist.barrier()
    reference, seen = Reference(), set()  # (built, and advanced, on every rank: it is collective)
    for attempt in range(LOADS):
        avg.load(target, verify=attempt % 10 == 0)
        counts = [None] * dist.get_world_size()
        dist.all_gather_object(counts, (avg.step, avg.num_updates))
        assert len(set(counts)) == 1, f"ranks loaded different saves: {counts}"
        state, want = avg.full_state_dict(), reference(avg.num_updates)
        if dist.get_rank() == 0:
            torn = [name for name in want if not torch.equal(state[name], want[name])]
            assert not torn, f"load {attempt}: {torn} are not save {avg.num_updates}'s"
        seen.add(avg.num_updates)
    if writer is not None:
        stop.touch()
        assert writer.wait(timeout=60) == 0
        assert len(seen) > 10, f"only {len(seen)} saves seen: the writer was not saving throughout"
        harness.report("CONCURRENT", {"engine": kind, "loads": LOADS, "saves_seen": len(seen)})


LOADS = 80
ENGINES = ("replicated", "fsdp2", "fsdp1", "zero3")


@record
def main() -> None:
    modes, kinds, root = sys.argv[1].split("+"), sys.argv[2], Path(sys.argv[3])
    kinds = ENGINES if kinds == "all" else tuple(kinds.split(","))
    harness.init_distributed(deepspeed="zero3" in kinds)
    runs = {
        "save": save,
        "load": load,
        "kill": kill,
        "kill-export": kill_export,
        "export-again": export_again,
        "export-apart": export_apart,
        "resume-first": resume_first,
        "resume-second": resume_second,
        "export-memory": export_memory,
        "concurrent": concurrent,
    }
    for mode in modes:
        harness.SAME_DATA_ON_EVERY_RANK = mode.startswith("resume")
        for kind in kinds:
            runs[mode](kind, root)
            dist.barrier()
            harness.report("DONE", {"mode": mode, "engine": kind, "world_size": dist.get_world_size()})
    harness.finish()


if __name__ == "__main__":
    main()
