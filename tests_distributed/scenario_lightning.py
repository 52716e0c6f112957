"""torchrun scenarios for ``shardavg.integrations.lightning`` (Lightning on CPU, 2 processes).

    torchrun --standalone --nproc_per_node 2 tests_distributed/scenario_lightning.py PLAN ROOT

PLAN is ``STRATEGY:MODE[+MODE...]`` items joined by ",", run in turn in one launch, each strategy
in its own folder under ROOT (a launch, mostly its imports of Lightning, costs more than a part;
the tests make two launches: every strategy's ``first``, then every strategy's ``second``).
STRATEGY is ``ddp``, ``fsdp`` (FSDPStrategy, sharded checkpoints), ``model_parallel``
(ModelParallelStrategy: FSDP2 through ``fully_shard`` in ``configure_model``) or ``deepspeed``
(DeepSpeedStrategy, ZeRO-3); the Trainers of one launch share its process group, as a script
that fits twice does. The CPU-only adjustments live here, not in the library. MODE is one of:
  first    fit 8 steps (2 epochs), a checkpoint after each epoch; each update is checked bitwise
           against an EMA of the live weights gathered by the engine's own API, and validation
           inside the swap against the reference average's loss
  second   fit from the step-4 checkpoint: the restored average goes on bitwise from the first
           run's average at step 4 (Lightning's own resume of the raw weights is not bitwise here)
  first-average, second-average   (fsdp) the same with ``checkpoint_weights="average"``: the
           distributed checkpoint's model shards are the average's at step 4, and the resume
           restores the live weights of step 4 bitwise from ``<checkpoint>.shardavg-live/``
  extras   (ddp) copy_at_end, the swap undone when validation raises, a sidecar removed with its checkpoint
  theirs   Lightning's own EMAWeightAveraging on the same set-up: it raises, or averages the wrong tensors
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import harness
import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from safetensors.torch import load_file, save_file
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from shardavg import CheckpointError
from shardavg.integrations.lightning import ShardedWeightAveraging, live_sidecar, sidecar

STEPS, DECAY, RESUME_AT = 8, 0.9, 4


class Net(L.LightningModule):
    def __init__(self, fully_shard: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = harness.TiedNet()
        self.fully_shard = fully_shard
        self.val_losses: list[float] = []

    def configure_model(self) -> None:
        if self.fully_shard:
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for block in (self.net.block, self.net.frozen):
                fully_shard(block, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.net(tokens)

    def training_step(self, batch, batch_idx):
        tokens, targets = batch
        return nn.functional.cross_entropy(self(tokens).float(), targets)

    def validation_step(self, batch, batch_idx):
        tokens, targets = batch
        loss = nn.functional.cross_entropy(self(tokens).float(), targets)
        self.val_losses.append(loss.item())

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.2, momentum=0.9)


def data(count: int, seed: int) -> torch.utils.data.DataLoader:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, harness.VOCAB, (count, 5), generator=generator)
    targets = torch.randint(0, harness.VOCAB, (count,), generator=generator)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens, targets), batch_size=8)


def gathered_live(trainer, module: Net) -> dict[str, torch.Tensor]:
    """The full live weights, gathered by the engine's own API."""
    params = dict(module.net.named_parameters())
    if any(hasattr(p, "ds_id") for p in params.values()):
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(params.values())):
            return {n: p.detach().float().clone() for n, p in params.items()}
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    if isinstance(trainer.strategy.model, FSDP):
        with FSDP.summon_full_params(trainer.strategy.model):
            return {
                n.replace("_fsdp_wrapped_module.", ""): p.detach().clone() for n, p in module.net.named_parameters()
            }
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in params.items()}


