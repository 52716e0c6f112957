"""Noticing that a watched model's structure changed: a parameter, buffer or submodule replaced.

torch offers only process-wide hooks for those registrations. They are installed once, for as
long as some model is watched, and removed (their handles kept for that) when the last watch
goes; each registration marks the watches whose model holds the module, and their averager
rescans that model at its next use (``model.fc = nn.Linear(...)`` or ``model.fc.weight = ...``).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

from torch import nn
from torch.nn.modules import module as module_hooks

_WATCHES: weakref.WeakSet[StructureWatch] = weakref.WeakSet()
_HANDLES: list = []  # the three registration hooks, while any watch lives


class StructureWatch:
    """Whether the modules of one model saw a registration since ``reset``."""

    def __init__(self, modules: Iterable[nn.Module]) -> None:
        self.changed = False
        self.reset(modules)
        if not _HANDLES:
            _HANDLES.extend(
                register(_on_registration)
                for register in (
                    module_hooks.register_module_parameter_registration_hook,
                    module_hooks.register_module_buffer_registration_hook,
                    module_hooks.register_module_module_registration_hook,
                )
            )
        _WATCHES.add(self)
        weakref.finalize(self, _release)

    def reset(self, modules: Iterable[nn.Module]) -> None:
        """Watch these modules from now on (after a rescan adopted them)."""
        self._module_ids = {id(module) for module in modules}
        self.changed = False

    def holds(self, module: nn.Module) -> bool:
        return id(module) in self._module_ids


def _on_registration(module: nn.Module, name: str, value: object) -> None:
    for watch in list(_WATCHES):
        if watch.holds(module):
            watch.changed = True


def _release() -> None:
    """When no watch is left, the hooks go: nothing else pays for them."""
    if not _WATCHES:
        while _HANDLES:
            _HANDLES.pop().remove()
