"""Scheduler: decides *when* units gather, reshard and reduce; owns every hook of the engine.

[Note: life of a gradient]
The functions one weight gradient passes through, in order:
1. ``Scheduler._pre_forward`` (here) -> ``FSDPUnit.enter_forward`` -> ``wait_unshard`` (unit.py):
   the unit's flat shard is all-gathered (``buffers.start_gather`` -> ``collectives.all_gather``;
   exchange.py on gloo) and copied out into ``ShardedParam.unsharded`` (``buffers.copy_out``,
   param.py); ``FSDPUnit.arm_post_backward`` puts ``PostBackward`` (iteration.py) on its inputs.
2. Autograd accumulates the gradient into ``ShardedParam.unsharded.grad``.
3. ``PostBackward.backward`` -> ``Scheduler._post_backward`` -> ``FSDPUnit.post_backward``
   (``UnitState.post_backward_fired``, state.py, says READY) -> ``Scheduler._reduce`` ->
   ``Reductions.reduce`` (reductions.py) ->
   ``FSDPUnit.reduce_grads`` -> ``buffers.start_reduce``: ``ShardedParam.take_grad_rows`` copies it (and a ``no_sync``
   stash) into a flat buffer with its usage flag, ``collectives.reduce_scatter`` sums it, and
   the full gradient is freed.
4. At the next reduction or the end of backward: ``PendingReduce`` (buffers.py) waits, through its
   collective's ``Watch`` (monitoring.py: the watchdog, order stamps, ledger); on HSDP
   ``PendingReduce.start_replicate`` all-reduces across replicas, waited one reduction later
   ([Note: replicas reduce behind compute]); ``PendingReduce.finish`` divides ([Note: SUM then
   divide]) and ``ShardedParam.accumulate_sharded_grad`` adds it into ``sharded.grad``; a
   parameter this rank did not use waits for ``Reductions.settle`` ([Note: usage flags]).
5. ``Scheduler._end_of_backward`` settles every reduction and checks none is missing.
6. ``Scheduler.clip_grad_norm_`` may scale it; the optimizer steps on ``sharded``
   (optimizer_steps.py keeps a unit gathered at that moment right).

One iteration, hook by hook: iteration.py.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch._dynamo
from torch import nn

from fsdp_strategy.config import BackwardPrefetch, MixedPrecision, ShardingStrategy
from fsdp_strategy.engine.accounting import MemoryAccount
from fsdp_strategy.engine.clipping import clip_grad_norm
from fsdp_strategy.engine.collectives import CommContext
from fsdp_strategy.engine.guard import shard_used_by
from fsdp_strategy.engine.iteration import BackwardPass, Step, autograd_running, cast_inputs
from fsdp_strategy.engine.optimizer_steps import OptimizerSteps
from fsdp_strategy.engine.order import ExecutionOrder, Prefetch, called_alike
from fsdp_strategy.engine.param import ShardedParam
from fsdp_strategy.engine.reductions import Reductions, check_no_late_grads
from fsdp_strategy.engine.replica_agreement import ReplicaAgreement
from fsdp_strategy.engine.state import AfterPostBackward, Frame, UnitState
from fsdp_strategy.engine.tensor_parallel import DOUBLE_BACKWARD_WITH_TENSOR_PARALLEL, refuse_double_backward_through
from fsdp_strategy.engine.trace import traced
from fsdp_strategy.engine.unit import FSDPUnit
from fsdp_strategy.options import UpdateKind

log = logging.getLogger(__name__)


class Scheduler:
    """Registers the engine's hooks on the root and its units and runs each step's schedule.

    Costs: a few Python calls per unit per forward and backward, one autograd node per unit
    call with grad, one usage flag per trainable parameter in each reduction.
    """

    def __init__(
        self,
        units: list[FSDPUnit],
        sharding_strategy: ShardingStrategy,
        mixed_precision: MixedPrecision,
        comm: CommContext,
        memory: MemoryAccount,
        device: torch.device,
        device_mesh: Any = None,
        prefetch: Prefetch | None = None,
        optimizer_updates: Mapping[type, UpdateKind] | None = None,
        *,
        saved_buffer_dtypes: Mapping[str, torch.dtype] | None = None,
        ignored_params: Mapping[str, nn.Parameter] | None = None,
        guards: Sequence[Any] = (),
    ) -> None:
        self.device_mesh = device_mesh  # the HSDP (replicate, shard) mesh, if any
        self.prefetch = prefetch or Prefetch()
        self.units = units
        self.root_unit = units[0]
        self.sharding_strategy = sharding_strategy
        self.mixed_precision = mixed_precision
        self.comm = comm  # [Note: flight recorder]: the engine counts iterations in observer.recorder
        assert comm.observer is not None, "the Scheduler reports to an observer (its ledger, flight recorder)"
        self.observer = comm.observer
        self.ledger = comm.observer.ledger
        self.owned_watchdog: Any = None  # a watchdog shard_model started for this model alone, closed with it
        self.memory = memory
        self.device = device
        # [Note: buffers keep their dtype in checkpoints] state-dict name -> dtype before buffer_dtype cast it
        self.saved_buffer_dtypes: dict[str, torch.dtype] = dict(saved_buffer_dtypes or {})
        self.ignored_params: dict[str, nn.Parameter] = dict(ignored_params or {})  # [Note: ignored modules]
        self._order = ExecutionOrder()  # outlives iterations: [Note: prefetch from the previous run]
        self.step = Step()  # the iteration in progress (iteration.py)
        self.device_layer = units[0].device_layer  # [Note: host and device] in device.py
        self.lost_edits = units[0].lost_edits  # [Note: edits while gathered] in edits.py
        self._lower_param_dtype = any(p.param_dtype != p.sharded.dtype for unit in units for p in unit.params)
        self.reductions = Reductions(self.device_layer)  # the gradient reductions in flight (reductions.py)
        params = self.sharded_params()
        self.optimizer_steps = OptimizerSteps.of(units, self.device_layer, comm, device, optimizer_updates)
        self.replicas = ReplicaAgreement.of(params, comm, device)  # [Note: TP replicas agree]; None without TP
        self.tensor_parallel = any(param.tp is not None for param in params)  # a 2-D (data x tensor) model
        self.hook_handles: list[Any] = list(guards)  # every module hook the engine registered on the model
        self._register_hooks()

    # ---- hooks -------------------------------------------------------------------------

    def _register_hooks(self) -> None:
        for unit in self.units:
            state = unit.training
            backward = torch._dynamo.disable(functools.partial(self._pre_backward, unit, state))  # on its outputs
            pre = torch._dynamo.disable(functools.partial(self._pre_forward, unit, state), recursive=True)
            post = torch._dynamo.disable(functools.partial(self._post_forward, unit, state, backward), recursive=True)
            self.hook_handles.append(unit.module.register_forward_pre_hook(pre, with_kwargs=True, prepend=True))
            self.hook_handles.append(unit.module.register_forward_hook(post, always_call=True))
            for param in unit.params:  # [Note: a backward no unit hook sees]
                param.register_grad_hooks(self._grad_accumulated, shard_used_by(param))
        owners = {id(use.module): use.module for p in self.sharded_params() if p.tp is not None for use in p.uses}
        self.hook_handles += refuse_double_backward_through(owners.values())  # [Note: a double backward through TP]

    @traced("pre_forward")
    def _pre_forward(self, unit: FSDPUnit, state: UnitState, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        in_backward = autograd_running()
        if unit is self.root_unit:
            if self.step.root_depth == 0 and not in_backward:
                args, kwargs = self._start_iteration(args, kwargs)
            self.step.root_depth += 1
        frame = unit.enter_forward(in_backward)
        if not in_backward and torch.is_grad_enabled():
            self.reductions.ran_forward(unit)
        if not in_backward and self.step.forward_phase is not None:
            state.ran_in_forward_pass()
            target = self._order.record(self.step.forward_phase, unit)
            if target is not None and self.prefetch.forward and called_alike(unit, target):
                target.unshard()  # [Note: bounded prefetch], [Note: no prefetch across user code]
        if torch.is_grad_enabled():
            args, kwargs = unit.arm_post_backward(frame, in_backward, args, kwargs, self._post_backward)
        return args, kwargs

    @traced("post_forward")
    def _post_forward(
        self, unit: FSDPUnit, state: UnitState, backward_hook: Any, module: nn.Module, args: tuple, output: Any
    ) -> Any:
        frame = state.forward_exited()
        if frame is None:  # our pre-hook did not run (a hook before it raised)
            return output
        if unit is self.root_unit:
            self.step.root_depth -= 1
        raised = sys.exc_info()[1]
        if raised is not None and raised is not frame.exception:
            self._forward_failed(unit, frame)
            return output
        in_backward = autograd_running()
        policy = self.sharding_strategy.reshard_after_forward
        hooked = unit.leave_forward(frame, output, backward_hook, self.step.root_depth, policy)
        if hooked and not in_backward:
            self.step.post_forward_order.append(unit)  # [Note: prefetch from the previous run]
        if unit is self.root_unit and self.step.root_depth == 0 and not in_backward:
            self._end_forward()
        return output

    @traced("pre_backward")
    def _pre_backward(self, unit: FSDPUnit, state: UnitState, grad: torch.Tensor) -> None:
        self._enter_backward()
        if not unit.reached_in_backward():
            return
        assert self.step.backward is not None
        target = self._order.record(("backward", self.step.backward.index), unit)
        if target is not None and self.prefetch.backward is BackwardPrefetch.BACKWARD_PRE:
            target.unshard()  # [Note: bounded prefetch]
        elif target is not None and self.prefetch.backward is BackwardPrefetch.BACKWARD_POST:
            state.prefetch_when_computed(target)

    @traced("post_backward")
    def _post_backward(self, unit: FSDPUnit, state: UnitState, counted: bool) -> None:
        self._enter_backward()
        backward = self.step.backward
        assert backward is not None
        target = state.take_prefetch()
        if target is not None:  # BACKWARD_POST: this unit's gradients are computed
            target.unshard()
        if unit.post_backward(counted, backward.create_graph) is not AfterPostBackward.READY:
            return  # kept for a double backward, or another call of this unit may be ahead in backward
        backward.ready.add(unit)
        while backward.expected and backward.expected[0] in backward.ready:
            ready = backward.expected.popleft()
            if not ready.training.reduced:
                self._reduce(ready)

    @traced("end_of_backward")
    def _end_of_backward(self) -> None:
        backward = self.step.backward
        assert backward is not None
        try:
            while backward.expected:  # [Note: post-backward every rank agrees on]
                unit = backward.expected.popleft()
                if not unit.training.reduced:
                    self._reduce(unit)
            for unit in self.units:  # then one fixed order on every rank
                if unit.due_for_reduction():
                    self._reduce(unit)
            self.reductions.forget_forwards()
            self.reductions.settle()
            self.device_layer.before_host_reads_grads()  # [Note: host and device] 2
            self.device_layer.before_host_writes_shards()  # a closure's step updates next (1)
            check_no_late_grads(self.units)
            if self.replicas is not None:
                self.replicas.send()
        finally:
            self._finish_backward(backward)
        self._report_lost_edits()  # after the units it reshards wrote back

    def _finish_backward(self, backward: BackwardPass) -> None:
        for unit in self.units:
            unit.end_backward(backward.create_graph)
        self._order.commit(("backward", backward.index))
        self.step.backward = None
        self.optimizer_steps.backward_finished()

    # ---- schedule ----------------------------------------------------------------------

    def _report_lost_edits(self, send: bool = True, agree: bool = True) -> None:
        """With a lower ``param_dtype``: ``send`` the checks of changes made while gathered (with
        ``agree``, every rank at the same place, their verdicts combined) and raise for those due
        with a change that could not be kept ([Note: edits while gathered]): no host wait."""
        if self._lower_param_dtype:
            if send:
                self.lost_edits.send(agree)
            self.lost_edits.raise_due()

    def _start_iteration(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        previous_without_backward = self.observer.recorder.iteration > 0 and self.step.backwards == 0
        # its forward's checks, each rank its own: ranks may run different numbers of forward-only
        # iterations (an uneven predict), where NO_SHARD issues no collective to agree in
        self._report_lost_edits(send=previous_without_backward, agree=False)
        stale = self.step.backward is not None or any(unit.training.on_stack for unit in self.units)
        if stale:
            log.warning("fsdp_custom: the previous iteration did not finish (an exception in backward?); resetting")
            self.reset()
        self.observer.recorder.iteration += 1
        self.step = Step(forward_phase=("forward", torch.is_grad_enabled()))
        self._order.start(self.step.forward_phase)
        return cast_inputs(args, kwargs, self.mixed_precision.param_dtype)

    def _end_forward(self) -> None:
        """The outermost root forward returned: free what was prefetched and did not run."""
        assert self.step.forward_phase is not None
        self._order.commit(self.step.forward_phase)
        self.step.forward_phase = None
        for unit in self.units:
            if unit.training.forward_pass_finished():
                unit.reshard()

    def _forward_failed(self, unit: FSDPUnit, frame: Frame) -> None:
        if unit is self.root_unit and self.step.root_depth == 0 and not autograd_running():
            unit.training.forward_raised(frame)
            log.info("fsdp_custom: the root forward raised; the iteration is reset")
            self.reset()
        else:
            unit.forward_raised(frame, self.step.root_depth)

    @torch._dynamo.disable
    def _grad_accumulated(self, param: torch.Tensor) -> None:
        """[Note: a backward no unit hook sees]
        A backward run inside the forward of the only unit it reaches (``manual_backward`` in
        ``training_step`` with the whole model one unit) passes no unit's output hook and no
        post-backward node: a gradient landing in a full parameter starts the backward pass, so
        its end-of-backward callback reduces the unit."""
        if self.step.backward is None:
            self._enter_backward()

    def _enter_backward(self) -> None:
        step = self.step
        if step.backward is None:
            if torch.is_grad_enabled() and self.tensor_parallel:
                raise RuntimeError(DOUBLE_BACKWARD_WITH_TENSOR_PARALLEL)
            step.backward = BackwardPass(step.backwards, torch.is_grad_enabled(), self.reductions.order())
            step.backwards += 1
            self._order.start(("backward", step.backward.index))
            finished = step.post_forward_order if step.backward.index == 0 else None
            self._order.follow_forward(("backward", step.backward.index), ("forward", True), finished)
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _reduce(self, unit: FSDPUnit) -> None:
        unit.training.reduced_now()
        self.reductions.reduce(unit)

    # ---- public ------------------------------------------------------------------------

    def reset(self) -> None:
        """Recover from a failed iteration: wait for the collectives in flight and drop their
        results, discard every gradient not yet reduced (stashed ``no_sync`` ones included),
        reshard every unit and forget the iteration's state. Reduced ``sharded.grad`` is kept.

        The next root forward does this by itself after an exception in backward; after one in
        forward it happens at once. Call it after catching a ``KeyboardInterrupt`` yourself.
        Nothing is done after a ``CollectiveError``: the collectives cannot finish, and the
        process ends ([Note: watchdog]).
        """
        if self.observer.wedged():
            return
        self.reductions.drop()
        self.device_layer.close()  # what reduced gradients are kept, and what was copied, is complete
        self.lost_edits.drop_pending()
        for unit in self.units:
            unit.reset()
        self.step = Step(backwards=self.step.backwards)  # an iteration without a backward is still one
        self.reductions.forget_forwards()
        self._order.discard()

    def close(self, agree: bool = False) -> None:
        """Release what this engine instance holds outside the model: the optimizer-step hooks, the
        exchange thread, and a watchdog ``shard_model`` started for it. The model stays sharded
        and runs again after ``open``. Raises for a change of the last steps that a lower
        ``param_dtype`` could not keep, unless an exception is already unwinding: with ``agree``
        (every rank closes here: the strategies' teardown) on every rank, after a 4-byte
        all-reduce; without, on the ranks whose rows changed. Costs: joins the threads (bounded)
        and waits for the device."""
        unwinding = sys.exc_info()[1] is not None
        if self._lower_param_dtype:  # first: the agreement is a collective
            self.lost_edits.send(agree=agree and not unwinding)
        self.optimizer_steps.close()
        self.device_layer.close()
        self.comm.close()
        if self.owned_watchdog is not None:
            self.owned_watchdog.close()
            self.owned_watchdog = None
            self.observer.attach(None)
        if not unwinding:
            self.lost_edits.raise_due(everything=True)
            self.optimizer_steps.raise_due()
            if self.replicas is not None:
                self.replicas.raise_due(everything=True)

    def open(self) -> None:
        """Install the optimizer-step hooks again after ``close`` (the strategy, at each setup)."""
        self.optimizer_steps.open()

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip gradient reduction: full gradients accumulate locally until a backward outside.

        Full parameters are still freed after each unit's backward. Costs: every trainable
        parameter keeps a full-size gradient in ``reduce_dtype`` between micro-batches (see
        :meth:`unsharded_grad_bytes`), in exchange for no reduction.
        """
        previous, self.reductions.sync = self.reductions.sync, False
        try:
            yield
        finally:
            self.reductions.sync = previous

    @property
    def running(self) -> bool:
        """Whether a forward of the root or a backward through the model is in progress."""
        return bool(self.step.root_depth) or self.step.backward is not None

    def unsharded_grad_bytes(self) -> int:
        """Bytes of full-size gradients held now (non-zero only inside ``no_sync`` accumulation)."""
        return sum(p.stashed_nbytes for p in self.sharded_params())

    def sharded_bytes(self) -> dict[str, int]:
        """This rank's bytes at rest: ``{"params": ..., "grads": ...}`` of the shards."""
        params = [p.sharded for p in self.sharded_params()]
        return {
            "params": sum(p.numel() * p.element_size() for p in params),
            "grads": sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None),
        }

    def sharded_params(self) -> list[ShardedParam]:
        """Every ShardedParam of the model, unit by unit."""
        return [p for unit in self.units for p in unit.params]

    @torch.no_grad()
    def clip_grad_norm_(
        self,
        max_norm: float,
        norm_type: float = 2.0,
        parameters: Iterable[torch.Tensor] | None = None,
        error_if_nonfinite: bool = False,
    ) -> torch.Tensor:
        """Clip sharded gradients by their global norm over all ranks: torch's ``get_total_norm`` on
        this rank's shards, one all-reduce, torch's ``clip_grads_with_norm_``. ``parameters``: the
        sharded parameters to clip together (e.g. one optimizer's); default all. Replicas (NO_SHARD,
        HYBRID_SHARD) hold the same shard, so the norm is reduced over the shard group only, and over
        tensor parallel ([Note: clipping across TP]). Returns the total norm before clipping, as
        ``clip_grad_norm_`` does; ``error_if_nonfinite=True`` raises before clipping where it is not
        finite (torch's meaning: a read of the norm on the host)."""
        where = (self.root_unit.shard_comm, self.comm, self.device)
        chosen = (max_norm, norm_type, parameters, error_if_nonfinite)
        return clip_grad_norm(self.sharded_params(), self.ignored_params, *where, *chosen)
