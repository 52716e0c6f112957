"""Everything a GPU must show about shardavg, in one command and at most 8 minutes.

    python -m tools.device_check                          # on a machine with CUDA: every stage
    python -m tools.device_check --json PATH              # the record there (default: runs/device_check/)
    python -m tools.device_check --dry                    # what it would run, each stage skipped, in seconds
    python -m tools.device_check --only bench-fsdp2,loop  # some stages again
    python -m tools.device_check --show FILE              # an earlier run's tables, from its JSON

Why one command: a GPU is rarely at hand here and its time is short (about 15 minutes a session,
the machine's start included), so what it must show is prepared and checked before one is:
the Triton kernel's first-use self-check, no host sync in ``update()`` under
``torch.cuda.set_sync_debug_mode("error")``, the rest of ``pytest tests_gpu``, the bench's CUDA rows
with the loop's verdict, the verdict's own averager unchecked (the twin) and two identical
unchecked averagers (A/A) for DDP and FSDP2, and the 268M-parameter bf16 training loop with and
without a verdict and with ``background=True`` (``STAGES``, in order, each with its budget).

Each stage runs the project's own tools and tests as a process of its own (``python -m pytest``,
``python -m tools.bench``, ``python -m tools.loop``), stopped at the stage's budget with every
process it started (``stop``), so one hang cannot take the time of the others, and a stage that
fails or is stopped is recorded with its output's end while the rest still run. The budgets add up to at most 8
minutes and no stage outlives the run's deadline. The record (one JSON file, rewritten after
each stage, atomically, so a run cut short still leaves what it measured) names the device, the
driver and the CUDA, torch and Triton versions; the table on stdout says the same, then the bench's
and the loop's tables, ready for docs/benchmarks.md.

Without CUDA (or with ``--dry``) nothing runs: each stage is recorded skipped with the reason and
the command it would run, after a check that needs no GPU (the bench's overrides against
``configs/bench.yaml``, the test functions named still defined), so that a renamed key or test
fails here (``tests/test_device_check_script.py``) rather than on the GPU. It exits 1 where a
stage failed, was stopped or could not start, or where the dry run's check found a problem.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import json
import logging
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

import shardavg
from launch import config as configs
from tools import bench, loop

log = logging.getLogger("device_check")

ROOT = Path(__file__).resolve().parents[1]
TOTAL_S = 480  # the whole run's deadline: 8 minutes of a GPU session's ~15 (its start and a rerun need the rest)
GRACE_S = 10  # a stopped stage's SIGTERM to SIGKILL, what its ranks get to let the GPU go
TAIL_CHARS = 10_000  # of each stage's output kept in the record
PLACEHOLDER = Path("SCRATCH")  # the dry run's stand-in for the run's scratch folder in the commands it shows


# ----------------------------------------------------------------------------- the stages


@dataclass(frozen=True)
class Outcome:
    """What a stage's files and output say: whether it found what it must, a line for the table,
    and the figures kept in the record."""

    ok: bool
    result: str
    figures: dict


@dataclass(frozen=True)
class Stage:
    """One process of the run: its name (``--only``, the record), what it shows, its budget, the
    command given the run's scratch folder, what its output means, and a check that needs no GPU
    (the problem it finds, or None), run by the dry mode and before the stage."""

    name: str
    shows: str
    budget_s: int
    argv: Callable[[Path], list[str]]
    read: Callable[[Path, str], Outcome]
    preflight: Callable[[], str | None]


def pytest_argv(*arguments: str) -> list[str]:
    """``python -m pytest`` verbose (one line per test as it ends, read even from a stopped run),
    with the reasons of failures and skips, writing no cache into the tree."""
    return [sys.executable, "-m", "pytest", *arguments, "-v", "-rfEs", "-p", "no:cacheprovider"]


SELF_CHECK = "tests_gpu/test_verdict_cuda.py::test_the_kernels_self_check_result_is_reported"
NO_SYNC = (
    "tests_gpu/test_update_cuda.py::test_the_update_never_waits_for_the_gpu_and_matches_the_reference",
    "tests_gpu/test_verdict_cuda.py::test_an_update_with_the_norm_on_the_gpu_never_waits",
)
ENGINES_TESTS = "tests_gpu/test_cuda.py"  # its torchrun launches: every engine against the references, accelerate
# tests_gpu's own bench (three engines, the default rounds, the exports, the loop) does not fit
# the budget: the bench stages run the same tool at a size that does.
BENCH_TEST = f"{ENGINES_TESTS}::test_the_bench_on_cuda"
GPU_REPORT = "gpu_report.jsonl"  # the self-check test appends its record here (SHARDAVG_GPU_REPORT)

OUTCOME = re.compile(r"^(tests_gpu/\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b", re.MULTILINE)


def tests_defined(*node_ids: str) -> Callable[[], str | None]:
    """The preflight of a pytest stage: each test function named is still defined in its file."""

    def check() -> str | None:
        missing = []
        for node_id in node_ids:
            path, _, function = node_id.partition("::")
            source = ROOT / path
            if not source.is_file() or not re.search(rf"^def {function}\(", source.read_text(), re.MULTILINE):
                missing.append(node_id)
        return f"no such test (renamed? update tools/device_check.py): {', '.join(missing)}" if missing else None

    return check


def read_pytest(output: str) -> Outcome:
    """Counts of each outcome from pytest's verbose lines (there even when the run was stopped),
    the failures by name, and the test that was running if it was stopped in one."""
    outcomes = OUTCOME.findall(output)
    counts: dict[str, int] = {}
    for _, outcome in outcomes:
        counts[outcome.lower()] = counts.get(outcome.lower(), 0) + 1
    failed = [node for node, outcome in outcomes if outcome in ("FAILED", "ERROR")]
    last = output.rstrip().rsplit("\n", 1)[-1]
    running = last.strip() if last.startswith("tests_gpu/") and not OUTCOME.match(last) else None
    text = ", ".join(f"{n} {outcome}" for outcome, n in counts.items()) or "no test ended"
    text += f"; failed: {', '.join(failed)}" if failed else ""
    text += f"; running when stopped: {running}" if running else ""
    ok = bool(outcomes) and not failed and running is None
    return Outcome(ok, text, {"outcomes": counts, "failed": failed, "running_when_stopped": running})


def read_self_check(scratch: Path, output: str) -> Outcome:
    """The self-check test's record (``SHARDAVG_GPU_REPORT``): whether the kernel is usable on this
    GPU, and the warning it gave if not (the device, the Triton version, the error)."""
    tests = read_pytest(output)
    report = scratch / GPU_REPORT
    if not report.is_file():
        return Outcome(False, f"no self-check record; {tests.result}", tests.figures)
    record = json.loads(report.read_text().splitlines()[-1])
    said = "usable" if record.get("usable") else f"NOT usable: {record.get('warning')}"
    return Outcome(tests.ok and bool(record.get("usable")), f"{said} (Triton {record.get('triton')})", record)


def read_tests(scratch: Path, output: str) -> Outcome:
    return read_pytest(output)


BENCH_SETS = (
    "device=cuda",
    "loop.run=false",  # (the loop stage runs it, with the verdict)
    "export=false",  # (docs/benchmarks.md measures the export on its own)
    "work_ms=0",  # (the blocked rows: the loop stage times background=True in a real loop)
    "repeats=10",  # (15 by default)
    "verdict_repeats.transformer=40",  # (80 and 320 by default: sized for a shared CPU's noise)
    "verdict_repeats.many_small=120",
)


def bench_sets(engine: str) -> list[str]:
    return [*BENCH_SETS, f"engines=[{engine}]"]


def bench_argv(engine: str) -> Callable[[Path], list[str]]:
    def argv(scratch: Path) -> list[str]:
        sets = [argument for value in bench_sets(engine) for argument in ("--set", value)]
        return [sys.executable, "-m", "tools.bench", "--config", "configs/bench.yaml",
                "--json", str(scratch / f"bench-{engine}.json"), *sets]  # fmt: skip

    return argv


def bench_preflight(engine: str) -> Callable[[], str | None]:
    """The bench's own refusal of its overrides, before any engine starts (a renamed key, a type)."""

    def check() -> str | None:
        try:
            bench.check_rounds(configs.load(ROOT / "configs" / "bench.yaml", bench_sets(engine)))
        except configs.ConfigError as error:
            return f"tools.bench refuses the overrides: {error}"
        return None

    return check


