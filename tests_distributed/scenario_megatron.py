"""torchrun scenario: Megatron-Core GPT models averaged live, at several parallel layouts in one launch.

    torchrun --standalone --nproc_per_node N tests_distributed/scenario_megatron.py OUT LAYOUT [LAYOUT ...]

Each LAYOUT is ``tp<T>-pp<P>[-vp<V>]`` (data parallel takes the other ranks). For each, a GPT
(tied embeddings, Megatron-LM's default; SwiGLU, whose fused fc1 Megatron describes by a
factory: its halves split over TP) built with Megatron's own layers on CPU
(``megatron_harness.py``: the test-only shims) trains a few torch-AdamW steps, ``avg.update()``
after each, and:

- detection picks the Megatron adapter, every layout is derived (nothing gathered), and the
  replicated strategy forced on it is refused where it holds tensor-parallel slices;
- ``update()`` issues no collective;
- the reference is not shardavg: each step, every rank's slices are placed at their
  ``global_offset`` (Megatron's own description, ``megatron_harness.assembled``), then lerped in
  fp32 as ``get_ema_multi_avg_fn`` does (``harness.PlainAverage``); inside ``avg.swapped()`` the
  live model, assembled the same way on every rank, is that reference bitwise;
- ``avg.export``, ``avg.full_state_dict``, ``avg.save``, and Megatron's ``dist_checkpointing.save``
  of ``avg.sharded_state_dict("ema.")`` beside the model and of ``avg.sharded_state_dict("")``
  alone are written, and each layout after the first loads the previous layout's ``avg.save``
  and ``"ema."`` checkpoint (a reshard between sharded layouts): equal to that layout's reference.

Then at TP1/PP1 (every rank a data-parallel replica) a fresh GPT checks every layout's outputs:
the export read by a plain safetensors reader and ``full_state_dict`` load into the model (only
``_extra_state`` objects missing), ``dist_checkpointing.load(model.sharded_state_dict())`` reads
the ``""`` checkpoint, a TP1 averager ``load``s the ``avg.save`` and the ``"ema."`` checkpoint
(counters too): each equals the reference, compared through Megatron's own keys and offsets.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

import harness
import megatron_harness as mh
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from safetensors.torch import load_file
from torch.distributed.elastic.multiprocessing.errors import record

import shardavg
from shardavg import EMA, StrategyError, WeightAverager

LAYERS, STEPS, DECAY = 4, 4, 0.75
Reference = dict[tuple[str, tuple[int, ...]], torch.Tensor]


@dataclass
class Outputs:
    """What one layout wrote, and its reference."""

    label: str
    reference: Reference
    full: dict[str, torch.Tensor]  # full_state_dict() on rank 0
    folder: Path


def parse(text: str) -> mh.Layout:
    found = re.fullmatch(r"tp(\d+)-pp(\d+)(?:-vp(\d+))?", text)
    assert found, text
    return mh.Layout(int(found[1]), int(found[2]), int(found[3]) if found[3] else None)


def model_state(chunks: list) -> dict:
    """The model's sharded state dict as Megatron-LM nests it (``model``, or ``model0``... per chunk)."""
    if len(chunks) == 1:
        return chunks[0].sharded_state_dict()
    return {f"model{i}": chunk.sharded_state_dict() for i, chunk in enumerate(chunks)}


def assert_equal(got: Reference, want: Reference, what: str) -> None:
    assert got.keys() == want.keys(), f"{what}: keys differ: {sorted(got.keys() ^ want.keys())[:6]}"
    for key, value in want.items():
        assert torch.equal(got[key].float(), value), f"{what}: {key} differs from the reference"


def megatron_save(state: dict, folder: Path) -> None:
    if dist.get_rank() == 0:
        folder.mkdir(parents=True)
    dist.barrier()
    dist_checkpointing.save(state, str(folder))


def averaged_reference(chunks: list, averager: WeightAverager, optimizer) -> Reference:
    """Train ``STEPS`` steps, updating the averager after each (no collective), and the reference alongside."""
    plain = harness.PlainAverage(lambda num_updates: 1 - DECAY)
    for step in range(STEPS):
        mh.train_step(chunks, optimizer, step)
        with harness.CollectiveCount() as count:
            assert averager.update()
        assert count.count == 0, f"update() issued {count.names}"
        live = mh.assembled(chunks)
        plain.update(step, live, frozen=set(), buffers=set())
    return plain.state


