"""``shardavg export | inspect | posthoc | merge``: work with checkpoints offline.

Runs in one process without a process group, reading one tensor at a time, on checkpoints
written by ``avg.save``, on the averager entry of a ``torch.distributed.checkpoint``, on
post-hoc EMA snapshots, and (``merge``) on model checkpoints of several kinds.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

from .base.dtypes import DTYPES
from .base.errors import CheckpointError
from .base.logs import log
from .base.progress import Progress
from .offline.methods import METHODS, given
from .offline.saved_average import SavedAverage
from .output.megatron_run import TRACKER
from .output.model_folder import folder_summary, is_model_folder
from .output.write_options import add_flags, from_args

EXPORT_OPTIONS = ("max_shard_size", "dtype")  # the write options (output.write_options) each command takes
POSTHOC_OPTIONS = ("max_shard_size", "dtype")
MERGE_OPTIONS = ("max_shard_size", "dtype", "output", "iteration")
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
        epilog="CKPT_DIR is a folder written by avg.save() (a checkpoint, or the parent of step-* "
        "checkpoints, of which the newest committed one is used), or a torch.distributed.checkpoint "
        "folder holding an averager under --key.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    export = commands.add_parser(
        "export",
        help="write the full averaged model as safetensors",
        description="Consolidate the averaged weights into OUT (a folder): model.safetensors, or "
        "model-ID-0000k-of-0000N.safetensors files with model.safetensors.index.json above --max-shard-size. "
        "Keys are the plain model's parameter and buffer names, so the result loads with strict=True.",
    )
    export.add_argument("checkpoint", metavar="CKPT_DIR")
    export.add_argument("out", metavar="OUT")
    add_flags(export, EXPORT_OPTIONS, unset={"dtype": "as saved, fp32 averages"})
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
    add_flags(posthoc, POSTHOC_OPTIONS, unset={"dtype": "fp32"})
    posthoc.add_argument("--list", action="store_true", help="print the snapshots instead")
    posthoc.add_argument("--quiet", action="store_true", help=QUIET_HELP)
    _merge_parser(commands)
    return parser


def _merge_parser(commands: Any) -> None:  # (argparse's subparsers action)
    merge = commands.add_parser(
        "merge",
        help="average checkpoints already on disk (uniform, weighted, last K, EMA over steps)",
        description="Write the weighted average of checkpoints IN to OUT, one tensor at a time in fp32: "
        "shardavg checkpoints (any average), DCP checkpoints (their --prefix tensors, or an averager with --key; "
        "Megatron-Core torch_dist ones too), DeepSpeed ZeRO tags and universal checkpoints (their fp32 masters), "
        "Hugging Face safetensors models; freely mixed when names and shapes agree, written at any world size. "
        "Integer tensors come from the last input. Every input and OUT are checked before anything is written.",
        epilog="OUT is a model folder, an averager's checkpoint (--format shardavg), or a DCP checkpoint under the "
        "inputs' keys (--format dcp). A format that cannot be read as data is refused naming the command that "
        "converts it.",
    )
    merge.add_argument("inputs", metavar="IN", nargs="*", help="checkpoints, oldest first")
    merge.add_argument("--out", required=True, metavar="OUT", help="the folder to write")
    weighting = merge.add_mutually_exclusive_group()  # (each merge method's option, from its declaration)
    for method in METHODS.values():
        if method.keyword is not None:
            weighting.add_argument(f"--{method.keyword}", dest=method.keyword, **method.option)
    merge.add_argument(
        "--raw-weights", action="store_true",
        help="take --weights as given, not normalised to sum 1 (negative ones too: task arithmetic)",
    )  # fmt: skip
    merge.add_argument(
        "--last", nargs=2, metavar=("K", "RUN_DIR"), help="merge the newest K finished checkpoints of RUN_DIR"
    )
    merge.add_argument("--average", metavar="NAME", help="which average of a shardavg checkpoint that keeps several")
    merge.add_argument(
        "--key",
        help="an averager's key in DCP checkpoints; in Megatron-Core ones the prefix it was saved under, its "
        "averages then merged as a model (default: the model's tensors)",
    )
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
    merge.add_argument("--accumulate", choices=("float32", "float64"), default="float32", help="(default float32)")
    add_flags(merge, MERGE_OPTIONS, unset={"dtype": "the inputs', or fp32"})
    merge.add_argument(
        "--collective", action=argparse.BooleanOptionalAction,
        help="split the merge between the writers of a launch (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); "
        "default: only when torchrun started this process itself (torchrun -m shardavg merge), never when it "
        "inherited them (a command run by a training script's torchrun worker), which merges alone",
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
    chosen = given({method.keyword: getattr(args, method.keyword) for method in METHODS.values() if method.keyword})
    out = merge(
        inputs, args.out, last=last, method=chosen[0] if chosen else None, normalize=not args.raw_weights,
        key=args.key, average=args.average, prefix=args.prefix, include=args.include, exclude=args.exclude,
        accumulate=DTYPES[args.accumulate], **from_args(args, MERGE_OPTIONS),
        collective=together, progress=Progress("merge", quiet=args.quiet or not lead),
    )  # fmt: skip
    said = f"wrote the merge of {len(inputs) if last is None else last} checkpoints to {out}"
    if out != Path(args.out):  # (its iter_NNNNNNN folder: OUT is a Megatron-LM run folder)
        said += f", which {TRACKER} names: Megatron-LM loads it with --load {args.out} --no-load-optim --no-load-rng"
    return said


@contextlib.contextmanager
def _writers(collective: bool | None) -> Iterator[tuple[bool, bool]]:
    """The writers' process group, when this merge is one of several: asked for (``--collective``),
    or by default when torchrun started this process (``_started_by_torchrun``); a gloo group over
    the writers (on one node or several) made here, or the one there is, which then split the
    merge. Yields whether it merges together, and whether this is the first writer (the one
    that reports). A group made here goes when the merge is done or refused."""
    import torch.distributed as dist

    together = _started_by_torchrun() if collective is None else collective
    if together and not dist.is_initialized():
        missing = [name for name in GROUP_VARIABLES if name not in os.environ]
        if missing:
            raise ValueError(
                f"--collective joins the writers of a launch, but {', '.join(missing)} not set: launch it with "
                "torchrun (torchrun --nproc_per_node N -m shardavg merge ...), or leave --collective out"
            )
        together = int(os.environ["WORLD_SIZE"]) > 1
    if not together or dist.is_initialized():
        yield together, not together or dist.get_rank() == 0
        return
    # (a writer waits at each agreement for the slowest to finish its share: hours for terabytes;
    # a writer that dies ends the others at once, its connection closed)
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
    starts, and every process those start inherits them: a training script's rank 0 that runs
    ``shardavg merge`` at the end would join a group of its parent's size, and hang. The two differ
    in the parent: a torchrun worker's is torchrun's agent, which holds no run id of its own (or,
    for a torchrun started inside a torchrun worker, another one), where an inheriting process's
    parent is the training script's rank, holding the same. Where the parent's environment cannot
    be read (no ``/proc``), the process merges alone, saying how to merge together."""
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
    from .posthoc import export_synthesized, snapshots, synthesizable
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
    path, written = export_synthesized(
        args.snapshots, args.out, args.sigma_rel, step=args.step, **from_args(args, POSTHOC_OPTIONS),
        progress=Progress("posthoc", quiet=args.quiet),
    )  # fmt: skip
    return f"wrote the post-hoc EMA of sigma_rel {args.sigma_rel} ({written} tensors) to {path}"


