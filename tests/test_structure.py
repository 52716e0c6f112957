"""The library's layering: the I/O modules see the averager only through ``AverageState``."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "shardavg"
IO_MODULES = ("checkpoint", "stateful", "export", "offline", "cli")


def imported_modules(module: str) -> set[str]:
    """shardavg modules that ``module`` imports, at run time or for type checking."""
    tree = ast.parse((PACKAGE / f"{module}.py").read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            found.add(node.module or "")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("shardavg."):
            found.add(node.module.removeprefix("shardavg."))
    return found


def test_io_modules_never_import_the_averager() -> None:
    for module in IO_MODULES:
        assert "averager" not in imported_modules(module), f"shardavg/{module}.py imports averager"


def test_io_modules_use_no_private_attribute_of_the_state() -> None:
    for module in IO_MODULES:
        tree = ast.parse((PACKAGE / f"{module}.py").read_text())
        private = sorted(
            {
                node.attr
                for node in ast.walk(tree)
                if isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in ("state", "avg", "averager")
                and node.attr.startswith("_")
            }
        )
        assert not private, f"shardavg/{module}.py reads private attributes {private}"
