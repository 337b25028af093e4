"""Resume mid-epoch at the same position, also on another number of ranks.

Lightning gives a training dataloader a ``DistributedSampler``; on a resume from a checkpoint
taken in the middle of an epoch it would replay the epoch from its first batch. The strategy
swaps that sampler for :class:`ResumableDistributedSampler` (same order, same arguments), and
the checkpoint records under its own key (``DATA_POSITION_KEY``) how many samples of the epoch
the whole job consumed, so a resumed run skips exactly those, whatever its world size. The
dataloader itself stays stateless: DDP and Lightning's FSDP load our checkpoints unchanged
(Lightning's loops refuse a loader state they have no stateful loader for).

[Note: global sample order]
A DistributedSampler gives rank r the positions ``r, r + W, r + 2W, ...`` of one global
(shuffled, padded) order, so after k batches of B samples the job has consumed exactly the
first ``k * B * W`` positions. The rest is dealt round-robin to the ranks of the resumed job.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from torch.utils.data import DataLoader, DistributedSampler


class ResumableDistributedSampler(DistributedSampler):
    """A DistributedSampler that can start its current epoch after the first ``skip`` samples.

    Costs: nothing beyond DistributedSampler; ``len()`` stays the full epoch's length.
    """

    skip = 0  # global samples of ``skip_epoch`` already consumed (see [Note: global sample order])
    skip_epoch = -1
    skip_taken = False  # the skipped epoch's first pass has begun: a second pass of it is whole

    def epoch_order(self) -> list[int]:
        """The epoch's order over the dataset (shuffled with ``seed + epoch``), before padding."""
        if not self.shuffle:
            return list(range(len(self.dataset)))
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(len(self.dataset), generator=generator).tolist()

    def dealt(self, positions: list[int], order: list[int]) -> list[int]:
        """``positions`` made a whole number of rounds over the ranks as DistributedSampler makes an
        epoch: cut (``drop_last``) or padded with ``order``'s first samples."""
        if self.drop_last:
            return positions[: len(positions) - len(positions) % self.num_replicas]
        padding = (-len(positions)) % self.num_replicas
        return positions + (order * math.ceil(padding / max(1, len(order))))[:padding]

    def __iter__(self) -> Iterator[int]:
        order = self.epoch_order()
        start = 0 if self.skip_taken else self.skipped()  # [Note: several training dataloaders]: a cycle
        self.skip_taken = self.skip_taken or self.epoch == self.skip_epoch
        # cut before padding: at another world size the padding differs, and the rest is each untaken sample once
        rest = self.dealt(order[start:], order)
        return iter(rest[self.rank :: self.num_replicas])

    def resume_from(self, epoch: int, consumed: int) -> None:
        """Skip the first ``consumed`` global samples when ``epoch`` is iterated next."""
        self.skip_epoch, self.skip, self.skip_taken = epoch, consumed, False

    def skipped(self) -> int:
        """The global samples the current epoch's iteration skips (a resume into it), else 0."""
        return self.skip if self.epoch == self.skip_epoch else 0

    def rank_length(self, skipped: int | None = None) -> int:
        """The samples ``__iter__`` gives this rank now (the epoch's share, less a resume's skip), or
        in an epoch that skips ``skipped`` global samples."""
        skipped = self.skipped() if skipped is None else skipped
        left, ranks = max(0, len(self.dataset) - skipped), self.num_replicas
        return (left - left % ranks if self.drop_last else left + (-left) % ranks) // ranks  # as ``dealt`` deals


DATA_POSITION_KEY = "fsdp_custom_data_position"  # a top-level checkpoint key: other strategies ignore it