def _inspect(saved: SavedAverage, verify: bool) -> str:
    return "\n".join(f"{label:<12} {value}" for label, value in saved.summary(verify))


def _inspect_folder(path: Path) -> int:
    """A model folder: what can be read is printed; each file that cannot (a crafted
    ``provenance.json``) gets one error line on stderr, and the exit code says so."""
    rows, problems = folder_summary(path)
    print("\n".join(f"{label:<12} {value}" for label, value in rows))
    for problem in problems:
        print(f"shardavg: error: {problem}", file=sys.stderr)
    return 2 if problems else 0


def _export(saved: SavedAverage, args: argparse.Namespace) -> str:
    path = saved.export(
        args.out, average=args.average, **from_args(args, EXPORT_OPTIONS), verify=args.verify,
        progress=Progress("export", quiet=args.quiet),
    )  # fmt: skip
    average = saved.average(args.average)
    which = "" if average is None else f" of average {average!r}"
    return f"wrote {sum(len(e.names) for e in saved.description.tensors)} tensors{which} to {path}"


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
            with _writers(args.collective) as (together, lead):
                said = _merge(args, together, lead)
            if lead:
                print(said)
            return 0
        if args.command == "posthoc":
            print(_posthoc(args))
            return 0
        if args.command == "inspect" and is_model_folder(Path(args.checkpoint)):
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
