"""Issue 47 on a GPU: ``update(finite=norm)`` with the loop's gradient norm as a CUDA tensor never makes
the host wait (with a verdict, without one, and in the background); a false verdict on the device
leaves the average as it was and is counted skipped once read; the Triton kernel's first-use
self-check is reported (passed, or the warning it gave); and the device path's masked update in
ATen (where the kernel does not run, or after it failed) is bitwise the host path's for every live
and average dtype pair, as tests/test_masked_dtypes.py shows on the CPU.

The self-check's result is printed (``-s`` or ``-rA`` shows it) and, where ``SHARDAVG_GPU_REPORT``
names a file, appended to it as one JSON line, for the session that records the GPU's figures."""

from __future__ import annotations

import itertools
import json
import os
import warnings
from collections.abc import Iterator

import pytest
import torch
from conftest import no_sync
from torch import nn

from shardavg import EMA, SWA, WeightAverager
from shardavg.update import kernels
from shardavg.update.updater import Updater

DECAY, WIDTH = 0.9, 256
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
PAIRS = list(itertools.product(DTYPES, DTYPES))
PAIR_IDS = [f"{NAMES[live]}-into-{NAMES[average]}" for live, average in PAIRS]


class Net(nn.Module):
    """Large shards (fused pieces), small ones apart in memory (gathered) and a 0-d scalar."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, 16 * WIDTH)
        self.down = nn.Linear(16 * WIDTH, WIDTH)
        self.norms = nn.ModuleList(nn.LayerNorm(WIDTH) for _ in range(12))
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        h = inputs + self.down(torch.relu(self.up(inputs)))
        for norm in self.norms:
            h = norm(h)
        return h * self.scale


class Loop:
    """Real optimizer steps on the GPU that clip with ``clip_grad_norm_`` and keep the norm it
    returned (a CUDA tensor, never read), and an fp32 EMA of the live weights after each step the
    averager takes in (``get_ema_multi_avg_fn``'s lerp, on the same device)."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = Net().to("cuda")
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)
        self.reference: list[torch.Tensor] | None = None
        self.steps = 0
        self.norm = torch.zeros((), device="cuda")

    def step(self) -> None:
        self.steps += 1
        generator = torch.Generator().manual_seed(self.steps)
        inputs = torch.randn(32, WIDTH, generator=generator).to("cuda")
        loss = self.model(inputs).float().pow(2).mean()
        self.optimizer.zero_grad()
        loss.backward()
        self.norm = nn.utils.clip_grad_norm_(self.model.parameters(), max_norm=1.0)
        self.optimizer.step()

    def averaged(self) -> None:
        """The step just taken entered the average: the reference takes it too."""
        live = [p.detach().float() for p in self.model.parameters()]
        if self.reference is None:
            self.reference = [t.clone() for t in live]
        else:
            torch._foreach_lerp_(self.reference, live, 1 - DECAY)

    def assert_average(self, averager: WeightAverager) -> None:
        got = averager.full_state_dict()
        for (name, _), want in zip(self.model.named_parameters(), self.reference or []):
            assert torch.equal(got[name], want.cpu()), f"{name}: differs by {(got[name] - want.cpu()).abs().max()}"


@pytest.fixture
def report() -> Iterator[dict]:
    """A record of what a test found on this GPU: printed, and appended to ``$SHARDAVG_GPU_REPORT``."""
    record = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    yield record
    print(f"\nGPU REPORT {json.dumps(record)}")
    if os.environ.get("SHARDAVG_GPU_REPORT"):
        with open(os.environ["SHARDAVG_GPU_REPORT"], "a") as handle:
            handle.write(json.dumps(record) + "\n")


