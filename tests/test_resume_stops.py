"""A run resumed from the checkpoint its fit left, whatever stopped it (``max_steps``, ``max_time`` or
``max_epochs``, off the checkpoint grid, an exception, a real SIGTERM to one rank, or a validation
after it), trains every
following step on the samples of the uninterrupted run and to its losses, at the same and at another
world size (the same global batch), from sharded and full checkpoints ([Note: an epoch stopped, not
finished] in data.py); a resume that changes the global batch says so, old beside new; a checkpoint
of another optimizer is refused before anything loads."""

from __future__ import annotations

import logging
import os
import signal
import time
import warnings

import lightning as L
import pytest
import torch
import torch.distributed as dist
from dist_utils import run_ranks
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException
from test_strategy import LIGHTNING_ENV, quiet_trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fsdp_strategy import FSDPCustomStrategy
from fsdp_strategy.checkpoint.layout import shortened
from fsdp_strategy.data import complete_finished_epoch, describe_batch_change, reopen_stopped_epoch

SAMPLES, GLOBAL_BATCH = 96, 12  # 8 steps per epoch at any world size that divides 12
GRID = 50  # a periodic checkpoint every 50 steps: none before the stops below, so ``last`` is the fit's end


class Interrupted(RuntimeError):
    """What ends a run "on an exception" below."""


