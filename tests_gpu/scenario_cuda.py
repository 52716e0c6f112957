"""torchrun scenario: the averager with its model on each rank's GPU, over NCCL, against references.

    torchrun --standalone --nproc_per_node N tests_gpu/scenario_cuda.py DEVICE ENGINE[,ENGINE...] OUT

DEVICE is ``cuda`` (one GPU per rank); ``cpu`` runs the same checks over gloo, which is how the
scenario itself is checked on a machine without a GPU. ENGINE is ddp, fsdp2, fsdp1 or zero3
(ZeRO-3 where DeepSpeed is installed). For each configuration (fp32 and bf16 live weights;
FSDP1's ``use_orig_params``) the model trains for real on the device while these averagers run:

- ``ema``: on the device, as built by default: on CUDA the non-finite check's verdict stays on the
  GPU, the update skipped there by the Triton kernel (``shardavg.kernels``) and the verdict read
  later; on the CPU the host reads it;
- ``ema_host``: the verdict read on the host at every update (``updater.on_device = False``);
- ``ema_deferred``: the check kept on the device on any device (``updater.on_device = True``);
- ``ema_off``: ``on_nonfinite="off"``;
- ``ema_cpu``: ``device="cpu"``: pinned host shadows, the live shards staged on a side stream;
- ``fn``: a ``multi_avg_fn`` (custom rules take the host path);
- ``ema_background``, ``ema_cpu_background``: ``background=True``, the update on a thread of its
  own and a side stream, collected by the next optimizer step.

Each is checked against ``AveragedModel`` with ``get_ema_multi_avg_fn`` over the live weights the
engine's own API gathers, kept where the averager keeps its shadows: bitwise for fp32 live
weights, within fp32 rounding for bf16. Then: the update with the check on the device, or off,
issues no device sync (``torch.cuda.set_sync_debug_mode("error")``); a NaN put in a live shard is refused by the update
(the host check) or masked on the device and reported at the next read (the deferred one),
naming the tensor and the step; ``export``, ``save``/``load`` and
``dcp.save``/``dcp.load`` give back the average bitwise (CPU pieces sent through CUDA buffers
where the backend is NCCL); ``swapped()`` evaluates the average and restores the live weights.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import harness
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from harness import Block, Frozen, TiedNet, expect_raises
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import shardavg
from shardavg import EMA, WeightAverager
from shardavg.strategies.base import canonical_name

STEPS = 8
DECAY = 0.9


@dataclass
class Engine:
    name: str
    model: object  # what WeightAverager takes
    step: Callable[[int], None]
    gather_live: Callable[[], dict[str, torch.Tensor]]  # full live parameters, every rank
    forward: Callable[[torch.Tensor], torch.Tensor]
    dtype: torch.dtype


def _trainer(model: nn.Module, forward, device: torch.device) -> Callable[[int], None]:
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.2, momentum=0.9)

    def step(index: int) -> None:
        tokens, targets = (t.to(device) for t in harness.batch(index))
        loss = nn.functional.cross_entropy(forward(tokens).float(), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    return step


def build(kind: str, dtype: torch.dtype, device: torch.device) -> Engine:
    """The engine ``kind`` over every rank, its model on ``device`` in ``dtype``."""
    torch.manual_seed(0)
    plain = TiedNet().to(device, dtype)
    label = f"{kind}-{str(dtype)[6:]}"
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [device.index] if device.type == "cuda" else None
        model = DistributedDataParallel(plain, device_ids=ids, broadcast_buffers=False)
        gather = lambda: {n: p.detach().clone() for n, p in plain.named_parameters()}  # noqa: E731
        return Engine(label, model, _trainer(model, model, device), gather, model, dtype)
    if kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        for module in (plain.block, plain.frozen, plain):
            fully_shard(module, mesh=mesh)

        def gather() -> dict[str, torch.Tensor]:
            plain.reshard()
            return {n: p.full_tensor().detach().clone() for n, p in plain.named_parameters()}

        return Engine(label, plain, _trainer(plain, plain, device), gather, plain, dtype)
    if kind.startswith("fsdp1"):
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        orig = kind == "fsdp1-orig"
        model = FSDP(plain, auto_wrap_policy=ModuleWrapPolicy({Block, Frozen}), use_orig_params=orig, device_id=device)

        def gather() -> dict[str, torch.Tensor]:
            with FSDP.summon_full_params(model, writeback=False):
                return {canonical_name(n): p.detach().clone() for n, p in model.named_parameters()}

        return Engine(label, model, _trainer(model, model, device), gather, model, dtype)
    if kind == "zero3":
        import deepspeed

        config = {
            "train_micro_batch_size_per_gpu": 8,
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
            "zero_allow_untested_optimizer": True,
            "bf16": {"enabled": dtype == torch.bfloat16},
        }
        optimizer = torch.optim.SGD(plain.parameters(), lr=0.2, momentum=0.9)
        engine, _, _, _ = deepspeed.initialize(model=plain, optimizer=optimizer, config=config)

        def step(index: int) -> None:
            tokens, targets = (t.to(device) for t in harness.batch(index))
            engine.backward(nn.functional.cross_entropy(engine(tokens).float(), targets))
            engine.step()

        def gather() -> dict[str, torch.Tensor]:
            params = dict(engine.module.named_parameters())
            with deepspeed.zero.GatheredParameters(list(params.values())):
                return {n: p.detach().clone() for n, p in params.items()}

        return Engine(label, engine, step, gather, engine, dtype)
    raise SystemExit(f"unknown engine {kind!r}")


class Reference:
    """``AveragedModel`` with ``get_ema_multi_avg_fn`` over an fp32 plain model on ``device``,
    fed the gathered live weights: the average the averager must equal."""

    def __init__(self, decay: float, device: torch.device) -> None:
        self.device = device
        self.plain = TiedNet().to(device)
        self.average = AveragedModel(self.plain, multi_avg_fn=get_ema_multi_avg_fn(decay))

    def update(self, live: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, param in self.plain.named_parameters():
                param.copy_(live[name].to(self.device, torch.float32))
        self.average.update_parameters(self.plain)

    def state(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().cpu() for n, p in self.average.module.named_parameters()}


def trainable() -> list[str]:
    return [n for n, p in TiedNet().named_parameters() if p.requires_grad]


def check_equal(label: str, got: dict, want: dict, exact: bool) -> None:
    """Rank 0: every trainable parameter's average (``got`` from the averager, on CPU) against ``want``."""
    if dist.get_rank() != 0:
        return
    for name in trainable():
        value, expected = got[name], want[name]
        assert value.device.type == "cpu" and value.dtype == torch.float32, (label, name, value.device, value.dtype)
        if exact:
            assert torch.equal(value, expected), f"{label}: {name} differs by {(value - expected).abs().max()}"
        else:
            message = lambda m, n=name: f"{label}: {n}: {m}"  # noqa: E731
            torch.testing.assert_close(value, expected, rtol=1e-5, atol=1e-6, msg=message)
    assert torch.equal(got["head.weight"], got["embed.weight"]), f"{label}: the tied weights differ"


