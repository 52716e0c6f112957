"""Every recipe of ``examples/`` refuses a bad argument before it starts anything: no process group, no
training, nothing written; argparse's own one-line error naming the flag, exit status 2, no traceback.

The recipes run as ``python examples/X.py ...`` runs them (``runpy`` as ``__main__``, with that
``sys.argv`` and ``sys.path[0]``), without torchrun's environment, all in one child process so that
torch, DeepSpeed, Lightning and Transformers are imported once: a recipe that got past its checks
would fail there on the missing process group, with a traceback the tests see.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

# Runs each (script, argv, env) as `python script *argv` would; prints [[exit status, stderr], ...]. A
# recipe past its checks is stopped at the first thing it starts (a process group, an optimizer, a child
# process: Lightning spawns its own), so that one that checks too little fails here at once, saying so.
DRIVER = """
import contextlib, io, json, os, runpy, subprocess, sys, traceback
import torch

def started(what):
    def refuse(*args, **kwargs):
        raise RuntimeError(f"STARTED {what} before refusing its arguments")
    return refuse

torch.distributed.init_process_group = started("a process group")
torch.optim.Optimizer.__init__ = started("an optimizer")
subprocess.Popen.__init__ = started("a child process")
results = []
for script, argv, env in json.loads(sys.stdin.read()):
    sys.argv, sys.path[0], saved = [script, *argv], os.path.dirname(script), dict(os.environ)
    os.environ.update(env)
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as exit:
            code = exit.code
        except BaseException:
            traceback.print_exc()
            code = 1
    os.environ.clear()
    os.environ.update(saved)
    results.append([code, stderr.getvalue()])
