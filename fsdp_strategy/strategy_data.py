"""The positions of a Trainer fit's training dataloaders, as checkpoints record them and a resume
applies them (data.py holds one loader's sampler and position)."""

from __future__ import annotations

from typing import Any

from lightning.fabric.utilities.data import has_len

from fsdp_strategy.data import DataPosition, describe_batch_change


class TrainingPositions:
    """[Note: several training dataloaders] Where a fit's training dataloaders stand in the epoch, as
    a checkpoint records it and a resume applies it. Lightning iterates them as one
    ``CombinedLoader`` (a single dataloader too, in ``max_size_cycle``), counting the epoch's batches
    over all; each loader's place follows from that count n and the mode: ``min_size`` takes n
    batches of each; ``max_size`` takes min(n, its length) (a shorter one runs out and waits);
    ``max_size_cycle`` starts a shorter one again inside the epoch, so it is n mod its length into
    its current pass. A checkpoint holds, per loader, the global samples taken of its current pass;
    a resume skips them in that pass alone (later passes of a cycling loader are whole: the sampler's
    skip is taken once), and the epoch's batches left are the longest loader's rest (``min_size``:
    the shortest's), also at another world size. A single loader's checkpoint keeps its format.

    Lightning processes the loaders one by one and only then combines them (the mode is known at
    ``on_train_start``), and loader workers take their first indices when it sets the data up, before
    ``on_train_start``, as do progress bars their counts: so each loader is positioned as it is
    processed (by the checkpoint's mode), and ``check_resume`` then compares what the fit turned
    out to be with what the checkpoint was; where they differ, ``undo`` takes the position back.
    Costs: a few integers per loader at saves and resumes; a modulo and an attribute read per
    training batch (``at_batch``)."""

    def __init__(self, progress: Any, saved: dict[str, Any] | None) -> None:
        self.progress = progress  # the epoch loop's batch_progress: the epoch's batches Lightning counts
        self.saved = saved  # the checkpoint's position this setup resumes (None: a fresh setup)
        self.loaders: list[DataPosition | None] = []  # None: a loader without a DistributedSampler
        self.samplers: list[str] = []  # their samplers' class names
        self.skipped_batches = 0  # of the epoch's batches: those that stand for a resume's skip (recount)
        self.resumed_epoch = -1
        self._unshifted = progress.current.processed  # the checkpoint's count, before ``_recount``
        self._validated_at_step = 0  # validation batches run before the current optimizer step's first batch

    def add(self, position: DataPosition | None, dataloader: Any, epoch: int) -> None:
        """The next training dataloader of the fit, in Lightning's order, and its position (None); its
        sampler is set to the ``epoch`` the fit starts (or resumes) and skips what the checkpoint says
        the resumed epoch took of its current pass."""
        self.loaders.append(position)
        self.samplers.append(type(getattr(dataloader, "sampler", None)).__name__)
        if position is None:
            return
        position.sampler.set_epoch(epoch)
        saved = self.saved
        entries = (saved.get("loaders") or [saved]) if saved is not None and saved["epoch"] == epoch else []
        if len(self.loaders) <= len(entries):
            position.sampler.resume_from(epoch, entries[len(self.loaders) - 1]["consumed_samples"])
            self.resumed_epoch = epoch
            self._recount(saved.get("mode", "max_size_cycle"))

    def at_batch(self, validated: int, accumulate: int) -> None:
        """At a training batch's start: ``validated``, the validation batches run so far this epoch,
        kept at an optimizer step's first micro-batch ([Note: a step half accumulated])."""
        if self.progress.current.processed % accumulate == 0:
            self._validated_at_step = validated

    def validated_inside_step(self, validated: int) -> bool:
        """Whether a validation ran since the current optimizer step's first micro-batch: a position
        set back to that batch runs it again at the resume (with the same weights: the same metrics)."""
        return validated > self._validated_at_step

    def positioned(self) -> list[DataPosition] | None:
        """Every loader's position, or None where a loader has none."""
        return None if None in self.loaders else list(self.loaders)  # type: ignore[arg-type]

    @property
    def batch_size(self) -> int:
        """The samples each rank takes per training batch, over every loader."""
        return sum(position.batch_size for position in self.positioned() or ())

    def state_dict(self, mode: str, pending_batches: int = 0) -> dict[str, Any]:
        """The epoch, the global samples the whole job has consumed of it (what a resume into it
        skipped, plus what this job took since), with the batch that took them; less the
        ``pending_batches`` of an optimizer step not yet taken ([Note: a step half accumulated]).
        Several loaders: each one's samples of its current pass under ``loaders``."""
        positions = self.positioned()
        assert positions, "a position is saved only where every training dataloader has one"
        sampler, batches = positions[0].sampler, self.progress.current.processed - pending_batches
        if sampler.epoch == self.resumed_epoch:
            batches -= self.skipped_batches
        taken = [position.samples_taken(batches, mode) for position in positions]
        state: dict[str, Any] = {
            "epoch": sampler.epoch,
            "consumed_samples": sum(taken),
            "world_size": sampler.num_replicas,
            "batch_size": self.batch_size,
        }
        if len(positions) > 1:
            state["mode"] = mode
            state["loaders"] = [{"consumed_samples": n, "batch_size": p.batch_size} for n, p in zip(taken, positions)]
        return state

    def check_resume(self, mode: str, epoch: int) -> str | None:
        """None where the resumed checkpoint's position fits the fit's loaders (combined in ``mode``,
        resuming ``epoch``), else why not."""
        saved = self.saved
        assert saved is not None
        entries = saved.get("loaders") or [saved]
        if saved["epoch"] != epoch:
            return f"its data position is in epoch {saved['epoch']} and the loops resume epoch {epoch}"
        if len(entries) != len(self.loaders):
            return f"it was saved with {len(entries)} training dataloader(s) and this fit has {len(self.loaders)}"
        if len(entries) > 1 and saved.get("mode") != mode:
            return (
                f"its training dataloaders were combined with mode={saved.get('mode')!r} and this fit's with {mode!r}"
            )
        return None

    def undo(self, restart_epoch: bool) -> tuple[bool, bool]:
        """Take a resume's skips back; Lightning's batch count goes back to the checkpoint's (its
        loaders restart the epoch while it counts on, as under DDP) or, ``restart_epoch``, to the
        epoch's start (the whole epoch is taken again: later checkpoints hold where the loaders
        are). Whether a skip was taken back (the loaders' iteration must start again) and whether the
        count moved."""
        skipped = any(position is not None and position.sampler.skip > 0 for position in self.loaders)
        for position in self.loaders:
            if position is not None:
                position.sampler.resume_from(-1, 0)
        count = self.progress.current.processed
        if not self.progress.is_last_batch:
            self._shift(0 if restart_epoch else self._unshifted)
        self.resumed_epoch, self.skipped_batches = -1, 0
        return skipped, count != self.progress.current.processed

    def describe_change(self, world_size: int, mode: str) -> str | None:
        """What a resume at another number of ranks (or other per-rank batches) changes: each loader's
        global batch, old beside new, and the batches of an epoch where they differ (``drop_last``
        and the sampler's padding deal a dataset by the number of ranks); None if nothing does."""
        saved, positions = self.saved, self.positioned()
        assert saved is not None and positions
        entries, old_world = saved.get("loaders") or [saved], saved.get("world_size")
        if old_world is None or len(entries) != len(positions):
            return None
        lines = []
        for index, (entry, position) in enumerate(zip(entries, positions)):
            line = describe_batch_change({**entry, "world_size": old_world}, position.batch_size, world_size)
            mine = ([line] if line else []) + _dealing(position, entry["consumed_samples"], old_world, world_size)
            name = f"fsdp_custom: training dataloader {index}: " if len(positions) > 1 else "fsdp_custom: "
            lines += [text.replace("fsdp_custom: ", name, 1) for text in mine]
        old_batches = [
            p.epoch_batches(old_world, e.get("batch_size") or p.batch_size) for e, p in zip(entries, positions)
        ]
        new_batches = [position.batches() for position in positions]
        pick = min if mode == "min_size" else max
        old, new = pick(old_batches), pick(new_batches)
        if old != new:
            lines.append(
                f"fsdp_custom: an epoch is {old} batches at {old_world} ranks and {new} here (drop_last and the "
                "sampler's padding deal the dataset by the number of ranks): from this epoch's end on, the steps "
                "differ from those of the run that saved"
            )
        return "\n".join(lines) or None

    def _recount(self, mode: str) -> None:
        """Restate Lightning's batch counts of the resumed epoch (counted in the saving run's batches)
        in this run's batches: the epoch's batches less those its rest makes here after each loader's
        skip (none where it was saved at its last batch). At the same world size it changes nothing;
        at another, the epoch loop would otherwise end the epoch early (it counts the batches it has
        seen against the epoch's length) and progress bars start at the wrong batch."""
        positions = [position for position in self.loaders if position is not None]
        whole = [position.batches() for position in positions]
        rest = [position.batches(position.sampler.skipped()) for position in positions]
        if mode == "min_size":
            epoch, left = min(whole), min(rest)
        else:  # the longest loader's rest (max_size: any loader's)
            epoch = max(whole)
            left = max(r for r, w in zip(rest, whole) if mode == "max_size" or w == epoch)
        done = epoch if self.progress.is_last_batch else max(0, epoch - left)
        self.skipped_batches = done  # the position counts the skip itself, not these batches
        self._shift(done)

    def _shift(self, processed: int) -> None:
        """Move the epoch's batch counts together so that ``processed`` batches count as taken."""
        current, total = self.progress.current, self.progress.total
        shift = processed - current.processed
        for progress in (current, total):  # the total: a validation every n batches across epochs counts it
            for counter in ("ready", "started", "processed", "completed"):
                setattr(progress, counter, max(0, getattr(progress, counter) + shift))


