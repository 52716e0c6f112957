"""tests_gpu/: the CUDA paths, run with ``python -m pytest tests_gpu`` on a machine with a GPU.

Without CUDA every test here is skipped at collection, with the reason, in seconds."""

from __future__ import annotations

import pytest
import torch

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if GPUS:
        return
    skip = pytest.mark.skip(reason="no CUDA device here: tests_gpu/ runs where torch.cuda.is_available()")
    for item in items:
        item.add_marker(skip)
