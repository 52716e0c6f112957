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

from .base.dtypes import DTYPES, dtype_name
from .base.errors import CheckpointError
from .base.logs import log
from .base.progress import Progress
from .checkpoints.format import DCP_METADATA, MANIFEST, WEIGHTS_FILE, WEIGHTS_INDEX
from .offline.saved_average import SavedAverage
from .output import provenance
from .output.export import export_metadata, write_model
from .output.model_folder import folder_export_id
from .output.provenance import made_by, of_input
from .output.weight_files import check_output_folder
from .state.description import Description, TensorEntry

EXPORT_DTYPES = ("float32", "bfloat16", "float16")
QUIET_HELP = "show no progress (shown on stderr when it is a terminal: bytes written, rate, time left)"
GROUP_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")  # torchrun's rendezvous for its workers


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
        "model-ID-0000k-of-0000N.safetensors files with model.safetensors.index.json above --max-shard-size. "
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
    export.add_argument("--quiet", action="store_true", help=QUIET_HELP)
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
    posthoc.add_argument("--quiet", action="store_true", help=QUIET_HELP)
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
    merge.add_argument(
        "--collective", action=argparse.BooleanOptionalAction,
        help="split the merge between the workers of a launch (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); "
        "default: only when torchrun started this process itself (torchrun -m shardavg merge), never when it "
        "inherited them (a command run by a training script's worker), which merges alone",
    )  # fmt: skip
    merge.add_argument("--quiet", action="store_true", help=QUIET_HELP)


def _merge(args: argparse.Namespace, together: bool, lead: bool) -> str:
    from .offline.merge import merge

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
        collective=together, progress=Progress("merge", quiet=args.quiet or not lead),
    )  # fmt: skip
    return f"wrote the merge of {len(inputs) if last is None else last} checkpoints to {out}"


@contextlib.contextmanager
def _workers(collective: bool | None) -> Iterator[tuple[bool, bool]]:
    """The workers' process group, when this merge is one of several: asked for (``--collective``),
    or by default when torchrun started this process (``_started_by_torchrun``); a gloo group over
    the workers (on one node or several) made here, or the one there is, which then split the
    merge. Yields whether it merges together, and whether this is the first worker (the one
    that reports). A group made here goes when the merge is done or refused."""
    import torch.distributed as dist

    together = _started_by_torchrun() if collective is None else collective
    if together and not dist.is_initialized():
        missing = [name for name in GROUP_VARIABLES if name not in os.environ]
        if missing:
            raise ValueError(
                f"--collective joins the workers of a launch, but {', '.join(missing)} not set: launch it with "
                "torchrun (torchrun --nproc_per_node N -m shardavg merge ...), or leave --collective out"
            )
        together = int(os.environ["WORLD_SIZE"]) > 1
    if not together or dist.is_initialized():
        yield together, not together or dist.get_rank() == 0
        return
    # (a worker waits at each agreement for the slowest to finish its share: hours for terabytes;
    # a worker that dies ends the others at once, its connection closed)
    dist.init_process_group("gloo", timeout=datetime.timedelta(hours=4))
    try:
        if dist.get_rank() != 0:
            log.setLevel(logging.WARNING)
        yield True, dist.get_rank() == 0
    finally:
        dist.destroy_process_group()


def _started_by_torchrun() -> bool:
    """Whether torchrun started this process as one of its workers, with a world of several.

    torchrun sets ``TORCHELASTIC_RUN_ID`` (with ``RANK``, ``WORLD_SIZE``, ...) for each worker it
    starts, and every process a worker starts inherits them: a training script's rank 0 that runs
    ``shardavg merge`` at the end would join a group of its parent's size, and hang. The two differ
    in the parent: a worker's is torchrun's agent, which holds no run id of its own (or, for a
    torchrun started inside a worker, another one), where an inheriting process's parent is the
    worker, holding the same. Where the parent's environment cannot be read (no ``/proc``), the
    process merges alone, saying how to merge together."""
    run = os.environ.get("TORCHELASTIC_RUN_ID")
    if not run or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    try:
        parent = Path(f"/proc/{os.getppid()}/environ").read_bytes().split(b"\0")
    except OSError:
        log.warning("cannot tell whether torchrun started this process: merging alone; pass --collective to split it")
        return False
    return f"TORCHELASTIC_RUN_ID={run}".encode() not in parent


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
    with Progress("posthoc", quiet=args.quiet) as progress:
        counted = progress.counted(values(), sum(entry.nbytes for entry in entries))
        path = write_model(args.out, entries, counted, metadata, args.max_shard_size, dtype, description.provenance)
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


def _inspect_folder(path: Path) -> int:
    """A model folder: its weight files, and the provenance shardavg recorded beside them. What
    can be read is printed; each file that cannot (a crafted ``provenance.json``) gets one error
    line on stderr, and the exit code says so."""
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
    rows += [("provenance", line) for line in lines]
    print("\n".join(f"{label:<12} {value}" for label, value in rows))
    for problem in problems:
        print(f"shardavg: error: {problem}", file=sys.stderr)
    return 2 if problems else 0


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
    progress = Progress("export", quiet=args.quiet)
    total = sum(entry.nbytes for entry in description.tensors)
    values = progress.counted((saved.read(entry.name, average) for entry in description.tensors), total)
    metadata = export_metadata(description, average)
    record = made_by(
        "export",
        1,
        average=average,
        step=description.step,
        dtype=args.dtype,
        inputs=[of_input(saved.path, description.step, 1.0, description.run)],
    )
    with progress:
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
            with _workers(args.collective) as (together, lead):
                said = _merge(args, together, lead)
            if lead:
                print(said)
            return 0
        if args.command == "posthoc":
            print(_posthoc(args))
            return 0
        if args.command == "inspect" and _model_folder(Path(args.checkpoint)):
            return _inspect_folder(Path(args.checkpoint))
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
