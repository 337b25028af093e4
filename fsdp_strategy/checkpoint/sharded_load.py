"""Loading sharded checkpoint folders: ours (formats 1 and 2) and Lightning FSDP's, at any world
size, straight into the shards ([Note: shards as DTensors] and [Note: Lightning's sharded layout]
in sharded.py). Everything about the folder is checked before a tensor is copied: keys and shapes
against the model, checksums, the optimizer's parameters.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from fsdp_strategy.checkpoint import layout, module_state, names, storage
from fsdp_strategy.checkpoint.layout import CheckpointError, shortened
from fsdp_strategy.checkpoint.sharded import (
    MODEL_KEYS,
    checkpoint_view,
    dcp_reader,
    model_key_in,
    optimizer_keys,
    stored_tensors,
)
from fsdp_strategy.checkpoint.storage import Location
from fsdp_strategy.engine import control
from fsdp_strategy.engine.view import ShardsView


def verify_folder(folder: Location, meta: dict, process_group: Any = None, dog: Any = None) -> None:
    """Each rank checks a share of the files; any problem is raised on every rank (the gather of
    problems watched by ``dog``)."""
    rank, world = control.process_rank(process_group)
    files = sorted(meta.get("checksums", {}))
    problems = layout.verify_files(folder, meta["checksums"], files[rank::world])
    found = [p for part in control.all_gather_objects(problems, process_group, dog) for p in part]
    if found:
        raise CheckpointError("checkpoint is damaged: " + "; ".join(found))


class _StoredKeys:
    """The folder's DCP keys: ``flat key -> path`` (e.g. ``("optimizer_0", "state", name, "exp_avg")``)
    and the stored size of each tensor (None for an object)."""

    def __init__(self, folder: Location) -> None:
        metadata, self.paths = stored_tensors(folder)
        self.metadata = metadata
        self.sizes = {
            key: tuple(info.size) if hasattr(info, "size") else None
            for key, info in metadata.state_dict_metadata.items()
        }
        self.dtypes = {
            key: getattr(getattr(info, "properties", None), "dtype", None)
            for key, info in metadata.state_dict_metadata.items()
        }

    def model(self, model_key: str = "model") -> dict[str, str]:
        """``state-dict name -> flat key`` of the model's entries (under ``model_key``)."""
        return {path[1]: key for key, path in self.paths.items() if path[0] == model_key and len(path) == 2}

    def tops(self) -> set[str]:
        """The top-level keys the folder holds."""
        return {path[0] for path in self.paths.values()}

    def optimizer(self, prefix: str, format_version: int) -> tuple[dict, dict[str, tuple], dict]:
        """(``(parameter name, state key) -> flat key``, ``flat key -> path`` of the param groups'
        entries, ``(parameter name, state key) -> {flat key -> path}`` of state values DCP stored
        flattened: lists and dicts, SOAP's preconditioners) of the optimizer stored under ``prefix``."""
        state, groups, nested = {}, {}, {}
        for key, path in self.paths.items():
            if path[0] != prefix:
                continue
            if format_version == 1 and len(path) == 3:
                state[(path[1], path[2])] = key
            elif len(path) == 4 and path[1] == "state":
                state[(path[2], path[3])] = key
            elif len(path) > 4 and path[1] == "state":
                nested.setdefault((path[2], path[3]), {})[key] = path
            elif path[1] == "param_groups":
                groups[key] = path
        return state, groups, nested


def _object_targets(stored: _StoredKeys, paths: dict[str, tuple]) -> dict[str, Any]:
    """Targets for stored entries that are plain values (param groups): tensors to fill, or None
    where DCP hands back the stored object."""
    return {
        key: None if stored.sizes[key] is None else torch.zeros(stored.sizes[key], dtype=stored.dtypes[key])
        for key in paths
    }


def _nested(flat: dict[str, Any], paths: dict[str, tuple]) -> Any:
    """Rebuild the nested value (lists and dicts) that DCP flattened into ``paths`` (prefix dropped)."""
    from torch.distributed.checkpoint._nested_dict import unflatten_state_dict

    rebuilt = unflatten_state_dict({key: flat[key] for key in paths}, paths)
    return next(iter(rebuilt.values()))