def _dealing(position: DataPosition, taken: int, old_world: int, world_size: int) -> list[str]:
    """Where the sampler deals a loader's epoch otherwise at ``world_size`` ranks than at
    ``old_world`` (it fills every rank up with repeats, or drops the rest with ``drop_last``): the
    samples of the resumed epoch's rest (``taken`` consumed) and of every later epoch differ."""
    if old_world == world_size:
        return []
    samples = len(position.sampler.dataset)
    before, later = position.dealt(samples, old_world), position.dealt(samples, world_size)
    rest = position.dealt(samples - taken, world_size)
    if taken + rest == before and later == before:
        return []
    how = "drops the rest (drop_last)" if position.sampler.drop_last else "repeats samples to fill every rank"
    return [
        f"fsdp_custom: DistributedSampler deals an epoch of {samples} samples as {before} at {old_world} ranks and as "
        f"{later} at {world_size} ({how}), this epoch's remaining {samples - taken} as {rest}: those samples differ "
        "from the run that saved"
    ]


UNPOSITIONED = (
    "fsdp_custom: this fit {what}: its checkpoints hold no data position, so a resume from inside an epoch starts "
    "each training dataloader again from its first batch (as under DDP): the samples of the steps after it differ "
    "from those of an uninterrupted run"
)
TAKEN_BACK = (
    "fsdp_custom: the checkpoint was saved inside an epoch, but {why}: the epoch is taken again from its first "
    "batch (each training dataloader's, and Lightning's batch count), so the samples of the steps after it differ "
    "from those of an uninterrupted run"
)
REPEATED_VALIDATION = (
    "fsdp_custom: the checkpoint was saved between the micro-batches of an optimizer step, after a validation that "
    "ran inside that step: the resume takes the step's micro-batches again, and that validation runs again (the same "
    "weights: the same metrics); a callback that counts validations (EarlyStopping's patience, a ModelCheckpoint "
    "keeping the top k) sees it twice"
)
NOT_OURS = (
    "fsdp_custom: the checkpoint stopped {saved[consumed_samples]} samples into epoch {saved[epoch]}, but this "
    "training dataloader's sampler ({sampler}) is not the DistributedSampler the strategy can position: the epoch "
    "starts again from its first batch, and the samples of the following steps differ from an uninterrupted run's"
)


def combination(trainer: Any) -> tuple[str, bool]:
    """How Lightning combines the fit's training dataloaders (its ``CombinedLoader``'s mode), and
    whether ``limit_train_batches`` cuts one of several (its passes then end early, where a
    resumed pass would not: such fits are not positioned)."""
    combined = getattr(getattr(trainer, "fit_loop", None), "_combined_loader", None)
    if combined is None:
        return "max_size_cycle", False
    loaders, limits = combined.flattened, combined.limits or []
    cut = len(loaders) > 1 and any(limit < len(loader) for loader, limit in zip(loaders, limits) if has_len(loader))
    return combined._mode, cut
