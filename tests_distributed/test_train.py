"""The main job (``-m launch.train``) end to end at a tiny size, under every engine at 2 processes:
it trains, its exports load strict into the plain model, and ``--resume`` from a mid-run
checkpoint ends bitwise where the uninterrupted run ends; the merge of the last checkpoints is
their fp32 average; asynchronous checkpoints change nothing, and a rank killed with one in
flight leaves the previous one to resume from. Plus a real two-node HSDP launch."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from launcher import ROOT, ZERO, torchrun
from safetensors.torch import load_file

from launch.model import GPT, GPTConfig

pytestmark = pytest.mark.slow  # a torchrun launch: python -m pytest -m "not slow" leaves it out

MAIN_JOB = "-m launch.train"

STEPS = 8
TINY = {
    "model.dim": 32, "model.layers": 2, "model.heads": 4, "model.context": 32, "data.max_bytes": 200_000,
    "train.batch_size": 4, "train.warmup_steps": 2, "eval.every": 4, "eval.batches": 2,
    "checkpoint.every": 4, "checkpoint.keep_last": 2, "posthoc.snapshot_every": 3,
}  # fmt: skip
ENGINES = ("ddp", "fsdp1", "fsdp2", "hsdp", "zero3", "fsdp2_tp", "pp")
PROCESSES = {"fsdp2_tp": 4, "pp": 4}  # a 2 x 2 mesh: 2 data-parallel ranks, as the others at 2 processes
KEPT = ("raw", "ema", "power")  # evaluated during training
NAMES = (*KEPT, "posthoc")  # exported; posthoc: the best of the post-hoc sweep
MERGED = "merge-last2"  # the average of the checkpoints of steps 4 and 8 (every engine's but zero3's)
DCP_ENGINES = tuple(e for e in ENGINES if e != "zero3")  # (zero3 saves DeepSpeed's own checkpoints: no merge, no async)


def job_args(engine: str, out: Path, *extra: str) -> list[str]:
    args = ["--config", str(ROOT / "configs" / f"{engine}.yaml"), "--out", str(out), "--steps", str(STEPS)]
    for key, value in TINY.items():
        args += ["--set", f"{key}={value}"]
    if engine in DCP_ENGINES:
        args += ["--set", "merge.last=2"]
    return [*args, *extra]


def train(engine: str, out: Path, *extra: str, nproc: int | None = None) -> dict:
    nproc = nproc or PROCESSES.get(engine, 2)
    launch = torchrun(
        MAIN_JOB, nproc, *job_args(engine, out, *extra), timeout=300, preload=ZERO if engine == "zero3" else ()
    )
    assert launch.returncode == 0, launch.output[-20000:]
    assert "held-out loss at step" in launch.output, launch.output[-5000:]
    assert "\r" not in launch.output and f"{engine}: step " in launch.output, launch.output[-3000:]  # plain lines
    return json.loads((out / "summary.json").read_text())


def exported(out: Path) -> dict[str, dict[str, torch.Tensor]]:
    names = (*NAMES, MERGED) if (out / "export" / MERGED).is_dir() else NAMES
    return {name: load_file(out / "export" / name / "model.safetensors") for name in names}


def assert_bitwise(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    for name in want:
        assert got[name].keys() == want[name].keys(), (what, name)
        different = [k for k in want[name] if not torch.equal(got[name][k], want[name][k])]
        assert not different, f"{what}: {name} differs in {different}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """One uninterrupted tiny run per engine, shared by the checks below."""
    root = tmp_path_factory.mktemp("train")
    for engine in ENGINES:
        train(engine, root / engine)
    return {engine: root / engine for engine in ENGINES}


@pytest.mark.parametrize("engine", ENGINES)
def test_the_job_trains_evaluates_and_exports_what_the_plain_model_loads(runs, engine) -> None:
    out = runs[engine]
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [4, 8]
    assert set(rows[-1]["heldout"]) == set(KEPT) and rows[-1]["heldout"]["raw"] < rows[0]["heldout"]["raw"]
    assert summary["engine"] == engine and summary["processes"] == PROCESSES.get(engine, 2)
    assert summary["tokens_per_s"] > 0
    saved = summary["checkpoints"]  # what checkpointing cost the training loop
    assert saved["mode"] == "sync" and saved["saves"] == 2 and set(saved["blocking_s_per_checkpoint"]) == {"4", "8"}
    assert 0 < saved["blocking_s"] == pytest.approx(sum(saved["blocking_s_per_checkpoint"].values()), abs=1e-3)
    shares = summary["update_share_of_step"]  # what averaging costs the step, per average and in all
    assert set(shares) == {"ema", "power", "posthoc", "all"} and all(0 < v < 1 for v in shares.values()), shares
    assert (
        max(shares["ema"], shares["power"], shares["posthoc"])
        <= shares["all"]
        <= sum(shares.values()) - shares["all"] + 1e-4
    )
    assert (out / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "posthoc.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    sweep = summary["posthoc"]
    assert len(sweep["heldout"]) >= 2 and sweep["best"] is not None, sweep
    assert sorted(p.name for p in (out / "posthoc").iterdir()) == [f"snapshot-{t:09d}" for t in (3, 6)]
    sizes = {k: v for k, v in TINY.items() if k.startswith("model.")}
    plain = GPT(GPTConfig(**{k.split(".")[1]: v for k, v in sizes.items()}))
    weights = exported(out)
    assert set(weights) == ({*NAMES, MERGED} if engine in DCP_ENGINES else set(NAMES)), sorted(weights)
    for name in weights:
        plain.load_state_dict(weights[name], strict=True)
    assert plain.head.weight is plain.embed.weight  # still tied after the load
    assert not torch.equal(weights["ema"]["embed.weight"], weights["raw"]["embed.weight"])
    shards = summary["shadow_bytes_per_rank"]
    full = sum(t.numel() * 4 for n, t in weights["ema"].items() if n != "head.weight")
    if engine == "ddp":
        assert shards["ema"] == full
    elif engine in PROCESSES:  # 4 ranks: a quarter of the blocks' matrices, half of what TP or a stage replicates
        assert full / 4 <= shards["ema"] < full / 2, (shards, full)
    else:  # every engine here shards: about half of the fp32 model per rank (FSDP1 pads, ZeRO-3 aligns)
        assert full / 2 <= shards["ema"] < full * 0.6, (shards, full)


def test_every_engine_reaches_the_same_losses(runs) -> None:
    losses = {e: json.loads((runs[e] / "summary.json").read_text())["heldout"] for e in ENGINES}
    for engine, heldout in losses.items():
        for name in KEPT:
            assert abs(heldout[name] - losses["ddp"][name]) < 1e-4, (engine, name, losses)


@pytest.mark.parametrize("engine", ENGINES)
def test_resume_from_a_mid_run_checkpoint_ends_bitwise_where_the_uninterrupted_run_ends(runs, engine, tmp_path) -> None:
    """The resumed run saves asynchronously (every engine but ZeRO-3, whose checkpoints are
    DeepSpeed's own): its checkpoint of step 8 is a ``dcp.async_save`` request, and the merge of it
    with step 4's, exported, is part of what must equal the uninterrupted synchronous run's."""
    middle = runs[engine] / "checkpoints" / "step-000000004"
    assert (middle / "train.json").is_file(), sorted(p.name for p in middle.parent.iterdir())
    shutil.copytree(middle, tmp_path / "checkpoints" / middle.name)
    for snapshot in ("snapshot-000000003",):  # what the run had written by step 4 (the next comes at 6)
        shutil.copytree(runs[engine] / "posthoc" / snapshot, tmp_path / "posthoc" / snapshot)
    asynchronous = engine in DCP_ENGINES
    summary = train(engine, tmp_path, "--resume", *(["--set", "checkpoint.async=true"] if asynchronous else []))
    assert summary["resumed_from"] == 4 and summary["checkpoints"]["mode"] == ("async" if asynchronous else "sync")
    assert_bitwise(exported(tmp_path), exported(runs[engine]), f"{engine} resumed at step 4")
    uninterrupted = json.loads((runs[engine] / "summary.json").read_text())
    assert summary["heldout"] == uninterrupted["heldout"] and summary["posthoc"] == uninterrupted["posthoc"]


def checkpointed_model(folder: Path) -> dict[str, torch.Tensor]:
    """The full tensors under ``model.`` of a main-job DCP checkpoint, read in one process by DCP itself."""
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(str(folder)).read_metadata()
    state = {
        key: torch.empty(stored.size, dtype=stored.properties.dtype)
        for key, stored in metadata.state_dict_metadata.items()
        if key.startswith("model.")
    }
    dcp.load(state, checkpoint_id=str(folder), no_dist=True)
    return {key.removeprefix("model."): tensor for key, tensor in state.items()}


def heldout_loss(weights: dict[str, torch.Tensor]) -> float:
    """The job's held-out loss of ``weights`` in the plain model, in one process: every data rank's batches."""
    from launch import data

    sizes = {k.split(".")[1]: v for k, v in TINY.items() if k.startswith("model.")}
    plain = GPT(GPTConfig(**sizes)).eval()
    plain.load_state_dict(weights, strict=True)
    corpus = data.load_corpus(None, 0.1, TINY["data.max_bytes"], 0, sizes["context"])
    batches = [
        batch for rank in (0, 1)
        for batch in data.heldout_batches(corpus.heldout, rank, 2, TINY["eval.batches"], TINY["train.batch_size"],
                                          sizes["context"])
    ]  # fmt: skip
    with torch.no_grad():
        return sum(plain(tokens, targets).double().item() for tokens, targets in batches) / len(batches)


@pytest.mark.parametrize("engine", DCP_ENGINES)
def test_the_merge_of_the_last_checkpoints_is_their_fp32_average(runs, engine) -> None:
    """``merge.last: 2`` averages the checkpoints of steps 4 and 8: the export is, bitwise, their
    model entries averaged in fp32 in step order (read by DCP, not by shardavg), and its held-out
    loss is that of those weights."""
    out = runs[engine]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["merge"]["name"] == MERGED and summary["merge"]["steps"] == [4, 8], summary["merge"]
    inputs = [checkpointed_model(out / "checkpoints" / f"step-{step:09d}") for step in (4, 8)]
    reference = {}
    for name in inputs[0]:
        total = torch.zeros(inputs[0][name].shape, dtype=torch.float32)
        for tensors in inputs:
            total.add_(tensors[name].to(torch.float32).mul_(1 / len(inputs)))
        reference[name] = total
    merged = load_file(out / "export" / MERGED / "model.safetensors")
    assert merged.keys() <= reference.keys() and "embed.weight" in merged, (sorted(merged), sorted(reference))
    different = [name for name in merged if not torch.equal(merged[name], reference[name])]
    assert not different, f"{engine}: the merge differs from the fp32 average in {different}"
    loss = summary["heldout"][MERGED]
    assert loss == summary["merge"]["heldout"] and abs(loss - heldout_loss(merged)) < 1e-5, (loss, engine)


def test_async_checkpoints_change_nothing_and_a_kill_in_flight_leaves_the_previous_one(runs, tmp_path) -> None:
    """``checkpoint.async``: rank 1 is killed right after the request of step 8 is started (step 4's
    is committed by then). The run trained exactly as the synchronous one (its held-out record is
    the same); the killed request is never committed (its staging folder has no train.json,
    whatever data reached it); ``--resume`` takes step 4, saves asynchronously again, and ends
    bitwise where the uninterrupted synchronous run ends, merge included."""
    out = tmp_path / "run"
    args = job_args("fsdp2", out, "--set", "checkpoint.async=true")
    killed = torchrun("kill_in_flight.py", 2, *args, timeout=300,
                      env={"SHARDAVG_TEST_KILL_IN_FLIGHT": "8"}, forked=False)  # fmt: skip
    assert killed.returncode != 0 and "Signal 9 (SIGKILL) received" in killed.output, killed.output[-5000:]
    assert (out / "metrics.jsonl").read_text() == (runs["fsdp2"] / "metrics.jsonl").read_text()
    checkpoints = out / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == [".step-000000008.incomplete", "step-000000004"]
    assert not (checkpoints / ".step-000000008.incomplete" / "train.json").exists()
    resumed = train("fsdp2", out, "--set", "checkpoint.async=true", "--resume")
    assert resumed["resumed_from"] == 4 and resumed["checkpoints"]["mode"] == "async", resumed["checkpoints"]
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-000000004", "step-000000008"]
    assert_bitwise(exported(out), exported(runs["fsdp2"]), "async, killed at step 8 and resumed from step 4")
    uninterrupted = json.loads((runs["fsdp2"] / "summary.json").read_text())
    assert resumed["heldout"] == uninterrupted["heldout"] and resumed["posthoc"] == uninterrupted["posthoc"]


def python_path() -> str:
    """PYTHONPATH for a torchrun started here: the repository first, where the package launch is."""
    return os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_two_nodes_of_two_processes_give_the_export_of_one_four_process_launch(tmp_path) -> None:
    port = free_port()
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": python_path()}
    nodes = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "2",
             "--node_rank", str(rank), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
             "--rdzv-id", "two-nodes", "-m", "launch.train", *job_args("hsdp", tmp_path / "nodes")],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True,
        )
        for rank in (0, 1)
    ]  # fmt: skip
    try:
        outputs = [node.communicate(timeout=300)[0] for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, 9)
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][-10000:] + outputs[1][-10000:]
    summary = json.loads((tmp_path / "nodes" / "summary.json").read_text())
    assert summary["processes"] == 4
    single = train("hsdp", tmp_path / "single", "--set", "hsdp.replicas=2", nproc=4)
    assert_bitwise(exported(tmp_path / "nodes"), exported(tmp_path / "single"), "two nodes vs one launch")
    assert summary["heldout"] == single["heldout"]


def worker_tracebacks(output: str) -> list[str]:
    """Traceback lines from the job's own processes (torchrun reports a worker's exit code 2 with a
    traceback of its own, which says nothing of the job)."""
    return [line for line in output.splitlines() if "[rank" in line and "Traceback" in line or "launch/" in line and
            '", line ' in line]  # fmt: skip


HOLD = """
import sys, time
from pathlib import Path
import shardavg
with shardavg.TargetLock(Path(sys.argv[1]) / ".train.lock", Path(sys.argv[1])):
    print("locked", flush=True)
    time.sleep(600)
