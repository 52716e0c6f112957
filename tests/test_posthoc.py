"""Post-hoc EMA in one process: the coefficients against the paper's formulas written out here,
synthesis against Algorithm 3 applied to the full snapshots, and what is refused."""

from __future__ import annotations

import contextlib
import logging
import re
import shutil

import numpy as np
import pytest
import torch
from harness import TiedNet
from safetensors.torch import load_file

from shardavg import CheckpointError, PowerEMA, WeightAverager
from shardavg.cli import main as cli_main
from shardavg.offline.saved_average import SavedAverage
from shardavg.posthoc import PostHocEMA, snapshots, solve_coefficients, synthesize
from shardavg.rules import sigma_rel_to_gamma


def edm2_p_dot_p(t_a, gamma_a, t_b, gamma_b):
    """EDM2's inner product of two power-function profiles, in the paper's own form."""
    t_ratio = t_a / t_b
    t_exp = np.where(t_a < t_b, gamma_b, -gamma_a)
    t_max = np.maximum(t_a, t_b)
    return (gamma_a + 1) * (gamma_b + 1) * t_ratio**t_exp / ((gamma_a + gamma_b + 1) * t_max)


def edm2_solve(ts, gammas, t_r, gamma_r):
    """EDM2's solve, as its released code does it: least squares, then divided by the sum."""
    t, g = np.float64(ts), np.float64(gammas)
    a = edm2_p_dot_p(t[:, None], g[:, None], t[None, :], g[None, :])
    b = edm2_p_dot_p(t[:, None], g[:, None], np.float64([t_r])[None, :], np.float64([gamma_r])[None, :])
    x = np.linalg.lstsq(a, b, rcond=None)[0][:, 0]
    return x / x.sum()


def test_the_coefficients_are_the_papers() -> None:
    ts = [100.0 * (i + 1) for i in range(20)] * 2
    gammas = [sigma_rel_to_gamma(0.05)] * 20 + [sigma_rel_to_gamma(0.10)] * 20
    for sigma in (0.04, 0.07, 0.12):
        ours, residual = solve_coefficients(ts, gammas, 2000.0, sigma_rel_to_gamma(sigma))
        want = edm2_solve(ts, gammas, 2000.0, sigma_rel_to_gamma(sigma))
        np.testing.assert_allclose(ours.numpy(), want, rtol=1e-6, atol=1e-9)
        assert residual < 0.05, (sigma, residual)
        assert abs(float(ours.sum()) - 1.0) < 1e-12  # an average of averages: its weights sum to one


def trained(trainer, tmp_path, steps: int = 12) -> PostHocEMA:
    ph = PostHocEMA(trainer.model, sigma_rels=(0.05, 0.10), snapshot_every=3, directory=tmp_path / "snapshots")
    for _ in range(steps):
        trainer.step()
        ph.update()
    return ph


def full_snapshots(directory) -> list[tuple[int, dict[str, dict[str, torch.Tensor]]]]:
    """Every snapshot read whole (the reference's view): [(t, {profile: {name: tensor}})]."""
    result = []
    for snapshot in snapshots(directory):
        saved = SavedAverage(snapshot.path)
        tensors = {
            profile: {name: saved.read(name, profile).double() for name in saved.tensors} for profile in saved.averages
        }
        result.append((snapshot.t, tensors))
    return result


