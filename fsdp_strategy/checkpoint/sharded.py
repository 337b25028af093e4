"""Sharded checkpoints with ``torch.distributed.checkpoint``: no gather, any world size on load.

[Note: shards as DTensors]
At rest a shard is a plain padded tensor. For a checkpoint each parameter (and each
shard-shaped optimizer state) is exposed, without a copy, as a DTensor with ``Shard(0)``
placement over the shard group (``(Replicate(), Shard(0))`` over an HSDP mesh) whose local
tensor is the shard's real rows (padding cut off), so the folder is an ordinary DCP
checkpoint: torch's ``dcp_to_torch_save`` reads it, and loading into the shards of another
world size reshards. With a shard group of one (one rank, NO_SHARD) the full tensors are
plain tensors. A 0-dim parameter cannot be sharded: it is a plain tensor that the lowest rank
(shard rank 0, which holds its value) writes; on load only shard rank 0 keeps it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from fsdp_strategy.checkpoint import layout, names
from fsdp_strategy.checkpoint.layout import CheckpointError
from fsdp_strategy.engine import Scheduler, collectives, get_scheduler
from fsdp_strategy.engine.param import ShardedParam

log = logging.getLogger(__name__)
_MESH_ATTR = "_checkpoint_mesh"


def _mesh(scheduler: Scheduler) -> tuple[Any, tuple] | None:
    """The DeviceMesh and placements of the shards (None for a shard group of one)."""
    if _MESH_ATTR not in scheduler.__dict__:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import Replicate, Shard

        comm = scheduler.root_unit.shard_comm
        device_type = scheduler.sharded_params()[0].sharded.device.type if scheduler.sharded_params() else "cpu"
        if scheduler.device_mesh is not None:
            info = (scheduler.device_mesh, (Replicate(), Shard(0)))
        elif comm.size > 1:
            info = (DeviceMesh.from_group(comm.group, device_type), (Shard(0),))
        else:
            info = None
        scheduler.__dict__[_MESH_ATTR] = info
    return scheduler.__dict__[_MESH_ATTR]


def _view(param: ShardedParam, local: torch.Tensor, mesh: tuple[Any, tuple] | None) -> torch.Tensor:
    """A shard-shaped tensor as the checkpoint sees it (see [Note: shards as DTensors])."""
    if param.shape == torch.Size([]):
        return local.reshape(-1)[:1].reshape(())
    rows = local.view(param.chunk_rows, *param.row_shape)
    if mesh is None:
        return rows[: param.dim0]
    from torch.distributed.tensor import DTensor

    real = max(0, min(param.chunk_rows, param.dim0 - param.shard_rank * param.chunk_rows))
    stride = torch.empty(param.shape, device="meta").stride()
    return DTensor.from_local(rows[:real], mesh[0], mesh[1], run_check=False, shape=param.shape, stride=stride)


def model_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict with every parameter as its shard's checkpoint view."""
    scheduler = get_scheduler(module)
    mesh = _mesh(scheduler)
    by_id = {id(p.sharded): p for p in scheduler.sharded_params()}
    state = {}
    for name, value in module.state_dict(keep_vars=True).items():
        param = by_id.get(id(value))
        state[name] = _view(param, param.sharded.detach(), mesh) if param is not None else value.detach()
    return state


def optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, list[dict], dict]:
    """(tensors keyed by parameter name, param groups naming parameters, per-key layout)."""
    owners, mesh = names.shard_owners(module), _mesh(get_scheduler(module))
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    layouts: dict[str, dict[str, dict]] = {}
    for group in optimizer.param_groups:
        for tensor in group["params"]:
            param = owners[id(tensor)]
            for key, value in optimizer.state.get(tensor, {}).items():
                if not torch.is_tensor(value):
                    raise CheckpointError(f"optimizer state {param.fqn!r}/{key!r} is not a tensor ({type(value)})")
                sharded = value.shape == param.sharded.shape
                tensors.setdefault(param.fqn, {})[key] = _view(param, value, mesh) if sharded else value
                layouts.setdefault(param.fqn, {})[key] = {
                    "sharded": sharded,
                    "dtype": str(value.dtype).removeprefix("torch."),
                    "shape": list(value.shape),
                }
    return tensors, names.named_groups(optimizer, owners), layouts


