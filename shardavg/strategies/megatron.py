"""Megatron-Core models: every tensor placed by the model's own ``sharded_state_dict()``.

Megatron-Core slices its tensors by hand (``ColumnParallelLinear`` keeps rows of a weight,
``RowParallelLinear`` columns, a pipeline stage some of the layers), in plain tensors that carry no
placement; what says where each slice lies is the description the model gives its own
checkpoints: ``model.sharded_state_dict()``, one ``ShardedTensor`` per tensor the rank holds, with
the global shape, this rank's offset, the number of fragments per axis, the replica id and the
*stacked* axes (``prepend_axis_num``: the layer index of ``decoder.layers.*``, and the expert index
of an MoE layer's experts) that a checkpoint stacks layer by layer. So the strategy never guesses
from parameter names: each ``ShardedTensor`` whose data is a parameter (or persistent buffer) of
the model is one tensor of the full model, of which this rank holds one box (several for a factory):

- the full model's tensor is the ``ShardedTensor``'s global tensor at the offsets of its stacked
  axes (one layer, one expert), of the shape left after them;
- its name is the name the full (TP1/PP1) model's ``state_dict()`` gives it: a stage numbers its
  layers from 0 in its own state dict (``decoder.layers.0.*`` on every stage, each virtual
  chunk too), so the numbered segments of the state-dict key are replaced by the global offsets
  along the stacked axes; a tensor with no stacked axis is named by its ``ShardedTensor`` key,
  which is also how a pipeline's last stage names its copy of the tied word embeddings (its
  ``output_layer.weight`` is Megatron's ``embedding.word_embeddings.weight``, replica 1), so
  the copy is the same tensor as the first stage's, replicated between them;
- the box is the offsets and local shape of the non-stacked axes; replicas (data parallel, the
  tensor-parallel copies of a layer norm, the tied copy) hold the same box: each is averaged
  where it lies (``swapped()`` evaluates on every rank), the lowest rank holding it writes it.

Every rank derives every other rank's part of a tensor of its stage from Megatron's process
groups (the stage's data-parallel x tensor-parallel ranks, split as ``torch.chunk`` along the one
fragmented axis: Megatron divides evenly), a ``MeshLayout`` checked against the rank's own part
when the layout is built (a tensor laid out otherwise, an expert's, is gathered instead); the
stages are put together by ``Pipeline``, which lists the other stages' tensors.

A ``ShardedTensorFactory`` (a tensor Megatron saves as several: SwiGLU's fused ``fc1``, its
``w`` and ``v`` halves each split over tensor parallel) is read through what it builds: slices of
the parameter lying back to back in it, so this rank holds several boxes of the full tensor
(rows ``[r*c, (r+1)*c)`` of ``w`` and of ``v``), a strided shard of it.

Refused, naming the tensor, where the description does not place it exactly: a factory whose
tensors are not such slices, a ``flattened_range`` (a distributed optimizer's flat buffer), a
``ShardedTensor`` whose data is not a tensor the model holds, a parameter or persistent buffer
with no ``ShardedTensor``, a stacked key whose numbering does not match its stacked axes, and
expert parallelism (each rank holds some experts: not built).

The averager's own ``sharded_state_dict`` (``sharded_average`` here) hands the same descriptions
back to Megatron with the shadows as data, so ``dist_checkpointing`` saves the average beside the
model and loads it at another layout.

Megatron-Core is imported only once it is loaded (``is_megatron``): shardavg never imports it.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..base.dist import distributed, rank
from ..base.errors import CheckpointError, StrategyError
from ..layouts.parts import Part
from ..layouts.tensor_layout import MeshLayout, make_grid
from .base import ModuleStrategy, Strategy, TensorInfo, grouped_by_identity, persistent_buffers, unwrap
from .dtensor import is_dtensor
from .pipeline import Pipeline

NUMBERED = re.compile(r"^[0-9]+$")  # a module list's index in a state-dict key (a layer, an expert)
COUNTERS = "shardavg.counters"  # the key (after the prefix) of the averager's counters in Megatron's checkpoint


def is_megatron(model: object) -> bool:
    """Whether ``model`` is a Megatron-Core module (bare, or in Megatron's or torch's wrappers), or a
    non-empty list of them (a virtual pipeline's models); False, without importing it, when
    Megatron-Core is not loaded.

    Args:
        model: Anything.

    Returns:
        Whether the Megatron strategy takes it.
    """
    if "megatron.core" not in sys.modules:
        return False
    from megatron.core.transformer.module import MegatronModule

    parts = list(model) if isinstance(model, (list, tuple)) else [model]
    return bool(parts) and all(isinstance(p, nn.Module) and isinstance(unwrap(p), MegatronModule) for p in parts)


def megatron_model(model: nn.Module) -> nn.Module:
    """The model inside torch's wrappers and Megatron's ``DistributedDataParallel`` and ``Float16Module``."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.transformer.module import Float16Module

    model = unwrap(model)
    while isinstance(model, (DistributedDataParallel, Float16Module)):
        model = unwrap(model.module)
    return model


def megatron_strategy(model: nn.Module | Sequence[nn.Module]) -> Strategy:
    """The strategy for a Megatron-Core model or its list of virtual-pipeline chunks: one ``Megatron``
    per chunk, put together by ``Pipeline`` over Megatron's pipeline group when there are stages.

    Args:
        model: The model (chunk), or this rank's chunks.

    Returns:
        The strategy.

    Raises:
        StrategyError: A mixture of experts under expert parallelism (not built), or what ``Megatron`` refuses.
    """
    from megatron.core import parallel_state

    models = list(model) if isinstance(model, (list, tuple)) else [model]
    if parallel_state.model_parallel_is_initialized() and parallel_state.get_expert_model_parallel_world_size() > 1:
        from megatron.core.transformer.moe.moe_layer import MoELayer

        moe = next((n for c in models for n, m in megatron_model(c).named_modules() if isinstance(m, MoELayer)), None)
        if moe is not None:
            raise StrategyError(
                f"{moe!r} is a mixture of experts under expert parallelism "
                f"(EP={parallel_state.get_expert_model_parallel_world_size()}): each rank holds some of the experts, "
                "which the Megatron strategy does not list for the others yet; average it at EP=1, or average "
                "Megatron's checkpoints with `shardavg merge`"
            )
    strategies = [Megatron(one) for one in models]
    if len(strategies) == 1 and parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return strategies[0]
    return Pipeline(strategies, parallel_state.get_pipeline_model_parallel_group())


@dataclasses.dataclass(frozen=True)
class Described:
    """One ``ShardedTensor`` of the model, read: the full model's tensor it is, and this rank's box."""

    path: tuple[str, ...]  # where it sits in the sharded state dict (dict keys, nested)
    value: Any  # the ShardedTensor
    name: str  # the full model's state-dict name
    tensor: torch.Tensor  # the parameter or buffer (the ShardedTensor's data)
    kind: str  # "param" or "buffer"
    shape: tuple[int, ...]  # the full model's tensor
    ranges: tuple[tuple[tuple[int, int], ...], ...]  # per axis, the (first, length) of each range this rank holds
    saved_as: int  # how many ShardedTensors it is saved as: 1, or a factory's (SwiGLU's fc1: 2, along axis 0)
    cuts: tuple[int, ...]  # Megatron's axis_fragmentations: into how many it is cut along each axis


class Megatron(ModuleStrategy):
    """A Megatron-Core model (chunk): its tensors and this rank's box of each, from ``sharded_state_dict()``.

    Args:
        model: A ``MegatronModule`` (``GPTModel``), bare or in Megatron's ``DistributedDataParallel``
            or ``Float16Module`` (or torch's wrappers).
    """

    name = "megatron"

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.module = megatron_model(model)

    @staticmethod
    def fits(model: nn.Module) -> bool:
        """Whether ``model`` is a Megatron-Core module (see ``is_megatron``).

        Args:
            model: The model as the user passed it.

        Returns:
            Whether it is one.
        """
        return is_megatron(model)

    def tensors(self) -> list[TensorInfo]:
        """Every tensor ``sharded_state_dict()`` describes (parameters and persistent buffers alike),
        in its order; nothing else (see ``_scan_params``).

        Returns:
            One info per tensor of this chunk.
        """
        self._buffer_slots = []  # (the buffers are among the described tensors)
        return self._scan_params()

    def _scan_params(self) -> list[TensorInfo]:
        described = self.described()
        self._views = [entry.tensor for entry in described]
        infos = []
        for entry in described:
            part = Part.from_ranges(entry.shape, entry.ranges)
            infos.append(
                TensorInfo(
                    name=entry.name,
                    aliases=(),
                    kind=entry.kind,  # type: ignore[arg-type]
                    shape=torch.Size(entry.shape),
                    dtype=entry.tensor.dtype,
                    requires_grad=entry.kind == "param" and entry.tensor.requires_grad,
                    part=part,
                    layout=self._stage_layout(entry),
                )
            )
        return infos

    def _param_views(self) -> list[torch.Tensor]:
        return self._views

    def described(self, metadata: Mapping[str, Any] | None = None) -> list[Described]:
        """Every ``ShardedTensor`` of ``sharded_state_dict(metadata=metadata)`` read, checked to place
        every parameter and persistent buffer of the model exactly once.

        Args:
            metadata: Megatron's ``sharded_state_dict`` metadata (None: its default).

        Returns:
            One entry per tensor, in the state dict's order.

        Raises:
            StrategyError: Something the description does not place exactly (see the module).
        """
        return self.read(metadata)[0]

    def read(self, metadata: Mapping[str, Any] | None = None) -> tuple[list[Described], list[tuple[str, Any]]]:
        """``described``, and the ``ShardedObject``s beside the tensors (Transformer Engine's
        ``_extra_state``) by their paths joined with dots: a checkpoint of the model needs them."""
        from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory

        held: dict[int, tuple[str, str]] = {}  # id -> (kind, name in this chunk)
        for names, tensor in grouped_by_identity(self.module.named_parameters(remove_duplicate=False)):
            held[id(tensor)] = ("param", names[0])
        for names, _, _, buffer in persistent_buffers(self.module):
            held[id(buffer)] = ("buffer", names[0])
        described: list[Described] = []
        objects: list[tuple[str, Any]] = []
        seen: dict[int, str] = {}
        for path, value in _walk(self.module.sharded_state_dict(metadata=dict(metadata or {}))):
            where = ".".join(path)
            if isinstance(value, ShardedObject):
                objects.append((where, value))
            elif isinstance(value, (ShardedTensor, ShardedTensorFactory)):
                described.append(self._read(path, value, held, seen))
        missing = [name for key, (_, name) in held.items() if key not in seen]
        if missing:
            raise StrategyError(
                f"{missing[0]!r}{_more(missing)} of {type(self.module).__name__} has no ShardedTensor in its "
                "sharded_state_dict(), so nothing says which part of the full model it is: shardavg cannot place "
                "it; describe it in the module's sharded_state_dict() (Megatron's make_sharded_tensors_for_checkpoint)"
            )
        return described, objects

    def _read(
        self, path: tuple[str, ...], value: Any, held: dict[int, tuple[str, str]], seen: dict[int, str]
    ) -> Described:
        """One ``ShardedTensor`` (or factory) as the full model's tensor and this rank's boxes of it, checked."""
        where = ".".join(path)
        label = f"{where!r} (Megatron key {value.key!r})"
        if value.flattened_range is not None:
            raise StrategyError(
                f"{label} is a flat range {value.flattened_range} of its tensor (a distributed optimizer's "
                "buffer): shardavg averages the model's own slices; pass the model, not the optimizer's state"
            )
        data = value.data
        if not isinstance(data, torch.Tensor) or id(data) not in held or is_dtensor(data):
            raise StrategyError(
                f"{label}: its data is not a parameter or persistent buffer of {type(self.module).__name__} (a copy "
                "or a view Megatron made for its checkpoint), so averaging it would not follow the model"
            )
        if id(data) in seen:
            raise StrategyError(f"{label} describes the tensor {seen[id(data)]!r} describes too")
        seen[id(data)] = where
        if not data.is_contiguous():
            raise StrategyError(f"{label}: this rank's slice is not contiguous, so it has no flat local shard")
        saved = _saved_as(value, data, label)
        first = saved[0]
        stacked = first.prepend_axis_num
        shape = tuple(first.global_shape[stacked:])
        boxes = [(tuple(p.global_offset[stacked:]), tuple(p.local_shape)) for p in saved]
        if any(
            (p.key, p.global_shape, p.prepend_axis_num, p.global_offset[:stacked])
            != (first.key, first.global_shape, stacked, first.global_offset[:stacked])
            or box[0][1:] != boxes[0][0][1:]
            or box[1][1:] != boxes[0][1][1:]
            for p, box in zip(saved, boxes)
        ) or not all(
            len(o) == len(shape) and all(0 <= a and a + b <= n for a, b, n in zip(o, z, shape)) for o, z in boxes
        ):
            raise StrategyError(
                f"{label}: slices {boxes} of this rank do not fit its global shape {tuple(first.global_shape)} "
                f"({stacked} stacked axes) as rows of one tensor"
            )
        ranges = ((*((o[0], z[0]) for o, z in boxes),), *(((o, z),) for o, z in zip(boxes[0][0][1:], boxes[0][1][1:])))
        return Described(
            path=path,
            value=value,
            name=_full_name(path[-1], first, label),
            tensor=data,
            kind=held[id(data)][0],
            shape=shape,
            ranges=ranges,
            saved_as=len(saved),
            cuts=tuple(first.axis_fragmentations[stacked:]),
        )

    def _stage_layout(self, entry: Described) -> MeshLayout | None:
        """The rule every rank of this stage follows for ``entry``: its data-parallel ranks hold copies,
        its tensor-parallel ranks ``torch.chunk`` the one fragmented axis (or copies, if none is);
        None where Megatron's groups do not tell (checked against each rank's part when built)."""
        if not distributed():
            return None
        from megatron.core import parallel_state

        if not parallel_state.model_parallel_is_initialized():
            return None
        tp = dist.get_process_group_ranks(parallel_state.get_tensor_model_parallel_group())
        dp = dist.get_process_group_ranks(parallel_state.get_data_parallel_group(with_context_parallel=True))
        cut = [axis for axis, count in enumerate(entry.cuts) if count != 1]
        if (
            len(cut) > 1
            or (cut and entry.cuts[cut[0]] != len(tp) * entry.saved_as)
            or (entry.saved_as > 1 and cut != [0])
        ):
            return None
        me = rank()
        ranks = [d + t - me for d in dp for t in tp]  # (Megatron's ranks are linear in each group's index)
        if len(set(ranks)) != len(ranks) or min(ranks) < 0:
            return None
        # (a factory's tensors: torch.chunk in ``saved_as`` groups, each split over TP: a strided shard)
        split = (
            ("strided_shard", 0, entry.saved_as) if entry.saved_as > 1 else ("shard", cut[0]) if cut else ("replicate",)
        )
        return MeshLayout(entry.shape, make_grid((len(dp), len(tp)), ranks), (("replicate",), split))


def _walk(tree: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    """``(path, value)`` of every leaf of a (nested) sharded state dict, in order."""
    if isinstance(tree, Mapping):
        for key, value in tree.items():
            yield from _walk(value, (*path, str(key)))
    elif isinstance(tree, list):
        for index, value in enumerate(tree):
            yield from _walk(value, (*path, str(index)))
    else:
        yield path, tree


def _saved_as(value: Any, data: torch.Tensor, label: str) -> list[Any]:
    """The ``ShardedTensor``s a description saves ``data`` as: itself, or what a factory builds, which
    must be slices of ``data`` lying back to back in it (SwiGLU's fc1: its two halves, ``torch.chunk``)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    if not isinstance(value, ShardedTensorFactory):
        return [value]
    built = value.build()
    saved = list(built) if isinstance(built, (list, tuple)) else [built]
    at, size = data.data_ptr(), data.element_size()
    for sharded in saved:
        if not (
            isinstance(sharded, ShardedTensor)
            and isinstance(sharded.data, torch.Tensor)
            and sharded.data.is_contiguous()
            and sharded.data.untyped_storage().data_ptr() == data.untyped_storage().data_ptr()
            and sharded.data.data_ptr() == at
        ):
            raise StrategyError(
                f"{label} is a ShardedTensorFactory whose tensors are not slices of the parameter lying back to "
                "back in it, so its description does not say which elements of the full tensor this rank's "
                "slice holds: shardavg cannot average it exactly; average Megatron's checkpoints with `shardavg merge`"
            )
        at += sharded.data.numel() * size
    if at != data.data_ptr() + data.numel() * size:
        raise StrategyError(f"{label} is a ShardedTensorFactory whose tensors do not cover its parameter")
    return saved


def _full_name(key: str, value: Any, label: str) -> str:
    """The name the full (TP1/PP1) model's ``state_dict()`` gives a ``ShardedTensor``'s tensor: its key
    when nothing is stacked; otherwise its state-dict key with each numbered segment (local on
    this stage) replaced by the global offset along the matching stacked axis."""
    stacked = value.prepend_axis_num
    if not stacked:
        return value.key
    segments = key.split(".")
    numbered = [i for i, segment in enumerate(segments) if NUMBERED.match(segment)]
    if len(numbered) != stacked:
        raise StrategyError(
            f"{label} has {stacked} stacked axes but its state-dict key holds {len(numbered)} numbered segments: "
            "cannot tell its name in the full model"
        )
    for axis, position in enumerate(numbered):
        segments[position] = str(value.global_offset[axis])
    return ".".join(segments)


def _more(names: Sequence[str]) -> str:
    return f" (and {len(names) - 1} more)" if len(names) > 1 else ""


# ---------------------------------------------------------------------- the average in Megatron's checkpoints


def megatron_strategies(strategy: Strategy) -> list[Megatron]:
    """The ``Megatron`` strategies of an averager's strategy, one per chunk.

    Raises:
        StrategyError: The averager does not average a Megatron-Core model.
    """
    stages = strategy.stages if isinstance(strategy, Pipeline) else [strategy]
    if not all(isinstance(stage, Megatron) for stage in stages):
        raise StrategyError(
            f"sharded_state_dict() describes the average as Megatron-Core's checkpoints do, for a Megatron-Core "
            f"model; this averager uses the {strategy.name!r} strategy: save it with avg.save() or "
            "torch.distributed.checkpoint (avg.state_dict())"
        )
    return stages  # type: ignore[return-value]


def sharded_average(
    strategy: Strategy,
    names: Sequence[str],
    values: Sequence[torch.Tensor],
    counters: torch.Tensor,
    prefix: str,
    metadata: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """Megatron ``ShardedTensor``s of the average: the model's own (offsets, fragments, replica ids,
    stacked axes), keys prefixed, each with ``values[i]`` (the tensor named ``names[i]``) as data;
    the model's ``ShardedObject``s (``_extra_state``), keys prefixed, so that the checkpoint is a
    whole model's; and the counters, held by every rank, written by rank 0.

    One chunk: the model's own state-dict keys, prefixed; several: ``{prefix}model{i}`` per chunk.
    """
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    index = {name: i for i, name in enumerate(names)}
    models = megatron_strategies(strategy)
    out: dict[str, Any] = {}
    for number, each in enumerate(models):
        described, objects = each.read(metadata)
        made: dict[str, Any] = {prefix + where: dataclasses.replace(o, key=prefix + o.key) for where, o in objects}
        for entry in described:
            data = values[index[entry.name]].view(entry.tensor.shape)
            typed = {"dtype": data.dtype} if isinstance(entry.value, ShardedTensor) else {}  # (a factory has none)
            made[prefix + ".".join(entry.path)] = dataclasses.replace(
                entry.value, key=prefix + entry.value.key, data=data, **typed
            )
        if len(models) == 1:
            out.update(made)
        else:
            out[f"{prefix}model{number}"] = made
    out[prefix + COUNTERS] = ShardedTensor.from_rank_offsets(prefix + COUNTERS, counters, replica_id=rank())
    return out


def loaded_average(
    strategy: Strategy, names: Sequence[str], state_dict: Mapping[str, Any], prefix: str
) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
    """What ``dist_checkpointing.load`` returned for a template made by ``sharded_average``: each
    loaded tensor by the index of its name, and the counters; everything checked first.

    Raises:
        CheckpointError: A tensor or the counters missing, or not of the shape this rank holds.
    """
    index = {name: i for i, name in enumerate(names)}
    models = megatron_strategies(strategy)
    found: dict[int, torch.Tensor] = {}
    missing: list[str] = []
    for number, each in enumerate(models):
        tree = state_dict if len(models) == 1 else state_dict.get(f"{prefix}model{number}", {})
        for entry in each.described():
            key = prefix + ".".join(entry.path)
            value = tree.get(key) if isinstance(tree, Mapping) else None
            if not isinstance(value, torch.Tensor):
                missing.append(key)
                continue
            if tuple(value.shape) != tuple(entry.tensor.shape):
                raise CheckpointError(
                    f"{key!r}: the loaded state dict holds {tuple(value.shape)} on rank {rank()}, this rank's slice "
                    f"of {entry.name!r} is {tuple(entry.tensor.shape)}; load with avg.sharded_state_dict(prefix="
                    f"{prefix!r}) of this model as the template"
                )
            found[index[entry.name]] = value
    counters = state_dict.get(prefix + COUNTERS)
    if not isinstance(counters, torch.Tensor) or counters.shape != (3,):
        missing.append(prefix + COUNTERS)
    if missing:
        raise CheckpointError(
            f"the loaded state dict lacks {missing[:4]}{_more(missing)}: pass what dist_checkpointing.load returned "
            f"for a template holding avg.sharded_state_dict(prefix={prefix!r}), with the same prefix"
        )
    return found, counters  # type: ignore[return-value]