class DataPosition:
    """One training dataloader's place in its epoch: its resumable sampler and its batches."""

    def __init__(self, sampler: ResumableDistributedSampler, batch_size: int, drop_last: bool = False):
        self.sampler = sampler
        self.batch_size = batch_size
        self.drop_last = drop_last  # the DataLoader's: a short last batch is dropped

    def batches(self, skipped: int = 0) -> int:
        """This rank's batches of an epoch that skips ``skipped`` global samples."""
        samples = self.sampler.rank_length(skipped)
        return samples // self.batch_size if self.drop_last else math.ceil(samples / self.batch_size)

    def epoch_batches(self, world_size: int, batch_size: int) -> int:
        """This loader's batches per rank in a whole epoch at ``world_size`` ranks of ``batch_size``."""
        samples, drop = len(self.sampler.dataset), self.sampler.drop_last
        per_rank = samples // world_size if drop else math.ceil(samples / world_size)
        return per_rank // batch_size if self.drop_last else math.ceil(per_rank / batch_size)

    def dealt(self, samples: int, world_size: int) -> int:
        """The samples the sampler deals ``world_size`` ranks out of ``samples`` (a rest of an epoch or
        a whole one): cut to a multiple of the ranks (``drop_last``) or filled up with repeats."""
        return samples - samples % world_size if self.sampler.drop_last else samples + (-samples) % world_size

    def samples_taken(self, batches: int, mode: str) -> int:
        """The global samples of this loader's current pass that ``batches`` batches of the epoch took
        (counted since a resume into it, which skipped ``sampler.skipped()``), the loader iterated by
        a ``CombinedLoader`` in ``mode`` ([Note: several training dataloaders])."""
        sampler = self.sampler
        skipped, step = sampler.skipped(), self.batch_size * sampler.num_replicas
        first = self.batches(skipped)  # the resumed pass
        if mode == "max_size_cycle" and batches > first:  # a shorter loader cycled: later passes are whole
            return (batches - first) % max(1, self.batches()) * step
        if mode == "max_size":  # a shorter loader ran out and waits for the epoch's end
            batches = min(batches, first)
        return min(skipped + batches * step, len(sampler.dataset))  # a short last batch: the whole dataset


UNAPPLIED = (  # [Note: a step half accumulated], where the batches of the step are not known (Fabric, manual)
    "the gradients of the backward(s) since the last optimizer step are not in the checkpoint, and the resumed loop "
    "goes on with the next batch, so its first optimizer step lacks them and differs from the uninterrupted run's; "
    "save right after optimizer.step()"
)


def pending_batches(trainer: Any) -> int:
    """[Note: a step half accumulated] The training batches of the current epoch taken since the last
    optimizer step: under ``accumulate_grad_batches``, a checkpoint saved between two of a step's
    micro-batches (a ``ModelCheckpoint`` monitoring a validation run there, ``save_on_exception``, a
    periodic save after a resume into another folder) holds the weights before the step, not the
    gradients of its micro-batches taken so far. Its data position is set back by them: a resume
    takes them again and steps as the uninterrupted run does (the batch counts of the epoch follow
    the position, ``recount_batches``). Lightning steps after every ``accumulate_grad_batches``
    batches of an epoch and at its last. Costs: a few attribute reads."""
    accumulate = getattr(trainer, "accumulate_grad_batches", 1)  # 1 also without a trainer
    if accumulate == 1:
        return 0
    progress = trainer.fit_loop.epoch_loop.batch_progress
    processed = progress.current.processed
    if progress.is_last_batch or processed >= trainer.num_training_batches:
        return 0
    return processed % accumulate


def rewind_pending_batches(checkpoint: dict[str, Any], pending: int) -> None:
    """[Note: a step half accumulated] The loop state of a checkpoint whose data position was set back
    by the ``pending`` micro-batches of a step not taken, set back with it: those batches count as
    never started (Lightning otherwise reads a save in ``on_train_batch_end`` as one to complete,
    and counts the step's first micro-batch taken again as its second: it steps one batch early)."""
    batches = checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]
    for progress in (batches["total"], batches["current"]):
        taken = max(0, progress["processed"] - pending)
        progress.update(ready=taken, started=taken, processed=taken, completed=taken)
    batches["is_last_batch"] = False


def make_resumable(dataloader: Any) -> tuple[Any, DataPosition | None]:
    """``dataloader`` rebuilt around a ResumableDistributedSampler, and its DataPosition.
    Dataloaders without a plain DistributedSampler (or one of ours, which starts afresh) are
    returned unchanged (position None)."""
    sampler = getattr(dataloader, "sampler", None)
    if not isinstance(dataloader, DataLoader) or type(sampler) not in (DistributedSampler, ResumableDistributedSampler):
        return dataloader, None  # a CombinedLoader's loaders come back with ours: Lightning writes them into it
    from lightning.pytorch.utilities.data import _update_dataloader

    resumable = ResumableDistributedSampler(
        sampler.dataset, sampler.num_replicas, sampler.rank, sampler.shuffle, sampler.seed, sampler.drop_last
    )
    resumable.epoch = sampler.epoch
    loader = _update_dataloader(dataloader, resumable)
    return loader, DataPosition(resumable, loader.batch_size or 1, loader.drop_last)


