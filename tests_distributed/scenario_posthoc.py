"""torchrun scenarios for the post-hoc EMA: every engine writes snapshots; every engine, at
every world size, synthesizes from every set of snapshots, against Algorithm 3 applied to the
full snapshots read whole.

    torchrun --standalone --nproc_per_node N tests_distributed/scenario_posthoc.py MODE ROOT

MODE is ``write`` (each engine trains with a PostHocEMA and writes its snapshots under
ROOT/<engine>-ws<N>) or ``read`` (each engine synthesizes from every directory under ROOT), or
``write+read``, both in turn in one launch.
"""

from __future__ import annotations

import sys
from pathlib import Path

import harness
import numpy as np
import torch
import torch.distributed as dist
from scenario_checkpoint import build

from shardavg import PostHocEMA
from shardavg.offline.saved_average import SavedAverage
from shardavg.posthoc import snapshots, synthesize
from shardavg.rules import sigma_rel_to_gamma

ENGINES = ["replicated", "fsdp2", "fsdp1", "zero3"]
STEPS, EVERY, SIGMAS = 8, 2, (0.06, 0.09)


def edm2_p_dot_p(t_a, gamma_a, t_b, gamma_b):
    """EDM2's inner product of two power-function profiles, in the paper's own form (independent
    of the library's log-space evaluation)."""
    t_ratio = t_a / t_b
    t_exp = np.where(t_a < t_b, gamma_b, -gamma_a)
    t_max = np.maximum(t_a, t_b)
    return (gamma_a + 1) * (gamma_b + 1) * t_ratio**t_exp / ((gamma_a + gamma_b + 1) * t_max)


def reference(directory: Path, sigma_rel: float) -> dict[str, torch.Tensor]:
    """Algorithm 3 (its least-squares solution divided by its sum) on the full snapshots, read whole in float64."""
    found = snapshots(directory)
    terms = [(s, name, g) for s in found for name, g in s.gammas.items()]
    t = np.float64([s.t for s, _, _ in terms])
    g = np.float64([gamma for _, _, gamma in terms])
    tr, gr = np.float64([found[-1].t]), np.float64([sigma_rel_to_gamma(sigma_rel)])
    a = edm2_p_dot_p(t[:, None], g[:, None], t[None, :], g[None, :])
    b = edm2_p_dot_p(t[:, None], g[:, None], tr[None, :], gr[None, :])
    x = np.linalg.lstsq(a, b, rcond=None)[0][:, 0]
    x = x / x.sum()  # EDM2's released code: the weights of an average sum to 1
    readers = {s.path: SavedAverage(s.path) for s in found}
    last = readers[found[-1].path]
    result = {}
    for name, entry in last.tensors.items():
        if entry.role == "average":
            result[name] = sum(c * readers[s.path].read(name, p).double() for c, (s, p, _) in zip(x, terms))
        elif entry.role == "copy":
            result[name] = last.read(name, next(iter(last.averages)))
    return result


def write(root: Path) -> None:
    for kind in ENGINES:
        engine = build(kind)
        ph = PostHocEMA(engine.model, sigma_rels=(0.05, 0.10), snapshot_every=EVERY,
                        directory=root / f"{kind}-ws{dist.get_world_size()}")  # fmt: skip
        for step in range(1, STEPS + 1):
            engine.step(step)
            ph.update()
        harness.report("WROTE", {"engine": kind, "world_size": dist.get_world_size()})


def read(root: Path) -> None:
    sources = sorted(p for p in root.iterdir() if p.is_dir())
    assert len(sources) >= len(ENGINES), sources
    for kind in ENGINES:
        engine = build(kind)  # untrained: the averaged values must come from the snapshots
        for source in sources:
            for sigma in SIGMAS:
                got = synthesize(engine.model, source, sigma).full_state_dict()
                if dist.get_rank() == 0:
                    want = reference(source, sigma)
                    for name, value in want.items():
                        label = f"{source.name} -> {kind} at {dist.get_world_size()}, sigma_rel {sigma}: {name}"
                        torch.testing.assert_close(
                            got[name].double(), value.double(), rtol=1e-5, atol=1e-6, msg=lambda m, x=label: f"{x}: {m}"
                        )
        harness.report("READ", {"engine": kind, "world_size": dist.get_world_size(), "sources": len(sources)})


def main() -> None:
    modes, root = sys.argv[1].split("+"), Path(sys.argv[2])  # several: in turn, in this launch
    harness.init_distributed(deepspeed=True)
    for mode in modes:
        {"write": write, "read": read}[mode](root)
    harness.finish()


if __name__ == "__main__":
    main()
