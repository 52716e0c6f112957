"""The main job's checkpoints: model, optimizer, data position and every average, resumable bitwise.

``OUT/checkpoints/step-NNNNNNNNN/`` (the library's step naming) holds either a
``torch.distributed.checkpoint`` (DDP, FSDP1, FSDP2, HSDP, TP, PP: model and optimizer through
``get_state_dict``, each average as a DCP Stateful) or,
under ZeRO-3, the DeepSpeed engine's own checkpoint plus each average's ``save``. A checkpoint
is written into a hidden staging folder and committed once every rank is done, with
``train.json`` (the step, the engine, and the SHA-256 of every other file) written last, by the
library's atomic commit (a resumed run's checkpoint of the same step is exchanged for it in one
step): a folder without ``train.json`` was never finished and is ignored. Only folders with that marker are ever
pruned. ``problem`` checks a checkpoint before anything reads it: ``train.json`` itself, every
file against its hash, and DCP's pickled ``.metadata`` with shardavg's restricted unpickler
(``dcp.load`` would unpickle anything); ``--resume`` takes the newest checkpoint that passes.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException  # (a BaseException, not an Exception)
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import shardavg
from launch.engines import Wrapped
from shardavg import WeightAverager
from shardavg.checkpoints.format import step_folder
from shardavg.checkpoints.storage import commit_folder, staging_path

MARKER = "train.json"
STEP = re.compile(r"step-(\d{8,9})")  # (eight digits: checkpoints of runs before the library's naming)


class Unreadable(RuntimeError):
    """A checkpoint that passed ``problem`` but that DCP could not read: one line, on every rank."""


def _reason(error: BaseException) -> str:
    """One line for what DCP raised (its own messages run to many lines, and torch's advice for a
    pickle that ``weights_only`` refused is to load it with ``weights_only=False``: never here)."""
    text = str(error)
    if "Weights only load failed" in text or "Unpickler" in text:
        return "an entry holds pickled Python objects, not tensor data: refused without running it"
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:300] if lines else type(error).__name__


def save(root: Path, step: int, wrapped: Wrapped, averages: dict[str, WeightAverager], keep_last: int) -> Path:
    """Collective: a checkpoint of everything training needs at ``step``; returns its folder."""
    target, staging = _prepare(root, step)
    if wrapped.kind == "zero3":
        wrapped.deepspeed_engine.save_checkpoint(str(staging), tag="engine", save_latest=False)
        for name, average in averages.items():
            average.save(staging / f"average-{name}")
    else:
        dcp.save(_dcp_state(wrapped, averages, step), checkpoint_id=str(staging))
    dist.barrier()
    if dist.get_rank() == 0:
        commit(root, staging, target, step, wrapped.kind, keep_last)
    dist.barrier()
    return target


def save_async(
    root: Path, step: int, wrapped: Wrapped, averages: dict[str, WeightAverager], group: dist.ProcessGroup
) -> tuple[Future, Path, Path]:
    """Collective: start one DCP request holding everything training needs at ``step`` (staged,
    i.e. copied, before it returns) whose collectives run over ``group``; returns its future,
    staging folder and target. Nothing is committed: ``commit`` follows once the future is done."""
    target, staging = _prepare(root, step)
    request = dcp.async_save(_dcp_state(wrapped, averages, step), checkpoint_id=str(staging), process_group=group)
    return request, staging, target


def _prepare(root: Path, step: int) -> tuple[Path, Path]:
    """Collective: the target folder of ``step`` and its fresh staging folder (rank 0 clears a
    crashed earlier attempt's); refuses a target that is not one of this job's checkpoints."""
    target = root / step_folder(step)
    staging = staging_path(target)
    if target.exists() and not (target / MARKER).is_file():
        raise RuntimeError(f"{target} exists and is not a checkpoint of this job: refusing to replace it")
    if dist.get_rank() == 0:
        shutil.rmtree(staging, ignore_errors=True)  # a crashed earlier attempt at this step
        staging.mkdir(parents=True)
    dist.barrier()
    return target, staging


def commit(root: Path, staging: Path, target: Path, step: int, engine: str, keep_last: int) -> None:
    """Rank 0, once every rank has written its part: ``train.json`` (with every other file's hash)
    written last, the staging folder committed atomically (a run resumed from an earlier step
    replaces its own), and all but the newest ``keep_last`` finished checkpoints removed."""
    record = {"step": step, "engine": engine, "files": digests(staging)}
    (staging / MARKER).write_text(json.dumps(record, indent=1))
    commit_folder(staging, target)
    for old in finished(root)[:-keep_last]:
        shutil.rmtree(old)


class Checkpointer:
    """The training loop's checkpoints, saved in the loop (``asynchronous=False``) or as one DCP
    request in flight over a gloo group of their own (created once, so the background thread's
    collectives never mix with training's); and the seconds each save blocked the loop.

    Before the next save and at ``close`` the request in flight is waited for; rank 0 commits it
    on a thread of its own as soon as it is written, exactly as a save in the loop commits, so
    a crash before then leaves the previous checkpoint the newest finished one."""

    def __init__(
        self, root: Path, wrapped: Wrapped, averages: dict[str, WeightAverager], keep_last: int, asynchronous: bool
    ) -> None:
        self.root, self.wrapped, self.averages, self.keep_last = root, wrapped, averages, keep_last
        self.group = dist.new_group(backend="gloo") if asynchronous else None
        self.committer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="commit") if asynchronous else None
        self.in_flight: Future | None = None  # rank 0: the commit that follows the request; others: the request
        self.blocking: dict[int, float] = {}  # step: seconds the loop waited in save()
        self.final_wait = 0.0  # seconds close() waited for the last request

    @property
    def mode(self) -> str:
        return "sync" if self.group is None else "async"

    def save(self, step: int) -> None:
        """Collective: the checkpoint of ``step``, after the previous request is done."""
        began = time.perf_counter()
        self.wait()
        if self.group is None:
            save(self.root, step, self.wrapped, self.averages, self.keep_last)
        else:
            request, staging, target = save_async(self.root, step, self.wrapped, self.averages, self.group)
            self.in_flight = request
            if dist.get_rank() == 0:
                self.in_flight = self.committer.submit(self._commit_when_written, request, staging, target, step)
        self.blocking[step] = time.perf_counter() - began

    def _commit_when_written(self, request: Future, staging: Path, target: Path, step: int) -> None:
        request.result()  # (DCP finishes on rank 0 only after every rank has written its part)
        commit(self.root, staging, target, step, self.wrapped.kind, self.keep_last)

    def wait(self) -> None:
        """The request in flight, if any, written (and on rank 0 committed); its error raised here."""
        in_flight, self.in_flight = self.in_flight, None
        if in_flight is not None:
            in_flight.result()

    def close(self) -> None:
        """Collective: the last request written and committed on every rank's watch."""
        began = time.perf_counter()
        self.wait()
        if self.committer is not None:
            self.committer.shutdown()
        dist.barrier()
        self.final_wait = time.perf_counter() - began

    def report(self) -> dict:
        """Collective: the mode, and the seconds saves blocked the loop on the slowest rank: in all,
        per checkpoint, and the wait for the last request after the loop."""
        seconds = torch.tensor([*self.blocking.values(), self.final_wait], dtype=torch.float64)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        *per_step, final = seconds.tolist()
        return {
            "mode": self.mode,
            "saves": len(per_step),
            "blocking_s": round(sum(per_step), 4),
            "blocking_s_per_checkpoint": {str(k): round(v, 4) for k, v in zip(self.blocking, per_step)},
            "final_wait_s": round(final, 4),
        }


def finished(root: Path) -> list[Path]:
    """The job's committed checkpoints under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if STEP.fullmatch(p.name) and (p / MARKER).is_file()]
    return sorted(found, key=step_of)


def step_of(folder: Path) -> int:
    """The step a checkpoint folder's name (``step-NNNNNNNNN``) gives."""
    return int(STEP.fullmatch(folder.name).group(1))


def digests(folder: Path) -> dict[str, str]:
    """The SHA-256 of every file under ``folder`` (but ``train.json``), by its path inside it."""
    return {
        str(file.relative_to(folder)): _sha256(file)
        for file in sorted(folder.rglob("*"))
        if file.is_file() and file.relative_to(folder) != Path(MARKER)
    }


def _sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as handle:
        while block := handle.read(2**24):
            digest.update(block)
    return digest.hexdigest()


def problem(folder: Path, engine: str) -> str | None:
    """Why the checkpoint at ``folder`` cannot be resumed from (None: it can), read before any of it is trusted."""
    record = _record(folder)
    if isinstance(record, str):
        return record
    if record["engine"] != engine:
        return f"it was written by the {record['engine']} engine, this run is {engine}"
    for name, expected in record.get("files", {}).items():
        file = folder / name
        if file.is_symlink() or not file.is_file():
            return f"{name} is missing"
        if _sha256(file) != expected:
            return f"{name} does not match the SHA-256 recorded when it was saved (damaged or changed since)"
    if engine != "zero3":
        try:
            shardavg.check_dcp(folder)
        except shardavg.CheckpointError as error:
            return str(error)
    return None


def _record(folder: Path) -> dict[str, Any] | str:
    """``train.json``, checked: its step is the folder's, its engine a name, its files a map of hashes."""
    try:
        record = json.loads((folder / MARKER).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as error:
        return f"{MARKER} cannot be read: {error}"
    match = STEP.fullmatch(folder.name)
    step = record.get("step") if isinstance(record, dict) else None
    if not isinstance(step, int) or isinstance(step, bool) or (match and int(match.group(1)) != step):
        return f"{MARKER} gives step {step!r} for the folder {folder.name}"
    if not isinstance(record.get("engine"), str):
        return f"{MARKER} names no engine"
    files = record.get("files", {})  # (checkpoints saved before hashes were recorded have none)
    if not isinstance(files, dict) or not all(
        isinstance(k, str) and ".." not in Path(k).parts and not Path(k).is_absolute() and isinstance(v, str)
        for k, v in files.items()
    ):
        return f"{MARKER} lists its files wrongly"
    return record


def load(folder: Path, wrapped: Wrapped, averages: dict[str, WeightAverager]) -> int:
    """Collective: restore everything from ``folder`` (checked by ``problem`` first); returns the
    step it was saved at. A checkpoint DCP cannot read is refused on every rank in one line."""
    step = json.loads((folder / MARKER).read_text())["step"]
    if wrapped.kind == "zero3":
        loaded, _ = wrapped.deepspeed_engine.load_checkpoint(str(folder), tag="engine")
        if loaded is None:
            raise RuntimeError(f"DeepSpeed found no engine checkpoint in {folder}")
        for name, average in averages.items():
            average.load(folder / f"average-{name}")
        return step
    state = _dcp_state(wrapped, averages, step=-1)
    try:
        dcp.load(state, checkpoint_id=str(folder))
    except (Exception, CheckpointException) as error:  # DCP gathers every rank's failure, raises it on all
        raise Unreadable(f"{folder} cannot be resumed from: {_reason(error)}") from None
    set_state_dict(
        wrapped.model, wrapped.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
    )
    if int(state["step"]) != step:
        raise RuntimeError(f"{folder}: {MARKER} says step {step}, the checkpoint holds step {int(state['step'])}")
    return step


def _dcp_state(wrapped: Wrapped, averages: dict[str, WeightAverager], step: int) -> dict:
    model, optimizer = get_state_dict(wrapped.model, wrapped.optimizer)
    state = {"model": model, "optimizer": optimizer, "step": torch.tensor(step)}
    return state | {f"average-{name}": average for name, average in averages.items()}