def checked_on(averager: WeightAverager, on_device: bool | None) -> WeightAverager:
    """``averager`` with its non-finite check kept on the device (the verdict read later), read on
    the host, or (None) as built."""
    averager.updater.on_device = on_device
    return averager


def averagers(engine: Engine, device: torch.device) -> dict[str, tuple[WeightAverager, Reference]]:
    host = torch.device("cpu")
    return {
        "ema": (WeightAverager(engine.model, EMA(decay=DECAY)), Reference(DECAY, device)),
        "ema_host": (checked_on(WeightAverager(engine.model, EMA(decay=DECAY)), False), Reference(DECAY, device)),
        "ema_deferred": (checked_on(WeightAverager(engine.model, EMA(decay=DECAY)), True), Reference(DECAY, device)),
        "ema_off": (WeightAverager(engine.model, EMA(decay=DECAY), on_nonfinite="off"), Reference(DECAY, device)),
        "ema_cpu": (WeightAverager(engine.model, EMA(decay=DECAY), device="cpu"), Reference(DECAY, host)),
        "ema_background": (WeightAverager(engine.model, EMA(decay=DECAY), background=True), Reference(DECAY, device)),
        "ema_cpu_background": (
            WeightAverager(engine.model, EMA(decay=DECAY), device="cpu", background=True),
            Reference(DECAY, host),
        ),
        "fn": (WeightAverager(engine.model, get_ema_multi_avg_fn(0.8)), Reference(0.8, device)),
    }


