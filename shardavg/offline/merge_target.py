"""Where a merge may write: OUT checked before anything is read (``check_out_of_merge``) and, once the
inputs say what the output is, again for a DCP output (``check_dcp_out``); and what of an earlier
merge into a model folder it may replace (``carried_before``: only what it can prove it wrote).

OUT is a folder of its own: not an input, inside one, or holding one, nor inside any checkpoint;
new, empty, or holding nothing but an earlier merge (or export) of shardavg's in the same format;
never a step of a torchtitan run (whose next restart would resume from the merge), nor a Megatron-LM
run's own folder (``output.megatron_run``).
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

from ..base.errors import CheckpointError, ProvenanceError
from ..checkpoints.format import DCP_METADATA
from ..checkpoints.ownership import LOCK_FILE, target_path
from ..checkpoints.storage import open_regular
from ..output import dcp_checkpoint, megatron_run
from ..output import provenance as provenance_file
from ..output.model_folder import NOT_CARRIED, weights_record
from ..output.provenance import FILE as PROVENANCE
from ..output.target import check_out
from ..output.write_options import Output, WriteOptions
from .saved_average import PLAIN_NAME, read_dcp_metadata

HF_CONFIGS = ("config.json", "generation_config.json")  # what merges before 0.4 carried, unrecorded
DIGESTS = "carried"  # the provenance's {name: SHA-256} of each file a merge carried: how a later merge knows them
TRAINER_STEP = re.compile(r"step-(\d+)")  # a step torchtitan resumes from: a folder whose name holds it (re.search)
TRAINING_STATE = ("train_state", "dataloader")  # torchtitan's entries beside the model in a step it saves
STEPS_PROBED = 3  # the newest steps beside OUT read for training state (a run's last save may be its model alone)


def check_out_of_merge(out: str | os.PathLike, inputs: list[Path], output: Output) -> None:
    """OUT names a folder of its own: not an input, inside one, or holding one (which its writing
    could replace), nor inside any checkpoint; new, empty, or holding nothing but an earlier
    merge (or export) of shardavg's in the same format, which it replaces."""
    weights = check_out(out, "merge", inputs, replaces_checkpoint=output != "safetensors")  # (all shardavg's)
    _check_not_a_trainer_step(Path(out))
    if output == "dcp":  # (replaced whole, by a staged folder swapped into place: a name of its own)
        target_path(out, "merge", replaced_whole=True)
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


def check_dcp_out(out: Path, write: WriteOptions) -> None:
    """A DCP output's OUT, once the inputs say which it is: a Megatron-LM run folder (an iteration),
    new or holding only merges (``megatron_run.check_replaceable``), else a DCP folder, new or an
    earlier merge (``dcp_checkpoint.check_replaceable``)."""
    if write.output == "dcp" and write.iteration is not None:
        megatron_run.check_replaceable(out)
    elif write.output == "dcp":
        dcp_checkpoint.check_replaceable(out)


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
        return digest_of(out / name).hex()
    except (OSError, CheckpointError):
        return None


def digest_of(file: Path) -> bytes:
    with os.fdopen(open_regular(file), "rb") as handle:
        return hashlib.file_digest(handle, "sha256").digest()
