"""The library's one logger: records from ranks other than 0 are dropped unless asked for, and
averagers the library builds for its own work (post-hoc synthesis) do not announce themselves."""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
from collections.abc import Iterator

import torch.distributed as dist


class _RankZeroFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if os.environ.get("SHARDAVG_LOG_ALL_RANKS") == "1":
            return True
        return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


log = logging.getLogger("shardavg")
log.addFilter(_RankZeroFilter())


_INTERNAL = contextvars.ContextVar("shardavg_internal", default=False)


@contextlib.contextmanager
def internal() -> Iterator[None]:
    """Averagers built inside the block are the library's own: they log nothing when built."""
    token = _INTERNAL.set(True)
    try:
        yield
    finally:
        _INTERNAL.reset(token)


def built_by_user() -> bool:
    return not _INTERNAL.get()
