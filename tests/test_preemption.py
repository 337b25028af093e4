"""Preemption as clusters do it: SIGTERM to every process of a real job (Lightning's launcher, or
torchrun's agent and its workers), at a random moment inside a training step, a validation batch
and a background checkpoint write. Every rank stops at one boundary within seconds of the phase
in flight, saves the last step and exits 143 ([Note: preemption at an agreed step]), with no
collective error, no watchdog report and no half checkpoint; ``validate``, ``test`` and ``predict``
stop every rank together too, and a Fabric loop that asks ``strategy.preempted()`` learns of it on
every rank at the same step. Resumed exactly: test_resume_stops.py;
every phase, 5 trials each, timed: benchmarks/preemption.py."""

from __future__ import annotations

import os
import random
import signal
import warnings

import lightning as L
import pytest
import torch
from dist_utils import excerpt, free_port, run_ranks
from lightning.fabric import Fabric
from lightning.pytorch.utilities.exceptions import SIGTERMException
from preempt_job import preempt
from test_strategy import LIGHTNING_ENV, quiet_trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fsdp_strategy import FSDPCustomFabricStrategy, FSDPCustomStrategy

PHASE_SECONDS = 1.5
CASES = [("lightning", "step"), ("torchrun", "validation"), ("lightning", "async_save")]


@pytest.mark.parametrize(("launcher", "phase"), CASES)
def test_sigterm_to_every_process_stops_every_rank_at_one_boundary_and_saves(tmp_path, launcher, phase):
    delay = random.uniform(0.0, PHASE_SECONDS - 0.3)
    checkpoints = tmp_path / "checkpoints"
    ended = preempt(launcher, phase, delay, checkpoints, free_port())
    where = f"{launcher}, {phase}, SIGTERM {delay:.2f} s into it:\n{excerpt(ended.output, 3000)}"
    assert ended.seconds < PHASE_SECONDS + 10, (ended.seconds, where)
    # torchrun's agent, signalled too, exits 1 with its own SignalException; Lightning's rank 0 exits 143
    assert ended.codes[0] == (1 if launcher == "torchrun" else 143), (ended.codes, where)
    assert ended.output.count("fsdp_custom: SIGTERM received by 2 of 2 ranks") == 1, where
    for failure in ("CollectiveError", "ending this process", "fsdp_custom: rank", "FINISHED"):
        assert failure not in ended.output, (failure, where)
    saved = sorted(path.name for path in checkpoints.iterdir())
    assert "last.ckpt" in saved and all(name.endswith(".ckpt") for name in saved), (saved, where)  # none half-written


class _Evaluated(L.LightningModule):
    """Rank 1 receives a real SIGTERM in its second batch of ``validate``, ``test`` or ``predict``."""

    def __init__(self) -> None:
        super().__init__()
        self.net, self.batches = nn.Linear(4, 1), 0

    def _step(self, batch, batch_idx):
        if batch_idx == 1 and self.global_rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        self.batches += 1
        return self.net(batch[0]).sum()

    validation_step = test_step = predict_step = _step


def _evaluations(rank: int, world: int) -> dict:
    warnings.filterwarnings("ignore")
    data = DataLoader(TensorDataset(torch.randn(48, 4)), batch_size=4)  # 6 batches per rank
    out = {}
    for stage in ("validate", "test", "predict"):
        module = _Evaluated()
        trainer = quiet_trainer(strategy=FSDPCustomStrategy(), devices=world)
        try:
            getattr(trainer, stage)(module, data)
            out[stage] = ("ran to the end", module.batches)
        except SIGTERMException as stop:
            out[stage] = (stop.code, module.batches)
    return out


def test_sigterm_in_validate_test_and_predict_stops_every_rank_together(tmp_path):
    """Between batches where every rank runs as many (validation and test: a padded sampler); at the
    end of the stage where not (predict: Lightning's sampler does not pad), never running on."""
    for rank, out in enumerate(run_ranks(_evaluations, 2, tmp_path, env=LIGHTNING_ENV, timeout=300)):
        assert out == {"validate": (143, 2), "test": (143, 2), "predict": (143, 6)}, (rank, out)


def _fabric_loop(rank: int, world: int, root: str) -> dict:
    """A Fabric loop that asks ``preempted()`` once per step; rank 1 receives SIGTERM in step 3."""
    warnings.filterwarnings("ignore")
    fabric = Fabric(strategy=FSDPCustomFabricStrategy(), accelerator="cpu", devices=world)
    fabric.launch()
    torch.manual_seed(0)
    model = fabric.setup_module(nn.Linear(4, 1))
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    stopped = None
    for step in range(8):
        if fabric.strategy.preempted():
            fabric.save(f"{root}/preempted.ckpt", {"model": model, "optimizer": optimizer, "step": step})
            stopped = step
            break
        if step == 3 and rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # recorded, not the end of the process
        loss = model(torch.randn(2, 4, generator=torch.Generator().manual_seed(step * world + rank))).sum()
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    state = {"model": model, "optimizer": optimizer, "step": -1}
    fabric.load(f"{root}/preempted.ckpt", state)
    fabric.strategy.teardown()
    return {"stopped": stopped, "saved step": state["step"]}


def test_fabric_loop_learns_of_a_sigterm_on_any_rank_at_the_same_step(tmp_path):
    for rank, out in enumerate(run_ranks(_fabric_loop, 2, tmp_path, str(tmp_path), env=LIGHTNING_ENV, timeout=300)):
        assert out == {"stopped": 4, "saved step": 4}, (rank, out)


class _SignalledEarly(_Evaluated):
    """Rank 1 receives SIGTERM in ``on_train_start``, before the strategy's own hook; then (the same
    trainer, the same script) in its second batch of a ``validate``."""

    def on_train_start(self) -> None:
        if self.global_rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)

    def training_step(self, batch, batch_idx):
        return self.net(batch[0]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _early_then_again(rank: int, world: int) -> dict:
    warnings.filterwarnings("ignore")
    data = DataLoader(TensorDataset(torch.randn(48, 4)), batch_size=4)
    module = _SignalledEarly()
    trainer = quiet_trainer(strategy=FSDPCustomStrategy(), devices=world, max_steps=5, num_sanity_val_steps=0)
    out = {}
    try:
        trainer.fit(module, data)
        out["fit"] = "ran to the end"
    except SIGTERMException as stop:
        out["fit"] = (stop.code, trainer.global_step)
    try:
        trainer.validate(module, data)
        out["validate"] = "ran to the end"
    except SIGTERMException as stop:
        out["validate"] = (stop.code, module.batches)
    return out


def test_a_sigterm_before_the_first_step_and_in_a_later_stage_stops_every_rank(tmp_path):
    """From Lightning's registration of its handlers on (not from the strategy's first hook): a SIGTERM
    in a LightningModule's ``on_train_start`` stops every rank before the first step; the same trainer's
    ``validate`` afterwards holds a new SIGTERM as well (the handler left after the stop is not called
    from itself)."""
    for rank, out in enumerate(run_ranks(_early_then_again, 2, tmp_path, env=LIGHTNING_ENV, timeout=300)):
        assert out == {"fit": (143, 0), "validate": (143, 2)}, (rank, out)
