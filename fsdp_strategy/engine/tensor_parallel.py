"""Tensor parallel inside, this engine's data parallel across: what a DTensor parameter needs.

[Note: tensor parallel parameters]
A model the user split with ``parallelize_module`` holds DTensor parameters on a 1-D tensor-parallel
mesh. The engine shards each one as FSDP2 does (``FSDPParam``): its dim-0 rows are those of the
**TP-local** tensor, chunked over the data-parallel shard group like any parameter ([Note: shard
layout]); gathered, the module's attribute is an ``nn.Parameter`` wrapping a DTensor built without
autograd history over the gathered local tensor, with the original mesh, placements and global
shape, so TP's styles see what ``parallelize_module`` made and TP's collectives stay DTensor's own.
The gradient is redistributed to the parameter's placements (a ``Partial`` one becomes an
all-reduce over TP), its local tensor reduce-scattered over data parallel and divided by the
data-parallel size only: TP peers share a batch. Plain parameters of a 2-D model are TP-replicated:
every TP peer holds, and computes, the same values. Everything TP is in ``TPSpec`` and
``ShardedParam``; the unit and its hooks know nothing of it. Costs: none per step but DTensor's
own collectives, and at setup one all-gather over TP of the replicated parameters' checksums.

[Note: compiled tensor-parallel blocks]
A unit compiled by itself (``block.compile()``) whose input is a tensor-parallel module's local
output (an ``AsyncCollectiveTensor``, as a ``RowwiseParallel`` embedding returns) passed that input
no gradient inside torch 2.13: the embedding got a zero gradient, 9e-4 off one process after three
steps, with FSDP2's ``fully_shard`` too (measured, ``aot_eager`` and ``inductor`` alike). The
engine's ``PostBackward`` (iteration.py), which every unit input needing a gradient passes, hands
the unit such an input waited for, a plain tensor: compiled blocks then train exactly (float64,
2x2, with and without SequenceParallel). ``torch.compile`` of a whole 2-D model fails inside torch
("Mixing fake modes"), with FSDP2 as with this engine.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.utils._pytree import tree_leaves

from fsdp_strategy.engine.collectives import CommGroup

FULLY_SHARDED_HINT = (
    "fsdp_custom shards a model once, over data parallel: pass the model before fully_shard or FSDP wrapping, "
    "and apply only the tensor-parallel plan (parallelize_module) yourself"
)


class TPSpec(NamedTuple):
    """What a tensor-parallel parameter is besides its local rows: its 1-D mesh, placements and global
    shape and stride (immutable, taken once from the DTensor ``parallelize_module`` made)."""

    mesh: Any  # a 1-D DeviceMesh, the tensor-parallel one
    placements: tuple  # one Shard(d) or Replicate()
    shape: torch.Size  # the global shape
    stride: tuple[int, ...]  # the global stride

    @classmethod
    def of(cls, param: torch.Tensor) -> TPSpec | None:
        """The spec of a DTensor parameter; None for a plain one."""
        if not isinstance(param, DTensor):
            return None
        return cls(param.device_mesh, tuple(param.placements), param.shape, tuple(param.stride()))

    def wrap(self, local: torch.Tensor) -> DTensor:
        """``local`` (the gathered TP-local tensor) as this parameter's DTensor, without autograd history."""
        with torch.no_grad():
            return DTensor.from_local(
                local, self.mesh, self.placements, run_check=False, shape=self.shape, stride=self.stride
            )

    def local_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """The TP-local tensor of a DTensor gradient in this parameter's placements (a ``Partial`` one
        summed over TP first, as FSDP2's ``_get_grad_inner_tensor``)."""
        wait = getattr(grad, "wait", None)  # an AsyncCollectiveTensor: the result once its collective is done
        if wait is not None and not isinstance(grad, DTensor):
            grad = wait()
        if not isinstance(grad, DTensor):
            return grad
        if tuple(grad.placements) != self.placements:
            grad = grad.redistribute(grad.device_mesh, self.placements)
        return grad.to_local()

    def block_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's block of a tensor of the global shape (a view; the whole tensor when replicated):
        what a full checkpoint's tensor loads into here."""
        for placement in self.placements:
            if isinstance(placement, Shard):
                return full.chunk(self.size, placement.dim)[self.mesh.get_local_rank()]
        return full

    def full_of(self, local: torch.Tensor) -> torch.Tensor:
        """The global tensor of the gathered TP-local ``local`` (every TP peer's block). A collective
        over tensor parallel: one all-gather of the parameter's size (none when replicated)."""
        return self.wrap(local).full_tensor()

    @property
    def size(self) -> int:
        """Ranks in the tensor-parallel mesh."""
        return self.mesh.size()

    @property
    def sharded(self) -> bool:
        """Whether the parameter is split over TP (not replicated)."""
        return any(isinstance(p, Shard) for p in self.placements)

    @property
    def splits_rows(self) -> bool:
        """Whether TP splits each of its rows (``Shard(d)`` on a dimension past the first, as a
        RowwiseParallel weight's ``Shard(1)``), which the data-parallel shards never do."""
        dims = [p.dim % max(len(self.shape), 1) for p in self.placements if isinstance(p, Shard)]
        return any(dim > 0 for dim in dims)


