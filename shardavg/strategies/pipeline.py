"""Pipeline stages: each rank holds the tensors of its own stages; the averager covers the whole model.

``torch.distributed.pipelining`` trains a model cut into stages, each a copy of the full model
with the other stages' layers deleted (torchtitan's way), so every stage keeps the full model's
names. ``Pipeline`` wraps one strategy per stage this rank holds (one, or several under an
interleaved schedule; each sharded or replicated within the stage as any model is) and lists,
besides its stages' own tensors, every other stage's tensor as a *placeholder*:
its name, shape, dtype and kind, an empty part and an empty local shard. So every rank tracks
the same tensors in the same order, and the layout, gathers, checkpoints, DCP and exports see
the whole model with no special case: a tensor's parts come from the ranks of the stage that
holds it. A tensor that two stages both hold (an embedding tied to the output head, kept in
the first and the last stage) is replicated between them, the lowest rank owning it, and
should be kept equal by the training loop. ``update()`` and ``swapped()`` touch this rank's
own tensors only: no communication.

The other stages' tensors are learnt once, when the averager is built (a collective over all
ranks: each place's list is sent once, by the lowest rank there, with each tensor's layout,
so every rank derives any rank's part); a later rescan looks at this rank's stages only. The
pipeline group (the ranks of one pipeline, as ``PipelineStage`` is given) tells which ranks
must agree: ranks at the same place in their pipeline groups hold the same stages, so they
must list the same tensors.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..base.errors import LayoutError, ModelChangedError
from ..layouts.parts import Part
from ..layouts.tensor_layout import MeshLayout, TensorLayout, make_grid
from .base import Strategy, TensorInfo


class Pipeline(Strategy):
    """The strategies of this rank's stages, listing every other stage's tensors as empty placeholders.

    Args:
        stages: One strategy per stage this rank holds (one, or several under an
            interleaved schedule).
        group: The pipeline's process group or device mesh, as ``PipelineStage`` gets it.
    """

    def __init__(self, stages: Sequence[Strategy], group: Any) -> None:
        self.stages = list(stages)
        self.name = self.stages[0].name  # type: ignore[misc]
        self.swap_gathers = any(stage.swap_gathers for stage in self.stages)  # type: ignore[misc]
        self.model = nn.ModuleList(stage.model for stage in self.stages)  # what the structure watch follows
        self.group = group.get_group() if hasattr(group, "get_group") else group
        self._order: list[tuple[str, TensorInfo]] | None = None  # (name, placeholder) of every stage's tensors

    def tensors(self) -> list[TensorInfo]:
        """This rank's tensors, every other stage's as a placeholder, in one order on every rank.

        A collective the first time (when the averager is built).

        Returns:
            One info per tensor of the whole model.

        Raises:
            LayoutError: This rank's stages list a tensor twice, or ranks disagree on the stages'
                tensors (first call).
            ModelChangedError: This rank holds a tensor no stage held when the averager was built.
        """
        own = [info for stage in self.stages for info in stage.tensors()]
        counted = Counter(name for info in own for name in info.names)
        twice = sorted(name for name, count in counted.items() if count > 1)
        if twice:
            raise LayoutError(f"the stages of rank {dist.get_rank()} list {twice} more than once")
        if self._order is None:
            self._order = self._learn(own)
        mine = {info.name: k for k, info in enumerate(own)}
        unknown = sorted(set(mine) - {name for name, _ in self._order})
        if unknown:
            raise ModelChangedError(
                f"rank {dist.get_rank()}'s stages hold {unknown[:8]}, which no stage held when the averager was "
                "built; build a new WeightAverager for the new model"
            )
        self._slots = [mine.get(name) for name, _ in self._order]  # per tensor: its place among this rank's own
        return [
            placeholder
            if slot is None
            else dataclasses.replace(own[slot], aliases=placeholder.aliases, layout=placeholder.layout)
            for (_, placeholder), slot in zip(self._order, self._slots)
        ]

    def _learn(self, own: list[TensorInfo]) -> list[tuple[str, TensorInfo]]:
        """Collective: every stage's tensors, checked, in one order (stage by stage, first seen first).

        The ranks share their place and a digest of their tensors (O(ranks)); then the lowest rank
        at each place sends its place's list to all (O(tensors) in all, not per rank)."""
        listed = [
            (info.name, info.aliases, info.kind, tuple(info.shape), info.dtype, info.requires_grad, info.layout)
            for info in own
        ]
        place = dist.get_rank(self.group) if self.group is not None else 0
        digest = hashlib.sha256(repr([entry[:6] + (_key(entry[6]),) for entry in listed]).encode()).hexdigest()
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (place, digest))
        ranks_at: dict[int, list[int]] = {}
        for holder, (their_place, _) in enumerate(everyone):
            ranks_at.setdefault(their_place, []).append(holder)
        if any(everyone[holder][1] != everyone[ranks[0]][1] for ranks in ranks_at.values() for holder in ranks):
            self._raise_unlike_places(listed, place)
        listings: dict[int, list] = {}
        for their_place, ranks in sorted(ranks_at.items(), key=lambda item: item[1][0]):
            sent = [listed if dist.get_rank() == ranks[0] else None]
            dist.broadcast_object_list(sent, src=ranks[0])
            listings[their_place] = sent[0]
        seen: dict[str, tuple[int, tuple]] = {}
        aliases: dict[str, list[str]] = {}
        layouts: dict[str, list[tuple[int, TensorLayout | None]]] = {}
        for their_place, theirs in listings.items():
            holder = ranks_at[their_place][0]
            for name, their_aliases, *described, layout in theirs:
                first, known = seen.setdefault(name, (holder, tuple(described)))
                if known != tuple(described):
                    raise LayoutError(
                        f"{name!r} is {_shown(known)} on rank {first} but {_shown(described)} on rank {holder}"
                    )
                known_aliases = aliases.setdefault(name, [])
                known_aliases += [alias for alias in their_aliases if alias not in known_aliases]
                layouts.setdefault(name, []).append((their_place, layout))
        both = sorted(set(seen) & {alias for names in aliases.values() for alias in names})
        if both:
            raise LayoutError(f"{both} name a tensor of their own on some ranks and an alias on others")
        device = next((view.device for stage in self.stages for view in stage.local_shards()), torch.device("cpu"))
        order = []
        for name, (_, (kind, shape, dtype, requires_grad)) in seen.items():
            size = torch.Size(shape)
            layout = _stage_layout(tuple(shape), layouts[name], ranks_at)
            placeholder = TensorInfo(
                name, tuple(aliases[name]), kind, size, dtype, requires_grad, Part.empty(size), layout
            )
            order.append((name, placeholder))
        self._empty = {name: torch.empty(0, dtype=info.dtype, device=device) for name, info in order}
        return order

    def _raise_unlike_places(self, listed: list, place: int) -> None:
        """Collective (every rank saw the digests differ): name two ranks at one place holding different tensors."""
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (place, {entry[0] for entry in listed}))
        stages: dict[int, tuple[int, set[str]]] = {}
        for holder, (their_place, names) in enumerate(everyone):
            first, expected = stages.setdefault(their_place, (holder, names))
            if names != expected:
                raise LayoutError(
                    f"ranks {first} and {holder} are at place {their_place} of their pipelines but hold different "
                    f"tensors: only on rank {first}: {sorted(expected - names)[:8]}, only on rank {holder}: "
                    f"{sorted(names - expected)[:8]}"
                )
        raise LayoutError("ranks at the same place of their pipelines shard their stage differently")

    def local_shards(self) -> list[torch.Tensor]:
        """This rank's stages' local shards in ``tensors()`` order, an empty tensor for each placeholder.

        Returns:
            One tensor per info of the latest ``tensors()``.

        Raises:
            RuntimeError: Called before ``tensors()``.
        """
        return self._arranged([view for stage in self.stages for view in stage.local_shards()])

    def swap_views(self) -> list[torch.Tensor]:
        """This rank's stages' swap views in ``tensors()`` order, an empty tensor for each placeholder.

        Returns:
            One tensor per info of the latest ``tensors()``.

        Raises:
            RuntimeError: Called before ``tensors()``.
        """
        return self._arranged([view for stage in self.stages for view in stage.swap_views()])

    def _arranged(self, own: list[torch.Tensor]) -> list[torch.Tensor]:
        """This rank's own views in the order of ``tensors()``, the placeholders' empty ones between."""
        if self._order is None:
            raise RuntimeError("Pipeline.local_shards() before tensors(): scan the model first")
        return [self._empty[name] if slot is None else own[slot] for (name, _), slot in zip(self._order, self._slots)]

    def release_gathered(self) -> None:
        """Release what each of this rank's stages keeps gathered."""
        for stage in self.stages:
            stage.release_gathered()


