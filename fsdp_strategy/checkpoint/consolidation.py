"""Turn a sharded checkpoint folder into one file, tensor by tensor, with no process group.

The output tensors are allocated (in the output dtype) and filled by one ``dcp.load``, which reads
the shard files one stored chunk at a time straight into them, so besides the output itself only
one chunk is in memory at a time: peak memory stays below the output size plus the largest
tensor. With safetensors and a ``max_shard_size`` the output itself is streamed: one shard is
read, written and freed at a time, so peak memory is about one shard plus one chunk.
"""

from __future__ import annotations

import json
import math
import os
import re
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from fsdp_strategy.checkpoint import layout, storage
from fsdp_strategy.checkpoint.layout import CheckpointError
from fsdp_strategy.checkpoint.sharded import model_key, stored_tensors
from fsdp_strategy.config import parse_dtype

FORMATS = ("torch", "safetensors")


def read_tensors(folder: Path, metadata: Any, keys: list[str], dtype: torch.dtype | None = None) -> dict:
    """Full tensors (or the stored objects) for ``keys``, tensors in ``dtype`` when floating: the
    output tensors are allocated and filled by ONE ``dcp.load``, which reads one stored chunk at a
    time straight into them."""
    out: dict[str, Any] = {}
    for key in keys:
        info = metadata.state_dict_metadata[key]
        if not hasattr(info, "size"):
            out[key] = None  # an object (param groups): DCP puts it here
            continue
        stored = info.properties.dtype
        out[key] = torch.empty(info.size, dtype=dtype if dtype is not None and stored.is_floating_point else stored)
    if out:
        with warnings.catch_warnings():  # no_dist=True is the intent here, torch warns about it anyway
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            dcp.load(out, storage_reader=dcp.FileSystemReader(str(folder)), no_dist=True)
    return out


def _under(paths: dict[str, tuple], prefix: str) -> list[str]:
    return [key for key, path in paths.items() if path[0] == prefix]


def weights_key(paths: dict[str, tuple]) -> str:
    """The DCP key of the weights a consolidated file holds: the average where the folder has one
    (written with Lightning's ``WeightAveraging``, whose full checkpoints keep the average as
    ``state_dict`` and the model as ``current_model_state``), else the model."""
    return "averaged_model" if any(path[0] == "averaged_model" for path in paths.values()) else model_key(paths)


def parse_size(text: str | int | None) -> int | None:
    """'500MB', '2GB', '1.5GiB' (a string needs its unit) or an int of bytes -> bytes (positive)."""
    if text is None:
        return None
    if isinstance(text, int):
        size = text
    else:
        size = _size_in_bytes(text)
    if size <= 0:
        raise ValueError(f"max_shard_size={text!r} must be positive, e.g. '500MB' or '2GB'")
    return size


def _size_in_bytes(text: str) -> int:
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "B": 1}
    upper = text.strip().upper()
    for unit, factor in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if upper.endswith(unit):
            try:
                return int(float(upper[: -len(unit)]) * factor)
            except ValueError:
                break
    if upper.replace(".", "", 1).isdigit():
        raise ValueError(f"max_shard_size={text!r} has no unit; use e.g. '500MB', '2GB' or '1.5GiB'")
    raise ValueError(f"max_shard_size={text!r} is not a size; use e.g. '500MB', '2GB' or '1.5GiB'")