def reopen_stopped_epoch(checkpoint: dict[str, Any], position: dict[str, int] | None) -> bool:
    """[Note: an epoch stopped, not finished] A fit that stops inside an epoch (``max_steps``,
    ``max_time``, a stop request) ends the epoch loop there and counts the epoch as finished; the
    checkpoint saved at its end (``save_last``, ``trainer.save_checkpoint``) says so, and a resume
    from it starts the next epoch: the rest of this one is never seen, and every later step trains on
    other samples than the uninterrupted run. The data position (without one, the epoch's batch
    count: a checkpoint of DDP's) says how far the epoch went: where the loop state counts the
    position's epoch as finished but its last batch was never reached (``is_last_batch`` false: an
    epoch cut by ``limit_train_batches`` reaches it), the epoch is reopened in ``checkpoint``'s loop
    state, as a checkpoint saved inside it would have it (Lightning by itself, DDP too, runs the rest
    of that epoch with the sampler set to the next one's order). Returns whether it did. Costs: a
    look at a few counters."""
    fit = checkpoint.get("loops", {}).get("fit_loop", {})
    epochs, batches = fit.get("epoch_progress"), fit.get("epoch_loop.batch_progress")
    went = batches["current"]["processed"] if batches and position is None else (position or {}).get("consumed_samples")
    if not epochs or not batches or batches.get("is_last_batch", True) or not went:
        return False
    total, current = epochs["total"], epochs["current"]
    finished = total["processed"] if position is None else position["epoch"] + 1
    # saved after the epoch's end hooks ran (completed) or from on_train_epoch_end (ModelCheckpoint's
    # default save there: processed, not yet completed); Lightning starts the next epoch from either
    ended = [total[key] for key in ("ready", "started", "processed")]
    if ended != [finished] * 3 or {total["completed"], current["completed"]} - {finished, finished - 1}:
        return False
    for progress in (total, current):
        progress["completed"] = min(progress["completed"], finished - 1)
        progress["processed"] -= 1
    if isinstance(checkpoint.get("epoch"), int):
        checkpoint["epoch"] = finished - 1
    return True


def complete_finished_epoch(checkpoint: dict[str, Any]) -> bool:
    """[Note: an epoch finished, then resumed by steps] A checkpoint saved after an epoch's last
    batch (ModelCheckpoint's default save in ``on_train_epoch_end``, at the end of a fit stopped by
    ``max_epochs``, or a step-interval save at that batch) keeps that epoch's batch counts. Resumed by
    a fit bounded by ``max_steps`` alone, Lightning (DDP alike) runs one batch of the next epoch under
    the finished one's number, then starts the epoch after it: most of the next epoch is never seen.
    The loop state is set to the next epoch's start (the finished epoch completed, its batch counts of
    the current epoch cleared), as a fit bounded by ``max_epochs`` reads it. Returns whether it did.
    Costs: a look at a few counters."""
    fit = checkpoint.get("loops", {}).get("fit_loop", {})
    epochs, batches = fit.get("epoch_progress"), fit.get("epoch_loop.batch_progress")
    if not epochs or not batches or not batches.get("is_last_batch"):
        return False
    total, current = epochs["total"], epochs["current"]
    finished = total["started"]
    if total["ready"] == finished and total["processed"] == finished - 1 == total["completed"]:
        _end_epoch_at_last_batch(fit)
    if finished < 1 or [total["ready"], total["processed"]] != [finished] * 2 or total["completed"] < finished - 1:
        return False
    for progress in (total, current):
        progress["completed"] = progress["processed"]
    batches["current"] = dict.fromkeys(batches["current"], 0)
    batches["is_last_batch"] = False
    if isinstance(checkpoint.get("epoch"), int):
        checkpoint["epoch"] = finished
    return True


def drop_unprocessed_batch(checkpoint: dict[str, Any]) -> bool:
    """[Note: a batch started, not processed] A checkpoint saved after a training batch was counted
    ready but before it was processed (an exception inside the step with ``save_on_exception``, a
    SIGTERM acted on at the batch's start) counts that batch in Lightning's total: the resume takes it
    again (the epoch's count goes back to the batches completed), but the total stays one ahead, so
    a validation every n batches across epochs (``check_val_every_n_epoch=None``) runs one batch
    early ever after; and where it was the epoch's last batch (the fetcher flags it when it fetches
    it), the resume takes the epoch for finished and skips it (DDP alike). The counts of both are
    set back to the processed batches, and the flag cleared. Returns whether it did."""
    batches = checkpoint.get("loops", {}).get("fit_loop", {}).get("epoch_loop.batch_progress")
    if not batches or batches["current"]["ready"] <= batches["current"]["processed"]:
        return False
    for progress in (batches["total"], batches["current"]):
        progress["ready"] = progress["started"] = progress["processed"]
    batches["is_last_batch"] = False
    return True