# the rows whose averages are ours: each must match the reference and communicate nothing
OURS = ("ours", "verdict", "again", "several")


def read_bench(engine: str) -> Callable[[Path, str], Outcome]:
    """The bench's record: every average of ours bitwise (or, for bf16 weights, close to) the
    reference with nothing received per update; the targets met; the verdict's ratio to its own
    averager's unchecked update and the A/A ratio, each over the cases."""

    def read(scratch: Path, output: str) -> Outcome:
        record = json.loads((scratch / f"bench-{engine}.json").read_text())
        rows = bench_rows(record)
        wrong = [
            f"{r.shape}/{r.dtype} {r.method}: {r.check}, {r.comm_bytes_per_update} B received"
            for r in rows
            if r.role in OURS and (r.check.startswith("FAIL") or r.comm_bytes_per_update)
        ]
        figures = [f for f in (bench.verdict_figures(by_role) for by_role in bench.cases(rows).values()) if f]
        met = sum(target["verdict"] == "PASS" for target in record["targets"])
        text = (
            f"{len(bench.cases(rows))} cases; averages "
            + (f"WRONG: {'; '.join(wrong)}" if wrong else "bitwise or close, nothing received")
            + f"; targets {met} of {len(record['targets'])} PASS"
            + span("verdict / check off", [f["verdict / check off"] for f in figures])
            + span("A/A", [f["A/A"] for f in figures])
        )
        return Outcome(not wrong, text, {"bench": record})

    return read


