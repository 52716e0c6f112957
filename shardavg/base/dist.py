"""The process group as shardavg uses it: who this rank is, and agreeing before collective I/O.

Every step that more than one rank must take together (a save, a load, an export, a DeepSpeed
tag) first gathers each rank's outcome: one rank's failure becomes an error on every rank,
naming the ranks and what each said, instead of a rank waiting forever in a collective that
the failed one never joins. Outside a process group (one process, the offline CLI) every
function answers for a world of one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
import torch.distributed as dist

from .errors import CheckpointError, RankFailure


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if distributed() else 1


def comm_device(device: torch.device) -> torch.device:
    """Where a tensor must be for the default process group to send it (NCCL: CUDA only)."""
    backend = dist.get_backend()
    if device.type == "cpu" and "nccl" in backend and "cpu:" not in backend and backend != "gloo":
        return torch.device("cuda", torch.cuda.current_device())
    return device


def same_everywhere(values: Sequence[int]) -> bool:
    """Collective: whether every rank passed the same integers (each below 2**62), in one
    all-reduce of the values and their negations (the maximum of both: the range): a check
    whose cost does not grow with the number of ranks, where gathering them would."""
    if not distributed():
        return True
    both = torch.tensor([*values, *(-v for v in values)], dtype=torch.int64, device=comm_device(torch.device("cpu")))
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    highest, lowest = both.tolist()[: len(values)], [-v for v in both.tolist()[len(values) :]]
    return highest == lowest


def digest(value: object) -> list[int]:
    """``value`` (plain data whose ``repr`` is the same on every rank) as four integers below 2**56
    (a SHA-256 of it): what ``same_everywhere`` compares where the value itself is large or not
    integers (names, shapes, paths, plans)."""
    hashed = hashlib.sha256(repr(value).encode()).digest()
    return [int.from_bytes(hashed[k : k + 7], "little") for k in range(0, 28, 7)]


def all_gathered(value: object) -> list:
    """Collective: every rank's ``value`` (small, plain data), in rank order."""
    values = [value]
    if distributed():
        values = [None] * dist.get_world_size()
        dist.all_gather_object(values, value)
    return values


def gather_or_raise(
    error: BaseException | None, value: object, what: str, kind: type[CheckpointError] = CheckpointError
) -> list:
    """Collective: every rank's ``value``; or, if any rank failed, raise ``kind`` on every rank,
    naming the ranks and their errors, with ``failures``: each failing rank's ``RankFailure`` (its
    exception's type name and message, the strings that cross processes; the exception itself
    is the cause only on its own rank)."""
    reports = all_gathered((None if error is None else (type(error).__name__, str(error)), value))
    failures = {r: RankFailure(*failure) for r, (failure, _) in enumerate(reports) if failure is not None}
    if failures:
        failed = "; ".join(f"rank {r}: {failure}" for r, failure in failures.items())
        raise kind(f"{what} failed: {failed}", failures=failures) from error
    return [value for _, value in reports]


def agree_or_raise(error: BaseException | None, what: str, kind: type[CheckpointError] = CheckpointError) -> None:
    """Collective: raise ``kind`` on every rank if any rank failed, naming the ranks and their errors
    in its message and in its ``failures`` (rank -> ``RankFailure``); one all-reduce when none did,
    the errors gathered only when one did."""
    alike = same_everywhere([0 if error is None else 1])  # every rank takes part, failed or not
    if error is not None or not alike:
        gather_or_raise(error, None, what, kind)
