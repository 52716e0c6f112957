"""Megatron-Core on CPU for the torchrun scenarios: TEST-ONLY shims, a small GPT, a training step.

Nothing here is part of shardavg, and nothing in the package patches Megatron. Megatron-Core
0.16.1 builds and trains a ``GPTModel`` with the local layer spec on CPU over gloo once:

- ``use_cpu_initialization=True`` (its default initializes on the GPU);
- the model-parallel RNG tracker's ``fork`` is a null context (``cpu_shims``): the tracker keeps
  CUDA RNG states, which a CPU has not; with dropout 0 nothing draws from it during training,
  and CPU initialization draws from the CPU generator, seeded per layout by Megatron's own rule;
- dropout 0;
- the attention's scratch buffer (``GlobalMemoryBuffer.get_tensor``) is allocated on
  ``torch.cuda.current_device()``: ``cpu_shims`` makes it a plain CPU ``torch.empty`` (its values
  are never read: ``baddbmm`` runs with ``beta=0``);
- at PP > 1 with tied embeddings, ``GPTModel`` moves the last stage's copy of the embedding to the
  GPU (``weight.data.cuda()``) before all-reducing it with the first stage's: ``build`` makes
  ``Tensor.cuda`` return the tensor itself while the model is built (``cuda_is_cpu``);
- ``dist_checkpointing.save`` waits for its device-to-host copies with ``torch.cuda.synchronize()``
  and puts its failure flag on ``torch.cuda.current_device()``: ``checkpoint_shims`` makes the
  first a no-op (the tensors are on the CPU already) and the second the CPU; and its writer
  collects results through a ``multiprocessing`` Manager's queue, a *spawned* server process kept
  for the rank's lifetime: it re-imports the scenario (seconds per rank), and, spawned processes
  inheriting the rank's stdout, it outlives a rank that ends by ``os._exit`` or a signal and keeps
  the launcher's pipe open (the launch never ends). Saves here are synchronous (the queue never
  leaves the rank's process), so ``checkpoint_shims`` gives the writer a plain ``queue.Queue``;
- its pipeline schedules send activations through CUDA tensors, so ``train_step`` moves them
  between stages with plain ``dist.send``/``recv`` (one microbatch, the chunks of every stage in
  their global order, virtual pipeline included), and all-reduces the tied embedding's gradient
  over Megatron's embedding group as its ``finalize_model_grads`` does.
"""

from __future__ import annotations

import contextlib
import queue
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.transformer_config import TransformerConfig

VOCAB, SEQUENCE, HIDDEN, HEADS = 128, 8, 32, 4  # VOCAB divisible by every TP size used (Megatron pads it so)


@dataclass(frozen=True)
class Layout:
    """A Megatron parallel layout: tensor, pipeline and virtual pipeline sizes (data parallel: the rest)."""

    tp: int = 1
    pp: int = 1
    vp: int | None = None

    @property
    def label(self) -> str:
        dp = dist.get_world_size() // (self.tp * self.pp)
        return f"tp{self.tp}-pp{self.pp}" + (f"-vp{self.vp}" if self.vp else "") + f"-dp{dp}"


def cpu_shims() -> None:
    """TEST-ONLY: Megatron's model-parallel RNG tracker forks CUDA RNG states; on CPU, with dropout
    0 and CPU initialization, nothing draws from them, so its ``fork`` becomes a null context; the
    attention's scratch buffer is allocated on the CPU."""
    tracker = tensor_parallel.get_cuda_rng_tracker()
    tracker.fork = lambda *args, **kwargs: contextlib.nullcontext()
    scratch = ps.get_global_memory_buffer()
    scratch.get_tensor = lambda shape, dtype, name, mem_alloc_context=None: torch.empty(shape, dtype=dtype)


@contextlib.contextmanager
def cuda_is_cpu() -> Iterator[None]:
    """TEST-ONLY, while a model is built: ``Tensor.cuda()`` returns the tensor itself (see the module)."""
    real = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.cuda = real  # type: ignore[method-assign]


def checkpoint_shims() -> None:
    """TEST-ONLY: Megatron's checkpointing on a CPU build of torch, in a launch that always ends (see the module)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.current_device = lambda: "cpu"
    filesystem_async._results_queue = queue.Queue()


def initialize(layout: Layout) -> None:
    """(Re)initialize Megatron's process groups for ``layout`` (gloo: the default group's backend)."""
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vp,
    )
    cpu_shims()


def config(layout: Layout, layers: int) -> TransformerConfig:
    return TransformerConfig(
        num_layers=layers,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        gated_linear_unit=True,  # SwiGLU's fused fc1 (Llama-style): a ShardedTensorFactory in the description
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vp,
    )


def build(layout: Layout, layers: int, seed: int = 0) -> list[GPTModel]:
    """This rank's model chunks (one, or ``vp`` under a virtual pipeline), tied embeddings (Megatron-LM's
    default), seeded alike on every rank (TP slices are cut from one CPU-initialized master weight)."""
    initialize(layout)
    torch.manual_seed(seed)
    chunks = []
    with cuda_is_cpu():
        for stage in range(layout.vp or 1):
            vp_stage = stage if layout.vp else None
            chunks.append(
                GPTModel(
                    config(layout, layers),
                    get_gpt_layer_local_spec(),
                    vocab_size=VOCAB,
                    max_sequence_length=SEQUENCE,
                    pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                    post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                    share_embeddings_and_output_weights=True,
                    vp_stage=vp_stage,
                )
            )
    return chunks


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of ``step`` for this rank's data-parallel replica (tokens, labels)."""
    generator = torch.Generator().manual_seed(100 * step + ps.get_data_parallel_rank())
    tokens = torch.randint(0, VOCAB, (2, SEQUENCE), generator=generator)
    return tokens, torch.roll(tokens, -1, dims=1)


