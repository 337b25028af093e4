"""A run resumed from a checkpoint written inside a training batch (an exception in the step with
``save_on_exception``, inside an accumulated step too, or a SIGTERM acted on at a batch's start), or
after a step's first micro-batch
validates at the batches and to the losses of the uninterrupted run when validation runs every n
batches across epochs (``check_val_every_n_epoch=None``) ([Note: a batch started, not processed]
in data.py): Lightning (DDP alike) kept that batch in its total count, and every validation after
the resume ran one batch early."""

from __future__ import annotations

import warnings

import pytest
from dist_utils import run_ranks
from lightning.pytorch.utilities.exceptions import SIGTERMException
from test_resume_stops import Indexed, Interrupted, _data, _result, _trainer
from test_strategy import LIGHTNING_ENV

CASES = {  # how the first run stops, and the trainer options of all three runs
    "an exception in a step": ({"fail_batch": (0, 4)}, {"max_steps": 16}),
    "an exception inside an accumulated step": ({"fail_batch": (0, 5)}, {"max_steps": 8, "accumulate_grad_batches": 2}),
    "a SIGTERM to one rank": ({"sigterm_at": 4}, {"max_steps": 16}),
    # after the step's first micro-batch (Lightning reads a save in on_train_batch_end as a batch to complete)
    "an exception after a micro-batch": ({"fail_batch_end": (1, 0)}, {"max_steps": 8, "accumulate_grad_batches": 2}),
    # after a validation that ran inside the step (after its first micro-batch): that validation runs again, said
    "an exception after a validation": ({"fail_batch": (1, 1)}, {"max_steps": 6, "accumulate_grad_batches": 3}),
}
REPEATED = "after a validation that ran inside that step: the resume takes the step's micro-batches again"


class Validated(Indexed):
    """Records the global step and loss of each validation; raises in ``fail_batch`` (epoch, batch)."""

    def __init__(
        self,
        fail_batch: tuple[int, int] | None = None,
        sigterm_at: int | None = None,
        fail_batch_end: tuple[int, int] | None = None,
    ) -> None:
        super().__init__(sigterm_at=sigterm_at)
        self.fail_batch, self.fail_batch_end, self.validations = fail_batch, fail_batch_end, []

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        if (self.current_epoch, batch_idx) == self.fail_batch_end:
            raise Interrupted(f"stopped after batch {batch_idx}")

    def training_step(self, batch, batch_idx):
        if (self.current_epoch, batch_idx) == self.fail_batch:
            raise Interrupted(f"stopped in batch {batch_idx}")
        return super().training_step(batch, batch_idx)

    def on_validation_epoch_end(self) -> None:
        self.validations.append((self.trainer.global_step, float(self.trainer.callback_metrics["val_loss"])))


def _schedule_body(rank: int, world: int, root: str) -> dict:
    out = {}
    for name, (stop, options) in CASES.items():
        runs = (
            ("uninterrupted", {}, None),
            ("stopped", stop, None),
            ("resumed", {}, f"{root}/{name}/stopped/last.ckpt"),
        )
        for run, how, ckpt in runs:
            module = Validated(**how)
            trainer = _trainer(
                world,
                f"{root}/{name}/{run}",
                val_check_interval=3,
                check_val_every_n_epoch=None,
                num_sanity_val_steps=0,
                **options,
            )
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    trainer.fit(module, _data(world), _data(world), ckpt_path=ckpt)
                except (Interrupted, SIGTERMException):
                    pass
            said = " ".join(str(warning.message) for warning in caught)
            out[name, run] = {**_result(module, trainer, world), "validations": module.validations, "said": said}
    return out


def test_a_resume_from_inside_a_batch_validates_as_the_uninterrupted_run(tmp_path):
    out = run_ranks(_schedule_body, 2, tmp_path, str(tmp_path), env=LIGHTNING_ENV, timeout=300)[0]
    for name in CASES:
        whole, stopped, resumed = (out[name, run] for run in ("uninterrupted", "stopped", "resumed"))
        assert len(whole["validations"]) == 5, (name, whole["validations"])  # every 3 of 16 batches
        validated = [at for at in stopped["validations"] if at[0] < resumed["start"]] + resumed["validations"]
        assert [step for step, _ in validated] == [step for step, _ in whole["validations"]], (name, validated)
        assert [loss for _, loss in validated] == pytest.approx([loss for _, loss in whole["validations"]], rel=1e-9)
        redone = len(whole["steps"]) - len(resumed["steps"])  # from the first batch of the step it stopped in
        assert 0 < redone <= len(stopped["steps"]), (name, redone)
        assert [ids for ids, _ in resumed["steps"]] == [ids for ids, _ in whole["steps"][redone:]], name
        repeated = [at for at in stopped["validations"] if at[0] == resumed["start"]]  # run again after the resume
        assert (REPEATED in resumed["said"]) == bool(repeated) == (name == "an exception after a validation"), name