def test_synthesis_is_algorithm_3_on_the_full_snapshots(trainer, tmp_path) -> None:
    ph = trained(trainer, tmp_path)
    found = snapshots(tmp_path / "snapshots")
    assert [s.t for s in found] == [3, 6, 9, 12]
    full = full_snapshots(tmp_path / "snapshots")
    gammas = {"profile-0": sigma_rel_to_gamma(0.05), "profile-1": sigma_rel_to_gamma(0.10)}
    for sigma in (0.06, 0.08):
        terms = [(t, p) for t, _ in full for p in gammas]
        x = edm2_solve([t for t, _ in terms], [gammas[p] for _, p in terms], 12.0, sigma_rel_to_gamma(sigma))
        snapshot_of = {t: tensors for t, tensors in full}
        got = ph.synthesize(sigma).full_state_dict()
        for name, value in got.items():
            if name.startswith("block.norm.running") or name.endswith("num_batches_tracked"):
                continue  # copied buffers: the last snapshot's
            if name.startswith("frozen.") or name == "head.weight":
                continue  # live values; the tied head is embed.weight
            want = sum(c * snapshot_of[t][p][name] for c, (t, p) in zip(x, terms))
            torch.testing.assert_close(value.double(), want, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_a_profile_at_its_own_snapshot_is_that_snapshot(trainer, tmp_path) -> None:
    ph = trained(trainer, tmp_path)
    snapshot = SavedAverage(tmp_path / "snapshots" / "snapshot-000000009")
    got = ph.synthesize(gamma=sigma_rel_to_gamma(0.10), step=snapshot.description.step).full_state_dict()
    for name in snapshot.tensors:
        if not name.startswith("frozen.") and snapshot.tensors[name].role == "average":
            torch.testing.assert_close(got[name], snapshot.read(name, "profile-1"), rtol=1e-5, atol=1e-6)


def test_what_cannot_be_synthesized_is_refused(trainer, tmp_path) -> None:
    ph = trained(trainer, tmp_path)
    with pytest.raises(ValueError, match=r"cannot be synthesized well.*sigma_rel 0.05-0.12 fit within"):
        ph.synthesize(0.005)
    with pytest.raises(
        ValueError, match=r"step 7 is not a snapshot's step; the snapshots are at steps \[3, 6, 9, 12\]"
    ):
        ph.synthesize(0.07, step=7)
    with pytest.raises(ValueError, match="at least two profiles"):
        PostHocEMA(trainer.model, sigma_rels=(0.05,), snapshot_every=3, directory=tmp_path / "one")
    other = PostHocEMA(TiedNet(), gammas=(5.0, 9.0), snapshot_every=1, directory=tmp_path / "snapshots")
    with pytest.raises(CheckpointError, match=r"holds snapshots of another run \(snapshot-000000003, run [0-9a-f]{32}"):
        other.update(step=100)  # would write its snapshots into this run's directory
    other.directory = tmp_path / "other"
    other.update(step=100)
    shutil.move(tmp_path / "other" / "snapshot-000000001", tmp_path / "snapshots")  # copied in by hand
    with pytest.raises(CheckpointError, match="mixes the snapshots of 2 runs"):
        ph.synthesize(0.07)
    shutil.rmtree(tmp_path / "snapshots" / "snapshot-000000001")
    (tmp_path / "snapshots" / "snapshot-000000006" / "rank-00000-of-00001.safetensors").unlink()
    with pytest.raises(CheckpointError, match="rank-00000-of-00001.safetensors"):
        ph.synthesize(0.07)
    with pytest.raises(CheckpointError, match="no snapshot folder"):
        synthesize(trainer.model, tmp_path / "nowhere", 0.07)


def test_a_resumed_run_writes_the_same_snapshots(model, trainer, tmp_path) -> None:
    straight = trained(trainer, tmp_path / "straight")
    torch.manual_seed(0)
    fresh = TiedNet()
    from conftest import Trainer

    again = Trainer(fresh)
    first = PostHocEMA(fresh, sigma_rels=(0.05, 0.10), snapshot_every=3, directory=tmp_path / "resumed" / "snapshots")
    for _ in range(7):
        again.step()
        first.update()
    first.save(tmp_path / "state")
    second = PostHocEMA(fresh, sigma_rels=(0.05, 0.10), snapshot_every=3, directory=tmp_path / "resumed" / "snapshots")
    second.load(tmp_path / "state")
    for _ in range(5):
        again.step()
        second.update()
    assert [s.t for s in snapshots(tmp_path / "resumed" / "snapshots")] == [3, 6, 9, 12]
    for (t, a), (u, b) in zip(
        full_snapshots(tmp_path / "straight" / "snapshots"), full_snapshots(tmp_path / "resumed" / "snapshots")
    ):
        assert t == u and all(torch.equal(a[p][n], b[p][n]) for p in a for n in a[p]), t
    del straight


def test_the_offline_command_writes_the_in_process_synthesis_bitwise(trainer, tmp_path) -> None:
    import subprocess
    import sys

    from safetensors.torch import load_file

    ph = trained(trainer, tmp_path)
    cli = [sys.executable, "-m", "shardavg", "posthoc", str(tmp_path / "snapshots")]
    listed = subprocess.run([*cli, "--list"], capture_output=True, text=True, check=True).stdout
    assert listed.count("profile-0: ") == 4 and re.search(r"sigma_rel [0-9.\-, and]+ fit", listed), listed
    subprocess.run([*cli, str(tmp_path / "out"), "--sigma-rel", "0.07"], capture_output=True, text=True, check=True)
    exported = load_file(tmp_path / "out" / "model.safetensors")
    want = ph.synthesize(0.07).full_state_dict()
    assert set(exported) == set(want)
    for name in want:
        assert torch.equal(exported[name], want[name]), name
    TiedNet().load_state_dict(exported, strict=True)
    refused = subprocess.run([*cli, str(tmp_path / "x"), "--sigma-rel", "0.005"], capture_output=True, text=True)
    assert refused.returncode == 2 and "cannot be synthesized well" in refused.stderr


def test_bf16_snapshots_are_half_the_bytes_and_synthesize_to_bf16_rounding(trainer, tmp_path) -> None:
    import subprocess
    import sys

    from safetensors.torch import load_file

    ph = PostHocEMA(trainer.model, snapshot_every=3, directory=tmp_path / "bf16", snapshot_dtype=torch.bfloat16)
    fp32 = PostHocEMA(trainer.model, snapshot_every=3, directory=tmp_path / "fp32")
    for _ in range(12):
        trainer.step()
        ph.update()
        fp32.update()
    assert SavedAverage(tmp_path / "bf16" / "snapshot-000000012").tensors["embed.weight"].dtype == "bfloat16"
    halves = [a.bytes / b.bytes for a, b in zip(snapshots(tmp_path / "bf16"), snapshots(tmp_path / "fp32"))]
    assert all(0.45 < h < 0.8 for h in halves), halves  # (a tiny model: the headers weigh too)
    got, want = ph.synthesize(0.07).full_state_dict(), fp32.synthesize(0.07).full_state_dict()
    for name in want:
        assert got[name].dtype == want[name].dtype
        torch.testing.assert_close(got[name], want[name], rtol=2e-2, atol=2e-2)
    cli = [sys.executable, "-m", "shardavg", "posthoc", str(tmp_path / "bf16"), str(tmp_path / "out")]
    subprocess.run([*cli, "--sigma-rel", "0.07"], capture_output=True, text=True, check=True)
    exported = load_file(tmp_path / "out" / "model.safetensors")
    assert all(torch.equal(exported[n], got[n]) for n in got)


def test_offline_synthesis_holds_one_snapshot_tensor_and_the_output_at_a_time(tmp_path) -> None:
    """torch's CPU allocator peak while the offline synthesis streams every tensor: about the
    output tensor plus one snapshot tensor, whatever the model size and the number of snapshots
    (measured, printed for the record). Nothing is mapped: each chunk is read into the tensor
    it goes to (the process's peak memory is measured below)."""
    from shardavg.posthoc import synthesized_tensors
    from tools.measure import allocated_peak

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512, bias=False) for _ in range(8)])  # 8 x 1 MiB
    ph = PostHocEMA(model, snapshot_every=1, directory=tmp_path / "snapshots")
    for _ in range(8):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p), alpha=0.01)
        ph.update()
    tensor_bytes = 512 * 512 * 4

    _, tensors = synthesized_tensors(tmp_path / "snapshots", sigma_rel_to_gamma(0.07))  # opens the files

    def consume() -> None:
        for _ in tensors:
            pass

    peak = allocated_peak(consume)
    snapshot_bytes = sum(s.bytes for s in snapshots(tmp_path / "snapshots"))
    print(f"offline synthesis: peak {peak / 2**20:.2f} MiB for a {8 * tensor_bytes / 2**20:.0f} MiB model, "
          f"8 snapshots x 2 profiles ({snapshot_bytes / 2**20:.0f} MiB on disk)")  # fmt: skip
    assert peak <= 3 * tensor_bytes + 2**16, peak


