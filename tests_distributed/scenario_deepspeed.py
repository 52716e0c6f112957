"""torchrun scenarios for ``shardavg.integrations.deepspeed``.

    torchrun --standalone --nproc_per_node N tests_distributed/scenario_deepspeed.py MODE ROOT

MODE is one of these, or several joined by "+" and run in turn in one launch (a launch costs more
than a mode):
  resume      for ZeRO stages 1, 2 and 3: train, save_checkpoint, train on (the reference); a new
              engine and averager load_checkpoint (through ``latest``) and train on: bitwise the
              same; a tag the engine saved alone is refused, or with strict=False re-seeds
  kill        save tag A, then SIGKILL rank 1 while it writes its shard of the average for tag B
  after-kill  load_checkpoint follows ``latest``: tag A, whole, equal to its reference
  master      bf16 at ZeRO 1, 2, 3 with source="master": bitwise an EMA of the gathered fp32 masters
  offload     bf16 ZeRO-3 with parameters (and optimizer) offloaded to the CPU: both sources bitwise
              EMAs of the gathered live weights and fp32 masters; NVMe refused, naming the config key
"""

from __future__ import annotations

import shutil
import sys
import warnings
from pathlib import Path

import harness
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record

import shardavg
from shardavg import EMA, SWA, CheckpointError, ModelChangedError, WeightAverager
from shardavg.integrations import deepspeed as ds_checkpoint

RULES = {"ema": EMA(decay=0.9), "swa": SWA()}
STEPS = 6


class Run:
    """A DeepSpeed engine at a ZeRO stage with a fresh TiedNet (the same initial weights every time)."""

    def __init__(self, stage: int, bf16: bool = False, source: str = "live", zero: dict | None = None) -> None:
        import deepspeed

        zero = {"stage": stage} | ({"stage3_param_persistence_threshold": 0} if stage == 3 else {}) | (zero or {})
        config = {
            "train_micro_batch_size_per_gpu": 8,
            "gradient_accumulation_steps": 1,
            "zero_optimization": zero,
            "zero_allow_untested_optimizer": True,
            "zero_force_ds_cpu_optimizer": False,  # SGD with offload_optimizer (DeepSpeed's CPUAdam needs a build)
            "bf16": {"enabled": bf16},
        }
        self.stage = stage
        torch.manual_seed(0)
        module = harness.TiedNet().to(torch.bfloat16 if bf16 else torch.float32)  # buffers too
        optimizer = torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=0.2, momentum=0.9)
        self.engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, config=config)
        self.avg = WeightAverager(self.engine, RULES, source=source)

    def train(self, steps: range) -> None:
        for step in steps:
            tokens, targets = harness.batch(step)
            loss = nn.functional.cross_entropy(self.engine(tokens).float(), targets)
            self.engine.backward(loss)
            self.engine.step()
            self.avg.update()

    def live(self) -> dict[str, torch.Tensor]:
        """The full live parameters (gathered under ZeRO-3)."""
        import deepspeed

        params = dict(self.engine.module.named_parameters())
        with deepspeed.zero.GatheredParameters(list(params.values()), enabled=self.stage == 3):
            return {n: p.detach().clone() for n, p in params.items() if p.requires_grad}

    def averages(self) -> dict[str, dict[str, torch.Tensor]]:
        return {name: self.avg.full_state_dict(name) for name in RULES}


def assert_same(label: str, got: dict, want: dict) -> None:
    for name in RULES:
        assert set(got[name]) == set(want[name]), f"{label}/{name}: names differ"
        for key, value in want[name].items():
            assert torch.equal(got[name][key], value), f"{label}/{name}: {key} differs"


