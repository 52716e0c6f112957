"""The package's structure, read from the package itself: no module order is kept here by hand.

Its packages are the folders under ``shardavg/`` (``base``, ``layouts``, ``update``, ...), each top-level
module that declares its imports (``rules.py``: a package of one module), and the face (the other
top-level modules: what users call), which shardavg's ``__init__`` declares for. Each package's
docstring ends with what it may import ("It may import: base, layouts."). Those declarations draw
the packages' graph, which must hold no cycle (so every arrow points down); every module's imports of
the package (relative or ``shardavg.``, in function bodies and type checking too) must stay within its
package's declaration, and a declaration names only packages the package does import (so the sentence stays
true). A new module is checked against its package's declaration with no edit here. Modules import one
another without a cycle, and ``docs/packages.md`` states each package's declaration as its docstring does.

No module reaches into another object's private attributes, except the engine internals listed in
``ENGINE_INTERNALS`` (each with why: the engines offer no public way). The core imports no
framework, and the engines it adapts only inside functions. The checks run on every module of the
package and the integrations, and on planted sources that must fail them."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "shardavg"
PACKAGES_PAGE = PACKAGE.parent / "docs" / "packages.md"
FACE = "face"  # the top-level modules that are no package of their own; shardavg/__init__.py declares for them
SAYS = re.compile(r"It may import: ([^.]*)\.\Z")  # the declaration, at the end of a docstring

# Private names of other libraries shardavg reads, by module: (the expression or name, why).
ENGINE_INTERNALS = {
    "update.updater": {
        "_version": "a tensor's version counter, which every in-place write through it moves: how a write the "
        "background update did not wait for is seen (torch offers no public accessor)",
    },
    "strategies.dtensor": {
        "_local_tensor": "a DTensor's local shard itself: to_local() makes a new alias at every call, which "
        "would look like a new view every update",
        "_StridedShard": "the placement FSDP2 gives a parameter sharded by tensor parallel on the same dim",
        "_layout": "a device mesh's layout over its root's ranks: where a sub-mesh's copies lie (the other "
        "ranks' meshes), so every rank derives the same grid",
        "_rank_map": "the root mesh's ranks, which that layout indexes",
    },
    "strategies.base": {
        "_orig_mod": "the module inside torch.compile's OptimizedModule, which offers no accessor",
        "torch._dynamo.eval_frame": "where OptimizedModule lives",
        "_buffers": "where a buffer lives, to read it again after model.to() replaced it",
        "_non_persistent_buffers_set": "which buffers state_dict() holds, with their owner",
    },
    "strategies.fsdp1": {
        "_handle": "FSDP1's flat parameter handle: the only description of each rank's slice",
        "_fqns": "the names of the parameters in a flat parameter",
        "_shapes": "their shapes",
        "_shard_param_infos": "which part of each parameter this rank's slice holds",
        "_shared_param_infos": "tied parameters in a flat parameter",
        "_params": "the original parameters (use_orig_params), for requires_grad",
        "_use_orig_params": "whether they exist",
        "_numels_with_padding": "each parameter's size in the flat parameter, alignment padding included: "
        "where every rank's slice of a parameter lies",
        "_is_padding_mask": "which of those entries are padding",
        "_device_mesh": "the 2-d mesh a hybrid-sharded unit shards and replicates over",
        "_local_shard": "this rank's slice of a flat parameter",
        "torch.distributed.fsdp._runtime_utils": "FSDP1's _reshard: frees a root unit's unsharded copy",
        "_reshard": "that function",
    },
    "strategies.zero12": {"_hp_mapping": "DeepSpeed ZeRO-1/2's link from a parameter to its fp32 master fragment"},
    "output.dcp_checkpoint": {
        "_StorageInfo": "DCP's record of where an item lies (file, offset, length) in .metadata; torch has no "
        "public constructor",
    },
    "averager.stateful": {
        "torch.distributed.tensor._shards_wrapper": "LocalShardsWrapper, the DTensor payload DCP reads for "
        "arbitrary shards (torchrec's way); no public path"
    },
}
ANYWHERE = {"_foreach_": "torch's fused multi-tensor kernels (torch.optim and swa_utils use them)"}
FRAMEWORKS = ("accelerate", "transformers", "lightning", "pytorch_lightning")  # integrations only
ENGINES = ("deepspeed", "megatron")  # the core adapts them, importing them only inside functions


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1]) if parts[-1] == "__init__" and len(parts) > 1 else ".".join(parts)


@functools.cache
def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def shown(name: str) -> str:
    """A module as its file: where to look."""
    path = modules().get(name)
    return str(path.relative_to(PACKAGE.parent)) if path else f"shardavg/{name.replace('.', '/')}.py"


def declaration(source: str) -> list[str] | None:
    """The packages a docstring says its package may import (its last sentence), or None if it says nothing."""
    said = SAYS.search((ast.get_docstring(ast.parse(source)) or "").strip())
    if said is None:
        return None
    names = re.split(r",\s*", said.group(1).strip())
    return [] if names == ["nothing"] else names


@functools.cache
def layout() -> tuple[dict[str, str], dict[str, Path]]:
    """Each module's package, and the file whose docstring declares each package's imports: a folder's
    ``__init__``; a top-level module that declares, itself; the face, shardavg's ``__init__``."""
    package_of: dict[str, str] = {}
    declared_in = {FACE: PACKAGE / "__init__.py"}
    for name, path in modules().items():
        top = name.split(".")[0]
        if (PACKAGE / top).is_dir():
            package_of[name], declared_in[top] = top, PACKAGE / top / "__init__.py"
        elif name != "__init__" and declaration(path.read_text()) is not None:
            package_of[name], declared_in[name] = name, path
        else:
            package_of[name] = FACE
    return package_of, declared_in