class Reference(Callback):
    """After the averager's update: an AveragedModel EMA of the gathered live weights, compared bitwise."""

    def __init__(self, averaging: ShardedWeightAveraging, root: Path, resumed: bool) -> None:
        self.averaging, self.root = averaging, root
        torch.manual_seed(0)
        self.reference = AveragedModel(harness.TiedNet(), multi_avg_fn=get_ema_multi_avg_fn(DECAY))
        self.updates = 0
        self.checked_validation = 0
        if resumed:  # go on from the average the first run had at the checkpoint
            self.reference.module.load_state_dict(load_file(str(root / "at-checkpoint.safetensors")), strict=False)
            self.reference.n_averaged.fill_(RESUME_AT)
            self.updates = RESUME_AT

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        averager = self.averaging.averager
        if averager.num_updates == self.updates:
            return
        self.updates = averager.num_updates
        gathered = gathered_live(trainer, pl_module)
        live = harness.TiedNet()
        live.load_state_dict(gathered, strict=False)  # tied: one name
        self.reference.update_parameters(live)
        buffers = {n.replace("_fsdp_wrapped_module.", ""): b.detach().clone() for n, b in pl_module.net.named_buffers()}
        if isinstance(trainer.strategy.model, nn.parallel.DistributedDataParallel):
            for buffer in buffers.values():  # DDP's forward broadcasts rank 0's buffers to every rank
                dist.broadcast(buffer, 0)
        self.reference.module.load_state_dict(buffers, strict=False)  # copied at each update, as ours are
        got = averager.full_state_dict()
        if self.updates == RESUME_AT and dist.get_rank() == 0:
            state = {k: v.clone() for k, v in self.reference.module.state_dict().items() if k != "head.weight"}
            save_file(state, str(self.root / "at-checkpoint.safetensors"))
            save_file(gathered, str(self.root / "live-at-checkpoint.safetensors"))
        if dist.get_rank() == 0:
            for name, value in self.reference.module.named_parameters():
                if value.requires_grad:
                    assert torch.equal(got[f"net.{name}"], value), f"step {trainer.global_step}: {name} differs"

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if trainer.sanity_checking or not self.averaging.averager.num_updates:
            return
        tokens, targets = batch
        self.reference.module.eval()
        with torch.no_grad():
            want = nn.functional.cross_entropy(self.reference.module(tokens).float(), targets).item()
        got = pl_module.val_losses[-1]  # computed by the sharded model inside the swap
        assert abs(got - want) <= 1e-5 * max(1.0, abs(want)), f"validation with the average: {got} vs {want}"
        self.checked_validation += 1


def strategy(kind: str):
    if kind == "ddp":
        return "ddp"
    if kind == "fsdp":
        from lightning.pytorch.strategies import FSDPStrategy

        class CPUFSDP(FSDPStrategy):
            """Lightning refuses FSDPStrategy itself without a GPU (a subclass passes), and wraps with the
            root device's index, which FSDP on CPU needs as ``device_id=cpu``: wrap here, as a user would."""

            def _setup_model(self, model):
                from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
                from torch.distributed.fsdp.wrap import ModuleWrapPolicy

                policy = ModuleWrapPolicy({harness.Block})
                wrapped = FSDP(model, auto_wrap_policy=policy, device_id=torch.device("cpu"), use_orig_params=True)
                return super()._setup_model(wrapped)

        return CPUFSDP(state_dict_type="sharded")
    if kind == "model_parallel":
        from lightning.pytorch.strategies import ModelParallelStrategy

        return ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy

    class CPUDeepSpeed(DeepSpeedStrategy):
        """DeepSpeedStrategy refuses a CPU accelerator before setting up: skip that check (gloo then)."""

        def setup_environment(self) -> None:
            DDPStrategy.setup_environment(self)

        def setup_distributed(self) -> None:  # (without the check that CUDA device indices match ranks)
            self.set_world_ranks()
            self._init_deepspeed_distributed()

        def _setup_model_and_optimizer(self, model, optimizer, lr_scheduler=None):
            import argparse

            import deepspeed

            engine, optimizer, _, _ = deepspeed.initialize(  # the CPU device has no index: the local rank
                args=argparse.Namespace(device_rank=self.local_rank), config=self.config, model=model,
                model_parameters=[p for p in model.parameters() if p.requires_grad], optimizer=optimizer,
                lr_scheduler=lr_scheduler, dist_init_required=False,
            )  # fmt: skip
            return engine, optimizer

    config = {
        "train_micro_batch_size_per_gpu": 8,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},  # partition every parameter
        "zero_allow_untested_optimizer": True,
    }
    return CPUDeepSpeed(config=config)


