"""A training progress bar that stays sane after a mid-epoch resume.

On a resume in the middle of an epoch Lightning calls no ``on_train_epoch_start`` for that epoch,
so its bar shows ``Training: 151/?`` (no epoch, no total); and when training is bounded by
``max_steps`` its total is the steps left, not the batch the epoch ends at. This bar names the
epoch, starts at the batch it resumes from and counts to the batch it will end at
(``Epoch 0: 151/170``). Otherwise it is Lightning's
``TQDMProgressBar``.
"""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import TQDMProgressBar


class ResumedEpochProgressBar(TQDMProgressBar):
    """``TQDMProgressBar`` with the resumed epoch's name and total. Costs: nothing."""

    def on_train_start(self, trainer: L.Trainer, *args: Any) -> None:
        super().on_train_start(trainer, *args)
        if trainer.fit_loop.restarted_mid_epoch:  # Lightning calls no on_train_epoch_start: start the bar here
            bar = self.train_progress_bar
            total = self.total_train_batches
            bar.total = None if total == float("inf") else total
            bar.n = bar.initial = bar.last_print_n = _batches_done_before(trainer)
            bar.set_description(f"Epoch {trainer.current_epoch}")

    @property
    def total_train_batches(self) -> int | float:
        """The batch of the epoch (counted from its first) at which it will end."""
        trainer = self.trainer
        epoch_batches = trainer.num_training_batches
        if trainer.max_steps is None or trainer.max_steps < 0:
            return epoch_batches
        left = (trainer.max_steps - trainer.global_step) * trainer.accumulate_grad_batches
        return min(epoch_batches, _batches_done_before(trainer) + left)


def _batches_done_before(trainer: L.Trainer) -> int:
    """Batches of the current epoch taken before this run: those of the checkpoint while the epoch
    it resumes runs; none when it was saved at the previous epoch's last batch (Lightning then
    goes on to the next epoch, again without its start hook) and in every later epoch."""
    epoch_loop = trainer.fit_loop.epoch_loop
    processed = epoch_loop.batch_progress.current.processed
    return processed if epoch_loop.restarting and processed < trainer.num_training_batches else 0
