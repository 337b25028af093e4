"""SIGTERM (preemption, a time limit, an eviction) acted on at a training-batch boundary that every
rank agrees on, with no collective inside the signal handler.

[Note: preemption at an agreed step]
Clusters end jobs with SIGTERM to every process (SLURM at preemption and at the time limit, SIGKILL
``KillWait`` seconds later, 30 by default; Kubernetes on eviction, 30 s of grace). Lightning 2.6's
handler broadcasts a tensor from inside the signal handler, which meets whatever collective another
rank is in (a hang until SIGKILL, or a mismatched-size crash), and its training loop broadcasts a
device tensor and reads it on the host at every batch. While ``fit`` runs under ``fsdp_custom``:
- the handler only records the signal, passes it to a launcher's child processes once (as
  Lightning's does) and calls the other handlers Lightning composed with its own (SLURM's
  "bypass", a handler the user had); Lightning's per-batch broadcast is switched off;
- at the start of every optimizer step (its first training batch: a micro-batch that goes on
  accumulating is no boundary, a stop there would lose the step's earlier gradients), of every
  validation batch inside ``fit`` where every rank runs as many (a ``DistributedSampler``: Lightning's
  by default; with another sampler the ranks may run different numbers) and no accumulation is
  interrupted (otherwise the signal waits for the next optimizer step), and at the end of training,
  every rank adds what it has recorded to a sum over all ranks: one blocking all-reduce of one
  integer on a gloo group of its own (the CPU: it never waits for the device, and reads no device
  tensor);
- where the sum is not zero, every rank, at that same boundary, sets ``trainer.received_sigterm``
  and raises Lightning's ``SIGTERMException`` with exit status 143 (128 + SIGTERM, what a shell,
  torchrun and Kubernetes read as "ended by SIGTERM"; Lightning exits 0). Lightning then runs
  ``on_exception`` on every rank together (``ModelCheckpoint(save_on_exception=True)`` saves the
  last completed step there, atomically) and tears down.
So the job ends after the batch in flight (a checkpoint save in flight finishes first), whichever
ranks got the signal; a stop between validation batches leaves the validation to run again at the
resume, as Lightning does; after that stop, a further SIGTERM is recorded and
ignored until the process exits. The same holds in ``validate``, ``test`` and ``predict`` (between
batches where every rank runs as many, else at the stage's end). The handler is installed right
after Lightning registers its own, at the start of every stage (``hold_from_registration``): no
moment of a stage runs Lightning's broadcasting handler; before that (the strategy's setup, the
model's sharding, a checkpoint's load) SIGTERM ends the process as it would without Lightning, and a
stop in the sanity check leaves no checkpoint (no step was taken). With one process the same boundaries apply,
without the all-reduce. Costs: per training batch one all-reduce of 8 bytes on the CPU (it waits
for the slowest rank's host to reach the batch, not for any device), and the group's connections.
"""

from __future__ import annotations

import logging
import signal
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch.utils.data import DistributedSampler

from fsdp_strategy.engine import control
from fsdp_strategy.engine.monitoring import watched
from fsdp_strategy.engine.watchdog import Watchdog

log = logging.getLogger(__name__)

EXIT_STATUS = 128 + signal.SIGTERM  # 143: "ended by SIGTERM"