def _end_epoch_at_last_batch(fit: dict[str, Any]) -> None:
    """A checkpoint saved at an epoch's last batch (``on_train_batch_end``: a step-interval save) as the
    same run saved in ``on_train_epoch_end`` has it: the batch completed, counted as stepped, the epoch
    processed (those three counters are all that differ; an epoch-interval scheduler has already
    stepped in both). Resumed as saved, Lightning (DDP alike) counts the epoch finished but never
    the next one started, so every later checkpoint names one epoch too few and a resume from one of
    them trains that epoch again."""
    batches = fit["epoch_loop.batch_progress"]
    for progress in (batches["total"], batches["current"]):
        progress["completed"] = progress["processed"]
    stepped = fit.get("epoch_loop.state_dict", {})
    if isinstance(stepped.get("_batches_that_stepped"), int):
        stepped["_batches_that_stepped"] += 1
    for progress in fit["epoch_progress"].values():
        progress["processed"] += 1


def next_epoch_start(position: dict[str, Any]) -> dict[str, Any]:
    """``position`` (a checkpoint's, saved at its epoch's last batch) moved to the next epoch's start."""
    moved = {**position, "epoch": position["epoch"] + 1, "consumed_samples": 0}
    if "loaders" in position:
        moved["loaders"] = [{**loader, "consumed_samples": 0} for loader in position["loaders"]]
    return moved


def describe_batch_change(saved: dict[str, int], batch_size: int, world_size: int) -> str | None:
    """What a resume at another number of ranks (or another per-rank batch) changes: the global batch
    of every step from here on, old beside new, and what to change to keep it; None if nothing does."""
    old_world, old_batch = saved.get("world_size"), saved.get("batch_size")
    if old_world is None or (old_world, old_batch or batch_size) == (world_size, batch_size):
        return None
    old_batch = old_batch or batch_size  # a checkpoint that did not record it: the per-rank batch kept
    old, new = old_world * old_batch, world_size * batch_size
    if old == new:
        return (
            f"fsdp_custom: the checkpoint was trained on {old_world} ranks x {old_batch} samples, this run has "
            f"{world_size} ranks x {batch_size}: the same global batch of {new} samples per step"
        )
    keep = []
    if old % world_size == 0:
        keep.append(f"a per-rank batch of {old // world_size}")
    if old % new == 0:
        keep.append(f"accumulate_grad_batches={old // new}")
    how = f"to keep {old} per step, {' or '.join(keep)}; or " if keep else "you may want to "
    return (
        f"fsdp_custom: the checkpoint was trained on {old_world} ranks x {old_batch} samples = {old} per step; this "
        f"run has {world_size} ranks x {batch_size} = {new} per step ({new / old:.3g}x) with the same learning "
        f"rate: {how}scale the learning rate with the batch"
    )


class ExactResumeNotice:
    """Lightning warns on a mid-epoch resume that "your dataloader is not resumable" (it knows only
    stateful dataloaders). With a DataPosition loaded the resume is exact, so the warning would
    contradict it: while installed (from the dataloader's setup until the first batch, when the
    epoch loop has made its check) a filter hides that one warning, and one line says where the
    epoch resumes. Costs: one entry in ``warnings.filters``, for those moments.
    """

    MESSAGE = "You're resuming from a checkpoint that ended before the epoch ended and your dataloader is not resumable"

    def __init__(self) -> None:
        self._filter: tuple | None = None

    def install(self, position: dict[str, int]) -> None:
        """Hide the warning for the resume at ``position`` (a DataPosition's state) and say where it is."""
        self.remove()
        warnings.filterwarnings("ignore", message=self.MESSAGE, category=PossibleUserWarning)
        self._filter = warnings.filters[0]
        if not position["consumed_samples"]:  # the epoch's start: nothing to say, Lightning's warning still false
            return
        loaders = position.get("loaders")
        taken = f"its first {position['consumed_samples']} samples"
        if loaders:
            counts = ", ".join(str(loader["consumed_samples"]) for loader in loaders)
            taken = f"{counts} samples of its {len(loaders)} training dataloaders' current passes"
        rank_zero_info(
            f"fsdp_custom: resuming epoch {position['epoch']} after {taken}, exactly where the checkpoint left it "
            "(Lightning's warning that the dataloader is not resumable does not apply and is hidden)"
        )

    def remove(self) -> None:
        """Show the warning again (idempotent)."""
        if self._filter is not None and self._filter in warnings.filters:
            warnings.filters.remove(self._filter)
        self._filter = None