class Indexed(L.LightningModule):
    """A linear model that records the sample ids and the loss of each step."""

    def __init__(
        self,
        sleep: float = 0.0,
        fail_at: int | None = None,
        sigterm_at: int | None = None,
        sigterm_in_validation: int | None = None,
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net, self.sleep, self.steps = nn.Linear(5, 1).double(), sleep, []
        self.fail_at = fail_at  # raise inside this step (every rank alike), as a crash would
        self.sigterm_at = sigterm_at  # rank 1 receives a real SIGTERM inside this step (an operator, a drain)
        self.sigterm_in_validation = sigterm_in_validation  # ... inside the validation after this step
        self.validated = 0  # validation batches run

    def on_train_start(self) -> None:
        self.start = self.trainer.global_step  # where a resumed fit starts

    def training_step(self, batch, batch_idx):
        x, ids = batch
        if self.trainer.global_step == self.fail_at:
            raise Interrupted(f"stopped at step {self.fail_at}")
        if self.trainer.global_step == self.sigterm_at and self.global_rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        loss = self.net(x).square().mean()
        self.steps.append((ids.tolist(), loss.item()))
        time.sleep(self.sleep)
        return loss

    def validation_step(self, batch, batch_idx):
        if (self.trainer.global_step, batch_idx, self.global_rank) == (self.sigterm_in_validation, 1, 1):
            os.kill(os.getpid(), signal.SIGTERM)
        self.validated += 1
        self.log("val_loss", self.net(batch[0]).square().mean(), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def _data(world: int, per_rank: int | None = None, samples: int = SAMPLES) -> DataLoader:
    x = torch.randn(samples, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    batch = per_rank or GLOBAL_BATCH // world
    return DataLoader(TensorDataset(x, torch.arange(samples)), batch_size=batch, shuffle=True)


def _trainer(world: int, root: str, state: str = "sharded", epoch_end_save: bool = False, grid: int = GRID, **stop):
    """A Trainer of ``world`` ranks saving into ``root``: ``epoch_end_save``: ModelCheckpoint's default, a
    save in ``on_train_epoch_end`` (which Lightning runs at a ``max_steps`` stop too); else one every
    ``grid`` steps, on an exception and ``last``."""
    return L.Trainer(
        strategy=FSDPCustomStrategy(state_dict_type=state),
        accelerator="cpu",
        devices=world,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            ModelCheckpoint(dirpath=root, save_last=True)
            if epoch_end_save
            else ModelCheckpoint(
                dirpath=root, every_n_train_steps=grid, save_top_k=-1, save_last=True, save_on_exception=True
            )
        ],
        **stop,
    )


def _result(module: Indexed, trainer: L.Trainer, world: int, exit_status: int | None = None) -> dict:
    """Per step of ``module``'s fit, the samples of every rank (sorted) and the mean loss; where it started."""
    everyone = [None] * world
    dist.all_gather_object(everyone, module.steps)
    steps = []
    for at_step in zip(*everyone):
        steps.append((sorted(i for ids, _ in at_step for i in ids), sum(loss for _, loss in at_step) / world))
    return {
        "steps": steps,
        "global_step": trainer.global_step,
        "start": module.start,
        "exit_status": exit_status,
        "validated": module.validated,
    }


def _fit(
    world: int,
    root: str,
    ckpt: str | None = None,
    sleep: float = 0.0,
    fail_at: int | None = None,
    validate: bool = False,
    sigterm_at: int | None = None,
    sigterm_in_validation: int | None = None,
    per_rank: int | None = None,
    **trainer_options,
) -> dict:
    """Fit to the stop in ``trainer_options`` (with ``_trainer``'s options); ``per_rank``: the per-rank
    batch (default: the global batch of 12 split); the ``_result``."""
    module = Indexed(sleep, fail_at, sigterm_at, sigterm_in_validation)
    trainer = _trainer(world, root, **trainer_options)
    exit_status = None
    try:
        validation = _data(world) if sigterm_in_validation is not None else None
        trainer.fit(module, _data(world, per_rank), validation, ckpt_path=ckpt)
    except Interrupted:
        pass
    except SIGTERMException as stop_signal:
        exit_status = stop_signal.code
    if validate:  # a validation after the fit, then the checkpoint saved last
        trainer.validate(module, _data(world), verbose=False)
        trainer.save_checkpoint(f"{root}/last.ckpt")
    return _result(module, trainer, world, exit_status)


STOPS = {  # how the first run stops, and how far the resumed one goes
    "max_steps": ({"max_steps": 5}, {"max_steps": 13}),
    "max_steps, saved at the epoch's end hook": ({"max_steps": 3, "epoch_end_save": True}, {"max_steps": 13}),
    "max_steps at the epoch's last batch, saved at its end hook": (
        {"max_steps": 8, "epoch_end_save": True},
        {"max_steps": 13},
    ),
    "max_epochs": ({"max_epochs": 1}, {"max_epochs": 2}),
    # saved in on_train_batch_end of the epoch's last batch, resumed to the next epoch's last batch (saved
    # there too), and that resumed again below: Lightning alone counted the second epoch as never started
    "a periodic save at the epoch's last batch": ({"max_steps": 8, "grid": 8}, {"max_steps": 16, "grid": 8}),
    "max_time": ({"max_time": {"seconds": 2}, "max_steps": 13}, {"max_steps": 13}),
    "an exception": ({"max_steps": 13, "fail_at": 5}, {"max_steps": 13}),
    "a SIGTERM to one rank": ({"max_steps": 13, "sigterm_at": 4}, {"max_steps": 13}),
    "a SIGTERM in a validation": (
        {"max_steps": 13, "sigterm_in_validation": 4, "val_check_interval": 4, "num_sanity_val_steps": 0},
        {"max_steps": 13},
    ),
    "a validation after max_steps": ({"max_steps": 6, "validate": True}, {"max_steps": 13}),
}


def _stop_body(rank: int, world: int, root: str, phase: str) -> dict:
    warnings.filterwarnings("ignore")
    out = {}
    if phase == "save":
        out["uninterrupted"] = _fit(world, f"{root}/uninterrupted", max_steps=20)
        for name, (stop, _) in STOPS.items():
            sleep = 0.4 if name == "max_time" else 0.0  # a few steps into the first epoch of 8
            state = "full" if name == "max_steps" else "sharded"
            out[name] = _fit(world, f"{root}/{name}", sleep=sleep, state=state, **stop)
    # a chain that changes the global batch: 2 ranks x 4 (1 step: 8 samples), 3 x 4 (1 step: 12), 2 x 4 to
    # the epoch's end: the third resumes after 20 samples, not after whole batches of the second's 12
    links = {"save": (None, {"max_steps": 1}), "resume": ("batch-1", {"max_steps": 2}), "chain": ("batch-2", {})}
    previous, stop = links[phase]
    ckpt = f"{root}/{previous}/last.ckpt" if previous else None
    link = "batch-3" if phase == "chain" else f"batch-{1 + (phase == 'resume')}"
    out[link] = _fit(world, f"{root}/{link}", ckpt, per_rank=4, **(stop or {"max_epochs": 1}))
    if phase == "chain":  # the third link: back at 2 ranks from the 3 ranks' stop
        out["chained"] = _fit(world, f"{root}/chain-end", f"{root}/chain/last.ckpt", max_steps=16)
        return out
    for name, (_, further) in STOPS.items():
        out[(name, "resumed")] = _fit(world, f"{root}/{name}-{world}", f"{root}/{name}/last.ckpt", **further)
    if phase == "resume":  # the second link of a chain: stopped again inside the next epoch
        out["chain"] = _fit(world, f"{root}/chain", f"{root}/max_steps/last.ckpt", max_steps=10)
    else:  # the periodic save at the second epoch's last batch, resumed
        hop = f"{root}/a periodic save at the epoch's last batch-{world}/last.ckpt"
        out["second hop"] = _fit(world, f"{root}/second hop", hop, max_steps=20, grid=8)
    return out


def _assert_continues(stopped: dict, resumed: dict, uninterrupted: dict, where: str) -> None:
    start = resumed["start"]
    assert start == stopped["global_step"], (where, start)  # the checkpoint of the fit's end
    assert 0 < start < len(uninterrupted["steps"]), (where, start)
    before = uninterrupted["steps"][stopped["start"] : start]
    assert [ids for ids, _ in stopped["steps"]] == [ids for ids, _ in before], where
    assert [loss for _, loss in stopped["steps"]] == pytest.approx([loss for _, loss in before], rel=1e-9), where
    expected = uninterrupted["steps"][start : start + len(resumed["steps"])]
    assert len(resumed["steps"]) > 2, (where, len(resumed["steps"]))
    assert [ids for ids, _ in resumed["steps"]] == [ids for ids, _ in expected], where
    assert [loss for _, loss in resumed["steps"]] == pytest.approx([loss for _, loss in expected], rel=1e-9), where


def test_a_fit_stopped_off_the_checkpoint_grid_resumes_sample_by_sample(tmp_path):
    """Every stop at 2 ranks, each resumed at 2 and at 3; and a chain 2 -> 3 -> 2 stopped inside epochs."""
    saved = run_ranks(_stop_body, 2, tmp_path, str(tmp_path), "save", env=LIGHTNING_ENV, timeout=300)[0]
    assert saved["max_steps"]["global_step"] == 5 and saved["max_epochs"]["global_step"] == 8
    assert saved["an exception"]["global_step"] == 5 and saved["a validation after max_steps"]["global_step"] == 6
    # both ranks stop before the batch after the one rank 1 was signalled in, with status 143 (128 + SIGTERM)
    assert (saved["a SIGTERM to one rank"]["global_step"], saved["a SIGTERM to one rank"]["exit_status"]) == (5, 143)
    in_validation = saved["a SIGTERM in a validation"]  # stopped before its next validation batch
    assert (in_validation["global_step"], in_validation["exit_status"], in_validation["validated"]) == (4, 143, 2)
    assert 1 < saved["max_time"]["global_step"] < 8, saved["max_time"]["global_step"]  # inside the first epoch
    other = run_ranks(_stop_body, 3, tmp_path, str(tmp_path), "resume", env=LIGHTNING_ENV, timeout=300)[0]
    for name in STOPS:
        for world, resumed in ((2, saved[(name, "resumed")]), (3, other[(name, "resumed")])):
            _assert_continues(saved[name], resumed, saved["uninterrupted"], f"{name} resumed at world {world}")
    chained = run_ranks(_stop_body, 2, tmp_path, str(tmp_path), "chain", env=LIGHTNING_ENV, timeout=300)[0]
    periodic = saved[("a periodic save at the epoch's last batch", "resumed")]
    _assert_continues(periodic, saved["second hop"], saved["uninterrupted"], "a periodic save resumed twice")
    _assert_continues(saved["max_steps"], other["chain"], saved["uninterrupted"], "2 -> 3 ranks")
    _assert_continues(other["chain"], chained["chained"], saved["uninterrupted"], "2 -> 3 -> 2 ranks")
    links = [saved["batch-1"], other["batch-2"], chained["batch-3"]]
    assert [len(link["steps"]) for link in links] == [1, 1, 10], [len(link["steps"]) for link in links]
    seen = sorted(i for link in links for ids, _ in link["steps"] for i in ids)
    assert seen == list(range(SAMPLES)), sorted(set(range(SAMPLES)) - set(seen))  # each sample once


def test_the_loop_state_of_a_stopped_or_finished_epoch_is_corrected_and_only_then():
    def checkpoint(completed: int, is_last_batch: bool) -> dict:
        counts = {"ready": 1, "started": 1, "processed": completed, "completed": completed}
        epochs = {"total": dict(counts), "current": dict(counts)}
        batches = {"total": {}, "current": {}, "is_last_batch": is_last_batch}
        return {
            "epoch": completed,
            "loops": {"fit_loop": {"epoch_progress": epochs, "epoch_loop.batch_progress": batches}},
        }

    stopped = checkpoint(1, is_last_batch=False)  # max_steps inside epoch 0
    assert reopen_stopped_epoch(stopped, {"epoch": 0, "consumed_samples": 40})
    assert stopped["loops"]["fit_loop"]["epoch_progress"]["total"] == {
        "ready": 1,
        "started": 1,
        "processed": 0,
        "completed": 0,
    }
    assert stopped["epoch"] == 0
    foreign = checkpoint(1, is_last_batch=False)  # DDP's: no data position, 3 batches into epoch 0
    foreign["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"] = {"processed": 3}
    assert reopen_stopped_epoch(foreign, None) and foreign["epoch"] == 0
    assert not reopen_stopped_epoch(checkpoint(1, is_last_batch=True), {"epoch": 0, "consumed_samples": 96})
    assert not reopen_stopped_epoch(checkpoint(0, is_last_batch=False), {"epoch": 0, "consumed_samples": 40})  # inside
    assert not reopen_stopped_epoch(checkpoint(1, is_last_batch=False), {"epoch": 0, "consumed_samples": 0})
    at_epoch_end_hook = checkpoint(1, is_last_batch=False)  # ModelCheckpoint's on_train_epoch_end save
    for progress in at_epoch_end_hook["loops"]["fit_loop"]["epoch_progress"].values():
        progress["completed"] = 0
    assert reopen_stopped_epoch(at_epoch_end_hook, {"epoch": 0, "consumed_samples": 40})
    assert at_epoch_end_hook["loops"]["fit_loop"]["epoch_progress"]["current"]["processed"] == 0
    at_last_batch = checkpoint(1, is_last_batch=True)  # the same save after the epoch's last batch
    for progress in at_last_batch["loops"]["fit_loop"]["epoch_progress"].values():
        progress["completed"] = 0
    assert complete_finished_epoch(at_last_batch)
    assert at_last_batch["loops"]["fit_loop"]["epoch_progress"]["current"]["completed"] == 1
    assert at_last_batch["loops"]["fit_loop"]["epoch_loop.batch_progress"]["is_last_batch"] is False
    assert not complete_finished_epoch(at_epoch_end_hook)  # inside the epoch: reopened instead
    at_batch_end = checkpoint(0, is_last_batch=True)  # a periodic save in on_train_batch_end of the last batch
    fit = at_batch_end["loops"]["fit_loop"]
    for counts in ("total", "current"):
        fit["epoch_loop.batch_progress"][counts] = {"ready": 8, "started": 8, "processed": 8, "completed": 7}
    fit["epoch_loop.state_dict"] = {"_batches_that_stepped": 7}
    assert complete_finished_epoch(at_batch_end)
    assert fit["epoch_progress"]["total"] == dict.fromkeys(("ready", "started", "processed", "completed"), 1)
    assert fit["epoch_loop.batch_progress"]["total"]["completed"] == 8
    assert (fit["epoch_loop.state_dict"]["_batches_that_stepped"], at_batch_end["epoch"]) == (8, 1)
    assert not complete_finished_epoch(checkpoint(0, is_last_batch=False))  # a periodic save inside the epoch


def test_a_resume_that_changes_the_global_batch_says_so():
    same = describe_batch_change({"world_size": 2, "batch_size": 6}, 4, 3)
    assert "the same global batch of 12" in same
    larger = describe_batch_change({"world_size": 2, "batch_size": 8}, 8, 3)
    assert "2 ranks x 8 samples = 16 per step" in larger and "3 ranks x 8 = 24 per step (1.5x)" in larger
    assert "scale the learning rate" in larger
    smaller = describe_batch_change({"world_size": 4, "batch_size": 8}, 8, 2)
    assert "a per-rank batch of 16 or accumulate_grad_batches=2" in smaller
    assert describe_batch_change({"world_size": 2, "batch_size": 8}, 8, 2) is None


class Grouped(Indexed):
    """Indexed with its bias in a param group of its own (as Muon's example splits its parameters)."""

    def configure_optimizers(self):
        return torch.optim.Adam([{"params": [self.net.weight]}, {"params": [self.net.bias], "lr": 1e-3}], lr=1e-2)


def _other_optimizer_body(rank: int, world: int, root: str, state: str) -> dict:
    warnings.filterwarnings("ignore")
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger().addHandler(handler)

    def trainer(max_steps: int) -> L.Trainer:
        return quiet_trainer(strategy=FSDPCustomStrategy(state_dict_type=state), devices=world, max_steps=max_steps)

    first = trainer(2)
    first.fit(Grouped(), _data(world))
    first.save_checkpoint(f"{root}/grouped-{state}")
    try:
        trainer(4).fit(Indexed(), _data(world), ckpt_path=f"{root}/grouped-{state}")
        error = "resumed"
    except Exception as caught:  # noqa: BLE001 - the message is what is tested
        error = f"{type(caught).__name__}: {caught}"
    logging.getLogger().removeHandler(handler)
    return {"error": error, "loaded": [r for r in records if r.startswith("fsdp_custom: loaded")]}


@pytest.mark.parametrize("state", ["sharded", "full"])
def test_a_checkpoint_of_another_optimizer_is_refused_before_anything_loads(tmp_path, state):
    for result in run_ranks(_other_optimizer_body, 2, tmp_path, str(tmp_path), state, env=LIGHTNING_ENV, timeout=300):
        assert result["error"].startswith("CheckpointError: "), result["error"]
        assert (
            "was it trained with another optimizer? Its optimizer state has 2 param groups, this run's Adam has 1"
            in (result["error"])
        )
        assert not result["loaded"], result["loaded"]  # nothing printed as loaded


def test_key_lists_in_errors_are_shortened():
    assert (
        shortened([f"layer.{i}" for i in range(12)])
        == "['layer.0', 'layer.1', 'layer.10', 'layer.11', 'layer.2', ... 7 more]"
    )
    assert shortened(["b", "a"]) == "['a', 'b']" and shortened([]) == "[]"


def _second_fit_body(rank: int, world: int, root: str) -> dict:
    """Fits after the first on one Trainer: a second ``fit`` (its periodic save at step 12 resumed by
    a new Trainer), and the ``fit`` after an LR finder's run (its ``max_steps`` stop resumed)."""
    from lightning.pytorch.tuner import Tuner

    warnings.filterwarnings("ignore")
    out = {"uninterrupted": _fit(world, f"{root}/uninterrupted", max_steps=16)}
    module, trainer = Indexed(), _trainer(world, f"{root}/twice", max_epochs=1, grid=4)
    trainer.fit(module, _data(world))
    trainer.fit_loop.max_epochs = 2
    module.steps = []
    trainer.fit(module, _data(world))
    out["second fit"] = _result(module, trainer, world)
    saved = f"{root}/twice/epoch=1-step=12.ckpt"
    out["second fit, resumed"] = _fit(world, f"{root}/twice-resumed", saved, max_steps=16)
    module, trainer = Indexed(), _trainer(world, f"{root}/tuned", max_steps=5)
    Tuner(trainer).lr_find(module, _data(world), num_training=3, update_attr=False)
    module.steps = []
    trainer.fit(module, _data(world))
    out["after lr_find"] = _result(module, trainer, world)
    out["after lr_find, resumed"] = _fit(world, f"{root}/tuned-resumed", f"{root}/tuned/last.ckpt", max_steps=13)
    return out


def test_a_second_fit_and_a_fit_after_the_lr_finder_are_positioned(tmp_path):
    """Lightning resets its CombinedLoader before each fit and after an LR finder's run: the training
    dataloader of each such fit is positioned anew, and its checkpoints resume sample by sample."""
    out = run_ranks(_second_fit_body, 2, tmp_path, str(tmp_path), env=LIGHTNING_ENV, timeout=300)[0]
    uninterrupted = out["uninterrupted"]
    second, resumed = out["second fit"], out["second fit, resumed"]
    assert second["start"] == 8 and resumed["start"] == 12 and len(resumed["steps"]) == 4, resumed["start"]
    ids = [ids for ids, _ in second["steps"][:4] + resumed["steps"]]  # a second fit has new optimizers: ids only
    assert ids == [ids for ids, _ in uninterrupted["steps"][8:16]], "a second fit's checkpoint"
    _assert_continues(out["after lr_find"], out["after lr_find, resumed"], uninterrupted, "a fit after lr_find")


class StopsInsideAStep(Indexed):
    """Raises in epoch 0's sixth training batch: under ``accumulate_grad_batches=2``, after the first
    micro-batch of the third optimizer step (its gradient not yet applied)."""

    def training_step(self, batch, batch_idx):
        if (self.current_epoch, batch_idx) == (0, 5):
            raise Interrupted("inside an optimizer step")
        return super().training_step(batch, batch_idx)


def _half_step_body(rank: int, world: int, root: str) -> dict:
    warnings.filterwarnings("ignore")
    out = {}
    for name, module, ckpt in (
        ("uninterrupted", Indexed(), None),
        ("stopped", StopsInsideAStep(), None),
        ("resumed", Indexed(), f"{root}/stopped/last.ckpt"),  # save_on_exception's, at global step 2
    ):
        trainer = _trainer(world, f"{root}/{name}", accumulate_grad_batches=2, max_steps=8)
        try:
            trainer.fit(module, _data(world), ckpt_path=ckpt)
        except Interrupted:
            pass
        out[name] = _result(module, trainer, world)
        out[name]["stepped"] = trainer.fit_loop.epoch_loop._batches_that_stepped  # the loggers' step
    return out


def test_a_checkpoint_inside_an_accumulated_step_resumes_at_the_steps_first_micro_batch(tmp_path):
    """[Note: a step half accumulated] in data.py: the checkpoint holds the weights before the step;
    its micro-batches taken so far are taken again, so every step equals the uninterrupted run's."""
    out = run_ranks(_half_step_body, 2, tmp_path, str(tmp_path), env=LIGHTNING_ENV, timeout=300)[0]
    whole, stopped, resumed = out["uninterrupted"], out["stopped"], out["resumed"]
    assert (len(whole["steps"]), stopped["global_step"], len(stopped["steps"])) == (16, 2, 5)
    expected = whole["steps"][4:]  # from the third step's first micro-batch (the fifth batch)
    assert [ids for ids, _ in resumed["steps"]] == [ids for ids, _ in expected]
    assert [loss for _, loss in resumed["steps"]] == pytest.approx([loss for _, loss in expected], rel=1e-9)
    assert (resumed["global_step"], resumed["stepped"]) == (whole["global_step"], whole["stepped"])


class ManualAccumulation(Indexed):
    """Manual optimization that steps after every second batch; ``fail``: raises in the third batch,
    after its backward (the step's gradients so far not applied)."""

    def __init__(self, fail: bool = False) -> None:
        super().__init__()
        self.automatic_optimization, self.fail = False, fail

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss)
        if self.fail and batch_idx == 2:
            raise Interrupted("inside a manual optimizer step")
        if batch_idx % 2 == 1:
            self.optimizers().step()
            self.optimizers().zero_grad()


def _manual_half_step_body(rank: int, world: int, root: str) -> list[str]:
    told = []
    for ckpt in (None, f"{root}/last.ckpt"):  # save_on_exception's, after the third batch's backward
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                _trainer(world, root, max_steps=3).fit(ManualAccumulation(ckpt is None), _data(world), ckpt_path=ckpt)
            except Interrupted:
                pass
        told = [str(w.message) for w in caught if "fsdp_custom" in str(w.message)]
    return told


def test_a_manual_optimization_save_inside_a_step_says_the_resume_is_not_exact(tmp_path):
    """[Note: a step half accumulated]: the batches of a manual optimization's step are not known, so
    the resume says what differs instead of "exactly"."""
    told = run_ranks(_manual_half_step_body, 2, tmp_path, str(tmp_path), env=LIGHTNING_ENV, timeout=300)[0]
    said = " ".join(told)
    assert "saved inside an optimizer step: the gradients of the backward(s) since the last" in said, told


class Plateau(Indexed):
    """Adam under an epoch-interval ReduceLROnPlateau on the logged training loss."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss, on_epoch=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "monitor": "train_loss"}}


def _plateau_body(rank: int, world: int, root: str) -> list[str]:
    _trainer(world, root, max_steps=8, grid=8).fit(Plateau(), _data(world))  # saved at epoch 0's last batch
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _trainer(world, root, max_steps=10).fit(Plateau(), _data(world), ckpt_path=f"{root}/epoch=0-step=8.ckpt")
    return [str(w.message) for w in caught if "fsdp_custom" in str(w.message)]


def test_a_resume_that_skips_a_plateau_schedulers_step_says_so(tmp_path):
    told = run_ranks(_plateau_body, 2, tmp_path, str(tmp_path), env=LIGHTNING_ENV, timeout=300)[0]
    assert any("before epoch 0's end hooks: its ReduceLROnPlateau (monitor='train_loss')" in line for line in told)
