"""The write options declared once (``output.write_options``): every keyword that takes one defaults to
its declaration, every command's flag is made from it, and a bad value is refused naming it, wherever
it enters."""

from __future__ import annotations

import argparse
import inspect
from dataclasses import fields

import pytest
import torch

import shardavg
from shardavg import cli
from shardavg.offline.saved_average import SavedAverage
from shardavg.output.write_options import DEFAULTS, WriteOptions, add_flags, from_args
from shardavg.posthoc import export_synthesized

TAKERS = {  # each public writer and the write options it takes
    shardavg.WeightAverager.export: ("max_shard_size", "dtype", "writers"),
    SavedAverage.export: ("max_shard_size", "dtype"),
    export_synthesized: ("max_shard_size", "dtype"),
    shardavg.merge: ("max_shard_size", "dtype", "output", "iteration"),
}
COMMANDS = {  # each command, a command line of it, and the write options it takes
    "export": (["export", "ckpt", "out"], cli.EXPORT_OPTIONS),
    "posthoc": (["posthoc", "snapshots", "out", "--sigma-rel", "0.1"], cli.POSTHOC_OPTIONS),
    "merge": (["merge", "a", "b", "--out", "out"], cli.MERGE_OPTIONS),
}


@pytest.mark.parametrize("taker", list(TAKERS), ids=lambda f: f.__qualname__)
def test_every_keyword_defaults_to_the_declaration(taker) -> None:
    parameters = inspect.signature(taker).parameters
    for name in TAKERS[taker]:
        assert parameters[name].default == getattr(DEFAULTS, name), (taker, name)


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_command_line_flag_is_made_from_the_declaration(command: str) -> None:
    argv, names = COMMANDS[command]
    args = cli._parser().parse_args(argv)
    assert from_args(args, names) == {name: getattr(DEFAULTS, name) for name in names}
    given = cli._parser().parse_args([*argv, "--dtype", "bfloat16", "--max-shard-size", "300"])
    assert from_args(given, names)["dtype"] is torch.bfloat16 and from_args(given, names)["max_shard_size"] == "300"


def test_a_bad_value_is_refused_naming_the_option() -> None:
    refusals = {
        "max_shard_size": ("lots", "max_shard_size must be a positive size up to 4 EiB"),
        "dtype": (torch.int32, "dtype must be a floating torch.dtype"),
        "writers": (0, "writers must be an int >= 1 or None"),
        "output": ("zip", "unknown output 'zip'"),
        "iteration": (0, "iteration must be an int >= 1"),
    }
    assert sorted(refusals) == sorted(spec.name for spec in fields(WriteOptions))  # (every option checked)
    for name, (value, message) in refusals.items():
        with pytest.raises(ValueError, match=message):
            WriteOptions(**{name: value})
    assert WriteOptions(max_shard_size="500MiB").max_bytes == 500 * 2**20


def test_a_command_words_an_unset_default_its_own_way() -> None:
    parser = argparse.ArgumentParser()
    add_flags(parser, ("dtype", "max_shard_size"), unset={"dtype": "as saved"})
    shown = " ".join(parser.format_help().split())
    assert "cast floating tensors (default: as saved)" in shown, shown
    assert f"largest file before splitting, e.g. 2GB or 500MiB (default {DEFAULTS.max_shard_size})" in shown, shown
    assert "--writers" not in shown and "--format" not in shown  # (only the options named)
