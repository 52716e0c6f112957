"""A saved averager's description (counters, rule, tensors), checked whole before anything changes.

Every reader (``avg.load``, the DCP Stateful, the offline CLI) passes what it read through
``check_description``: a damaged or crafted description is refused with one message naming
where it came from and the field at fault, so nothing is half-restored and no reader trips
over a missing key or a wrong type later. Descriptions written since format version 2 carry
a checksum of their own content, so an edited or corrupted byte is refused too.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from typing import Any

from .errors import CheckpointError
from .rules import rule_from_config
from .state import AVERAGE_NAME, FORMAT, VERSION
from .storage import DTYPES
from .strategies import ADAPTERS

KINDS = ("param", "buffer")
ROLES = ("average", "copy", "live")
CHECKSUM = "checksum"
RUN_ID = re.compile(r"^[0-9a-f]{32}$")
REQUIRED = ("step", "num_updates", "num_skipped", "averages", "strategy", "world_size", "options", "tensors")
REQUIRED_V2 = tuple("rule" if key == "averages" else key for key in REQUIRED)


def fail(where: str, what: str) -> CheckpointError:
    return CheckpointError(f"{where}: {what}")


def is_count(value: Any, minimum: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def numel(shape: list[int]) -> int:
    return math.prod(shape)


def checksum(meta: dict[str, Any]) -> str:
    """SHA-256 of the description without its checksum, in one canonical JSON spelling."""
    content = {key: value for key, value in meta.items() if key != CHECKSUM}
    canonical = json.dumps(content, sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


def with_checksum(meta: dict[str, Any]) -> dict[str, Any]:
    return meta | {CHECKSUM: checksum(meta)}


def _check_rule(config: Any, where: str) -> None:
    """A built-in rule's exact ``to_config()``, or a custom rule's name."""
    if isinstance(config, dict) and config.get("kind") == "custom":
        if set(config) != {"kind", "name"} or not isinstance(config["name"], str):
            raise fail(where, f"'rule' is not a custom rule's config: {str(config)[:200]}")
        return
    try:
        canonical = rule_from_config(config).to_config() if isinstance(config, dict) else None
    except (ValueError, TypeError, KeyError) as error:
        raise fail(where, f"'rule' {str(config)[:200]} is not a rule: {error!r}") from None
    if canonical != config:
        raise fail(where, f"'rule' {str(config)[:200]} is not a rule's config")


def _check_averages(averages: Any, where: str) -> None:
    """A non-empty list of ``{"name", "rule"}``: plain, distinct names, or one unnamed average."""
    if not isinstance(averages, list) or not averages:
        raise fail(where, f"'averages' must be a non-empty list, got {str(averages)[:200]}")
    for entry in averages:
        if not isinstance(entry, dict) or set(entry) != {"name", "rule"}:
            raise fail(where, f"an 'averages' entry must hold 'name' and 'rule', got {str(entry)[:200]}")
        _check_rule(entry["rule"], where)
    names = [entry["name"] for entry in averages]
    unnamed = names == [None]
    if not unnamed and not all(isinstance(n, str) and AVERAGE_NAME.match(n) for n in names):
        raise fail(where, f"average names {names} must be plain names, or one average with name null")
    if len(set(names)) != len(names):
        raise fail(where, f"average names {names} repeat")


def _check_options(options: Any, where: str) -> None:
    checks = {
        "every_n_steps": lambda value: is_count(value, 1),
        "start_step": is_count,
        "dtype": lambda value: value is None or (isinstance(value, str) and value in DTYPES),
        "buffers": lambda value: value in ("copy", "average", "ignore"),
        "include_frozen": lambda value: isinstance(value, bool),
    }
    if not isinstance(options, dict) or set(options) != set(checks):
        raise fail(where, f"'options' must hold {sorted(checks)}, got {str(options)[:200]}")
    wrong = [f"{key}={options[key]!r}" for key, valid in checks.items() if not valid(options[key])]
    if wrong:
        raise fail(where, f"'options' has invalid values: {', '.join(wrong)}")


def _check_tensor(entry: Any, where: str) -> None:
    if not isinstance(entry, dict):
        raise fail(where, f"a tensor entry is {type(entry).__name__}, not an object")
    name = entry.get("name")
    if not isinstance(name, str) or not name:
        raise fail(where, f"a tensor entry has no name: {str(entry)[:200]}")
    aliases = entry.get("aliases")
    problems = []
    if not isinstance(aliases, list) or not all(isinstance(alias, str) and alias for alias in aliases):
        problems.append(f"aliases {aliases!r} are not a list of names")
    if entry.get("kind") not in KINDS:
        problems.append(f"kind {entry.get('kind')!r} is not one of {KINDS}")
    if entry.get("role") not in ROLES:
        problems.append(f"role {entry.get('role')!r} is not one of {ROLES}")
    shape = entry.get("shape")
    if not isinstance(shape, list) or not all(is_count(dim) for dim in shape):
        problems.append(f"shape {shape!r} is not a list of sizes")
    if not isinstance(entry.get("dtype"), str) or entry["dtype"] not in DTYPES:
        problems.append(f"dtype {entry.get('dtype')!r} is not one of {sorted(DTYPES)}")
    if problems:
        raise fail(where, f"tensor {name!r}: " + "; ".join(problems))


def check_description(meta: Any, where: str) -> dict[str, Any]:
    """Refuse anything that is not a complete, well-typed description written by a shardavg.

    Returns it with older versions' one ``"rule"`` given as ``"averages"``, as version 3 writes."""
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{where} is not a shardavg checkpoint description")
    version = meta.get("version")
    if not is_count(version, 1) or version > VERSION:
        raise CheckpointError(f"{where} has format version {version!r}; this shardavg reads up to {VERSION}")
    if CHECKSUM in meta or version >= 2:
        if meta.get(CHECKSUM) != checksum(meta):
            raise fail(where, "the checksum does not match the content: the file was edited or damaged")
    required = ("step", "num_updates", "rule", "tensors") if version == 1 else REQUIRED_V2 if version == 2 else REQUIRED
    missing = [key for key in required if key not in meta]
    if missing:
        raise CheckpointError(f"{where} lacks {missing}")
    for key, minimum in (("step", 0), ("num_updates", 0), ("num_skipped", 0), ("world_size", 1)):
        if key in meta and not is_count(meta[key], minimum):
            raise fail(where, f"{key!r} must be an integer >= {minimum}, got {meta[key]!r}")
    if version < 3:  # one unnamed average, described by "rule"
        rule = meta["rule"]
        meta = {key: value for key, value in meta.items() if key != "rule"} | {
            "averages": [{"name": None, "rule": rule}]
        }
    _check_averages(meta["averages"], where)
    if "strategy" in meta and not (isinstance(meta["strategy"], str) and meta["strategy"] in ADAPTERS):
        raise fail(where, f"'strategy' must be one of {sorted(ADAPTERS)}, got {meta['strategy']!r}")
    if "options" in meta:
        _check_options(meta["options"], where)
    if "run" in meta and not (isinstance(meta["run"], str) and RUN_ID.match(meta["run"])):
        raise fail(where, f"'run' must be 32 hex digits, got {str(meta['run'])[:80]!r}")
    if "sequence" in meta and not is_count(meta["sequence"]):
        raise fail(where, f"'sequence' must be an integer >= 0, got {meta['sequence']!r}")
    if not isinstance(meta["tensors"], list):
        raise fail(where, "'tensors' must be a list")
    names: set[str] = set()
    for entry in meta["tensors"]:
        _check_tensor(entry, where)
        for name in (entry["name"], *entry["aliases"]):
            if name in names:
                raise fail(where, f"the name {name!r} appears twice")
            names.add(name)
    return meta