def plan(module: nn.Module) -> dict[str, Any]:
    """Names, shapes, dtypes and units of the parameters, and the buffers: the sharding plan."""
    scheduler = get_scheduler(module)
    unit_of = {p.fqn: unit.name for unit in scheduler.units for p in unit.params}
    by_id = names.shard_owners(module)
    params, buffers = {}, {}
    for name, value in module.state_dict(keep_vars=True).items():
        param = by_id.get(id(value))
        entry = {"dtype": str(value.dtype).removeprefix("torch.")}
        if param is not None:
            params[name] = {**entry, "shape": list(param.shape), "unit": unit_of[param.fqn], "fqn": param.fqn}
        else:
            buffers[name] = {**entry, "shape": list(value.shape)}
    return {"params": params, "buffers": buffers}


def write_dcp(folder: Path, state: dict, process_group: Any = None) -> None:
    """Every rank writes its own shards into ``folder`` (collectives only for the plan)."""
    writer = dcp.FileSystemWriter(str(folder))
    planner = dcp.DefaultSavePlanner(dedup_save_to_lowest_rank=True)
    dcp.save(state, storage_writer=writer, planner=planner, process_group=process_group)


def finish_folder(folder: Path, meta: dict, lightning_state: dict, process_group: Any = None) -> None:
    """Checksum each rank's files, then rank 0 writes ``fsdp_meta.json`` and ``lightning.pt``."""
    rank, _ = collectives.process_rank(process_group)
    own = {p.name: layout.file_crc32(p) for p in folder.glob(f"__{rank}_*.distcp")}
    checksums = {}
    for part in collectives.all_gather_objects(own, process_group):
        checksums.update(part)
    if rank == 0:
        checksums[layout.DCP_METADATA] = layout.file_crc32(folder / layout.DCP_METADATA)
        torch.save(lightning_state, folder / layout.LIGHTNING_FILE)
        checksums[layout.LIGHTNING_FILE] = layout.file_crc32(folder / layout.LIGHTNING_FILE)
        layout.write_meta(folder, {**meta, "checksums": checksums})


def check_compatible(folder: Path, meta: dict, module: nn.Module, strict: bool) -> None:
    """Missing or unexpected keys and shape mismatches, named with the file and the key."""
    current = plan(module)
    saved = {**meta["plan"]["params"], **meta["plan"]["buffers"]}
    here = {**current["params"], **current["buffers"]}
    where = folder / layout.META_FILE
    missing, unexpected = sorted(set(here) - set(saved)), sorted(set(saved) - set(here))
    if strict and (missing or unexpected):
        raise CheckpointError(
            f"{where}: checkpoint of another model: keys missing from it {missing}, unexpected keys {unexpected}"
        )
    for name in sorted(set(here) & set(saved)):
        if saved[name]["shape"] != here[name]["shape"]:
            raise CheckpointError(
                f"{where}: key {name!r} has shape {tuple(saved[name]['shape'])} in the checkpoint, "
                f"{tuple(here[name]['shape'])} in the model"
            )


def verify_folder(folder: Path, meta: dict, process_group: Any = None) -> None:
    """Each rank checks a share of the files; any problem is raised on every rank."""
    rank, world = collectives.process_rank(process_group)
    files = sorted(meta.get("checksums", {}))
    problems = layout.verify_files(folder, meta["checksums"], files[rank::world])
    found = [p for part in collectives.all_gather_objects(problems, process_group) for p in part]
    if found:
        raise CheckpointError("checkpoint is damaged: " + "; ".join(found))


def _optimizer_targets(module: nn.Module, optimizer: torch.optim.Optimizer, layouts: dict, where: Path) -> tuple:
    """Empty local tensors for each saved optimizer state, and their checkpoint views."""
    owners, mesh = names.shard_owners(module), _mesh(get_scheduler(module))
    names.check_names(optimizer, owners, layouts, where)
    locals_, views = {}, {}
    by_fqn = {p.fqn: p for p in owners.values()}
    for fqn, keys in layouts.items():
        param = by_fqn[fqn]
        for key, spec in keys.items():
            dtype = getattr(torch, spec["dtype"])
            shape = param.sharded.shape if spec["sharded"] else spec["shape"]
            local = torch.zeros(shape, dtype=dtype, device=param.sharded.device)
            locals_.setdefault(fqn, {})[key] = local
            views.setdefault(fqn, {})[key] = _view(param, local, mesh) if spec["sharded"] else local
    return locals_, views