OFFLINE = """
import resource, sys
from shardavg.cli import main
def status(field):
    with open("/proc/self/status") as lines:
        return next(int(line.split()[1]) * 1024 for line in lines if line.startswith(field + ":"))
if sys.argv[3] != "unlimited":  # the address space this process has now, and that much more
    limit = status("VmSize") + int(sys.argv[3])
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
before = status("VmRSS")
with open("/proc/self/clear_refs", "w") as clear:
    clear.write("5")  # the peak RSS starts again from here: what the synthesis itself adds
code = main(["posthoc", sys.argv[1], sys.argv[2], "--sigma-rel", sys.argv[4]])
print(code, status("VmHWM") - before)
"""


def snapshot_run(directory, count: int, tensor_side: int = 512, tensors: int = 8) -> None:
    """``count`` snapshots of two profiles of a model of ``tensors`` square fp32 tensors."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(tensor_side, tensor_side, bias=False) for _ in range(tensors)])
    ph = PostHocEMA(model, snapshot_every=1, directory=directory)
    for _ in range(count):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p), alpha=0.01)
        ph.update()


def offline(directory, out, headroom: int | str = "unlimited", sigma_rel: float = 0.07) -> tuple[int, int, str]:
    """``shardavg posthoc`` in a process of its own: exit code, its peak RSS beyond what the
    process held before it started (imports), stderr."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", OFFLINE, str(directory), str(out), str(headroom), str(sigma_rel)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    code, peak = map(int, done.stdout.split()[-2:])
    return code, peak, done.stderr


