"""Fabric's ``save``, ``load`` and ``load_raw`` for ``FSDPCustomFabricStrategy``, through the
checkpoint package.

Fabric FSDP's layouts: "sharded", a folder whose DCP keys are the saved state's own names for the
model and its optimizers, ``meta.pt`` holding the rest; "full", one file
``{model key: state dict, optimizer key: torch's optimizer state dict, ...rest}``. The Trainer
strategy's checkpoints (``model``, ``optimizer_<i>``; ``state_dict``, ``optimizer_states``) load
under any names, in order. A part the strategy owns: it is given the writer, the layout and the
broadcast, and each call what it needs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning.fabric.strategies.strategy import _apply_filter, _validate_keys_for_strict_loading
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.fabric.utilities.cloud_io import _atomic_save
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning.fabric.utilities.types import _PATH, _Stateful
from torch import nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader

from fsdp_strategy.checkpoint import full, layout, sharded_load, storage
from fsdp_strategy.checkpoint.layout import CheckpointError
from fsdp_strategy.checkpoint.writer import save_targets
from fsdp_strategy.data import UNAPPLIED, describe_batch_change
from fsdp_strategy.engine import get_scheduler, is_sharded
from fsdp_strategy.fabric_data import LoopDataPosition, make_loop_resumable


class FabricCheckpoints:
    """``save_checkpoint``, ``load_checkpoint`` and the dataloaders' positions of the Fabric strategy:
    a part it owns (as ``RunWatchdog``), given what it needs; it reads no attribute of the strategy.
    Costs: those of the checkpoint package (a sharded save writes each rank's shards; a full one
    gathers unit by unit to rank 0)."""

    def __init__(self, writer: Any, layout: Callable[[], str], broadcast: Callable[[Any], Any]) -> None:
        self._writer, self._layout, self._broadcast = writer, layout, broadcast  # layout(): "full" or "sharded"

    def process_dataloader(self, dataloader: DataLoader) -> DataLoader:
        """A dataloader with Fabric's DistributedSampler rebuilt around one that can resume inside an
        epoch, at any world size; a dataloader in the state of ``fabric.save`` then records where
        its epoch stands, and ``fabric.load`` resumes it there ([Note: a Fabric loop's data position])."""
        return make_loop_resumable(dataloader)[0]

    def save(
        self,
        path: _PATH,
        state: dict[str, nn.Module | Optimizer | Any],
        storage_options: Any,
        filter: dict[str, Callable[[str, Any], bool]] | None,
        is_global_zero: bool,
    ) -> None:
        """Save as Fabric's FSDP does: "sharded", a folder (DCP keys: the state's names of the
        model and its optimizers; ``meta.pt``: the rest); "full", one file written by rank 0.
        Atomic: written under a temporary name, moved once every rank is done."""
        if storage_options is not None:
            raise TypeError(
                "`FSDPCustomFabricStrategy.save_checkpoint(..., storage_options=...)` is not supported: the strategy "
                "does not use a CheckpointIO (as Fabric's FSDPStrategy)"
            )
        if filter is not None and self._layout() == "sharded":
            raise NotImplementedError("a filter is supported with state_dict_type='full' only (as Fabric's FSDP)")
        module_key, module = _the_module(state, "save")
        optimizers = {key: value for key, value in state.items() if isinstance(value, Optimizer)}
        unapplied = get_scheduler(module).optimizer_steps.unapplied_gradients()  # [Note: a step half accumulated]
        rest = {
            key: _saved(key, value, unapplied)
            for key, value in state.items()
            if key != module_key and key not in optimizers
        }
        final, temporary = save_targets(path, self._layout(), is_global_zero, self._broadcast)
        if self._layout() == "sharded":
            keys = (module_key, list(optimizers))
            self._writer.save_sharded(final, temporary, module, list(optimizers.values()), rest, keys=keys)
            return
        converted: dict[str, Any] = {module_key: full.full_state_dict(module)}
        for key, optimizer in optimizers.items():
            converted[key] = full.full_optimizer_state_dict(module, optimizer)
        everything: dict[str, Any] = {}
        for key, value in {**converted, **rest}.items():
            _apply_filter(key, filter or {}, value, everything)
        self._writer.save_full(final, temporary, lambda url: _atomic_save(everything, url))

    def load(
        self,
        path: _PATH,
        state: nn.Module | Optimizer | dict[str, nn.Module | Optimizer | Any] | None,
        strict: bool,
        weights_only: bool | None,
    ) -> dict[str, Any]:
        """Load a sharded folder (ours, Fabric's or the Trainer's FSDP, any world size) or a full
        file into the state's model, optimizers and objects; returns what the state did not ask
        for. A module alone (``fabric.load_raw``) takes a plain state dict file or a folder."""
        if not state:
            raise ValueError(
                f"Got FSDPCustomFabricStrategy.load_checkpoint(..., state={state!r}) but a state with at least a model "
                "instance to reload is required. Pass it in like so: load_checkpoint(..., state={'model': model, ...})"
            )
        where = storage.locate(self._broadcast(str(path)))
        if isinstance(state, Optimizer):
            raise NotImplementedError("Loading a single optimizer object from a checkpoint is not supported yet")
        if isinstance(state, nn.Module):
            _load_raw(where, state, strict, weights_only)
            return {}
        module_key, module = _the_module(state, "load")
        optimizers = {key: value for key, value in state.items() if isinstance(value, Optimizer)}
        requested = state.keys() - {module_key} - optimizers.keys()
        if storage.isdir(where):  # every check before the first tensor is copied: a failed load changes nothing
            meta = layout.folder_meta(where)
            rest = sharded_load.read_rest(where, meta, weights_only)
            _validate_keys_for_strict_loading(requested, rest.keys(), strict=strict)
            keys = (module_key, list(optimizers))
            sharded_load.load_tensors(where, module, list(optimizers.values()), rest, strict, meta=meta, keys=keys)
        else:
            rest = full.load_file(where, weights_only)
            weights, optimizer_states = _full_parts(rest, module_key, list(optimizers), where)
            _validate_keys_for_strict_loading(requested, rest.keys(), strict=strict)
            full.load_full_state_dict(module, weights, strict=strict, source=str(where))
            for optimizer, optimizer_state in zip(optimizers.values(), optimizer_states):
                full.load_full_optimizer_state_dict(module, optimizer, optimizer_state, source=where)
        for key in requested & rest.keys():
            current, saved = state[key], rest.pop(key)
            if isinstance(current, _Stateful) and not isinstance(current, DataLoader):
                current.load_state_dict(saved)
            else:
                state[key] = _with_loaders_resumed(key, current, saved)
        return rest


LOADER_KEY = "fsdp_custom_dataloader"  # a saved dataloader's entry: its position, or its epochs begun


def _saved(key: str, value: Any, unapplied: bool) -> Any:
    """What ``fabric.save`` writes for one entry of the state besides the model and optimizers: a
    stateful object's state; a dataloader's position, also inside dicts and lists ([Note: a Fabric
    loop's data position]), saying whether the model held ``unapplied`` gradients; anything else as
    it is."""
    if isinstance(value, _Stateful) and not isinstance(value, DataLoader):
        return value.state_dict()
    return apply_to_collection(value, DataLoader, _loader_entry, key, unapplied)


def _loader_entry(loader: DataLoader, key: str, unapplied: bool) -> dict[str, Any]:
    position: LoopDataPosition | None = getattr(loader, "_data_position", None)
    if position is None:
        rank_zero_warn(
            f"fsdp_custom: the dataloader {key!r} has no DistributedSampler of Fabric's (`use_distributed_sampler="
            "False` or a sampler of your own): its position is not saved, and a resumed loop iterates it from the "
            "start of an epoch as a new one"
        )
        return {LOADER_KEY: None}
    if unapplied:
        rank_zero_warn(
            f"fsdp_custom: saving the position of {key!r} after a backward whose gradients no optimizer step has "
            f"applied yet (an accumulation under way): {UNAPPLIED}"
        )
    return {LOADER_KEY: {**position.loop_state(), "unapplied_gradients": unapplied}}


def _holds_loader(value: Any) -> bool:
    if isinstance(value, dict):
        return any(_holds_loader(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_loader(item) for item in value)
    return isinstance(value, DataLoader)


def _with_loaders_resumed(name: str, current: Any, saved: Any) -> Any:
    """``saved`` in place of ``current``, but the dataloaders in ``current`` (at any depth of dicts,
    lists and tuples) stay, resumed where ``saved`` says their loops stood."""
    if isinstance(current, DataLoader):
        _resume_loader(name, current, saved)
        return current
    if isinstance(current, dict) and isinstance(saved, dict) and _holds_loader(current):
        resumed = {key: _with_loaders_resumed(f"{name}.{key}", current[key], value) for key, value in saved.items()}
        return {**{key: value for key, value in current.items() if _holds_loader(value)}, **resumed}
    same_kind = type(current) in (list, tuple) and type(saved) in (list, tuple) and len(current) == len(saved)
    if same_kind and _holds_loader(current):
        return type(current)(
            _with_loaders_resumed(f"{name}[{i}]", mine, value) for i, (mine, value) in enumerate(zip(current, saved))
        )
    return saved


def _resume_loader(key: str, loader: DataLoader, saved: Any) -> None:
    """Resume ``loader`` where ``saved`` (``_saved``'s entry) says its loop stood."""
    if not isinstance(saved, dict) or LOADER_KEY not in saved:
        raise CheckpointError(
            f"the checkpoint's {key!r} is not a dataloader's position (saved by fsdp_custom's fabric.save): "
            f"load it under another key, or leave the dataloader out of the state"
        )
    state = saved[LOADER_KEY]
    position: LoopDataPosition | None = getattr(loader, "_data_position", None)
    if state is None or position is None:
        rank_zero_warn(
            f"fsdp_custom: the dataloader {key!r} starts from the start of an epoch as a new one: its position was not "
            "saved or cannot be applied (a sampler other than Fabric's DistributedSampler)"
        )
        return
    position.resume_loop(state)
    epoch, consumed, left = state["epoch"], state["consumed_samples"], state.get("left")
    where = f"after its first {consumed} samples" if consumed else "from its start"
    where = f"resumes epoch {epoch} at its next iter(), {where}"
    if left:
        rank_zero_warn(
            f"fsdp_custom: the dataloader {key!r} {where}: the saving loop had left that epoch before its end (a "
            "`break` or an exception), and the resume continues it; a loop that goes on to its next epoch after a "
            f"`break` (a batch limit) would have started epoch {state.get('next_epoch', epoch + 1)} instead"
        )
    elif left is None:  # written before the position said whether the loop had left its epoch
        rank_zero_info(
            f"fsdp_custom: the dataloader {key!r} {where} (a checkpoint that does not say whether its loop had "
            "left that epoch by a `break`: if it had, the loop continues it instead of the next epoch)"
        )
    elif state.get("unapplied_gradients"):
        rank_zero_warn(
            f"fsdp_custom: the dataloader {key!r} {where}; the checkpoint was saved inside an accumulated "
            f"optimizer step: {UNAPPLIED}"
        )
    else:
        rank_zero_info(f"fsdp_custom: the dataloader {key!r} {where}, exactly where the checkpoint left it")
    if "." in key or "[" in key:  # [Note: a Fabric loop's data position]: Fabric's load unwraps nested loaders
        rank_zero_warn(
            f"fsdp_custom: fabric.load puts the inner DataLoader back in place of the loader at {key!r} (Fabric "
            "unwraps objects inside dicts and lists of the state): it resumes, but moves no batch to the device; "
            "iterate the loader fabric.setup_dataloaders returned, or keep it at the top level of the state"
        )
    change = describe_batch_change(state, position.batch_size, position.sampler.num_replicas)
    if change is not None:
        rank_zero_warn(change)


def _the_module(state: dict[str, Any], action: str) -> tuple[str, nn.Module]:
    """The one sharded module of a state to save or load, and its key (Fabric FSDP's rule)."""
    modules = [(key, value) for key, value in state.items() if isinstance(value, nn.Module) and is_sharded(value)]
    if len(modules) != 1:
        found = "no" if not modules else "several"
        raise ValueError(
            f"Found {found} sharded models in the state to {action}; give exactly one, set up through the strategy, "
            f"like so: fabric.{action}(path, {{'model': model, 'optimizer': optimizer, ...}}); to {action} several "
            "models, call it once per model with its own path"
        )
    return modules[0]


def _full_parts(
    checkpoint: dict[str, Any], module_key: str, optimizer_keys: list[str], where: storage.Location
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Take the model's state dict and the optimizers' states out of a full checkpoint: under the
    state's names, or, in a file the Trainer wrote, ``state_dict`` and ``optimizer_states`` in order."""
    if module_key not in checkpoint and "state_dict" in checkpoint:
        saved = checkpoint.pop("optimizer_states", [])
        if optimizer_keys and len(saved) != len(optimizer_keys):
            raise CheckpointError(f"{where.url}: holds {len(saved)} optimizer states, the state names {optimizer_keys}")
        return checkpoint.pop("state_dict"), saved[: len(optimizer_keys)]
    missing = [key for key in (module_key, *optimizer_keys) if key not in checkpoint]
    if missing:
        raise CheckpointError(f"{where.url}: holds nothing under {missing}; its keys are {sorted(checkpoint)}")
    return checkpoint.pop(module_key), [checkpoint.pop(key) for key in optimizer_keys]


def _load_raw(where: storage.Location, module: nn.Module, strict: bool, weights_only: bool | None) -> None:
    """``fabric.load_raw``: a plain state dict file (or a checkpoint folder's model) into ``module``."""
    if not is_sharded(module):
        module.load_state_dict(full.load_file(where, weights_only), strict=strict)
        return
    if storage.isdir(where):
        meta = layout.folder_meta(where)
        sharded_load.load_tensors(
            where, module, [], sharded_load.read_rest(where, meta, weights_only), strict, meta=meta
        )
        return
    weights = full.load_file(where, weights_only)
    own = set(module.state_dict())
    holders = sorted(key for key, value in weights.items() if isinstance(value, dict) and own & set(value))
    if holders and not own & set(weights):
        raise CheckpointError(
            f"{where.url}: a checkpoint holding the model under {holders}, not a plain state dict: load it with "
            f"fabric.load(path, {{{holders[0]!r}: model, ...}}); load_raw takes a file of the model's state dict"
        )
    full.load_full_state_dict(module, weights, strict=strict, source=str(where))
