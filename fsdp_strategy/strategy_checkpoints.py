"""The strategy's checkpoint hooks: Lightning's save/load/remove calls mapped onto the checkpoint
package, and the training data position that travels in checkpoints.

A part ``FSDPCustomStrategy`` owns (as ``RunWatchdog``): its Lightning checkpoint methods are one
line each, calling this with what it needs (the model, the optimizers, the trainer); it reads no
attribute of the strategy.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.optim import Optimizer

from fsdp_strategy import averaging
from fsdp_strategy import checkpoint as ckpt
from fsdp_strategy.checkpoint import full, layout, names, sharded, sharded_load, storage
from fsdp_strategy.checkpoint.storage import Location
from fsdp_strategy.checkpoint.writer import save_targets
from fsdp_strategy.data import (
    DATA_POSITION_KEY,
    UNAPPLIED,
    ExactResumeNotice,
    complete_finished_epoch,
    drop_unprocessed_batch,
    make_resumable,
    next_epoch_start,
    pending_batches,
    reopen_stopped_epoch,
    rewind_pending_batches,
)
from fsdp_strategy.engine import get_scheduler, is_sharded
from fsdp_strategy.strategy_data import (
    NOT_OURS,
    REPEATED_VALIDATION,
    TAKEN_BACK,
    UNPOSITIONED,
    TrainingPositions,
    combination,
)


@dataclass
class _CheckpointToLoad:
    """A checkpoint ``load_checkpoint`` read: its weights go into the shards as soon as the model is
    sharded (at once, or at setup), its optimizer states when Lightning restores optimizers."""

    path: Location
    is_folder: bool
    meta: dict | None  # a sharded folder's fsdp_meta.json (None: Lightning FSDP's folder, or a file)
    checkpoint: dict  # Lightning's state (a full file: everything, weights included)
    weights_loaded: bool = False


def _fresh_lightning_state(path: Location) -> dict[str, Any]:
    """Lightning's state for a folder without one (FSDP2's, torchtitan's, Fabric's): its weights and
    optimizer states load; the loops, LR schedulers and callbacks start fresh, as it says."""
    import lightning

    rank_zero_info(
        f"fsdp_custom: {path} holds no Lightning state (a DCP checkpoint written by FSDP2, torchtitan or Fabric): its "
        "weights and optimizer state load; the loops (epoch, step), LR schedulers and callbacks start fresh"
    )
    return {"pytorch-lightning_version": lightning.__version__, "lr_schedulers": []}


class TrainerCheckpoints:
    """Save, load and remove checkpoints for ``FSDPCustomStrategy`` (see checkpoint/), and carry the
    training data position through them. Costs: those of the checkpoint package."""

    def __init__(self, writer: Any, layout: Callable[[], str], broadcast: Callable[[Any], Any]) -> None:
        self._writer, self._layout, self._broadcast = writer, layout, broadcast  # layout(): "full" or "sharded"
        self.positions: TrainingPositions | None = None  # the training dataloaders', once built
        self._data_position_to_load: dict | None = None  # from the checkpoint being resumed
        self.resume_notice = ExactResumeNotice()  # removed at the first batch and at teardown
        self._to_load: _CheckpointToLoad | None = None  # read by ``read``, applied in setup
        self._setup_open = False  # a setup of the training dataloaders is being processed ([Note: ...] below)
        self._unstepped_epoch: int | None = None  # resumed before this epoch's end hooks ran
        self._resumed_fit = False  # the fit being set up restored a checkpoint

    def model_state(self, model: Any) -> dict[str, Any]:
        """Full: the gathered model state on rank 0 ({} elsewhere). Sharded: views of the shards."""
        assert model is not None
        if self._layout() == "sharded":
            return sharded.model_state(model)
        return ckpt.full_state_dict(model, rank0_only=True)

    def optimizer_state(self, model: Any, optimizer: Optimizer) -> dict[str, Any]:
        """Full: the gathered optimizer state in torch's layout (as DDP writes it) on rank 0.
        Sharded: {} (the save writes each rank's shards itself)."""
        assert model is not None
        if self._layout() == "sharded":
            return {}
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        return ckpt.full_optimizer_state_dict(model, optimizer, rank0_only=True)

    def load_weights_now(
        self, model: Any, checkpoint: Mapping[str, Any], strict: bool, trainer: Any, optimizers: list, world_size: int
    ) -> None:
        """Load the weights of the checkpoint ``read`` took into the shards now, if the model is
        sharded (a restore after setup: Lightning's tuner, a callback's own restore, ``validate``
        after ``fit``); else ``load_into_shards`` does at setup. ``checkpoint`` is the one
        ``on_load_checkpoint`` saw (a full file's weights are taken from it)."""
        pending = self._to_load
        if pending is None or model is None or not is_sharded(model):
            return
        pending.checkpoint = dict(checkpoint)
        self._load_weights(pending, model, strict, trainer, optimizers, world_size)

    def load_optimizers(self, model: Any, optimizers: list, checkpoint: Mapping[str, Any]) -> None:
        """Load the optimizer states of the checkpoint ``read`` took (Lightning restores optimizers
        after setup); the checkpoint is then done with."""
        pending, self._to_load = self._to_load, None
        if pending is None or not optimizers:
            return
        assert model is not None
        if pending.is_folder:
            sharded_load.load_tensors(
                pending.path, model, list(optimizers), pending.checkpoint, meta=pending.meta, with_model=False
            )
        else:
            full.load_full_optimizers(dict(checkpoint), model, list(optimizers), pending.path)

    def save(
        self,
        checkpoint: dict[str, Any],
        filepath: _PATH,
        storage_options: Any,
        model: Any,
        optimizers: list,
        checkpoint_io: Any,
        trainer: Any,
        is_global_zero: bool,
    ) -> None:
        """Write atomically to a local path or any fsspec URL: a temporary name, moved once every rank
        is done ([Note: atomic commit] in checkpoint/storage.py). Replaces only a checkpoint: anything
        else at ``filepath`` is an error on every rank before anything is written."""
        if storage_options is not None and self._layout() == "sharded":
            raise TypeError(
                "`FSDPCustomStrategy.save_checkpoint(..., storage_options=...)` is not supported with "
                "state_dict_type='sharded': the sharded save does not use the CheckpointIO (as Lightning's FSDP)"
            )
        mode, cut = combination(trainer)
        if self.positions is not None and self.positions.positioned() and not cut and "loops" in checkpoint:
            pending = pending_batches(trainer)  # [Note: a step half accumulated]
            position = self.positions.state_dict(mode, pending)
            if pending:
                rewind_pending_batches(checkpoint, pending)
                position["validation_repeated"] = self.positions.validated_inside_step(_validated(trainer))
            if not pending and model is not None and get_scheduler(model).optimizer_steps.unapplied_gradients():
                position["unapplied_gradients"] = True  # a manual optimization's accumulation: said at the resume
            checkpoint[DATA_POSITION_KEY] = position
        averaged = _averaging_callback(trainer)
        extra = {}
        if averaged is not None and "current_model_state" in checkpoint:  # [Note: sharded weight averaging]
            if self._layout() == "full":
                checkpoint["state_dict"] = averaging.full_average(model, averaged)
            else:
                checkpoint.pop("current_model_state")  # the folder's "model": written below
                extra = {averaging.AVERAGED_KEY: averaging.sharded_views(model, averaged)}
        final, temporary = save_targets(filepath, self._layout(), is_global_zero, self._broadcast)
        if self._layout() == "full":
            self._writer.save_full(
                final, temporary, lambda path: checkpoint_io.save_checkpoint(checkpoint, path, storage_options)
            )
            return
        assert model is not None
        checkpoint.pop("state_dict", None)
        saved = list(optimizers) if checkpoint.pop("optimizer_states", None) is not None else []
        self._writer.save_sharded(final, temporary, model, saved, checkpoint, extra)

    def remove(self, filepath: _PATH) -> None:
        """Delete a checkpoint file or folder (after any save in flight)."""
        self._writer.remove(storage.locate(filepath))

    def read(self, checkpoint_path: _PATH, weights_only: bool | None, trainer: Any) -> dict[str, Any]:
        """Read a checkpoint: a sharded folder (ours or Lightning FSDP's, any world size) or a full
        file (memory-mapped). Its weights go into the shards at ``load_weights_now`` (or at setup,
        before which there are no shards), its optimizer states at ``load_optimizers``: a restore is
        in effect when Lightning's restore returns, at any point of a run. Returns Lightning's
        state. ``weights_only`` as ``torch.load``'s, not given meaning False (as Lightning's FSDP:
        callbacks' and hyperparameters' objects load)."""
        self._writer.wait()
        path = storage.locate(self._broadcast(os.fspath(checkpoint_path)))
        is_folder = storage.isdir(path)
        if is_folder:
            meta = layout.folder_meta(path)
            checkpoint = sharded_load.read_rest(path, meta, weights_only)
            if "pytorch-lightning_version" not in checkpoint:  # FSDP2's, torchtitan's, Fabric's: tensors only
                checkpoint = _fresh_lightning_state(path)
            saved = sharded_load.saved_optimizer_count(path)
            if saved:  # Lightning checks the key before it restores optimizers; the states are in the folder
                checkpoint["optimizer_states"] = [{} for _ in range(saved)]
        elif not storage.exists(path):
            raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist")
        else:
            meta = None
            checkpoint = full.load_file(path, weights_only)
        if "pytorch-lightning_version" not in checkpoint:  # Lightning would fail on the key itself, unexplained
            raise ckpt.CheckpointError(
                f"{path.url}: not a Lightning checkpoint (it holds {sorted(checkpoint)[:8]}): one written by Fabric or "
                "by hand? Resume it with Fabric (fabric.load), or take its weights with fsdp-consolidate --weights-only"
            )
        self._to_load = _CheckpointToLoad(path, is_folder, meta, checkpoint)
        self._take_data_position(checkpoint, trainer)
        return checkpoint

    def load_into_shards(self, model: Any, trainer: pl.Trainer, strict: bool, optimizers: list, world: int) -> None:
        """At setup: the weights of a checkpoint read before the model was sharded (a resume); with
        no optimizer restore to follow (validate, test, predict), the checkpoint is done with."""
        pending = self._to_load
        if pending is None:
            return
        if not pending.weights_loaded:
            self._load_weights(pending, model, strict, trainer, optimizers, world)
        if trainer.state.fn != TrainerFn.FITTING:
            self._to_load = None

    def _load_weights(
        self, pending: _CheckpointToLoad, model: Any, strict: bool, trainer: Any, optimizers: list, world: int
    ) -> None:
        """Copy the checkpoint's weights (and a WeightAveraging average) into the shards."""
        assert model is not None
        checkpoint, averaged = pending.checkpoint, _averaging_callback(trainer)
        with_average = "averaging_state" in checkpoint  # written with WeightAveraging
        _refuse_other_optimizers(pending, trainer, optimizers)
        if pending.is_folder:
            sharded_load.load_tensors(pending.path, model, [], checkpoint, strict, meta=pending.meta)
            change = sharded.describe_resharding(pending.meta, model, pending.path)
            rank_zero_info(f"fsdp_custom: loaded {pending.path}: {change}")
            if averaged is not None and with_average:
                averaging.load_sharded_average(pending.path, model, averaged)
        else:
            current = checkpoint.get("current_model_state") if with_average else None
            weights = checkpoint if current is None else {**checkpoint, "state_dict": current}
            full.apply_full_checkpoint(weights, model, [], strict, pending.path)
            takes = "one rank took every row" if world == 1 else f"each of {world} ranks took its rows"
            rank_zero_info(f"fsdp_custom: loaded full checkpoint {pending.path}: {takes}")
            if averaged is not None and current is not None:
                averaging.load_full_average(model, averaged, checkpoint["state_dict"])
        if averaged is not None and not with_average:  # as WeightAveraging: both start from the weights
            averaging.copy_current(model, averaged)
        pending.weights_loaded = True

    def process_dataloader(self, dataloader: object, trainer: Any) -> object:
        """Make a training dataloader resumable mid-epoch, also on another world size (data.py), and
        position it where a resumed checkpoint left it."""
        if trainer is None or not trainer.training:
            return dataloader
        fit = trainer.fit_loop
        if not self._setup_open:  # the first of a setup's training dataloaders ([Note: ...] below)
            self._setup_open = True
            saved, self._data_position_to_load = self._data_position_to_load, None
            self.positions = TrainingPositions(fit.epoch_loop.batch_progress, saved)
        loader, position = make_resumable(dataloader)
        assert self.positions is not None
        self.positions.add(position, dataloader, fit.epoch_progress.current.completed)  # the epoch Lightning sets
        return loader

    def end_dataloader_setup(self, trainer: Any = None) -> None:
        """A stage's setup or a training batch began: the training dataloaders processed next are a
        new setup (a second ``fit``, the fit after an LR finder's run, a reload), with new positions.
        Lightning processes one setup's loaders together, before any batch; it has no hook between
        two setups (and resets its own ``CombinedLoader`` to None before each). A resume's hidden
        warning shows again (the epoch loop has checked the dataloader by then)."""
        self._setup_open = False
        self.resume_notice.remove()
        if trainer is not None and self.positions is not None:  # a training batch: [Note: a step half accumulated]
            self.positions.at_batch(_validated(trainer), max(1, getattr(trainer, "accumulate_grad_batches", 1)))

    def position_training_data(self, trainer: Any, world_size: int) -> None:
        """At ``on_train_start``, once Lightning has combined the fit's training dataloaders (and
        before the epoch loop checks them): take back a resumed position that does not fit them
        ([Note: several training dataloaders]), and say what differs from the run that saved."""
        self._say_unstepped_plateau(trainer)
        resumed, self._resumed_fit = self._resumed_fit, False
        self._data_position_to_load = None  # a fit without training batches leaves none for the next
        positions = self.positions
        if positions is None or trainer.fit_loop._data_fetcher is None:
            return
        mode, cut = combination(trainer)
        saved = positions.saved
        if len(positions.loaders) > 1 and (cut or not positions.positioned()):
            why = "a limit_train_batches that cuts one of them" if cut else f"samplers {positions.samplers}"
            self._take_back(positions, trainer, restart_epoch=False)
            rank_zero_warn(UNPOSITIONED.format(what=f"has several training dataloaders ({why})"))
            return
        if not positions.positioned():
            if saved is not None and saved.get("consumed_samples"):
                rank_zero_warn(NOT_OURS.format(saved=saved, sampler=positions.samplers[0]))
            return
        epoch = trainer.fit_loop.epoch_progress.current.processed
        why_not = "it holds no data position" if saved is None else positions.check_resume(mode, epoch)
        if why_not is not None:
            if resumed and self._take_back(positions, trainer, restart_epoch=True):
                rank_zero_warn(TAKEN_BACK.format(why=why_not))
            return
        change = positions.describe_change(world_size, mode)
        if change:
            rank_zero_warn(change)
        if saved.get("validation_repeated"):
            rank_zero_warn(REPEATED_VALIDATION)
        if saved.get("unapplied_gradients"):
            rank_zero_warn(f"fsdp_custom: the checkpoint was saved inside an optimizer step: {UNAPPLIED}")
        elif not trainer.fit_loop.epoch_loop.batch_progress.is_last_batch:
            self.resume_notice.install(saved)

    @staticmethod
    def _take_back(positions: TrainingPositions, trainer: Any, restart_epoch: bool) -> bool:
        """Undo a resume's positions (``TrainingPositions.undo``), and start the loaders' iteration
        again (their workers took their first indices when Lightning set the data up); whether
        anything changed."""
        skipped, recounted = positions.undo(restart_epoch)
        if skipped:
            iter(trainer.fit_loop._data_fetcher)
        return skipped or recounted

    def _take_data_position(self, checkpoint: dict[str, Any], trainer: Any) -> None:
        """Keep a loaded checkpoint's data position for the training dataloader (built after the
        restore) when fitting; one in Lightning's loop state (our checkpoints before format 2) moves
        here too. Validate/test keep none: a later fit has nothing to resume."""
        position = checkpoint.pop(DATA_POSITION_KEY, None)
        fit_loop = checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {})
        legacy = fit_loop.pop("combined_loader", None)
        if position is None and legacy:
            position = legacy[0]
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        if fitting:
            drop_unprocessed_batch(checkpoint)  # [Note: a batch started, not processed] in data.py
        if fitting:
            reopen_stopped_epoch(checkpoint, position)  # [Note: an epoch stopped, not finished] in data.py
        epochs = checkpoint.get("loops", {}).get("fit_loop", {}).get("epoch_progress", {}).get("total", {})
        ended_early = epochs.get("completed", 0) < epochs.get("started", 0)  # before the epoch's end hooks
        self._unstepped_epoch = None
        if fitting and complete_finished_epoch(checkpoint):
            self._unstepped_epoch = epochs["started"] - 1 if ended_early else None
            if position is not None:
                position = next_epoch_start(position)
        self._data_position_to_load = position if fitting else None
        self._resumed_fit = fitting

    def _say_unstepped_plateau(self, trainer: Any) -> None:
        """A checkpoint written before its epoch's end hooks (at its last batch, or in
        ``on_train_epoch_end``) resumes at the next epoch: Lightning steps an epoch-interval
        ``ReduceLROnPlateau`` after those hooks, on a metric the checkpoint does not hold, and its
        resume (DDP alike) never takes that step. Said, since the learning rate may then differ."""
        configs = [c for c in trainer.lr_scheduler_configs if c.reduce_on_plateau and c.interval == "epoch"]
        if self._unstepped_epoch is not None and configs:
            rank_zero_warn(
                f"fsdp_custom: the checkpoint was saved before epoch {self._unstepped_epoch}'s end hooks: its "
                f"ReduceLROnPlateau (monitor={configs[0].monitor!r}) is not stepped for that epoch, as Lightning "
                "steps it after them on a metric the checkpoint does not hold (DDP alike); where that step would "
                "have lowered the learning rate, the steps after the resume differ from the uninterrupted run's"
            )
        self._unstepped_epoch = None


def _validated(trainer: Any) -> int:
    """The validation batches the fit has run this epoch."""
    return trainer.fit_loop.epoch_loop.val_loop.batch_progress.total.completed


def _refuse_other_optimizers(pending: _CheckpointToLoad, trainer: Any, optimizers: list) -> None:
    """Before a resume loads anything: a checkpoint whose optimizer states have other param groups
    than this run's optimizers was trained with another optimizer (or grouping): refused, saying so."""
    if trainer is None or trainer.state.fn != TrainerFn.FITTING or not optimizers:
        return
    if pending.is_folder:
        counts = sharded_load.saved_group_counts(pending.path)
    else:
        counts = [len(s.get("param_groups", ())) for s in pending.checkpoint.get("optimizer_states", ())]
    for optimizer, saved in zip(optimizers, counts):
        if saved is not None:
            names.check_group_count(saved, optimizer, pending.path)


def _averaging_callback(trainer: Any) -> Any:
    """The trainer's WeightAveraging callback once its sharded average is built, else None."""
    found = averaging.averaging_callbacks(trainer) if trainer is not None else []
    return found[0] if found and found[0]._average_model is not None else None
