"""FSDP1 (``FullyShardedDataParallel``), with ``use_orig_params`` True or False.

Each FSDP unit flattens its parameters into one flat parameter and gives every rank an equal
flat range of it. An original parameter's local shard is what of this rank's range falls
inside it (FSDP's own ``_shard_param_infos``), one flat range of that parameter. Every
rank's range follows from the parameter's offset in the flat parameter and the ranges' length
(a ``FlatLayout`` over the unit's process group, or its 2-d device mesh under hybrid
sharding); a unit that does not shard (``NO_SHARD``) holds its parameters whole on every rank
of its group.
"""

from __future__ import annotations

import operator
from itertools import accumulate

import torch
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from ..layouts.parts import Part
from ..layouts.tensor_layout import FlatLayout, Grid, MeshLayout
from .base import ModuleStrategy, TensorInfo, canonical_name, group_grid
from .dtensor import grid_of

_LOCAL_SHARD = operator.attrgetter("_local_shard")


def _join(*parts: str) -> str:
    return ".".join(part for part in parts if part)


def _offsets(flat: torch.Tensor) -> list[int]:
    """Where each original parameter starts in the unsharded flat parameter (alignment padding skipped)."""
    starts = [0, *accumulate(flat._numels_with_padding)]
    return [start for start, padding in zip(starts, flat._is_padding_mask) if not padding]


class FSDP1(ModuleStrategy):
    """FSDP1 units: each parameter's local shard is what it holds of this rank's flat-parameter range.

    Args:
        model: A model holding ``FullyShardedDataParallel`` units.
    """

    name = "fsdp1"
    _views_key: list | None = None  # what the cached views were sliced from
    _handed: tuple | None = None  # the last local_shards(): (views, buffers, their pointers, the list)

    @staticmethod
    def fits(model: nn.Module) -> bool:
        """Whether ``model`` holds an FSDP1 unit.

        Args:
            model: The model as the user passed it.

        Returns:
            Whether any of its modules is ``FullyShardedDataParallel``.
        """
        return any(isinstance(module, FSDP) for module in model.modules())

    def _units(self) -> list[tuple[str, FSDP]]:
        return [
            (canonical_name(path), module)
            for path, module in self.module.named_modules()
            if isinstance(module, FSDP) and module._handle is not None
        ]

    def _scan_params(self) -> list[TensorInfo]:
        infos: list[TensorInfo] = []
        self._flat_params = []
        for prefix, unit in self._units():
            handle = unit._handle
            flat = handle.flat_param
            self._flat_params.append(flat)
            aliases: dict[str, list[str]] = {}
            for shared in flat._shared_param_infos:
                primary = _join(prefix, shared.prim_module_name, shared.prim_param_name)
                aliases.setdefault(primary, []).append(_join(prefix, shared.module_name, shared.param_name))
            offsets = _offsets(flat)
            grid, dim = self._grid(unit)
            range_numel = self._local_shard(flat).numel()
            for index, (fqn, shape, shard) in enumerate(zip(flat._fqns, flat._shapes, flat._shard_param_infos)):
                name = _join(prefix, canonical_name(fqn))
                start = shard.intra_param_start_idx if shard.in_shard else 0
                end = shard.intra_param_end_idx + 1 if shard.in_shard else 0
                requires_grad = flat._params[index].requires_grad if handle._use_orig_params else flat.requires_grad
                infos.append(
                    TensorInfo(
                        name=name,
                        aliases=tuple(aliases.get(name, ())),
                        kind="param",
                        shape=torch.Size(shape),
                        dtype=flat.dtype,
                        requires_grad=requires_grad,
                        part=Part.flat(shape, start, end),
                        layout=(
                            FlatLayout(tuple(shape), grid, dim, range_numel, offsets[index])
                            if handle.uses_sharded_strategy
                            else MeshLayout(tuple(shape), grid, (("replicate",),))
                        ),
                    )
                )
        return infos

    @staticmethod
    def _grid(unit: FSDP) -> tuple[Grid, int]:
        """The ranks a unit shards over, and the grid dim along which its flat parameter is split:
        under hybrid sharding on a 2-d device mesh, (replicas, shards) and dim 1; else its process group."""
        mesh = getattr(unit, "_device_mesh", None)
        if mesh is not None and mesh.ndim == 2:
            return grid_of(mesh)[0], 1
        return group_grid(unit._handle.process_group), 0

    @staticmethod
    def _local_shard(flat: torch.Tensor) -> torch.Tensor:
        """This rank's flat range; before FSDP's lazy init (the first forward) that is the flat parameter itself."""
        return getattr(flat, "_local_shard", flat).detach()

    def _views_of(self, flat: torch.Tensor) -> list[torch.Tensor]:
        local = self._local_shard(flat)
        return [
            local.narrow(0, shard.offset_in_shard, shard.numel_in_shard) if shard.in_shard else local.narrow(0, 0, 0)
            for shard in flat._shard_param_infos
        ]

    def _param_views(self) -> list[torch.Tensor]:
        try:  # (read at every update: at C speed, once FSDP's lazy init gave each its local shard)
            pointers = list(map(torch.Tensor.data_ptr, map(_LOCAL_SHARD, self._flat_params)))
        except AttributeError:  # (before the first forward: the flat parameters; no detach to read a pointer)
            pointers = [getattr(flat, "_local_shard", flat).data_ptr() for flat in self._flat_params]
        key = [*map(id, self._flat_params), *pointers]
        if key != self._views_key:  # new flat parameters, or FSDP moved a local shard: slice again
            self._views = [view for flat in self._flat_params for view in self._views_of(flat)]
            self._views_key = key
        return self._views

    def local_shards(self) -> list[torch.Tensor]:
        """The views of the flat parameters, then the buffers (see ``Strategy.local_shards``): the
        very list of the last call while nothing in it moved, so the update does not read the
        pointer of each of a model's many views. The views are this strategy's own, sliced again
        whenever a flat parameter's local shard moves (``_param_views``); each buffer is compared
        by object and pointer.

        Returns:
            One tensor per info of the latest ``tensors()``.
        """
        buffers = self._buffer_shards()  # (first: it refuses a call before the scan)
        views = self._param_views()
        pointers = list(map(torch.Tensor.data_ptr, buffers))
        handed = self._handed
        if (
            handed is not None
            and views is handed[0]
            and len(buffers) == len(handed[1])
            and all(map(operator.is_, buffers, handed[1]))
            and pointers == handed[2]
        ):
            return handed[3]
        shards = views + buffers
        self._handed = (views, buffers, pointers, shards)
        return shards

    def release_gathered(self) -> None:
        """Free the unsharded flat parameters the root and ``SHARD_GRAD_OP`` units keep after a forward."""
        from torch.distributed.fsdp._runtime_utils import _reshard

        for _, unit in self._units():
            handle = unit._handle
            # The root unit (and SHARD_GRAD_OP units) keep their unsharded copy after a forward,
            # and FSDP reuses it as long as it is allocated: free it.
            if handle.uses_sharded_strategy and not handle.needs_unshard():
                _reshard(unit, handle, True)
