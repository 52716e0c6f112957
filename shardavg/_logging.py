"""The library's one logger: records from ranks other than 0 are dropped unless asked for."""

from __future__ import annotations

import logging
import os

import torch.distributed as dist


class _RankZeroFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if os.environ.get("SHARDAVG_LOG_ALL_RANKS") == "1":
            return True
        return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


log = logging.getLogger("shardavg")
log.addFilter(_RankZeroFilter())
