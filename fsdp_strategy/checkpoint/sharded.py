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

[Note: tensor-parallel shards in checkpoints]
A tensor-parallel parameter's shard is rows of its TP block ([Note: tensor parallel parameters] in
engine/tensor_parallel.py). Its checkpoint DTensor lives on the 2-D (data, tensor) mesh with
FSDP2's placements and the parameter's global shape: TP ``Shard(0)`` as ``(_StridedShard(0, tp),
Shard(0))``, ``Shard(1)`` as ``(Shard(0), Shard(1))``, ``Replicate()`` as ``(Shard(0), Replicate())``
(``Replicate()`` first where data parallel does not shard). So a folder's chunks are those FSDP2
writes for the same layout, TP peers' replicated chunks are written once, and DCP reshards the
folder into any other layout: other data- or tensor-parallel sizes, a plain 1-D model, one
process. A full checkpoint gathers a TP parameter over data parallel, then over TP
(``TPSpec.full_of``); loading one, each rank takes its TP block, then its rows.

[Note: Lightning's sharded layout]
The folder holds what Lightning's ``FSDPStrategy`` writes: DCP keys ``model`` (the state dict)
and ``optimizer_<i>`` (FSDP's ``optim_state_dict``: ``state`` keyed by parameter name,
``param_groups`` naming parameters), and ``meta.pt`` with the rest of Lightning's state. So
Lightning's FSDP loads our folders, we load its folders, and Lightning's
``consolidate_checkpoint`` turns ours into a file DDP resumes from. ``fsdp_meta.json`` (plan,
checksums) is our addition. Format 1 (before this layout) kept optimizer state under
``optimizer_<i>.<name>.<key>`` and the rest in ``lightning.pt``; it still loads.

[Note: buffers keep their dtype in checkpoints]
``buffer_dtype`` casts buffers for training (BatchNorm statistics in bf16); a checkpoint holds
them in the dtype they had before, as FSDP1's does, so it loads anywhere unchanged.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from fsdp_strategy.checkpoint import layout, module_state, names, storage
from fsdp_strategy.checkpoint.chunks import untiled
from fsdp_strategy.checkpoint.layout import CheckpointError
from fsdp_strategy.checkpoint.storage import Location
from fsdp_strategy.engine import control
from fsdp_strategy.engine.diagnosis import plural
from fsdp_strategy.engine.param import ShardedParam
from fsdp_strategy.engine.view import ShardsView
from fsdp_strategy.engine.watchdog import Watchdog


def checkpoint_view(param: ShardedParam | names.WholeParam, local: torch.Tensor, view: ShardsView) -> torch.Tensor:
    """A shard-shaped tensor as the checkpoint sees it (see [Note: shards as DTensors] and [Note:
    tensor-parallel shards in checkpoints])."""
    if isinstance(param, names.WholeParam):  # [Note: ignored modules]: whole on every rank
        return local
    if param.shape == torch.Size([]):
        return local.reshape(-1)[:1].reshape(())
    rows = local.view(param.chunk_rows, *param.row_shape)
    layout = view.dtensor_layout(param)
    if layout is None:
        return rows[: param.dim0]
    from torch.distributed.tensor import DTensor

    mesh, placements, shape = layout
    real = max(0, min(param.chunk_rows, param.dim0 - param.shard_rank * param.chunk_rows))
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(rows[:real], mesh, placements, run_check=False, shape=shape, stride=stride)


def model_state(model: nn.Module | ShardsView) -> dict[str, Any]:
    """The model's state dict, by the keys its modules' own code gives ([Note: state dicts through
    the modules' own code] in module_state.py), with every sharded parameter as its shard's
    checkpoint view and buffers in their saved dtype ([Note: buffers keep their dtype in
    checkpoints]: a copy where it differs)."""
    view = ShardsView.of(model)
    dtypes = view.saved_dtypes()
    state: dict[str, Any] = {}
    for key, value in module_state.saved_state(view).items():
        if isinstance(value, ShardedParam):
            value = checkpoint_view(value, value.sharded.detach(), view)
        elif torch.is_tensor(value):
            value = value.detach().to(dtypes.get(id(value), value.dtype))
        state[key] = value
    return state


def optimizer_state(model: nn.Module | ShardsView, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """FSDP's sharded ``optim_state_dict`` layout: state keyed by name, shards as checkpoint views."""
    view = ShardsView.of(model)
    owners = names.optimizer_owners(view)
    apart = view.apart_keys(optimizer)  # an owner's state of the shard's shape is no row shard
    state: dict[str, dict[str, Any]] = {}
    for group in names.optimizer_params(optimizer, owners):
        for param in group:
            for key, value in optimizer.state.get(param.sharded, {}).items():
                shard_shaped = torch.is_tensor(value) and value.shape == param.sharded.shape
                shard_shaped = shard_shaped and key not in apart.get(id(param.sharded), ())
                local = checkpoint_view(param, value, view) if shard_shaped else value
                state.setdefault(param.fqn, {})[key] = local
    return {"state": state, "param_groups": names.named_groups(optimizer, owners)}


def plan(model: nn.Module | ShardsView) -> dict[str, Any]:
    """Names, shapes, dtypes and units of the parameters, and the buffers: the sharding plan."""
    view = ShardsView.of(model)
    dtypes = view.saved_dtypes()
    params, buffers = {}, {}
    for key, value in module_state.saved_state(view).items():
        if isinstance(value, ShardedParam):
            dtype = str(value.sharded.dtype).removeprefix("torch.")
            params[key] = {
                "dtype": dtype,
                "shape": list(value.global_shape),
                "unit": view.unit_of[value.fqn],
                "fqn": value.fqn,
            }
        elif torch.is_tensor(value):
            dtype = str(dtypes.get(id(value), value.dtype)).removeprefix("torch.")
            buffers[key] = {"dtype": dtype, "shape": list(value.shape)}
    return {"params": params, "buffers": buffers}


def dcp_writer(folder: Location) -> Any:
    """DCP's writer for ``folder``: its file-system writer on a local disk, its fsspec one elsewhere."""
    if folder.local:
        return dcp.FileSystemWriter(folder.path)
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    return FsspecWriter(folder.url)


def dcp_reader(folder: Location) -> Any:
    """DCP's reader for ``folder`` (see ``dcp_writer``)."""
    if folder.local:
        return dcp.FileSystemReader(folder.path)
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    return FsspecReader(folder.url)


def stored_tensors(path: str | os.PathLike | Location) -> tuple[Any, dict[str, tuple]]:
    """A folder's DCP metadata (read once) and ``{stored key: path}`` of its entries, e.g.
    ``("model", "net.embed.weight")`` or ``("optimizer_0", "state", "net.embed.weight", "exp_avg")``.
    A folder whose chunks do not tile a tensor exactly once (chunks.py) is a ``CheckpointError``."""
    folder = storage.locate(path)
    try:
        metadata = dcp_reader(folder).read_metadata()
    except Exception as error:  # DCP raises several types for a missing or damaged .metadata
        where = folder.child(layout.DCP_METADATA)
        raise CheckpointError(f"{where}: unreadable ({type(error).__name__}: {error})") from None
    broken = untiled(metadata)
    if broken:
        shown = "; ".join(f"{key}: {problem}" for key, problem in list(broken.items())[:3])
        more = f" (and {len(broken) - 3} more)" if len(broken) > 3 else ""
        raise CheckpointError(
            f"{folder}: cannot be read here: its stored chunks do not tile {plural(len(broken), 'tensor')} exactly "
            f"once ({shown}{more}). Written with a layout this version cannot read, or by a writer that computed wrong "
            "offsets (uneven strided shards: pytorch#168134); nothing was loaded"
        )
    return metadata, {key: tuple(path) for key, path in (metadata.planner_data or {}).items()}


def write_dcp(folder: Location, state: dict, process_group: Any = None) -> None:
    """Every rank writes its own shards into ``folder`` (collectives only for the plan)."""
    planner = dcp.DefaultSavePlanner(dedup_save_to_lowest_rank=True)
    dcp.save(state, storage_writer=dcp_writer(folder), planner=planner, process_group=process_group)


def finish_folder(
    folder: Location, meta: dict, lightning_state: dict, process_group: Any = None, dog: Watchdog | None = None
) -> None:
    """Checksum each rank's files, then rank 0 writes ``meta.pt`` and ``fsdp_meta.json`` (the
    gather of checksums watched by ``dog``)."""
    rank, _ = control.process_rank(process_group)
    mine = [n for n in storage.names(folder) if n.startswith(f"__{rank}_") and n.endswith(".distcp")]
    own = {name: storage.crc32(folder.child(name)) for name in mine}
    checksums = {}
    for part in control.all_gather_objects(own, process_group, dog):
        checksums.update(part)
    if rank == 0:
        checksums[layout.DCP_METADATA] = storage.crc32(folder.child(layout.DCP_METADATA))
        with folder.fs.open(folder.child(layout.LIGHTNING_FILE).path, "wb") as handle:
            torch.save(lightning_state, handle)
        checksums[layout.LIGHTNING_FILE] = storage.crc32(folder.child(layout.LIGHTNING_FILE))
        layout.write_meta(folder, {**meta, "checksums": checksums})


def _package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fsdp-strategy")
    except PackageNotFoundError:
        return "unknown"


def build_meta(model: nn.Module | ShardsView) -> dict[str, Any]:
    """The metadata of a checkpoint of ``model`` written now (see layout.py)."""
    view = ShardsView.of(model)
    return {
        "format_version": layout.FORMAT_VERSION,
        "package_version": _package_version(),
        "torch_version": torch.__version__,
        "world_size": control.process_rank()[1],
        "shard_world_size": view.shard_world,
        "replicate_world_size": view.replicate_world,
        "sharding_strategy": view.sharding_strategy.value,
        "tensor_parallel_size": view.tensor_parallel_size,
        "plan": plan(view),
    }


def optimizer_keys(count: int) -> list[str]:
    """The DCP keys of ``count`` optimizers in the Trainer's layout: ``optimizer_0``, ..."""
    return [f"optimizer_{index}" for index in range(count)]


MODEL_KEYS = ("model", "state_dict")  # the Trainer's layout (Lightning FSDPStrategy's); ModelParallelStrategy's


def model_key_in(tops: set[str]) -> str | None:
    """Which of ``MODEL_KEYS`` a folder's top-level DCP keys hold its model under (None: neither)."""
    return next((key for key in MODEL_KEYS if key in tops), None)


def model_key(paths: dict[str, tuple]) -> str:
    """The DCP key a folder's model is under (``{stored key: path}`` of ``stored_tensors``): one of
    ``MODEL_KEYS`` (``model`` where it holds none)."""
    return model_key_in({path[0] for path in paths.values()}) or "model"


def trainer_model_key(view: ShardsView) -> str:
    """The model's DCP key in the Trainer's layout: ``model`` (Lightning ``FSDPStrategy``'s), ``state_dict``
    for a tensor-parallel model (Lightning ``ModelParallelStrategy``'s, which then loads our folders)."""
    return "state_dict" if view.tensor_parallel_size > 1 else "model"


def prepare_state(
    model: nn.Module | ShardsView, optimizers: list[torch.optim.Optimizer], keys: tuple[str, list[str]] | None = None
) -> dict[str, Any]:
    """The tensors (and param groups) DCP writes ([Note: Lightning's sharded layout]) under
    ``keys`` (the model's and each optimizer's; default the Trainer's ``trainer_model_key``, ``optimizer_<i>``;
    Fabric's layout names them as the saved state does)."""
    view = ShardsView.of(model)
    model_key, optimizer_names = keys or (trainer_model_key(view), optimizer_keys(len(optimizers)))
    state: dict[str, Any] = {model_key: model_state(view)}
    for key, optimizer in zip(optimizer_names, optimizers):
        state[key] = optimizer_state(view, optimizer)
    return state


def save_folder(
    path: str | os.PathLike | Location,
    module: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    lightning_state: dict,
    process_group: Any = None,
) -> None:
    """Write a complete sharded checkpoint into ``path`` (every rank writes only its shards);
    returns on every rank once the folder is complete (rank 0 writes its metadata last)."""
    folder = storage.locate(path)
    view = ShardsView.of(module)
    write_dcp(folder, prepare_state(view, optimizers), process_group)
    finish_folder(folder, build_meta(view), lightning_state, process_group, view.watchdog)
    control.barrier(process_group, view.watchdog)


def _layout_words(meta: dict[str, Any]) -> str:
    """A checkpoint's (or the model's) layout in words: ``FULL_SHARD, 2 shards x 1 replica x 2 tensor-parallel``."""
    tensor = meta.get("tensor_parallel_size", 1)
    return (
        f"{meta['sharding_strategy']}, {plural(meta['shard_world_size'], 'shard')} x "
        f"{plural(meta['replicate_world_size'], 'replica')}" + (f" x {tensor} tensor-parallel" if tensor > 1 else "")
    )


def describe_resharding(
    meta: dict[str, Any] | None, model: nn.Module | ShardsView, folder: Location | None = None
) -> str:
    """What differs between a checkpoint and the model it loads into, in one paragraph (``folder``: where
    a checkpoint without ``fsdp_meta.json`` is, to name what wrote it)."""
    now = build_meta(model)
    here = f"loading at world size {now['world_size']} ({_layout_words(now)})."
    if meta is None:
        tensor = folder is not None and model_key(stored_tensors(folder)[1]) == "state_dict"
        writer = "ModelParallelStrategy" if tensor else "FSDPStrategy"
        return f"a sharded checkpoint of Lightning's {writer}; {here} Parameters are resharded as they load."
    saved_params, here_params = meta["plan"]["params"], now["plan"]["params"]
    lines = [
        f"checkpoint written by fsdp_strategy {meta.get('package_version')} at world size {meta['world_size']} "
        f"({_layout_words(meta)}); {here}"
    ]
    layouts = [(m["shard_world_size"], m["world_size"], m.get("tensor_parallel_size", 1)) for m in (meta, now)]
    if layouts[0] != layouts[1]:
        tensor = [m.get("tensor_parallel_size", 1) for m in (meta, now)]
        split = f" and from {tensor[0]} to {tensor[1]} tensor-parallel ranks" if tensor[0] != tensor[1] else ""
        lines.append(
            f"{plural(len(here_params), 'parameter')} and their optimizer states are resharded from "
            f"{meta['shard_world_size']} to {plural(now['shard_world_size'], 'shard')}{split}; the data position is "
            f"remapped to {plural(now['world_size'], 'rank')}."
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
