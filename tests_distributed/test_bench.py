"""The benchmark cannot rot: a tiny run has every row, ours matches the engines' own gathers,
communicates nothing per update and keeps less than the peers (counts, never timings)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from launcher import torchrun

pytestmark = pytest.mark.slow  # a torchrun launch: python -m pytest -m "not slow" leaves it out

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "shapes.transformer.layers=2", "shapes.transformer.dim=32", "shapes.many_small.blocks=6",
    "shapes.many_small.width=16", "warmup=1", "repeats=2", "work_ms=2",
]  # fmt: skip


def test_a_tiny_bench_has_every_row_and_every_check_passes(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    args = ["--config", str(ROOT / "configs" / "bench.yaml"), "--json", str(out)]
    for override in TINY:
        args += ["--set", override]
    launch = torchrun("-m tools.bench", 2, *args, timeout=540)
    assert launch.returncode == 0, launch.output[-20000:]
    rows = json.loads(out.read_text())
    cases = {(r["engine"], r["shape"], r["dtype"]) for r in rows}
    assert len(cases) == 4 * 2 * 2, sorted(cases)
    for case in cases:
        methods = {r["method"]: r for r in rows if (r["engine"], r["shape"], r["dtype"]) == case}
        assert {"ours", "ours, check off", "floor", "export: ours"} <= set(methods), (case, sorted(methods))
        (peer,) = [r for r in methods.values() if r["check"] == "reference"]
        one, three = methods["3 averages, one averager"], methods["3 averages, three averagers"]
        assert one["extra_bytes_per_rank"] == three["extra_bytes_per_rank"] > 0, (case, one, three)
        for name in ("ours", "ours, check off", "3 averages, one averager", "3 averages, three averagers"):
            ours = methods[name]
            expected = ("bitwise",) if case[2] == "float32" else ("bitwise", "close")
            assert ours["check"].startswith(expected), (case, name, ours["check"])
            assert ours["comm_bytes_per_update"] == 0, (case, ours)
            single = name.startswith("ours")  # (three averages keep three times the shadows)
            assert 0 < ours["extra_bytes_per_rank"] < peer["extra_bytes_per_rank"] or case[0] == "ddp" or not single
        blocked = {name: r for name, r in methods.items() if r["role"] == "blocked"}
        assert len(blocked) == 4, (case, sorted(blocked))
        for name, row in blocked.items():  # in the background: bitwise the update in the loop (fp32 shadows)
            assert row["check"] == ("bitwise" if "background" in name else "-"), (case, name, row["check"])
        if case[0] != "ddp":  # the gathering peers receive the model every update
            assert peer["comm_bytes_per_update"] > 0, (case, peer)
    assert "| ours |" in launch.output and "copy bandwidth" in launch.output


def test_a_tiny_tensor_parallel_bench_at_four_processes(tmp_path: Path) -> None:
    """FSDP2 over 2 x tensor parallel over 2: ours bitwise the ``full_tensor()`` peer's average,
    nothing communicated, a quarter of the blocks' matrices kept per rank."""
    out = tmp_path / "bench.json"
    args = ["--config", str(ROOT / "configs" / "bench.yaml"), "--json", str(out), "--set", "engines=[fsdp2_tp]",
            "--set", "dtypes=[float32]", "--set", "export=false"]  # fmt: skip
    for override in TINY:
        args += ["--set", override]
    launch = torchrun("-m tools.bench", 4, *args, timeout=540)
    assert launch.returncode == 0, launch.output[-20000:]
    methods = {r["method"]: r for r in json.loads(out.read_text())}
    assert {r["engine"] for r in methods.values()} == {"fsdp2_tp"}, methods
    (peer,) = [r for r in methods.values() if r["check"] == "reference"]
    assert peer["method"] == "full_tensor() + full copy" and peer["comm_bytes_per_update"] > 0
    for name in ("ours", "ours, check off"):
        assert methods[name]["check"] == "bitwise" and methods[name]["comm_bytes_per_update"] == 0, methods[name]
        assert 0 < methods[name]["extra_bytes_per_rank"] < peer["extra_bytes_per_rank"] / 2, (methods[name], peer)