def resume(root: Path) -> None:
    for stage in (1, 2, 3):
        folder = root / f"stage{stage}"
        first = Run(stage)
        first.train(range(1, STEPS + 1))
        ds_checkpoint.save_checkpoint(first.engine, first.avg, folder)
        assert (folder / "latest").read_text() == f"global_step{STEPS}"
        first.train(range(STEPS + 1, 2 * STEPS + 1))
        reference = first.averages()

        second = Run(stage)
        ds_checkpoint.load_checkpoint(second.engine, second.avg, folder)
        assert (second.avg.step, second.avg.num_updates) == (STEPS, STEPS)
        second.train(range(STEPS + 1, 2 * STEPS + 1))
        assert_same(f"stage {stage} resumed", second.averages(), reference)
        if stage == 1:
            refuse_bad_tags(first, folder, root)
        if stage == 3:
            refuse_an_averager_built_before_partitioning()

        # A tag the engine saved by itself: refused before the engine loads it, or re-seeded.
        first.engine.save_checkpoint(str(folder), tag="engine-only")
        third = Run(stage)
        before = {n: p.detach().clone() for n, p in third.engine.module.named_parameters()}
        with harness.expect_raises(CheckpointError, "holds no average", "strict=False"):
            ds_checkpoint.load_checkpoint(third.engine, third.avg, folder, tag="engine-only")
        after = dict(third.engine.module.named_parameters())
        assert all(torch.equal(before[n], after[n]) for n in before), "the engine loaded before the refusal"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ds_checkpoint.load_checkpoint(third.engine, third.avg, folder, tag="engine-only", strict=False)
        assert any("holds no average" in str(w.message) for w in caught), [str(w.message) for w in caught]
        assert (third.avg.num_updates, third.avg.step) == (1, 2 * STEPS)
        live, average = third.live(), third.avg.full_state_dict("ema")  # re-seeded: the loaded live weights
        if dist.get_rank() == 0:
            assert all(torch.equal(average[n], value) for n, value in live.items()), "not re-seeded from live"
        harness.report("RESUMED", {"stage": stage, "world_size": dist.get_world_size()})


def refuse_an_averager_built_before_partitioning() -> None:
    """Built on the plain module, then deepspeed.initialize partitions it: the first update says so."""
    import deepspeed

    module = harness.TiedNet()
    early = WeightAverager(module, EMA(decay=0.9))
    optimizer = torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=0.1)
    config = {"train_micro_batch_size_per_gpu": 8, "zero_allow_untested_optimizer": True,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}  # fmt: skip
    deepspeed.initialize(model=module, optimizer=optimizer, config=config)
    with harness.expect_raises(
        ModelChangedError, "deepspeed.initialize", "build the averager on the model they return"
    ):
        early.update()


def refuse_bad_tags(run: Run, folder: Path, root: Path) -> None:
    """Tags that name no folder inside the save folder (or another one on each rank) are refused
    on every rank before anything is written; ``latest`` and the previous tag stay as they were."""
    before = sorted(p.relative_to(root) for p in root.rglob("*"))
    latest = (folder / "latest").read_text()
    for tag in ("../escape", "sub/dir", "", ".", "..", "latest", " padded", "two\nlines"):
        with harness.expect_raises(ValueError, f"tag {tag!r} does not name one folder inside the save folder"):
            ds_checkpoint.save_checkpoint(run.engine, run.avg, folder, tag=tag)
        with harness.expect_raises(ValueError, "does not name one folder"):
            ds_checkpoint.load_checkpoint(run.engine, run.avg, folder, tag=tag)
    with harness.expect_raises(CheckpointError, "the ranks name different tags"):
        ds_checkpoint.save_checkpoint(run.engine, run.avg, folder, tag=f"rank{dist.get_rank()}")
    dist.barrier()
    assert sorted(p.relative_to(root) for p in root.rglob("*")) == before, "a refused save wrote something"
    assert (folder / "latest").read_text() == latest
    again = Run(run.stage)
    damaged = root / "damaged"  # rank 1's file of the average gone: refused before the engine loads
    if dist.get_rank() == 0:
        shutil.copytree(folder, damaged)
        (damaged / latest / "shardavg" / "rank-00001-of-00002.safetensors").unlink()
    dist.barrier()
    before = {n: p.detach().clone() for n, p in again.engine.module.named_parameters()}
    with harness.expect_raises(CheckpointError, "missing checkpoint file", "rank-00001-of-00002.safetensors"):
        ds_checkpoint.load_checkpoint(again.engine, again.avg, damaged)
    after = dict(again.engine.module.named_parameters())
    assert all(torch.equal(before[n], after[n]) for n in before), "the engine loaded before the average was refused"
    ds_checkpoint.load_checkpoint(again.engine, again.avg, folder)  # the previous tag, through latest
    assert again.avg.num_updates == STEPS