def data_placement(tp: TPSpec, sharded: bool, data_first: bool = True) -> Any:
    """The placement on the data-parallel mesh dimension of a tensor-parallel parameter's shard, as
    FSDP2 gives it ([Note: tensor-parallel shards in checkpoints]): its TP-local rows chunked over
    data parallel. Where TP splits rows too and the data-parallel dimension comes first in the mesh
    (``data_first``: Lightning's ``(data_parallel, tensor_parallel)``), DTensor would chunk over data
    parallel first, so the rows are ``_StridedShard(0, split_factor=tp)``; otherwise ``Shard(0)``;
    ``Replicate()`` when data parallel does not shard (NO_SHARD, or one data-parallel rank)."""
    from torch.distributed.tensor.placement_types import _StridedShard

    if not sharded:
        return Replicate()
    dims = [p.dim % max(len(tp.shape), 1) for p in tp.placements if isinstance(p, Shard)]
    return _StridedShard(0, split_factor=tp.size) if 0 in dims and tp.size > 1 and data_first else Shard(0)


def two_d_mesh(tp_mesh: Any, data: CommGroup, device_type: str) -> tuple[Any, int]:
    """``(the 2-D mesh of data parallel and tensor parallel, its data-parallel dimension)`` for
    checkpoint DTensors of tensor-parallel shards ([Note: tensor-parallel shards in checkpoints]): the
    mesh ``tp_mesh`` was cut from (Lightning's ``(data_parallel, tensor_parallel)``, or the user's
    ``init_device_mesh``), on the shards' device type (CPU-offloaded shards stay on the CPU). Raises a
    ``ValueError`` naming the meshes when ``tp_mesh`` is not one dimension of a 2-D mesh whose other
    one is the data-parallel group. Costs: no collective (the groups exist)."""
    from torch.distributed.device_mesh import DeviceMesh

    root = tp_mesh._get_root_mesh()
    tensor_ranks = sorted(dist.get_process_group_ranks(tp_mesh.get_group()))
    data_ranks = sorted(dist.get_process_group_ranks(data.group)) if data.group is not None else [dist.get_rank()]
    dims = [sorted(dist.get_process_group_ranks(root.get_group(d))) for d in range(root.ndim)]
    names = list(root.mesh_dim_names or ())
    name = (tp_mesh.mesh_dim_names or (None,))[0]
    tensor_dim = names.index(name) if name in names else dims.index(tensor_ranks) if tensor_ranks in dims else 0
    if root.ndim != 2 or dims[tensor_dim] != tensor_ranks or dims[1 - tensor_dim] != data_ranks:
        raise ValueError(
            f"fsdp_custom cannot checkpoint the tensor-parallel parameters: their mesh (ranks {tensor_ranks}) is not "
            f"one dimension of a 2-D mesh whose other dimension is the data-parallel group (ranks {data_ranks}); its "
            f"root mesh is {root}. Accepted: parallelize_module on device_mesh['tensor_parallel'] of a "
            "(data_parallel, tensor_parallel) mesh, as the strategies' data_parallel_size / tensor_parallel_size make"
        )
    if root.device_type != device_type:
        groups = [root.get_group(0), root.get_group(1)]
        root = DeviceMesh.from_group(groups, device_type, mesh=root.mesh, mesh_dim_names=root.mesh_dim_names)
    return root, 1 - tensor_dim


def local_of(param: torch.Tensor) -> torch.Tensor:
    """A parameter's TP-local tensor, the one it wraps (the parameter itself when plain)."""
    return param._local_tensor if isinstance(param, DTensor) else param


