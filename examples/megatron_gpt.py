"""Megatron-Core GPT with an EMA kept on each rank's slices, saved inside Megatron's own checkpoints.

Shows: a ``GPTModel`` under Megatron's ``parallel_state`` (``--tp``, ``--pp``, data parallel the rest),
torch AdamW, the averager on the model (each rank averages the slices it holds, placed by the model's
``sharded_state_dict()``), ``avg.update(finite=total_norm)``, evaluation under ``avg.swapped()``, the
model, optimizer and average in one ``dist_checkpointing.save`` laid out as Megatron-LM's (``iter_NNNNNNN``
beside ``latest_checkpointed_iteration.txt``), resume from it, and a consolidated export.

    torchrun --nproc_per_node 2 examples/megatron_gpt.py --tp 2 --steps 100 --out runs/megatron

Megatron-Core trains on GPUs (NCCL). At ``--pp`` above 1 the steps go through Megatron's pipeline
schedule, which needs CUDA (not run by the test suite); the suite runs this file at TP2 on CPU.
Run it again with the same ``--out`` and more ``--steps``: it resumes from the tracked iteration.
"""

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, tensor_parallel
from megatron.core import parallel_state as ps
from megatron.core.dist_checkpointing.optimizer import get_param_id_to_sharded_param_map, optim_state_to_sharding_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.module import param_is_not_shared
from megatron.core.transformer.transformer_config import TransformerConfig

import shardavg

VOCAB, SEQUENCE, HEADS, BATCH = 128, 16, 4, 8
TRACKER = "latest_checkpointed_iteration.txt"  # what Megatron-LM's --load reads first


