"""SLURM's requeue signal, acted on at a step boundary that every rank agrees on.

[Note: requeue at an agreed step]
Under SLURM (``SLURMEnvironment(auto_requeue=True)``, Lightning's default there) the signal sent
before the time limit (``#SBATCH --signal=SIGUSR1@90``) runs Lightning's handler, which saves
``hpc_ckpt_<n>.ckpt`` and has rank 0 call ``scontrol requeue``; the next job resumes from it. The
handler runs wherever the main thread is when the signal lands: a sharded save is a collective, so a
rank that saves in the middle of its backward while another is between steps mixes the save's
collectives with the engine's (a hang, or shards of two different moments). Here the signal only
notes itself; at the first batch of every optimizer step each rank adds what it has noted to a
sum over all ranks, started there without waiting (a gloo group of its own: no device
synchronization) and read at the next step's first batch. Every rank reads the same sum at the
same step, so all of them run Lightning's handler there together, between two steps, with the
save written before the requeue (also with ``async_save``). The save comes one or two steps after
the signal. Costs: one all-reduce of one integer per optimizer step, under SLURM only, and the
group's connections.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from fsdp_strategy.engine import control

WAIT_AT_TEARDOWN = timedelta(seconds=10)


class DeferredRequeue:
    """Holds Lightning's requeue handler back to an agreed optimizer-step boundary (see the Note).
    ``synchronous_save``: a context in which the strategy writes checkpoints before returning."""

    def __init__(self, synchronous_save: Callable[[], AbstractContextManager]) -> None:
        self._synchronous_save = synchronous_save
        self._handler: Any = None  # Lightning's handler, held back; None when not installed
        self._signal: int | None = None
        self._noted = 0
        self._group: Any = None
        self._work: Any = None
        self._sum: torch.Tensor | None = None
        self._step: int | None = None
        self._done = False

    @property
    def installed(self) -> bool:
        """Whether Lightning's requeue handler is held back in this run."""
        return self._handler is not None

    def install(self, trainer: Any) -> None:
        """At the start of training: take Lightning's requeue handler over, if it registered one.
        Collective over the default group when it did (every rank detects SLURM alike)."""
        from lightning.fabric.plugins.environments import SLURMEnvironment

        environment = trainer._accelerator_connector.cluster_environment
        if not isinstance(environment, SLURMEnvironment) or not environment.auto_requeue:
            return
        requeue_signal = environment.requeue_signal
        handler = signal.getsignal(requeue_signal)
        lightning_handler = trainer._signal_connector._slurm_sigusr_handler_fn
        if lightning_handler not in getattr(handler, "signal_handlers", ()):
            return  # the user's own handler is installed: Lightning did not register its own
        self._handler, self._signal, self._noted, self._done, self._step = handler, requeue_signal, 0, False, None
        if dist.is_initialized() and dist.get_world_size() > 1:
            self._group = control.new_gloo_group()
        signal.signal(requeue_signal, self._note)

    def _note(self, signum: int, frame: Any) -> None:
        self._noted = 1

    def at_batch_start(self, global_step: int) -> None:
        """At each training batch: on the first batch of an optimizer step, read the previous step's
        sum (and run the handler if a rank noted the signal), then start this step's."""
        if self._handler is None or self._done or global_step == self._step:
            return
        self._step = global_step
        if self._agreed():
            self._done = True
            self._run_handler()
            return
        self._sum = torch.tensor([self._noted], dtype=torch.int64)
        self._work = dist.all_reduce(self._sum, group=self._group, async_op=True) if self._group is not None else None

    def _agreed(self) -> bool:
        if self._sum is None:
            return False
        if self._work is not None:
            self._work.wait()
            self._work = None
        return int(self._sum.item()) > 0

    def _run_handler(self) -> None:
        with self._synchronous_save():
            self._handler(self._signal, None)

    def remove(self) -> None:
        """At teardown: finish the sum in flight and release the group (Lightning restores the
        signal handlers it replaced)."""
        if self._work is not None:
            try:
                self._work.wait(WAIT_AT_TEARDOWN)
            except RuntimeError:  # a rank is gone: the run is failing anyway
                pass
        control.destroy_group(self._group)
        self._handler = self._group = self._work = self._sum = None