def no_sync(device: torch.device):
    """A block in which a device sync raises (CUDA); nothing on the CPU."""

    @contextlib.contextmanager
    def mode():
        if device.type != "cuda":
            yield
            return
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")

    return mode()


SYNC_FREE = ("ema", "ema_deferred", "ema_off")  # on CUDA: update() never waits for the GPU


def check_training(engine: Engine, device: torch.device) -> WeightAverager:
    """Every averager of ``averagers`` against its reference after ``STEPS`` steps; the device
    path taken and free of syncs where it should be. Returns the ``ema`` averager."""
    built = averagers(engine, device)
    exact = engine.dtype == torch.float32
    for step in range(1, STEPS + 1):
        engine.step(step)
        live = engine.gather_live()
        for label, (averager, reference) in built.items():
            reference.update(live)
            if label in SYNC_FREE and step > 3:  # (the first updates build the device's tables)
                with no_sync(device):
                    averager.update()
            else:
                averager.update()
    deferred = {"ema_deferred"} | ({"ema", "ema_background"} if device.type == "cuda" else set())
    for label, (averager, reference) in built.items():
        on_device = averager.updater.check_on_device()
        assert on_device == (label in deferred), f"{engine.name}/{label}: check on the device: {on_device}"
        assert averager.num_updates == STEPS, (engine.name, label, averager.num_updates)
        check_equal(f"{engine.name}/{label}", averager.full_state_dict(), reference.state(), exact)
    offloaded = built["ema_cpu"][0]
    shadows = [s for s in offloaded.shadows() if s is not None]
    assert all(s.device.type == "cpu" for s in shadows), f"{engine.name}: ema_cpu shadows left the host"
    if device.type == "cuda":
        assert all(s.is_pinned() for s in shadows), f"{engine.name}: offloaded shadows are not pinned"
        assert offloaded.updater.stager._streams, f"{engine.name}: the staging did not use a side stream"
    harness.report("TRAINED", {"engine": engine.name, "averagers": sorted(built)})
    return built["ema"][0]


def local_view(averager: WeightAverager) -> tuple[torch.Tensor, str]:
    """A floating live shard this rank holds a part of, and its tensor's name."""
    for view, info in zip(averager.strategy.local_shards(), averager.tensors):
        if view.is_floating_point() and view.numel() and info.requires_grad:
            return view, info.name
    raise AssertionError("no floating live shard on this rank")


def check_nonfinite(engine: Engine, device: torch.device, step: int) -> None:
    """A NaN in a live shard, under each policy and either check: the host check refuses it in the
    update; the deferred one (no sync in the update) masks it on the device and reports it at the
    next read. Either names the tensor and the step, and ``skip`` leaves the average as it was."""
    for policy in ("skip", "raise"):
        for on_device in (False, True, None):  # (None: as built, on the device on CUDA)
            averager = checked_on(WeightAverager(engine.model, EMA(decay=DECAY), on_nonfinite=policy), on_device)
            check_one_nonfinite(engine, averager, device, step, policy)


def check_one_nonfinite(engine: Engine, averager: WeightAverager, device: torch.device, step: int, policy: str) -> None:
    for offset in range(3):
        averager.update(step + offset)
    before = averager.full_state_dict()
    view, name = local_view(averager)
    saved = view.detach().clone()
    deferred = averager.updater.check_on_device()

    def poisoned_update() -> int:
        with torch.no_grad():
            view.view(-1)[0] = float("nan")
        if device.type == "cuda" and deferred:  # the device busy for a while: the verdict cannot be ready
            torch.cuda._sleep(200_000_000)
        try:
            with no_sync(device) if deferred else contextlib.nullcontext():
                averager.update(step + 3)
        finally:
            with torch.no_grad():
                view.copy_(saved)
        if device.type == "cuda" and deferred:
            assert averager.updater.pending, f"{engine.name}: the update waited for its verdict"
        return averager.num_updates  # (the read that settles a deferred verdict)

    if policy == "raise":
        with expect_raises(shardavg.NonFiniteError, name, f"step {step + 3}"):
            poisoned_update()
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert poisoned_update() == 3 and averager.num_skipped == 1
    messages = [str(w.message) for w in caught]
    assert any(name in m and f"step {step + 3}" in m for m in messages), messages
    after = averager.full_state_dict()
    if dist.get_rank() == 0:
        assert all(torch.equal(after[n], before[n]) for n in before), f"{engine.name}: a skipped update moved"