def bench_rows(record: dict) -> list[bench.Row]:
    """The rows of a bench run's record (``--json``), as the bench's tables take them."""
    return [bench.Row(**{**row, "timed": tuple(row["timed"])}) for row in record["rows"]]


def span(name: str, values: list[float]) -> str:
    shown = sorted(v for v in values if v == v)  # (nan: a case without the figure)
    return f"; {name} {shown[0]:.3f}-{shown[-1]:.3f}" if shown else ""


def loop_argv(scratch: Path) -> list[str]:
    return [sys.executable, "-m", "tools.loop", "--device", "cuda", "--verdict", "--json", str(scratch / "loop.json")]


def read_loop(scratch: Path, output: str) -> Outcome:
    """Each variant's step and what it adds, against issue 38's limits (a MISS is a figure to
    report, not a failure of the run)."""
    rows = [loop.LoopRow(**row) for row in json.loads((scratch / "loop.json").read_text())]
    base = rows[0]
    added = "; ".join(f"{r.variant} {r.added_percent:+.1f}% ({loop.verdict(r)})" for r in rows[1:])
    text = f"{base.parameters / 1e6:.1f}M {base.dtype}, {base.ms_per_step:.2f} ms a step; {added}"
    return Outcome(True, text, {"loop": [asdict(row) for row in rows]})


