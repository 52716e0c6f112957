"""YAML configs for the jobs in ``launch/``, with ``--set key=value`` overrides on dotted keys.

A config is the YAML file itself: every key a job reads is in it, so an override may only
change an existing key, to a value of the same type. Anything else stops the job before it
starts, with one message naming the key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A config that cannot run: the message names the file or the key."""


def load(path: str | Path, overrides: list[str] = ()) -> dict[str, Any]:
    path = Path(path)
    try:
        config = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as error:
        raise ConfigError(f"cannot read config {path}: {error}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"config {path} must be a mapping of keys to values")
    for override in overrides:
        key, sep, text = override.partition("=")
        if not sep:
            raise ConfigError(f"--set {override!r}: expected key=value")
        apply(config, key.strip(), yaml.safe_load(text))
    return config


def apply(config: dict[str, Any], key: str, value: Any) -> None:
    """Set the dotted ``key`` to ``value``; the key must exist and keep its type."""
    *parents, last = key.split(".")
    node = config
    for depth, part in enumerate(parents):
        node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict):
            raise ConfigError(f"unknown config key {'.'.join(parents[: depth + 1])!r} (in --set {key})")
    if last not in node:
        raise ConfigError(f"unknown config key {key!r}; known here: {sorted(node)}")
    old = node[last]
    if old is not None and not _same_type(old, value):
        kind = type(old).__name__
        raise ConfigError(f"config key {key!r} takes {'an' if kind[0] in 'aeiou' else 'a'} {kind}, got {value!r}")
    node[last] = value


def _same_type(old: Any, new: Any) -> bool:
    if isinstance(old, bool) or isinstance(new, bool):
        return isinstance(old, bool) and isinstance(new, bool)
    if isinstance(old, float):
        return isinstance(new, (int, float))
    return isinstance(new, type(old))


def validate(config: dict[str, Any], schema: dict[str, Any], where: str = "") -> None:
    """Every key of ``schema`` present with a value of its type(s), and no other key.

    A schema value is a type, a tuple of types (``type(None)`` for optional), or a nested
    schema for a mapping; ``dict`` alone accepts any mapping (checked by the job itself).
    """
    unknown = sorted(set(config) - set(schema))
    if unknown:
        raise ConfigError(f"unknown config key {where + unknown[0]!r}; known here: {sorted(schema)}")
    for key, expected in schema.items():
        name = where + key
        if key not in config:
            raise ConfigError(f"config key {name!r} is missing")
        value = config[key]
        if isinstance(expected, dict):
            if not isinstance(value, dict):
                raise ConfigError(f"config key {name!r} must be a mapping, got {value!r}")
            validate(value, expected, name + ".")
            continue
        types = expected if isinstance(expected, tuple) else (expected,)
        if not any(_same_type(kind() if kind is not type(None) else None, value) for kind in types):
            names = " or ".join("null" if t is type(None) else t.__name__ for t in types)
            raise ConfigError(f"config key {name!r} takes {names}, got {value!r}")
