"""``WeightAverager.update()`` on CUDA never makes the host wait for the GPU: the non-finite check's
verdict stays on the device, the update is skipped there on it, and a NaN is reported at the next
call, raised or warned as ``on_nonfinite`` says. One process, a plain module (no process group)."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import no_sync
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from shardavg import EMA, NonFiniteError, WeightAverager

pytestmark = pytest.mark.usefixtures("compiled_kernels")

DECAY, VOCAB, WIDTH = 0.999, 64, 256
DTYPES = [torch.float32, torch.bfloat16]


class Net(nn.Module):
    """Large shards (cut into fused pieces), small ones lying apart (gathered: the LayerNorms),
    BatchNorm buffers (an integer one among them) and a tied embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.up = nn.Linear(WIDTH, 16 * WIDTH)  # 1M weights: over one fused piece with the bias's neighbours
        self.norm = nn.BatchNorm1d(16 * WIDTH)
        self.down = nn.Linear(16 * WIDTH, WIDTH)
        self.norms = nn.ModuleList(nn.LayerNorm(WIDTH) for _ in range(12))
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens).mean(1)
        h = h + self.down(torch.relu(self.norm(self.up(h))))
        for norm in self.norms:
            h = norm(h)
        return self.head(h)


class Training:
    """Real optimizer steps on the GPU, and an fp32 ``AveragedModel`` EMA of the same live weights."""

    def __init__(self, dtype: torch.dtype) -> None:
        torch.manual_seed(0)
        self.model = Net().to("cuda", dtype)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)
        self.mirror = Net().to("cuda")  # fp32: the live weights as the reference sees them
        self.reference = AveragedModel(self.mirror, multi_avg_fn=get_ema_multi_avg_fn(DECAY))
        self.steps = 0

    def step(self) -> None:
        self.steps += 1
        generator = torch.Generator().manual_seed(self.steps)
        tokens = torch.randint(0, VOCAB, (32, 5), generator=generator).to("cuda")
        targets = torch.randint(0, VOCAB, (32,), generator=generator).to("cuda")
        loss = nn.functional.cross_entropy(self.model(tokens).float(), targets)
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        with torch.no_grad():
            for mirrored, live in zip(self.mirror.parameters(), self.model.parameters()):
                mirrored.copy_(live)
        self.reference.update_parameters(self.mirror)


def warmed_up(training: Training, averager: WeightAverager) -> None:
    """Three steps and updates (the first copies, on the host), every verdict read since."""
    for _ in range(3):
        training.step()
        averager.update()
    assert averager.num_updates == 3  # (reads the pending verdicts)
    assert averager.updater.check_on_device(), "the non-finite check is read on the host: update() waits for the GPU"


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_the_update_never_waits_for_the_gpu_and_matches_the_reference(dtype: torch.dtype) -> None:
    training = Training(dtype)
    averager = WeightAverager(training.model, EMA(decay=DECAY))
    warmed_up(training, averager)
    for _ in range(5):
        training.step()
        with no_sync():
            averager.update()
    assert (averager.num_updates, averager.num_skipped) == (8, 0)
    got = averager.full_state_dict()
    for name, param in training.reference.module.named_parameters():
        value, want = got[name], param.detach().cpu()
        assert value.dtype == torch.float32, (name, value.dtype)
        if dtype == torch.float32:  # bitwise, as AveragedModel's EMA on the same device
            assert torch.equal(value, want), f"{name}: differs by {(value - want).abs().max()}"
        else:  # within fp32 rounding
            torch.testing.assert_close(value, want, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
@pytest.mark.parametrize("policy", ["raise", "skip"])
def test_a_nan_is_masked_on_the_gpu_and_reported_at_the_next_call(policy: str, dtype: torch.dtype) -> None:
    training = Training(dtype)
    averager = WeightAverager(training.model, EMA(decay=DECAY), on_nonfinite=policy)
    warmed_up(training, averager)
    before = [shadow.clone() for shadow in averager.shadows() if shadow is not None]
    training.step()
    weight = training.model.up.weight
    saved = weight.detach()[0, 0].clone()
    with torch.no_grad():
        weight[0, 0] = float("nan")
    torch.cuda._sleep(1_000_000_000)  # the GPU busy ~0.5 s: the verdict cannot be ready when update() returns
    with warnings.catch_warnings(), no_sync():
        warnings.simplefilter("error", RuntimeWarning)  # the update itself neither raises nor warns
        averager.update()
    assert averager.updater.pending, "the update read its verdict: it waited for the GPU"
    torch.cuda.synchronize()
    after = [shadow for shadow in averager.shadows() if shadow is not None]  # (reads no verdict)
    assert all(torch.equal(new, old) for new, old in zip(after, before)), "the masked update moved the average"
    with torch.no_grad():
        weight[0, 0] = saved
    training.step()
    if policy == "raise":
        with pytest.raises(NonFiniteError) as raised:
            averager.update()
        assert "'up.weight'" in str(raised.value) and "step 4" in str(raised.value), raised.value
        assert averager.num_updates == 3
    else:
        with pytest.warns(RuntimeWarning) as warned:
            averager.update()
        messages = [str(w.message) for w in warned]
        assert any("'up.weight'" in m and "step 4" in m for m in messages), messages
        assert (averager.num_updates, averager.num_skipped) == (4, 1)
