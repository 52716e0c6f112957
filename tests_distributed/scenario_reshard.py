"""torchrun scenario: one checkpoint across every layout, bitwise.

    torchrun --standalone --nproc_per_node N tests_distributed/scenario_reshard.py MODE ROOT

MODE ``train`` (4 ranks): TP 2 x FSDP 2 trains ``LayerNet`` with an averager keeping two named
averages and a ``PostHocEMA`` (snapshots under ROOT/posthoc-fsdp2_tp), and so does a pipeline
of 2 stages x FSDP 2 (ROOT/posthoc-pp); rank 0 writes the references (each average's full
state dict, and each post-hoc synthesis exported in process); both averages are saved with
``avg.save`` and through DCP under ROOT/saved and ROOT/dcp; then it loads, as MODE ``load``
(any world size) does:
every layout this world size holds (FSDP2, ZeRO-3, DDP, TP, FSDP2 + TP, HSDP + TP, pipeline
stages) builds the untrained model, loads every checkpoint found there, checks that every
rank's part of every average is bitwise its part of the reference, and saves its own, which
the next launch loads in turn: TP 2 x FSDP 2 -> FSDP2 at 4, 2 and 1 -> ZeRO-3 at 2 -> DDP ->
PP 2 x DP 2 -> back to TP 2 x FSDP 2, each loading all the others' checkpoints on the way.
"""

from __future__ import annotations

import sys
from pathlib import Path

import harness
import layouts
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.elastic.multiprocessing.errors import record

from shardavg import EMA, SWA, PostHocEMA, WeightAverager

RULES = {"ema": EMA(decay=0.9), "swa": SWA()}
STEPS, SIGMA_REL = 12, 0.08


def layout_builders(world: int) -> dict:
    fp32 = torch.float32
    found = {f"fsdp2-{world}": lambda: layouts.build_fsdp2(fp32), f"ddp-{world}": lambda: layouts.build_ddp(fp32)}
    if world == 2:
        found |= {"zero3-2": lambda: layouts.build_zero3(fp32), "tp-2": lambda: layouts.build_tp(fp32)}
    if world == 4:
        found |= {
            "fsdp2_tp-4": lambda: layouts.build_tp(fp32, (2,), fsdp=True),
            "hsdp_tp-4": lambda: layouts.build_tp(fp32, (1, 2), fsdp=True),
        }
    if world in (2, 4):
        found[f"pp-{world}"] = lambda: layouts.Pipelined(fp32)
    return found


def averager_for(built, rules) -> WeightAverager:
    if isinstance(built, layouts.Pipelined):
        return WeightAverager(built.module, rules, pipeline=built.group)
    return WeightAverager(built.model, rules)


def save_both(avg: WeightAverager, root: Path, label: str) -> None:
    avg.save(root / "saved" / label)
    dcp.save({"avg": avg}, checkpoint_id=str(root / "dcp" / label))


def train(root: Path) -> None:
    for label in ("fsdp2_tp-4", "pp-4"):
        built = layout_builders(4)[label]()
        engine = built.engine() if isinstance(built, layouts.Pipelined) else built
        avg = averager_for(built, RULES)
        extra = {"pipeline": built.group} if isinstance(built, layouts.Pipelined) else {}
        posthoc = PostHocEMA(engine.model, snapshot_every=3, directory=root / f"posthoc-{label}", **extra)
        for step in range(1, STEPS + 1):
            engine.step(step)
            avg.update()
            posthoc.update()
        synthesized = posthoc.synthesize(SIGMA_REL)
        synthesized.export(root / f"posthoc-{label}-in-process")
        references = {name: avg.full_state_dict(name) for name in RULES}
        if dist.get_rank() == 0:
            for name, state in references.items():
                save_file(
                    {k: v.contiguous() for k, v in state.items()}, str(root / f"reference-{label}-{name}.safetensors")
                )
        save_both(avg, root, label)
        dist.barrier()


def check_loaded(label: str, avg: WeightAverager, reference: dict[str, dict[str, torch.Tensor]]) -> None:
    """Every rank's part of every average is its part of the reference; rank 0's gather too."""
    for name in RULES:
        for info, shadow in zip(avg.tensors, avg.shadows(name)):
            if shadow is not None and avg.options.role(info) == "average":
                want = info.part.take(reference[name][info.name])
                assert torch.equal(shadow.reshape(-1), want), f"{label}: rank {dist.get_rank()}'s {name}/{info.name}"
        got = avg.full_state_dict(name)
        if dist.get_rank() == 0:
            assert set(got) == set(reference[name]), f"{label}: {set(got) ^ set(reference[name])}"
            for key, value in reference[name].items():
                assert torch.equal(got[key], value), f"{label}: {name}/{key} differs after the load"


def load(root: Path) -> None:
    world = dist.get_world_size()
    references = {}  # the same average whichever run wrote it: each checkpoint names its own
    for path in sorted(root.glob("reference-*-ema.safetensors")):
        source = path.name[len("reference-") : -len("-ema.safetensors")]
        references[source] = {name: load_file(str(root / f"reference-{source}-{name}.safetensors")) for name in RULES}
    loads = 0
    for label, build in layout_builders(world).items():
        built = build()
        avg = averager_for(built, RULES)
        for kind in ("saved", "dcp"):
            for checkpoint in sorted((root / kind).iterdir()):
                source = origin(root, checkpoint.name)
                if kind == "saved":
                    avg.load(checkpoint)
                else:
                    state = {"avg": avg.state_dict()}
                    dcp.load(state, checkpoint_id=str(checkpoint))
                    avg.load_state_dict(state["avg"])
                assert (avg.num_updates, avg.step) == (STEPS, STEPS), (label, checkpoint, avg.num_updates)
                check_loaded(f"{label} from {kind}/{checkpoint.name}", avg, references[source])
                loads += 1
        if not (root / "saved" / label).exists():
            avg.load(root / "saved" / "fsdp2_tp-4")  # what this layout saves: the first run's averages
            save_both(avg, root, label)
            write_origin(root, label, "fsdp2_tp-4")
        dist.barrier()
    harness.report("RESHARDED", {"world_size": world, "loads": loads, "layouts": sorted(layout_builders(world))})


def origin(root: Path, label: str) -> str:
    """Which training run a checkpoint holds the averages of (one written here carries its source's)."""
    marker = root / "origin" / label
    return marker.read_text() if marker.exists() else label


def write_origin(root: Path, label: str, source: str) -> None:
    if dist.get_rank() == 0:
        (root / "origin").mkdir(exist_ok=True)
        (root / "origin" / label).write_text(origin(root, source))


@record
def main() -> None:
    mode, root = sys.argv[1], Path(sys.argv[2])
    harness.init_distributed(deepspeed=True)
    if mode == "train":
        train(root)
    load(root)
    harness.report("DONE", {"mode": mode, "world_size": dist.get_world_size()})
    harness.finish()


if __name__ == "__main__":
    main()