def load_folder(
    folder: Path,
    module: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    strict: bool = True,
    process_group: Any = None,
    meta: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Load model (and optimizer) state into the shards, at any world size; return Lightning's state.

    ``meta``: the folder's ``fsdp_meta.json`` if the caller has already read it.
    """
    meta = meta if meta is not None else layout.read_meta(folder)
    check_compatible(folder, meta, module, strict)
    verify_folder(folder, meta, process_group)
    lightning_state = torch.load(folder / layout.LIGHTNING_FILE, map_location="cpu", weights_only=False)
    state: dict[str, Any] = {"model": model_state(module)}
    saved_optimizers = lightning_state.pop("optimizer_layouts", [])
    groups = lightning_state.pop("optimizer_groups", [])
    if optimizers and len(saved_optimizers) != len(optimizers):
        raise CheckpointError(
            f"{folder / layout.LIGHTNING_FILE}: key 'optimizer_layouts' holds {len(saved_optimizers)} optimizers, "
            f"the model configures {len(optimizers)}"
        )
    targets = []
    for index, optimizer in enumerate(optimizers):
        locals_, views = _optimizer_targets(module, optimizer, saved_optimizers[index], folder / layout.META_FILE)
        targets.append(locals_)
        state[f"optimizer_{index}"] = views
    dcp.load(state, storage_reader=dcp.FileSystemReader(str(folder)), process_group=process_group)
    _clear_scalar_padding(module)
    owners = names.shard_owners(module)
    for optimizer, locals_, saved_groups in zip(optimizers, targets, groups):
        names.load_named_state(optimizer, owners, locals_, saved_groups, folder / layout.LIGHTNING_FILE)
    return lightning_state


def _clear_scalar_padding(module: nn.Module) -> None:
    """A 0-dim parameter was loaded on every rank; only shard rank 0 keeps it."""
    for param in get_scheduler(module).sharded_params():
        if param.shape == torch.Size([]) and param.shard_rank != 0:
            param.sharded.data.zero_()


def _package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fsdp-strategy")
    except PackageNotFoundError:
        return "unknown"


def build_meta(module: nn.Module) -> dict[str, Any]:
    """The metadata of a checkpoint of ``module`` written now (see layout.py)."""
    scheduler = get_scheduler(module)
    unit = scheduler.root_unit
    return {
        "format_version": layout.FORMAT_VERSION,
        "package_version": _package_version(),
        "torch_version": torch.__version__,
        "world_size": collectives.process_rank()[1],
        "shard_world_size": unit.shard_comm.size,
        "replicate_world_size": unit.replicate_comm.size,
        "sharding_strategy": scheduler.sharding_strategy.value,
        "plan": plan(module),
    }


def prepare_state(module: nn.Module, optimizers: list[torch.optim.Optimizer]) -> tuple[dict, dict]:
    """(the tensors DCP writes, the optimizer layouts and groups that go to lightning.pt)."""
    state: dict[str, Any] = {"model": model_state(module)}
    layouts, groups = [], []
    for index, optimizer in enumerate(optimizers):
        tensors, optimizer_groups, optimizer_layouts = optimizer_state(module, optimizer)
        state[f"optimizer_{index}"] = tensors
        layouts.append(optimizer_layouts)
        groups.append(optimizer_groups)
    return state, {"optimizer_layouts": layouts, "optimizer_groups": groups}


def save_folder(
    folder: Path,
    module: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    lightning_state: dict,
    process_group: Any = None,
) -> None:
    """Write a complete sharded checkpoint into ``folder`` (every rank writes only its shards)."""
    state, optimizer_info = prepare_state(module, optimizers)
    write_dcp(folder, state, process_group)
    finish_folder(folder, build_meta(module), {**lightning_state, **optimizer_info}, process_group)


def describe_resharding(meta: dict[str, Any], module: nn.Module) -> str:
    """What differs between a checkpoint and the model it loads into, in one paragraph."""
    now = build_meta(module)
    saved_params, here_params = meta["plan"]["params"], now["plan"]["params"]
    lines = [
        f"checkpoint written by fsdp_strategy {meta.get('package_version')} at world size {meta['world_size']} "
        f"({meta['sharding_strategy']}, {meta['shard_world_size']} shards x {meta['replicate_world_size']} "
        f"replicas); loading at world size {now['world_size']} ({now['sharding_strategy']}, "
        f"{now['shard_world_size']} shards x {now['replicate_world_size']} replicas)."
    ]
    if (meta["shard_world_size"], meta["world_size"]) != (now["shard_world_size"], now["world_size"]):
        lines.append(
            f"{len(here_params)} parameters and their optimizer states are resharded from "
            f"{meta['shard_world_size']} to {now['shard_world_size']} shards; the data position is remapped "
            f"to {now['world_size']} ranks."
        )
    else:
        lines.append("same layout: every rank reads back its own shards.")
    changed = {
        name: (saved_params[name]["dtype"], spec["dtype"])
        for name, spec in here_params.items()
        if name in saved_params and saved_params[name]["dtype"] != spec["dtype"]
    }
    lines.append(f"dtype changes: {changed}." if changed else "dtypes unchanged.")
    return " ".join(lines)
