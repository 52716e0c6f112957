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
inputs' own keys that the trainers that wrote them load back (``output.dcp_checkpoint``).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import math
import os
import re
import shutil
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Literal

import torch

from ..base import validate
from ..base.dist import all_gathered, digest
from ..base.dtypes import dtype_name
from ..base.errors import CheckpointError, ProvenanceError
from ..base.links import confined
from ..base.logs import log
from ..base.progress import Progress
from ..checkpoints.checkpoint import save_whole
from ..checkpoints.format import DCP_METADATA
from ..checkpoints.ownership import LOCK_FILE, target_path
from ..checkpoints.storage import Entry, atomic_file, open_regular
from ..output import dcp_checkpoint
from ..output import provenance as provenance_file
from ..output.model_folder import (
    CONFIG,
    NOT_CARRIED,
    TOKENIZER_FILES,
    carried_files,
    configured,
    files_dtype,
    weights_record,
)
from ..output.model_writer import cast, cast_dtype, parse_size, write_spread
from ..output.provenance import FILE as PROVENANCE
from ..output.provenance import made_by, manifest_sha256, of_input
from ..output.record import FolderRecord, MergedInput
from ..output.target import check_out, out_path
from ..output.weight_files import Slots, WeightPlan
from ..output.work import Rows, Work, Workers, assign, pieces
from ..rules import SWA
from ..state.description import DescribedAverage, Description, TensorEntry
from ..update.options import Options
from . import megatron
from .saved_average import PLAIN_NAME, read_dcp_metadata, rows_shape
from .sources import DcpSource, SafetensorsSource, Source, Spec, finished_checkpoints, open_source

Output = Literal["safetensors", "shardavg", "dcp"]
HF_CONFIGS = ("config.json", "generation_config.json")  # what merges before 0.4 carried, unrecorded
Carried = dict[str, Path]  # a model folder's files a merge carries: {name: the real file read}
DIGESTS = "carried"  # the provenance's {name: SHA-256} of each file a merge carried: how a later merge knows them
TRAINER_STEP = re.compile(r"step-(\d+)")  # a step torchtitan resumes from: a folder whose name holds it (re.search)
TRAINING_STATE = ("train_state", "dataloader")  # torchtitan's entries beside the model in a step it saves
STEPS_PROBED = 3  # the newest steps beside OUT read for training state (a run's last save may be its model alone)