def batch(seed: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic tokens whose label is the token after each one: a rule the model can learn."""
    tokens = torch.randint(0, VOCAB, (BATCH, SEQUENCE), generator=torch.Generator().manual_seed(seed))
    return tokens.to(device), ((tokens + 1) % VOCAB).to(device)


def step(model: GPTModel, tokens: torch.Tensor, labels: torch.Tensor, pp: int, train: bool) -> torch.Tensor | None:
    """The mean loss of one batch (forward, and backward when ``train``); None on the stages before the last."""
    positions = torch.arange(SEQUENCE, device=tokens.device).expand_as(tokens)
    mask = torch.ones(1, 1, SEQUENCE, SEQUENCE, dtype=torch.bool, device=tokens.device).triu(1)  # True: masked

    def forward_step(_, chunk: GPTModel):  # Megatron's schedule's: the output, and how to reduce it to the loss
        return chunk(tokens, positions, mask, labels=labels), lambda out: (out.mean(), {"loss": out.mean().detach()})

    if pp == 1:  # one stage: what Megatron's schedule does with one microbatch
        loss = model(tokens, positions, mask, labels=labels).mean()
        if train:
            loss.backward()
        return loss.detach()
    stored = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter([None]), model=[model], num_microbatches=1,
        seq_length=SEQUENCE, micro_batch_size=BATCH, forward_only=not train,
    )  # fmt: skip
    return stored[0]["loss"] if stored else None


def reduce_and_clip(model: GPTModel, max_norm: float = 1.0) -> torch.Tensor:
    """Gradients averaged over data parallel, the tied embedding's summed over its stages, then clipped by
    Megatron's global norm (each tensor-parallel slice once, shared copies once); returns the norm."""
    grads = [p.grad for p in model.parameters()]
    for grad in grads if ps.get_data_parallel_world_size() > 1 else []:
        dist.all_reduce(grad.div_(ps.get_data_parallel_world_size()), group=ps.get_data_parallel_group())
    if ps.get_pipeline_model_parallel_world_size() > 1 and ps.is_rank_in_embedding_group():
        dist.all_reduce(model.shared_embedding_or_output_weight().grad, group=ps.get_embedding_group())
    is_own = lambda p: param_is_not_shared(p) and tensor_parallel.param_is_not_tensor_parallel_duplicate(p)  # noqa: E731
    own = [p.grad for p in model.parameters() if is_own(p)]
    squares = torch.stack([g.float().square().sum() for g in own]).sum()
    dist.all_reduce(squares, group=ps.get_model_parallel_group())
    total_norm = squares.sqrt()
    torch._foreach_mul_(grads, (max_norm / (total_norm + 1e-6)).clamp(max=1.0))
    return total_norm


def checkpoint(model: GPTModel, optimizer: torch.optim.Optimizer, avg: shardavg.WeightAverager, iteration: int) -> dict:
    """Megatron-LM's checkpoint contents (model, optimizer, iteration) with the average beside them."""
    model_state, optimizer_state = model.sharded_state_dict(), optimizer.state_dict()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    optim_state_to_sharding_state(optimizer_state, get_param_id_to_sharded_param_map(model_state, params), ("step",))
    average = avg.sharded_state_dict(prefix="ema.")  # shardavg: the model's ShardedTensors, the average as data
    return {"model": model_state, "optimizer": optimizer_state, "iteration": iteration, **average}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size (divides the 4 attention heads)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (above 1: GPUs only)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--save-every", type=int, default=50)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("runs/megatron"))
    args = parser.parse_args()
    for flag in ("tp", "pp", "steps", "save_every", "layers", "dim"):  # counts, checked before anything starts
        if getattr(args, flag) < 1:
            parser.error(f"argument --{flag.replace('_', '-')}: must be at least 1, got {getattr(args, flag)}")
    world = int(os.environ.get("WORLD_SIZE", 1))  # torchrun's, known before the process group
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for fails, message in (
        (HEADS % args.tp, f"argument --tp: {args.tp} does not divide the model's {HEADS} attention heads"),
        (args.dim % HEADS, f"argument --dim: {args.dim} is not a multiple of the {HEADS} attention heads"),
        (args.layers % args.pp, f"argument --layers: {args.layers} do not split evenly into --pp {args.pp} stages"),
        (world % (args.tp * args.pp), f"argument --pp: --tp {args.tp} x --pp {args.pp} does not divide the {world} "
         "process(es) (torchrun's --nproc_per_node)"),
        (args.pp > 1 and device == "cpu", "argument --pp: Megatron's pipeline schedules need CUDA; on CPU, --pp 1"),
    ):  # fmt: skip
        if fails:
            parser.error(message)

    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    ps.initialize_model_parallel(tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp)
    torch.manual_seed(0)
    if device == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(0)  # Megatron's RNG tracker, which its layers fork
    config = TransformerConfig(
        num_layers=args.layers, hidden_size=args.dim, num_attention_heads=HEADS, gated_linear_unit=True,
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=device == "cpu",
        params_dtype=torch.float32, pipeline_dtype=torch.float32,
        tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp,
    )  # fmt: skip
    model = GPTModel(
        config, get_gpt_layer_local_spec(), vocab_size=VOCAB, max_sequence_length=SEQUENCE,
        pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=True,  # tied, Megatron-LM's default
    ).to(device)  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    rule = shardavg.EMA(decay=0.999, warmup=shardavg.RatioWarmup())  # shardavg: decay min(0.999, (n+1)/(n+10))
    avg = shardavg.WeightAverager(model, rule)  # shardavg: every rank; strategy "megatron", picked from the model

    checkpoints, first = args.out / "checkpoints", 1
    talks = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == ps.get_data_parallel_rank() == 0
    if (checkpoints / TRACKER).is_file():  # resume, at this run's TP/PP (any: Megatron reshards)
        iteration = int((checkpoints / TRACKER).read_text())
        for p in model.parameters():  # AdamW's state for the load's template to hold, as Megatron's init_state_fn
            optimizer.state[p] = {key: torch.zeros_like(p) for key in ("exp_avg", "exp_avg_sq")}
        template = checkpoint(model, optimizer, avg, iteration)
        loaded = dist_checkpointing.load(template, str(checkpoints / f"iter_{iteration:07d}"))
        model.load_state_dict(loaded["model"])
        for state in loaded["optimizer"]["state"].values():  # AdamW's step count (not saved: one per iteration)
            state["step"] = torch.tensor(float(loaded["iteration"]))
        optimizer.load_state_dict(loaded["optimizer"])
        avg.load_sharded_state_dict(loaded)  # shardavg: the average's tensors and counters, from ema.
        first = loaded["iteration"] + 1
        if talks:
            print(f"resumed at iteration {loaded['iteration']} (average of {avg.num_updates} updates)")

    dp_rank = ps.get_data_parallel_rank()  # the ranks of one model replica train on the same batch
    for iteration in range(first, args.steps + 1):
        loss = step(model, *batch(1000 * iteration + dp_rank, device), args.pp, train=True)
        total_norm = reduce_and_clip(model)
        optimizer.step()
        optimizer.zero_grad()
        # shardavg: this rank's slices, in place, no communication; skipped where the norm is not finite
        avg.update(finite=total_norm)
        if iteration % args.save_every == 0 or iteration == args.steps:
            folder = checkpoints / f"iter_{iteration:07d}"
            folder.mkdir(parents=True, exist_ok=True)
            dist_checkpointing.save(checkpoint(model, optimizer, avg, iteration), str(folder))
            if dist.get_rank() == 0:  # the tracker last, atomically: --load finds a whole checkpoint or the one before
                (checkpoints / f"{TRACKER}.tmp").write_text(str(iteration))
                (checkpoints / f"{TRACKER}.tmp").replace(checkpoints / TRACKER)
            if talks:
                print(f"iteration {iteration}: train loss {loss.item():.4f}, saved {folder}")

    tokens, labels = batch(-1, device)
    with torch.no_grad():
        live = step(model, tokens, labels, args.pp, train=False)
        with avg.swapped():  # shardavg: every rank holds the average of its own slices inside the block
            ema = step(model, tokens, labels, args.pp, train=False)
    avg.export(args.out / "ema")  # shardavg: collective; safetensors under the full (TP1/PP1) model's names
    if talks:
        print(f"held-out loss live {live.item():.4f}, ema {ema.item():.4f}")
        print(f"done at iteration {args.steps}: {avg.num_updates} updates, exported to {args.out / 'ema'}")
    dist.barrier()  # every rank done before any tears the process group down
    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
