"""Run a documentation snippet as a user would, under torchrun, so the docs cannot drift from the code.

    torchrun --standalone --nproc_per_node 2 tests_distributed/scenario_snippets.py NAME ROOT

The snippet after ``<!-- snippet: NAME -->`` in docs/integrations/NAME.md runs in ROOT with what a user brings:
``model``, ``optimizer``, ``loader``, ``compute_loss`` (and ``ds_config`` for ``deepspeed``).
Afterwards its average must hold one update per optimizer step and its checkpoint be complete.

``readme`` is the README's usage block (between its ``[start:usage]`` and ``[end:usage]`` markers),
run on a model sharded with FSDP2 whose output has a ``.loss``, as a Hugging Face model's does; its
``model = ...`` line stands for that model. It must leave its export, its ``avg.save`` checkpoint
and its DCP checkpoint.
"""

from __future__ import annotations

import os
import re
import sys
from collections import namedtuple
from pathlib import Path

import harness
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record

DOCS = Path(__file__).resolve().parents[1] / "docs" / "integrations"
README = Path(__file__).resolve().parents[1] / "README.md"
STEPS = 8  # batches each rank sees
Output = namedtuple("Output", "loss")  # a model output with a .loss (a pytree, so FSDP2 sees the tensor)


def snippet(name: str) -> str:
    if name == "readme":
        match = re.search(r"\[start:usage\] -->\s*```python\n(.*?)```", README.read_text(), re.DOTALL)
        assert match, "README.md has no usage block between <!-- --8<-- [start:usage] --> and [end:usage]"
        code, placeholders = re.subn(r"^model = \.\.\..*$", "", match.group(1), flags=re.MULTILINE)
        assert placeholders == 1, "the README's usage block no longer starts from `model = ...`"
        return code
    match = re.search(rf"<!-- snippet: {name} -->\s*```python\n(.*?)```", (DOCS / f"{name}.md").read_text(), re.DOTALL)
    assert match, f"docs/integrations/{name}.md has no snippet {name!r}"
    return match.group(1)


def user_parts(name: str) -> dict:
    torch.manual_seed(0)
    model = harness.TiedNet()
    # accelerate shards the loader it prepares over the ranks; DeepSpeed's users give each rank its own
    ranks = int(os.environ["WORLD_SIZE"]) if name == "accelerate" else 1
    generator = torch.Generator().manual_seed(0 if name == "accelerate" else int(os.environ["RANK"]))
    samples = 8 * STEPS * ranks
    data = torch.utils.data.TensorDataset(
        torch.randint(0, harness.VOCAB, (samples, 5), generator=generator),
        torch.randint(0, harness.VOCAB, (samples,), generator=generator),
    )
    parts = {
        "model": model,
        "optimizer": torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1),
        "loader": torch.utils.data.DataLoader(data, batch_size=8),
        "compute_loss": lambda m, batch: nn.functional.cross_entropy(m(batch[0]).float(), batch[1]),
    }
    if name == "transformers":
        from scenario_hf_trainer import Tokens, tiny_gpt2
        from transformers import TrainingArguments

        parts = {
            "model": tiny_gpt2(),
            "args": TrainingArguments(
                output_dir="out",
                per_device_train_batch_size=4,
                max_steps=STEPS,
                save_steps=4,
                eval_strategy="steps",
                eval_steps=4,
                report_to=[],
                use_cpu=True,
                disable_tqdm=True,
            ),  # fmt: skip
            "train_dataset": Tokens(64, 1),
            "eval_dataset": Tokens(8, 2),
        }
    if name == "lightning":
        from scenario_lightning import Net, data

        parts = {
            "model": Net(), "train_loader": data(64, 1), "val_loader": data(16, 2), "strategy": "ddp",
            "accelerator": "cpu", "devices": 2, "max_steps": STEPS,
        }  # fmt: skip
    if name == "readme":
        parts = {"model": readme_model(), "loader": parts["loader"]}
        parts["optimizer"] = torch.optim.SGD([p for p in parts["model"].parameters() if p.requires_grad], lr=0.1)
        parts["evaluate"] = evaluate
    if name == "deepspeed":
        parts["model"] = model.to(torch.bfloat16)
        parts["ds_config"] = {
            "train_micro_batch_size_per_gpu": 8,
            "zero_optimization": {"stage": 3},
            "zero_allow_untested_optimizer": True,
            "bf16": {"enabled": True},
        }
    return parts


