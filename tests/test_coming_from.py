"""docs/coming-from.md runs as written: every block marked ``<!-- run: NAME -->`` runs, in page order,
in one namespace after the page's prelude (on the CPU, one process), and where the page says the
run is a peer's and the peer runs here (torch's ``AveragedModel`` and ``update_bn``, Lightning's
``EMAWeightAveraging``), the peer's version of the same run is run and the averages compared. The
blocks marked ``<!-- theirs -->`` are not run (most peers are not installed) but must parse."""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path
from typing import Any

import pytest
import torch

PAGE = Path(__file__).resolve().parents[1] / "docs" / "coming-from.md"
BLOCK = re.compile(r"<!-- (run: (?P<name>[\w-]+)|theirs) -->\n```python\n(?P<code>.*?)\n```", re.S)
NEEDS_LIGHTNING = {"lightning", "nemo"}
HAS_LIGHTNING = importlib.util.find_spec("lightning") is not None


def blocks() -> list[tuple[str | None, str]]:
    return [(found["name"], found["code"]) for found in BLOCK.finditer(PAGE.read_text())]


RUN = [(name, code) for name, code in blocks() if name is not None]


def test_every_python_block_is_marked_and_parses() -> None:
    text = PAGE.read_text()
    assert text.count("```python") == len(blocks()), "a ```python block without <!-- run: NAME --> or <!-- theirs -->"
    names = [name for name, _ in RUN]
    assert names[0] == "prelude" and len(set(names)) == len(names)
    for _, code in blocks():
        ast.parse(code)  # theirs too: a snippet that cannot parse is a typo


@pytest.fixture(scope="module")
def page() -> dict[str, Any]:
    namespace: dict[str, Any] = {"__name__": "coming_from"}
    exec(compile(RUN[0][1], f"{PAGE.name}:prelude", "exec"), namespace)
    namespace["_ran"] = {}
    return namespace


def same(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor], exact: bool = True, **tol: float) -> None:
    assert ours.keys() == theirs.keys()
    for name in ours:
        a, b = ours[name], theirs[name].to(ours[name].dtype)
        if exact:
            assert torch.equal(a, b), name
        else:
            torch.testing.assert_close(a, b, **tol, msg=name)


def fresh(ns: dict[str, Any]):
    model = ns["make_model"]()
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def check_torch_ema(ns: dict[str, Any]) -> None:
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    model, optimizer = fresh(ns)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    for batch in ns["loader"]:
        ns["train_step"](model, optimizer, batch)
        ema.update_parameters(model)
    same(ns["avg"].full_state_dict(), ema.module.state_dict())
    assert ns["loss"] == ns["evaluate"](ema)


def check_torch_avg_fn(ns: dict[str, Any]) -> None:
    from torch.optim.swa_utils import AveragedModel, get_ema_avg_fn

    model, optimizer = fresh(ns)
    ema = AveragedModel(model, avg_fn=get_ema_avg_fn(0.9))
    for batch in ns["loader"]:
        ns["train_step"](model, optimizer, batch)
        ema.update_parameters(model)
    same(ns["avg"].full_state_dict(), ema.module.state_dict())


def check_torch_swa(ns: dict[str, Any]) -> None:
    from torch.optim.swa_utils import SWALR, AveragedModel, update_bn

    model, optimizer = fresh(ns)
    swa_model = AveragedModel(model)
    swa_scheduler = SWALR(optimizer, swa_lr=0.05)
    for epoch in range(4):
        for batch in ns["loader"]:
            ns["train_step"](model, optimizer, batch)
        if epoch >= 1:
            swa_model.update_parameters(model)
            swa_scheduler.step()
    update_bn(ns["loader"], swa_model)
    # SWA() is the running mean through shardavg's lerp: torch's own formula to rounding (its
    # get_swa_multi_avg_fn as the rule is bitwise), BatchNorm statistics computed under it included
    same(ns["state"], swa_model.module.state_dict(), exact=False, rtol=1e-5, atol=1e-6)


def check_construction_copy(ns: dict[str, Any]) -> None:
    """timm's ``update(model)`` without a step, NeMo's and torchtitan's fixed decay: a copy at
    construction, then ``lerp(1 - decay)`` at every update (written from their sources)."""
    model, optimizer = fresh(ns)
    reference = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    for batch in ns["loader"]:
        ns["train_step"](model, optimizer, batch)
        for name, param in model.named_parameters():
            reference[name].lerp_(param.detach(), 0.1)
    ours, names = ns["avg"].full_state_dict(), [name for name, _ in model.named_parameters()]
    same({n: ours[n] for n in names}, {n: reference[n] for n in names})  # bitwise: the same lerp


