"""Hundreds of randomly damaged and crafted checkpoints: every one is refused with a shardavg
error (one line and exit code 2 from the CLI), or, where the damage changed nothing that
matters (a whitespace byte), loads exactly what was saved. Never a raw traceback, a hang,
or wrong weights with success.

Damaged bytes are caught by the manifest's checksum and the safetensors header checks.
Crafted values come with a recomputed checksum, as from someone who knows the format, so
they exercise every validator behind it; ``load`` must refuse them or load exactly what was
saved, and the CLI must refuse them in one line or export what the crafted manifest says
(a consistent rename or removal of a tensor is a different checkpoint, not a damaged one).
"""

from __future__ import annotations

import json
import random
import shutil
import struct
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import deadline, fresh, trained
from safetensors.torch import load_file

from shardavg import CheckpointError
from shardavg.checkpoints.description import with_checksum
from shardavg.cli import main as cli_main

CASES = 200  # per family: damaged manifest bytes, crafted manifest values, damaged shard headers
SHARD = "rank-00000-of-00001.safetensors"
JUNK = [None, "", "x", "../../etc/passwd", -1, -(2**64), 1.5, float("nan"), True, [], {}, [[[[]]]], {"a": [1]}]


def damage_bytes(data: bytearray, rng: random.Random, low: int = 0, high: int | None = None) -> bytearray:
    """Flip, drop, insert or cut bytes in ``data[low:high]``."""
    high = len(data) if high is None else high
    at = rng.randrange(low, high)
    kind = rng.choice(["flip", "drop", "insert", "cut", "digit"])
    if kind == "flip":
        data[at] ^= 1 << rng.randrange(8)
    elif kind == "drop":
        del data[at : at + rng.randint(1, 8)]
    elif kind == "insert":
        data[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
    elif kind == "cut":
        del data[at:]
    else:  # a digit for another digit keeps JSON valid and changes a number
        digits = [i for i in range(low, high) if 48 <= data[i] <= 57]  # ASCII digits only
        if digits:
            at = rng.choice(digits)
            data[at] = ord(str((int(chr(data[at])) + rng.randint(1, 9)) % 10))
    return data


def craft_value(meta: dict, rng: random.Random) -> None:
    """Replace or delete one value of the manifest (not its checksum): a top-level key picked
    uniformly, then a random way down into it."""
    parent, key = meta, rng.choice(sorted(set(meta) - {"checksum"}))
    while isinstance(parent[key], (dict, list)) and parent[key] and rng.random() < 0.7:
        parent = parent[key]
        key = rng.choice(sorted(parent) if isinstance(parent, dict) else range(len(parent)))
    if rng.random() < 0.2:
        del parent[key]
    else:
        parent[key] = rng.choice(JUNK)


def loaded(path: Path) -> tuple | None:
    """What ``load`` made of ``path``: the counters and the average, or None if it refused."""
    averager = fresh()
    try:
        with deadline(20):
            averager.load(path)
    except CheckpointError:
        return None
    return averager.step, averager.num_updates, averager.full_state_dict()


def exported(path: Path, out: Path, capsys) -> dict | None:
    """What the CLI exported from ``path``, or None if it refused in one line with exit code 2."""
    with deadline(20):
        code = cli_main(["export", str(path), str(out)])
    err = capsys.readouterr().err
    if code == 2:
        assert err.startswith("shardavg: error:") and len(err.strip().splitlines()) == 1, err
        return None
    assert code == 0, err
    return load_file(str(out / "model.safetensors"))


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("family", ["manifest-bytes", "crafted-values", "shard-header-bytes"])
def test_damaged_and_crafted_checkpoints(trainer, tmp_path, capsys, family) -> None:
    averager = trained(trainer, steps=3)
    pristine = averager.save(tmp_path / "pristine")
    want_load = loaded(pristine)
    want_export = exported(pristine, tmp_path / "pristine-export", capsys)
    assert want_load is not None and want_export is not None
    rng = random.Random(f"shardavg-{family}")
    mutate: Callable[[Path], None] = {
        "manifest-bytes": lambda path: damage(path / "shardavg.json", rng),
        "crafted-values": lambda path: craft(path, rng),
        "shard-header-bytes": lambda path: damage(path / SHARD, rng, header=True),
    }[family]
    outcomes: Counter[str] = Counter()
    for case in range(CASES):
        path = tmp_path / f"case-{case}"
        shutil.copytree(pristine, path)
        mutate(path)
        got = loaded(path)
        if got is not None:
            step, num_updates, average = got
            assert (step, num_updates) == want_load[:2] and same(average, want_load[2]), f"case {case}: wrong load"
        written = exported(path, tmp_path / f"export-{case}", capsys)
        if written is not None and family != "crafted-values":  # (a crafted, consistent table is what it says)
            assert same(written, want_export), f"case {case}: wrong export"
        outcomes[f"load {'identical' if got else 'refused'}, export {'identical' if written else 'refused'}"] += 1
        shutil.rmtree(path)
    print(family, dict(outcomes))
    refused = outcomes["load refused, export refused"]
    assert refused >= 0.8 * CASES, outcomes  # the damage must mostly matter, or this test proves little


def damage(file: Path, rng: random.Random, header: bool = False) -> None:
    data = bytearray(file.read_bytes())
    high = 8 + struct.unpack("<Q", bytes(data[:8]))[0] if header else len(data)
    file.write_bytes(bytes(damage_bytes(data, rng, 0, high)))


def craft(path: Path, rng: random.Random) -> None:
    meta = json.loads((path / "shardavg.json").read_text())
    meta.pop("checksum")
    craft_value(meta, rng)
    (path / "shardavg.json").write_text(json.dumps(with_checksum(meta)))


def test_damaged_tensor_bytes_are_refused_by_every_verifying_reader(trainer, tmp_path, capsys) -> None:
    """Bytes changed inside the tensor data (not the header) pass every structural check; the
    SHA-256 recorded at save time catches each one."""
    pristine = trained(trainer, steps=3).save(tmp_path / "pristine")
    original = (pristine / SHARD).read_bytes()
    data_start = 8 + struct.unpack("<Q", original[:8])[0]
    rng = random.Random("shardavg-tensor-bytes")
    outcomes: Counter[str] = Counter()
    for case in range(CASES):
        path = tmp_path / f"case-{case}"
        shutil.copytree(pristine, path)
        damaged = bytes(damage_bytes(bytearray(original), rng, data_start))
        (path / SHARD).write_bytes(damaged)
        if damaged == original:  # (a digit swap in data without any digit byte changes nothing)
            shutil.rmtree(path)
            continue
        averager = fresh()
        with deadline(20), pytest.raises(CheckpointError):
            averager.load(path, verify=True)
        assert averager.num_updates == 0, f"case {case}: changed before refusing"
        with deadline(20):
            code = cli_main(["inspect", str(path), "--verify"])
        err = capsys.readouterr().err
        assert code == 2 and err.startswith("shardavg: error:") and len(err.strip().splitlines()) == 1, err
        outcomes["size" if len(damaged) != len(original) else "sha256"] += 1
        shutil.rmtree(path)
    print(dict(outcomes))
    assert outcomes["sha256"] >= CASES // 4 and outcomes["size"] >= CASES // 4, outcomes


def test_the_crafted_family_reaches_every_field(trainer, tmp_path) -> None:
    """Guard: the crafted values land on every key of the manifest, and deep inside the tensor table."""
    meta = json.loads((trained(trainer, steps=3).save(tmp_path / "ckpt") / "shardavg.json").read_text())
    rng = random.Random("shardavg-crafted-values")
    touched: Counter[str] = Counter()
    for _ in range(CASES):
        copy = json.loads(json.dumps(meta))
        craft_value(copy, rng)
        touched.update(key for key in meta if json.dumps(meta.get(key)) != json.dumps(copy.get(key)))
    assert set(touched) == set(meta) - {"checksum"}, touched