def test_offline_synthesis_memory_does_not_grow_with_the_snapshots(tmp_path) -> None:
    """Peak RSS of ``shardavg posthoc`` from 4 and from 16 snapshots of an 8 MiB model (2 profiles,
    256 MiB on disk for 16): the same within 32 MiB (before, every snapshot stayed mapped: 2.4 /
    4.4 / 8.1 GiB for 5 / 10 / 20 snapshots of a 192 MiB model). Under an address-space limit of
    what the process has plus 64 MiB it still works: nothing is mapped."""
    peaks = {}
    for count in (4, 16):
        snapshot_run(tmp_path / f"snapshots-{count}", count)
        code, peaks[count], err = offline(tmp_path / f"snapshots-{count}", tmp_path / f"out-{count}")
        assert code == 0, err
    print("offline synthesis peak RSS, MiB:", {count: round(peak / 2**20) for count, peak in peaks.items()})
    assert abs(peaks[16] - peaks[4]) < 32 * 2**20, peaks
    code, _, err = offline(tmp_path / "snapshots-16", tmp_path / "limited", headroom=64 * 2**20)
    assert code == 0, err


def test_running_out_of_memory_is_said_as_such(tmp_path) -> None:
    snapshot_run(tmp_path / "snapshots", 2, tensor_side=4096, tensors=2)  # 64 MiB tensors
    code, _, err = offline(tmp_path / "snapshots", tmp_path / "out", headroom=48 * 2**20, sigma_rel=0.10)
    assert code == 2 and err.startswith("shardavg: error: out of memory") and len(err.strip().splitlines()) == 1, err
    assert "foreign" not in err and "truncated" not in err