def consolidate(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    weights_only: bool = False,
    dtype: torch.dtype | str | None = None,
    output_format: str = "torch",
    max_shard_size: int | str | None = None,
    overwrite: bool = False,
    strip_prefix: str | None = None,
) -> Path:
    """Write the sharded checkpoint ``src`` as one file (or safetensors shards) at ``dst``.

    "torch": ``torch.load(dst)["state_dict"]`` loads into the unsharded LightningModule (a folder
    written with ``WeightAveraging`` gives its average there and the model as
    ``current_model_state``, as Lightning's full checkpoints do)
    (``weights_only``: ``torch.load(dst)`` is that state dict); the rest of Lightning's state and
    the optimizer states (full tensors, in torch's layout keyed by position) come along unless
    ``weights_only``, so ``Trainer(strategy="ddp").fit(ckpt_path=dst)`` resumes from it (DDP has
    no mid-epoch data position: resume from a checkpoint taken at an epoch's end for exactness).
    "safetensors": model weights only; with ``max_shard_size`` a folder of
    ``model-0000i-of-0000n.safetensors`` files and ``model.safetensors.index.json``.
    ``strip_prefix`` (weights only): drop the LightningModule's attribute prefix (``"model."``)
    from every key, so ``inner_module.load_state_dict(torch.load(dst))`` works; a key without
    the prefix is an error.
    """
    src, dst = Path(src), Path(dst)
    if output_format not in FORMATS:
        raise ValueError(f"output_format={output_format!r} is not supported; accepted: {FORMATS}")
    cast = parse_dtype(dtype, "dtype")
    limit = parse_size(max_shard_size)
    if limit is not None and output_format != "safetensors":
        raise ValueError("max_shard_size needs output_format='safetensors'")
    if strip_prefix is not None and output_format == "torch" and not weights_only:
        raise ValueError(
            f"strip_prefix={strip_prefix!r} writes a plain module state dict: use it with weights_only=True "
            "or output_format='safetensors'; a Lightning checkpoint keeps the LightningModule's keys"
        )
    if not dst.parent.is_dir():
        raise FileNotFoundError(f"the output's folder {str(dst.parent)!r} does not exist; create it first")
    meta = layout.read_meta(src)
    problems = layout.verify_files(storage.locate(src), meta["checksums"], sorted(meta["checksums"]))
    if problems:
        raise CheckpointError("checkpoint is damaged: " + "; ".join(problems))
    _check_destination(src, dst, overwrite)
    temporary = storage.temporary(storage.locate(dst))
    try:
        stored = stored_tensors(src)  # the DCP metadata, read once
        rename = _prefix_stripper(stored[1], strip_prefix)
        if output_format == "safetensors":
            _write_safetensors(src, stored, Path(temporary.path), cast, limit, rename)
        else:
            _write_torch(src, stored, Path(temporary.path), cast, weights_only, meta["format_version"], rename)
        storage.commit(temporary, storage.locate(dst))
    finally:
        storage.remove(temporary)
    return dst


_SHARD_FILE = re.compile(r"model-\d{5,}-of-\d{5,}\.safetensors")
_INDEX_FILE = "model.safetensors.index.json"


def _check_destination(src: Path, dst: Path, overwrite: bool) -> None:
    """Refuse a ``dst`` whose replacement would delete the checkpoint or something this tool did
    not write: ``overwrite`` replaces a file, or a folder of safetensors shards and their index."""
    source, target = src.resolve(), dst.resolve()
    if target == source or source in target.parents:
        raise ValueError(f"the output {str(dst)!r} is the checkpoint {str(src)!r} or inside it; write it elsewhere")
    if source.parent == target.parent and source.name.startswith(f".{target.name}.tmp-"):
        raise ValueError(
            f"the checkpoint {str(src)!r} is named like an unfinished write of the output {str(dst)!r}, which "
            "would be removed after writing it; rename it or write the output elsewhere"
        )
    if target in source.parents:
        raise ValueError(
            f"the output {str(dst)!r} holds the checkpoint {str(src)!r}: replacing it would delete the checkpoint"
        )
    if not (dst.exists() or dst.is_symlink()):
        return
    if not overwrite:
        raise FileExistsError(f"{str(dst)!r} exists; pass overwrite=True to replace it")
    if dst.is_dir() and not dst.is_symlink():
        foreign = sorted(entry.name for entry in dst.iterdir() if not _written_shard(entry))
        if not (dst / _INDEX_FILE).is_file() or foreign != [_INDEX_FILE]:
            raise FileExistsError(
                f"{str(dst)!r} is a folder this tool did not write (it writes folders of safetensors shards "
                f"with {_INDEX_FILE} only); overwrite=True replaces a file or such a folder: "
                "choose another output or remove the folder yourself"
            )


def _written_shard(entry: Path) -> bool:
    """Whether ``entry`` is a shard file as ``_write_safetensors`` names them (a file, not a link)."""
    return bool(_SHARD_FILE.fullmatch(entry.name)) and entry.is_file() and not entry.is_symlink()


def _prefix_stripper(paths: dict[str, tuple], prefix: str | None) -> Any:
    """``model key -> output key``: without ``prefix`` (checked against every key first)."""
    if prefix is None:
        return lambda name: name
    prefix = prefix if prefix.endswith(".") else prefix + "."
    key = model_key(paths)
    outside = sorted(path[1] for path in paths.values() if path[0] == key and not path[1].startswith(prefix))
    if outside:
        raise ValueError(f"strip_prefix={prefix!r}: the keys {outside} do not start with it")
    return lambda name: name.removeprefix(prefix)