def check_tensor_parallel(
    module: nn.Module,
    shard: CommGroup,
    replicate: CommGroup,
    hybrid: bool,
    synced: bool = False,
    ignored: Iterable[nn.Module] | None = None,
) -> Any:
    """Check a model's DTensor parameters before anything changes; return their TP mesh (None: a plain
    1-D model). Refused, each naming the parameter and the fix: a module already ``fully_shard``ed or
    FSDP1-wrapped; a DTensor on a mesh of more than one dimension, with another placement than one
    ``Shard(d)`` or ``Replicate()``, on a mesh other than the first one's, or one that shares ranks
    with the data-parallel group; a TP-split dimension not divisible by the TP size; HYBRID_SHARD
    with TP; TP-replicated parameters or buffers that differ across TP ranks (unless ``synced``: global rank 0's
    values are about to be broadcast, ``sync_module_states``). Costs: a check per parameter, and with
    TP one all-gather over it of the replicated parameters' checksums."""
    _refuse_wrapped(module)
    dtensors = [(name, p) for name, p in module.named_parameters() if isinstance(p, DTensor)]
    if not dtensors:
        return None
    mesh = dtensors[0][1].device_mesh
    for name, param in dtensors:
        _check_placement(name, param, mesh)
    _refuse_ignored(module, ignored or ())
    if hybrid and mesh.size() > 1:
        raise ValueError(
            "fsdp_custom: sharding_strategy='HYBRID_SHARD' with tensor parallel (tensor_parallel_size > 1) is not "
            "supported; accepted with tensor parallel: 'FULL_SHARD', 'SHARD_GRAD_OP', 'NO_SHARD'"
        )
    _check_orthogonal(mesh, shard if shard.size > 1 else replicate, dtensors[0][0])
    if not synced:  # those still on the meta device are checked once materialized (shard_with_options)
        buffers = [(name, b) for name, b in module.named_buffers() if not isinstance(b, DTensor)]
        named = [(n, t) for n, t in [*replicated_locals(module), *buffers] if not t.is_meta]
        check_replicas_agree(named, mesh)
    return mesh


def _refuse_wrapped(module: nn.Module) -> None:
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    for name, sub in module.named_modules():
        if isinstance(sub, (FSDPModule, FullyShardedDataParallel)):
            kind = "fully_shard" if isinstance(sub, FSDPModule) else "FullyShardedDataParallel"
            raise TypeError(
                f"fsdp_custom cannot shard {type(module).__name__}: {name or 'the model'} is already wrapped by "
                f"{kind}. {FULLY_SHARDED_HINT}"
            )


def _refuse_ignored(module: nn.Module, ignored: Iterable[nn.Module]) -> None:
    ids = {id(p) for sub in ignored for p in sub.parameters()}
    split = [name for name, p in module.named_parameters() if id(p) in ids and isinstance(p, DTensor)]
    if split:
        shown = ", ".join(split[:3]) + (f" and {len(split) - 3} more" if len(split) > 3 else "")
        raise TypeError(
            f"fsdp_custom: ignored_modules hold the tensor-parallel parameters {shown}: an ignored module is left "
            "whole on each rank, its gradients the rank's own, which a tensor-parallel block cannot be (clipping and "
            "reductions would mix DTensors and plain tensors). Accepted: tensor-parallel modules outside "
            "ignored_modules"
        )


def _check_placement(name: str, param: DTensor, mesh: Any) -> None:
    placements = tuple(param.placements)
    if param.device_mesh.ndim != 1 or len(placements) != 1:
        raise TypeError(
            f"fsdp_custom cannot shard the DTensor parameter {name!r}: its mesh has {param.device_mesh.ndim} "
            f"dimensions {placements}; accepted: a 1-D tensor-parallel mesh (parallelize_module on "
            f"device_mesh['tensor_parallel']). {FULLY_SHARDED_HINT}"
        )
    if not isinstance(placements[0], (Shard, Replicate)):
        raise TypeError(
            f"fsdp_custom cannot shard the DTensor parameter {name!r}: its placement is {placements[0]}; "
            "accepted: Shard(d) or Replicate()"
        )
    if dist.get_process_group_ranks(param.device_mesh.get_group()) != dist.get_process_group_ranks(mesh.get_group()):
        raise ValueError(
            f"fsdp_custom: the DTensor parameter {name!r} lives on another mesh than the model's other tensor-parallel "
            "parameters; accepted: one tensor-parallel mesh for the whole model"
        )
    if isinstance(placements[0], Shard):
        dim, size = placements[0].dim, param.device_mesh.size()
        if param.shape[dim] % size:
            raise ValueError(
                f"fsdp_custom: the tensor-parallel parameter {name!r} of shape {tuple(param.shape)} is split on "
                f"dimension {dim} ({param.shape[dim]}), which {size} tensor-parallel ranks do not divide; accepted: "
                f"a dimension divisible by tensor_parallel_size={size} (pad the layer, or leave it unsplit)"
            )


