"""Post-hoc EMA in one process: the coefficients against the paper's formulas written out here,
synthesis against Algorithm 3 applied to the full snapshots, and what is refused."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from harness import TiedNet

from shardavg import CheckpointError
from shardavg.offline import SavedAverage
from shardavg.posthoc import PostHocEMA, snapshots, solve_coefficients, synthesize
from shardavg.rules import sigma_rel_to_gamma


def edm2_p_dot_p(t_a, gamma_a, t_b, gamma_b):
    """EDM2's inner product of two power-function profiles, in the paper's own form."""
    t_ratio = t_a / t_b
    t_exp = np.where(t_a < t_b, gamma_b, -gamma_a)
    t_max = np.maximum(t_a, t_b)
    return (gamma_a + 1) * (gamma_b + 1) * t_ratio**t_exp / ((gamma_a + gamma_b + 1) * t_max)


def edm2_solve(ts, gammas, t_r, gamma_r):
    t, g = np.float64(ts), np.float64(gammas)
    a = edm2_p_dot_p(t[:, None], g[:, None], t[None, :], g[None, :])
    b = edm2_p_dot_p(t[:, None], g[:, None], np.float64([t_r])[None, :], np.float64([gamma_r])[None, :])
    return np.linalg.lstsq(a, b, rcond=None)[0][:, 0]


def test_the_coefficients_are_the_papers() -> None:
    ts = [100.0 * (i + 1) for i in range(20)] * 2
    gammas = [sigma_rel_to_gamma(0.05)] * 20 + [sigma_rel_to_gamma(0.10)] * 20
    for sigma in (0.04, 0.07, 0.12):
        ours, residual = solve_coefficients(ts, gammas, 2000.0, sigma_rel_to_gamma(sigma))
        want = edm2_solve(ts, gammas, 2000.0, sigma_rel_to_gamma(sigma))
        np.testing.assert_allclose(ours.numpy(), want, rtol=1e-6, atol=1e-9)
        assert residual < 0.05, (sigma, residual)
        assert abs(float(ours.sum()) - 1.0) < 1e-3  # an average of averages: the weights sum to about one


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
    got = ph.synthesize(gamma=sigma_rel_to_gamma(0.10), step=snapshot.description["step"]).full_state_dict()
    for name in snapshot.tensors:
        if not name.startswith("frozen.") and snapshot.tensors[name]["role"] == "average":
            torch.testing.assert_close(got[name], snapshot.read(name, "profile-1"), rtol=1e-5, atol=1e-6)


def test_what_cannot_be_synthesized_is_refused(trainer, tmp_path) -> None:
    ph = trained(trainer, tmp_path)
    with pytest.raises(ValueError, match=r"cannot be synthesized well.*sigma_rel from"):
        ph.synthesize(0.005)
    with pytest.raises(
        ValueError, match=r"step 7 is not a snapshot's step; the snapshots are at steps \[3, 6, 9, 12\]"
    ):
        ph.synthesize(0.07, step=7)
    with pytest.raises(ValueError, match="at least two profiles"):
        PostHocEMA(trainer.model, sigma_rels=(0.05,), snapshot_every=3, directory=tmp_path / "one")
    other = PostHocEMA(TiedNet(), gammas=(5.0, 9.0), snapshot_every=1, directory=tmp_path / "snapshots")
    other.update(step=100)  # writes snapshot-000000001 with other profiles into the same directory
    with pytest.raises(CheckpointError, match="different models or profiles"):
        ph.synthesize(0.07)
    shutil.rmtree(tmp_path / "snapshots" / "snapshot-000000001")
    (tmp_path / "snapshots" / "snapshot-000000006" / "rank-00000-of-00001.safetensors").unlink()
    with pytest.raises(CheckpointError, match="rank-00000-of-00001.safetensors"):
        ph.synthesize(0.07)
    with pytest.raises(CheckpointError, match="no snapshot directory"):
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
    assert listed.count("profile-0: ") == 4 and "sigma_rel from" in listed, listed
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
    assert SavedAverage(tmp_path / "bf16" / "snapshot-000000012").tensors["embed.weight"]["dtype"] == "bfloat16"
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
    output tensor plus one snapshot tensor (and its chunk), whatever the model size and the
    number of snapshots (measured, printed for the record). The snapshot files themselves are
    memory-mapped when opened (safetensors maps each file; its pages are read on demand and
    stay file-backed), which is left out of the measure: the files are opened first."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "launch"))
    from measure import allocated_peak

    from shardavg.posthoc import synthesized_tensors

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512, bias=False) for _ in range(8)])  # 8 x 1 MiB
    ph = PostHocEMA(model, snapshot_every=1, directory=tmp_path / "snapshots")
    for _ in range(8):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p), alpha=0.01)
        ph.update()
    tensor_bytes = 512 * 512 * 4

    _, tensors = synthesized_tensors(tmp_path / "snapshots", sigma_rel_to_gamma(0.07))  # opens and maps the files

    def consume() -> None:
        for _ in tensors:
            pass

    peak = allocated_peak(consume)
    snapshot_bytes = sum(s.bytes for s in snapshots(tmp_path / "snapshots"))
    print(f"offline synthesis: peak {peak / 2**20:.2f} MiB for a {8 * tensor_bytes / 2**20:.0f} MiB model, "
          f"8 snapshots x 2 profiles ({snapshot_bytes / 2**20:.0f} MiB on disk)")  # fmt: skip
    assert peak <= 3 * tensor_bytes + 2**16, peak
