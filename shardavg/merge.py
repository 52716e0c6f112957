"""``shardavg merge``: a weighted average of checkpoints already on disk, streamed tensor by tensor.

The average of the last few checkpoints of a run (LAWA, OLMo's final models), a model soup, or
an EMA over saved steps, computed in one process from checkpoints of any kind ``sources.py``
reads, written at any world size. Every input is opened and checked first (names, shapes,
dtypes, every file's place), and the target too: a refusal writes nothing. Then each tensor is
accumulated in fp32 (or fp64) from one input at a time, ``sum(w_i * x_i)`` in input order, cast
and streamed to disk, so memory holds the accumulator, one input's tensor and the writer's
piece, whatever the number of inputs. Integer tensors (counters) are not averaged: they come
from the last input (with ``last=K``, the newest). The output is a Hugging Face safetensors
model (``model.safetensors``, or shards and an index) or an averager's checkpoint that
``avg.load`` restores at any world size.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Literal

import torch

from . import validate
from .checkpoint import save_whole
from .errors import CheckpointError
from .export import cast_dtype, parse_size, write_model
from .format import FORMAT, VERSION
from .ownership import LOCK_FILE, enclosing_checkpoint, export_files
from .rules import SWA
from .sources import Source, Spec, finished_checkpoints, open_source
from .storage import Entry, atomic_file, dtype_name

Output = Literal["safetensors", "shardavg"]
HF_CONFIGS = ("config.json", "generation_config.json")  # copied from a Hugging Face input, for from_pretrained


def merge(
    inputs: Sequence[str | os.PathLike] | str | os.PathLike,
    out: str | os.PathLike,
    *,
    weights: Sequence[float] | None = None,
    last: int | None = None,
    ema: float | None = None,
    key: str | None = None,
    average: str | None = None,
    prefix: str = "model.",
    dtype: torch.dtype | None = None,
    accumulate: torch.dtype = torch.float32,
    max_shard_size: int | str = "5GB",
    output: Output = "safetensors",
) -> Path:
    """Write the weighted average of the checkpoints ``inputs`` to ``out``; returns ``out``.

    Args:
        inputs: checkpoints (see ``sources.open_source``), or with ``last`` one run folder.
        weights: one per input, normalised to sum to 1 (default: uniform).
        last: take the newest ``last`` finished checkpoints of the run folder ``inputs``, by step.
        ema: weight the checkpoint of step ``s`` by ``ema ** (s_newest - s)``, normalised: what an
            EMA of that decay per step gives each saved step, relative to the others.
        key: an averager's key in DCP checkpoints (else their tensors under ``prefix`` are merged).
        average: which average of a shardavg checkpoint that keeps several.
        prefix: a DCP checkpoint's tensors to merge, named without it.
        dtype: the floating tensors' output dtype (default: the inputs' when they agree, else fp32).
        accumulate: ``torch.float32`` or ``torch.float64``.
        max_shard_size: the largest output file before the model is split (``"5GB"``, or bytes).
        output: ``"safetensors"`` (a model folder) or ``"shardavg"`` (an averager's checkpoint).
    """
    validate.floating_dtype("dtype", dtype)
    validate.choice("accumulate", accumulate, (torch.float32, torch.float64))
    validate.choice("output", output, ("safetensors", "shardavg"))
    max_bytes = parse_size(max_shard_size)
    paths = _inputs(inputs, last)
    _check_out(out, paths, output)
    sources: list[Source] = []
    try:
        for path in paths:
            sources.append(open_source(path, key=key, average=average, prefix=prefix))
        for source in sources:
            source.check()
        specs = _agreed_specs(sources)
        shares = _weights(sources, weights, ema)
        out_specs = {name: _output_spec(name, sources, dtype) for name in specs}
        stream = _merged(sources, shares, out_specs, accumulate)
        if output == "shardavg":
            return save_whole(out, _description(sources, shares, out_specs), stream)
        metadata = {"format": "pt", "shardavg": json.dumps(_record(sources, shares))}
        entries = [Entry(name, spec.dtype, spec.shape) for name, spec in out_specs.items()]
        written = write_model(out, entries, stream, metadata, max_bytes)
        _copy_configs(sources, written)
        return written
    finally:
        for source in sources:
            source.close()


def _inputs(inputs: Sequence[str | os.PathLike] | str | os.PathLike, last: int | None) -> list[Path]:
    """The checkpoints to merge: the given ones, or the newest ``last`` of a run folder, oldest first."""
    given = [Path(inputs)] if isinstance(inputs, (str, os.PathLike)) else [Path(p) for p in inputs]
    if any(not os.fspath(p) for p in given):
        raise ValueError("an input path is empty: name a checkpoint")
    if last is not None:
        validate.count("last", last, 1)
        if len(given) != 1:
            raise ValueError(f"last={last} picks checkpoints from one run folder; got {len(given)} inputs")
        found = finished_checkpoints(given[0])
        if len(found) < last:
            steps = [step for step, _ in found]
            raise CheckpointError(
                f"{given[0]} holds {len(found)} finished checkpoints (steps {steps}), fewer than last={last}"
            )
        return [path for _, path in found[-last:]]
    if not given:
        raise ValueError("no checkpoint to merge: name at least one")
    resolved = [p.resolve() for p in given]
    twice = sorted({str(p) for p in given if resolved.count(p.resolve()) > 1})
    if twice:
        raise ValueError(f"{twice} given more than once: weight an input with weights= instead")
    return given


def _check_out(out: str | os.PathLike, inputs: list[Path], output: Output) -> None:
    """OUT names a folder of its own: not an input, inside one, or holding one (which its writing
    could replace), nor inside any checkpoint; new, empty, or holding nothing but an earlier
    merge (or export) of shardavg's in the same format, which it replaces."""
    if not os.fspath(out):
        raise ValueError("OUT is empty: name the folder to write the merged model into")
    target = Path(out).resolve()
    for path in inputs:
        source = path.resolve()
        if target == source or source in target.parents or target in source.parents:
            raise CheckpointError(f"OUT {out} and the input {path} lie one inside the other: write to a folder apart")
    enclosing = enclosing_checkpoint(Path(out).parent)
    if enclosing is not None:
        raise CheckpointError(f"OUT {out} is inside the checkpoint {enclosing}: write to a folder of its own")
    if output == "safetensors" and enclosing_checkpoint(Path(out)) is not None:  # (an averager checkpoint is
        raise CheckpointError(f"OUT {out} is a checkpoint: name a model folder of its own")  # replaced only by one)
    if output == "safetensors" and Path(out).is_dir() and not Path(out).is_symlink():
        own = {name for name, ours in export_files(Path(out)).items() if ours}
        others = sorted(p.name for p in Path(out).iterdir() if p.name not in own | {*HF_CONFIGS, LOCK_FILE})
        if others:
            raise CheckpointError(
                f"OUT {out} holds files a merge did not write ({', '.join(others[:8])}"
                f"{f', ... {len(others) - 8} more' if len(others) > 8 else ''}): name a new or empty folder"
            )


def _agreed_specs(sources: list[Source]) -> dict[str, Spec]:
    """The first input's tensors, which every other input must hold too, in the same shapes (and
    for integer tensors the same dtype; floating ones may differ, like a bf16 model and fp32 averages)."""
    first = sources[0]
    for source in sources[1:]:
        missing = sorted(set(first.specs) - set(source.specs))
        unexpected = sorted(set(source.specs) - set(first.specs))
        wrong = sorted(
            f"{name}: {source.specs[name]} vs {spec}"
            for name, spec in first.specs.items()
            if name in source.specs and not _compatible(spec, source.specs[name])
        )
        if missing or unexpected or wrong:
            raise CheckpointError(
                f"{source} does not match {first}: missing {_some(missing)}, unexpected {_some(unexpected)}, "
                f"mis-shaped or of another dtype {_some(wrong)}"
            )
    return first.specs


def _compatible(a: Spec, b: Spec) -> bool:
    if a.shape != b.shape or a.dtype.is_floating_point != b.dtype.is_floating_point:
        return False
    return a.dtype.is_floating_point or a.dtype == b.dtype


def _some(names: list[str]) -> str:
    return str(names[:8])[:-1] + (f", ... {len(names) - 8} more]" if len(names) > 8 else "]")


def _weights(sources: list[Source], weights: Sequence[float] | None, ema: float | None) -> list[float]:
    """Each input's share, summing to 1."""
    count = len(sources)
    if weights is not None and ema is not None:
        raise ValueError("weights and ema both give the inputs' weights: pass one")
    if ema is not None:
        if isinstance(ema, bool) or not isinstance(ema, (int, float)) or not 0.0 < ema < 1.0:
            raise ValueError(f"ema must be a decay in (0, 1), got {ema!r}")
        unknown = [str(s) for s in sources if s.step is None]
        if unknown:
            raise CheckpointError(f"ema weights need each input's step; these record none: {unknown}")
        newest = max(s.step for s in sources)  # type: ignore[type-var]
        weights = [ema ** (newest - s.step) for s in sources]  # type: ignore[operator]
    if weights is None:
        return [1.0 / count] * count
    weights = list(weights)
    if len(weights) != count:
        raise ValueError(f"{len(weights)} weights for {count} inputs: give one per input")
    numbers = (isinstance(w, (int, float)) and not isinstance(w, bool) for w in weights)
    if not all(numbers) or not all(math.isfinite(w) and w >= 0 for w in weights):
        raise ValueError(f"weights must be finite numbers >= 0, got {weights}")
    total = math.fsum(weights)
    if not total > 0:
        raise ValueError(f"weights {weights} sum to {total}: at least one must be positive")
    return [w / total for w in weights]


def _output_spec(name: str, sources: list[Source], dtype: torch.dtype | None) -> Spec:
    """The merged tensor's dtype: ``dtype`` for floating tensors, else the inputs' when they agree,
    else fp32; integer tensors keep theirs."""
    found = {source.specs[name].dtype for source in sources}
    first = sources[0].specs[name]
    if not first.dtype.is_floating_point or dtype is not None:
        return Spec(cast_dtype(first.dtype, dtype), first.shape)
    return Spec(found.pop() if len(found) == 1 else torch.float32, first.shape)


def _merged(
    sources: list[Source], shares: list[float], specs: dict[str, Spec], accumulate: torch.dtype
) -> Iterator[torch.Tensor]:
    """Each merged tensor in turn: ``sum(w_i * x_i)`` accumulated in input order, then cast."""
    for name, spec in specs.items():
        if not spec.dtype.is_floating_point:
            yield sources[-1].read(name)
            continue
        total = torch.zeros(spec.shape, dtype=accumulate)
        for source, share in zip(sources, shares):
            total.add_(source.read(name).to(accumulate).mul_(share))
        yield total.to(spec.dtype)
        del total


def _record(sources: list[Source], shares: list[float]) -> dict:
    """What the output says of its making: the inputs, their steps and weights."""
    steps = [s.step for s in sources]
    newest = max((s for s in steps if s is not None), default=None)
    return {"merge": [{"input": str(s), "step": s.step, "weight": w} for s, w in zip(sources, shares)], "step": newest}


def _description(sources: list[Source], shares: list[float], specs: dict[str, Spec]) -> dict:
    """The merge as an averager's description: one average of ``len(sources)`` updates, by SWA's
    rule when the weights are equal (it is then their SWA), else a custom rule named ``merge``;
    each tensor's kind and role as an averager's input records them (else a floating tensor is
    an averaged parameter, an integer one a copy)."""
    uniform = max(shares) - min(shares) <= 1e-12 * max(shares)
    record = _record(sources, shares)
    described = next((s.described for s in sources if s.described), {})  # an averager's checkpoint's roles

    def kind_and_role(name: str, spec: Spec) -> tuple[str, str]:
        return described.get(name, ("param", "average" if spec.dtype.is_floating_point else "copy"))

    return {
        "format": FORMAT,
        "version": VERSION,
        "step": record["step"] or 0,
        "num_updates": len(sources),
        "num_skipped": 0,
        "averages": [{"name": None, "rule": SWA().to_config() if uniform else {"kind": "custom", "name": "merge"}}],
        "strategy": "replicated",
        "world_size": 1,
        "options": {"every_n_steps": 1, "start_step": 0, "dtype": None, "buffers": "copy", "include_frozen": False},
        "tensors": [
            {
                "name": name,
                "aliases": [],
                "kind": kind_and_role(name, spec)[0],
                "role": kind_and_role(name, spec)[1],
                "shape": list(spec.shape),
                "dtype": dtype_name(spec.dtype),
            }
            for name, spec in specs.items()
        ],
    }


def _copy_configs(sources: list[Source], out: Path) -> None:
    """A Hugging Face model's ``config.json`` (and generation config) from the newest input that has
    one, so that ``from_pretrained`` loads the merge; it replaces the one an earlier merge there
    copied (a model of another shape would otherwise load with a stale config)."""
    for name in HF_CONFIGS:
        found = [s.path / name for s in sources if s.path.is_dir() and (s.path / name).is_file()]
        if found:
            with atomic_file(out / name) as handle:
                handle.write(found[-1].read_bytes())
