"""The run folder OUT: what the main job may replace in it, and the lock that keeps a second job out.

The job writes ``metrics.jsonl``, ``plot.png``, ``posthoc.png``, ``summary.json``, ``checkpoints/``,
``posthoc/``, ``export/`` and ``merge/`` into OUT, and claims the folder with a ``run.json`` of its own when it
first runs there. Before anything starts (the config check), a fresh run refuses an OUT holding
any of those names without that claim (they are someone else's), a ``run.json`` it did not
write, and weight files under ``export/`` that shardavg did not write; a resumed run may also
continue a folder whose finished checkpoints prove it the job's. While it runs, rank 0 holds an
exclusive lock on ``OUT/.train.lock`` (``shardavg.TargetLock``: never through a link, released by
the kernel if the job is killed), and every rank learns whether it got it, so a second job in
the same folder stops at once, naming the first.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import torch.distributed as dist

import shardavg
from launch.config import ConfigError

MARKER = "run.json"
LOCK = ".train.lock"
OUTPUTS = ("metrics.jsonl", "plot.png", "posthoc.png", "summary.json", "checkpoints", "posthoc", "export", "merge")
JOB = "shardavg launch/train.py"  # what the marker says


class RunRefused(RuntimeError):
    """Another job holds the run folder: every rank raises it, rank 0 reports it."""


def check_out(out: Path, resuming: bool) -> None:
    """Config time: refuse an OUT that is a file, or holds what this job would replace but did not write."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file, not a folder: choose a folder for the run")
    if not out.is_dir():
        return
    marker = out / MARKER
    if marker.exists() or marker.is_symlink():
        if not _is_marker(marker):
            raise ConfigError(f"--out {out}: {MARKER} there was not written by this job; choose another --out")
    elif not resuming:
        theirs = sorted(name for name in OUTPUTS if (out / name).exists())
        if theirs:
            raise ConfigError(
                f"--out {out} holds {', '.join(theirs)}, which this job writes, but no {MARKER} of the job's: they "
                "are not its to replace; choose another --out, or move them"
            )
    foreign = foreign_weights(out / "export")
    if foreign:
        raise ConfigError(
            f"--out {out}: {', '.join(foreign[:6])} {'are' if len(foreign) > 1 else 'is'} not a weight file this "
            "job exported (no shardavg metadata), and the export at the end would stop on it: move it first"
        )


def _is_marker(path: Path) -> bool:
    try:
        return not path.is_symlink() and json.loads(path.read_text()).get("job") == JOB
    except (OSError, ValueError, AttributeError):
        return False


def foreign_weights(export: Path) -> list[str]:
    """Weight files under ``export/*/`` without shardavg's metadata (safetensors headers only)."""
    from safetensors import safe_open

    foreign = []
    for file in sorted(export.glob("*/model*.safetensors")) if export.is_dir() else []:
        try:
            with safe_open(str(file), framework="pt") as handle:
                ours = "shardavg" in (handle.metadata() or {})
        except Exception:  # unreadable or not safetensors: not provably the job's
            ours = False
        if not ours:
            foreign.append(str(file.relative_to(export.parent)))
    return foreign


@contextlib.contextmanager
def locked(out: Path) -> Iterator[None]:
    """Collective: rank 0 holds ``OUT/.train.lock`` for the block and claims OUT with the marker;
    every rank raises RunRefused if another job holds it."""
    with contextlib.ExitStack() as held:
        refusal = None
        if dist.get_rank() == 0:
            try:
                out.mkdir(parents=True, exist_ok=True)
                held.enter_context(shardavg.TargetLock(out / LOCK, out))
                claim(out)
            except (shardavg.CheckpointError, OSError) as error:
                refusal = f"--out {out} is in use: {error}"
        shared = [refusal]
        dist.broadcast_object_list(shared, src=0)
        if shared[0] is not None:
            raise RunRefused(shared[0])
        yield


def claim(out: Path) -> None:
    """Write the marker (atomically) unless the folder already holds it."""
    marker = out / MARKER
    if marker.exists():
        return
    temporary = out / f".{MARKER}.incomplete"
    temporary.unlink(missing_ok=True)
    with open(temporary, "x") as handle:
        handle.write(json.dumps({"job": JOB}) + "\n")
    os.replace(temporary, marker)
