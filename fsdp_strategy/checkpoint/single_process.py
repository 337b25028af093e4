"""A checkpoint of the sharded model into a plain module, in one process, on the CPU.

``MyModule.load_from_checkpoint(path)`` is Lightning's classmethod: it opens ``path`` as a file, so
on a sharded folder it raises ``IsADirectoryError``, and it cannot be changed from here.
``load_from_checkpoint(MyModule, path)`` does the same job for both kinds: it reads a sharded folder
(its model's tensors gathered into full ones, no process group) or a full file, then builds the
module with the checkpoint's hyperparameters and loads the weights through Lightning's own
``_load_state`` (``on_load_checkpoint``, ``load_state_dict``), as the classmethod does.
"""

from __future__ import annotations

import os
from typing import Any

from fsdp_strategy.checkpoint import full, layout, storage
from fsdp_strategy.checkpoint.consolidation import read_tensors, weights_key
from fsdp_strategy.checkpoint.sharded import MODEL_KEYS, stored_tensors
from fsdp_strategy.checkpoint.sharded_load import read_rest


def load_from_checkpoint(
    module_class: type, path: str | os.PathLike, *, strict: bool | None = None, weights_only: bool | None = None,
    **kwargs: Any,
) -> Any:  # fmt: skip
    """``module_class.load_from_checkpoint(path)`` for a sharded folder or a full file: a new
    ``module_class`` (a LightningModule; its ``__init__`` arguments from the checkpoint's
    hyperparameters, overridden by ``kwargs``) holding the checkpoint's weights, on the CPU.

    Costs: the whole model in memory once, as full tensors (the folder is read one stored chunk at
    a time). ``strict`` and ``weights_only`` as Lightning's classmethod takes them.
    """
    from lightning.pytorch.core.saving import _load_state

    where = storage.locate(path)
    if storage.isdir(where):
        checkpoint = read_rest(where, layout.folder_meta(where), weights_only)
        checkpoint["state_dict"] = model_weights(where)
    else:
        checkpoint = full.load_file(where, weights_only)
    return _load_state(module_class, checkpoint, strict=strict, **kwargs)


def model_weights(folder: Any) -> dict[str, Any]:
    """A sharded folder's model entries as full tensors (its weight average where it has one, as a
    full checkpoint's ``state_dict`` holds it), by their state-dict names."""
    from torch.distributed.checkpoint._nested_dict import unflatten_state_dict

    metadata, paths = stored_tensors(folder)
    tops = {path[0] for path in paths.values()}
    found = [key for key in ("averaged_model", *MODEL_KEYS) if key in tops]
    if not found:
        raise layout.CheckpointError(f"{folder}: holds no model under {list(MODEL_KEYS)}; its keys are {sorted(tops)}")
    key = weights_key(paths) if found[0] == "averaged_model" else found[0]
    keys = [flat for flat, path in paths.items() if path[0] == key]
    tensors = read_tensors(storage.locate(folder).path, metadata, keys)
    return dict(unflatten_state_dict(tensors, {flat: paths[flat] for flat in keys})[key])