def _key(layout: TensorLayout | None) -> tuple | None:
    return None if layout is None else layout.key()


def _stage_layout(
    shape: tuple[int, ...], held: list[tuple[int, TensorLayout | None]], ranks_at: dict[int, list[int]]
) -> TensorLayout | None:
    """The layout of a tensor that the stages at the places in ``held`` hold: each stage's layout
    cut to the ranks at its place (a tensor a stage holds whole is held by the ranks there, not
    by every rank), the copies at every such place replicas of each other (an embedding tied to
    the output head); None (gathered) where that cannot be said as one layout."""
    cut = [layout.within(set(ranks_at[place])) if isinstance(layout, MeshLayout) else None for place, layout in held]
    if any(layout is None for layout in cut) or len({(c.placements, c.grid.shape[1:]) for c in cut}) > 1:  # type: ignore[union-attr]
        return held[0][1] if len(held) == 1 and not isinstance(held[0][1], MeshLayout) else None
    ranks = [rank for layout in cut for rank in layout.grid.ranks]  # type: ignore[union-attr]
    first = cut[0]
    grid_shape = (len(ranks) // math.prod(first.grid.shape[1:]), *first.grid.shape[1:])  # type: ignore[union-attr]
    if grid_shape[0] == 1 and len(grid_shape) > 1:
        return MeshLayout(shape, make_grid(grid_shape[1:], ranks), first.placements[1:])  # type: ignore[union-attr]
    return MeshLayout(shape, make_grid(grid_shape, ranks), first.placements)  # type: ignore[union-attr]


def _shown(described: Sequence) -> str:
    kind, shape, dtype, requires_grad = described
    return f"a {kind} of shape {tuple(shape)} and {dtype}{'' if requires_grad or kind != 'param' else ', frozen'}"