@functools.cache
def declared() -> dict[str, set[str]]:
    """Each package's declared imports (an undeclared package's as none: the first test names it)."""
    return {package: set(declaration(path.read_text()) or ()) for package, path in layout()[1].items()}


def resolved(dotted: str, known: set[str]) -> str:
    """The module an import of ``dotted`` (a name relative to ``shardavg``) runs: a name from a
    package's ``__init__`` is that ``__init__``; ``shardavg`` itself is ``__init__``."""
    while dotted and dotted not in known:
        dotted = dotted.rpartition(".")[0]
    return dotted or "__init__"


def internal_imports(name: str, tree: ast.AST, is_package: bool | None = None) -> dict[str, int]:
    """The package's modules ``name`` imports, anywhere in it (function bodies and type checking
    too), relative or through ``shardavg.``, each with the first line that imports it."""
    known = set(modules())
    if is_package is None:
        is_package = name == "__init__" or (PACKAGE / Path(*name.split(".")) / "__init__.py").exists()
    package = [] if name == "__init__" else name.split(".") if is_package else name.split(".")[:-1]
    found: dict[str, int] = {}

    def add(dotted: str, line: int) -> None:
        target = resolved(dotted, known)
        if target != name:
            found.setdefault(target, line)

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = ".".join([*package[: len(package) - node.level + 1], *([node.module] if node.module else [])])
            for alias in node.names:
                add(f"{base}.{alias.name}".lstrip("."), node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "shardavg":
            for alias in node.names:
                add(f"{node.module}.{alias.name}".removeprefix("shardavg").lstrip("."), node.lineno)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "shardavg":
                    add(alias.name.removeprefix("shardavg").lstrip("."), node.lineno)
    return found


def imports_by_module() -> dict[str, dict[str, int]]:
    return {name: internal_imports(name, ast.parse(path.read_text())) for name, path in modules().items()}


def a_cycle(graph: dict[str, set[str]]) -> list[str]:
    """A cycle of ``graph`` (``[a, b, ..., a]``), or ``[]`` where there is none."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str]:
        if node in path:
            return [*path[path.index(node) :], node]
        if node in done:
            return []
        for target in sorted(graph.get(node, ())):
            if cycle := visit(target, [*path, node]):
                return cycle
        done.add(node)
        return []

    for node in sorted(graph):
        if cycle := visit(node, []):
            return cycle
    return []


def outside_declaration(name: str, imports: dict[str, int], package_of: dict[str, str]) -> list[str]:
    """``name``'s imports of packages its package does not declare, each naming the module, the import
    and the declaration it breaks."""
    package, declared_in = package_of[name], layout()[1]
    may = declared().get(package, set())
    found = []
    for target, line in sorted(imports.items()):
        other = package_of[target]
        if other != package and other not in may:
            said = ", ".join(declaration(declared_in[package].read_text()) or ["nothing"])
            found.append(
                f"{shown(name)}:{line} imports shardavg.{target} (package {other}), "
                f"which package {package} may not import: "
                f"{declared_in[package].relative_to(PACKAGE.parent)} says 'It may import: {said}.' Move the code "
                f"that needs it, or add {other} there if that draws no cycle"
            )
    return found


def test_every_package_says_what_it_may_import() -> None:
    folders = {p.parent.relative_to(PACKAGE) for p in PACKAGE.rglob("*.py")} - {Path(".")}
    loose = sorted(str(f) for f in folders if not (PACKAGE / f / "__init__.py").exists())
    assert not loose, f"give these folders an __init__.py (a package's says what it may import): {loose}"
    declared_in = layout()[1]
    for package, path in declared_in.items():
        said = declaration(path.read_text())
        where = path.relative_to(PACKAGE.parent)
        assert said is not None, f"{where}: end its docstring with 'It may import: PARTS.' (or 'nothing.')"
        unknown = sorted(set(said) - set(declared_in))
        assert not unknown, f"{where} says it may import {unknown}, which are no packages: {sorted(declared_in)}"
        assert package not in said, f"{where} names its own package, {package}, among what it may import"


def test_the_declared_imports_draw_no_cycle() -> None:
    """So the packages stand on floors and every arrow points down."""
    cycle = a_cycle(declared())
    declared_in = layout()[1]
    files = ", ".join(str(declared_in[package].relative_to(PACKAGE.parent)) for package in cycle[:-1])
    assert not cycle, (
        f"the packages' declarations go round: {' -> '.join(cycle)} ({files}); one of them must not import the next"
    )


def test_every_import_stays_within_its_parts_declaration() -> None:
    package_of = layout()[0]
    found = [f for name, imports in imports_by_module().items() for f in outside_declaration(name, imports, package_of)]
    assert not found, "\n".join(found)


def test_every_declared_import_is_used() -> None:
    """A declaration names only packages the package does import, so the sentence stays true."""
    package_of, declared_in = layout()
    used: dict[str, set[str]] = {package: set() for package in declared_in}
    for name, imports in imports_by_module().items():
        mine = package_of[name]
        used[mine].update(package_of[target] for target in imports if package_of[target] != mine)
    stale = [
        f"{declared_in[package].relative_to(PACKAGE.parent)} says package {package} may import "
        f"{sorted(may - used[package])}, "
        "which none of its modules does: take them out of its 'It may import' sentence"
        for package, may in declared().items()
        if may - used[package]
    ]
    assert not stale, "\n".join(stale)


def reachable(package: str) -> set[str]:
    """The packages ``package`` may reach through the declarations, directly or through others."""
    seen, todo = set(), [package]
    while todo:
        for below in declared()[todo.pop()] - seen:
            seen.add(below)
            todo.append(below)
    return seen


@pytest.mark.parametrize("package", ["checkpoints", "output", "offline"])
def test_the_file_formats_reach_no_live_state(package: str) -> None:
    """Only the averager's own I/O (``averager/``) takes an ``AverageState``: the packages that read
    and write files know a saved averager by its ``Description``, so that a file is read, checked
    or merged without a live one. No declaration under them reaches ``averager`` (and the checks
    above hold every import to the declarations)."""
    assert "averager" not in reachable(package), (
        f"{shown(package)}: {package} reaches averager/ through its declared imports {sorted(declared()[package])}; "
        "it must know the averager by its Description (checkpoints/description.py), not its live state"
    )


def test_no_modules_import_one_another_in_a_circle() -> None:
    """Within a package as across them (an import inside a function too): each module stands on the ones it imports."""
    cycle = a_cycle({name: set(imports) for name, imports in imports_by_module().items()})
    assert not cycle, f"these modules import one another in a circle: {' -> '.join(cycle)}"


def parts_page() -> dict[str, list[str]]:
    """Each package's paragraph in docs/packages.md, "**package** (where; may import X, Y).", as X, Y, in page order."""
    said = re.findall(r"^\*\*(\w+)\*\* \([^;]*; may import ([^)]*)\)\.", PACKAGES_PAGE.read_text(), re.MULTILINE)
    return {package: [] if may == "nothing" else re.split(r",\s*", may.strip()) for package, may in said}


def test_docs_parts_page_says_what_each_part_says() -> None:
    page, declared_in = parts_page(), layout()[1]
    assert sorted(page) == sorted(declared_in), (
        f"docs/packages.md describes packages {sorted(page)}; the package has {sorted(declared_in)}: give each package "
        "one paragraph, '**package** (where; may import PACKAGES).'"
    )
    for package, may in declared().items():
        assert set(page[package]) == may, (
            f"docs/packages.md says {package} may import {page[package]}; "
            f"{declared_in[package].relative_to(PACKAGE.parent)} says {sorted(may)}"
        )
    order = list(page)
    for package, may in page.items():
        above = sorted(m for m in may if order.index(m) > order.index(package))
        assert not above, (
            f"docs/packages.md lists the packages bottom first: put {package} after {above}, which it imports"
        )


def test_no_module_touches_another_objects_private_attributes() -> None:
    found = [use for name, path in modules().items() for use in private_uses(name, ast.parse(path.read_text()))]
    assert not found, found


def private_uses(name: str, tree: ast.AST) -> list[str]:
    """Private attributes of other objects this source reads, and private names it imports, that
    ``ENGINE_INTERNALS`` does not list for it."""
    allowed = ENGINE_INTERNALS.get(name, {})
    found = []

    def check(what: str, line: int) -> None:
        parts = [part for part in what.split(".") if part.startswith("_") and not part.startswith("__")]
        if parts and what not in allowed and not all(p in allowed or p.startswith(tuple(ANYWHERE)) for p in parts):
            found.append(f"{name}:{line}: {what}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                check(node.attr, node.lineno)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr"):
            if len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
                if not (isinstance(node.args[0], ast.Name) and node.args[0].id in ("self", "cls")):
                    check(node.args[1].value, node.lineno)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            if not node.module.startswith("shardavg"):
                check(node.module, node.lineno)
                for alias in node.names:
                    check(alias.name, node.lineno)
    return found


def imported_libraries(nodes: list[ast.AST]) -> dict[str, int]:
    """The top-level names of the libraries ``nodes`` import (absolute imports), with a line each."""
    names: dict[str, int] = {}
    for node in nodes:
        if isinstance(node, ast.Import):
            for alias in node.names:
                names.setdefault(alias.name.split(".")[0], node.lineno)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.setdefault(node.module.split(".")[0], node.lineno)
    return names


def run_at_import(tree: ast.AST) -> list[ast.AST]:
    """The nodes that run when a module is imported: not function bodies, nor ``if TYPE_CHECKING:``."""
    found: list[ast.AST] = []

    def visit(node: ast.AST) -> None:
        found.append(node)
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):  # its decorators run, its body not
                for decorator in child.decorator_list:
                    visit(decorator)
                continue
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for other in child.orelse:
                    visit(other)
                continue
            visit(child)

    visit(tree)
    return found


