"""Single-process tests share the scenarios' test model (tests_distributed/harness.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests_distributed"))

from harness import TiedNet  # noqa: E402


@pytest.fixture
def model() -> TiedNet:
    torch.manual_seed(0)
    return TiedNet()


class Trainer:
    """Real optimizer steps on random tokens for a model."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.2, momentum=0.9)
        self.steps = 0

    def step(self) -> None:
        self.steps += 1
        generator = torch.Generator().manual_seed(self.steps)
        tokens = torch.randint(0, 11, (8, 5), generator=generator)
        targets = torch.randint(0, 11, (8,), generator=generator)
        loss = torch.nn.functional.cross_entropy(self.model(tokens).float(), targets)
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()


@pytest.fixture
def trainer(model: TiedNet) -> Trainer:
    return Trainer(model)


@pytest.fixture
def tokens() -> torch.Tensor:
    return torch.randint(0, 11, (4, 5), generator=torch.Generator().manual_seed(7))
