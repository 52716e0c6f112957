"""torchrun scenario: the last rank raises while the others wait in a collective.

The launch must end promptly with that rank's traceback instead of hanging.
"""

from __future__ import annotations

import harness
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record


@record
def main() -> None:
    harness.init_distributed()
    if dist.get_rank() == dist.get_world_size() - 1:
        raise ValueError(f"rank {dist.get_rank()} fails on purpose")
    dist.barrier()  # would wait forever for the failed rank


if __name__ == "__main__":
    main()