STAGES = (
    Stage(
        name="self-check",
        shows="the Triton kernel's first-use self-check on this GPU (six compiles, its bits against ATen's)",
        budget_s=40,
        argv=lambda scratch: pytest_argv(SELF_CHECK),
        read=read_self_check,
        preflight=tests_defined(SELF_CHECK),
    ),
    Stage(
        name="host-syncs",
        shows='no host sync in update() under set_sync_debug_mode("error"): fp32 and bf16 weights, with and '
        "without a verdict, in the loop and with background=True",
        budget_s=45,
        argv=lambda scratch: pytest_argv(*NO_SYNC),
        read=read_tests,
        preflight=tests_defined(*NO_SYNC),
    ),
    Stage(
        name="tests-gpu",
        shows="the rest of pytest tests_gpu but its torchrun launches: the kernel bitwise, NaN and false "
        "verdicts on the device, the masked update for every dtype pair",
        budget_s=60,
        argv=lambda scratch: pytest_argv(
            "tests_gpu", f"--ignore={ENGINES_TESTS}", *(f"--deselect={node}" for node in (SELF_CHECK, *NO_SYNC))
        ),
        read=read_tests,
        preflight=tests_defined(SELF_CHECK, *NO_SYNC),
    ),
    Stage(
        name="tests-gpu-engines",
        shows=f"{ENGINES_TESTS} but its bench (the bench stages run it at a size that fits): every engine "
        "at 1 rank over NCCL against the references, accelerate's FSDP2 saved and resumed",
        budget_s=115,
        argv=lambda scratch: pytest_argv(ENGINES_TESTS, f"--deselect={BENCH_TEST}"),
        read=read_tests,
        preflight=tests_defined(BENCH_TEST),
    ),
    Stage(
        name="bench-ddp",
        shows="tools.bench on the GPU, DDP at 1 rank: every row, with the verdict, the twin and A/A",
        budget_s=75,
        argv=bench_argv("ddp"),
        read=read_bench("ddp"),
        preflight=bench_preflight("ddp"),
    ),
    Stage(
        name="bench-fsdp2",
        shows="tools.bench on the GPU, FSDP2 at 1 rank: the same rows",
        budget_s=75,
        argv=bench_argv("fsdp2"),
        read=read_bench("fsdp2"),
        preflight=bench_preflight("fsdp2"),
    ),
    Stage(
        name="loop",
        shows="tools.loop, the 268M-parameter bf16 training loop: no averager, check on, check off, the "
        "loop's verdict, background=True",
        budget_s=45,
        argv=loop_argv,
        read=read_loop,
        preflight=lambda: None,
    ),
)


# ----------------------------------------------------------------------------- running them


def run(stages: tuple[Stage, ...], chosen: set[str], scratch: Path, deadline: float, write: Callable) -> list[dict]:
    """Each stage in order: its preflight, its process within the time it has, what it showed."""
    records = []
    for index, stage in enumerate(stages, 1):
        record = described(stage, scratch)
        if stage.name not in chosen:
            record.update(status="skipped", reason="not in --only")
        elif problem := stage.preflight():
            record.update(status="error", reason=problem)
        elif (left := deadline - time.monotonic()) < 10:
            record.update(status="skipped", reason=f"the run's {TOTAL_S} s were spent before it")
        else:
            timeout = min(stage.budget_s, left)
            log.info("[%d/%d] %s: %.0f s at most", index, len(stages), stage.name, timeout)
            record.update(ran(stage, scratch, timeout))
            log.info("[%d/%d] %s: %s in %.0f s: %s", index, len(stages), stage.name, record["status"],
                     record["seconds"], record["result"])  # fmt: skip
        records.append(record)
        write(records)
    return records


def described(stage: Stage, scratch: Path) -> dict:
    argv = stage.argv(scratch)
    return {"name": stage.name, "shows": stage.shows, "budget_s": stage.budget_s, "command": shlex.join(argv)}


def ran(stage: Stage, scratch: Path, timeout: float) -> dict:
    """The stage's process, stopped at ``timeout``; its status, time, output's end and outcome (read
    even from a stopped or failed run: what it got to)."""
    output_path = scratch / f"{stage.name}.log"
    began = time.monotonic()
    returncode, stopped = execute(stage.argv(scratch), output_path, timeout)
    seconds = round(time.monotonic() - began, 1)
    output = output_path.read_text(errors="replace")
    try:
        outcome = stage.read(scratch, output)
    except Exception as error:  # (a file it did not write, or wrote in part)
        outcome = Outcome(False, f"nothing to read ({type(error).__name__}: {error})", {})
    if stopped:
        status, result = "timed out", f"stopped at {timeout:.0f} s; {outcome.result}"
    else:
        status = "passed" if returncode == 0 and outcome.ok else "failed"
        result = outcome.result if returncode == 0 else f"exit {returncode}; {outcome.result}"
    return {"status": status, "seconds": seconds, "returncode": returncode, "result": result,
            "figures": outcome.figures, "output_tail": output[-TAIL_CHARS:]}  # fmt: skip