class LiveAtStart(Callback):
    """On a resume, the live weights training goes on from: those the first run had at the checkpoint."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.checked = False

    def on_train_start(self, trainer, pl_module) -> None:
        got = gathered_live(trainer, pl_module)  # collective
        if dist.get_rank() == 0:
            want = load_file(str(self.root / "live-at-checkpoint.safetensors"))
            for name, value in got.items():
                assert torch.equal(value, want[name]), f"resumed live weight {name} differs"
        self.checked = True


def run(mode: str, kind: str, root: Path) -> None:
    phase, _, weights = mode.partition("-")  # "first" or "second", then "" or "average"
    if weights:
        root = root / weights
        root.mkdir(exist_ok=True)
    averaging = ShardedWeightAveraging(decay=DECAY, checkpoint_weights=weights or "live")
    reference = Reference(averaging, root, resumed=phase == "second")
    live_at_start = LiveAtStart(root)
    resuming_the_average = phase == "second" and weights == "average"
    # 4 steps an epoch (64 samples, 2 ranks, batches of 8), a checkpoint at each epoch's end
    checkpoints = ModelCheckpoint(dirpath=root / "ckpt", every_n_epochs=1, save_top_k=-1, save_last=True)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy(kind), max_steps=STEPS,
        callbacks=[averaging, checkpoints, reference] + ([live_at_start] if resuming_the_average else []),
        num_sanity_val_steps=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    module = Net(fully_shard=kind == "model_parallel")
    at_checkpoint = root / "ckpt" / f"epoch=0-step={RESUME_AT}.ckpt"
    trainer.fit(module, data(64, 1), data(16, 2), ckpt_path=str(at_checkpoint) if phase == "second" else None)
    averager = averaging.averager
    assert averager.num_updates == STEPS and averager.step == STEPS, (averager.num_updates, averager.step)
    assert reference.updates == STEPS, f"the reference saw {reference.updates} updates"
    assert reference.checked_validation > 0, "validation with the average was never checked"
    assert live_at_start.checked == resuming_the_average
    if dist.get_rank() == 0:
        assert sidecar(at_checkpoint).is_dir() and sidecar(root / "ckpt" / "last.ckpt").is_dir()
        if weights == "average":
            assert live_sidecar(at_checkpoint).is_dir()
            assert_holds_the_average(at_checkpoint, root / "at-checkpoint.safetensors")
    harness.report("LIGHTNING", {"mode": mode, "strategy": kind, "world_size": dist.get_world_size()})


def assert_holds_the_average(checkpoint: Path, average: Path) -> None:
    """The distributed checkpoint's model (``FSDPStrategy``'s key) is, bitwise, the reference average."""
    from lightning.fabric.utilities.load import _load_distributed_checkpoint

    saved = _load_distributed_checkpoint(checkpoint)["model"]  # one process, every rank's shards
    want = load_file(str(average))
    parameters = [name for name, _ in harness.TiedNet().named_parameters() if name in want]
    assert parameters, sorted(want)
    for name in parameters:
        assert torch.equal(saved[f"net.{name}"], want[name]), f"the checkpoint's {name} is not the average"


class Failing(Net):
    """Raises in its first validation with averaged weights."""

    def validation_step(self, batch, batch_idx):
        if self.trainer.global_step > 0:
            raise RuntimeError("validation failed on purpose")
        return super().validation_step(batch, batch_idx)


class LiveBefore(Callback):
    """Keeps the live weights as they are before the averager swaps its own in."""

    def on_validation_epoch_start(self, trainer, pl_module) -> None:
        self.weights = {n: p.detach().clone() for n, p in pl_module.named_parameters()}


def extras(root: Path) -> None:
    """copy_at_end, the swap undone by an exception, and a sidecar removed with its checkpoint (DDP)."""
    averaging = ShardedWeightAveraging(decay=DECAY, copy_at_end=True)
    keep_one = ModelCheckpoint(dirpath=root / "one", every_n_epochs=1, save_top_k=1)  # removes the older
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_steps=STEPS, callbacks=[averaging, keep_one],
        num_sanity_val_steps=0, logger=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    module = Net()
    trainer.fit(module, data(64, 1), data(16, 2))
    average = averaging.averager.full_state_dict()
    if dist.get_rank() == 0:
        live = {n: p.detach() for n, p in module.named_parameters()}
        assert all(torch.equal(live[n], average[n]) for n in live if live[n].requires_grad), "not copied at the end"
        files = sorted(p.name for p in (root / "one").iterdir())
        assert files == [f"epoch=1-step={STEPS}.ckpt", f"epoch=1-step={STEPS}.ckpt.shardavg"], files

    resume_without_the_sidecar(root / "one" / f"epoch=1-step={STEPS}.ckpt", root)

    before = LiveBefore()
    averaging = ShardedWeightAveraging(decay=DECAY)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_steps=STEPS, callbacks=[before, averaging],
        num_sanity_val_steps=0, logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False,
    )  # fmt: skip
    failing = Failing()
    try:
        trainer.fit(failing, data(64, 1), data(16, 2))
    except RuntimeError as error:
        assert "on purpose" in str(error), error
    else:
        raise AssertionError("the failing validation did not raise")
    restored = dict(failing.named_parameters())
    assert all(torch.equal(restored[n], w) for n, w in before.weights.items()), "the swap was not undone"
    harness.report("EXTRAS", {"world_size": dist.get_world_size()})


def resume_without_the_sidecar(checkpoint: Path, root: Path) -> None:
    """A checkpoint copied without its ``.shardavg`` sidecar: refused naming the sidecar to copy, or
    with ``strict=False`` the average restarts from the loaded weights and goes on."""
    import shutil

    bare = root / "bare" / checkpoint.name
    if dist.get_rank() == 0:
        bare.parent.mkdir()
        shutil.copy(checkpoint, bare)
    dist.barrier()
    for strict in (True, False):
        averaging = ShardedWeightAveraging(decay=DECAY, strict=strict)
        trainer = L.Trainer(
            accelerator="cpu", devices=2, strategy="ddp", max_steps=STEPS + 2, callbacks=[averaging],
            num_sanity_val_steps=0, logger=False, enable_progress_bar=False, enable_model_summary=False,
            enable_checkpointing=False, limit_val_batches=0,
        )  # fmt: skip
        if strict:
            with harness.expect_raises(
                CheckpointError, "has no average beside it", f"copy its sidecar {bare.name}.shardavg/"
            ):
                trainer.fit(Net(), data(64, 1), ckpt_path=str(bare))
            continue
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(Net(), data(64, 1), ckpt_path=str(bare))
        assert any("restarted from the loaded weights" in str(w.message) for w in caught), [
            str(w.message) for w in caught
        ]
        assert (averaging.averager.num_updates, averaging.averager.step) == (3, STEPS + 2)


def theirs(kind: str) -> None:
    """Lightning's EMAWeightAveraging on the same set-up: it raises, or keeps an average of the
    wrong tensors (reported: what it holds against the plain model's shapes)."""
    from lightning.pytorch.callbacks import EMAWeightAveraging

    ema = EMAWeightAveraging(decay=DECAY, use_buffers=False)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy(kind), max_steps=4, callbacks=[ema], logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, limit_val_batches=0,
    )  # fmt: skip
    try:
        trainer.fit(Net(fully_shard=kind == "model_parallel"), data(64, 1))
    except Exception as error:  # noqa: BLE001 (what Lightning's callback does is the finding)
        outcome = f"raised {type(error).__name__}: {str(error)[:300]}"
    else:
        shapes = {n: tuple(p.shape) for n, p in harness.TiedNet().named_parameters()}
        held = {n.removeprefix("net."): tuple(p.shape) for n, p in ema._average_model.module.named_parameters()}
        wrong = sorted(n for n in shapes if held.get(n) != shapes[n])
        outcome = f"ran, holding wrong tensors {wrong}" if wrong else "ran, holding the right shapes"
    harness.report("THEIRS", {"strategy": kind, "outcome": outcome})


def main() -> None:
    plan, root = sys.argv[1], Path(sys.argv[2])
    for item in plan.split(","):
        kind, modes = item.split(":")
        folder = root / kind
        folder.mkdir(parents=True, exist_ok=True)
        for mode in modes.split("+"):
            if mode == "theirs":
                theirs(kind)
            elif mode == "extras":
                extras(folder)
            else:
                run(mode, kind, folder)
    if dist.is_initialized():  # (Lightning's own EMA may raise before it makes the process group)
        harness.finish()


if __name__ == "__main__":
    main()