print(json.dumps(results))
"""

# (script, argv, env, the error argparse prints after "<script>: error: ")
CASES = [
    ("fsdp2_dcp.py", ["--steps", "-5"], {}, "argument --steps: must be at least 1, got -5"),
    ("fsdp2_dcp.py", ["--save-every", "0"], {}, "argument --save-every: must be at least 1, got 0"),
    ("fsdp2_dcp.py", ["--steps", "many"], {}, "argument --steps: invalid int value: 'many'"),
    ("deepspeed_zero3.py", ["--dim", "0"], {}, "argument --dim: must be at least 1, got 0"),
    ("accelerate_fsdp.py", ["--save-every", "-1"], {}, "argument --save-every: must be at least 1, got -1"),
    ("hf_trainer.py", ["--steps", "0"], {}, "argument --steps: must be at least 1, got 0"),
    (
        "hf_trainer.py",
        ["--dim", "15"],
        {},
        "argument --dim: must be even (the model's 2 attention heads split it), got 15",
    ),
    ("lightning_fsdp.py", ["--devices", "0"], {}, "argument --devices: must be at least 1, got 0"),
    ("lightning_fsdp.py", ["--devices", "4"], {"WORLD_SIZE": "2"}, "argument --devices: 4, but torchrun started 2"),
    ("lightning_fsdp.py", ["--steps", "10"], {}, "argument --save-every: 25 exceeds --steps 10 (no validation)"),
    ("posthoc_sweep.py", ["--steps", "-5"], {}, "argument --steps: must be at least 1, got -5"),
    ("posthoc_sweep.py", ["--dim", "0"], {}, "argument --dim: must be at least 1, got 0"),
    ("posthoc_sweep.py", ["--snapshot-every", "0"], {}, "argument --snapshot-every: must be at least 1, got 0"),
    ("posthoc_sweep.py", ["--steps", "20"], {}, "argument --snapshot-every: 40 exceeds --steps 20 (no snapshot)"),
    (
        "posthoc_sweep.py",
        ["--out", "used"],
        {},
        "argument --out: used/snapshots holds another run's snapshots; give a fresh --out",
    ),
    (
        "merge_last.py",
        ["--steps", "8", "--save-every", "2", "--last", "9"],
        {},
        "argument --last: 9 is more than the 4 checkpoint(s) the run keeps (--steps 8 // --save-every 2, at most "
        "--keep 5)",
    ),
    (
        "merge_last.py",
        ["--keep", "2", "--last", "3"],
        {},
        "argument --last: 3 is more than the 2 checkpoint(s) the run keeps (--steps 200 // --save-every 20, at most "
        "--keep 2)",
    ),
    (
        "merge_last.py",
        ["--steps", "8", "--save-every", "10", "--last", "1"],
        {},
        "argument --last: 1 is more than the 0 checkpoint(s) the run keeps (--steps 8 // --save-every 10, at most "
        "--keep 5)",
    ),
    ("merge_last.py", ["--keep", "0"], {}, "argument --keep: must be at least 1, got 0"),
    ("merge_last.py", ["--last", "-2"], {}, "argument --last: must be at least 1, got -2"),
    ("fsdp2_tp.py", ["--tp", "0"], {}, "argument --tp: must be at least 1, got 0"),
    (
        "fsdp2_tp.py",
        ["--tp", "3"],
        {"WORLD_SIZE": "2"},
        "argument --tp: 3 does not divide the 2 process(es) (torchrun's --nproc_per_node)",
    ),
    ("fsdp2_tp.py", ["--dim", "-1"], {}, "argument --dim: must be at least 1, got -1"),
    ("megatron_gpt.py", ["--save-every", "0"], {}, "argument --save-every: must be at least 1, got 0"),
    ("megatron_gpt.py", ["--tp", "3"], {}, "argument --tp: 3 does not divide the model's 4 attention heads"),
    ("megatron_gpt.py", ["--dim", "30"], {}, "argument --dim: 30 is not a multiple of the 4 attention heads"),
    (
        "megatron_gpt.py",
        ["--layers", "3", "--pp", "2"],
        {},
        "argument --layers: 3 do not split evenly into --pp 2 stages",
    ),
    (
        "megatron_gpt.py",
        ["--tp", "2"],
        {"WORLD_SIZE": "3"},
        "argument --pp: --tp 2 x --pp 1 does not divide the 3 process(es) (torchrun's --nproc_per_node)",
    ),
    (
        "megatron_gpt.py",
        ["--tp", "2", "--pp", "2"],
        {"WORLD_SIZE": "4"},
        "argument --pp: Megatron's pipeline schedules need CUDA; on CPU, --pp 1",
    ),
]

# torchrun's variables: without them a recipe past its checks cannot start a process group.
TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass
class Refusals:
    """What the recipes did with the bad arguments: each case's exit status and stderr, and the
    files they left in the folder they ran in."""

    results: list[tuple[int, str]]
    written: list[str]


@pytest.fixture(scope="module")
def refusals(tmp_path_factory) -> Refusals:
    """Every case, run by one child process in a folder holding only an earlier run's snapshot."""
    cwd = tmp_path_factory.mktemp("recipes")
    (cwd / "used" / "snapshots" / "snapshot-000000040").mkdir(parents=True)
    cases = [(str(EXAMPLES / script), argv, env) for script, argv, env, _ in CASES]
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN} | {"PYTHONWARNINGS": "ignore"}
    done = subprocess.run(
        [sys.executable, "-c", DRIVER], input=json.dumps(cases), capture_output=True, text=True, env=env, cwd=cwd,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-5000:]
    results = [tuple(result) for result in json.loads(done.stdout.splitlines()[-1])]
    return Refusals(results, sorted(str(p.relative_to(cwd)) for p in cwd.rglob("*")))


@pytest.mark.parametrize(("index", "case"), list(enumerate(CASES)), ids=[f"{c[0]}{c[1]}" for c in CASES])
def test_a_bad_argument_is_refused_in_one_line_before_anything_starts(refusals, index, case) -> None:
    script, _, _, message = case
    code, stderr = refusals.results[index]
    assert "Traceback" not in stderr, stderr
    assert code == 2, stderr
    assert stderr.splitlines()[-1] == f"{script}: error: {message}", stderr


def test_a_refused_recipe_writes_nothing(refusals) -> None:
    assert refusals.written == ["used", "used/snapshots", "used/snapshots/snapshot-000000040"]
