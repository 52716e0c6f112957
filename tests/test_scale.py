"""What a rank pays for the averager does not grow with the world size: rank 0 of an FSDP2 job
at 8 and at 4,096 ranks, simulated with PyTorch's fake process group (``simulated_rank.py``),
builds the averager without gathering anything, holds as much Python memory either way, and
saves a manifest whose only part that grows with the ranks is each file's size and hash.
Counts, never wall time."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).with_name("simulated_rank.py")


def simulate(world: int, out: Path) -> dict:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--world", str(world), "--layers", "16", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_rank_of_4096_pays_what_a_rank_of_8_does(tmp_path) -> None:
    small, large = simulate(8, tmp_path / "w8"), simulate(4096, tmp_path / "w4096")
    for run in (small, large):
        assert run["tensors"] == 193 and run["gathered_tensors"] == 0, run
        assert run["construction_gathers"] == [], run  # agreement is one all-reduce of a digest, no all-gather
        assert run["distinct_mesh_layouts"] <= 8, run  # nothing enumerated every rank at construction
        assert run["manifest_tensors"] == 193 and run["manifest_chunk_tables"] == 0 and run["manifest_grids"] == 1
    assert large["files"] == 4096 and small["files"] == 8
    assert large["construction_traced_peak"] <= 1.1 * small["construction_traced_peak"], (small, large)
    per_file = (large["manifest_bytes"] - small["manifest_bytes"]) / (4096 - 8)
    assert per_file <= 80, f"{per_file:.1f} bytes per rank in the manifest beyond each file's [bytes, sha256]"