class WithConstant(torch.nn.Module):
    """A small MLP and a parameter the loss never reaches: it never changes, so every average of it,
    synthesized ones included, must be it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(8, 32), torch.nn.Linear(32, 4)
        self.constant = torch.nn.Parameter(torch.ones(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def test_synthesis_keeps_a_constant_and_is_as_close_to_the_exact_ema_as_edm2s_own(tmp_path, capsys) -> None:
    """Against power EMAs kept live alongside (exact), over 200 SGD steps with profiles 0.05/0.10
    every 10: before the coefficients summed to 1, the constant came back as 1.034 at step 20
    and 0.99966 at sigma_rel 0.03, and the 0.07 average was 1.3x further from the exact one."""
    torch.manual_seed(0)
    model = WithConstant()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    posthoc = PostHocEMA(model, sigma_rels=(0.05, 0.10), snapshot_every=10, directory=tmp_path / "snapshots")
    exact = {sigma: WeightAverager(model, PowerEMA(sigma_rel=sigma)) for sigma in (0.03, 0.07, 0.12, 0.15)}
    generator = torch.Generator().manual_seed(1)
    for _ in range(200):
        x, y = torch.randn(32, 8, generator=generator), torch.randn(32, 4, generator=generator)
        optimizer.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        optimizer.step()
        posthoc.update()
        for average in exact.values():
            average.update()
    full = full_snapshots(tmp_path / "snapshots")
    for sigma, live in exact.items():
        want, got = live.full_state_dict(), posthoc.synthesize(sigma).full_state_dict()
        terms = [(t, p) for t, _ in full for p in ("profile-0", "profile-1")]
        gammas = {"profile-0": sigma_rel_to_gamma(0.05), "profile-1": sigma_rel_to_gamma(0.10)}
        x = edm2_solve([t for t, _ in terms], [gammas[p] for _, p in terms], 200.0, sigma_rel_to_gamma(sigma))
        snapshot_of = {t: tensors for t, tensors in full}
        for name in ("fc1.weight", "fc2.weight", "fc2.bias"):
            edm2 = sum(c * snapshot_of[t][p][name] for c, (t, p) in zip(x, terms))
            ours_error = float((got[name].double() - want[name].double()).norm() / want[name].norm())
            edm2_error = float((edm2 - want[name].double()).norm() / want[name].norm())
            assert ours_error <= edm2_error * 1.001 + 1e-7, (sigma, name, ours_error, edm2_error)
        torch.testing.assert_close(got["constant"], torch.ones(16), rtol=2e-7, atol=0)
    for snapshot in snapshots(tmp_path / "snapshots")[1:]:  # every step a synthesis can target
        for sigma in (0.05, 0.08, 0.10):
            try:
                got = posthoc.synthesize(sigma, step=snapshot.step).full_state_dict()
            except ValueError:
                continue  # this sigma_rel does not fit that early
            torch.testing.assert_close(got["constant"], torch.ones(16), rtol=4e-7, atol=0)
    capsys.readouterr()
    out = tmp_path / "offline"
    assert cli_main(["posthoc", str(tmp_path / "snapshots"), str(out), "--sigma-rel", "0.07", "--step", "20"]) == 2
    said = capsys.readouterr().err  # what fits at step 20 (not at the last snapshot), 0.07 itself excluded
    assert "at step 20 from the snapshots up to it" in said and "sigma_rel 0.05-0.06 and 0.08-0.11 fit" in said, said
    assert cli_main(["posthoc", str(tmp_path / "snapshots"), str(out), "--sigma-rel", "0.08", "--step", "20"]) == 0
    torch.testing.assert_close(load_file(str(out / "model.safetensors"))["constant"], torch.ones(16), rtol=2e-7, atol=0)


def test_a_second_run_refuses_a_used_directory_and_a_resumed_one_goes_on(trainer, tmp_path) -> None:
    """Another seed, the same model and profiles: before, it overwrote snapshots 3-6 of the first
    run, kept 9-12, and synthesis combined them without a word."""
    first = trained(trainer, tmp_path)  # snapshots at 3, 6, 9, 12
    checkpoint = first.save(tmp_path / "checkpoint")
    torch.manual_seed(1)
    second = PostHocEMA(TiedNet(), sigma_rels=(0.05, 0.10), snapshot_every=3, directory=tmp_path / "snapshots")
    with pytest.raises(CheckpointError, match="holds snapshots of another run"):
        second.update()  # refused at once, before it averages anything
    assert second.averager.num_updates == 0
    assert [s.t for s in snapshots(tmp_path / "snapshots")] == [3, 6, 9, 12]  # nothing overwritten
    resumed = PostHocEMA(trainer.model, sigma_rels=(0.05, 0.10), snapshot_every=3, directory=tmp_path / "snapshots")
    resumed.load(checkpoint)  # the same run, going on
    assert resumed.averager.run_id == first.averager.run_id
    for _ in range(3):
        trainer.step()
        resumed.update()
    assert [s.t for s in snapshots(tmp_path / "snapshots")] == [3, 6, 9, 12, 15]
    assert len({s.run for s in snapshots(tmp_path / "snapshots")}) == 1


def test_synthesis_builds_its_averagers_without_a_word(trainer, tmp_path, caplog) -> None:
    """The main job's sweep printed the "shardavg: ... strategy" line twice per sigma_rel."""
    ph = trained(trainer, tmp_path)
    with caplog.at_level(logging.INFO, logger="shardavg"):
        ph.synthesize(0.08)
        ph.synthesize(0.10)
    assert not [r.getMessage() for r in caplog.records if "strategy" in r.getMessage()]
    with caplog.at_level(logging.INFO, logger="shardavg"):
        WeightAverager(TiedNet(), PowerEMA(sigma_rel=0.1))  # one the user builds still says what it is
    assert any("shardavg: replicated strategy" in r.getMessage() for r in caplog.records)


def test_a_false_verdict_is_no_update_of_the_profiles_and_takes_no_snapshot(trainer, tmp_path) -> None:
    """``PostHocEMA.update(finite=...)`` passes the loop's verdict on: a skipped optimizer step is
    neither averaged into the profiles nor counted toward a snapshot, exactly as if the loop had
    not called it (the reference: the same run with the skipped step left out)."""
    ph = PostHocEMA(trainer.model, sigma_rels=(0.05, 0.10), snapshot_every=2, directory=tmp_path / "given")
    reference = PostHocEMA(trainer.model, sigma_rels=(0.05, 0.10), snapshot_every=2, directory=tmp_path / "reference")
    for step in range(1, 6):
        trainer.step()
        skipped = step == 3
        with pytest.warns(RuntimeWarning, match="at step 3 .*finite=False") if skipped else contextlib.nullcontext():
            ph.update(step, finite=not skipped)
        if not skipped:
            reference.update(step)
    assert (ph.averager.num_updates, ph.averager.num_skipped) == (4, 1)
    assert [s.t for s in snapshots(tmp_path / "given")] == [s.t for s in snapshots(tmp_path / "reference")] == [2, 4]
    for profile in ("profile-0", "profile-1"):
        mine = ph.averager.full_state_dict(average=profile)
        theirs = reference.averager.full_state_dict(average=profile)
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