"""


def test_a_second_job_is_refused_while_one_runs_and_a_damaged_newest_checkpoint_is_skipped(runs, tmp_path) -> None:
    """A job holding OUT keeps a second one out (it stops at once, naming the holder, touching
    nothing); once the holder is killed its lock is no obstacle, and ``--resume`` skips the
    damaged newest checkpoint, says so, and ends bitwise where the uninterrupted run ends."""
    out = tmp_path / "run"
    shutil.copytree(runs["fsdp2"], out)
    newest = out / "checkpoints" / "step-000000008"
    data_file = next(newest.glob("*.distcp"))
    data_file.write_bytes(data_file.read_bytes()[: data_file.stat().st_size // 2])  # truncated
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        before = {p: (p.stat().st_mtime_ns, p.stat().st_size) for p in out.rglob("*")}
        refused = torchrun(MAIN_JOB, 2, *job_args("fsdp2", out, "--resume"), timeout=300)
        assert refused.returncode != 0
        said = [line for line in refused.output.splitlines() if line.startswith("error: ")]
        assert (
            len(said) == 1 and f"is in use: {out} is being written by another process (pid {holder.pid} on" in said[0]
        )
        assert not worker_tracebacks(refused.output), refused.output[-5000:]
        assert {p: (p.stat().st_mtime_ns, p.stat().st_size) for p in out.rglob("*")} == before  # nothing touched
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
    assert (out / ".train.lock").exists()  # the killed holder's, left behind: no obstacle
    launch = torchrun(MAIN_JOB, 2, *job_args("fsdp2", out, "--resume"), timeout=300)
    assert launch.returncode == 0, launch.output[-20000:]
    assert "--resume: skipped step-000000008, which cannot be resumed from: " in launch.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed_from"] == 4 and not (out / ".train.lock").exists()
    assert_bitwise(exported(out), exported(runs["fsdp2"]), "resumed past a damaged checkpoint")


PLANT = """
import pickle, sys
from pathlib import Path
import torch.distributed.checkpoint as dcp
folder = Path(sys.argv[1])
metadata = dcp.FileSystemReader(str(folder)).read_metadata()
info = next(info for index, info in metadata.storage_data.items() if index.fqn == "step")
data = bytearray((folder / info.relative_path).read_bytes())
evil = pickle.dumps(print)  # any Python object: torch.load(weights_only=True) refuses it
assert len(evil) <= info.length
data[info.offset : info.offset + info.length] = evil.ljust(info.length, b".")
(folder / info.relative_path).write_bytes(bytes(data))
"""


def test_a_pickle_in_a_checkpoint_entry_is_refused_in_one_line(runs, tmp_path) -> None:
    """An entry of a checkpoint saved before hashes were recorded holds a pickle: DCP's loader
    refuses it; the job says so in one line, without torch's advice to load it unsafely."""
    folder = tmp_path / "step-000000004"
    shutil.copytree(runs["fsdp2"] / "checkpoints" / "step-000000004", folder)
    record = json.loads((folder / "train.json").read_text())
    (folder / "train.json").write_text(json.dumps({"step": record["step"], "engine": record["engine"]}))
    subprocess.run([sys.executable, "-c", PLANT, str(folder)], check=True)
    args = job_args("fsdp2", tmp_path / "out", "--resume-from", str(folder), "--set", "merge.last=0")  # (1 to merge)
    launch = torchrun(MAIN_JOB, 2, *args, timeout=300)
    assert launch.returncode != 0
    said = [line for line in launch.output.splitlines() if line.startswith("error: ")]
    assert said == [f"error: {folder} cannot be resumed from: an entry holds pickled Python objects, not tensor "
                    "data: refused without running it"], launch.output[-5000:]  # fmt: skip
    assert "weights_only=False" not in launch.output and not worker_tracebacks(launch.output), launch.output[-5000:]


def test_a_config_error_is_shown_by_every_launch(tmp_path) -> None:
    """The refusal is found on every rank before any process group exists; whichever rank torchrun
    stops first, the launch shows it (before: 4 of 6 launches exited 2 without a word, so four
    launches here would have caught it 98 times in 100)."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        "-m", "launch.train", *job_args("fsdp2", tmp_path / "never", "--set", "train.lr=-1.0"),
    ]  # fmt: skip
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": python_path()}
    launches = [
        subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        for _ in range(4)
    ]
    outputs = [launch.communicate(timeout=300)[0] for launch in launches]
    shown = [output.count("config error: config key 'train.lr' must be a finite number > 0.0") for output in outputs]
    print("the message shown, per launch:", shown)
    assert all(launch.returncode != 0 for launch in launches) and min(shown) >= 1, outputs[shown.index(min(shown))]
    assert not (tmp_path / "never").exists()
