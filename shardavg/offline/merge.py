"""``shardavg merge``: a weighted average of checkpoints already on disk, streamed tensor by tensor.

The average of the last few checkpoints of a run (LAWA, OLMo's final models), a model soup, or
an EMA over saved steps, computed in one process from checkpoints of any kind ``sources.py``
reads, written at any world size. Every input is opened and checked first (names, shapes,
dtypes, every file's place), and the target too: a refusal writes nothing. Then each tensor is
accumulated in fp32 (or fp64) from one input at a time, ``sum(w_i * x_i)`` in input order, cast
and streamed to disk, so memory holds the accumulator, one input's tensor and the writer's
piece, whatever the number of inputs. Integer tensors (counters) are not averaged: they come
from the last input (with ``last=K``, the newest). The output is a Hugging Face safetensors
model (``model.safetensors``, or shards and an index), an averager's checkpoint that
``avg.load`` restores at any world size, or a ``torch.distributed.checkpoint`` folder under the
inputs' own keys that the trainers that wrote them load back (``output.dcp_checkpoint``; from
Megatron-Core inputs, in a Megatron-LM run folder: ``output.megatron_run``). An averager saved
beside a Megatron-Core model (``megatron.Averager``) is no part of a merge of the models: left out by
name, and carried unchanged from the newest input into a DCP output, as its ``*._extra_state`` is;
``key`` merges its averages instead, as a model.

The merge plans, then writes. Each input's share comes from a method (``methods``: uniform,
weights, an EMA over steps, WSM's schedules), the tensors and their names from ``merge_names``;
both go into a ``MergePlan``, plain data the same on every writer, which the three writers
(``Folder``, ``_write_checkpoint``, ``_write_dcp``) consume through ``Merging``, which reads and
accumulates each piece of it.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import math
import os
import shutil
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..base import validate
from ..base.dist import all_gathered, digest
from ..base.dtypes import dtype_name
from ..base.errors import CheckpointError, ProvenanceError
from ..base.links import confined
from ..base.logs import log
from ..base.progress import Progress
from ..checkpoints.description import DescribedAverage, Description, TensorEntry
from ..checkpoints.saving import save_whole
from ..checkpoints.storage import Entry, atomic_file, open_regular
from ..output import dcp_checkpoint, megatron_run
from ..output.model_folder import (
    CONFIG,
    TOKENIZER_FILES,
    carried_files,
    configured,
    files_dtype,
)
from ..output.model_writer import cast, write_spread
from ..output.provenance import FILE as PROVENANCE
from ..output.provenance import made_by, manifest_sha256, of_input
from ..output.record import FolderRecord, MergedInput
from ..output.target import out_path
from ..output.weight_files import Slots, WeightPlan
from ..output.work import Rows, Work, Writers, assign, pieces
from ..output.write_options import DEFAULTS, Output, WriteOptions
from ..rules import SWA
from ..update.options import Options
from . import megatron, methods
from .merge_names import Planned, output_spec, patterns, plan_names, selected, tie_saved_once
from .merge_target import DIGESTS, carried_before, check_dcp_out, check_out_of_merge, digest_of
from .methods import Method, Schedule
from .saved_average import rows_shape
from .sources import DcpSource, SafetensorsSource, Source, Spec, finished_checkpoints, open_source

Carried = dict[str, Path]  # a model folder's files a merge carries: {name: the real file read}
AVERAGERS_CARRIED = "averagers_carried"  # an input's record: the prefixes of its averagers a DCP output carries


def merge(
    inputs: Sequence[str | os.PathLike] | str | os.PathLike,
    out: str | os.PathLike,
    *,
    weights: Sequence[float] | None = None,
    last: int | None = None,
    ema: float | None = None,
    schedule: Schedule | None = None,
    normalize: bool = True,
    method: Method | str | None = None,
    key: str | None = None,
    average: str | None = None,
    prefix: str | None = None,
    include: Sequence[str] | None = None,
    exclude: Sequence[str] | None = None,
    dtype: torch.dtype | None = DEFAULTS.dtype,
    accumulate: torch.dtype = torch.float32,
    max_shard_size: int | str = DEFAULTS.max_shard_size,
    output: Output = DEFAULTS.output,
    iteration: int | None = DEFAULTS.iteration,
    collective: bool = False,
    progress: Progress | None = None,
) -> Path:
    """Write the weighted average of the checkpoints ``inputs`` to ``out``; returns ``out``.

    Args:
        inputs: checkpoints (see ``sources.open_source``), or with ``last`` one run folder.
        out: the folder to write: a model folder, with ``output="shardavg"`` an averager's checkpoint,
            with ``output="dcp"`` a DCP checkpoint.
        weights: one per input, normalised to sum to 1 (default: uniform).
        last: take the newest ``last`` finished checkpoints of the run folder ``inputs``, by step.
        ema: weight the checkpoint of step ``s`` by ``ema ** (s_newest - s)``, normalised: what an
            EMA of that decay per step gives each saved step, relative to the others.
        schedule: ``"linear"``, ``"cosine"`` or ``"minus-sqrt"``: the weights that make the merge the
            model a decay of the learning rate by that shape over the inputs' steps would have given
            (WSM, warmup-stable-merge; ``schedule_weights``). Linear decay is the uniform average.
        normalize: scale ``weights`` to sum to 1 (default). ``False`` takes them as given, negative
            ones too (task arithmetic: ``--weights 1 1 -1``): only with ``weights``.
        method: any merge method (``offline.methods``: ``Ema(0.99)``, ``Wsm("cosine")``, a method of
            one's own registered there), or a registered one's name (``"uniform"``), in place of
            ``weights``, ``ema`` or ``schedule`` (each of which names a registered method).
        key: an averager's key in DCP checkpoints (else the model's tensors are merged); in Megatron-Core
            ``torch_dist`` checkpoints, the prefix an averager was saved under (``"ema."``, or ``"ema"``):
            its averages are merged, as the model (under the model's keys), its counters left out.
            Without it, a merge of Megatron-Core checkpoints leaves the averagers saved beside the
            model out (named in the log and the provenance's ``left_out``) and a DCP output carries
            the newest input's unchanged: a mean of averages with one input's counters is no run's.
        average: which average of a shardavg checkpoint that keeps several.
        prefix: the entry of DCP checkpoints that holds the model (``"model."``; ``""`` for the top
            level); default: found from how the checkpoint nests its entries (``sources.model_tensors``).
            Optimizer, scheduler, data loader and train state entries are never merged.
        include: merge only the tensors whose name matches one of these ``fnmatch`` patterns.
        exclude: leave out the tensors whose name matches one of these patterns.
        dtype: the floating tensors' output dtype (default: the inputs' when they agree, else fp32).
            This and the other write options (``max_shard_size``, ``output``, ``iteration``) are
            declared, with their checks, in ``output.write_options.WriteOptions``.
        accumulate: ``torch.float32`` or ``torch.float64``.
        max_shard_size: the largest output file before the model is split (bytes, or a size such as
            ``"500MiB"``).
        output: ``"safetensors"`` (a model folder), ``"shardavg"`` (an averager's checkpoint) or
            ``"dcp"``: a ``torch.distributed.checkpoint`` folder of the model's tensors under the keys,
            shapes and dtypes of the newest DCP input (its nesting too: ``dcp.load`` of the state dict
            that trainer saves restores it), else of the tensors' names at the top level; one file per
            writer, ``.metadata`` written last. From a Megatron-Core ``torch_dist`` input it also
            carries, byte for byte and never unpickled, ``metadata.json``, ``common.pt`` and the
            ``*._extra_state`` entries (and, unchanged, the averagers saved beside its model), so that
            ``dist_checkpointing.load`` reads it (without the optimizer and rng state:
            ``--no-load-optim --no-load-rng``), laid out as a Megatron-LM run
            that ``--load OUT`` resumes from: ``OUT/iter_NNNNNNN`` beside ``latest_checkpointed_iteration.txt``
            naming it (``output.megatron_run``). ``max_shard_size`` does not apply.
        iteration: the iteration a Megatron-LM run folder written as DCP holds the merge as (default:
            the newest input's step); only there.
        collective: split the work between the ranks of the default process group, each of which
            must call ``merge`` with the same arguments (what ``torchrun -m shardavg merge`` does);
            by default this process merges alone, whatever process group there is.
        progress: shows the bytes this process writes as it writes them (the command line's, on
            a terminal); default: nothing shown.

    Names tied in any input (an averager's aliases; a Hugging Face folder that stores
    ``lm_head.weight`` once, with the embedding) are one tensor; a model folder then holds it as
    the newest Hugging Face input does. A model folder also receives the newest Hugging Face
    input's other files (config, generation config, tokenizer; the inputs' tokenizers must agree),
    its ``config.json`` declaring the dtype written; a link there (or among the weights) is
    followed only within its input (for a snapshot of the Hugging Face cache, to its
    repository's blobs): one elsewhere is refused by name. The output's provenance is always
    the merge's own (an input's ``provenance.json`` is recorded in it, never carried; one that
    cannot be read is recorded as unknown, with a warning). A floating tensor that overflows
    ``dtype`` (an fp16 output beyond 65,504) is refused by name.

    Returns:
        The folder (or checkpoint) written: for a Megatron-LM run folder, its ``iter_NNNNNNN`` folder.

    Raises:
        CheckpointError: an input that cannot be read or does not match the others, or an ``out``
            inside a checkpoint or an input; nothing is written then.
        ValueError: weights, schedule or patterns that make no merge.
    """
    write = WriteOptions(max_shard_size=max_shard_size, dtype=dtype, output=output, iteration=iteration)
    validate.choice("accumulate", accumulate, (torch.float32, torch.float64))
    selection = patterns("include", include), patterns("exclude", exclude)
    writers = Writers.of(collective)
    progress = Progress("merge", quiet=True) if progress is None else progress
    sources: list[Source] = []
    try:
        error: Exception | None = None
        try:  # every writer checks every input before anything is written; a refusal is every writer's
            paths = _inputs(inputs, last)
            check_out_of_merge(out, paths, output)
            for path in paths:
                sources.append(open_source(path, key=key, average=average, prefix=prefix))
            _check_distinct(sources)
            for source in sources:
                source.check()
            tie_saved_once(sources)
            write = replace(write, iteration=_run_iteration(sources, write))
            check_dcp_out(Path(out), write)
            models = [s.model_dir for s in sources if isinstance(s, SafetensorsSource) and s.model_dir is not None]
            carried = [_carried(model) for model in models]
            _check_tokenizers(models, carried)
            tensors = selected(plan_names(sources, model_folder=output == "safetensors"), *selection)
            chosen = _method(weights, ema, schedule, normalize, method)
            plan = MergePlan.of(sources, tensors, chosen, accumulate, write, writers.count)
            merging = Merging(sources, plan)
            merging.check_range(plan.mine(writers.rank))
            made = _made(sources, plan.shares, chosen, write, writers.count) if writers.lead else None
            newest = carried[-1] if carried else {}
            folder = Folder.of(Path(out), newest, plan) if output == "safetensors" else None
            if folder is not None and made is not None:  # (the first writer's record: it writes it)
                made[DIGESTS] = folder.digests()
        except Exception as caught:
            error = caught
        writers.agree(error, "checking the merge's inputs")
        agreed = digest([[p.names, p.held, str(s.dtype), s.shape] for p, s in zip(plan.tensors, plan.specs)])
        agreed = digest([agreed, plan.shares])
        if not writers.same(agreed):
            seen = all_gathered((len(plan.tensors), [round(share, 6) for share in plan.shares], agreed))
            raise CheckpointError(
                "the writers read different inputs (names, shapes, dtypes or weights differ): "
                + "; ".join(f"rank {r}: {n} tensors, weights {w}, digest {d[0]:x}" for r, (n, w, d) in enumerate(seen))
                + ": every writer must see the same checkpoints and be given the same arguments"
            )
        if folder is not None:
            written = folder.write(merging, made, writers, progress)
        elif output == "shardavg":
            written = _write_checkpoint(Path(out), merging, made, writers, progress)
        else:
            written = _write_dcp(Path(out), merging, made, writers, progress)
        _log_done(sources, plan.tensors, written, write.output)
        return written
    finally:
        progress.close()  # (its line ended before any error is said)
        for source in sources:
            source.close()


def _method(
    weights: Sequence[float] | None,
    ema: float | None,
    schedule: Schedule | None,
    normalize: bool,
    method: Method | str | None,
) -> Method:
    """The merge's method (``methods``): the one its keywords give (``weights``, ``ema``, ``schedule``:
    each a registered method's keyword; ``method``, any method, or a registered one's name), else
    ``uniform``; with ``normalize`` off, one that takes its weights as given. One only."""
    found = methods.given({"weights": weights, "ema": ema, "schedule": schedule})
    words = [str(m.keyword) for m in found]
    if method is not None:
        found.append(methods.method(method) if isinstance(method, str) else method)
        words.append("method")
    if len(found) > 1:
        raise ValueError(f"{' and '.join(words)} each give the inputs' weights: pass one")
    chosen = found[0] if found else methods.method("uniform")
    return chosen if normalize else chosen.as_given()


@dataclass(frozen=True)
class MergePlan:
    """What the merge writes, decided before anything is read or written, the same on every writer:
    plain data its writers consume, as DCP's ``SavePlan`` is. Each merged tensor (``tensors``: the
    names written, the name read from each input; ``specs``: its output dtype and shape), each input's
    share (``shares``, the method's), the dtype sums accumulate in, the write options, and the work:
    its pieces (``_work``) and which writer writes each (``owner``)."""

    tensors: list[Planned]
    specs: list[Spec]
    shares: list[float]
    accumulate: torch.dtype
    write: WriteOptions
    work: list[Work]
    owner: list[int]

    @classmethod
    def of(
        cls,
        sources: list[Source],
        tensors: list[Planned],
        chosen: Method,
        accumulate: torch.dtype,
        write: WriteOptions,
        writers: int,
    ) -> MergePlan:
        """The plan of merging ``tensors`` of ``sources`` by the method ``chosen`` among ``writers``."""
        keyword = chosen.keyword or chosen.name
        methods.checked_steps(chosen, keyword, [s.step for s in sources], [str(s) for s in sources])
        shares = chosen.shares([s.step for s in sources], accumulate)
        specs = [output_spec(planned, sources, write.dtype) for planned in tensors]
        work = _work(tensors, specs, write.output, writers)
        owner = assign([piece.nbytes for piece in work], writers)
        return cls(tensors, specs, shares, accumulate, write, work, owner)

    def mine(self, rank: int) -> list[Work]:
        """The pieces writer ``rank`` writes (an averager's checkpoint: all, merged by each, written by one)."""
        every = self.write.output == "shardavg"
        return [piece for piece, writer in zip(self.work, self.owner) if writer == rank or every]


def _work(plan: list[Planned], specs: list[Spec], output: Output, writers: int) -> list[Work]:
    """The work (``work.pieces``), by bytes written (under each name of a tied tensor): every tensor,
    and, into a model folder or a DCP checkpoint by several writers, one larger than 1/``writers``
    of the whole as pieces of consecutive rows of about that (a DCP chunk is then a box of those
    rows), so that the largest tensors spread over the writers too. A model folder's tensor ``k``
    is written at the slots of its names, which follow the names of the tensors before it."""
    spread = output != "shardavg"  # (an averager's checkpoint is one file, one writer's)
    copies = [len(planned.names) if spread else 1 for planned in plan]
    sizes = [math.prod(spec.shape) * spec.dtype.itemsize * n for spec, n in zip(specs, copies)]
    largest = -(-sum(sizes) // writers) if spread else sum(sizes)
    first = list(itertools.accumulate(copies, initial=0))
    found = []
    for index, (spec, size) in enumerate(zip(specs, sizes)):
        found += pieces(index, spec.shape, size, tuple(range(first[index], first[index + 1])), largest)
    return found


def _write_checkpoint(out: Path, merging: Merging, made: dict | None, writers: Writers, progress: Progress) -> Path:
    """The merge as an averager's checkpoint of one rank file (its provenance ``made`` in the
    manifest): written by the first writer (one file, with its digest, is one writer's), the
    others waiting for its verdict."""
    error: Exception | None = None
    if writers.lead:
        try:
            whole = [Work(index, None, 0, ()) for index in range(len(merging.plan.tensors))]
            total = sum(math.prod(spec.shape) * spec.dtype.itemsize for spec in merging.plan.specs)
            stream = progress.counted(merging.merged(whole), total)
            description = replace(_description(merging), provenance=made)
            out = save_whole(out, description, stream)
        except Exception as caught:
            error = caught
    writers.agree(error, f"writing {out}")
    return Path(out)


def _write_dcp(out: Path, merging: Merging, made: dict | None, writers: Writers, progress: Progress) -> Path:
    """The merge as a DCP checkpoint (``output.dcp_checkpoint``), staged beside ``out`` and swapped
    into place whole: the first writer makes the staging folder (``staged``: locked, its record
    written); every writer, once it has proved it sees that folder (``joined``), writes its pieces
    into a file of its own there, in parallel, each piece a chunk of its rows under the key of each
    of its names (the first also the newest Megatron input's averagers, unchanged: ``DcpSource.kept``);
    once every writer has, the first carries a Megatron input's files, commits ``.metadata`` there and
    swaps the folder into place. A failure anywhere is every writer's, and leaves ``out`` as it was (an
    earlier merge, whole, or nothing) and no staging folder. With an ``iteration`` (the plan's), ``out``
    is a Megatron-LM run folder: the checkpoint goes into its ``iter_NNNNNNN`` folder, and the tracker
    naming it is written once that is in place (``output.megatron_run``)."""
    plan, iteration = merging.plan, merging.plan.write.iteration
    run, out = out, out if iteration is None else megatron_run.folder_of(out, iteration)
    keys, nesting, newest = _dcp_keys(merging.sources)
    tensors = {keys(n): (s.dtype, s.shape) for planned, s in zip(plan.tensors, plan.specs) for n in planned.names}
    kept = newest.kept if newest is not None else {}  # (its averagers' tensors, carried unchanged)
    tensors |= {key: (stored.properties.dtype, tuple(stored.size)) for key, stored in kept.items()}
    error: Exception | None = None
    token = ""
    objects: list[tuple[str, dcp_checkpoint.StoredBytes]] = []
    files: list[Path] = []
    with contextlib.ExitStack() as held:
        if writers.lead:
            try:
                if iteration is not None:
                    held.enter_context(megatron_run.held(run))
                token = held.enter_context(dcp_checkpoint.staged(out, made or {}))
                if newest is not None and megatron.is_torch_dist(newest.path):
                    averaged = None if newest.averaged is None else newest.averaged.prefix
                    objects, files = megatron.carried(newest.folder, averaged)
            except Exception as caught:
                error = caught
        writers.agree(error, f"preparing {out}")
        token = all_gathered(token)[0] if writers.together else token

        def chunks() -> Iterator[tuple[str, Rows, torch.Tensor]]:
            for piece, tensor in merging.each(plan.mine(writers.rank), progress):
                for name in plan.tensors[piece.index].names:  # (a tied tensor under each of its names' keys)
                    yield keys(name), piece.rows, tensor
                del tensor  # (before the next one is merged)
            for key in kept if writers.lead else ():  # (the newest input's own, whole, as it stored them)
                yield key, None, newest.folder.read(key)  # type: ignore[union-attr]

        written: list[dcp_checkpoint.Written] = []
        try:
            staging = dcp_checkpoint.joined(out, token, writers.rank)
            written = dcp_checkpoint.write_part(staging, writers.rank, chunks(), objects, merge=token)
        except Exception as caught:
            error = caught
        writers.agree(error, f"writing the merge to {out}")
        everyone = all_gathered(written) if writers.together else [written]
        if writers.lead:
            try:
                dcp_checkpoint.carry(staging, files)
                chunks_written = [chunk for part in everyone for chunk in part]
                dcp_checkpoint.commit(staging, tensors, chunks_written, nesting, out)
                dcp_checkpoint.swap(out)
                if iteration is not None:
                    megatron_run.track(run, iteration)
            except Exception as caught:
                error = caught
        writers.agree(error, f"committing the merge to {out}")
    return out


def _newest_dcp(sources: list[Source]) -> DcpSource | None:
    """The newest DCP input: a DCP output takes its keys, nesting and what it carries from it."""
    return next((s for s in reversed(sources) if isinstance(s, DcpSource)), None)


def _dcp_keys(sources: list[Source]) -> tuple[Callable[[str], str], dict[str, tuple] | None, DcpSource | None]:
    """How a DCP output names and nests the merged tensors: as the newest DCP input stores them
    (``model.`` and its nesting, as torchtitan or the main job saved; Megatron's flat keys), else
    under their names at the top level; and that input."""
    newest = _newest_dcp(sources)
    if newest is None:
        return (lambda name: name), None, None
    stored = {name: newest.output_key(name) for name in newest.keys}
    return (lambda name: stored.get(name, name)), dcp_checkpoint.nesting_of(newest.folder.metadata), newest


@dataclass
class Folder:
    """The merge as a model folder: the weights, written by every writer, each its share of the
    tensors by bytes, with the merge's record (its inputs and the files carried; its provenance
    beside them, with each carried file's SHA-256, ``digests``); then the newest Hugging Face input's
    other files (``carried``, see ``_carry``; ``config``: its ``config.json`` as written), by the first
    writer."""

    out: Path
    carried: Carried
    config: bytes | None
    entries: list[Entry]
    max_bytes: int

    @classmethod
    def of(cls, out: Path, carried: Carried, plan: MergePlan) -> Folder:
        """The model folder of the tensors ``plan`` merges, its ``config.json`` made (declaring the
        dtype of most of their elements, untied embeddings where the merge unties them) before anything
        is written: a config that cannot be read is a refusal, and its digest goes into the provenance."""
        entries = [Entry(n, spec.dtype, spec.shape) for p, spec in zip(plan.tensors, plan.specs) for n in p.names]
        dtype = files_dtype((e.dtype, math.prod(e.shape)) for e in entries)
        untied = any(planned.untied for planned in plan.tensors)
        config = configured(carried[CONFIG], dtype, untied) if CONFIG in carried else None
        return cls(out, carried, config, entries, plan.write.max_bytes)

    def digests(self) -> dict[str, str]:
        """``{name: SHA-256}`` of each file this merge carries, as it writes it (``DIGESTS``)."""
        found = {name: digest_of(real).hex() for name, real in self.carried.items() if name != CONFIG}
        return found | ({CONFIG: hashlib.sha256(self.config).hexdigest()} if self.config is not None else {})

    def write(self, merging: Merging, made: dict | None, writers: Writers, progress: Progress) -> Path:
        target = out_path(self.out, "merge")
        before = carried_before(target) if target.is_dir() else set()
        record = _record(merging.sources, merging.plan.shares, sorted(self.carried), made)
        weights = WeightPlan(self.entries, self.max_bytes, record)

        def write(slots: Slots) -> Exception | None:
            try:
                for piece, tensor in merging.each(merging.plan.mine(writers.rank), progress):
                    for slot in piece.slots:
                        slots.write(weights.slots[slot], tensor, piece.rows)
                    del tensor  # before the next one is merged
            except Exception as caught:
                return caught
            finally:
                slots.close()
            return None

        def finish() -> None:
            _carry(self.carried, self.config, before, target)

        return write_spread(target, weights, write, f"writing the merge to {self.out}", writers, finish)


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


def _check_distinct(sources: list[Source]) -> None:
    """Refuse one checkpoint named twice under two names (a folder and its ``model.safetensors``,
    a link to it): the files their tensors are read from, every link followed, must differ."""
    seen: dict[Path, Source] = {}
    for source in sources:
        for origin in sorted(source.origins()):
            if origin in seen:
                raise ValueError(
                    f"{seen[origin]} and {source} are one checkpoint (both read {origin}): name it once, and weight "
                    "an input with weights= (--weights) instead"
                )
        seen |= dict.fromkeys(source.origins(), source)


def _run_iteration(sources: list[Source], write: WriteOptions) -> int | None:
    """The iteration of the Megatron-LM run folder a DCP merge of Megatron-Core ``torch_dist`` inputs
    (its newest DCP input one) is written as: the one given (``write.iteration``), else the newest
    input's step; None for any other merge, which takes no iteration."""
    iteration = write.iteration
    newest = _newest_dcp(sources)
    if write.output != "dcp" or newest is None or not megatron.is_torch_dist(newest.path):
        if iteration is not None:
            raise ValueError(
                f"iteration={iteration} names the iter_NNNNNNN folder of a Megatron-LM run, which only a merge of "
                "Megatron-Core torch_dist checkpoints written as DCP (--format dcp) is: leave it out here"
            )
        return None
    if iteration is None:
        iteration = _newest(sources)
        if not iteration:  # (None, or 0: Megatron-LM resumes from no iteration 0)
            raise CheckpointError(
                f"the merge is written as a Megatron-LM run folder, whose iteration comes from the newest input's "
                f"step, but {'no input records one' if iteration is None else 'it is 0'} (an iter_NNNNNNN folder's "
                "name): give the iteration to write, iteration=N (--iteration N)"
            )
    return megatron_run.check_iteration(iteration)


@dataclass(frozen=True)
class Merging:
    """What every writer merges: the ``plan`` (plain data), read from the inputs (``sources``)."""

    sources: list[Source]
    plan: MergePlan

    def merged(self, pieces: Iterable[Work]) -> Iterator[torch.Tensor]:
        """Each piece merged in turn: ``sum(w_i * x_i)`` accumulated in input order, then cast (an
        overflow of the output dtype refused by name). Nothing is kept from one piece to the next."""
        accumulate = self.plan.accumulate
        for piece in pieces:
            planned, spec = self.plan.tensors[piece.index], self.plan.specs[piece.index]
            if spec.dtype.is_floating_point:
                merged = torch.zeros(rows_shape(spec.shape, piece.rows), dtype=accumulate)
                for source, name, share in zip(self.sources, planned.held, self.plan.shares):
                    merged.add_(source.read(name, piece.rows).to(accumulate).mul_(share))
                merged = cast(merged, spec.dtype, planned.names[0])
            else:
                merged = self.sources[-1].read(planned.held[-1], piece.rows)
            yield merged
            del merged

    def each(self, mine: list[Work], progress: Progress) -> Iterator[tuple[Work, torch.Tensor]]:
        """Each piece of ``mine`` with its merged tensor, the progress advanced once the caller has
        written it. Not ``zip``: its reused tuple would hold a tensor while the next is merged."""
        items = iter(mine)
        progress.start(sum(piece.nbytes for piece in mine))
        for tensor in self.merged(mine):
            piece = next(items)
            yield piece, tensor
            del tensor
            progress.advance(piece.nbytes)

    def check_range(self, pieces: list[Work]) -> None:
        """Refuse, before anything is written, a merged tensor that overflows its output dtype: one
        pass over the ``pieces`` narrowed to a dtype of a smaller range (fp16) from inputs of a wider
        one, or, when the weights are no average (raw, negative or not summing to 1), from any input.
        (An average of inputs already in the output dtype stays within their range.)"""
        shares, accumulate = self.plan.shares, self.plan.accumulate
        average = all(w >= 0 for w in shares) and abs(math.fsum(shares) - 1.0) <= 1e-9

        def narrowed(piece: Work) -> bool:
            planned, spec = self.plan.tensors[piece.index], self.plan.specs[piece.index]
            return spec.dtype.is_floating_point and any(
                torch.finfo(spec.dtype).max < torch.finfo(source.specs[name].dtype if average else accumulate).max
                for source, name in zip(self.sources, planned.held)
            )

        for _ in self.merged(filter(narrowed, pieces)):
            pass  # (each piece is cast and checked in turn, then let go)


def _record(sources: list[Source], shares: list[float], carried: list[str], made: dict | None) -> FolderRecord:
    """What the output says of its making: the inputs, their steps and weights, the newest step,
    the files carried, and (beside the weights) the provenance ``made``."""
    inputs = tuple(MergedInput(str(s), s.step, w) for s, w in zip(sources, shares))
    return FolderRecord("merge", _newest(sources), inputs=inputs, carried=tuple(carried), provenance=made)


def _newest(sources: list[Source]) -> int | None:
    """The newest of the inputs' steps (None: none records one)."""
    return max((s.step for s in sources if s.step is not None), default=None)


def _description(merging: Merging) -> Description:
    """The merge as an averager's description: one average of ``len(sources)`` updates, by SWA's
    rule when the weights are equal (it is then their SWA), else a custom rule named ``merge``;
    each tensor's kind and role as an averager's input records them (else a floating tensor is
    an averaged parameter, an integer one a copy), tied names as its aliases."""
    sources, shares = merging.sources, merging.plan.shares
    uniform = max(shares) - min(shares) <= 1e-12 * max(shares)
    described = next((s.described for s in sources if s.described), {})  # an averager's checkpoint's roles

    def kind_and_role(name: str, spec: Spec) -> tuple[str, str]:
        return described.get(name, ("param", "average" if spec.dtype.is_floating_point else "copy"))

    rule = SWA().to_config() if uniform else {"kind": "custom", "name": "merge"}
    return Description(
        step=_newest(sources) or 0,
        num_updates=len(sources),
        num_skipped=0,
        averages=(DescribedAverage(None, rule),),
        tensors=tuple(
            TensorEntry(
                planned.names[0],
                planned.names[1:],
                *kind_and_role(planned.names[0], spec),
                spec.shape,
                dtype_name(spec.dtype),
            )
            for planned, spec in zip(merging.plan.tensors, merging.plan.specs)
        ),
        strategy="replicated",
        world_size=1,
        options=Options(dtype=None),  # each tensor kept in its own dtype
    )


def _carried(model: Path) -> Carried:
    """The files a merge of the model folder ``model`` carries (``model_folder.carried_files``) but
    its provenance (the merge writes its own), each ``confined`` to the input: ``{name: the real
    file}``. A link that leads elsewhere is refused by name before anything is written."""
    return {name: confined(model / name, model) for name in carried_files(model) if name != PROVENANCE}


def _check_tokenizers(models: list[Path], carried: list[Carried]) -> None:
    """Refuse inputs whose tokenizer files differ (a merged model has one tokenizer), comparing
    their digests, read a chunk at a time (a tokenizer model may be large)."""
    for name in TOKENIZER_FILES:
        holding = {model: digest_of(files[name]) for model, files in zip(models, carried) if name in files}
        if len(set(holding.values())) > 1:
            last = list(holding)[-1]
            differ = next(model for model, digest in holding.items() if digest != holding[last])
            raise CheckpointError(
                f"the inputs disagree on the tokenizer: {name} of {differ} differs from {last}'s; a merge of models "
                "with different tokenizers is not one model"
            )


def _carry(carried: Carried, config: bytes | None, before: set[str], out: Path) -> None:
    """The newest Hugging Face input's other files (config, generation config, tokenizer, ...) into
    ``out``, so that ``from_pretrained`` loads the merge as the model it is; ``config.json`` as
    ``Folder.of`` made it (declaring the dtype written). Each file is copied a chunk at a time from
    the real file ``_carried`` found (a regular file, no link followed now) and replaces the one an
    earlier merge there carried, atomically (never written through a link); what an earlier merge
    carried and this one does not is removed (it belonged to another model): only files of
    ``before``, those ``carried_before`` proved it wrote."""
    for name, real in carried.items():
        if name == CONFIG and config is not None:
            with atomic_file(out / name) as handle:
                handle.write(config)
            continue
        with os.fdopen(open_regular(real), "rb") as source, atomic_file(out / name) as handle:
            shutil.copyfileobj(source, handle, dcp_checkpoint.COPY_BYTES)
    for stale in before - set(carried):
        (out / stale).unlink(missing_ok=True)


def _made(sources: list[Source], shares: list[float], chosen: Method, write: WriteOptions, writers: int) -> dict:
    """The merge's provenance, made before anything is written (so that nothing an input holds can
    fail it afterwards): each input's path, step, weight, run and manifest digest, the provenance
    it recorded, where it can be read (``_input_made``), and the groups of its entries left out
    (``{group: entries}``: an optimizer, rng state, an averager), and in a DCP output the prefixes of
    the averagers carried unchanged from it (``AVERAGERS_CARRIED``); the learning-rate decay the
    method stands in for (``schedule``) and the dtype written; a DCP output's format (``"output"``)."""
    inputs = [_input_made(source, share) for source, share in zip(sources, shares)]
    for record, source in zip(inputs, sources):
        if source.left_out:
            record["left_out"] = dict(source.left_out)
    carried = _averagers_carried(sources, write.output)
    if carried is not None:
        source, averagers = carried
        inputs[sources.index(source)][AVERAGERS_CARRIED] = [averager.prefix for averager in averagers]
    written = None if write.dtype is None else dtype_name(write.dtype)
    details = {"output": write.output} if write.output == "dcp" else {}
    return made_by("merge", writers, schedule=chosen.schedule, dtype=written, inputs=inputs, **details)


def _input_made(source: Source, share: float) -> dict:
    """One input's record (``provenance.of_input``). An input whose own provenance cannot be read
    (damaged, crafted: nested beyond any merge of merges) is merged all the same, recorded without
    it (``"provenance_unreadable"``: why), with a warning: it describes how the input was made, not
    what it holds, which every input is checked for."""
    try:
        return of_input(Path(source.path), source.step, share, source.run_id)
    except ProvenanceError as error:
        reason = str(error)
    log.warning("%s: its provenance cannot be read (%s): the merge records it as unreadable", source, reason)
    made = {"path": str(source.path), "step": source.step, "weight": share, "provenance_unreadable": reason}
    digest = manifest_sha256(Path(source.path))
    return made | ({"run_id": source.run_id} if source.run_id else {}) | ({"manifest_sha256": digest} if digest else {})


def _log_done(sources: list[Source], plan: list[Planned], out: Path, output: Output) -> None:
    """Say what the merge did not do plainly: names it untied, and each input's entries left out,
    the averagers saved beside a Megatron-Core model among them (``_log_averagers``)."""
    untied = sorted(n for p in plan if p.untied for n in p.names)
    if untied:
        log.warning("%s: the inputs disagree on tying %s; each name merged on its own, written untied", out, untied)
    for source in sources:
        if source.left_out:
            skipped = ", ".join(f"{count} under {key!r}" for key, count in source.left_out.items())
            log.info("%s: merged its %d %s; left out %s", source, len(source.specs), _merged_as(source), skipped)
    _log_averagers(sources, out, output)


def _merged_as(source: Source) -> str:
    """What a merge read from ``source``: its model's tensors, or an averager's averages (``key``)."""
    averaged = source.averaged if isinstance(source, DcpSource) else None
    return "model tensors" if averaged is None else f"averages of the averager {averaged.prefix!r}, as the model"


def _averagers_carried(sources: list[Source], output: Output) -> tuple[DcpSource, list[megatron.Averager]] | None:
    """The input whose averagers a DCP output carries unchanged (the newest DCP input, a Megatron-Core
    one holding averagers beside its model: ``DcpSource.kept``), and those averagers; None elsewhere."""
    newest = _newest_dcp(sources)
    if output != "dcp" or newest is None or not newest.kept:
        return None
    return newest, newest.averagers


def _log_averagers(sources: list[Source], out: Path, output: Output) -> None:
    """Say what became of the averagers saved beside the models merged: left out of the merge (a mean
    of averages restored with one input's counters would be no run's average); in a DCP output, the
    newest input's carried unchanged, so that a run resuming from it restores that run's average."""
    left = sorted({a.prefix for s in sources if isinstance(s, DcpSource) and s.averaged is None for a in s.averagers})
    if not left:
        return
    named = ", ".join(repr(prefix) for prefix in left)
    carried = _averagers_carried(sources, output)
    if carried is None:
        became = "OUT holds none"
    else:
        source, kept = carried
        became = (
            f"{', '.join(repr(a.prefix) for a in kept)} of the newest input, {source}, carried unchanged (averages and "
            "counters): a run resuming from OUT restores that run's average"
        )
    log.info(
        "%s: the averager saved beside the model under %s is left out of the merge of the models; %s. To merge the "
        "averages themselves, as a model, pass key=%r (--key %s)", out, named, became, left[0], left[0],
    )  # fmt: skip
