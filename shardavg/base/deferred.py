"""Warnings met on a thread of the library's own, given later in the thread that collects its work.

A warning issued on the background update's thread would land whenever that thread got there,
under no caller's ``warnings.catch_warnings`` or ``pytest.warns``, and past the line of the loop
it is about. Code that may run there (the update, the Triton kernel's first failure) warns
through ``warn``: on a thread running inside ``deferring(kept)`` the warning is kept in ``kept``
for its collector to issue (``Background.wait``); anywhere else it is issued at once.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import os
import warnings
from collections.abc import Iterator

# (a context variable: each thread starts with its own context, so a sink set on the update's
# thread is never seen by the loop's)
_KEPT: contextvars.ContextVar[list[Warning] | None] = contextvars.ContextVar("shardavg_deferred", default=None)


@contextlib.contextmanager
def deferring(kept: list[Warning]) -> Iterator[None]:
    """Within the block, in this thread, ``warn`` appends to ``kept`` instead of warning."""
    token = _KEPT.set(kept)
    try:
        yield
    finally:
        _KEPT.reset(token)


def warn(warning: Warning, stacklevel: int | None = None) -> None:
    """Issue ``warning`` (``stacklevel`` counted from the caller, as ``warnings.warn`` counts it;
    None: at the first line outside shardavg, the user's, however deep the call), or keep it where
    this thread is ``deferring``."""
    kept = _KEPT.get()
    if kept is not None:
        kept.append(warning)
    else:
        warnings.warn(warning, stacklevel=(_outside() if stacklevel is None else stacklevel) + 1)


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _outside() -> int:
    """The stacklevel, counted from ``warn``'s caller, of the first frame outside the package."""
    frame, level = inspect.currentframe().f_back.f_back, 1  # type: ignore[union-attr] (warn's caller)
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_PACKAGE):  # type: ignore[union-attr]
        frame, level = frame.f_back, level + 1
    return level
