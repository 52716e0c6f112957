"""The CUDA paths under torchrun, one rank per GPU over NCCL, at 1 to min(4, GPUs) ranks: every
engine against the references (``scenario_cuda.py``), and the benchmark on the GPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from launcher import torchrun

from conftest import GPUS

ROOT = Path(__file__).resolve().parents[1]
SCENARIO = str(Path(__file__).resolve().parent / "scenario_cuda.py")
ON_CUDA = {"DS_ACCELERATOR": "cuda", "OMP_NUM_THREADS": "4"}
# Launches here run the torchrun command (forked=False), not ranks forked after the imports: an
# import that asks CUDA for its devices (DeepSpeed's accelerator does) initializes the driver in
# the forking process, which forked children cannot use.


TORCH_ENGINES = ["ddp", "fsdp2", "fsdp1"]
NO_DEEPSPEED = (
    "DeepSpeed is not installed here, so ZeRO-3 on CUDA did not run: pip install deepspeed (pure Python: on a "
    "machine without a network, carry its wheel there and pip install it)"
)


@pytest.mark.parametrize("kinds", [TORCH_ENGINES, ["zero3"]], ids=["torch-engines", "zero3"])
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_every_engine_on_cuda_matches_the_references(world_size: int, kinds: list[str], tmp_path: Path) -> None:
    if world_size > GPUS:
        pytest.skip(f"{world_size} ranks need {world_size} GPUs (one per rank under NCCL); {GPUS} here")
    if "zero3" in kinds:
        pytest.importorskip("deepspeed", reason=NO_DEEPSPEED)
    launch = torchrun(
        SCENARIO, world_size, "cuda", ",".join(kinds), str(tmp_path), timeout=900, env=ON_CUDA, forked=False
    )
    assert launch.returncode == 0, launch.output[-20000:]
    done = launch.reports("DONE")
    configurations = {"ddp": 2, "fsdp2": 2, "fsdp1": 3, "zero3": 2}
    assert len(done) == sum(configurations[k] for k in kinds), launch.output[-5000:]
    assert all(d["device"] == "cuda" and d["world_size"] == world_size for d in done), done


def test_the_bench_on_cuda(tmp_path: Path) -> None:
    """A small bench on the GPU: ours bitwise the gathering peer, nothing communicated per update,
    the achieved GB/s no more than a little above the copy floor's (both can run from the GPU's L2
    cache on the small shapes; far above it, the bytes counted would be wrong), and the tables (the
    training loop's too) printed for the docs."""
    world_size = min(GPUS, 2)
    out = tmp_path / "bench.json"
    args = ["--config", str(ROOT / "configs" / "bench.yaml"), "--json", str(out), "--set", "device=cuda",
            "--set", f"engines={TORCH_ENGINES}", "--set", "warmup=2", "--set", "repeats=5"]  # fmt: skip
    launch = torchrun("-m tools.bench", world_size, *args, timeout=900, env=ON_CUDA, forked=False)
    assert launch.returncode == 0, launch.output[-20000:]
    print(launch.output)  # (the tables, for docs/benchmarks.md)
    rows = json.loads(out.read_text())["rows"]
    copy_rates = {(r["engine"], r["shape"], r["dtype"]): r["gb_per_s"] for r in rows if r["method"] == "copy floor"}
    for row in rows:
        if row["method"] in ("ours", "ours, check off"):
            expected = ("bitwise",) if row["dtype"] == "float32" else ("bitwise", "close")
            assert row["check"].startswith(expected) and row["comm_bytes_per_update"] == 0, row
            assert 0 < row["gb_per_s"] < 1.25 * copy_rates[row["engine"], row["shape"], row["dtype"]], row


def test_accelerate_fsdp2_save_state_and_load_state(tmp_path: Path) -> None:
    """accelerate's FSDP plugin (version 2), which needs a GPU (on a CPU it becomes DDP): train
    against the reference, ``save_state``, and ``load_state`` in a new launch."""
    world_size = min(GPUS, 2)
    for mode in ("first", "second"):
        launch = torchrun(
            "scenario_accelerate.py", world_size, mode, "fsdp2", str(tmp_path), timeout=600, env=ON_CUDA, forked=False
        )
        assert launch.returncode == 0, launch.output[-20000:]
        (done,) = [r for r in launch.reports("DONE") if r["mode"] == mode]
        assert done == {"mode": mode, "kind": "fsdp2", "world_size": world_size}, done