def merge(
    inputs: Sequence[str | os.PathLike] | str | os.PathLike,
    out: str | os.PathLike,
    *,
    weights: Sequence[float] | None = None,
    last: int | None = None,
    ema: float | None = None,
    schedule: Schedule | None = None,
    normalize: bool = True,
    key: str | None = None,
    average: str | None = None,
    prefix: str | None = None,
    include: Sequence[str] | None = None,
    exclude: Sequence[str] | None = None,
    dtype: torch.dtype | None = None,
    accumulate: torch.dtype = torch.float32,
    max_shard_size: int | str = "5GB",
    output: Output = "safetensors",
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
        key: an averager's key in DCP checkpoints (else the model's tensors are merged).
        average: which average of a shardavg checkpoint that keeps several.
        prefix: the entry of DCP checkpoints that holds the model (``"model."``; ``""`` for the top
            level); default: found from how the checkpoint nests its entries (``sources.model_tensors``).
            Optimizer, scheduler, data loader and train state entries are never merged.
        include: merge only the tensors whose name matches one of these ``fnmatch`` patterns.
        exclude: leave out the tensors whose name matches one of these patterns.
        dtype: the floating tensors' output dtype (default: the inputs' when they agree, else fp32).
        accumulate: ``torch.float32`` or ``torch.float64``.
        max_shard_size: the largest output file before the model is split (``"5GB"``, or bytes).
        output: ``"safetensors"`` (a model folder), ``"shardavg"`` (an averager's checkpoint) or
            ``"dcp"``: a ``torch.distributed.checkpoint`` folder of the model's tensors under the keys,
            shapes and dtypes of the newest DCP input (its nesting too: ``dcp.load`` of the state dict
            that trainer saves restores it), else of the tensors' names at the top level; one file per
            worker, ``.metadata`` written last. From a Megatron-Core ``torch_dist`` input it also
            carries, byte for byte and never unpickled, ``metadata.json``, ``common.pt`` and the
            ``*._extra_state`` entries, so that ``dist_checkpointing.load`` reads it (without the
            optimizer and rng state: ``--no-load-optim --no-load-rng``). ``max_shard_size`` does not
            apply.
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
        The folder (or checkpoint) written.

    Raises:
        CheckpointError: an input that cannot be read or does not match the others, or an ``out``
            inside a checkpoint or an input; nothing is written then.
        ValueError: weights, schedule or patterns that make no merge.
    """
    validate.floating_dtype("dtype", dtype)
    validate.choice("accumulate", accumulate, (torch.float32, torch.float64))
    validate.choice("output", output, ("safetensors", "shardavg", "dcp"))
    patterns = _patterns("include", include), _patterns("exclude", exclude)
    max_bytes = parse_size(max_shard_size)
    workers = Workers.of(collective)
    progress = Progress("merge", quiet=True) if progress is None else progress
    sources: list[Source] = []
    try:
        error: Exception | None = None
        try:  # every worker checks every input before anything is written; a refusal is every worker's
            paths = _inputs(inputs, last)
            _check_out(out, paths, output)
            for path in paths:
                sources.append(open_source(path, key=key, average=average, prefix=prefix))
            _check_distinct(sources)
            for source in sources:
                source.check()
            _tie_saved_once(sources)
            models = [s.model_dir for s in sources if isinstance(s, SafetensorsSource) and s.model_dir is not None]
            carried = [_carried(model) for model in models]
            _check_tokenizers(models, carried)
            plan = _selected(plan_names(sources, model_folder=output == "safetensors"), *patterns)
            shares = _weights(sources, weights, ema, schedule, normalize, accumulate)
            specs = [_output_spec(planned, sources, dtype) for planned in plan]
            work = _work(plan, specs, output, workers.count)
            owner = assign([piece.nbytes for piece in work], workers.count)
            mine = [piece for piece, writer in zip(work, owner) if writer == workers.rank or output == "shardavg"]
            merging = Merging(sources, shares, plan, specs, accumulate)
            merging.check_range(mine)
            made = _made(sources, shares, schedule, dtype, workers.count, output) if workers.lead else None
            newest = carried[-1] if carried else {}
            folder = Folder.of(Path(out), newest, plan, specs, max_bytes) if output == "safetensors" else None
            if folder is not None and made is not None:  # (the first worker's record: it writes it)
                made[DIGESTS] = folder.digests()
        except Exception as caught:
            error = caught
        workers.agree(error, "checking the merge's inputs")
        agreed = digest([[p.names, p.held, str(s.dtype), s.shape] for p, s in zip(plan, specs)] + [shares])
        if not workers.same(agreed):
            seen = all_gathered((len(plan), [round(share, 6) for share in shares], agreed))
            raise CheckpointError(
                "the workers read different inputs (names, shapes, dtypes or weights differ): "
                + "; ".join(f"rank {r}: {n} tensors, weights {w}, digest {d[0]:x}" for r, (n, w, d) in enumerate(seen))
                + ": every worker must see the same checkpoints and be given the same arguments"
            )
        if folder is not None:
            written = folder.write(merging, mine, made, workers, progress)
        elif output == "shardavg":
            written = _write_checkpoint(Path(out), merging, made, workers, progress)
        else:
            written = _write_dcp(Path(out), merging, mine, made, workers, progress)
        _log_done(sources, plan, written)
        return written
    finally:
        progress.close()  # (its line ended before any error is said)
        for source in sources:
            source.close()


def _work(plan: list[Planned], specs: list[Spec], output: Output, workers: int) -> list[Work]:
    """The work (``work.pieces``), by bytes written (under each name of a tied tensor): every tensor,
    and, into a model folder or a DCP checkpoint by several workers, one larger than 1/``workers``
    of the whole as pieces of consecutive rows of about that (a DCP chunk is then a box of those
    rows), so that the largest tensors spread over the workers too. A model folder's tensor ``k``
    is written at the slots of its names, which follow the names of the tensors before it."""
    spread = output != "shardavg"  # (an averager's checkpoint is one file, one writer's)
    copies = [len(planned.names) if spread else 1 for planned in plan]
    sizes = [math.prod(spec.shape) * spec.dtype.itemsize * n for spec, n in zip(specs, copies)]
    largest = -(-sum(sizes) // workers) if spread else sum(sizes)
    first = list(itertools.accumulate(copies, initial=0))
    found = []
    for index, (spec, size) in enumerate(zip(specs, sizes)):
        found += pieces(index, spec.shape, size, tuple(range(first[index], first[index + 1])), largest)
    return found


def _write_checkpoint(out: Path, merging: Merging, made: dict | None, workers: Workers, progress: Progress) -> Path:
    """The merge as an averager's checkpoint of one rank file (its provenance ``made`` in the
    manifest): written by the first worker (one file, with its digest, is one writer's), the
    others waiting for its verdict."""
    error: Exception | None = None
    if workers.lead:
        try:
            whole = [Work(index, None, 0, ()) for index in range(len(merging.plan))]
            total = sum(math.prod(spec.shape) * spec.dtype.itemsize for spec in merging.specs)
            stream = progress.counted(merging.merged(whole), total)
            description = replace(_description(merging), provenance=made)
            out = save_whole(out, description, stream)
        except Exception as caught:
            error = caught
    workers.agree(error, f"writing {out}")
    return Path(out)


def _write_dcp(
    out: Path, merging: Merging, mine: list[Work], made: dict | None, workers: Workers, progress: Progress
) -> Path:
    """The merge as a DCP checkpoint (``output.dcp_checkpoint``), staged beside ``out`` and swapped
    into place whole: the first worker makes the staging folder (``staged``: locked, its record
    written); every worker, once it has proved it sees that folder (``joined``), writes its pieces
    into a file of its own there, in parallel, each piece a chunk of its rows under the key of each
    of its names; once every worker has, the first carries a Megatron input's files, commits
    ``.metadata`` there and swaps the folder into place. A failure anywhere is every worker's, and
    leaves ``out`` as it was (an earlier merge, whole, or nothing) and no staging folder."""
    keys, nesting, newest = _dcp_keys(merging.sources)
    tensors = {keys(n): (s.dtype, s.shape) for planned, s in zip(merging.plan, merging.specs) for n in planned.names}
    error: Exception | None = None
    token = ""
    objects: list[tuple[str, dcp_checkpoint.StoredBytes]] = []
    files: list[Path] = []
    with contextlib.ExitStack() as held:
        if workers.lead:
            try:
                token = held.enter_context(dcp_checkpoint.staged(out, made or {}))
                if newest is not None and megatron.is_torch_dist(newest.path):
                    objects, files = megatron.carried(newest.folder)
            except Exception as caught:
                error = caught
        workers.agree(error, f"preparing {out}")
        token = all_gathered(token)[0] if workers.together else token

        def chunks() -> Iterator[tuple[str, Rows, torch.Tensor]]:
            for piece, tensor in merging.each(mine, progress):
                for name in merging.plan[piece.index].names:  # (a tied tensor under each of its names' keys)
                    yield keys(name), piece.rows, tensor
                del tensor  # (before the next one is merged)

        written: list[dcp_checkpoint.Written] = []
        try:
            staging = dcp_checkpoint.joined(out, token, workers.rank)
            written = dcp_checkpoint.write_part(staging, workers.rank, chunks(), objects, merge=token)
        except Exception as caught:
            error = caught
        workers.agree(error, f"writing the merge to {out}")
        everyone = all_gathered(written) if workers.together else [written]
        if workers.lead:
            try:
                dcp_checkpoint.carry(staging, files)
                chunks_written = [chunk for part in everyone for chunk in part]
                dcp_checkpoint.commit(staging, tensors, chunks_written, nesting, out)
                dcp_checkpoint.swap(out)
            except Exception as caught:
                error = caught
        workers.agree(error, f"committing the merge to {out}")
    return out


def _dcp_keys(sources: list[Source]) -> tuple[Callable[[str], str], dict[str, tuple] | None, DcpSource | None]:
    """How a DCP output names and nests the merged tensors: as the newest DCP input stores them
    (``model.`` and its nesting, as torchtitan or the main job saved; Megatron's flat keys), else
    under their names at the top level; and that input."""
    newest = next((s for s in reversed(sources) if isinstance(s, DcpSource)), None)
    if newest is None:
        return (lambda name: name), None, None
    stored = {name: key for name, (key, _) in newest.keys.items()}
    return (lambda name: stored.get(name, name)), dcp_checkpoint.nesting_of(newest.folder.metadata), newest


@dataclass
class Folder:
    """The merge as a model folder: the weights, written by every worker, each its share of the
    tensors by bytes, with the merge's record (its inputs and the files carried; its provenance
    beside them, with each carried file's SHA-256, ``digests``); then the newest Hugging Face input's
    other files (``carried``, see ``_carry``; ``config``: its ``config.json`` as written), by the first
    worker."""

    out: Path
    carried: Carried
    config: bytes | None
    entries: list[Entry]
    max_bytes: int

    @classmethod
    def of(cls, out: Path, carried: Carried, plan: list[Planned], specs: list[Spec], max_bytes: int) -> Folder:
        """The model folder of the tensors ``plan`` and ``specs``, its ``config.json`` made (declaring the
        dtype of most of their elements, untied embeddings where the merge unties them) before anything
        is written: a config that cannot be read is a refusal, and its digest goes into the provenance."""
        entries = [Entry(n, spec.dtype, spec.shape) for planned, spec in zip(plan, specs) for n in planned.names]
        dtype = files_dtype((e.dtype, math.prod(e.shape)) for e in entries)
        untied = any(planned.untied for planned in plan)
        config = configured(carried[CONFIG], dtype, untied) if CONFIG in carried else None
        return cls(out, carried, config, entries, max_bytes)

    def digests(self) -> dict[str, str]:
        """``{name: SHA-256}`` of each file this merge carries, as it writes it (``DIGESTS``)."""
        found = {name: _digest_of(real).hex() for name, real in self.carried.items() if name != CONFIG}
        return found | ({CONFIG: hashlib.sha256(self.config).hexdigest()} if self.config is not None else {})

    def write(
        self, merging: Merging, mine: list[Work], made: dict | None, workers: Workers, progress: Progress
    ) -> Path:
        target = out_path(self.out, "merge")
        before = carried_before(target) if target.is_dir() else set()
        record = _record(merging.sources, merging.shares, sorted(self.carried), made)
        weights = WeightPlan(self.entries, self.max_bytes, record)

        def write(slots: Slots) -> Exception | None:
            try:
                for piece, tensor in merging.each(mine, progress):
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

        return write_spread(target, weights, write, f"writing the merge to {self.out}", workers, finish)


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


def _check_out(out: str | os.PathLike, inputs: list[Path], output: Output) -> None:
    """OUT names a folder of its own: not an input, inside one, or holding one (which its writing
    could replace), nor inside any checkpoint; new, empty, or holding nothing but an earlier
    merge (or export) of shardavg's in the same format, which it replaces."""
    weights = check_out(out, "merge", inputs, replaces_checkpoint=output != "safetensors")  # (all shardavg's)
    _check_not_a_trainer_step(Path(out))
    if output == "dcp":  # (replaced whole, by a staged folder swapped into place)
        dcp_checkpoint.check_replaceable(target_path(out, "merge", replaced_whole=True))
    if output == "safetensors" and Path(out).is_dir():
        own = set(weights) | carried_before(Path(out))
        others = sorted(p.name for p in Path(out).iterdir() if p.name not in own | {*HF_CONFIGS, LOCK_FILE, PROVENANCE})
        if others:
            claimed = sorted(set(others) & _claimed(Path(out)))
            why = (
                f"; the record of its weights names {', '.join(claimed[:8])} among the files a merge carried, but "
                f"not with the content that merge wrote (its SHA-256 in {PROVENANCE}), and a merge removes only "
                "what it can prove it wrote: move them, or"
                if claimed
                else ":"
            )
            raise CheckpointError(
                f"OUT {out} holds files a merge did not write ({', '.join(others[:8])}"
                f"{f', ... {len(others) - 8} more' if len(others) > 8 else ''}){why} name a new or empty folder"
            )


def _check_not_a_trainer_step(out: Path) -> None:
    """Refuse an OUT that torchtitan would take for a step of its run: a folder whose name holds
    ``step-N`` (what torchtitan looks for, anywhere in the name) beside others that hold a DCP
    checkpoint with its training state (``train_state``, ``dataloader``: read from the newest
    ``STEPS_PROBED``'s ``.metadata``). Its next restart would resume from the merge, the newest
    step, and fail on the training state a merge does not hold."""
    folder = out.absolute().parent
    if not TRAINER_STEP.search(out.name) or not folder.is_dir():
        return
    steps = {p: TRAINER_STEP.search(p.name) for p in folder.iterdir() if p.name != out.name}
    found = sorted(
        ((int(match.group(1)), p) for p, match in steps.items() if match and (p / DCP_METADATA).is_file()), reverse=True
    )
    for _, step in found[:STEPS_PROBED]:
        try:
            keys = [str(key) for key in read_dcp_metadata(step).state_dict_metadata]
        except CheckpointError:
            continue  # (not a checkpoint this can read: not a run's step)
        if any(key.split(".")[0] in TRAINING_STATE for key in keys):
            raise CheckpointError(
                f"OUT {out} would be a step of the torchtitan run checkpointed in {folder} (beside {step.name}, which "
                "holds its training state): its next restart would resume from the merge and fail on the training "
                "state a merge does not hold. Merge into a folder of its own, and load it into a run whose checkpoint "
                "folder holds no step yet with checkpoint.initial_load_path=OUT and "
                "checkpoint.initial_load_model_only=true"
            )


def carried_before(out: Path) -> set[str]:
    """The files an earlier merge into ``out`` carried there and that it can be proved to have
    written: named by the record of its weights (``_claimed``) and holding what it wrote, the
    SHA-256 its provenance recorded for each (``DIGESTS``). Only these may be replaced or removed:
    a name a file in OUT claims proves nothing (weights copied from elsewhere, or crafted, could
    name any file beside them), and shardavg 0.10 and earlier recorded no digest."""
    try:
        record = provenance_file.load(out / PROVENANCE)
    except ProvenanceError:
        return set()
    digests = record.get(DIGESTS) if record is not None else None
    if not isinstance(digests, dict):
        return set()
    return {
        name for name in _claimed(out) if isinstance(digests.get(name), str) and _digest_in(out, name) == digests[name]
    }


def _claimed(out: Path) -> set[str]:
    """The files the record of ``out``'s weights names as carried by the merge that wrote them:
    plain names in OUT, never a weight file, nor the provenance; none where the record cannot be
    read. A claim only: ``carried_before`` says which are proved."""
    try:
        record = weights_record(out)
    except (OSError, CheckpointError):
        return set()
    carried = record.carried if record is not None else ()
    return {name for name in carried if PLAIN_NAME.match(name) and not NOT_CARRIED.search(name) and name != PROVENANCE}


def _digest_in(out: Path, name: str) -> str | None:
    """The SHA-256 (hex) of the regular file ``name`` in ``out`` (never through a link), else None."""
    try:
        return _digest_of(out / name).hex()
    except (OSError, CheckpointError):
        return None


@dataclass(frozen=True)
class Planned:
    """One merged tensor: the names it is written under, and the name read from each input."""

    names: tuple[str, ...]
    held: tuple[str, ...]  # one per input
    untied: bool = False  # a name of a group some input ties and another does not


def plan_names(sources: list[Source], model_folder: bool) -> list[Planned]:
    """What to merge and under which names, in the first input's order.

    Names are grouped where any input ties them (stores them once). Every input must hold
    every group, in the same shapes. A group every input ties is merged once and written under
    every name, or, written as a model folder (``model_folder``) with a Hugging Face input, under
    the names the newest such input holds (Transformers saves a tied ``lm_head.weight`` not at all); a
    group some input holds as distinct tensors is merged name by name, a tied input giving its
    one tensor to each name."""
    groups = _tie_groups(sources)
    held = [_held(source, groups) for source in sources]
    _check_agree(sources, held)
    newest_hf = next((i for i in reversed(range(len(sources))) if isinstance(sources[i], SafetensorsSource)), None)
    plan = []
    for group, first in held[0].items():
        names = sorted(group, key=lambda n: (n not in first, first.index(n) if n in first else 0, n))
        if all(_tied(source, h[group]) for source, h in zip(sources, held)):
            written = tuple(names) if not model_folder or newest_hf is None else held[newest_hf][group]
            plan.append(Planned(written, tuple(h[group][0] for h in held)))
        else:
            untied = len(names) > 1
            plan += [Planned((n,), tuple(n if n in h[group] else h[group][0] for h in held), untied) for n in names]
    return plan


EMBEDDING = re.compile(r"(^|\.)(embed_tokens|wte|word_embeddings|tok_embeddings|embed_in|embeddings?)(\.|$)")


def _tie_saved_once(sources: list[Source]) -> None:
    """Tie, in each Hugging Face input whose config ties word embeddings, a tensor it lacks but
    another input holds (the output embedding, which Transformers saves once) to the one it holds
    in its place: the floating tensor of that shape named as an input embedding, else the one
    another input holds, equal, under both names. Nothing is tied where that is not one tensor."""
    for source in sources:
        if not isinstance(source, SafetensorsSource) or not source.ties_embeddings:
            continue
        elsewhere = {n: s.specs[n] for s in sources if s is not source for n in s.specs}
        for name in sorted(elsewhere.keys() - source.specs.keys()):
            shape = elsewhere[name].shape
            same = [n for n, spec in source.specs.items() if spec.shape == shape and spec.dtype.is_floating_point]
            found = [n for n in same if EMBEDDING.search(n)]
            if len(found) != 1:
                found = [n for n in same if any(_stored_equal(s, name, n) for s in sources if s is not source)]
            if len(found) == 1:
                source.ties = [*source.ties, (found[0], name)]


def _stored_equal(source: Source, first: str, second: str) -> bool:
    """Whether ``source`` holds both names, equal (one tensor stored twice, like a DCP checkpoint
    of a tied model)."""
    return first in source.specs and second in source.specs and _tied(source, (first, second))


def _tie_groups(sources: list[Source]) -> dict[str, frozenset[str]]:
    """``{name: its group}``: names tied in any input joined (a name alone is its own group)."""
    group = {name: frozenset([name]) for source in sources for name in source.specs}
    for source in sources:
        for tie in source.ties:
            joined = frozenset().union(*(group.get(name, frozenset([name])) for name in tie))
            for name in joined:
                group[name] = joined
    return group


def _held(source: Source, groups: dict[str, frozenset[str]]) -> dict[frozenset[str], tuple[str, ...]]:
    """``{group: the names of it this input stores}``, in the input's order."""
    found: dict[frozenset[str], tuple[str, ...]] = {}
    for name in source.specs:
        found[groups[name]] = (*found.get(groups[name], ()), name)
    return found


def _tied(source: Source, names: tuple[str, ...]) -> bool:
    """Whether the input holds one tensor for ``names``: stored once, or equal under each name
    (a DCP checkpoint of a tied model stores it under both)."""
    if len(names) == 1:
        return True
    first = source.read(names[0])
    return all(torch.equal(first, source.read(name)) for name in names[1:])


def _check_agree(sources: list[Source], held: list[dict[frozenset[str], tuple[str, ...]]]) -> None:
    """Every input holds every tensor of the first (a tied group by any of its names), in the
    same shape (floating tensors may differ in dtype, like a bf16 model and fp32 averages)."""
    first = sources[0]
    for source, holds in zip(sources[1:], held[1:]):
        missing = sorted(min(group) for group in held[0].keys() - holds.keys())
        unexpected = sorted(min(group) for group in holds.keys() - held[0].keys())
        wrong = sorted(
            f"{name}: {source.specs[name]} vs {first.specs[held[0][group][0]]}"
            for group, names in holds.items()
            if group in held[0]
            for name in names
            if not _compatible(first.specs[held[0][group][0]], source.specs[name])
        )
        if missing or unexpected or wrong:
            raise CheckpointError(
                f"{source} does not match {first}: missing {_some(missing)}, unexpected {_some(unexpected)}, "
                f"mis-shaped or of another dtype {_some(wrong)}"
            )


def _compatible(a: Spec, b: Spec) -> bool:
    if a.shape != b.shape or a.dtype.is_floating_point != b.dtype.is_floating_point:
        return False
    return a.dtype.is_floating_point or a.dtype == b.dtype


def _some(names: list[str]) -> str:
    return str(names[:8])[:-1] + (f", ... {len(names) - 8} more]" if len(names) > 8 else "]")


def _patterns(what: str, patterns: Sequence[str] | str | None) -> tuple[str, ...]:
    if patterns is None:
        return ()
    if isinstance(patterns, str) or not all(isinstance(p, str) and p for p in patterns):
        raise ValueError(f"{what} takes a list of non-empty name patterns (fnmatch), got {patterns!r}")
    return tuple(patterns)


def _selected(plan: list[Planned], include: tuple[str, ...], exclude: tuple[str, ...]) -> list[Planned]:
    """The plan's names that match an ``include`` pattern (when any is given) and no ``exclude`` one."""

    def wanted(name: str) -> bool:
        return (not include or any(fnmatchcase(name, p) for p in include)) and not any(
            fnmatchcase(name, p) for p in exclude
        )

    kept = [replace(p, names=tuple(n for n in p.names if wanted(n))) for p in plan]
    kept = [p for p in kept if p.names]
    if not kept:
        raise ValueError(f"no tensor is left to merge: include {list(include)}, exclude {list(exclude)}")
    return kept


def _weights(
    sources: list[Source],
    weights: Sequence[float] | None,
    ema: float | None,
    schedule: Schedule | None,
    normalize: bool,
    accumulate: torch.dtype = torch.float32,
) -> list[float]:
    """Each input's share: summing to 1, unless ``normalize`` is off (given weights as they are,
    within what ``accumulate`` holds)."""
    count = len(sources)
    given = [name for name, value in (("weights", weights), ("ema", ema), ("schedule", schedule)) if value is not None]
    if len(given) > 1:
        raise ValueError(f"{' and '.join(given)} each give the inputs' weights: pass one")
    if not normalize and weights is None:
        raise ValueError("normalize=False takes the weights as given: pass weights (--weights)")
    if ema is not None or schedule is not None:
        unknown = [str(s) for s in sources if s.step is None]
        if unknown:
            raise CheckpointError(f"{given[0]} weights need each input's step; these record none: {unknown}")
        steps = [s.step for s in sources]
        if len(set(steps)) < len(steps):
            raise CheckpointError(f"{given[0]} weights need distinct steps; the inputs' steps are {steps}")
    if ema is not None:
        if isinstance(ema, bool) or not isinstance(ema, (int, float)) or not 0.0 < ema < 1.0:
            raise ValueError(f"ema must be a decay in (0, 1), got {ema!r}")
        newest = max(s.step for s in sources)  # type: ignore[type-var]
        weights = [ema ** (newest - s.step) for s in sources]  # type: ignore[operator]
    if schedule is not None:
        return schedule_weights(schedule, [s.step for s in sources])  # type: ignore[misc]
    if weights is None:
        return [1.0 / count] * count
    weights = list(weights)
    if len(weights) != count:
        raise ValueError(f"{len(weights)} weights for {count} inputs: give one per input")
    numbers = (isinstance(w, (int, float)) and not isinstance(w, bool) for w in weights)
    if not all(numbers) or not all(math.isfinite(w) for w in weights):
        raise ValueError(f"weights must be finite numbers, got {weights}")
    if not normalize:
        largest = torch.finfo(accumulate).max
        if any(abs(w) > largest for w in weights):
            raise ValueError(
                f"weights {weights} reach beyond {dtype_name(accumulate)}'s range (up to {largest:.6g}), in which the "
                "merge accumulates: give smaller weights, or accumulate in float64 (--accumulate float64)"
            )
        return [float(w) for w in weights]
    if not all(w >= 0 for w in weights):
        raise ValueError(f"weights must be >= 0 to be normalised, got {weights}: pass normalize=False (--raw-weights)")
    top = max(weights)
    if top > sys.float_info.max / count:  # (their sum would overflow: the same shares, scaled down)
        weights = [w / top for w in weights]
    total = math.fsum(weights)
    if not total > 0:
        raise ValueError(f"weights {weights} sum to {total}: at least one must be positive")
    return [w / total for w in weights]


Schedule = Literal["linear", "cosine", "minus-sqrt"]
DECAYS: dict[str, Callable[[float], float]] = {  # the learning rate's multiplier at progress x of the window
    "linear": lambda x: 1.0 - x,
    "cosine": lambda x: 0.5 * (1.0 + math.cos(math.pi * x)),
    "minus-sqrt": lambda x: 1.0 - math.sqrt(x),
}


def schedule_weights(schedule: Schedule, steps: Sequence[int]) -> list[float]:
    """The weights of checkpoints taken at ``steps`` (under a constant learning rate) whose average
    is the model a decay of the learning rate by ``schedule`` over those steps would give (WSM).

    The average sum(c_i x_i) moves from the weights before the window by the sum over segments of
    (the weights of checkpoints at or after the segment) times (the segment's update), so it
    gives segment i the learning-rate multiplier c_i + ... + c_n. Setting that to the decay at
    the segment's start, ``decay(x_{i-1})``, gives c_i = decay(x_{i-1}) - decay(x_i), where x_i
    is checkpoint i's progress through the window. The window starts one interval (the
    checkpoints' mean spacing) before the oldest step and ends at the newest, so evenly spaced
    checkpoints sit at x_i = i / n. The weights sum to decay(0) - decay(1) = 1."""
    if schedule not in DECAYS:
        raise ValueError(f"schedule must be one of {sorted(DECAYS)}, got {schedule!r}")
    order = sorted(range(len(steps)), key=lambda i: steps[i])
    ordered = [steps[i] for i in order]
    spacing = (ordered[-1] - ordered[0]) / (len(ordered) - 1) if len(ordered) > 1 else 1.0
    start, end = ordered[0] - spacing, ordered[-1]
    progress = [0.0] + [(step - start) / (end - start) for step in ordered]
    decay = DECAYS[schedule]
    weights = [0.0] * len(steps)
    for position, index in enumerate(order):
        weights[index] = decay(progress[position]) - decay(progress[position + 1])
    return weights


def _output_spec(planned: Planned, sources: list[Source], dtype: torch.dtype | None) -> Spec:
    """The merged tensor's dtype: ``dtype`` for floating tensors, else the inputs' when they agree,
    else fp32; integer tensors keep theirs."""
    found = {source.specs[name].dtype for source, name in zip(sources, planned.held)}
    first = sources[0].specs[planned.held[0]]
    if not first.dtype.is_floating_point or dtype is not None:
        return Spec(cast_dtype(first.dtype, dtype), first.shape)
    return Spec(found.pop() if len(found) == 1 else torch.float32, first.shape)


@dataclass(frozen=True)
class Merging:
    """What every writer merges: the inputs and their weights (``shares``), the tensors planned and
    their output specs, and the dtype sums accumulate in."""

    sources: list[Source]
    shares: list[float]
    plan: list[Planned]
    specs: list[Spec]
    accumulate: torch.dtype

    def merged(self, pieces: Iterable[Work]) -> Iterator[torch.Tensor]:
        """Each piece merged in turn: ``sum(w_i * x_i)`` accumulated in input order, then cast (an
        overflow of the output dtype refused by name). Nothing is kept from one piece to the next."""
        for piece in pieces:
            planned, spec = self.plan[piece.index], self.specs[piece.index]
            if spec.dtype.is_floating_point:
                merged = torch.zeros(rows_shape(spec.shape, piece.rows), dtype=self.accumulate)
                for source, name, share in zip(self.sources, planned.held, self.shares):
                    merged.add_(source.read(name, piece.rows).to(self.accumulate).mul_(share))
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
        average = all(w >= 0 for w in self.shares) and abs(math.fsum(self.shares) - 1.0) <= 1e-9

        def narrowed(piece: Work) -> bool:
            planned, spec = self.plan[piece.index], self.specs[piece.index]
            return spec.dtype.is_floating_point and any(
                torch.finfo(spec.dtype).max < torch.finfo(source.specs[name].dtype if average else self.accumulate).max
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
    sources, shares = merging.sources, merging.shares
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
            for planned, spec in zip(merging.plan, merging.specs)
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
        holding = {model: _digest_of(files[name]) for model, files in zip(models, carried) if name in files}
        if len(set(holding.values())) > 1:
            last = list(holding)[-1]
            differ = next(model for model, digest in holding.items() if digest != holding[last])
            raise CheckpointError(
                f"the inputs disagree on the tokenizer: {name} of {differ} differs from {last}'s; a merge of models "
                "with different tokenizers is not one model"
            )


def _digest_of(file: Path) -> bytes:
    with os.fdopen(open_regular(file), "rb") as handle:
        return hashlib.file_digest(handle, "sha256").digest()


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


def _made(
    sources: list[Source],
    shares: list[float],
    schedule: Schedule | None,
    dtype: torch.dtype | None,
    workers: int,
    output: Output = "safetensors",
) -> dict:
    """The merge's provenance, made before anything is written (so that nothing an input holds can
    fail it afterwards): each input's path, step, weight, run and manifest digest, the provenance
    it recorded, where it can be read (``_input_made``), and the groups of its entries left out
    (``{group: entries}``: an optimizer, rng state); a DCP output's format (``"output"``)."""
    inputs = [_input_made(source, share) for source, share in zip(sources, shares)]
    for record, source in zip(inputs, sources):
        if source.left_out:
            record["left_out"] = dict(source.left_out)
    written = None if dtype is None else dtype_name(dtype)
    details = {"output": output} if output == "dcp" else {}
    return made_by("merge", workers, schedule=schedule, dtype=written, inputs=inputs, **details)


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


def _log_done(sources: list[Source], plan: list[Planned], out: Path) -> None:
    untied = sorted(n for p in plan if p.untied for n in p.names)
    if untied:
        log.warning("%s: the inputs disagree on tying %s; each name merged on its own, written untied", out, untied)
    for source in sources:
        if source.left_out:
            skipped = ", ".join(f"{count} under {key!r}" for key, count in source.left_out.items())
            log.info("%s: merged its %d model tensors; left out %s", source, len(source.specs), skipped)
