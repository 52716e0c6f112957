"""``shardavg merge``: averages of checkpoints on disk, against in-memory fp32 references.

One short training run saves, at every step, the same state four ways (an averager's
checkpoint, a DCP checkpoint of model and optimizer, a single-file and a sharded safetensors
model); each test merges some of them and compares, bitwise, with the weighted sum of the
state dicts kept in memory at those steps.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import Trainer
from harness import TiedNet
from helpers import in_process_cli
from safetensors.torch import load_file, save_file

import shardavg
import shardavg.cli
from shardavg import EMA, SWA, WeightAverager
from shardavg.output.record import FolderRecord

STEPS = 4


class Run:
    """Checkpoints of steps 1..STEPS in every form, and the states they hold, kept in memory."""

    def __init__(self, root: Path) -> None:
        self.root = root
        torch.manual_seed(0)
        model = TiedNet()
        trainer = Trainer(model)
        avg = WeightAverager(model, {"ema": EMA(decay=0.8), "swa": SWA()})
        self.live: dict[int, dict[str, torch.Tensor]] = {}
        self.ema: dict[int, dict[str, torch.Tensor]] = {}
        for step in range(1, STEPS + 1):
            trainer.step()
            avg.update(step)
            self.live[step] = {k: v.detach().clone() for k, v in model.state_dict().items()}
            self.ema[step] = avg.full_state_dict("ema")
            avg.save(root / "avg", keep_last=STEPS)
            state = {"model": model.state_dict(), "optimizer": trainer.optimizer.state_dict()}
            dcp.save(state, checkpoint_id=str(self.dcp(step)), no_dist=True)
            avg.export(self.hf(step), live=True)
            avg.export(self.hf(step, sharded=True), live=True, max_shard_size=300)

    def avg(self, step: int) -> Path:
        return self.root / "avg" / f"step-{step:09d}"

    def dcp(self, step: int) -> Path:
        return self.root / "dcp" / f"step-{step}"

    def hf(self, step: int, sharded: bool = False) -> Path:
        return self.root / ("hf-sharded" if sharded else "hf") / f"checkpoint-{step}"


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Run:
    return Run(tmp_path_factory.mktemp("merge"))


def reference(states: list[dict[str, torch.Tensor]], shares: list[float]) -> dict[str, torch.Tensor]:
    """sum(w_i * x_i) in fp32 in input order; integer tensors from the last state."""
    merged = {}
    for name, last in states[-1].items():
        if not last.is_floating_point():
            merged[name] = last
            continue
        total = torch.zeros(last.shape, dtype=torch.float32)
        for state, share in zip(states, shares):
            total = total + state[name].to(torch.float32) * share
        merged[name] = total
    return merged


def read_model(folder: Path) -> dict[str, torch.Tensor]:
    index = folder / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    )
    state = {}
    for file in files:
        state |= load_file(str(folder / file))
    return state


def assert_bitwise(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want), set(got) ^ set(want)
    for name, value in want.items():
        assert got[name].dtype == value.dtype and torch.equal(got[name], value), name


KINDS = {
    "shardavg": lambda run, step: run.avg(step),
    "dcp": lambda run, step: run.dcp(step),
    "safetensors": lambda run, step: run.hf(step),
    "safetensors-sharded": lambda run, step: run.hf(step, sharded=True),
}


def states_of(run: Run, kind: str, steps: list[int]) -> list[dict[str, torch.Tensor]]:
    return [(run.ema if kind == "shardavg" else run.live)[step] for step in steps]


@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_and_weighting_is_the_weighted_sum(run: Run, kind: str, tmp_path: Path) -> None:
    paths = [KINDS[kind](run, step) for step in (1, 2, 4)]
    options = {"average": "ema"} if kind == "shardavg" else {}
    uniform = shardavg.merge(paths, tmp_path / "uniform", **options)
    assert_bitwise(read_model(uniform), reference(states_of(run, kind, [1, 2, 4]), [1 / 3] * 3))
    weighted = shardavg.merge(paths, tmp_path / "weighted", weights=[1, 2, 1], **options)
    assert_bitwise(read_model(weighted), reference(states_of(run, kind, [1, 2, 4]), [0.25, 0.5, 0.25]))
    ema = shardavg.merge(paths, tmp_path / "ema", ema=0.5, **options)  # steps 1, 2, 4: 0.5**3, 0.5**2, 1
    raw = [0.5**3, 0.5**2, 1.0]
    assert_bitwise(read_model(ema), reference(states_of(run, kind, [1, 2, 4]), [w / math.fsum(raw) for w in raw]))
    folder = run.avg(1).parent if kind == "shardavg" else KINDS[kind](run, 1).parent
    last = shardavg.merge(folder, tmp_path / "last", last=2, **options)
    assert_bitwise(read_model(last), reference(states_of(run, kind, [3, 4]), [0.5, 0.5]))


def test_mixed_kinds_and_dtypes_merge_in_fp32_or_fp64(run: Run, tmp_path: Path) -> None:
    bf16 = tmp_path / "bf16"
    bf16.mkdir()
    save_file({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in run.live[3].items()},
              str(bf16 / "model.safetensors"))  # fmt: skip
    inputs = [run.dcp(2), bf16, run.hf(4, sharded=True)]
    states = [run.live[2], {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in run.live[3].items()},
              run.live[4]]  # fmt: skip
    merged = read_model(shardavg.merge(inputs, tmp_path / "mixed"))
    assert_bitwise(merged, reference(states, [1 / 3] * 3))  # mixed floating dtypes: fp32 out
    wide = read_model(shardavg.merge(inputs, tmp_path / "fp64", accumulate=torch.float64, dtype=torch.bfloat16))
    for name, value in merged.items():
        if value.is_floating_point():
            exact = sum(s[name].to(torch.float64) * (1 / 3) for s in states)
            assert wide[name].dtype == torch.bfloat16 and torch.equal(wide[name], exact.to(torch.bfloat16)), name
    same = read_model(shardavg.merge([bf16, bf16.parent / "fp64"], tmp_path / "bf16-only"))
    assert all(v.dtype == torch.bfloat16 for v in same.values() if v.is_floating_point())  # the inputs' dtype kept


def test_an_average_of_a_dcp_averager_and_the_shardavg_output_loads_at_world_size_one(run: Run, tmp_path: Path) -> None:
    entry = tmp_path / "dcp-ema"
    torch.manual_seed(0)
    model = TiedNet()
    avg = WeightAverager(model, {"ema": EMA(decay=0.8), "swa": SWA()})
    avg.load(run.avg(3))
    dcp.save({"ema": avg}, checkpoint_id=str(entry), no_dist=True)
    out = shardavg.merge([entry, run.avg(4)], tmp_path / "ckpt", key="ema", average="ema", output="shardavg")
    manifest = json.loads((out / "shardavg.json").read_text())
    assert manifest["num_updates"] == 2 and manifest["averages"] == [{"name": None, "rule": SWA().to_config()}]
    torch.manual_seed(0)  # frozen parameters are the model's own (live), as in the run
    loaded = WeightAverager(TiedNet(), SWA())
    loaded.load(out)  # strict: names (tied ones apart in the merge), shapes and rule all match
    assert_bitwise(loaded.full_state_dict(), reference([run.ema[3], run.ema[4]], [0.5, 0.5]))
    assert loaded.num_updates == 2 and loaded.step == 4
    again = shardavg.merge(run.avg(4), out, average="ema", output="shardavg")  # its own earlier merge: replaced
    loaded.load(again)
    assert_bitwise(loaded.full_state_dict(), reference([run.ema[4]], [1.0]))
    with pytest.raises(
        shardavg.CheckpointError, match=f"OUT {out} is a checkpoint: export into a model folder of its own"
    ):
        shardavg.merge(run.avg(4), out, average="ema")  # a model folder is not written over a checkpoint
    loaded.load(out)  # untouched


def test_a_model_saved_by_transformers_merges_and_loads_with_from_pretrained(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=16, bos_token_id=0, eos_token_id=0
    )  # 112 KB of fp32 weights
    states, folders = [], []
    for seed in range(3):
        torch.manual_seed(seed)
        model = transformers.GPT2LMHeadModel(config)
        folders.append(tmp_path / f"checkpoint-{seed + 1}")
        model.save_pretrained(folders[-1], max_shard_size="40KB")  # sharded, with an index
        states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    assert (folders[-1] / "model.safetensors.index.json").is_file()
    out = shardavg.merge(folders, tmp_path / "soup", max_shard_size="50KB")
    assert (out / "config.json").read_bytes() == (folders[-1] / "config.json").read_bytes()
    assert (out / "model.safetensors.index.json").is_file()
    merged = transformers.GPT2LMHeadModel.from_pretrained(out)
    want = reference(states, [1 / 3] * 3)
    got = merged.state_dict()
    for name, value in read_model(out).items():
        assert torch.equal(value, want[name]) and torch.equal(got[name], want[name]), name
    wider = tmp_path / "wider"  # another model merged into the same folder: its config replaces the first's
    transformers.GPT2LMHeadModel(transformers.GPT2Config(**(config.to_dict() | {"n_embd": 64}))).save_pretrained(wider)
    shardavg.merge([wider], out)
    assert transformers.GPT2LMHeadModel.from_pretrained(out).config.n_embd == 64
    written = ["config.json", "generation_config.json", "model.safetensors", "provenance.json"]
    assert sorted(p.name for p in out.iterdir()) == written


def test_a_link_planted_at_the_config_is_replaced_not_written_through(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    save_file({"w": torch.ones(3)}, str(model / "model.safetensors"))
    (model / "config.json").write_text('{"hidden_size": 3}')
    yours, out = tmp_path / "yours.json", tmp_path / "out"
    yours.write_text("yours")
    out.mkdir()
    (out / "config.json").symlink_to(yours)
    shardavg.merge([model], out)
    assert yours.read_text() == "yours"
    assert not (out / "config.json").is_symlink()  # (a config that declares no dtype is given the files')
    assert json.loads((out / "config.json").read_text()) == {"hidden_size": 3, "dtype": "float32"}


# ------------------------------------------------------------------------- refusals


def cli(*args: str) -> subprocess.CompletedProcess:
    return shardavg_cli("merge", *args)


def shardavg_cli(*args: str) -> subprocess.CompletedProcess:
    return in_process_cli(*args)


class Refusals:
    """``shardavg merge`` run in this process (as the console script runs it), its stderr captured."""

    def __init__(self, capsys: pytest.CaptureFixture) -> None:
        self.capsys = capsys

    def __call__(self, *args: str, match: str) -> None:
        """The CLI refuses in one line, exit 2, and OUT is as it was (not created, nothing changed)."""
        out = Path(args[args.index("--out") + 1])
        before = listing(out)
        self.capsys.readouterr()
        code = shardavg.cli.main(["merge", *args])
        stderr = self.capsys.readouterr().err
        assert code == 2, stderr
        assert stderr.count("\n") == 1 and stderr.startswith("shardavg: error: "), stderr
        assert match in stderr, stderr
        assert listing(out) == before, f"{out} was written"


def listing(folder: Path) -> dict[str, int] | None:
    """What ``folder`` holds, with each file's modification time; None when it does not exist."""
    return {str(p): p.stat().st_mtime_ns for p in folder.rglob("*")} if folder.exists() else None


