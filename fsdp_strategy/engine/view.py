"""ShardsView: what checkpoints read of a sharded model, in one small read-only object.

The checkpoint package never looks the Scheduler up or reads its internals: a save or a load
takes one view (``ShardsView.of(module)``) and reads the shards through it: their names,
layouts and this rank's rows, the buffers' saved dtypes, the parameters left whole, the device
mesh a DTensor of a shard lives on, and the watchdog that watches the checkpoint's own
agreements. ``gather`` is the one engine operation it offers (a collective per unit), and
``before_host_writes`` the one wait a load needs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fsdp_strategy.engine import get_scheduler
from fsdp_strategy.engine.param import ShardedParam
from fsdp_strategy.engine.tensor_parallel import data_placement, two_d_mesh
from fsdp_strategy.engine.unit import FSDPUnit

if TYPE_CHECKING:
    from fsdp_strategy.engine.runtime import Scheduler


class ShardsView:
    """A sharded model as checkpoints see it. Costs: building the id map and the mesh, once."""

    def __init__(self, module: nn.Module, scheduler: Scheduler) -> None:
        self.module = module
        self._units: tuple[FSDPUnit, ...] = tuple(scheduler.units)
        self.unit_names: tuple[str, ...] = tuple(unit.name for unit in self._units)
        self.params: tuple[ShardedParam, ...] = tuple(p for unit in self._units for p in unit.params)
        self.by_id: dict[int, ShardedParam] = {id(p.sharded): p for p in self.params}
        self.unit_of: dict[str, str] = {p.fqn: unit.name for unit in self._units for p in unit.params}
        self.ignored_params: dict[str, nn.Parameter] = dict(scheduler.ignored_params)
        self.buffer_dtypes: dict[str, torch.dtype] = dict(scheduler.saved_buffer_dtypes)
        self.sharding_strategy = scheduler.sharding_strategy
        root = self._units[0]
        self.shard_world, self.replicate_world = root.shard_comm.size, root.replicate_comm.size
        self.watchdog = scheduler.observer.watchdog
        self.mesh = _mesh(root, self.params, scheduler.device_mesh)
        self._data_sharded = root.shard_comm.size > 1
        self._data_comm = root.shard_comm if self._data_sharded else root.replicate_comm
        self._two_d: Any = None  # the (data, tensor) mesh of tensor-parallel shards, made at first use
        self._device_layer = scheduler.device_layer
        self._whole = scheduler.optimizer_steps.whole_matrix

    @property
    def tensor_parallel_size(self) -> int:
        """Ranks a tensor-parallel parameter is split over (1: a model without tensor parallel)."""
        return next((p.tp.size for p in self.params if p.tp is not None), 1)

    def saved_dtypes(self) -> dict[int, torch.dtype]:
        """``id(buffer) -> the dtype a checkpoint holds it in``, for the buffers ``buffer_dtype`` cast
        ([Note: buffers keep their dtype in checkpoints] in checkpoint/sharded.py)."""
        named = self.module.named_buffers(remove_duplicate=False)
        return {id(tensor): self.buffer_dtypes[name] for name, tensor in named if name in self.buffer_dtypes}

    def before_host_writes(self) -> None:
        """Wait for copies of shards to the device still in flight: a load is about to write the
        shards (or the average's) on the host ([Note: host and device] 1 in device.py)."""
        self._device_layer.before_host_writes_shards()

    def held_apart(self, optimizer: torch.optim.Optimizer) -> dict[int, dict[str, Any]]:
        """``id(shard) -> {key: value}``: optimizer state this rank alone holds, as the owner of a
        parameter placed whole ([Note: whole-matrix placement]); a full checkpoint gathers it."""
        return self._whole.held_apart(optimizer) if self._whole is not None else {}

    def apart_keys(self, optimizer: torch.optim.Optimizer) -> dict[int, set[str]]:
        """``id(shard) -> state keys`` its owner alone holds ([Note: whole-matrix placement]): never row
        shards, whatever their shape."""
        return self._whole.apart_keys(optimizer) if self._whole is not None else {}

    def loaded_state(self, optimizer: torch.optim.Optimizer, rows: dict[int, dict[str, bool]]) -> None:
        """A load put these shards' state of ``optimizer`` in place: ``{id(shard): {key: row-shaped in
        the checkpoint}}`` (what the placement of whole parameters reads instead of guessing by shape)."""
        if self._whole is not None:
            self._whole.loaded(optimizer, rows)

    @classmethod
    def of(cls, model: nn.Module | ShardsView) -> ShardsView:
        """The view of a model ``shard_model`` sharded (a view is returned as it is, so a save that
        passes one down builds it once)."""
        if isinstance(model, ShardsView):
            return model
        return cls(model, get_scheduler(model))

    def unit_params(self) -> list[tuple[str, tuple[ShardedParam, ...]]]:
        """``(unit name, its parameters)`` in unit order."""
        return [(unit.name, tuple(unit.params)) for unit in self._units]

    def gather(self, unit_name: str, shards: list[torch.Tensor], keep: bool = True) -> list[torch.Tensor]:
        """All-gather one shard-shaped tensor per parameter of a unit into full tensors of the
        parameters' global shapes (on the CPU); with ``keep=False`` this rank only contributes. A
        collective: every rank calls it. A unit with tensor-parallel parameters gathers them whole on
        every rank, then over tensor parallel (``TPSpec.full_of``)."""
        unit = self._units[self.unit_names.index(unit_name)]
        if not any(p.tp is not None for p in unit.params):
            return [full.to("cpu") for full in unit.gather_full(shards, keep=keep)]
        fulls = unit.gather_full(shards)
        fulls = [full if p.tp is None else p.tp.full_of(full) for p, full in zip(unit.params, fulls)]
        return [full.to("cpu") for full in fulls] if keep else []

    def dtensor_layout(self, param: ShardedParam) -> tuple[Any, tuple, torch.Size] | None:
        """``(mesh, placements, global shape)`` of the DTensor a checkpoint sees for ``param``'s shard
        ([Note: shards as DTensors] in checkpoint/sharded.py; [Note: tensor-parallel shards in
        checkpoints]); None where the shard is the whole tensor, a plain one."""
        if param.tp is None:
            return None if self.mesh is None else (*self.mesh, param.shape)
        if self._two_d is None:
            self._two_d = two_d_mesh(param.tp.mesh, self._data_comm, param.sharded.device.type)
        mesh, data_dim = self._two_d
        placements = [param.tp.placements[0]] * 2
        placements[data_dim] = data_placement(param.tp, self._data_sharded, data_first=data_dim == 0)
        return mesh, tuple(placements), param.tp.shape


def _mesh(root: FSDPUnit, params: tuple[ShardedParam, ...], device_mesh: Any) -> tuple[Any, tuple] | None:
    """The DeviceMesh and placements of the shards (None for a shard group of one). The mesh's
    device type is the shards' own: a DTensor on a mesh of another type moves its local shard
    there, so CPU-offloaded shards on the HSDP (CUDA) mesh would be copied to the GPU whole, and a
    load would fill those copies instead of the shards. Costs: no collective (the groups exist)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard

    device_type = params[0].sharded.device.type if params else "cpu"
    if device_mesh is not None:
        if device_mesh.device_type != device_type:  # the same groups, on the shards' device
            groups = [device_mesh.get_group(0), device_mesh.get_group(1)]
            names = device_mesh.mesh_dim_names
            device_mesh = DeviceMesh.from_group(groups, device_type, mesh=device_mesh.mesh, mesh_dim_names=names)
        return device_mesh, (Replicate(), Shard(0))
    if root.shard_comm.size > 1:
        return DeviceMesh.from_group(root.shard_comm.group, device_type), (Shard(0),)
    return None