def timm_decay(step: int, decay: float, gamma: float, power: float, min_decay: float) -> float:
    """timm's ``ModelEmaV3.get_decay(step)`` (update_after_step 0, use_warmup), from its source."""
    step = max(0, step - 0 - 1)
    if step <= 0:
        return 0.0
    return max(min(1 - (1 + step / gamma) ** -power, decay), min_decay)


def check_timm(ns: dict[str, Any]) -> None:
    """timm lerps every floating tensor of the state dict (buffers included), copies the rest."""
    model, optimizer = fresh(ns)
    reference = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    for step, batch in enumerate(ns["loader"], start=1):
        ns["train_step"](model, optimizer, batch)
        weight = 1.0 - timm_decay(step, 0.99, 1.0, 3 / 4, 0.5)
        for name, tensor in model.state_dict().items():
            if tensor.is_floating_point():
                reference[name].lerp_(tensor, weight)
            else:
                reference[name].copy_(tensor)
    same(ns["avg"].full_state_dict(), reference)  # bitwise: the same decays, the same lerp


def check_torchtitan(ns: dict[str, Any]) -> None:
    """torchtitan's ``EMAOptimizersContainer.step`` (from its source): a copy of the trainable
    parameters at construction, lerped at ``1 - 2 ** (-1 / (f * num_updates))``. The first update
    copies here where theirs lerps at 2 ** -20: the averages agree to that."""
    model, optimizer = fresh(ns)
    reference = {name: p.detach().clone() for name, p in model.named_parameters()}
    for step, batch in enumerate(ns["loader"], start=1):
        ns["train_step"](model, optimizer, batch)
        decay = 2.0 ** (-1.0 / (0.05 * max(step, 1)))
        for name, param in model.named_parameters():
            reference[name].lerp_(param.detach(), 1.0 - decay)
    ours = ns["avg"].full_state_dict()
    same({name: ours[name] for name in reference}, reference, exact=False, rtol=0, atol=1e-6)


def check_lightning(ns: dict[str, Any]) -> None:
    """Lightning's own callback on the same training: the floating tensors of the model after
    ``fit`` (both copy the average in at the end) agree to rounding (theirs computes
    ``d * a + (1 - d) * x``, a lerp here); ``num_batches_tracked`` is copied here."""
    import lightning as L
    from lightning.pytorch.callbacks import EMAWeightAveraging

    theirs = ns["Module"]()
    trainer = L.Trainer(max_steps=6, callbacks=[EMAWeightAveraging(decay=0.9, update_starting_at_step=2)],
                        accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)  # fmt: skip
    trainer.fit(theirs, ns["loader"])
    ours, reference = ns["module"].state_dict(), theirs.state_dict()
    floating = [name for name, tensor in ours.items() if tensor.is_floating_point()]
    same({n: ours[n] for n in floating}, {n: reference[n] for n in floating}, exact=False, rtol=1e-6, atol=1e-7)
    assert ns["averaging"].averager.num_updates == 4  # steps 2, 3, 4, 5 (counted from 0)


def check_nemo(ns: dict[str, Any]) -> None:
    assert ns["averaging"].averager.num_updates == 3  # NeMo's every_n_steps=2: steps 0, 2, 4


def check_ema_pytorch(ns: dict[str, Any]) -> None:
    assert ns["avg"].num_updates == 3  # steps 4, 6, 8
    assert ns["avg"].options.exclude == ("3.bias",)


CHECKS = {
    "torch-ema": check_torch_ema,
    "torch-avg-fn": check_torch_avg_fn,
    "torch-swa": check_torch_swa,
    "construction-copy": check_construction_copy,
    "lightning": check_lightning,
    "ema-pytorch": check_ema_pytorch,
    "timm": check_timm,
    "nemo": check_nemo,
    "torchtitan": check_torchtitan,
}


@pytest.mark.parametrize("name", [name for name, _ in RUN[1:]])
def test_the_block_runs_and_agrees_with_the_peer(page: dict[str, Any], name: str) -> None:
    if name in NEEDS_LIGHTNING and not HAS_LIGHTNING:
        pytest.skip("lightning is not installed (the [lightning] extra)")
    if name == "nemo" and "lightning" not in page["_ran"]:
        pytest.skip("the NeMo block uses the Lightning block's Module")
    code = dict(RUN)[name]
    torch.manual_seed(0)
    exec(compile(code, f"{PAGE.name}:{name}", "exec"), page)
    page["_ran"][name] = True
    if name in CHECKS:
        CHECKS[name](page)