def execute(argv: list[str], output_path: Path, timeout: float) -> tuple[int | None, bool]:
    """``argv`` in the repository, its output into ``output_path``, stopped at ``timeout`` with every
    process it started (``stop``), so that no stage holds the GPU into the next."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "SHARDAVG_GPU_REPORT": str(output_path.parent / GPU_REPORT),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}  # fmt: skip
    with open(output_path, "wb") as output:
        process = subprocess.Popen(
            argv, cwd=ROOT, env=env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            return process.wait(timeout=timeout), False
        except subprocess.TimeoutExpired:
            stop(process)
            return None, True
        except BaseException:  # (an interrupt of the run: its stage goes with it)
            stop(process)
            raise


def stop(process: subprocess.Popen) -> None:
    """SIGTERM to the stage's process group and to every process under it, then after ``GRACE_S``
    (torchrun's agent stops its ranks on SIGTERM) SIGKILL to what still runs. The processes under
    it are listed first, while they still descend from it: torchrun starts each rank in a session
    of its own, out of reach of the group's signal."""
    tree = [process.pid, *descendants(process.pid)]

    def send(number: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, number)
        for pid in tree:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, number)

    def ended() -> bool:
        until = time.monotonic() + GRACE_S
        while process.poll() is None or any(running(pid) for pid in tree[1:]):
            if time.monotonic() > until:
                return False
            time.sleep(0.1)
        return True

    send(signal.SIGTERM)
    if not ended():
        send(signal.SIGKILL)
        ended()


def descendants(pid: int) -> list[int]:
    """The processes under ``pid`` now, from each one's parent in ``/proc``."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(stat.parent.name))
    found, unseen = [], [pid]
    while unseen:
        below = children.get(unseen.pop(), [])
        found += below
        unseen += below
    return found


def running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped by its parent, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def skipped(stages: tuple[Stage, ...], reason: str) -> list[dict]:
    """The dry run: each stage as it would run, skipped with ``reason``, with its preflight's finding."""
    return [{**described(stage, PLACEHOLDER), "status": "skipped", "reason": reason,
             "preflight": stage.preflight() or "ok"} for stage in stages]  # fmt: skip


# ----------------------------------------------------------------------------- the device


def device() -> dict:
    """The GPU the stages run on (the current CUDA device), or why there is none; the driver, the
    CUDA torch was built with, torch, Triton (its version, never imported here), Python, shardavg,
    and the environment variables that change which path the update takes."""
    versions = {
        "driver": driver(),
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "triton": installed("triton") or installed("pytorch-triton"),
        "python": platform.python_version(),
        "shardavg": shardavg.__version__,
        "environment": {k: os.environ[k] for k in ("SHARDAVG_KERNEL", "TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES")
                        if k in os.environ},  # fmt: skip
    }
    if not torch.cuda.is_available():
        return {"name": None, "why_none": "no CUDA device here: torch.cuda.is_available() is False", **versions}
    properties = torch.cuda.get_device_properties(torch.cuda.current_device())
    return {"name": properties.name, "count": torch.cuda.device_count(),
            "memory_gib": round(properties.total_memory / 2**30, 1),
            "capability": f"{properties.major}.{properties.minor}", **versions}  # fmt: skip


def driver() -> str | None:
    """The NVIDIA driver's version, as ``nvidia-smi`` reports it (None where it cannot)."""
    try:
        answer = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=15)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    version = answer.stdout.split("\n")[0].strip()
    return version if answer.returncode == 0 and version else None