def _write_torch(
    src: Path, stored: tuple, out: Path, dtype: torch.dtype | None, weights_only: bool, version: int, rename: Any
) -> None:
    metadata, paths = stored
    model = read_tensors(src, metadata, _under(paths, weights_key(paths)), dtype)
    state_dict = {rename(paths[key][1]): tensor for key, tensor in model.items()}
    if weights_only:
        torch.save(state_dict, out)
        return
    current = {}
    if weights_key(paths) != model_key(paths):  # Lightning's WeightAveraging layout: the model apart from its average
        live = read_tensors(src, metadata, _under(paths, model_key(paths)), dtype)
        current = {"current_model_state": {paths[key][1]: tensor for key, tensor in live.items()}}
    lightning_state = layout.load_object(
        src / (layout.LEGACY_LIGHTNING_FILE if version == 1 else layout.LIGHTNING_FILE), weights_only=False
    )
    lightning_state.pop("optimizer_layouts", None)
    legacy_groups = lightning_state.pop("optimizer_groups", [])
    # the data position belongs to fsdp_strategy's resumable sampler; a DDP or plain run has none to load
    lightning_state.get("loops", {}).get("fit_loop", {}).get("state_dict", {}).pop("combined_loader", None)
    prefixes = sorted({p[0] for p in paths.values() if p[0].startswith("optimizer_")}, key=lambda s: int(s[10:]))
    optimizer_states = []
    for index, prefix in enumerate(prefixes):
        entries = read_tensors(src, metadata, _under(paths, prefix))
        group_paths = {key: paths[key] for key in entries if paths[key][1] == "param_groups"}
        groups = legacy_groups[index] if version == 1 else _param_groups(entries, group_paths)
        optimizer_states.append(_by_position(paths, entries, groups))
    torch.save({**lightning_state, **current, "state_dict": state_dict, "optimizer_states": optimizer_states}, out)


def _param_groups(entries: dict[str, Any], group_paths: dict[str, tuple]) -> list[dict]:
    """The param groups that DCP stored flattened (one entry per group and setting)."""
    from torch.distributed.checkpoint._nested_dict import unflatten_state_dict

    rebuilt = unflatten_state_dict({key: entries[key] for key in group_paths}, group_paths)
    return next(iter(rebuilt.values()))["param_groups"]


def _by_position(paths: dict[str, tuple], entries: dict[str, Any], groups: list[dict]) -> dict[str, Any]:
    """One optimizer's name-keyed state as ``optimizer.state_dict()`` of the plain model has it (state
    values that are lists or dicts, SOAP's preconditioners, rebuilt from DCP's flattened entries)."""
    from torch.distributed.checkpoint._nested_dict import unflatten_state_dict

    position = {fqn: i for i, fqn in enumerate(fqn for group in groups for fqn in group["params"])}
    state_paths = {key: paths[key] for key in entries if paths[key][1] != "param_groups"}
    state: dict[int, dict[str, Any]] = {}
    if state_paths:
        rebuilt = next(iter(unflatten_state_dict({k: entries[k] for k in state_paths}, state_paths).values()))
        version_two = all(path[1] == "state" for path in state_paths.values())
        by_name = rebuilt["state"] if version_two else rebuilt  # (optimizer_i, "state", fqn, key, ...) or format 1's
        state = {position[fqn]: dict(values) for fqn, values in by_name.items() if fqn in position}
    torch_groups = [{**group, "params": [position[fqn] for fqn in group["params"]]} for group in groups]
    return {"state": dict(sorted(state.items())), "param_groups": torch_groups}


def _write_safetensors(
    src: Path, stored: tuple, out: Path, dtype: torch.dtype | None, limit: int | None, rename: Any
) -> None:
    from safetensors.torch import save_file

    metadata, paths = stored
    keys = [key for key in _under(paths, weights_key(paths)) if hasattr(metadata.state_dict_metadata[key], "size")]
    if limit is None:
        tensors = read_tensors(src, metadata, keys, dtype)
        save_file({rename(paths[key][1]): tensor.contiguous() for key, tensor in tensors.items()}, str(out))
        return
    out.mkdir(parents=True)
    shards: list[list[str]] = [[]]
    size = 0
    for key in keys:  # plan the shards from the metadata, then read and write one shard at a time
        info = metadata.state_dict_metadata[key]
        stored = info.properties.dtype
        element = (dtype if dtype is not None and stored.is_floating_point else stored).itemsize
        nbytes = math.prod(info.size) * element
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes
    weight_map = {}
    for index, shard in enumerate(shards):
        name = f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = read_tensors(src, metadata, shard, dtype)
        save_file({rename(paths[key][1]): tensor.contiguous() for key, tensor in tensors.items()}, str(out / name))
        weight_map.update({rename(paths[key][1]): name for key in shard})
        del tensors
    index_file = {"metadata": {"format": "pt"}, "weight_map": weight_map}
    (out / _INDEX_FILE).write_text(json.dumps(index_file, indent=1, sort_keys=True))
