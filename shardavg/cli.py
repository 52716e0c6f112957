"""``shardavg export | inspect | posthoc | merge``: work with checkpoints offline.

Runs in one process without a process group, reading one tensor at a time, on checkpoints
written by ``avg.save``, on the averager entry of a ``torch.distributed.checkpoint``, on
post-hoc EMA snapshots, and (``merge``) on model checkpoints of several kinds.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import logging
import os
import sys
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, NoReturn

import torch

from . import provenance
from .errors import CheckpointError
from .export import export_metadata, write_model
from .format import DCP_METADATA, MANIFEST, WEIGHTS_FILE, WEIGHTS_INDEX, Description, TensorEntry
from .logs import log
from .offline import SavedAverage
from .provenance import made_by, of_input
from .storage import DTYPES, dtype_name
from .weight_files import check_output_folder

EXPORT_DTYPES = ("float32", "bfloat16", "float16")


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage mistake reported in one line like every other error."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"shardavg: error: {self.prog}: {message} (see {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="shardavg",
        description="Work with shardavg checkpoints offline: one process, no process group, "
        "one tensor in memory at a time.",
        epilog="CKPT_DIR is a directory written by avg.save() (a checkpoint, or the parent of step-* "
        "checkpoints, of which the newest committed one is used), or a torch.distributed.checkpoint "
        "directory holding an averager under --key.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    export = commands.add_parser(
        "export",
        help="write the full averaged model as safetensors",
        description="Consolidate the averaged weights into OUT (a directory): model.safetensors, or "
        "model-0000k-of-0000N.safetensors files with model.safetensors.index.json above --max-shard-size. "
        "Keys are the plain model's parameter and buffer names, so the result loads with strict=True.",
    )
    export.add_argument("checkpoint", metavar="CKPT_DIR")
    export.add_argument("out", metavar="OUT")
    export.add_argument(
        "--max-shard-size", default="5GB", help="largest file before splitting, e.g. 5GB or 500MiB (default 5GB)"
    )
    export.add_argument(
        "--dtype", choices=EXPORT_DTYPES, help="cast floating tensors (default: as saved, fp32 averages)"
    )
    export.add_argument("--key", default="ema", help="the averager's key in a DCP checkpoint (default ema)")
    export.add_argument("--average", metavar="NAME", help="which average, when the averager kept several (see inspect)")
    export.add_argument(
        "--verify", action="store_true", help="first hash every file against the SHA-256 recorded when it was written"
    )
    inspect = commands.add_parser(
        "inspect",
        help="print what a checkpoint holds",
        description="Print step, num_updates, the averages and their rules, source strategy and world size, "
        "tensor count and bytes.",
    )
    inspect.add_argument("checkpoint", metavar="CKPT_DIR")
    inspect.add_argument("--key", default="ema", help="the averager's key in a DCP checkpoint (default ema)")
    inspect.add_argument(
        "--verify",
        action="store_true",
        help="also hash every file and compare it with the SHA-256 recorded when it was written",
    )
    posthoc = commands.add_parser(
        "posthoc",
        help="synthesize a post-hoc EMA from PostHocEMA snapshots",
        description="Combine the snapshots in DIR (written by shardavg.PostHocEMA at any world size) into the "
        "power-function EMA of --sigma-rel at --step (EDM2's post-hoc EMA) and write it to OUT as safetensors, "
        "one tensor at a time; or --list the snapshots and the sigma_rel range they synthesize well.",
    )
    posthoc.add_argument("snapshots", metavar="DIR")
    posthoc.add_argument("out", metavar="OUT", nargs="?")
    posthoc.add_argument("--sigma-rel", type=float, help="the profile's relative width, e.g. 0.08")
    posthoc.add_argument("--step", type=int, help="a snapshot's training step (default: the last snapshot's)")
    posthoc.add_argument("--dtype", choices=EXPORT_DTYPES, help="cast floating tensors (default fp32)")
    posthoc.add_argument("--max-shard-size", default="5GB", help="largest file before splitting (default 5GB)")
    posthoc.add_argument("--list", action="store_true", help="print the snapshots instead")
    _merge_parser(commands)
    return parser


def _merge_parser(commands: Any) -> None:  # (argparse's subparsers action)
    merge = commands.add_parser(
        "merge",
        help="average checkpoints already on disk (uniform, weighted, last K, EMA over steps)",
        description="Write the weighted average of checkpoints IN to OUT, one tensor at a time in fp32: "
        "shardavg checkpoints (any average), DCP checkpoints (their --prefix tensors, or an averager with --key), "
        "Hugging Face safetensors models; freely mixed when names and shapes agree, written at any world size. "
        "Integer tensors come from the last input. Every input and OUT are checked before anything is written.",
        epilog="A DeepSpeed ZeRO checkpoint is refused (its states are pickles): convert it with zero_to_fp32.py "
        "--safe_serialization first.",
    )
    merge.add_argument("inputs", metavar="IN", nargs="*", help="checkpoints, oldest first")
    merge.add_argument("--out", required=True, metavar="OUT", help="the folder to write")
    weighting = merge.add_mutually_exclusive_group()
    weighting.add_argument("--weights", type=float, nargs="+", metavar="W", help="one per input, normalised to sum 1")
    weighting.add_argument(
        "--ema", type=float, metavar="DECAY", help="weight step s by DECAY**(newest - s): an EMA over the saved steps"
    )
    weighting.add_argument(
        "--schedule", choices=("linear", "cosine", "minus-sqrt"),
        help="the weights that make the merge what this learning-rate decay over the inputs' steps gives (WSM)",
    )  # fmt: skip
    merge.add_argument(
        "--raw-weights", action="store_true",
        help="take --weights as given, not normalised to sum 1 (negative ones too: task arithmetic)",
    )  # fmt: skip
    merge.add_argument(
        "--last", nargs=2, metavar=("K", "RUN_DIR"), help="merge the newest K finished checkpoints of RUN_DIR"
    )
    merge.add_argument("--average", metavar="NAME", help="which average of a shardavg checkpoint that keeps several")
    merge.add_argument("--key", help="an averager's key in DCP checkpoints (default: the model's tensors)")
    merge.add_argument(
        "--prefix", help="the entry of DCP checkpoints holding the model, like model. or '' for the top level "
        "(default: found; optimizer, scheduler, data loader and train state entries are never merged)",
    )  # fmt: skip
    merge.add_argument(
        "--include",
        action="append",
        metavar="PATTERN",
        help="merge only tensors whose name matches (fnmatch; repeatable)",
    )
    merge.add_argument("--exclude", action="append", metavar="PATTERN", help="leave out tensors whose name matches")
    merge.add_argument("--dtype", choices=EXPORT_DTYPES, help="floating output dtype (default: the inputs', or fp32)")
    merge.add_argument("--accumulate", choices=("float32", "float64"), default="float32", help="(default float32)")
    merge.add_argument("--max-shard-size", default="5GB", help="largest file before splitting (default 5GB)")
    merge.add_argument(
        "--format", choices=("safetensors", "shardavg"), default="safetensors",
        help="a model folder (default), or an averager's checkpoint that avg.load restores at any world size",
    )  # fmt: skip


def _merge(args: argparse.Namespace) -> str:
    from .merge import merge

    inputs, last = args.inputs, None
    if args.last is not None:
        if inputs:
            raise ValueError("--last K RUN_DIR picks the inputs: give no IN with it")
        count, inputs = args.last
        if not count.isdigit() or int(count) < 1:
            raise ValueError(f"--last takes a count of checkpoints >= 1 and a run folder, got {count!r}")
        last = int(count)
    elif not inputs:
        raise ValueError("merge needs checkpoints IN, or --last K RUN_DIR")
    out = merge(
        inputs, args.out, weights=args.weights, last=last, ema=args.ema, schedule=args.schedule,
        normalize=not args.raw_weights, key=args.key, average=args.average,
        prefix=args.prefix, include=args.include, exclude=args.exclude,
        dtype=None if args.dtype is None else DTYPES[args.dtype],
        accumulate=DTYPES[args.accumulate], max_shard_size=args.max_shard_size, output=args.format,
        collective=True,  # (the workers' process group, under torchrun: see _workers)
    )  # fmt: skip
    return f"wrote the merge of {len(inputs) if last is None else last} checkpoints to {out}"


@contextlib.contextmanager
def _workers() -> Iterator[bool]:
    """Under torchrun (``WORLD_SIZE`` > 1, on one node or several) a gloo process group over the
    workers, which then split the merge between them; yields whether this is the first worker
    (the one that reports). The group goes when the merge is done or refused."""
    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or dist.is_initialized():
        yield not dist.is_initialized() or dist.get_rank() == 0
        return
    # (a worker waits at each agreement for the slowest to finish its share: hours for terabytes;
    # a worker that dies ends the others at once, its connection closed)
    dist.init_process_group("gloo", timeout=datetime.timedelta(hours=4))
    try:
        if dist.get_rank() != 0:
            log.setLevel(logging.WARNING)
        yield dist.get_rank() == 0
    finally:
        dist.destroy_process_group()


def _posthoc(args: argparse.Namespace) -> str:
    from .posthoc import snapshots, synthesizable, synthesized_dtype, synthesized_tensors, target_gamma
    from .rules import gamma_to_sigma_rel

    if args.list:
        found = snapshots(args.snapshots)
        rows = [f"{'t':>10} {'step':>10} {'world':>5} {'bytes':>12}  profiles (name: gamma, sigma_rel)"]
        for s in found:
            profiles = ", ".join(f"{n}: {g:.3f}, {gamma_to_sigma_rel(g):.3f}" for n, g in s.gammas.items())
            rows.append(f"{s.t:>10} {s.step:>10} {s.world_size:>5} {s.bytes:>12}  {profiles}")
        return "\n".join([*rows, synthesizable(found)])
    if args.out is None or args.sigma_rel is None:
        raise ValueError("posthoc needs OUT and --sigma-rel (or --list)")
    check_output_folder(args.out)
    gamma = target_gamma(sigma_rel=args.sigma_rel)
    description, tensors = synthesized_tensors(args.snapshots, gamma, args.step)
    dtype = None if args.dtype is None else DTYPES[args.dtype]
    entries = [replace(e, dtype=dtype_name(synthesized_dtype(e))) for e in description.tensors]

    def values() -> Iterator[torch.Tensor]:
        for _, full in tensors:
            yield full
            del full  # before the next tensor is synthesized

    metadata = {"format": "pt", "shardavg": json.dumps({"posthoc": {"sigma_rel": args.sigma_rel, "step": args.step}})}
    path = write_model(args.out, entries, values(), metadata, args.max_shard_size, dtype, description.provenance)
    written = sum(len(entry.names) for entry in entries)
    return f"wrote the post-hoc EMA of sigma_rel {args.sigma_rel} ({written} tensors) to {path}"


def _inspect(saved: SavedAverage, verify: bool) -> str:
    description = saved.description
    tensors = description.tensors
    size = sum(t.nbytes for t in tensors)
    roles = Counter(t.role for t in tensors)
    where = f"{saved.path}" + (" (torch.distributed.checkpoint)" if saved.kind == "dcp" else "")
    rows = [
        ("checkpoint", where),
        ("step", description.step),
        ("num_updates", _updates(description)),
        *(
            ("rule" if average.name is None else f"average {average.name}", json.dumps(average.rule))
            for average in description.averages
        ),
        ("strategy", f"{description.strategy} on {description.world_size} rank(s)"),
        ("tensors", f"{len(tensors)}: " + ", ".join(f"{n} {role}" for role, n in sorted(roles.items()))),
        ("bytes", f"{size} ({size / 2**20:.1f} MiB)"),
        *(("layout", line) for line in _layouts(tensors)),
    ]
    if verify:
        files, checked = saved.verify_contents()
        rows.append(("verified", f"{files} file(s), {checked} bytes: every SHA-256 matches the manifest"))
    if description.provenance is not None:
        rows += [("provenance", line) for line in provenance.shown(description.provenance)]
    return "\n".join(f"{label:<12} {value}" for label, value in rows)


def _model_folder(path: Path) -> bool:
    """A folder of safetensors weights (an export, a merge), not a checkpoint."""
    has_weights = (path / WEIGHTS_FILE).is_file() or (path / WEIGHTS_INDEX).is_file()
    return path.is_dir() and has_weights and not (path / MANIFEST).exists() and not (path / DCP_METADATA).exists()


def _inspect_folder(path: Path) -> str:
    """A model folder: its weight files, and the provenance shardavg recorded beside them."""
    weights = sorted(p.name for p in path.glob("model*.safetensors"))
    size = sum((path / name).stat().st_size for name in weights)
    rows = [("model", str(path)), ("files", f"{len(weights)} weight file(s), {size} bytes")]
    record = provenance.read(path)
    lines = provenance.shown(record) if record is not None else ["none recorded (not written by shardavg 0.6+)"]
    rows += [("provenance", line) for line in lines]
    return "\n".join(f"{label:<12} {value}" for label, value in rows)


def _layouts(tensors: Sequence[TensorEntry]) -> list[str]:
    """How the saving ranks held the tensors, in words, the commonest first (a checkpoint of
    ``avg.save``; DCP's chunks are its own)."""
    shown = Counter(entry.layout.shown() for entry in tensors if entry.layout is not None)
    return [f"{count} tensor{'s' if count > 1 else ''}: {words}" for words, count in shown.most_common()]


def _updates(description: Description) -> str:
    if description.num_updates == 0:
        return "0 (saved before the first update: no average yet, nothing to export)"
    return f"{description.num_updates} ({description.num_skipped} skipped for non-finite weights)"


def _export(saved: SavedAverage, args: argparse.Namespace) -> str:
    out, average = args.out, args.average
    check_output_folder(out, inputs=[saved.path], beside=True)
    average = saved.average(average)
    description = saved.description
    if description.num_updates == 0:
        raise CheckpointError(f"{saved.path} was saved before any update was applied: it holds no average to export")
    saved.verify()  # a damaged chunk table is refused before anything is written
    if args.verify:
        saved.verify_contents()
    dtype = None if args.dtype is None else DTYPES[args.dtype]
    values = (saved.read(entry.name, average) for entry in description.tensors)
    metadata = export_metadata(description, average)
    record = made_by(
        "export",
        1,
        average=average,
        step=description.step,
        dtype=args.dtype,
        inputs=[of_input(saved.path, description.step, 1.0, description.run)],
    )
    path = write_model(out, description.tensors, values, metadata, args.max_shard_size, dtype, record)
    which = "" if average is None else f" of average {average!r}"
    return f"wrote {sum(len(e.names) for e in description.tensors)} tensors{which} to {path}"


def _out_of_memory(error: BaseException) -> bool:
    """A failed allocation, as Python or torch's CPU allocator reports one."""
    return isinstance(error, MemoryError) or "can't allocate memory" in str(error)


def _allocation(error: BaseException) -> str:
    """The line of torch's allocator message that says how much was asked for."""
    text = str(error)
    start = text.find("you tried to allocate")
    return text[start:].split(".")[0] if start >= 0 else type(error).__name__


def main(argv: list[str] | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
    except SystemExit as stop:  # --help, or a usage mistake already reported in one line
        return stop.code if isinstance(stop.code, int) else 2
    saved, shown = None, logging.StreamHandler(sys.stderr)  # the library's notes (what a merge left out)
    shown.setFormatter(logging.Formatter("shardavg: %(message)s"))
    log.addHandler(shown)
    level = log.level
    log.setLevel(logging.INFO if level == logging.NOTSET else level)
    try:
        if args.command == "merge":
            with _workers() as lead:
                said = _merge(args)
            if lead:
                print(said)
            return 0
        if args.command == "posthoc":
            print(_posthoc(args))
            return 0
        if args.command == "inspect" and _model_folder(Path(args.checkpoint)):
            print(_inspect_folder(Path(args.checkpoint)))
            return 0
        saved = SavedAverage(args.checkpoint, key=args.key)
        if args.command == "inspect":
            print(_inspect(saved, args.verify))
        else:
            print(_export(saved, args))
    except (CheckpointError, ValueError, OSError) as error:
        print(f"shardavg: error: {error}", file=sys.stderr)
        return 2
    except (MemoryError, RuntimeError) as error:
        if not _out_of_memory(error):
            raise
        print(f"shardavg: error: out of memory: {_allocation(error)}; free memory or raise the limit", file=sys.stderr)
        return 2
    finally:
        log.removeHandler(shown)
        log.setLevel(level)
        if saved is not None:
            saved.close()
    return 0
