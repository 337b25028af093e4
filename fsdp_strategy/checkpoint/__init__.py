"""Checkpoints of sharded models: full files, sharded DCP folders, consolidation.

- ``full_state_dict`` / ``load_full_state_dict`` and ``full_optimizer_state_dict`` /
  ``load_full_optimizer_state_dict``: gather to (or scatter from) full tensors, unit by unit.
- ``save_folder`` / ``load_folder``: a sharded folder written with torch.distributed.checkpoint;
  loads at any world size.
- ``consolidate(src, dst)``: a sharded folder to one file, streamed tensor by tensor.
- ``load_from_checkpoint(MyModule, path)``: a sharded folder or a full file into a new plain module
  in one process (Lightning's ``MyModule.load_from_checkpoint`` takes files only).
"""

from fsdp_strategy.checkpoint.consolidation import consolidate
from fsdp_strategy.checkpoint.full import (
    full_optimizer_state_dict,
    full_state_dict,
    load_full_checkpoint,
    load_full_optimizer_state_dict,
    load_full_state_dict,
)
from fsdp_strategy.checkpoint.layout import (
    CheckpointError,
    CheckpointSaveError,
    StrictLoadError,
    is_sharded_checkpoint,
    read_meta,
)
from fsdp_strategy.checkpoint.sharded import save_folder
from fsdp_strategy.checkpoint.sharded_load import load_folder
from fsdp_strategy.checkpoint.single_process import load_from_checkpoint

__all__ = [
    "CheckpointError",
    "CheckpointSaveError",
    "consolidate",
    "full_optimizer_state_dict",
    "full_state_dict",
    "is_sharded_checkpoint",
    "load_folder",
    "load_from_checkpoint",
    "load_full_checkpoint",
    "load_full_optimizer_state_dict",
    "load_full_state_dict",
    "read_meta",
    "save_folder",
    "StrictLoadError",
]
