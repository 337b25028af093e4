"""Every transition of a unit's ``UnitState`` (engine/state.py) and the decisions read from it,
without a model or a process: the schedule's rules, one by one."""

from __future__ import annotations

from fsdp_strategy.engine.state import AfterPostBackward, Frame, TrainingState, UnitState


def _entered(state: UnitState, counted: bool = True, in_backward: bool = False) -> Frame:
    frame = Frame(None, counted=counted)
    state.forward_entered(frame, in_backward)
    state.post_backward_armed(counted)
    return frame


def test_forward_then_backward_of_a_block():
    state = UnitState(is_root=False)
    assert state.phase is TrainingState.IDLE and state.may_reshard()
    _entered(state)
    assert state.phase is TrainingState.FORWARD and state.on_stack and not state.may_reshard()
    assert state.forward_exited() is not None and state.phase is TrainingState.IDLE
    # FULL_SHARD releases it after forward; SHARD_GRAD_OP keeps it while its backward is due
    assert state.reshards_after_forward(backward_due=True, root_depth=1, reshard_after_forward=True)
    assert not state.reshards_after_forward(backward_due=True, root_depth=1, reshard_after_forward=False)
    assert state.reshards_after_forward(backward_due=False, root_depth=1, reshard_after_forward=False)
    assert state.backward_reached() and state.phase is TrainingState.PRE_BACKWARD
    assert not state.backward_reached()  # a second output's hook: nothing new
    assert not state.reshards_after_forward(backward_due=False, root_depth=0, reshard_after_forward=True)
    assert state.post_backward_fired(counted=True, create_graph=False) is AfterPostBackward.READY
    assert state.phase is TrainingState.POST_BACKWARD and state.needs_reduction(gathered=False)
    state.reduced_now()
    assert not state.needs_reduction(gathered=True)
    assert not state.keeps_after_backward(create_graph=False)
    state.backward_finished(create_graph=False)
    assert state.phase is TrainingState.IDLE and not state.in_backward and not state.reduced


def test_the_root_stays_gathered_while_its_forward_is_on_the_stack():
    root = UnitState(is_root=True)
    _entered(root)
    _entered(root)  # training_step calls the root's forward again inside it
    assert root.forward_exited() is not None and root.on_stack and root.phase is TrainingState.FORWARD
    assert not root.may_reshard() and root.keeps_after_backward(create_graph=False)
    assert root.needs_reduction(gathered=True)  # a backward inside its forward reduces it
    root.forward_exited()
    assert not root.reshards_after_forward(backward_due=True, root_depth=0, reshard_after_forward=True)
    assert not root.reshards_after_forward(backward_due=False, root_depth=1, reshard_after_forward=True)
    assert root.reshards_after_forward(backward_due=False, root_depth=0, reshard_after_forward=False)
    assert not root.forward_pass_finished()  # the root is never a missed prefetch


def test_a_unit_called_twice_reduces_once_after_its_last_post_backward():
    state = UnitState(is_root=False)
    for _ in range(2):
        _entered(state)
        state.forward_exited()
    state.backward_reached()
    assert state.post_backward_fired(counted=True, create_graph=False) is AfterPostBackward.RESHARD
    assert state.phase is TrainingState.IDLE
    assert state.post_backward_fired(counted=True, create_graph=False) is AfterPostBackward.READY


def test_a_call_without_post_backward_defers_the_reduction_to_the_end_of_backward():
    state = UnitState(is_root=False)
    _entered(state)
    state.forward_exited()
    state.forward_entered(Frame(None), in_backward=False)  # a critic on real data: inputs need no grad
    state.call_uncovered()
    state.forward_exited()
    state.backward_reached()
    assert state.post_backward_fired(counted=True, create_graph=False) is AfterPostBackward.RESHARD
    assert state.needs_reduction(gathered=False)  # backward reached it: the end of backward reduces it


def test_double_backward_keeps_the_unit_until_the_next_backward_ends():
    state = UnitState(is_root=False)
    _entered(state)
    state.forward_exited()
    state.backward_reached()
    assert state.post_backward_fired(counted=True, create_graph=True) is AfterPostBackward.KEEP
    assert not state.may_reshard() and state.keeps_after_backward(create_graph=True)
    state.backward_finished(create_graph=True)
    assert state.double_backward and state.needs_reduction(gathered=True)  # the next backward reduces it
    assert state.post_backward_fired(counted=False, create_graph=False) is AfterPostBackward.KEEP
    assert not state.keeps_after_backward(create_graph=False)
    state.backward_finished(create_graph=False)
    assert not state.double_backward and state.may_reshard()


def test_a_recomputation_in_backward_counts_no_post_backward():
    state = UnitState(is_root=False)
    _entered(state)
    state.forward_exited()
    state.backward_reached()
    frame = _entered(state, counted=False, in_backward=True)  # activation checkpointing recomputes it
    assert state.phase is TrainingState.PRE_BACKWARD and not frame.counted and state.post_backwards_due == 1
    state.forward_exited()
    assert state.post_backward_fired(counted=True, create_graph=False) is AfterPostBackward.READY


def test_a_raising_forward_owes_no_post_backward():
    state = UnitState(is_root=False)
    frame = _entered(state)
    assert state.forward_exited() is frame
    state.forward_raised(frame)
    assert state.post_backwards_due == 0 and state.phase is TrainingState.IDLE
    assert state.forward_exited() is None  # a post-hook whose pre-hook never ran


def test_a_prefetch_that_missed_is_released_when_the_forward_pass_ends():
    ran, missed = UnitState(is_root=False), UnitState(is_root=False)
    ran.ran_in_forward_pass()
    assert not ran.forward_pass_finished() and not ran.ran_forward
    assert missed.forward_pass_finished()
    missed.pin()
    assert not missed.forward_pass_finished()  # summon_full_params holds it


def test_pinning_and_the_backward_post_prefetch():
    state = UnitState(is_root=False)
    state.pin()
    state.pin()
    assert not state.may_reshard() and state.keeps_after_backward(create_graph=False)
    assert not state.reshards_after_forward(backward_due=False, root_depth=0, reshard_after_forward=True)
    assert not state.unpin() and state.unpin() and state.may_reshard()
    target = object()
    state.prefetch_after_backward = target
    assert state.take_prefetch() is target and state.take_prefetch() is None


def test_reset_forgets_everything_in_one_call():
    state = UnitState(is_root=True)
    _entered(state)
    state.pin()
    state.backward_reached()
    state.post_backward_fired(counted=True, create_graph=True)
    state.call_uncovered()
    state.reset()
    fresh = UnitState(is_root=True)
    assert vars(state) == vars(fresh)


def test_exposed_until_covered_and_forgotten_by_reset():
    state = UnitState(is_root=True)
    assert not state.covered()  # never exposed: its reshard keeps the visibly changed parameters only
    state.expose()  # training_step runs inside the root: user code may change any full parameter
    assert state.covered()  # the reshard keeps every parameter's edits, once
    assert not state.covered()
    state.expose()
    state.reset()
    assert not state.exposed and not state.covered()
