"""The package's structure: its parts are folders (``base``, ``layouts``, ``update``, ...), each
imports only the parts below it, and inside a part every module imports only modules below it
(the order here is the layering, bottom first). Each part's ``__init__`` says in its docstring what
it may import, and the imports agree. No module reaches into another object's private attributes,
except the engine internals listed in ``ENGINE_INTERNALS`` (each with why: the engines offer no
public way). The checks run on every module of the package and the integrations, and on planted
sources that must fail them."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "shardavg"

PARTS = {  # bottom first: a part imports only parts before it; a module, only modules before it
    "base": [
        "base.errors", "base.links", "base.validate", "base.untrusted", "base.dtypes", "base.dist", "base.logs",
        "base.progress", "base",
    ],
    "rules": ["rules"],
    "layouts": ["layouts.parts", "layouts.tensor_layout", "layouts.tensor_info", "layouts.shard_layout", "layouts"],
    "strategies": [
        "strategies.dtensor", "strategies.base", "strategies.fsdp1", "strategies.fsdp2", "strategies.zero3",
        "strategies.zero12", "strategies.replicated", "strategies.pipeline", "strategies",
    ],
    "update": [
        "update.options", "update.staging", "update.masked_lerp", "update.kernels", "update.fused", "update.watch",
        "update.background", "update.updater", "update",
    ],
    "state": ["state.description", "state.average_state", "state.swap", "state"],
    "checkpoints": [
        "checkpoints.storage", "checkpoints.format", "checkpoints.ownership", "checkpoints.reading",
        "checkpoints.checkpoint", "checkpoints.stateful", "checkpoints",
    ],
    "output": [
        "output.provenance", "output.record", "output.target", "output.work", "output.weight_files",
        "output.model_writer", "output.model_folder", "output.dcp_checkpoint", "output.export", "output",
    ],
    "offline": [
        "offline.saved_average", "offline.megatron", "offline.deepspeed_folders", "offline.sources", "offline.merge",
        "offline",
    ],
    "face": ["averager", "posthoc", "cli", "__init__", "__main__"],
    "integrations": [
        "integrations", "integrations.accelerate", "integrations.deepspeed", "integrations.lightning",
        "integrations.transformers",
    ],
}  # fmt: skip
ORDER = [module for modules in PARTS.values() for module in modules]
PART_OF = {module: part for part, modules in PARTS.items() for module in modules}
FOLDERS = [part for part in PARTS if (PACKAGE / part / "__init__.py").exists()]

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
    "checkpoints.stateful": {
        "torch.distributed.tensor._shards_wrapper": "LocalShardsWrapper, the DTensor payload DCP reads for "
        "arbitrary shards (torchrec's way); no public path"
    },
}
ANYWHERE = {"_foreach_": "torch's fused multi-tensor kernels (torch.optim and swa_utils use them)"}
FRAMEWORKS = ("accelerate", "transformers", "lightning", "pytorch_lightning")  # integrations only


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1]) if parts[-1] == "__init__" and len(parts) > 1 else ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def internal_imports(name: str, tree: ast.AST) -> set[str]:
    """The package's modules ``name`` imports, anywhere in it (function bodies and type checking too)."""
    is_package = not (PACKAGE / Path(*name.split("."))).with_suffix(".py").exists()  # (an __init__)
    package = name.split(".") if is_package else name.split(".")[:-1]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[: len(package) - node.level + 1]
            if node.module:
                found.add(".".join([*base, node.module]))
            else:
                found.update(".".join([*base, alias.name]) for alias in node.names)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [node.module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            found.update(n.removeprefix("shardavg.") for n in names if n and n.startswith("shardavg."))
    return {target for target in found if target}


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


def framework_imports(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module.split(".")[0])
    return names & set(FRAMEWORKS)


def test_every_module_is_placed_in_the_layering() -> None:
    assert sorted(modules()) == sorted(ORDER), f"place these in ORDER: {sorted(set(modules()) ^ set(ORDER))}"


def imports_by_module() -> dict[str, set[str]]:
    """Each module's imports of the package, a name from a package's ``__init__`` as that package."""
    found = {}
    for name, path in modules().items():
        targets = internal_imports(name, ast.parse(path.read_text()))
        found[name] = {target if target in ORDER else target.rsplit(".", 1)[0] for target in targets}
    return found


def test_every_part_is_a_folder_that_says_what_it_may_import() -> None:
    """Each folder's docstring ends with the parts it may import: exactly those below it that its
    modules do import (so the sentence stays true), never one above it."""
    imported: dict[str, set[str]] = {}
    for name, targets in imports_by_module().items():
        imported.setdefault(PART_OF[name], set()).update(PART_OF[t] for t in targets if PART_OF[t] != PART_OF[name])
    for part in FOLDERS:
        docstring = ast.get_docstring(ast.parse((PACKAGE / part / "__init__.py").read_text())) or ""
        said = re.search(r"It may import: (.*)\.$", docstring.strip())
        assert said, f"shardavg/{part}/__init__.py: end its docstring with 'It may import: PARTS.'"
        may = set() if said.group(1) == "nothing" else set(said.group(1).split(", "))
        below = list(PARTS)[: list(PARTS).index(part)]
        assert may <= set(below), f"{part} says it may import {sorted(may - set(below))}, which are not below it"
        assert imported.get(part, set()) == may, (
            f"{part} imports {sorted(imported.get(part, set()))}, says {sorted(may)}"
        )


def test_no_part_depends_on_another_both_ways() -> None:
    edges = {
        (PART_OF[name], PART_OF[target])
        for name, targets in imports_by_module().items()
        for target in targets
        if PART_OF[name] != PART_OF[target]
    }
    assert not {(a, b) for a, b in edges if (b, a) in edges}


def test_no_import_runs_back_up() -> None:
    upward = []
    for name, path in modules().items():
        for target in internal_imports(name, ast.parse(path.read_text())):
            target = target if target in ORDER else target.rsplit(".", 1)[0]  # a name from a package's __init__
            if ORDER.index(target) >= ORDER.index(name):
                upward.append(f"{name} imports {target}")
    assert not upward, upward


def test_no_module_touches_another_objects_private_attributes() -> None:
    found = [use for name, path in modules().items() for use in private_uses(name, ast.parse(path.read_text()))]
    assert not found, found


def test_the_core_never_imports_a_framework() -> None:
    for name, path in modules().items():
        if not name.startswith("integrations"):
            assert not framework_imports(ast.parse(path.read_text())), name


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


def test_a_planted_upward_import_is_found() -> None:
    tree = ast.parse("from ..averager import WeightAverager")
    found = internal_imports("state.average_state", tree)
    assert found == {"averager"} and ORDER.index("averager") > ORDER.index("state.average_state")
