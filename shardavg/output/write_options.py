"""How a model is written, each option declared once: the largest file, the dtype, the writers,
the output's format and (a Megatron-LM run folder) its iteration.

An option is one field of ``WriteOptions``: its type, its default, the check it passes where it
enters, and its command-line option (``flag``: argparse's keywords, and how a parsed value
becomes the option's), with its docstring. ``avg.export``, ``shardavg export``, ``posthoc`` and
``merge`` take their keywords of these names with the defaults of ``DEFAULTS`` and check them by
building ``WriteOptions``; the command line makes each command's options from here
(``add_flags``, ``from_args``). Adding a field here is adding a write option.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal, get_args

import torch

from ..base import validate
from ..base.dtypes import DTYPES
from .megatron_run import check_iteration
from .model_writer import parse_size

Output = Literal["safetensors", "shardavg", "dcp"]
DTYPE_NAMES = ("float32", "bfloat16", "float16")  # the output dtypes the command line offers

Check = Callable[[str, Any], Any]  # (name, value) -> the value kept, or ValueError naming the option


def write_option(default: Any, check: Check, flag: Mapping[str, Any] | None = None) -> Any:
    """Declare one field of ``WriteOptions``.

    Args:
        default: The value when the option is not given.
        check: Called with the option's name and value where it enters; returns the value kept or
            raises ``ValueError`` naming it.
        flag: Its command-line option: argparse's keywords (``help`` may hold ``{default}``, which
            each command words for itself, ``add_flags``), ``"option"`` its name where it is not the
            field's (``--max-shard-size`` for ``max_shard_size``), ``"parse"`` how a parsed value
            becomes the option's (default: as parsed). None: no command takes it.

    Returns:
        The dataclass field.
    """
    return field(default=default, metadata={"check": check, "flag": flag})


def _size(name: str, value: Any) -> int | str:
    parse_size(value)  # (refused here, naming max_shard_size, before anything is written)
    return value


def _floating_dtype(name: str, value: Any) -> torch.dtype | None:
    validate.floating_dtype(name, value)
    return value


def _writers(name: str, value: Any) -> int | None:
    validate.count(name, value, 1, optional=True)
    return value


def _output(name: str, value: Any) -> str:
    validate.choice(name, value, Output)
    return value


def _iteration(name: str, value: Any) -> int | None:
    return None if value is None else check_iteration(value)


@dataclass(frozen=True, kw_only=True)
class WriteOptions:
    """How a model is written: the options ``avg.export``, ``shardavg export``, ``posthoc`` and
    ``merge`` take (each the ones that apply to it), declared and documented here once.

    Raises:
        ValueError: An option out of its range or not one of its choices, naming it.
    """

    max_shard_size: int | str = write_option(
        "5GB", _size, {"help": "largest file before splitting, e.g. 2GB or 500MiB (default {default})"}
    )
    """Above this size (bytes, or a string such as ``"2GB"``, ``"500MiB"``) the Hugging Face sharded
    layout (files and an index) is written. Not for an averager's checkpoint or a DCP output."""

    dtype: torch.dtype | None = write_option(
        None, _floating_dtype,
        {
            "choices": DTYPE_NAMES, "help": "cast floating tensors (default: {default})",
            "parse": lambda name: None if name is None else DTYPES[name],
        },
    )  # fmt: skip
    """Cast floating tensors to this dtype; None: each writer's own default (as saved, as averaged,
    the inputs' dtype). Integer tensors keep theirs."""

    writers: int | None = write_option(None, _writers)
    """``avg.export``: ``k`` ranks spread over the world receive and write everything; ``1``: rank 0
    alone, for a file system that cannot take concurrent writers; None: every rank."""

    output: Output = write_option(
        "safetensors", _output,
        {
            "option": "--format", "choices": get_args(Output),
            "help": "a model folder (default); an averager's checkpoint that avg.load restores at any world size; or a "
            "DCP checkpoint under the inputs' keys that their trainer loads back (from Megatron-Core inputs with "
            "metadata.json, the common state and *._extra_state carried, as a Megatron-LM run folder: "
            "OUT/iter_NNNNNNN and latest_checkpointed_iteration.txt; load it with --load OUT --no-load-optim "
            "--no-load-rng)",
        },
    )  # fmt: skip
    """``merge``: ``"safetensors"`` (a model folder), ``"shardavg"`` (an averager's checkpoint) or
    ``"dcp"`` (a ``torch.distributed.checkpoint`` folder the inputs' trainer loads)."""

    iteration: int | None = write_option(
        None, _iteration,
        {
            "type": int, "metavar": "N",
            "help": "with --format dcp of Megatron-Core inputs, the iteration OUT/iter_NNNNNNN holds the merge as, "
            "which latest_checkpointed_iteration.txt names (default: the newest input's)",
        },
    )  # fmt: skip
    """``merge`` of Megatron-Core inputs written as DCP: the iteration of the Megatron-LM run folder
    written (``OUT/iter_NNNNNNN``); None: the newest input's step."""

    def __post_init__(self) -> None:
        for spec in fields(self):
            object.__setattr__(self, spec.name, spec.metadata["check"](spec.name, getattr(self, spec.name)))

    @property
    def max_bytes(self) -> int:
        """``max_shard_size`` in bytes."""
        return parse_size(self.max_shard_size)


DEFAULTS = WriteOptions()  # every write option's default: the defaults of the keywords that take them


def add_flags(parser: argparse.ArgumentParser, names: Sequence[str], unset: Mapping[str, str] | None = None) -> None:
    """Add the command-line options of the write options ``names`` to a command's ``parser``, each
    from its declaration: its name, default and help (its ``{default}`` the default, or how this
    command words a default of None: ``unset``, ``{"dtype": "as saved"}``)."""
    for spec in (spec for spec in fields(WriteOptions) if spec.name in names):
        flag = dict(spec.metadata["flag"])
        option = flag.pop("option", f"--{spec.name.replace('_', '-')}")
        flag.pop("parse", None)
        said = (unset or {}).get(spec.name, str(spec.default))
        flag["help"] = flag["help"].replace("{default}", said)
        parser.add_argument(option, dest=spec.name, default=spec.default, **flag)


def from_args(args: argparse.Namespace, names: Sequence[str]) -> dict[str, Any]:
    """The write options ``names`` a parsed command line gives, as keywords (each parsed value made
    the option's by its declaration's ``parse``)."""
    found = {}
    for spec in (spec for spec in fields(WriteOptions) if spec.name in names):
        parse = spec.metadata["flag"].get("parse", _itself)
        found[spec.name] = parse(getattr(args, spec.name))
    return found


def _itself(value: Any) -> Any:
    return value