def other_model(folder: Path, change) -> Path:
    """A single-file model like step 4's, with ``change`` applied to its state dict."""
    folder.mkdir()
    state = {k: v.clone() for k, v in load_file(str(folder.parent / "base.safetensors")).items()}
    change(state)
    save_file(state, str(folder / "model.safetensors"))
    return folder


def test_every_refusal_writes_nothing(run: Run, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    refused = Refusals(capsys)
    save_file(read_model(run.hf(4)), str(tmp_path / "base.safetensors"))
    base, out = str(run.hf(4)), str(tmp_path / "out")
    renamed = other_model(tmp_path / "renamed", lambda s: s.update(extra=s.pop("gain")))
    reshaped = other_model(tmp_path / "reshaped", lambda s: s.update(gain=torch.ones(2)))
    retyped = other_model(tmp_path / "retyped", lambda s: s.update(gain=torch.ones(1, dtype=torch.int64)))
    refused(base, str(renamed), "--out", out, match="missing ['gain'], unexpected ['extra']")
    refused(base, str(reshaped), "--out", out, match="gain: float32 [2] vs float32 [1]")
    refused(base, str(retyped), "--out", out, match="gain: int64 [1] vs float32 [1]")

    truncated = tmp_path / "truncated"
    truncated.mkdir()
    data = (run.hf(3) / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[:-10])
    refused(base, str(truncated), "--out", out, match="truncated or foreign")
    broken_index = tmp_path / "broken-index"
    broken_index.mkdir()
    for file in run.hf(3, sharded=True).iterdir():
        (broken_index / file.name).write_bytes(file.read_bytes())
    shard = sorted(broken_index.glob("model-*.safetensors"))[1]
    shard.unlink()
    refused(base, str(broken_index), "--out", out, match=f"names files that are missing: ['{shard.name}']")
    short_dcp = tmp_path / "short-dcp"
    short_dcp.mkdir()
    for file in run.dcp(3).iterdir():
        (short_dcp / file.name).write_bytes(file.read_bytes()[: -100 if file.suffix == ".distcp" else None])
    refused(base, str(short_dcp), "--out", out, match="(truncated?)")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("not a checkpoint")
    refused(base, str(foreign), "--out", out, match="is not a checkpoint merge reads")
    deepspeed = tmp_path / "ds" / "global_step4"
    deepspeed.mkdir(parents=True)
    torch.save({"module": {}}, deepspeed / "mp_rank_00_model_states.pt")  # never loaded: refused by its name
    refused(str(deepspeed.parent), base, "--out", out, match="is a DeepSpeed checkpoint (global_step4/mp_rank_00")
    refused(base, str(run.dcp(3)), "--key", "ema", "--out", out, match="has no averager under key 'ema'")
    refused(base, str(run.dcp(3)), "--prefix", "opt.", "--out", out, match="holds no model tensor under 'opt.'")
    refused(base, str(run.avg(3)), "--out", out, match="holds averages ['ema', 'swa']: name one (--average)")

    refused(base, str(run.hf(3)), "--out", str(run.hf(3) / "inside"), match="lie one inside the other")
    refused(base, str(run.hf(3)), "--out", str(run.hf(3)), match="lie one inside the other")
    refused(base, str(run.hf(3)), "--out", str(run.avg(3) / "x"), match="is inside the checkpoint")
    kept = tmp_path / "out-kept"
    kept.mkdir()
    save_file({"w": torch.ones(1)}, str(kept / "model.safetensors"))  # someone's model: never replaced
    refused(
        base, str(run.hf(3)), "--out", str(kept), match="holds weight files shardavg did not write (model.safetensors)"
    )
    assert load_file(str(kept / "model.safetensors"))["w"].item() == 1.0

    notes = tmp_path / "out-notes"
    notes.mkdir()
    (notes / "notes.txt").write_text("mine")
    refused(base, str(run.hf(3)), "--out", str(notes), match="holds files a merge did not write (notes.txt)")

    refused(base, str(run.hf(3)), "--weights", "1", "--out", out, match="1 weights for 2 inputs")
    refused(base, str(run.hf(3)), "--weights", "1", "-1", "--out", out, match="must be >= 0 to be normalised")
    refused(base, str(run.hf(3)), "--weights", "1", "nan", "--out", out, match="weights must be finite numbers")
    refused(base, str(run.hf(3)), "--weights", "0", "0", "--out", out, match="at least one must be positive")
    refused(base, str(run.hf(3)), "--ema", "1.5", "--out", out, match="ema must be a decay in (0, 1)")
    refused(base, str(renamed.parent / "base.safetensors"), "--ema", "0.9", "--out", out, match="record none")
    refused(base, base, "--out", out, match="given more than once")
    refused("--last", "9", str(run.root / "dcp"), "--out", out, match="holds 4 finished checkpoints")
    refused(base, "--last", "2", str(run.root / "dcp"), "--out", out, match="give no IN with it")
    refused("--out", out, match="merge needs checkpoints IN, or --last K RUN_DIR")


def test_the_command_line_merges_and_refuses_in_one_line(run: Run, tmp_path: Path) -> None:
    done = cli("--last", "2", str(run.root / "dcp"), "--weights", "1", "3", "--out", str(tmp_path / "out"))
    assert done.returncode == 0 and "wrote the merge of 2 checkpoints" in done.stdout, done
    assert_bitwise(read_model(tmp_path / "out"), reference([run.live[3], run.live[4]], [0.25, 0.75]))
    again = cli(str(run.hf(4)), "--out", str(tmp_path / "out"))  # its own earlier merge: replaced
    assert again.returncode == 0, again
    assert_bitwise(read_model(tmp_path / "out"), reference([run.live[4]], [1.0]))
    bad = cli(str(run.hf(4)), "--ema", "0", "--out", str(tmp_path / "other"))
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "ema must be a decay" in bad.stderr, bad
    assert not (tmp_path / "other").exists()


def test_last_skips_checkpoints_a_save_has_not_finished(run: Run, tmp_path: Path) -> None:
    runs = tmp_path / "run" / "checkpoints"
    for step in (2, 3, 4):
        target = runs / f"step-{step:09d}"
        target.mkdir(parents=True)
        for file in run.dcp(step).iterdir():
            (target / file.name).write_bytes(file.read_bytes())
        if step != 4:  # a main-job folder is committed when its train.json is there
            (target / "train.json").write_text(json.dumps({"step": step}))
    out = shardavg.merge(tmp_path / "run", tmp_path / "out", last=2)  # the run folder, as the main job's OUT
    assert_bitwise(read_model(out), reference([run.live[2], run.live[3]], [0.5, 0.5]))
    assert json.loads(load_file_metadata(out)["shardavg"])["step"] == 3


def load_file_metadata(folder: Path) -> dict[str, str]:
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as file:
        return file.metadata()


def test_memory_does_not_grow_with_the_number_of_inputs(tmp_path: Path) -> None:
    """8 inputs of a 64 MiB model (16 tensors of 4 MiB): the merge adds three tensors' worth of
    memory (the accumulator, one input's tensor, the writer's piece), the same for 2 inputs as for 8
    (glibc's mmap threshold fixed, so that freed tensors leave: ``merge_memory.ALLOCATOR``)."""
    from tools.merge_memory import peak_added, write_inputs

    tensor_bytes = 4 * 2**20
    inputs = write_inputs(tmp_path / "inputs", {f"layer{i}.weight": (1024, 1024) for i in range(16)}, 8)
    added = {count: peak_added(inputs[:count], tmp_path / f"out{count}") for count in (2, 8)}
    assert tensor_bytes <= added[2], added  # it measured the merge: at least its accumulator
    # the accumulator, one input's tensor, the writer's piece: not 8 inputs' worth (512 MiB), nor one model (64 MiB)
    assert added[8] <= 3 * tensor_bytes + 2 * 2**20, added
    assert added[8] <= added[2] + 2**20, added  # (holding each input's tensor would add 6 tensors, 24 MiB)


def test_schedules_weight_each_step_by_the_drop_of_their_learning_rate_decay(run: Run, tmp_path: Path) -> None:
    """WSM: checkpoints at steps 1, 2 and 4; the window starts one mean spacing (1.5) before step 1,
    so they sit at progress 1/3, 5/9 and 1 of it, and checkpoint i weighs decay(x_{i-1}) - decay(x_i)."""
    from shardavg.offline.methods import schedule_weights

    x = [0.0, 1 / 3, 5 / 9, 1.0]
    decays = {
        "linear": lambda t: 1 - t,
        "cosine": lambda t: (1 + math.cos(math.pi * t)) / 2,
        "minus-sqrt": lambda t: 1 - math.sqrt(t),
    }
    paths = [run.hf(step) for step in (1, 2, 4)]
    for name, decay in decays.items():
        want = [decay(x[i]) - decay(x[i + 1]) for i in range(3)]
        got = schedule_weights(name, [1, 2, 4])
        assert got == pytest.approx(want, abs=1e-15) and math.fsum(got) == pytest.approx(1.0, abs=1e-15), name
        merged = shardavg.merge(paths, tmp_path / name, schedule=name)
        assert_bitwise(read_model(merged), reference(states_of(run, "safetensors", [1, 2, 4]), got))
    assert schedule_weights("linear", [100, 200, 300, 400]) == pytest.approx([0.25] * 4, abs=1e-15)
    assert schedule_weights("minus-sqrt", [300, 100, 200]) == pytest.approx(
        [1 - math.sqrt(2 / 3), math.sqrt(1 / 3), math.sqrt(2 / 3) - math.sqrt(1 / 3)], abs=1e-15
    )  # (inputs in any order: each weighs by its own step)


def test_raw_weights_are_taken_as_given_only_when_asked(run: Run, tmp_path: Path) -> None:
    paths = [run.hf(step) for step in (1, 2, 4)]
    merged = shardavg.merge(paths, tmp_path / "task", weights=[1.0, 1.0, -1.0], normalize=False)
    assert_bitwise(read_model(merged), reference(states_of(run, "safetensors", [1, 2, 4]), [1.0, 1.0, -1.0]))
    with pytest.raises(ValueError, match="must be >= 0 to be normalised"):
        shardavg.merge(paths, tmp_path / "refused", weights=[1.0, 1.0, -1.0])
    with pytest.raises(ValueError, match="normalize=False takes the weights as given"):
        shardavg.merge(paths, tmp_path / "refused", schedule="linear", normalize=False)
    with pytest.raises(ValueError, match="each give the inputs' weights"):
        shardavg.merge(paths, tmp_path / "refused", schedule="linear", ema=0.9)
    assert not (tmp_path / "refused").exists()


def test_provenance_is_written_beside_every_merge_and_export_and_a_merge_of_merges_keeps_it(
    run: Run, tmp_path: Path
) -> None:
    first = shardavg.merge([run.hf(1), run.hf(2)], tmp_path / "first", schedule="minus-sqrt")
    second = shardavg.merge([first, run.avg(4)], tmp_path / "second", average="ema", weights=[3, 1])
    record = json.loads((second / "provenance.json").read_text())
    assert record["made"] == "merge" and record["shardavg"] and record["torch"] == torch.__version__
    assert [entry["weight"] for entry in record["inputs"]] == [0.75, 0.25] and record["command"]
    nested = record["inputs"][0]["provenance"]
    assert nested["schedule"] == "minus-sqrt" and [e["step"] for e in nested["inputs"]] == [1, 2], nested
    checkpoint = record["inputs"][1]
    assert checkpoint["step"] == 4 and len(checkpoint["manifest_sha256"]) == 64, checkpoint
    assert checkpoint["manifest_sha256"] == hashlib.sha256((run.avg(4) / "shardavg.json").read_bytes()).hexdigest()
    shown = shardavg_cli("inspect", str(second))
    assert shown.returncode == 0 and f"by shardavg {shardavg.__version__}" in shown.stdout, shown
    assert "made merge" in shown.stdout and "schedule minus-sqrt" in shown.stdout and str(run.hf(1)) in shown.stdout
    as_checkpoint = shardavg.merge([first, run.hf(3)], tmp_path / "ckpt", output="shardavg")
    shown = shardavg_cli("inspect", str(as_checkpoint))
    assert shown.returncode == 0 and "provenance" in shown.stdout and str(first) in shown.stdout, shown.stdout

    model = torch.nn.Linear(3, 2)
    avg = WeightAverager(model, EMA(decay=0.5))
    avg.update()
    exported = avg.export(tmp_path / "export", dtype=torch.bfloat16)
    record = json.loads((exported / "provenance.json").read_text())
    assert (record["made"], record["dtype"], record["step"], record["writers"]) == ("export", "bfloat16", 1, 1)
    avg.export(exported)  # an export replaces its own provenance with the rest
    assert json.loads((exported / "provenance.json").read_text())["dtype"] is None


def test_a_merge_removes_only_what_it_can_prove_an_earlier_merge_wrote(
    run: Run, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A weights file in OUT whose record named ``notes.txt`` among the files a merge carried had the
    merge remove the user's notes.txt. A file is an earlier merge's when its content is what that
    merge recorded (its SHA-256, in its provenance), not when a file in OUT names it."""
    with_tokenizer = tmp_path / "with-tokenizer"
    shutil.copytree(run.hf(4), with_tokenizer)
    (with_tokenizer / "tokenizer.json").write_text('{"vocab": {}}')
    out = tmp_path / "out"
    shardavg.merge([run.hf(3), with_tokenizer], out)
    carried = json.loads((out / "provenance.json").read_text())["carried"]
    assert carried == {"tokenizer.json": hashlib.sha256(b'{"vocab": {}}').hexdigest()}
    refused = Refusals(capsys)
    (out / "tokenizer.json").write_text('{"vocab": {"edited": 0}}')  # the user's now: kept, and said so
    edited = "holds files a merge did not write (tokenizer.json)"
    refused(str(run.hf(3)), str(run.hf(4)), "--out", str(out), match=edited)
    (out / "tokenizer.json").write_text('{"vocab": {}}')  # what the merge wrote: the next merge may remove it
    shardavg.merge([run.hf(3), run.hf(4)], out)  # (the newest input carries no tokenizer)
    assert not (out / "tokenizer.json").exists()

    forged = tmp_path / "forged"
    forged.mkdir()
    record = FolderRecord("merge", 4, carried=("notes.txt",))
    save_file({"w": torch.ones(1)}, str(forged / "model.safetensors"), metadata=record.to_metadata())
    (forged / "notes.txt").write_text("mine")
    claimed = "holds files a merge did not write (notes.txt); the record of its weights names notes.txt among the files"
    refused(str(run.hf(3)), str(run.hf(4)), "--out", str(forged), match=claimed)
    assert (forged / "notes.txt").read_text() == "mine"