class AgreedSigterm:
    """Holds SIGTERM to a training-batch boundary that every rank agrees on ([Note: preemption at an
    agreed step]). Costs: see the note."""

    def __init__(self) -> None:
        self._trainer: Any = None  # while installed
        self._others: list[Any] = []  # the handlers Lightning composed beside its own broadcasting one
        self._received = 0
        self._stopped = False  # every rank raised at a boundary: none after it
        self.in_evaluation = False  # evaluation batches are boundaries now (``start_evaluation``)
        self._step: int | None = None  # the global step at the last training boundary
        self._group: Any = None

    @property
    def installed(self) -> bool:
        """Whether SIGTERM is held back in this run."""
        return self._trainer is not None

    def install(self, trainer: Any) -> None:
        """Take SIGTERM over while ``fit``, ``validate``, ``test`` or ``predict`` runs (idempotent; a
        collective on the first call where there are several ranks: every rank reaches it alike)."""
        if self._trainer is not None:
            return
        connector = trainer._signal_connector
        handler = signal.getsignal(signal.SIGTERM)
        composed = list(getattr(handler, "signal_handlers", ()))
        if connector._sigterm_notifier_fn not in composed:
            return  # not Lightning's handler (Windows, or the user replaced it): leave it alone
        self._trainer, self._received, self._stopped, self._step = trainer, 0, False, None
        self._others = [h for h in composed if h != connector._sigterm_notifier_fn and not _ours(h)]
        if dist.is_initialized() and dist.get_world_size() > 1:
            self._group = control.new_gloo_group()
        trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = _nothing  # its device broadcast and host read
        signal.signal(signal.SIGTERM, self._record)

    def hold_from_registration(self, trainer: Any) -> None:
        """From now on every stage of ``trainer`` takes SIGTERM over right after Lightning registers its
        handlers (before its sanity check, ``on_train_start`` hooks or first batch). Costs: a wrapper."""
        connector = trainer._signal_connector
        if getattr(connector.register_signal_handlers, "_holds_sigterm", False):
            return
        register = connector.register_signal_handlers

        def register_then_hold() -> None:
            register()
            self.install(trainer)

        register_then_hold._holds_sigterm = True  # type: ignore[attr-defined]
        connector.register_signal_handlers = register_then_hold

    def start_evaluation(self, trainer: Any, loaders: Any) -> None:
        """An evaluation begins (a validation inside ``fit``, or ``validate``, ``test``, ``predict``): its
        batches are boundaries too where every rank runs as many of them, which a padded
        ``DistributedSampler`` guarantees (Lightning's for validation and test, by default; not its
        predict sampler, which does not pad), and where it does not interrupt an optimizer step's
        accumulation; otherwise the signal waits for the evaluation's end, or the next optimizer step."""
        loaders = loaders if isinstance(loaders, (list, tuple)) else [loaders]
        fitting = trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking
        accumulating = fitting and trainer.fit_loop.epoch_loop._should_accumulate()
        self.in_evaluation = (
            self._trainer is not None
            and not accumulating
            and all(_padded(getattr(loader, "sampler", None)) for loader in loaders)
        )

    def before_evaluation_batch(self, dog: Watchdog | None) -> None:
        """An evaluation batch's start: a boundary where ``start_evaluation`` said the batches are."""
        if self.in_evaluation:
            self.at_boundary("before this evaluation batch", dog)

    def end_evaluation(self, trainer: Any, dog: Watchdog | None) -> None:
        """An evaluation ends: back to training's boundaries; the end of ``validate``, ``test`` or
        ``predict`` is a boundary itself (a validation inside ``fit`` goes on to training's)."""
        self.in_evaluation = False
        if trainer.state.fn != TrainerFn.FITTING:
            self.at_boundary("at the end of this evaluation", dog)

    def at_step_start(self, global_step: int, dog: Watchdog | None) -> None:
        """At a training batch's start: a boundary where it begins an optimizer step (the first batch of
        the run, or the first after a step); a micro-batch that goes on accumulating is none (a stop
        there would lose the gradients of the step's earlier micro-batches)."""
        if global_step == self._step:
            return
        self._step = global_step
        self.at_boundary("before this batch", dog)

    def _record(self, signum: int, frame: Any) -> None:
        """The handler: records, passes the signal on; no collective, no lock."""
        if not self._received and self._trainer is not None:
            launcher = self._trainer.strategy.launcher
            if launcher is not None and hasattr(launcher, "kill"):
                launcher.kill(signum)  # a launcher's child processes, as Lightning's handler does
        self._received = 1
        for other in self._others:
            handler = signal.getsignal(other) if isinstance(other, int) else other
            if callable(handler):
                handler(signum, frame)

    def at_boundary(self, where: str, dog: Watchdog | None) -> None:
        """At a boundary every rank reaches alike (a training batch's start, the end of training):
        raise ``SIGTERMException`` on every rank if any rank received SIGTERM."""
        if self._trainer is None or self._stopped:
            return
        ranks = _ranks_received(self._received, self._group, dog)
        if not ranks:
            return
        trainer = self._trainer
        trainer._signal_connector.received_sigterm = True
        if trainer.is_global_zero:
            log.warning(
                "fsdp_custom: SIGTERM received by %d of %d ranks; every rank stops %s (step %d), exit status %d",
                ranks,
                trainer.world_size,
                where,
                trainer.global_step,
                EXIT_STATUS,
            )
        self._stopped = True
        raise SIGTERMException(EXIT_STATUS)

    def remove(self) -> None:
        """At the strategy's teardown: release the group and Lightning's loop. The handler stays,
        recording (a second SIGTERM while ``on_exception`` saves must not broadcast), until
        Lightning's teardown, right after, restores the handlers from before ``fit``; after a stop
        by SIGTERM it stays for good: the process is on its way out, and a launcher that sends
        SIGTERM to the workers still running when one exits (torchrun) must not cut another
        rank's teardown short. SIGKILL still ends it."""
        if self._trainer is None:
            return
        trainer, self._trainer = self._trainer, None
        trainer.fit_loop.epoch_loop.__dict__.pop("_broadcast_sigterm_tensor", None)
        if self._stopped:
            trainer._signal_connector._original_handlers[signal.SIGTERM] = self._record
        control.destroy_group(self._group)
        self._group = None