def _optimizer_targets(
    view: ShardsView,
    optimizer: torch.optim.Optimizer,
    stored: _StoredKeys,
    state_keys: dict[tuple[str, str], str],
    where: Location,
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """(``flat key -> tensor DCP loads into``, ``name -> {state key -> this rank's tensor}``); a state
    for a parameter the optimizer does not hold is an error before anything is loaded."""
    owners = names.optimizer_owners(view)
    by_fqn = {p.fqn: p for p in owners.values()}
    unknown = sorted({fqn for fqn, _ in state_keys} - set(by_fqn))
    if unknown:
        raise CheckpointError(
            f"{where}: checkpoint of another model? It has optimizer state for {len(unknown)} parameters the model "
            f"does not have: {shortened(unknown)}"
        )
    held = {p.fqn for group in names.optimizer_params(optimizer, owners) for p in group}
    unheld = sorted({fqn for fqn, _ in state_keys} - held)
    if unheld:
        raise CheckpointError(
            f"{where}: checkpoint of another model? It has optimizer state for {len(unheld)} parameters this "
            f"optimizer does not hold: {shortened(unheld)}"
        )
    flat, local_state = {}, {}
    for (fqn, key), flat_key in state_keys.items():
        param, size, dtype = by_fqn[fqn], stored.sizes[flat_key], stored.dtypes[flat_key]
        if size is None:  # a non-tensor entry: DCP hands back the object itself
            flat[flat_key] = None
            continue
        if names.is_full_shaped(param, key, size):
            local = torch.zeros(param.sharded.shape, dtype=dtype, device=param.sharded.device)
            flat[flat_key] = checkpoint_view(param, local, view)
        else:
            local = torch.zeros(size, dtype=dtype)
            flat[flat_key] = local
        local_state.setdefault(fqn, {})[key] = local
    return flat, local_state


def load_folder(
    path: str | os.PathLike | Location,
    module: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    strict: bool = True,
    process_group: Any = None,
    meta: dict[str, Any] | None = None,
    weights_only: bool | None = None,
) -> dict[str, Any]:
    """Load model (and optimizer) state into the shards, at any world size; return Lightning's state.

    Reads our folders and Lightning FSDP's ([Note: Lightning's sharded layout]). ``meta``: the
    folder's ``fsdp_meta.json`` if the caller has read it. With ``strict=False`` the keys both
    sides have are loaded. ``weights_only``: as ``torch.load``'s, for ``meta.pt``.
    """
    folder = storage.locate(path)
    meta = meta if meta is not None else layout.folder_meta(folder)
    rest = read_rest(folder, meta, weights_only)
    load_tensors(folder, module, optimizers, rest, strict, process_group, meta)
    return rest


def read_rest(folder: Location, meta: dict[str, Any] | None, weights_only: bool | None = None) -> dict[str, Any]:
    """Lightning's state of a folder (``meta.pt``; ``lightning.pt`` in format 1), read on the CPU;
    ``{}`` for a DCP folder without one (FSDP2's, torchtitan's)."""
    if meta is None and not layout.has_lightning_state(folder):
        return {}
    version = meta["format_version"] if meta is not None else layout.FORMAT_VERSION
    return layout.load_object(
        folder.child(layout.LEGACY_LIGHTNING_FILE if version == 1 else layout.LIGHTNING_FILE), weights_only
    )


def load_tensors(
    folder: Location,
    module: nn.Module | ShardsView,
    optimizers: list[torch.optim.Optimizer],
    rest: dict[str, Any],
    strict: bool = True,
    process_group: Any = None,
    meta: dict[str, Any] | None = None,
    keys: tuple[str, list[str]] | None = None,
    with_model: bool = True,
) -> None:
    """Load a folder's model (and optimizer) tensors into the shards (``rest``: its ``read_rest``;
    format 1 keeps the param groups there). ``keys``: the model's and each optimizer's DCP key
    (Fabric's layout, named by the loaded state); default the Trainer's. ``with_model=False``:
    the optimizers' only (the model's were loaded before: the folder was checked then)."""
    version = meta["format_version"] if meta is not None else layout.FORMAT_VERSION
    view = ShardsView.of(module)
    if meta is not None and with_model:
        verify_folder(folder, meta, process_group, view.watchdog)
    stored = _StoredKeys(folder)
    if meta is None and with_model:  # no checksums (Lightning's, FSDP2's folders): the files must hold what it names
        check_shard_files(folder, stored.metadata)
    model_key, prefixes = _resolve_keys(stored, folder, len(optimizers), keys)
    flat: dict[str, Any] = {}
    if with_model:
        model_keys = stored.model(model_key)
        shapes = {name: stored.sizes[key] for name, key in model_keys.items() if stored.sizes[key] is not None}
        values = _read_values(folder, stored, model_key, process_group)
        where = folder.child(layout.DCP_METADATA)
        dtypes = {name: stored.dtypes[key] for name, key in model_keys.items() if name in shapes}
        stand_ins = {**values, **dict.fromkeys(shapes)}
        plan = module_state.load_plan(view, stand_ins, strict, where, shapes=shapes, dtypes=dtypes)
        flat, plain = _model_targets(view, stored, model_keys, shapes, plan)
    legacy_groups = rest.pop("optimizer_groups", []) if optimizers else []
    if optimizers:
        rest.pop("optimizer_layouts", None)
    loaded = []
    for index, prefix in enumerate(prefixes):
        state_keys, group_paths, nested = stored.optimizer(prefix, version)
        targets, local_state = _optimizer_targets(view, optimizers[index], stored, state_keys, folder)
        flat.update(targets)
        flat.update(_object_targets(stored, group_paths))
        for paths in nested.values():
            flat.update(_object_targets(stored, paths))
        loaded.append((local_state, state_keys, group_paths, targets, nested))
    view.before_host_writes()
    try:
        dcp.load(flat, storage_reader=dcp_reader(folder), process_group=process_group)
    except dcp.CheckpointException as error:  # every rank's failure, each with a long traceback
        causes = [f"rank {rank}: {type(exc).__name__}: {exc}" for rank, (exc, _) in error.failures.items()]
        raise CheckpointError(f"{folder}: reading the shard files failed ({'; '.join(causes)})") from None
    if with_model:
        for params in plan.params.values():  # one checkpoint tensor loaded into several parameters
            for other in params[1:]:
                other.sharded.data.copy_(params[0].sharded)
        module_state.load_plain(view, {**values, **plain, **_meta(shapes, plan)}, plan)
        _clear_scalar_padding(view)
    _load_optimizer_states(view, folder, stored, optimizers, loaded, flat, legacy_groups)


def check_shard_files(folder: Location, metadata: Any) -> None:
    """Raise a ``CheckpointError`` naming each shard file the DCP ``metadata`` reads from that is missing
    or shorter than the bytes it names (a folder without checksums: a lost or truncated file would load
    half). Costs: one size query per file."""
    needed: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        path = getattr(info, "relative_path", None)
        if path is not None:
            needed[path] = max(needed.get(path, 0), info.offset + info.length)
    problems = []
    for name, size in sorted(needed.items()):
        where = folder.child(name)
        found = folder.fs.size(where.path) if folder.fs.exists(where.path) else None
        if found is None or found < size:
            problems.append(f"{name} is missing" if found is None else f"{name} holds {found} of {size} bytes")
    if problems:
        raise CheckpointError(f"{folder}: shard files are damaged ({'; '.join(problems)}); nothing was loaded")


def _load_optimizer_states(
    view: ShardsView,
    folder: Location,
    stored: _StoredKeys,
    optimizers: list[torch.optim.Optimizer],
    loaded: list[tuple],
    flat: dict[str, Any],
    legacy_groups: list[Any],
) -> None:
    """Put each optimizer's state, read into ``flat`` (its targets in ``loaded``), into the optimizer."""
    owners = names.optimizer_owners(view)
    by_fqn = {p.fqn: p for p in owners.values()}
    for index, (optimizer, (local_state, state_keys, group_paths, targets, nested)) in enumerate(
        zip(optimizers, loaded)
    ):
        for (fqn, key), flat_key in state_keys.items():
            if targets[flat_key] is None:
                local_state.setdefault(fqn, {})[key] = flat[flat_key]
        for (fqn, key), paths in nested.items():
            local_state.setdefault(fqn, {})[key] = _nested(flat, paths)["state"][fqn][key]
        groups = _nested(flat, group_paths)["param_groups"] if group_paths else legacy_groups[index]
        rows = {
            (fqn, key): stored.sizes[flat_key] is not None
            and names.is_full_shaped(by_fqn[fqn], key, stored.sizes[flat_key])
            for (fqn, key), flat_key in state_keys.items()
        }
        loaded_state = {"state": local_state, "param_groups": groups}
        view.loaded_state(
            optimizer, names.load_state(optimizer, owners, loaded_state, folder, cut_rows=False, rows=rows)
        )


def _read_values(folder: Location, stored: _StoredKeys, model_key: str, process_group: Any) -> dict[str, Any]:
    """The model's entries a folder holds as objects or nested values (extra state: DCP stores a
    dict entry flattened), read before the tensors and rebuilt."""
    from torch.distributed.checkpoint._nested_dict import unflatten_state_dict

    targets, paths = {}, {}
    for key, path in stored.paths.items():
        if path[0] != model_key or (len(path) == 2 and stored.sizes[key] is not None):
            continue
        size = stored.sizes[key]
        targets[key] = None if size is None else torch.zeros(size, dtype=stored.dtypes[key])
        paths[key] = path
    if not targets:
        return {}
    dcp.load(targets, storage_reader=dcp_reader(folder), process_group=process_group)
    return dict(unflatten_state_dict(targets, paths)[model_key])


def _model_targets(
    view: ShardsView,
    stored: _StoredKeys,
    model_keys: dict[str, str],
    shapes: dict[str, tuple],
    plan: module_state.LoadPlan,
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(``flat key -> what DCP loads into``, ``name -> a tensor loaded whole``): a checkpoint view of
    the shard for an entry that loads into sharded parameters, a whole tensor for a buffer or a
    whole parameter (loaded through the model's own code afterwards); unexpected entries are not read."""
    flat, plain = {}, {}
    for name, key in model_keys.items():
        if name in plan.params:
            first = plan.params[name][0]
            flat[key] = checkpoint_view(first, first.sharded.detach(), view)
        elif name in shapes and name not in plan.unexpected:
            flat[key] = plain[name] = torch.zeros(shapes[name], dtype=stored.dtypes[key])
    return flat, plain


def _meta(shapes: dict[str, tuple], plan: module_state.LoadPlan) -> dict[str, torch.Tensor]:
    """Meta stand-ins of the entries loaded into shards, for the plain ``load_state_dict``."""
    return {name: torch.empty(shapes[name], device="meta") for name in plan.params}


def saved_group_counts(folder: Location) -> list[int | None]:
    """Per optimizer of the Trainer's layout (``optimizer_<i>``, in order), how many param groups its
    stored state has (None where the folder does not say: format 1). Reads the metadata only."""
    stored = _StoredKeys(folder)
    counts: dict[int, set] = {}
    for path in stored.paths.values():
        if path[0].startswith("optimizer_") and path[0][10:].isdigit() and len(path) > 2 and path[1] == "param_groups":
            counts.setdefault(int(path[0][10:]), set()).add(path[2])
    indexed = sorted({int(top[10:]) for top in stored.tops() if top.startswith("optimizer_") and top[10:].isdigit()})
    return [len(counts[i]) if i in counts else None for i in indexed]


def saved_optimizer_count(folder: Location) -> int:
    """How many optimizers' states a folder holds in the Trainer's layout (``optimizer_<i>``), or one
    under FSDP2's or Fabric's usual name (``optim``, ``optimizer``)."""
    tops = _StoredKeys(folder).tops()
    indexed = {top for top in tops if top.startswith("optimizer_")}
    return len(indexed) or int(any(key in tops for key in SINGLE_OPTIMIZER_KEYS))


SINGLE_OPTIMIZER_KEYS = ("optim", "optimizer")  # FSDP2 scripts and torchtitan, Fabric's usual name


def _resolve_keys(
    stored: _StoredKeys, folder: Location, count: int, keys: tuple[str, list[str]] | None
) -> tuple[str, list[str]]:
    """The DCP keys of the model and of ``count`` optimizers to load. Without ``keys``, the
    Trainer's: ``model`` (``state_dict`` in Lightning ModelParallelStrategy's folders) and
    ``optimizer_<i>`` (all of them or, for a folder written without optimizers, none; one ``optim``
    or ``optimizer`` for one optimizer, as FSDP2 scripts and Fabric write). With ``keys`` (Fabric's
    names), those, which must all be there; a folder in the Trainer's layout answers to any names,
    in order (``model``, ``optimizer_0``, ...)."""
    tops = stored.tops()
    model_key = model_key_in(tops)
    trainer_layout = model_key is not None and (count == 0 or set(optimizer_keys(count)) <= tops)
    if keys is None or (trainer_layout and not {keys[0], *keys[1]} <= tops):
        if model_key is None and not tops:  # a model without tensors: nothing to load
            return "model", []
        if model_key is None:
            raise CheckpointError(
                f"{folder}: holds no model under {list(MODEL_KEYS)}; its keys are {sorted(tops)}. A folder Fabric "
                "wrote under other names loads with fabric.load(path, {name: model, ...})"
            )
        saved = sorted((top for top in tops if top.startswith("optimizer_")), key=lambda top: int(top.split("_")[-1]))
        single = [key for key in SINGLE_OPTIMIZER_KEYS if key in tops]
        if not saved and single and count == 1:
            return model_key, single[:1]
        others = sorted(tops - {model_key, "averaged_model"} - set(saved))
        if count and not saved and others:  # an optimizer under another name would be left behind
            raise CheckpointError(
                f"{folder}: holds no {', '.join(optimizer_keys(count))} but {others}: a checkpoint written by Fabric "
                "under its own names? Load it with fabric.load(path, {name: ...}), or take its weights with "
                "fsdp-consolidate --weights-only"
            )
        if count and saved and len(saved) != count:
            raise CheckpointError(f"{folder}: holds {len(saved)} optimizers, the model configures {count}")
        return model_key, optimizer_keys(count) if saved else []
    missing = [key for key in (keys[0], *keys[1]) if key not in tops]
    if missing:
        raise CheckpointError(f"{folder}: holds nothing under {missing}; its keys are {sorted(tops)}")
    return keys[0], list(keys[1])


def _clear_scalar_padding(view: ShardsView) -> None:
    """A 0-dim parameter was loaded on every rank; only shard rank 0 keeps it."""
    for param in view.params:
        if param.shape == torch.Size([]) and param.shard_rank != 0:
            param.sharded.data.zero_()
