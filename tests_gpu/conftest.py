"""tests_gpu/: the CUDA paths, run with ``python -m pytest tests_gpu`` on a machine with a GPU.

Without CUDA every test here is skipped at collection, with the reason, in seconds."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import pytest
import torch

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if GPUS:
        return
    skip = pytest.mark.skip(reason="no CUDA device here: tests_gpu/ runs where torch.cuda.is_available()")
    for item in items:
        item.add_marker(skip)


@contextlib.contextmanager
def no_sync() -> Iterator[None]:
    """A block in which anything that makes the host wait for the GPU raises (``.item()``, a
    blocking copy to or from the host, a stream or device synchronize)."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.fixture
def compiled_kernels(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """``shardavg.kernels`` compiled for the GPU (never the interpreter), built afresh.

    ``kernels.usable`` is False either because Triton does not import, or because the kernel's
    first-use self-check failed on this GPU (a compile, a launch or its bits): the failure says
    which, with the self-check's own warning (the device, the Triton version, the error), since
    that warning is the finding to report, not a missing install."""
    from shardavg.update import kernels

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv(kernels.SWITCH, raising=False)
    kernels.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        usable = kernels.usable(torch.device("cuda"))
    if not usable:
        said = [str(w.message) for w in caught if "Triton kernel" in str(w.message)]
        if said:
            pytest.fail(f"the Triton kernel failed its self-check on this GPU: {said[0]}")
        pytest.fail("triton does not import here: torch's CUDA wheels ship it (pip install -e '.[test]')")
    yield
    kernels.reset()