def run(layout: mh.Layout, out: Path, previous: Outputs | None) -> Outputs:
    chunks = mh.build(layout, LAYERS)
    label = layout.label
    optimizer = mh.optimizer(chunks)
    model = chunks if len(chunks) > 1 else chunks[0]
    assert shardavg.detect(chunks[0]) == "megatron"
    if layout.tp > 1:  # the replicated strategy still refuses Megatron's slices
        with harness.expect_raises(StrategyError, "is a tensor-parallel slice", "tensor_model_parallel"):
            WeightAverager(chunks[0], strategy="replicated")
    averager = WeightAverager(model, EMA(decay=DECAY))
    assert averager.strategy.name == "megatron"
    harness.check_derived_layout(averager)  # every rank's part of every tensor derived, none gathered
    reference = averaged_reference(chunks, averager, optimizer)
    live = mh.assembled(chunks)
    with averager.swapped():  # every rank evaluates the average: its own slices, replicas included
        assert_equal(mh.assembled(chunks), reference, f"{label}: swapped()")
    assert_equal(mh.assembled(chunks), live, f"{label}: the live weights back after swapped()")

    folder = out / label
    full = averager.full_state_dict()
    averager.export(folder / "export")
    averager.save(folder / "saved")
    megatron_save({**model_state(chunks), **averager.sharded_state_dict(prefix="ema.")}, folder / "with-model")
    megatron_save(averager.sharded_state_dict(prefix=""), folder / "average")

    if previous is not None:  # the previous layout's average, resharded to this one
        fresh = WeightAverager(model, EMA(decay=DECAY))
        fresh.load(previous.folder / "saved")
        with fresh.swapped():
            assert_equal(mh.assembled(chunks), previous.reference, f"{previous.label} saved, loaded at {label}")
        fresh = WeightAverager(model, EMA(decay=DECAY))
        template = {**model_state(chunks), **fresh.sharded_state_dict(prefix="ema.")}
        fresh.load_sharded_state_dict(dist_checkpointing.load(template, str(previous.folder / "with-model")))
        assert fresh.num_updates == STEPS
        with fresh.swapped():
            assert_equal(mh.assembled(chunks), previous.reference, f"{previous.label} 'ema.', loaded at {label}")
    harness.report("LAYOUT", {"layout": label, "tensors": len(averager.tensors)})
    return Outputs(label, reference, full, folder)


def loaded_into(model, state: dict[str, torch.Tensor], what: str) -> None:
    """Load a plain state dict into the TP1 model: every tensor name its own, only ``_extra_state`` left out."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected, f"{what}: names the full model does not have: {unexpected}"
    assert all(name.endswith("._extra_state") for name in missing), f"{what}: missing {missing}"


def check_at_tp1(outputs: list[Outputs]) -> None:
    """Every layout's outputs read at TP1/PP1, against its reference."""
    (model,) = mh.build(mh.Layout(), LAYERS, seed=1)
    for written in outputs:
        folder, label = written.folder, written.label
        files = sorted((folder / "export").glob("*.safetensors"))
        loaded_into(model, {k: v for file in files for k, v in load_file(str(file)).items()}, f"{label} export")
        assert_equal(mh.by_key([model]), written.reference, f"{label}: the export")
        if dist.get_rank() == 0:
            loaded_into(model, written.full, f"{label} full_state_dict()")
            assert_equal(mh.by_key([model]), written.reference, f"{label}: full_state_dict()")
        loaded = dist_checkpointing.load(model.sharded_state_dict(), str(folder / "average"))
        loaded_into(model, loaded, f"{label} sharded_state_dict(prefix='')")
        assert_equal(mh.by_key([model]), written.reference, f"{label}: Megatron's load of the average")
        averager = WeightAverager(model, EMA(decay=DECAY))
        averager.load(folder / "saved")
        with averager.swapped():
            assert_equal(mh.by_key([model]), written.reference, f"{label}: avg.save, loaded at TP1")
        averager = WeightAverager(model, EMA(decay=DECAY))
        template = {**model.sharded_state_dict(), **averager.sharded_state_dict(prefix="ema.")}
        averager.load_sharded_state_dict(dist_checkpointing.load(template, str(folder / "with-model")))
        assert (averager.num_updates, averager.step) == (STEPS, STEPS)
        with averager.swapped():
            assert_equal(mh.by_key([model]), written.reference, f"{label}: 'ema.' beside the model, loaded at TP1")
        harness.report("TP1", {"layout": label})


@record
def main() -> None:
    out = Path(sys.argv[1])
    harness.init_distributed()
    mh.checkpoint_shims()
    assert len(sys.argv) > 2, "name the layouts"
    outputs: list[Outputs] = []
    for text in sys.argv[2:]:
        outputs.append(run(parse(text), out, outputs[-1] if outputs else None))
    check_at_tp1(outputs)
    harness.finish()


if __name__ == "__main__":
    main()