class WithLoss(nn.Module):
    """The test model, answering ``model(batch).loss`` as the README's loop asks."""

    def __init__(self) -> None:
        super().__init__()
        self.net = harness.TiedNet()

    def forward(self, batch: list[torch.Tensor]) -> Output:
        return Output(nn.functional.cross_entropy(self.net(batch[0]).float(), batch[1]))


def readme_model() -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = WithLoss()
    fully_shard(model.net.block)
    fully_shard(model.net.frozen)
    return fully_shard(model)


def evaluate(model: nn.Module) -> None:
    was_training = model.training
    model.eval()
    with torch.no_grad():
        tokens = torch.randint(0, harness.VOCAB, (8, 5), generator=torch.Generator().manual_seed(1))
        assert torch.isfinite(model([tokens, tokens[:, 0]]).loss)
    model.train(was_training)


@record
def main() -> None:
    name, root = sys.argv[1], Path(sys.argv[2])
    os.chdir(root)
    if name == "deepspeed":
        harness.init_distributed(deepspeed=True)
    if name == "readme":
        harness.init_distributed()
    namespace = user_parts(name)
    where = "README.md usage block" if name == "readme" else f"docs/integrations/{name}.md snippet"
    exec(compile(snippet(name), where, "exec"), namespace)  # noqa: S102
    if name == "transformers":
        trainer = namespace["trainer"]
        (callback,) = [c for c in trainer.callback_handler.callbacks if hasattr(c, "averager")]
        assert callback.averager.num_updates == STEPS, callback.averager.num_updates
        assert any("eval_avg_loss" in entry for entry in trainer.state.log_history), trainer.state.log_history
        assert (root / "out" / f"checkpoint-{STEPS}" / "shardavg" / "shardavg.json").is_file()
        assert (root / "ema-model" / "model.safetensors").is_file()
        harness.report("SNIPPET", {"name": name, "world_size": dist.get_world_size()})
        harness.finish()
    if name == "lightning":
        (callback,) = [c for c in namespace["trainer"].callbacks if hasattr(c, "averager")]
        assert callback.averager.num_updates == STEPS, callback.averager.num_updates
        harness.report("SNIPPET", {"name": name, "world_size": dist.get_world_size()})
        harness.finish()
    avg = namespace["avg"]
    if name == "readme":
        assert avg.strategy.name == "fsdp2" and avg.num_updates == STEPS, (avg.strategy.name, avg.num_updates)
        assert (root / "ema-model" / "model.safetensors").is_file()
        assert [*(root / "ckpt" / "ema").glob("step-*/shardavg.json")], sorted((root / "ckpt" / "ema").iterdir())
        assert (root / "ckpt" / "step-1000" / ".metadata").is_file()
    elif name == "accelerate":
        assert avg.num_updates == STEPS // 2, avg.num_updates  # accumulation 2
        assert (root / "ckpt" / "shardavg" / "shardavg.json").is_file()
    else:
        assert avg.strategy.name == "zero3" and avg.num_updates == STEPS, (avg.strategy.name, avg.num_updates)
        assert (root / "ckpt" / "latest").read_text() == f"global_step{STEPS}"
        assert (root / "ckpt" / f"global_step{STEPS}" / "shardavg" / "shardavg.json").is_file()
    harness.report("SNIPPET", {"name": name, "world_size": dist.get_world_size()})
    harness.finish()


if __name__ == "__main__":
    main()