def test_the_core_never_imports_a_framework() -> None:
    for name, path in modules().items():
        if not name.startswith("integrations"):
            found = imported_libraries(list(ast.walk(ast.parse(path.read_text())))).keys() & set(FRAMEWORKS)
            assert not found, f"{shown(name)} imports {sorted(found)}: only shardavg/integrations/ may"


def test_the_core_imports_the_engines_only_inside_functions() -> None:
    """Importing shardavg imports no DeepSpeed or Megatron: a strategy imports its engine when it is used."""
    found = []
    for name, path in modules().items():
        if not name.startswith("integrations"):
            at_import = imported_libraries(run_at_import(ast.parse(path.read_text())))
            found += [
                f"{shown(name)}:{line} imports {lib} at import" for lib, line in at_import.items() if lib in ENGINES
            ]
    assert not found, f"{found}: import it inside the function that needs it"


@pytest.mark.parametrize(
    "source",
    [
        "def f(avg):\n    return avg._state",
        "def f(accelerator):\n    return getattr(accelerator, '_save_model_state_pre_hook', {})",
        "from torch.distributed.tensor._utils import compute_local_shape_and_global_offset",
        "from torch.distributed.tensor.placement_types import _StridedShard",  # allowed in strategies.dtensor only
    ],
)
def test_a_planted_private_access_is_found(source: str) -> None:
    assert private_uses("averager", ast.parse(source)), source