def master(root: Path) -> None:
    """bf16 at ZeRO 1, 2 and 3: the master-source EMA is bitwise an EMA of the gathered fp32
    masters; the live-source one (of the bf16 weights) is not; swapped() writes the bf16 weights
    the forward reads and restores them bit for bit."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    for stage in (1, 2, 3):
        run = Run(stage, bf16=True, source="master")
        assert run.avg.strategy.name == ("zero3" if stage == 3 else "zero12"), run.avg.strategy.name
        live_source = WeightAverager(run.engine, EMA(decay=0.9))
        harness.check_derived_layout(run.avg)
        harness.check_derived_layout(live_source)
        torch.manual_seed(0)
        reference = AveragedModel(harness.TiedNet(), multi_avg_fn=get_ema_multi_avg_fn(0.9))
        params = dict(run.engine.module.named_parameters())
        frozen_params = [p for p in params.values() if not p.requires_grad]
        for step in range(1, 2 * STEPS + 1):
            run.train(range(step, step + 1))
            live_source.update()
            plain = harness.TiedNet()
            masters = {n: safe_get_full_fp32_param(p) for n, p in params.items() if p.requires_grad}
            with deepspeed.zero.GatheredParameters(frozen_params, enabled=stage == 3):
                frozen = {n: p.detach().float().clone() for n, p in params.items() if not p.requires_grad}
            plain.load_state_dict(masters | frozen, strict=False)
            reference.update_parameters(plain)
        harness.check_writers(run.avg, f"zero{stage}-masters", average="ema")
        got, lived = run.avg.full_state_dict("ema"), live_source.full_state_dict()
        if dist.get_rank() == 0:
            differences = []
            for name, want in reference.module.named_parameters():
                if want.requires_grad:
                    assert torch.equal(got[name], want), (
                        f"stage {stage}: master-source {name} differs from the reference"
                    )
                    differences.append(((lived[name] - want).abs().max() / want.abs().max()).item())
            assert max(differences) > 1e-4, f"stage {stage}: the bf16-live average is as good: {differences}"
            harness.report("MASTER_VS_LIVE", {"stage": stage, "max_rel_difference": max(differences)})

        before = [view.clone() for view in run.avg.strategy.swap_views()]
        with run.avg.swapped("ema"):
            averaged = run.avg.shadows("ema")
            for info, shadow, view in zip(run.avg.tensors, averaged, run.avg.strategy.swap_views()):
                if shadow is not None and info.kind == "param":
                    assert view.dtype == torch.bfloat16, (info.name, view.dtype)
                    if stage == 3:  # this rank's partition of the average
                        assert torch.equal(view, shadow.to(torch.bfloat16)), info.name
                    else:  # the whole average, gathered: this rank's part of it is its fragment
                        part = info.part.take(view)
                        assert torch.equal(part, shadow.reshape(-1).to(torch.bfloat16)), info.name
        after = run.avg.strategy.swap_views()
        assert all(torch.equal(a, b) for a, b in zip(before, after)), f"stage {stage}: live weights not restored"
    with harness.expect_raises(shardavg.StrategyError, "source='master'", "ZeRO-3"):
        WeightAverager(run.engine.module, EMA(decay=0.9), source="master")  # the module: no optimizer
    harness.report("MASTER", {"world_size": dist.get_world_size()})


def offload(root: Path) -> None:
    """bf16 ZeRO-3 with "offload_param" on the CPU (the partitions then live in flat CPU buffers, marked
    "not-nvme" by DeepSpeed), at persistence threshold 0 alone and at DeepSpeed's default with
    "offload_optimizer" on the CPU too: the live-source EMA is bitwise an EMA of the gathered live
    weights, the master-source one of the gathered fp32 masters, each view is the memory the optimizer
    writes (never a copy, as DeepSpeed's local-master getter makes of CPU masters on a GPU: simulated
    here), and swapped() writes the offloaded partitions and restores them bit for bit. NVMe (which
    DeepSpeed cannot run here, without libaio) is refused as its config or partition says it."""
    import deepspeed
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum
    from deepspeed.utils import safe_get_full_fp32_param
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    cpu = {"device": "cpu"}
    for zero in (
        {"offload_param": cpu},
        {"offload_param": cpu, "offload_optimizer": cpu, "stage3_param_persistence_threshold": 100_000},  # the default
    ):
        run = Run(3, bf16=True, source="master", zero=zero)
        live_source = WeightAverager(run.engine, RULES["ema"])
        params, optimizer = dict(run.engine.module.named_parameters()), run.engine.optimizer
        if "offload_optimizer" in zero:  # as on a GPU: DeepSpeed's local master, moved to the device, is a copy
            local = optimizer.get_local_fp32_param
            optimizer.get_local_fp32_param = lambda param, key=None, local=local: local(param, key).clone()
            run.avg = WeightAverager(run.engine, RULES, source="master")  # (built anew: the views are read once)
        references = {}
        for source in ("live", "master"):
            torch.manual_seed(0)
            references[source] = AveragedModel(harness.TiedNet(), multi_avg_fn=get_ema_multi_avg_fn(0.9))
        for step in range(1, STEPS + 1):
            run.train(range(step, step + 1))
            live_source.update()
            with deepspeed.zero.GatheredParameters(list(params.values())):
                live = {n: p.detach().float().clone() for n, p in params.items()}
            masters = {n: safe_get_full_fp32_param(p) for n, p in params.items() if p.requires_grad}
            for source, weights in (("live", live), ("master", live | masters)):
                plain = harness.TiedNet()
                plain.load_state_dict(weights, strict=False)
                references[source].update_parameters(plain)
        written = {  # the flat buffers the optimizer writes: bf16 partitions (on the CPU) and fp32 masters
            "live": {t.untyped_storage().data_ptr() for t in optimizer.fp16_partitioned_groups_flat},
            "master": {t.untyped_storage().data_ptr() for t in optimizer.fp32_partitioned_groups_flat},
        }
        for source, averager in (("live", live_source), ("master", run.avg)):
            for info, view in zip(averager.tensors, averager.strategy.local_shards()):
                if info.kind == "param" and info.requires_grad:
                    assert view.untyped_storage().data_ptr() in written[source], (zero, source, info.name)
            got = averager.full_state_dict("ema" if source == "master" else None)
            if dist.get_rank() == 0:
                for name, want in references[source].module.named_parameters():
                    assert torch.equal(got[name], want), f"{zero} {source}-source {name} differs from the reference"
        before = [view.clone() for view in run.avg.strategy.swap_views()]
        with run.avg.swapped("ema"):
            for info, shadow, view in zip(run.avg.tensors, run.avg.shadows("ema"), run.avg.strategy.swap_views()):
                if shadow is not None and info.kind == "param":
                    assert torch.equal(view, shadow.to(view.dtype)), (zero, info.name)
        assert all(torch.equal(a, b) for a, b in zip(before, run.avg.strategy.swap_views())), f"{zero}: not restored"
        harness.report("OFFLOAD", {"zero": sorted(zero), "world_size": dist.get_world_size()})

    # NVMe, as the config says (DeepSpeed reads "nvme" there as OffloadDeviceEnum.nvme)
    config = run.engine._config.zero_config
    config.offload_optimizer.device = OffloadDeviceEnum.nvme
    with harness.expect_raises(
        shardavg.StrategyError, '"offload_optimizer": {"device": "nvme"}', "source='live'", '"device": "cpu"'
    ):
        WeightAverager(run.engine, RULES["ema"], source="master")
    WeightAverager(run.engine, RULES["ema"])  # the live partitions stay in memory: averaged
    config.offload_param.device = OffloadDeviceEnum.nvme
    for source in ("live", "master"):
        with harness.expect_raises(
            shardavg.StrategyError, '"offload_param": {"device": "nvme"}', "update()", '{"device": "cpu"}'
        ):
            WeightAverager(run.engine, RULES["ema"], source=source)
    # a partition DeepSpeed marks as on NVMe (as zero.Init(remote_device="nvme") leaves them): refused by name
    params["block.up.weight"].ds_tensor.final_location = OffloadDeviceEnum.nvme
    with harness.expect_raises(shardavg.StrategyError, "'block.up.weight' is on NVMe", 'remote_device="cpu"'):
        WeightAverager(run.engine.module, RULES["ema"])


def kill(root: Path) -> None:
    run = Run(3)
    run.train(range(1, STEPS + 1))
    ds_checkpoint.save_checkpoint(run.engine, run.avg, root / "killed", tag="A")
    reference = run.averages()
    if dist.get_rank() == 0:
        for name, state in reference.items():
            save_file({k: v.clone() for k, v in state.items()}, str(root / f"reference-{name}.safetensors"))
    dist.barrier()
    run.train(range(STEPS + 1, 2 * STEPS + 1))
    harness.die_while_writing_shards(rank=1)
    ds_checkpoint.save_checkpoint(run.engine, run.avg, root / "killed", tag="B")
    raise AssertionError("rank 1 should have been killed during the save")


def after_kill(root: Path) -> None:
    run = Run(3)
    assert (root / "killed" / "latest").read_text() == "A"
    ds_checkpoint.load_checkpoint(run.engine, run.avg, root / "killed")
    assert (run.avg.step, run.avg.num_updates) == (STEPS, STEPS)
    got = run.averages()
    if dist.get_rank() == 0:
        want = {name: load_file(str(root / f"reference-{name}.safetensors")) for name in RULES}
        assert_same("after the kill", got, want)
    harness.report("RECOVERED", {"world_size": dist.get_world_size()})


@record
def main() -> None:
    modes, root = sys.argv[1].split("+"), Path(sys.argv[2])
    harness.init_distributed(deepspeed=True)
    for mode in modes:
        {"resume": resume, "master": master, "offload": offload, "kill": kill, "after-kill": after_kill}[mode](root)
    harness.finish()


if __name__ == "__main__":
    main()