def train_step(chunks: list[GPTModel], optimizer: torch.optim.Optimizer, step: int) -> None:
    """One step on one microbatch: forward through every stage's chunks in global order (activations
    sent to the next stage), backward the other way, the tied embedding's gradient all-reduced over
    the embedding group, gradients averaged over data parallel, then ``optimizer.step()``."""
    tokens, labels = data(step)
    positions = torch.arange(SEQUENCE).unsqueeze(0).expand_as(tokens)
    mask = torch.tril(torch.ones(1, 1, SEQUENCE, SEQUENCE)) < 0.5
    pp, me = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    group = ps.get_pipeline_model_parallel_group()
    ranks = dist.get_process_group_ranks(group)
    order = [(chunk, stage) for chunk in range(len(chunks)) for stage in range(pp)]  # global layer order
    kept: list[tuple[torch.Tensor | None, torch.Tensor]] = []  # (input, output) of each own chunk, in order
    activation = None
    for position, (chunk, stage) in enumerate(order):
        if stage != me:
            continue
        model = chunks[chunk]
        received = None
        if position:  # receive from the previous stage
            received = torch.empty(SEQUENCE, tokens.shape[0], HIDDEN)
            dist.recv(received, src=ranks[order[position - 1][1]])
            received.requires_grad_(True)
        model.set_input_tensor(received)
        output = model(tokens, positions, mask, labels=labels if position == len(order) - 1 else None)
        if position < len(order) - 1:
            dist.send(output.detach().contiguous(), dst=ranks[order[position + 1][1]])
        kept.append((received, output))
        activation = output
    for position in reversed(range(len(order))):
        chunk, stage = order[position]
        if stage != me:
            continue
        received, output = kept.pop()
        if position == len(order) - 1:
            output.float().mean().backward()
        else:
            gradient = torch.empty_like(output)
            dist.recv(gradient, src=ranks[order[position + 1][1]])
            output.backward(gradient)
        if position:
            dist.send(received.grad.contiguous(), dst=ranks[order[position - 1][1]])
    del activation
    if pp > 1 and ps.is_rank_in_embedding_group(ignore_virtual=True):
        shared = [c.shared_embedding_or_output_weight() for c in chunks if c.pre_process or c.post_process]
        for weight in shared:
            dist.all_reduce(weight.grad, group=ps.get_embedding_group())
    dp = ps.get_data_parallel_world_size()
    for chunk in chunks:
        for param in chunk.parameters():
            if dp > 1:
                dist.all_reduce(param.grad, group=ps.get_data_parallel_group())
                param.grad.div_(dp)
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)


def optimizer(chunks: list[GPTModel]) -> torch.optim.Optimizer:
    params = [p for chunk in chunks for p in chunk.parameters()]
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.01)


def sharded_tensors(chunks: list[GPTModel]) -> list[ShardedTensor]:
    """Every ShardedTensor the chunks' ``sharded_state_dict()`` describe on this rank."""
    return [v for chunk in chunks for v in chunk.sharded_state_dict().values() if isinstance(v, ShardedTensor)]


def assembled(chunks: list[GPTModel]) -> dict[tuple[str, tuple[int, ...]], torch.Tensor]:
    """Collective, the reference's own assembly (no shardavg): every full tensor in fp32, keyed by
    ``(Megatron key, offsets along the stacked axes)``, from every rank's slices placed at their
    ``global_offset`` (main replicas only; the copies are checked equal to them)."""
    mine = [
        (st.key, tuple(st.global_offset), tuple(st.global_shape), st.prepend_axis_num, st.replica_id,
         st.data.detach().float().clone())
        for st in sharded_tensors(chunks)
    ]  # fmt: skip
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    full: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}
    copies = []
    for theirs in everyone:
        for key, offset, shape, prepend, replica, value in theirs:
            name = (key, offset[:prepend])
            target = full.setdefault(name, torch.full(shape[prepend:], float("nan")))
            box = tuple(slice(o, o + s) for o, s in zip(offset[prepend:], value.shape))
            main = all(r == 0 for r in (replica if isinstance(replica, tuple) else (replica,)))
            if main:
                target[box] = value
            else:
                copies.append((name, box, value))
    for name, box, value in copies:
        assert torch.equal(full[name][box], value), f"{name}: a replica differs from its main copy"
    for name, value in full.items():
        assert not value.isnan().any(), f"{name}: not every element assembled"
    return full


def by_key(chunks: list[GPTModel]) -> dict[tuple[str, tuple[int, ...]], torch.Tensor]:
    """This rank's ShardedTensors' data keyed as ``assembled`` keys them (TP1: whole per key)."""
    return {
        (st.key, tuple(st.global_offset[: st.prepend_axis_num])): st.data.detach() for st in sharded_tensors(chunks)
    }