def installed(package: str) -> str | None:
    """``package``'s version, read from its metadata (nothing imported), or None where it is not installed."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def named(info: dict) -> str:
    """One line naming the device and the versions."""
    if info["name"] is None:
        where = f"none ({info['why_none']})"
    else:
        where = f"{info['name']} x{info['count']} ({info['memory_gib']} GiB, compute {info['capability']})"
    versions = ", ".join(f"{key} {info[key] or '-'}" for key in ("driver", "cuda", "torch", "triton", "python"))
    settings = " ".join(f"{k}={v}" for k, v in info["environment"].items())
    return f"device: {where}; {versions}; shardavg {info['shardavg']}" + (f"; set: {settings}" if settings else "")


# ----------------------------------------------------------------------------- the record and the tables


def write_atomically(path: Path, record: dict) -> None:
    """The record at ``path``, whole or not at all (a temporary file beside it, renamed over it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", delete=False) as temporary:
        json.dump(record, temporary, indent=1)
    os.replace(temporary.name, path)


def tables(record: dict) -> str:
    """The device, one line per stage, then the figures for docs/benchmarks.md: each bench stage's
    summary, verdict and targets tables, and the loop's table."""
    lines = [
        named(record["device"]),
        f"mode: {record['mode']}" + (f" ({record['reason']})" if record.get("reason") else "")
        + f"; the stages' budgets {sum(stage['budget_s'] for stage in record['stages'])} s, the run's deadline "
        f"{record['budget_s']} s; took {record['seconds']:.0f} s",
        "",
        "| stage | status | s | budget s | result |",
        "|---|---|---:|---:|---|",
    ]
    for stage in record["stages"]:
        result = stage.get("result") or stage.get("reason", "")
        if stage.get("preflight", "ok") != "ok":
            result += f"; PREFLIGHT: {stage['preflight']}"
        seconds = f"{stage['seconds']:.0f}" if "seconds" in stage else "-"
        lines.append(f"| {stage['name']} | {stage['status']} | {seconds} | {stage['budget_s']} | {result} |")
    if record["mode"] == "dry":
        lines += ["", "would run (SCRATCH: the run's scratch folder):"]
        lines += [f"  {stage['name']}: {stage['shows']}\n    {stage['command']}" for stage in record["stages"]]
    for stage in record["stages"]:
        figures = stage.get("figures") or {}
        if "bench" in figures:
            rows = bench_rows(figures["bench"])
            shown = [bench.summary(rows), bench.verdict_table(rows), bench.targets_table(figures["bench"]["targets"])]
            lines += ["", f"{stage['name']}:", *(f"\n{table}" for table in shown if table)]
        if "loop" in figures:
            rows = [loop.LoopRow(**row) for row in figures["loop"]]
            lines += ["", f"{stage['name']}:", "", loop.table(rows, loop.defaults(torch.device("cuda")))]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the command


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.device_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="the record (default: runs/device_check/<UTC time>.json)")
    parser.add_argument("--dry", action="store_true", help="run nothing: each stage skipped, with its command")
    parser.add_argument("--only", help=f"these stages (comma-separated) of {', '.join(s.name for s in STAGES)}")
    parser.add_argument("--show", type=Path, metavar="FILE", help="print the tables of an earlier run's record")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="device_check: %(message)s")
    if args.show:
        print(tables(json.loads(args.show.read_text())))
        return 0
    chosen = set(args.only.split(",")) if args.only else {stage.name for stage in STAGES}
    unknown = sorted(chosen - {stage.name for stage in STAGES})
    if unknown:
        parser.error(f"--only: no stage {', '.join(unknown)}; the stages: {', '.join(s.name for s in STAGES)}")
    began, started = time.monotonic(), datetime.datetime.now(datetime.timezone.utc)
    path = args.json or ROOT / "runs" / "device_check" / f"{started:%Y%m%d-%H%M%S}.json"
    info = device()
    dry = "--dry given" if args.dry else None if info["name"] else info["why_none"]
    record = {"tool": "tools.device_check", "started": started.isoformat(timespec="seconds"),
              "mode": "dry" if dry else "run", "reason": dry, "device": info, "budget_s": TOTAL_S}  # fmt: skip

    def write(stages: list[dict]) -> None:
        record.update(stages=stages, seconds=round(time.monotonic() - began, 1))
        write_atomically(path, record)

    if dry:
        write(skipped(STAGES, dry))
        ok = all(stage["preflight"] == "ok" for stage in record["stages"])
    else:
        with tempfile.TemporaryDirectory(prefix="device-check-") as scratch:
            stages = run(STAGES, chosen, Path(scratch), began + TOTAL_S, write)
        ok = all(stage["status"] in ("passed", "skipped") for stage in stages)
    print(tables(record))
    print(f"\nrecord: {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