@pytest.mark.parametrize(
    ("name", "source", "target"),
    [
        ("checkpoints.format", "from ..averager.average_state import AverageState", "averager.average_state"),
        ("base.newcomer", "def f():\n    from shardavg.layouts.parts import Part", "layouts.parts"),
        ("layouts.newcomer", "import shardavg.strategies.base", "strategies.base"),
        ("strategies.newcomer", "from .. import WeightAverager", "__init__"),
        ("output.newcomer", "if TYPE_CHECKING:\n    from ..averager import swap", "averager.swap"),
    ],
)
def test_a_planted_import_outside_the_declaration_is_found(name: str, source: str, target: str) -> None:
    """A module the test has never seen, in any package, is held to its package's declaration."""
    imports = internal_imports(name, ast.parse(source), is_package=False)
    assert list(imports) == [target]
    (found,) = outside_declaration(name, imports, {**layout()[0], name: name.split(".")[0]})
    assert found.startswith(f"shardavg/{name.replace('.', '/')}.py:") and f"imports shardavg.{target}" in found
    assert f"which package {name.split('.')[0]} may not import" in found and "It may import: " in found


def test_a_planted_import_within_the_declaration_passes() -> None:
    source = "from ..layouts.parts import Part\nfrom .base import Strategy\ndef f():\n    from ..base import dist"
    imports = internal_imports("strategies.newcomer", ast.parse(source), is_package=False)
    assert sorted(imports) == ["base.dist", "layouts.parts", "strategies.base"]
    assert not outside_declaration("strategies.newcomer", imports, {**layout()[0], "strategies.newcomer": "strategies"})


def test_a_planted_cycle_is_found() -> None:
    assert a_cycle({"base": set(), "state": {"update"}, "update": {"base", "output"}, "output": {"state"}}) == [
        "output", "state", "update", "output",
    ]  # fmt: skip
    assert a_cycle({"base": set(), "rules": {"base"}, "layouts": {"base"}, "update": {"rules", "layouts"}}) == []


def test_a_planted_engine_import_at_module_level_is_found() -> None:
    lazy = "def strategy():\n    from megatron.core import parallel_state\n    import deepspeed"
    assert not imported_libraries(run_at_import(ast.parse(lazy))).keys() & set(ENGINES)
    at_import = "from megatron.core import parallel_state\nclass A:\n    import deepspeed"
    assert imported_libraries(run_at_import(ast.parse(at_import))).keys() & set(ENGINES) == {"megatron", "deepspeed"}