def test_the_kernels_self_check_result_is_reported(report: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """``kernels.usable`` runs the self-check at its first call on the device: its answer, and the
    warning it gave if it failed (the device, the Triton version, the error), are the record."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv(kernels.SWITCH, raising=False)
    kernels.reset()
    try:
        import triton

        report["triton"] = triton.__version__
    except Exception as error:
        report["triton"] = f"not importable ({error})"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        usable = kernels.usable(torch.device("cuda"))
    said = [str(w.message) for w in caught if "Triton kernel" in str(w.message)]
    report.update(test="kernel self-check", usable=usable, warning=said[0] if said else None)
    kernels.reset()
    assert usable, f"the kernel's self-check failed on {report['device']}: {said or 'no warning given'}"
    assert not said, said


@pytest.mark.usefixtures("compiled_kernels")
@pytest.mark.parametrize("background", [False, True], ids=["loop", "background"])
@pytest.mark.parametrize("verdict", [False, True], ids=["screened", "verdict"])
def test_an_update_with_the_norm_on_the_gpu_never_waits(verdict: bool, background: bool) -> None:
    """Under ``set_sync_debug_mode("error")`` the update (and, in the background, its collection by
    ``wait()``) raises at any host sync: with the norm as the verdict (the screen does not run:
    the pending verdict holds no screen), and without one (the screen on the device)."""
    loop = Loop()
    averager = WeightAverager(loop.model, EMA(decay=DECAY), background=background)
    for _ in range(3):  # (the first update copies, on the host; the device's tables are built)
        loop.step()
        averager.update(finite=loop.norm if verdict else None)
        averager.wait()
        loop.averaged()
    assert averager.num_updates == 3  # (reads the pending verdicts)
    for _ in range(5):
        loop.step()
        with no_sync():
            assert averager.update(finite=loop.norm if verdict else None) is True
            averager.wait()  # (in the background: the thread joined, the loop's stream behind its event)
        issued = averager.updater.pending[-1]
        assert (issued.screened is None) == verdict, "the screen ran despite the verdict, or not without one"
        assert (issued.given is not None) == verdict, "the norm did not reach the device path"
        loop.averaged()
    assert averager.updater.check_on_device(), "the check is read on the host: update() waits for the GPU"
    assert (averager.num_updates, averager.num_skipped) == (8, 0)
    loop.assert_average(averager)


@pytest.mark.usefixtures("compiled_kernels")
@pytest.mark.parametrize("kind", ["skipped-step", "nan-norm"])
def test_a_false_verdict_on_the_gpu_skips_and_is_counted_once_read(kind: str) -> None:
    """A step the loop's scaler skipped (a False 0-d bool on the device) or a NaN norm: the update
    is issued, masked on the device (the average as it was), and counted skipped, with a warning
    naming the step, when the host reads its verdict; the steps after it are averaged."""
    loop = Loop()
    averager = WeightAverager(loop.model, EMA(decay=DECAY))
    for _ in range(3):
        loop.step()
        averager.update(finite=loop.norm)
        loop.averaged()
    assert averager.num_updates == 3
    before = [shadow.clone() for shadow in averager.shadows() if shadow is not None]
    if kind == "skipped-step":  # (what a GradScaler's skip says: the weights did not move)
        finite = torch.zeros((), dtype=torch.bool, device="cuda")
    else:
        finite = torch.full((), float("nan"), device="cuda")
    torch.cuda._sleep(1_000_000_000)  # the GPU busy ~0.5 s: the verdict cannot be on the host yet
    with warnings.catch_warnings(), no_sync():
        warnings.simplefilter("error", RuntimeWarning)  # the call itself neither waits nor warns
        assert averager.update(finite=finite) is True  # (issued: skipped or not, the device knows)
    assert averager.updater.pending, "the update read its verdict: it waited for the GPU"
    torch.cuda.synchronize()
    after = [shadow for shadow in averager.shadows() if shadow is not None]  # (reads no verdict)
    assert all(torch.equal(new, old) for new, old in zip(after, before)), "the masked update moved the average"
    with pytest.warns(RuntimeWarning, match=r"skipped the update at step 4 on rank 0: the loop's verdict was false"):
        assert averager.num_skipped == 1
    assert averager.num_updates == 3
    for _ in range(2):
        loop.step()
        averager.update(finite=loop.norm)
        loop.averaged()
    assert (averager.num_updates, averager.num_skipped, averager.step) == (5, 1, 6)
    loop.assert_average(averager)


def paired(model: nn.Module, dtype: torch.dtype, path: str) -> WeightAverager:
    """An EMA (weight 0.1) and an SWA (1/2, 1/3, ...: both of ATen's lerp forms) into ``dtype``:
    ``host`` checked on the host in ATen, ``aten`` the device path's ATen masked update forced,
    ``kernel`` the Triton kernel's, as CUDA chooses by default."""
    with pytest.MonkeyPatch.context() as patch, warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # (an average below its live dtype says so)
        if path != "kernel":
            patch.setattr(Updater, "kernel_devices", frozenset())
        built = WeightAverager(model, {"ema": EMA(decay=DECAY), "swa": SWA()}, dtype=dtype)
    built.updater.on_device = {"host": False, "aten": True, "kernel": None}[path]
    return built


def assert_paths_agree(live_dtype: torch.dtype, average_dtype: torch.dtype, path: str) -> None:
    torch.manual_seed(0)
    model = Net().to("cuda", live_dtype)
    on_host, on_device = paired(model, average_dtype, "host"), paired(model, average_dtype, path)
    if path == "kernel":
        assert all(group.kernel for group in on_device.updater.groups), "the kernel is not in use: vacuous"
    generator = torch.Generator().manual_seed(1)
    for update in range(1, 7):
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_((torch.randn(parameter.shape, generator=generator) * 0.7).to("cuda", live_dtype))
        on_host.update()
        on_device.update()
        if update > 1:
            assert on_device.updater.pending, "the update did not take the device path: vacuous"
    assert on_device.num_updates == on_host.num_updates == 6
    for name in ("ema", "swa"):
        want, got = on_host.full_state_dict(name), on_device.full_state_dict(name)
        for key in want:
            assert torch.equal(got[key], want[key]), f"{name}: {key}"


@pytest.mark.parametrize(("live_dtype", "average_dtype"), PAIRS, ids=PAIR_IDS)
def test_the_masked_aten_update_on_cuda_is_the_host_update_bitwise(
    live_dtype: torch.dtype, average_dtype: torch.dtype
) -> None:
    """CUDA's lerp of a bf16/fp16 tensor by a Python float runs in fp32 and rounds once, as its
    fp32 lerp by a tensor weight then a cast does: ``fused._masked_lerp`` relies on that."""
    assert_paths_agree(live_dtype, average_dtype, "aten")


@pytest.mark.usefixtures("compiled_kernels")
@pytest.mark.parametrize(("live_dtype", "average_dtype"), PAIRS, ids=PAIR_IDS)
def test_the_kernel_update_on_cuda_is_the_host_update_bitwise(
    live_dtype: torch.dtype, average_dtype: torch.dtype
) -> None:
    assert_paths_agree(live_dtype, average_dtype, "kernel")