def _check_orthogonal(mesh: Any, data: CommGroup, name: str) -> None:
    tensor_ranks = set(dist.get_process_group_ranks(mesh.get_group()))
    data_ranks = set(dist.get_process_group_ranks(data.group)) if data.group is not None else {dist.get_rank()}
    if tensor_ranks & data_ranks != {dist.get_rank()}:
        raise ValueError(
            f"fsdp_custom: the tensor-parallel mesh of {name!r} (ranks {sorted(tensor_ranks)}) shares ranks with the "
            f"data-parallel group (ranks {sorted(data_ranks)}): was the model sharded by fully_shard, or parallelized "
            "on the data-parallel dimension? Accepted: a tensor-parallel mesh that crosses the data-parallel group, "
            "device_mesh['tensor_parallel'] of a (data_parallel, tensor_parallel) mesh"
        )


def replicated_locals(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The TP-replicated parameters of a model (plain ones and ``Replicate()`` DTensors), their
    local tensors by name."""
    return [
        (name, local_of(p))
        for name, p in module.named_parameters()
        if not isinstance(p, DTensor) or not any(isinstance(x, Shard) for x in p.placements)
    ]


@torch.no_grad()
def check_replicas_agree(named: list[tuple[str, torch.Tensor]], mesh: Any, materialized: bool = False) -> None:
    """Raise naming the TP-replicated tensors of ``named`` whose values differ across the TP ranks
    of ``mesh`` (``materialized``: just made from the meta device). Costs: a checksum per tensor and
    one all-gather of them over TP (on the mesh's device: NCCL takes no CPU tensors)."""
    if not named or mesh.size() == 1 or any(isinstance(t, FakeTensor) for _, t in named):
        return  # a memory plan's fake tensors hold no values ([Note: memory plan] in plan/run.py)
    device = (
        torch.device("cpu")
        if mesh.device_type == "cpu"
        else torch.device(mesh.device_type, torch.cuda.current_device())
    )
    sums = torch.stack([_checksum(t).to(device) for _, t in named])
    rows = [torch.empty_like(sums) for _ in range(mesh.size())]
    dist.all_gather(rows, sums, group=mesh.get_group())  # setup only, not watched: before any watchdog
    everyone, mine = torch.stack(rows).cpu(), sums.cpu()
    differ = [name for i, (name, _) in enumerate(named) if bool((everyone[:, i] != mine[i]).any())]
    if differ:
        shown = ", ".join(differ[:3]) + (f" and {len(differ) - 3} more" if len(differ) > 3 else "")
        when = "after their materialization from the meta device" if materialized else "at setup"
        raise ValueError(
            f"fsdp_custom: the tensor-parallel-replicated parameters or buffers {shown} differ across the "
            "tensor-parallel ranks "
            f"{when}; each TP peer would train its own copy. Initialize them the same on every rank (the same seed "
            "before building the model: seed_everything), or pass sync_module_states=True"
        )


def _checksum(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.detach().reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    if flat.is_floating_point():
        weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=flat.device)
        return (flat.to(torch.float64) * weights).sum()
    return flat.to(torch.float64).sum()


DOUBLE_BACKWARD_WITH_TENSOR_PARALLEL = (
    "fsdp_custom: a backward with create_graph=True (a gradient penalty, higher-order gradients) on a model with "
    "tensor-parallel parameters is refused: torch 2.13's tensor parallel fails in a double backward on its own "
    "('got mixed torch.Tensor and DTensor') and FSDP2 with it too. Train a model that needs a double backward "
    "without a tensor-parallel plan (data parallel and sharding only: tensor_parallel_size=1)"
)


def refuse_double_backward_through(modules: Iterable[nn.Module]) -> list[Any]:
    """[Note: a double backward through tensor parallel] A backward with ``create_graph=True`` that
    passes no unit's output hook (a gradient penalty computed inside the root's forward: a Trainer's
    ``training_step`` with the whole model one unit, ``torch.autograd.grad`` of an activation) is
    refused where it passes a module holding tensor-parallel parameters: forward hooks on those
    modules put, while grad is enabled, a hook on each output tensor that raises in a backward run
    with grad enabled. Returns the hooks' handles. Costs: one tensor hook per output of such a
    module per forward with grad."""

    def check(grad: torch.Tensor) -> None:
        if torch.is_grad_enabled():
            raise RuntimeError(DOUBLE_BACKWARD_WITH_TENSOR_PARALLEL)

    @torch._dynamo.disable
    def hook(module: nn.Module, args: Any, output: Any) -> None:
        if torch.is_grad_enabled():
            for tensor in tree_leaves(output):
                if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                    tensor.register_hook(check)

    return [module.register_forward_hook(hook) for module in modules]
