"""A Hugging Face model folder: which files are its weights, the record of how shardavg made them
(``read_record``), which files travel beside them, and the dtype its ``config.json`` declares.

Transformers' conventions decide. The weights are ``model.safetensors`` or the files that
``model.safetensors.index.json`` names; a PEFT adapter (``adapter_model.safetensors``) is not
the model, and pickled weights (``pytorch_model.bin``) are never read. Everything else a folder
holds for ``from_pretrained`` and the tokenizer (``config.json``, ``generation_config.json``,
tokenizer files, a chat template) is carried to a merge of it, and ``config.json`` is made to
declare the dtype of the files written beside it: ``from_pretrained`` loads in that dtype.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from ..base.dtypes import dtype_name
from ..base.errors import CheckpointError
from ..base.untrusted import parse_json
from ..checkpoints.format import DCP_METADATA, MANIFEST, WEIGHTS_FILE, WEIGHTS_INDEX
from ..checkpoints.storage import SafetensorsFile, atomic_file, safetensors_metadata
from . import provenance
from .record import FolderRecord
from .weight_files import check_one_export

CONFIG = "config.json"
# Files a merge does not carry: weights of any kind, adapters, hidden files, training state (a
# Trainer's, DeepSpeed's, the main job's) and the model card (it describes the model merged from).
NOT_CARRIED = re.compile(
    r"(\.(safetensors|bin|pt|pth|ckpt|h5|msgpack|gguf|onnx|distcp)|\.index\.json)$|^adapter_|^\.|^shardavg"
    r"|^(README\.md|trainer_state\.json|train\.json|latest|zero_to_fp32\.py)$"
)
PICKLED_WEIGHTS = re.compile(
    r"^(pytorch_model|model|tf_model|flax_model)(-\d{5}-of-\d{5})?\.(bin|pt|pth|ckpt|h5|msgpack)$"
)
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt",
    "merges.txt", "special_tokens_map.json", "added_tokens.json", "chat_template.jinja", "chat_template.json",
)  # fmt: skip
DTYPE_KEYS = ("dtype", "torch_dtype")  # Transformers >= 4.56 writes the first, earlier releases the second


def weights_of(folder: Path) -> Path:
    """The model's weights in ``folder``: ``model.safetensors``, else its index (the order
    Transformers looks in), else the one safetensors index or file there."""
    for name in (WEIGHTS_FILE, WEIGHTS_INDEX):
        if (folder / name).is_file():
            return folder / name
    indexes = sorted(p for p in folder.glob("*.safetensors.index.json") if not _adapter_or_hidden(p))
    files = sorted(p for p in folder.glob("*.safetensors") if not _adapter_or_hidden(p))
    if len(indexes) == 1:
        return indexes[0]
    if len(indexes) > 1:
        raise CheckpointError(f"{folder} holds several indexes {[p.name for p in indexes]}: name the model's index")
    if len(files) == 1:
        return files[0]
    if len(files) > 1:
        raise CheckpointError(
            f"{folder} holds {len(files)} safetensors files ({', '.join(p.name for p in files[:4])}) and no "
            f"{WEIGHTS_INDEX}: name the model's file"
        )
    pickled = sorted(p.name for p in folder.iterdir() if PICKLED_WEIGHTS.match(p.name))
    if pickled:
        raise CheckpointError(
            f"{folder} holds its weights as {pickled[0]}, a pickle, which shardavg never loads (loading it runs code "
            "from the file): convert it once where you trust it, e.g. Transformers' "
            "from_pretrained(folder).save_pretrained(new_folder, safe_serialization=True), and merge that"
        )
    adapters = sorted(p.name for p in folder.glob("adapter_model*"))
    if adapters:
        raise CheckpointError(
            f"{folder} holds a PEFT adapter ({adapters[0]}), not a model: merge it into its base model first "
            "(peft's merge_and_unload, then save_pretrained) and merge that"
        )
    raise CheckpointError(f"{folder} holds no {WEIGHTS_FILE} or {WEIGHTS_INDEX}")


def _adapter_or_hidden(path: Path) -> bool:
    return path.name.startswith(("adapter_", "."))


def carried_files(folder: Path) -> list[str]:
    """The names of the files a merge of ``folder`` carries (every regular file, or link to one as
    in the Hugging Face cache, but weights, adapters, hidden files and the model card), sorted."""
    return sorted(p.name for p in folder.iterdir() if p.is_file() and not NOT_CARRIED.search(p.name))


def folder_export_id(folder: Path, follow_links: bool = False) -> str | None:
    """The export id of the model folder ``folder``'s weights (None where they carry none, as
    files older than export ids or not shardavg's); refused (``check_one_export``) where its
    index and files belong to different exports. A reader that opens the files itself checks the
    metadata of those it holds open with ``check_one_export`` instead. ``follow_links``: read
    through links (the Hugging Face cache's)."""
    weights = weights_of(folder)
    if not weights.name.endswith(".index.json"):
        with SafetensorsFile.open(weights, follow_links=follow_links) as file:
            return check_one_export([(str(weights), file.metadata)])
    try:
        index = parse_json(weights.read_text(), weights)
        names = sorted(set(index["weight_map"].values()))
        metadata = index.get("metadata")
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as error:
        raise CheckpointError(f"cannot read {weights}: {error}") from None
    if not all(isinstance(name, str) and name not in ("", ".", "..") and Path(name).name == name for name in names):
        raise CheckpointError(f"{weights}: 'weight_map' must map tensor names to file names in its folder")
    found: list[tuple[str, Any]] = [(str(weights), metadata)]
    for name in names:
        with SafetensorsFile.open(folder / name, follow_links=follow_links) as file:
            found.append((str(folder / name), file.metadata))
    return check_one_export(found)


def weights_record(folder: Path) -> FolderRecord | None:
    """The record the weights shardavg wrote into ``folder`` carry (a split model's index's, else
    ``model.safetensors``'), without what lies beside them; None where they carry none."""
    index = folder / WEIGHTS_INDEX
    try:
        if index.is_file():
            content = parse_json(index.read_text(), index)
            metadata = content.get("metadata") if isinstance(content, dict) else None
        else:
            metadata = safetensors_metadata(folder / WEIGHTS_FILE)
    except (OSError, ValueError) as error:  # (a CheckpointError too: a truncated header)
        raise CheckpointError(f"cannot read the record of {folder}'s weights: {error}") from None
    return FolderRecord.from_metadata(metadata, where=index if index.is_file() else folder / WEIGHTS_FILE)


def read_record(folder: Path) -> FolderRecord | None:
    """How the model folder ``folder`` was made: its weights' record (``weights_record``), their
    export id (checked to be one export's: ``folder_export_id``) and the provenance beside them
    (``provenance.read``); None where its weights are not shardavg's.

    Raises:
        CheckpointError: a file that cannot be read, weights of two exports, or a provenance
            shardavg did not write (a ``ProvenanceError``), in one line naming the file.
    """
    record = weights_record(folder)
    if record is None:
        return None
    return replace(record, export_id=folder_export_id(folder), provenance=provenance.read(folder))


def is_model_folder(path: Path) -> bool:
    """A folder of safetensors weights (an export, a merge), not a checkpoint."""
    has_weights = (path / WEIGHTS_FILE).is_file() or (path / WEIGHTS_INDEX).is_file()
    return path.is_dir() and has_weights and not (path / MANIFEST).exists() and not (path / DCP_METADATA).exists()


def folder_summary(path: Path) -> tuple[list[tuple[str, str]], list[str]]:
    """What ``shardavg inspect`` says of the model folder ``path``: ``(label, value)`` rows (its
    weight files, export id and provenance), and a line for each file that cannot be read (a
    missing file, weights of two exports, a crafted ``provenance.json``): what can be read is
    said all the same."""
    weights = sorted(p.name for p in path.glob("model*.safetensors"))
    problems, size = [], 0
    for name in weights:
        try:
            size += (path / name).stat().st_size
        except OSError as error:
            problems.append(f"cannot read {path / name}: {error.strerror}")
    rows = [("model", str(path)), ("files", f"{len(weights)} weight file(s), {size} bytes")]
    try:
        export_id = folder_export_id(path) if weights else None
    except (CheckpointError, OSError) as error:  # (a mix of two exports, a missing file)
        problems.append(str(error))
    else:
        rows.append(("export", export_id or "no export id (not written by shardavg 0.8+)"))
    try:
        record = provenance.read(path)
    except CheckpointError as error:
        problems.append(str(error))
        lines = ["unreadable (the error below)"]
    else:
        lines = provenance.shown(record) if record is not None else ["none recorded (not written by shardavg 0.6+)"]
    return rows + [("provenance", line) for line in lines], problems


def files_dtype(dtypes: Iterable[tuple[torch.dtype, int]]) -> torch.dtype | None:
    """The dtype of the most floating elements among ``(dtype, numel)`` pairs: what a model folder
    of these tensors declares (Transformers takes one dtype for the whole model)."""
    counts: Counter[torch.dtype] = Counter()
    for dtype, numel in dtypes:
        if dtype.is_floating_point:
            counts[dtype] += numel
    return counts.most_common(1)[0][0] if counts else None


def folder_dtype(folder: Path) -> torch.dtype | None:
    """The dtype of most floating elements in the weight files of the model folder ``folder``."""
    index = folder / WEIGHTS_INDEX
    names = (
        sorted(set(parse_json(index.read_text(), index)["weight_map"].values())) if index.is_file() else [WEIGHTS_FILE]
    )
    found: list[tuple[torch.dtype, int]] = []
    for name in names:
        with SafetensorsFile.open(folder / name) as file:
            found += [(stored.dtype, math.prod(stored.shape)) for stored in file.tensors.values()]
    return files_dtype(found)


def declared(config: dict[str, Any], dtype: torch.dtype | None, untied: bool) -> dict[str, Any]:
    """``config`` declaring ``dtype`` (under the key its Transformers version reads, and in every
    nested sub-model config that declares one), and untied word embeddings when ``untied``."""
    config = dict(config)
    if dtype is not None:
        keys = [key for key in DTYPE_KEYS if key in config] or [_dtype_key(config.get("transformers_version"))]
        for key in keys:
            config[key] = dtype_name(dtype)
        for key, value in config.items():
            if isinstance(value, dict) and any(k in value for k in DTYPE_KEYS):
                config[key] = declared(value, dtype, untied=False)
    if untied:
        config["tie_word_embeddings"] = False
    return config


def _dtype_key(version: Any) -> str:
    """``dtype`` from Transformers 4.56 on (and when the version is unknown), ``torch_dtype`` before."""
    match = re.match(r"^(\d+)\.(\d+)", version) if isinstance(version, str) else None
    return "torch_dtype" if match and (int(match[1]), int(match[2])) < (4, 56) else "dtype"


def configured(source: Path, dtype: torch.dtype | None, untied: bool = False) -> bytes:
    """The ``config.json`` at ``source`` declaring ``dtype``: its bytes unchanged when it already
    does, else rewritten as Transformers writes it (2-space indent). Made before it is written, so
    that a merge can record what it writes (its digest) beside the weights written first."""
    raw = source.read_bytes()
    try:
        config = parse_json(raw, source)
    except ValueError as error:
        raise CheckpointError(f"{source} is not JSON: {error}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{source} is not a model config (a JSON object)")
    wanted = declared(config, dtype, untied)
    return raw if wanted == config else (json.dumps(wanted, indent=2) + "\n").encode()


def write_config(source: Path, target: Path, dtype: torch.dtype | None, untied: bool = False) -> None:
    """Copy the ``config.json`` at ``source`` to ``target`` atomically, declaring ``dtype`` (``configured``)."""
    text = configured(source, dtype, untied)
    with atomic_file(target) as handle:
        handle.write(text)


def declare_dtype(folder: Path, untied: bool = False) -> None:
    """Make ``folder/config.json`` declare the dtype of the weight files beside it (an export
    in fp32 of a bf16 model would otherwise load as bf16)."""
    config = folder / CONFIG
    if config.is_file() and not config.is_symlink():
        write_config(config, config, folder_dtype(folder), untied)