class FabricSigterm:
    """SIGTERM under Fabric, which installs no handler: from the first ``agree`` on, the handler
    only records the signal (and passes it to the launcher's child processes); each ``agree`` (every
    rank at the same place in its loop) says how many ranks received it ([Note: preemption at an
    agreed step]). Costs: one 8-byte all-reduce on the CPU per call."""

    def __init__(self) -> None:
        self._received = 0
        self._group: Any = None
        self._previous: Any = None  # the handler before the first ``agree``; None while not installed
        self._launcher: Any = None

    def agree(self, launcher: Any, dog: Watchdog | None) -> int:
        """How many ranks received SIGTERM (the same number on every rank). The first call installs the
        handler (a collective where there are several ranks)."""
        if self._previous is None:
            self._launcher = launcher
            if dist.is_initialized() and dist.get_world_size() > 1:
                self._group = control.new_gloo_group()
            self._previous = signal.signal(signal.SIGTERM, self._record)
        return _ranks_received(self._received, self._group, dog)

    def _record(self, signum: int, frame: Any) -> None:
        if not self._received:
            for process in getattr(self._launcher, "procs", []):
                process.send_signal(signum)
        self._received = 1

    def remove(self) -> None:
        """Give SIGTERM its handler from before and release the group."""
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
        control.destroy_group(self._group)
        self._group = None


def _ranks_received(received: int, group: Any, dog: Watchdog | None) -> int:
    """The sum of ``received`` over the ranks: one blocking all-reduce of 8 bytes on the CPU (gloo)."""
    total = torch.tensor([received], dtype=torch.int64)
    if group is not None:
        with watched("all_reduce", "preemption", dog):
            dist.all_reduce(total, group=group)
    return int(total.item())  # a CPU tensor: no device wait


def _ours(handler: Any) -> bool:
    """Whether ``handler`` is an ``AgreedSigterm``'s own (left installed after a stop; a later stage's
    Lightning composes it with its handler as one it found)."""
    return getattr(handler, "__func__", None) is AgreedSigterm._record


def _padded(sampler: Any) -> bool:
    """Whether ``sampler`` gives every rank as many samples (torch's ``DistributedSampler`` pads)."""
    return isinstance(sampler, DistributedSampler) and not isinstance(sampler, UnrepeatedDistributedSampler)


def _nothing() -> None:
    """Lightning's per-batch SIGTERM broadcast, switched off while ``AgreedSigterm`` holds the signal."""


class AgreedStopHooks:
    """The Trainer strategy's stage hooks that move SIGTERM's boundaries ([Note: preemption at an
    agreed step]): a base class of ``FSDPCustomStrategy``, before Lightning's, that reads its
    ``_sigterm`` (an ``AgreedSigterm``) and its watchdog part ``_watch``. Costs: see the note."""

    def on_validation_start(self) -> None:
        """Hold SIGTERM back to agreed batch boundaries, from ``fit``'s sanity check on, and between
        validation batches where every rank runs as many."""
        self._sigterm.start_evaluation(self.lightning_module.trainer, self.lightning_module.trainer.val_dataloaders)
        super().on_validation_start()

    def on_validation_end(self) -> None:
        """Back to training's boundaries; at the end of ``validate``, a boundary."""
        self._sigterm.end_evaluation(self.lightning_module.trainer, self._watch.dog)
        super().on_validation_end()

    def on_test_start(self) -> None:
        """As ``on_validation_start``."""
        self._sigterm.start_evaluation(self.lightning_module.trainer, self.lightning_module.trainer.test_dataloaders)
        super().on_test_start()

    def on_test_end(self) -> None:
        """As ``on_validation_end``."""
        self._sigterm.end_evaluation(self.lightning_module.trainer, self._watch.dog)
        super().on_test_end()

    def on_predict_start(self) -> None:
        """As ``on_validation_start`` (Lightning's predict sampler pads nothing: no batch is a boundary)."""
        trainer = self.lightning_module.trainer
        self._sigterm.start_evaluation(trainer, trainer.predict_dataloaders)
        super().on_predict_start()

    def on_predict_end(self) -> None:
        """As ``on_validation_end``."""
        self._sigterm.end_evaluation(self.lightning_module.trainer, self._watch.dog)
        super().on_predict_end()

    def on_train_end(self) -> None:
        """A SIGTERM received in the last batch or validation stops every rank here, together."""
        self._sigterm.at_boundary("at the end of training", self._watch.dog)
        super().on_train_end()