def check_round_trips(engine: Engine, averager: WeightAverager, out: Path) -> None:
    """export, save/load and DCP give the average back bitwise."""
    from safetensors.torch import load_file

    full = averager.full_state_dict()
    folder = averager.export(out / f"export-{engine.name}")
    if dist.get_rank() == 0:
        exported = {}
        for file in sorted(folder.glob("*.safetensors")):
            exported |= load_file(str(file))
        for name in trainable():
            assert torch.equal(exported[name], full[name]), f"{engine.name}: export of {name} differs"
    averager.save(out / f"save-{engine.name}")
    loaded = WeightAverager(engine.model, EMA(decay=DECAY))
    loaded.load(out / f"save-{engine.name}")
    again = loaded.full_state_dict()
    if dist.get_rank() == 0:
        assert all(torch.equal(again[n], full[n]) for n in trainable()), f"{engine.name}: save/load differs"
    dcp.save({"ema": averager}, checkpoint_id=str(out / f"dcp-{engine.name}"))
    restored = WeightAverager(engine.model, EMA(decay=DECAY))
    dcp.load({"ema": restored}, checkpoint_id=str(out / f"dcp-{engine.name}"))
    again = restored.full_state_dict()
    assert restored.num_updates == averager.num_updates
    if dist.get_rank() == 0:
        assert all(torch.equal(again[n], full[n]) for n in trainable()), f"{engine.name}: DCP round trip differs"


def check_swapped(engine: Engine, averager: WeightAverager, device: torch.device) -> None:
    """Inside swapped() the forward is the average's; afterwards the live weights are back bit for bit."""
    full = [averager.full_state_dict()]
    tokens = harness.probe_tokens().to(device)
    before = engine.gather_live()
    if hasattr(engine.model, "eval"):
        engine.model.eval()
    with torch.no_grad(), averager.swapped():
        out = engine.forward(tokens)
    if dist.get_rank() == 0:  # (each rank keeps its own BatchNorm statistics; the export has rank 0's)
        reference = TiedNet()
        reference.load_state_dict(full[0])
        want = reference.to(device, engine.dtype).eval()(tokens)
        tolerance = {"rtol": 1e-5, "atol": 1e-5} if engine.dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
        torch.testing.assert_close(out, want, **tolerance, msg=lambda m: f"{engine.name}: swapped forward: {m}")
    after = engine.gather_live()
    assert all(torch.equal(before[n], after[n]) for n in before), f"{engine.name}: live weights not restored"
    if hasattr(engine.model, "train"):
        engine.model.train()


def configurations(kind: str) -> list[tuple[str, torch.dtype]]:
    if kind == "fsdp1":
        return [("fsdp1-orig", torch.float32), ("fsdp1-flat", torch.float32), ("fsdp1-orig", torch.bfloat16)]
    return [(kind, torch.float32), (kind, torch.bfloat16)]


@record
def main() -> None:
    device_type, kinds, out = sys.argv[1], sys.argv[2].split(","), Path(sys.argv[3])
    if device_type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        if "zero3" in kinds:
            import deepspeed

            deepspeed.init_distributed(dist_backend="nccl")
        else:
            dist.init_process_group("cpu:gloo,cuda:nccl")
    else:
        device = torch.device("cpu")
        harness.init_distributed(deepspeed="zero3" in kinds)
    for kind in kinds:
        for name, dtype in configurations(kind):
            engine = build(name, dtype, device)
            averager = check_training(engine, device)
            check_nonfinite(engine, device, step=STEPS + 1)
            check_round_trips(engine, averager, out)
            check_swapped(engine, averager, device)
            harness.report("DONE", {"engine": engine.name, "device": device.type, "world_size": dist.get_world_size()})
    harness.finish()


if __name__ == "__main__":
    main()
