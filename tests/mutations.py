"""The mutation check: plausible bugs, each put into a copy of the package in turn, each caught.

    python tests/mutations.py              # every mutation (about 5 minutes on 2 CPU cores)
    python tests/mutations.py --list       # what each one changes and the tests that must catch it
    python tests/mutations.py div_missing  # some of them, by name

A green suite proves only what its oracles see. Each mutation below is a mistake a real change
could make (a lost divide, optimizer state dropped on a resume, precision never applied, ...).
For each, the package is copied into a temporary folder in its installed layout, the one edit is
made there, and the tests named for it run against that copy (``PYTHONPATH`` puts it ahead of
the installed package): they must fail. First the same tests run against an unchanged copy and
must pass, so that a failure is the mutation's. The tests named are part of the fast suite
(``pytest -m "not slow"``). Exit status 1 if a mutation survives or no longer applies (the code
it edits changed: update its ``old`` text here; ``tests/test_mutations.py`` checks that each
still applies, in the suite).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]


class Mutation(NamedTuple):
    """One plausible bug: replace ``old`` (found exactly once in ``path``) by ``new``."""

    name: str
    what: str
    path: str  # relative to the checkout
    old: str
    new: str
    tests: tuple[str, ...]  # pytest node ids (relative to the checkout) that must fail with it


MUTATIONS = [
    Mutation(
        "backward_prefetch_from_last_step",
        "backward prefetches in the previous step's backward order (a layer dropped this step is gathered)",
        "fsdp_strategy/engine/order.py",
        "            self._previous[phase] = [unit for unit in before if unit in ran]\n",
        "            pass\n",
        (
            "tests/test_comm_schedule.py::"
            "test_prefetch_follows_the_previous_step_in_forward_and_this_steps_units_in_backward",
        ),
    ),
    Mutation(
        "stale_optimizer_steps",
        "an optimizer created before sharding steps the model's old parameters (nothing changes) without an error",
        "fsdp_strategy/engine/optimizer_steps.py",
        "return any(id(p) in self._held or self._was_replaced(p) for p in params)",
        "return any(id(p) in self._held for p in params)",
        ("tests/test_misuse.py::test_an_optimizer_created_before_sharding_is_refused",),
    ),
    Mutation(
        "restart_reads_old_keys",
        "a torchrun restart creates its process group on the agent's store as it is (the failed attempt's keys)",
        "fsdp_strategy/distributed/rendezvous.py",
        "    return dist.PrefixStore(namespace, store)\n",
        "    return store\n",
        ("tests/test_restarts.py::test_attempts_on_one_store_never_read_each_others_keys",),
    ),
    Mutation(
        "optimizer_dropped_on_reshard",
        "the Trainer drops the optimizer state whenever a sharded checkpoint resumes at another world size",
        "fsdp_strategy/strategy_checkpoints.py",
        "        if pending is None or not optimizers:\n            return\n",
        "        if pending is None or not optimizers:\n            return\n"
        "        if pending.meta is not None and pending.meta['world_size'] != __import__('torch').distributed"
        ".get_world_size():\n            return\n",
        ("tests/test_resume.py::test_resume_on_another_world_size",),
    ),
    Mutation(
        "loss_divided_twice",
        "the loss is divided by accumulate_grad_batches once more in the strategy's backward",
        "fsdp_strategy/strategy.py",
        "return super().backward(closure_loss, optimizer, *args, **kwargs)",
        "accumulate = self.lightning_module.trainer.accumulate_grad_batches\n"
        "            return super().backward(closure_loss / accumulate, optimizer, *args, **kwargs)",
        ("tests/test_strategy.py::test_lightning_fit_matches_reference",),
    ),
    Mutation(
        "fabric_precision_lost",
        "Fabric's precision never reaches the engine (training silently in fp32)",
        "fsdp_strategy/fabric.py",
        "mixed = self.mixed_precision or self.precision.engine_mixed_precision",
        "mixed = self.mixed_precision",
        ("tests/test_fabric.py::test_fabric_precisions_equal_the_precision_oracle",),
    ),
    Mutation(
        "trainer_precision_lost",
        "Trainer(precision='bf16-mixed') never reaches the engine (parameters gathered in fp32)",
        "fsdp_strategy/strategy.py",
        "options = dataclasses.replace(self._options, mixed_precision=self._engine_mixed_precision())",
        "options = self._options",
        ("tests/test_strategy.py::test_lightning_fit_matches_reference",),
    ),
    Mutation(
        "div_missing",
        "the reduced gradient sum is never divided by the data-parallel size",
        "fsdp_strategy/engine/buffers.py",
        "grads.div_(spec.divide_after)  # [Note: SUM then divide]",
        "pass",
        ("tests/test_parity.py::test_parity_world_2",),
    ),
    Mutation(
        "hybrid_divide_factor",
        "HYBRID_SHARD divides by the shard group's size instead of the data-parallel size",
        "fsdp_strategy/engine/unit.py",
        "data_parallel_size = self.shard_comm.size * self.replicate_comm.size",
        "data_parallel_size = self.shard_comm.size",
        ("tests/test_parity.py::test_parity_hybrid_shard_world_4",),
    ),
    Mutation(
        "last_reduction_lost",
        "the reduction still in flight at the end of backward is never applied (the last unit's gradients)",
        "fsdp_strategy/engine/reductions.py",
        "        while self._in_flight:\n            self._advance(self._in_flight.popleft())\n"
        "        self._finish_replicating()",
        "        while len(self._in_flight) > 1:\n            self._advance(self._in_flight.popleft())\n"
        "        self._in_flight.clear()\n        self._finish_replicating()",
        ("tests/test_parity.py::test_parity_world_2",),
    ),
    Mutation(
        "shard_offset",
        "each rank's shard starts one row late",
        "fsdp_strategy/engine/param.py",
        "local = rows[shard_rank * self.chunk_rows : (shard_rank + 1) * self.chunk_rows]",
        "local = rows[shard_rank * self.chunk_rows + 1 : (shard_rank + 1) * self.chunk_rows + 1]",
        ("tests/test_parity.py::test_parity_world_2",),
    ),
    Mutation(
        "optimizer_checkpoint_key",
        "sharded folders name their optimizers 'optimizer0' instead of Lightning's 'optimizer_0'",
        "fsdp_strategy/checkpoint/sharded.py",
        'return [f"optimizer_{index}" for index in range(count)]',
        'return [f"optimizer{index}" for index in range(count)]',
        ("tests/test_checkpoint.py",),
    ),
    Mutation(
        "offload_grad_copy_skipped",
        "with CPU offload, the reduced gradient is never copied into host memory",
        "fsdp_strategy/engine/device.py",
        "        out.copy_(reduced, non_blocking=True)\n",
        "",
        ("tests/test_parity.py::test_parity_world_2",),
    ),
    Mutation(
        "clip_norm_local",
        "clipping by norm uses this rank's shards' norm (the all-reduce is left out)",
        "fsdp_strategy/engine/clipping.py",
        '        collectives.all_reduce(terms, comm, ctx, "clip_grad_norm", op="max" if infinite else "sum").wait()\n',
        "        pass\n",
        ("tests/test_accumulation_and_clipping.py::test_each_optimizer_is_clipped_by_its_own_norm",),
    ),
    Mutation(
        "no_sync_in_param_dtype",
        "no_sync accumulates bf16 gradients in bf16 instead of the reduce dtype",
        "fsdp_strategy/engine/unit.py",
        'param.stash_grad(self._reduce_dtype), "stashed_grads"',
        'param.stash_grad(param.param_dtype), "stashed_grads"',
        ("tests/test_accumulation_and_clipping.py::test_no_sync_accumulates_bf16_gradients_in_fp32",),
    ),
    Mutation(
        "fabric_optimizer_not_loaded",
        "a sharded folder's optimizer state is not loaded when it was written at another world size",
        "fsdp_strategy/checkpoint/sharded_load.py",
        "    _load_optimizer_states(view, folder, stored, optimizers, loaded, flat, legacy_groups)\n",
        "    if meta is None or meta['world_size'] == control.process_rank(process_group)[1]:\n"
        "        _load_optimizer_states(view, folder, stored, optimizers, loaded, flat, legacy_groups)\n",
        ("tests/test_fabric.py::test_fabric_checkpoints_round_trip_and_resume_at_another_world_size",),
    ),
    Mutation(
        "freeze_inside_step_lost",
        "requires_grad changed on a gathered (full) parameter inside a step (a GAN's critic) is overwritten",
        "fsdp_strategy/engine/param.py",
        "value = full if sharded == self._agreed_requires_grad else sharded",
        "value = sharded",
        ("tests/test_patterns.py::test_patterns_world_2",),
    ),
    Mutation(
        "muon_steps_shards",
        "a whole-matrix optimizer (Muon) steps each rank's rows instead of whole matrices",
        "fsdp_strategy/engine/optimizer_steps.py",
        "                    raise _refused_on_blocks(optimizer, split, UpdateKind.WHOLE_MATRIX)\n"
        "                placement.before_update",
        "                    raise _refused_on_blocks(optimizer, split, UpdateKind.WHOLE_MATRIX)\n"
        "                placement.abandon",
        ("tests/test_whole_matrix.py::test_whole_matrix_optimizers_equal_one_process_on_the_global_batch",),
    ),
    Mutation(
        "renamed_keys_skipped",
        "a checkpoint key loads only into the parameter of that very name (LoRA's renames on load are skipped)",
        "fsdp_strategy/checkpoint/module_state.py",
        "        params.setdefault(probe[1], [])\n",
        "        if probe[1] != param.fqn:\n            continue\n        params.setdefault(probe[1], [])\n",
        ("tests/test_state_dict_hooks.py::test_fabric_checkpoints_go_through_the_modules_own_state_dict_code",),
    ),
    Mutation(
        "restore_after_setup_deferred",
        "a checkpoint restored after setup (the tuner's) is applied only at the next setup",
        "fsdp_strategy/strategy_checkpoints.py",
        "        if pending is None or model is None or not is_sharded(model):\n            return\n",
        "        if pending is None or model is None or is_sharded(model) or True:\n            return\n",
        ("tests/test_restore_anytime.py::test_a_restore_after_setup_is_in_effect_when_it_returns",),
    ),
    Mutation(
        "data_position_not_restored",
        "a mid-epoch resume starts the epoch's data from its first batch",
        "fsdp_strategy/strategy_data.py",
        '            position.sampler.resume_from(epoch, entries[len(self.loaders) - 1]["consumed_samples"])\n',
        "            pass\n",
        ("tests/test_resume.py::test_resume_is_exact_at_the_same_world_size",),
    ),
    Mutation(
        "stopped_epoch_counted_finished",
        "a fit stopped inside an epoch (max_steps, max_time) resumes from its end-of-fit checkpoint at the next "
        "epoch (the rest of the stopped one never seen)",
        "fsdp_strategy/strategy_checkpoints.py",
        "            reopen_stopped_epoch(checkpoint, position)",
        "            pass",
        ("tests/test_resume_stops.py::test_a_fit_stopped_off_the_checkpoint_grid_resumes_sample_by_sample",),
    ),
    Mutation(
        "optimizers_assumed_elementwise",
        "an optimizer the engine does not know is assumed elementwise instead of measured",
        "fsdp_strategy/engine/optimizer_kinds.py",
        '            measured[shapes] = self._measure(optimizer, when or "before its first step")\n',
        "            measured[shapes] = UpdateKind.ELEMENTWISE\n",
        ("tests/test_optimizer_probe.py::test_real_optimizers_equal_one_process_on_the_global_batch[2]",),
    ),
    Mutation(
        "probe_compares_the_update_only",
        "a measurement compares the parameters and their state, not the param groups' values or the optimizer's "
        "attributes (a global statistic that has not moved an update yet goes unseen: Prodigy, D-Adaptation)",
        "fsdp_strategy/engine/probe_compare.py",
        """    for kind, label in (("groups", "its param group's"), ("attributes", "its attribute")):""",
        """    for kind, label in ():""",
        ("tests/test_optimizer_verification.py::test_what_an_optimizer_keeps_is_compared_not_only_its_update",),
    ),
    Mutation(
        "measured_on_small_tensors_only",
        "an unknown optimizer is measured on small tensors only, not on the model's own parameters (a block size "
        "or a shape threshold goes unseen: ScalableShampoo; an optimizer of matrices alone is refused)",
        "fsdp_strategy/engine/optimizer_kinds.py",
        "        models = [None] * len(toys) if certain else self._measure_model(optimizer)\n",
        "        models = [None] * len(toys)\n",
        (
            "tests/test_optimizer_verification.py::test_every_optimizer_is_exact_or_refused_before_it_changes_a_weight[2]",
        ),
    ),
    Mutation(
        "owners_chosen_again",
        "a param group added to an optimizer placed whole chooses every parameter's owner again (the state "
        "only the old owner held is lost)",
        "fsdp_strategy/engine/whole_matrix.py",
        "        kept = {i: rank for i, rank in (cached[1] if cached is not None else {}).items() if i in ids}\n",
        "        kept = {}\n",
        (
            "tests/test_optimizer_verification.py::test_param_groups_added_and_optimizers_replaced_keep_placing_whole_"
            "exactly[2]",
        ),
    ),
    Mutation(
        "deleted_state_comes_back",
        "a state entry an optimizer placed whole deletes in its step stays in the owner's state at rest",
        "fsdp_strategy/engine/whole_matrix.py",
        "        for key in set(state) - {entry.key for entry in layout}:  # the optimizer deleted it in its step\n",
        "        for key in ():\n",
        (
            "tests/test_optimizer_verification.py::test_every_optimizer_is_exact_or_refused_before_it_changes_a_weight[2]",
        ),
    ),
    Mutation(
        "stand_ins_made_anew",
        "a parameter placed whole gets a new stand-in object at each step (state an optimizer keys by the "
        "parameter object is lost)",
        "fsdp_strategy/engine/whole_matrix.py",
        "        proxy = self._proxies.get(id(param.sharded))\n",
        "        proxy = None\n",
        (
            "tests/test_optimizer_verification.py::test_every_optimizer_is_exact_or_refused_before_it_changes_a_weight[2]",
        ),
    ),
    Mutation(
        "owner_state_replicated_then_lost",
        "state not shaped like its parameter is dropped by its owner too after a step (only rows kept)",
        "fsdp_strategy/engine/whole_matrix.py",
        "                self._keep_apart(optimizer, param, states.get(id(param.sharded)) if rank == me else None)\n",
        "                self._keep_apart(optimizer, param, None)\n",
        ("tests/test_optimizer_probe.py::test_real_optimizers_equal_one_process_on_the_global_batch[2]",),
    ),
    Mutation(
        "host_count_moved_to_device",
        "a step count an optimizer placed whole keeps on the host is moved to the device for its step (on CUDA "
        "a blocking copy, and the optimizer then reads it off the device: a host wait per step)",
        "fsdp_strategy/engine/state_layout.py",
        '    if key == "step" and value.device.type == "cpu":',
        "    if False:",
        ("tests/test_host_reads.py::test_a_steady_state_step_reads_nothing_on_the_host",),
    ),
    Mutation(
        "group_digest_ignores_values",
        "param groups are compared by their keys alone (a value one rank set from its parameters goes unseen)",
        "fsdp_strategy/engine/group_agreement.py",
        "    text = repr(_plain(values)).encode()\n",
        "    text = repr(sorted(values)).encode()\n",
        (
            "tests/test_optimizer_verification.py::"
            "test_a_group_value_set_from_one_parameter_after_the_measurement_is_an_error_on_every_rank",
        ),
    ),
    Mutation(
        "group_tensors_in_tuples_by_shape",
        "the agreement after a step compares tensors inside a param group's tuples (betas) by shape only",
        "fsdp_strategy/engine/group_agreement.py",
        "    elif isinstance(value, (list, tuple)):\n        for index, item in enumerate(value):\n",
        "    elif False:\n        for index, item in enumerate(value):\n",
        ("tests/test_group_agreement.py::test_a_value_one_rank_changed_is_an_error_on_every_rank_however_it_is_kept",),
    ),
    Mutation(
        "group_numbers_by_type",
        "the agreement after a step compares numpy arrays in a param group by their type only",
        "fsdp_strategy/engine/group_agreement.py",
        '    if all(hasattr(value, name) for name in ("tobytes", "shape", "dtype", "size")):',
        "    if False:",
        ("tests/test_group_agreement.py::test_a_value_one_rank_changed_is_an_error_on_every_rank_however_it_is_kept",),
    ),
    Mutation(
        "group_tensor_bits_summed_plainly",
        "the agreement after a step sums the small tensors' bits without mixing them (changes can cancel)",
        "fsdp_strategy/engine/group_agreement.py",
        "            term = _mix(_mix(bits) + _mix(places)).sum()\n",
        "            term = (bits + places).sum()\n",
        ("tests/test_group_agreement.py::test_a_value_one_rank_changed_is_an_error_on_every_rank_however_it_is_kept",),
    ),
    Mutation(
        "group_integers_through_float64",
        "the agreement after a step compares integer tensors through float64 (past 2^53 they round)",
        "fsdp_strategy/engine/group_agreement.py",
        "    if not flat.is_floating_point():\n",
        "    if False:\n",
        ("tests/test_group_agreement.py::test_a_value_one_rank_changed_is_an_error_on_every_rank_however_it_is_kept",),
    ),
    Mutation(
        "group_measured_again_apart",
        "a rank that alone measures an optimizer again (a value changed there only) goes ahead unchecked (a hang)",
        "fsdp_strategy/engine/group_agreement.py",
        "[_digest(values) for values in buckets] + [len(groups), int(measuring)]",
        "[_digest(values) for values in buckets] + [len(groups), 0]",
        ("tests/test_group_agreement.py::test_a_value_one_rank_changed_is_an_error_on_every_rank_however_it_is_kept",),
    ),
    Mutation(
        "group_placed_whole_not_compared_before",
        "an optimizer placed whole is not compared before its step (a rank measuring it again alone: a hang)",
        "fsdp_strategy/engine/optimizer_steps.py",
        "            elif self._agreement is not None and self._kinds.placed_whole(optimizer):\n",
        "            elif False:\n",
        ("tests/test_group_agreement.py::test_a_value_one_rank_changed_is_an_error_on_every_rank_however_it_is_kept",),
    ),
    Mutation(
        "group_count_not_compared",
        "the agreement does not compare the number of param groups (one added on one rank: a less clear error)",
        "fsdp_strategy/engine/group_agreement.py",
        "[_digest(values) for values in buckets] + [len(groups), int(measuring)]",
        "[_digest(values) for values in buckets] + [0, int(measuring)]",
        ("tests/test_group_agreement.py::test_a_value_one_rank_changed_is_an_error_on_every_rank_however_it_is_kept",),
    ),
    Mutation(
        "probe_copies_a_held_module",
        "the probe deep-copies an optimizer that holds a module (a sharded model: the process crashed)",
        "fsdp_strategy/engine/optimizer_copies.py",
        "    if module is not None:  # a deep copy of a sharded model",
        "    if False:  # a deep copy of a sharded model",
        ("tests/test_optimizer_probe.py::test_the_probe_classifies_real_optimizers",),
    ),
    Mutation(
        "group_values_by_type",
        "the agreement after a step compares a param group's Fraction, enum and other non-builtin values by type",
        "fsdp_strategy/engine/group_agreement.py",
        "    if isinstance(value, (numbers.Number, torch.dtype, torch.device)):  # Fraction(1, 20), torch.bfloat16\n",
        "    if False:\n",
        ("tests/test_group_agreement.py::test_a_value_one_rank_changed_is_an_error_on_every_rank_however_it_is_kept",),
    ),
    Mutation(
        "group_object_array_by_bytes",
        "the agreement after a step compares a numpy object array by its bytes (addresses: an error where ranks agree)",
        "fsdp_strategy/engine/group_agreement.py",
        "        if value.dtype.hasobject:  # its bytes are addresses\n",
        "        if False:\n",
        ("tests/test_group_agreement.py::test_a_value_one_rank_changed_is_an_error_on_every_rank_however_it_is_kept",),
    ),
    Mutation(
        "settings_changed_not_measured_again",
        "an optimizer whose param group values change between steps keeps the kind measured with the old ones",
        "fsdp_strategy/engine/optimizer_kinds.py",
        "        return [] if self.known(optimizer) is not None else self._changed_since_step(optimizer)\n",
        "        return []\n",
        (
            "tests/test_optimizer_verification.py::"
            "test_what_changes_after_the_first_measurement_is_measured_again_or_an_error[2]",
        ),
    ),
    Mutation(
        "one_parameter_of_each_shape",
        "only one parameter of each shape is measured on the model (a branch another one takes goes unseen)",
        "fsdp_strategy/engine/optimizer_kinds.py",
        "                if others_load[owner] + numel > OTHERS_BUDGET:\n",
        "                if True:\n",
        (
            "tests/test_optimizer_verification.py::"
            "test_what_changes_after_the_first_measurement_is_measured_again_or_an_error[2]",
        ),
    ),
    Mutation(
        "tensor_values_by_shape_only",
        "the agreement after a step compares tensor values of a param group by shape only",
        "fsdp_strategy/engine/group_agreement.py",
        "            term = _mix(_mix(bits) + _mix(places)).sum()\n",
        "            term = torch.zeros((), dtype=torch.int64, device=self._device)\n",
        (
            "tests/test_optimizer_verification.py::"
            "test_what_changes_after_the_first_measurement_is_measured_again_or_an_error[2]",
        ),
    ),
    Mutation(
        "layers_assumed_alike",
        "a memory plan counts identical-looking layers without checking that each runs alike (by its index)",
        "fsdp_strategy/plan/run.py",
        "        if layer_list is not None and not runs_alike(module, layer_list, lambda: _meta_forward(module, "
        "example_input)):\n",
        "        if False:\n",
        ("tests/test_plan.py::test_layers_that_run_otherwise_by_their_index_are_planned_every_one",),
    ),
    Mutation(
        "complex_buffers_cast_real",
        "'*-true' precisions convert the module with module.to(dtype): a complex rotary table keeps its real part",
        "fsdp_strategy/config.py",
        "        return module._apply(functools.partial(convert_tensor, dtype=self.low))\n",
        "        return module.to(dtype=self.low)\n",
        ("tests/test_complex_tensors.py::test_every_precision_keeps_complex_tensors_and_equals_ddp",),
    ),
    Mutation(
        "complex_params_gathered_in_param_dtype",
        "a complex parameter is gathered in mixed_precision.param_dtype (its imaginary part dropped)",
        "fsdp_strategy/engine/param.py",
        "        floating = layout.param_dtype is not None and param.is_floating_point()\n",
        "        floating = layout.param_dtype is not None\n",
        ("tests/test_complex_tensors.py::test_complex_parameters_and_buffers_train_as_one_process",),
    ),
    Mutation(
        "lost_edits_read_at_reshard",
        "a lower param_dtype's write-back check is read at each reshard (a host wait per unit per step on a GPU)",
        "fsdp_strategy/engine/unit.py",
        "        self.lost_edits.add(keep_full_edits(self.name, self.params, every_param and not self._aliased))\n",
        "        checks = keep_full_edits(self.name, self.params, every_param and not self._aliased)\n"
        "        if any(bool(check.lost) for check in checks):\n"
        "            raise RuntimeError('fsdp_custom: a change made while gathered was lost')\n"
        "        self.lost_edits.add(checks)\n",
        ("tests/test_host_reads.py::test_a_steady_state_step_reads_nothing_on_the_host",),
    ),
    Mutation(
        "lost_edits_read_at_their_own_report",
        "the lost-edit flags are read where they are sent (a device sync on CUDA)",
        "fsdp_strategy/engine/edits.py",
        "        if not everything and self._sent and self._sent[-1][0].event is not None:\n",
        "        if False:\n",
        ("tests/test_host_reads.py::test_lost_edit_flags_are_read_a_step_later_on_every_rank_alike",),
    ),
    Mutation(
        "lost_edits_read_once_landed",
        "the lost-edit flags are read once this rank's copy has landed (ranks raise at different places on CUDA)",
        "fsdp_strategy/engine/edits.py",
        "        for _ in range(due):\n",
        "        while due and self._sent[0][0].landed():\n            due -= 1\n",
        ("tests/test_host_reads.py::test_lost_edit_flags_are_read_a_step_later_on_every_rank_alike",),
    ),
    Mutation(
        "tp_partial_grad_not_summed",
        "a tensor-parallel gradient is reduce-scattered in its own placement (a Partial one never summed over TP)",
        "fsdp_strategy/engine/tensor_parallel.py",
        "        if tuple(grad.placements) != self.placements:\n",
        "        if False:\n",
        ("tests/test_tensor_parallel.py::test_two_dimensional_training_equals_one_process",),
    ),
    Mutation(
        "tp_clip_counts_replicas",
        "the clipping norm counts a TP-replicated gradient once per tensor-parallel peer",
        "fsdp_strategy/engine/clipping.py",
        "    replicas = 1.0 if infinite else float(tensor_comm.size)",
        "    replicas = 1.0",
        ("tests/test_tensor_parallel.py::test_two_dimensional_training_equals_one_process",),
    ),
    Mutation(
        "tp_blocks_stepped_whole",
        "a whole-matrix optimizer steps tensor-parallel blocks as if they were the matrices",
        "fsdp_strategy/engine/optimizer_steps.py",
        "        if split and known is not UpdateKind.ELEMENTWISE",
        "        if False and known is not UpdateKind.ELEMENTWISE",
        ("tests/test_tensor_parallel.py::test_only_elementwise_optimizers_step_tensor_parallel_blocks",),
    ),
    Mutation(
        "tp_dp_broadcast_global",
        "sync_module_states broadcasts a tensor-parallel block from global rank 0 (another rank's block)",
        "fsdp_strategy/engine/build.py",
        "        control.broadcast_from_rank0(blocks, layout.compute_device, dog, data.group)",
        "        control.broadcast_from_rank0(blocks, layout.compute_device, dog)",
        ("tests/test_tensor_parallel.py::test_two_dimensional_training_equals_one_process",),
    ),
    Mutation(
        "tp_replicas_apart_unseen",
        "TP-replicated parameters whose gradients differ across the TP ranks train apart silently",
        "fsdp_strategy/engine/replica_agreement.py",
        "            if apart:\n",
        "            if False:\n",
        ("tests/test_tensor_parallel.py::test_what_breaks_two_dimensional_training_in_use_is_named",),
    ),
    Mutation(
        "fabric_resumed_skip_forgotten",
        "a Fabric loop saved again after a resume into an epoch forgets what that resume skipped",
        "fsdp_strategy/fabric_data.py",
        "        taken = current.skipped + current.taken * self.batch_size * self.sampler.num_replicas\n",
        "        taken = current.taken * self.batch_size * self.sampler.num_replicas\n",
        ("tests/test_fabric_data_position.py::test_a_fabric_loop_resumes_its_dataloader_where_the_checkpoint_left_it",),
    ),
    Mutation(
        "fabric_all_handed_out_unseen",
        "a Fabric loop whose iteration was closed after handing out all its batches (zip of two loaders, islice) "
        "resumes inside that epoch (one epoch more than it ran)",
        "fsdp_strategy/fabric_data.py",
        "                record.state = FINISHED if record.taken >= record.batches else LEFT\n",
        "                record.state = LEFT\n",
        ("tests/test_fabric_data_position.py::test_a_fabric_loop_resumes_its_dataloader_where_the_checkpoint_left_it",),
    ),
    Mutation(
        "fabric_peek_taken_for_the_loop",
        "a batch peeked at inside a Fabric loop's `for` (next(iter(loader))) is taken for the loop's iteration",
        "fsdp_strategy/fabric_data.py",
        "(closed is not None and closed.state == FINISHED and closed.touched > running.touched)",
        "(closed is not None and closed.touched > running.touched)",
        ("tests/test_fabric_data_position.py::test_a_fabric_loop_resumes_its_dataloader_where_the_checkpoint_left_it",),
    ),
    Mutation(
        "fabric_next_epoch_not_kept",
        "a resumed Fabric loop numbers the epochs after the resumed one from it, not from the saved loop's count",
        "fsdp_strategy/fabric_data.py",
        '        following = state.get("next_epoch", state["epoch"] + 1)\n',
        '        following = state["epoch"] + 1\n',
        ("tests/test_fabric_data_position.py::test_a_fabric_loop_resumes_its_dataloader_where_the_checkpoint_left_it",),
    ),
    Mutation(
        "stopped_epoch_at_end_hook_unseen",
        "a max_steps stop saved by ModelCheckpoint's on_train_epoch_end (processed, not completed) resumes at the "
        "next epoch",
        "fsdp_strategy/data.py",
        '{total["completed"], current["completed"]} - {finished, finished - 1}',
        '{total["completed"], current["completed"]} - {finished}',
        ("tests/test_resume_stops.py::test_a_fit_stopped_off_the_checkpoint_grid_resumes_sample_by_sample",),
    ),
    Mutation(
        "rest_of_epoch_in_rounded_batches",
        "a Trainer resume at another global batch counts what was consumed in whole batches of its own (the "
        "epoch loop ends before the rest of the epoch is seen)",
        "fsdp_strategy/strategy_data.py",
        "        rest = [position.batches(position.sampler.skipped()) for position in positions]\n",
        "        steps = [math.ceil(p.sampler.skipped() / p.batch_size / p.sampler.num_replicas) for p in positions]\n"
        "        rest = [max(0, p.batches() - taken) for p, taken in zip(positions, steps)]\n",
        ("tests/test_resume_stops.py::test_a_fit_stopped_off_the_checkpoint_grid_resumes_sample_by_sample",),
    ),
    Mutation(
        "finished_epoch_left_processed",
        "a checkpoint saved at on_train_epoch_end after the epoch's last batch, resumed by a fit bounded by "
        "max_steps, runs the next epoch's samples under the finished epoch's number (Lightning's own behaviour)",
        "fsdp_strategy/strategy_checkpoints.py",
        "        if fitting and complete_finished_epoch(checkpoint):\n",
        "        if False:\n",
        ("tests/test_resume_stops.py::test_a_fit_stopped_off_the_checkpoint_grid_resumes_sample_by_sample",),
    ),
    Mutation(
        "batch_end_save_left_unfinished",
        "a periodic checkpoint saved at an epoch's last batch is resumed as Lightning counts it: the next epoch "
        "never counted as started, so a resume from that epoch's own checkpoint trains it again",
        "fsdp_strategy/data.py",
        "        _end_epoch_at_last_batch(fit)\n",
        "        pass\n",
        ("tests/test_resume_stops.py::test_a_fit_stopped_off_the_checkpoint_grid_resumes_sample_by_sample",),
    ),
    Mutation(
        "dataloader_setup_kept_across_fits",
        "a second fit on one Trainer (or the fit after an LR finder's run) takes its training dataloader for "
        "another loader of the first fit's setup: never positioned, its checkpoints keep the first fit's position",
        "fsdp_strategy/strategy_checkpoints.py",
        "        self._setup_open = False\n        self.resume_notice.remove()\n",
        "        self.resume_notice.remove()\n",
        ("tests/test_resume_stops.py::test_a_second_fit_and_a_fit_after_the_lr_finder_are_positioned",),
    ),
    Mutation(
        "half_step_not_replayed",
        "a checkpoint saved between the micro-batches of an accumulated step resumes after them: their gradients, "
        "not in the checkpoint, are lost and the step differs from the uninterrupted run's",
        "fsdp_strategy/data.py",
        "    return processed % accumulate\n",
        "    return 0\n",
        (
            "tests/test_resume_stops.py::test_a_checkpoint_inside_an_accumulated_step_resumes_at_the_steps_first_micro_batch",
        ),
    ),
    Mutation(
        "unapplied_gradients_unsaid",
        "a Fabric save between a backward and its optimizer step is resumed as 'exactly where the checkpoint left it'",
        "fsdp_strategy/engine/optimizer_steps.py",
        "        self._backward_since_step = True\n",
        "        self._backward_since_step = False\n",
        ("tests/test_fabric_data_position.py::test_a_save_inside_an_accumulated_step_says_the_resume_is_not_exact",),
    ),
    Mutation(
        "zero_grad_misses_the_stash",
        "a zero_grad between no_sync micro-batches leaves their stashed gradients, added back at the reduction",
        "fsdp_strategy/engine/param.py",
        "        return grad is None or grad is not marked() or grad._version != version\n",
        "        return False\n",
        (
            "tests/test_accumulation_and_clipping.py::test_zero_grad_between_micro_batches_discards_what_no_sync_accumulated",
        ),
    ),
    Mutation(
        "raised_ranks_stop_each_other",
        "when every rank raised, another rank's report stops this rank's on_exception collectives (the "
        "save_on_exception checkpoint fails by a race)",
        "fsdp_strategy/engine/watchdog.py",
        "        if self.abort is not None and not (self.reported_own and self._abort_raised):\n",
        "        if self.abort is not None:\n",
        ("tests/test_watchdog.py::test_ranks_that_all_raised_run_their_exception_handlers_collectives_together",),
    ),
    Mutation(
        "double_backward_inside_the_root_passes",
        "a gradient penalty through tensor-parallel layers inside the root's forward (one unit) trains wrong",
        "fsdp_strategy/engine/tensor_parallel.py",
        "        if torch.is_grad_enabled():\n            raise RuntimeError(DOUBLE_BACKWARD_WITH_TENSOR_PARALLEL)\n",
        "        return None\n",
        ("tests/test_tensor_parallel.py::test_what_breaks_two_dimensional_training_in_use_is_named",),
    ),
    Mutation(
        "cycled_loader_skipped_every_pass",
        "a shorter training dataloader that a CombinedLoader (max_size_cycle) starts again inside a resumed epoch "
        "skips the checkpoint's samples on every pass, not on the resumed one alone",
        "fsdp_strategy/data.py",
        "        start = 0 if self.skip_taken else self.skipped()",
        "        start = self.skipped()",
        ("tests/test_resume_loaders.py",),
    ),
    Mutation(
        "cycled_loader_position_past_its_end",
        "a shorter training dataloader cycling in max_size_cycle saves the epoch's batch count as its position "
        "(past its end: a resume skips its whole pass)",
        "fsdp_strategy/data.py",
        '        if mode == "max_size_cycle" and batches > first:',
        "        if False:",
        ("tests/test_resume_loaders.py",),
    ),
    Mutation(
        "worker_indices_taken_before_the_resume",
        "a training dataloader with worker processes resumed into a later epoch takes the indices its workers "
        "fetched at setup (epoch 0's order, nothing skipped)",
        "fsdp_strategy/strategy_data.py",
        "        position.sampler.set_epoch(epoch)\n",
        "        pass\n",
        ("tests/test_resume_loaders.py",),
    ),
    Mutation(
        "unfitting_position_kept",
        "a checkpoint whose training dataloaders were combined in another mode (or were another number) is "
        "resumed with its positions applied to this fit's loaders, unsaid",
        "fsdp_strategy/strategy_checkpoints.py",
        "        if why_not is not None:\n",
        "        if False:\n",
        ("tests/test_resume_loaders.py",),
    ),
    Mutation(
        "unprocessed_batch_kept",
        "a checkpoint saved inside a training batch (an exception in the step, a SIGTERM at a batch's start) keeps "
        "that batch in Lightning's total: validations every n batches run one batch early after the resume, and "
        "at an epoch's last batch the resume skips it",
        "fsdp_strategy/strategy_checkpoints.py",
        "            drop_unprocessed_batch(checkpoint)",
        "            pass",
        ("tests/test_resume_schedule.py",),
    ),
    Mutation(
        "own_sampler_not_repositioned",
        "a CombinedLoader given to fit comes back with the strategy's samplers at a reload, a second fit or the "
        "fit after the LR finder: left unpositioned, its checkpoints hold no position",
        "fsdp_strategy/data.py",
        "type(sampler) not in (DistributedSampler, ResumableDistributedSampler)",
        "type(sampler) is not DistributedSampler",
        ("tests/test_resume_loaders.py",),
    ),
    Mutation(
        "take_back_counts_on",
        "a resume whose position does not fit the loaders restarts them while Lightning counts on: the fit's "
        "later checkpoints hold a position its loaders never reached",
        "fsdp_strategy/strategy_data.py",
        "            self._shift(0 if restart_epoch else self._unshifted)",
        "            self._shift(self._unshifted)",
        ("tests/test_resume_loaders.py",),
    ),
    Mutation(
        "epoch_length_change_unsaid",
        "a resume at another world size whose epochs have another number of batches (drop_last, padding) says "
        "only that the global batch is the same",
        "fsdp_strategy/strategy_data.py",
        "        if old != new:",
        "        if False:",
        ("tests/test_resume_loaders.py",),
    ),
    Mutation(
        "stopped_epoch_without_position_left",
        "a checkpoint without a data position (DDP's) of a fit stopped inside an epoch resumes that epoch with "
        "its sampler set to the next epoch's order: the fit's later checkpoints name another epoch than its loops",
        "fsdp_strategy/strategy_checkpoints.py",
        "        if fitting:\n            reopen_stopped_epoch(checkpoint, position)",
        "        if fitting and position is not None:\n            reopen_stopped_epoch(checkpoint, position)",
        ("tests/test_resume_loaders.py",),
    ),
    Mutation(
        "tensor_parallel_death_unnamed",
        "a rank that dies while its peers wait in tensor parallel's own collectives (inside the forward) ends the "
        "job with torch's bare 'Connection reset by peer', naming no rank",
        "fsdp_strategy/strategy_watchdog.py",
        "        if dog.reports.gone_locally():",
        "        if False:",
        ("tests/test_faults.py::test_a_rank_that_dies_under_tensor_parallel_is_named",),
    ),
    Mutation(
        "pending_batches_counted_done",
        "a checkpoint saved after a step's first micro-batch (on_train_batch_end) rolls its data position back but "
        "not Lightning's batch count: the resumed step steps after one micro-batch",
        "fsdp_strategy/strategy_checkpoints.py",
        "                rewind_pending_batches(checkpoint, pending)\n",
        "                pass\n",
        ("tests/test_resume_schedule.py",),
    ),
    Mutation(
        "repeated_validation_unsaid",
        "a checkpoint set back to a step's first micro-batch past a validation that ran inside the step resumes "
        "with that validation run again, unsaid (EarlyStopping's patience counts it twice)",
        "fsdp_strategy/strategy_data.py",
        "        return validated > self._validated_at_step",
        "        return False",
        ("tests/test_resume_schedule.py",),
    ),
    Mutation(
        "dealing_change_unsaid",
        "a resume at another world size whose sampler repeats (or drops) other samples to fill the ranks says only "
        "that the global batch is the same",
        "fsdp_strategy/strategy_data.py",
        "    if taken + rest == before and later == before:",
        "    if True:",
        ("tests/test_resume_loaders.py",),
    ),
    Mutation(
        "epoch_start_take_back_said",
        "a checkpoint at an epoch's end resumed by a fit it does not fit warns that the epoch is taken again "
        "(nothing was skipped)",
        "fsdp_strategy/strategy_data.py",
        "        skipped = any(position is not None and position.sampler.skip > 0 for position in self.loaders)",
        "        skipped = self.resumed_epoch >= 0",
        ("tests/test_resume_loaders.py",),
    ),
    Mutation(
        "cut_loaders_positioned",
        "a fit whose limit_train_batches cuts one of several training dataloaders saves positions a resume "
        "cannot honour, without a word",
        "fsdp_strategy/strategy_data.py",
        "    cut = len(loaders) > 1 and any(",
        "    cut = False and any(",
        ("tests/test_resume_loaders.py",),
    ),
    Mutation(
        "resumed_skip_rounded_to_batches",
        "a Trainer resume at another global batch saves its position in whole batches of its own (samples skipped "
        "at the next resume)",
        "fsdp_strategy/data.py",
        "        return min(skipped + batches * step, len(sampler.dataset))",
        "        return min(self.batches(0) - first + batches, self.batches()) * step",
        ("tests/test_resume_stops.py::test_a_fit_stopped_off_the_checkpoint_grid_resumes_sample_by_sample",),
    ),
    Mutation(
        "fabric_rollback_position_stale",
        "a Fabric loop that loads a checkpoint in the middle of an epoch and saves at once saves where it was, "
        "not where it went back to",
        "fsdp_strategy/fabric_data.py",
        "        if self._resume is not None:  # loaded, not iterated since\n",
        "        if False:\n",
        ("tests/test_fabric_data_position.py::test_a_fabric_loop_resumes_its_dataloader_where_the_checkpoint_left_it",),
    ),
    Mutation(
        "resume_pads_before_cut",
        "a resume at another world size pads the epoch for the new world before skipping what was taken (samples "
        "already taken come again)",
        "fsdp_strategy/data.py",
        "        rest = self.dealt(order[start:], order)\n",
        "        rest = self.dealt(order, order)[start:]\n        rest += rest[: (-len(rest)) % self.num_replicas]\n",
        ("tests/test_resumable_sampler.py",),
    ),
    Mutation(
        "replaced_param_overwritten",
        "a parameter replaced after sharding (a tensor-parallel plan applied late, a new nn.Parameter) is "
        "overwritten by the engine's own at the next gather and silently dropped",
        "fsdp_strategy/engine/param.py",
        "        if current is self.sharded or current is self.unsharded:\n",
        "        if True:\n",
        ("tests/test_tensor_parallel.py::test_what_breaks_two_dimensional_training_in_use_is_named",),
    ),
    Mutation(
        "tp_double_backward_allowed",
        "a double backward (create_graph=True) of a model with tensor-parallel parameters runs into torch's failure",
        "fsdp_strategy/engine/runtime.py",
        "            if torch.is_grad_enabled() and self.tensor_parallel:\n",
        "            if False:\n",
        ("tests/test_tensor_parallel.py::test_what_breaks_two_dimensional_training_in_use_is_named",),
    ),
    Mutation(
        "tp_compiled_input_in_flight",
        "a compiled unit gets a tensor-parallel module's output still in flight (torch then passes it no gradient)",
        "fsdp_strategy/engine/iteration.py",
        "        return tuple(x.wait() if isinstance(x, AsyncCollectiveTensor) else x for x in inputs)\n",
        "        return inputs\n",
        ("tests/test_tensor_parallel.py::test_two_dimensional_training_equals_one_process",),
    ),
    Mutation(
        "tp_collectives_summed_across_steps",
        "tensor parallel's own collectives are reported summed since the start, not per optimizer step",
        "fsdp_strategy/engine/ledger.py",
        "        self.tensor_parallel = defaultdict(KindTotals)\n",
        "        pass\n",
        ("tests/test_tensor_parallel.py::test_the_trainer_trains_modelparallelstrategys_user_code_as_one_process",),
    ),
    Mutation(
        "tp_checkpoint_unstrided",
        "a colwise (TP Shard(0)) shard is written as (Shard(0), Shard(0)): its rows land in another rank's block",
        "fsdp_strategy/engine/tensor_parallel.py",
        "    return _StridedShard(0, split_factor=tp.size) if 0 in dims and tp.size > 1 and data_first else Shard(0)\n",
        "    return Shard(0)\n",
        (
            "tests/test_tensor_parallel_checkpoints.py::"
            "test_a_two_d_sharded_folder_holds_fsdp2s_chunks_and_loads_into_other_layouts",
        ),
    ),
    Mutation(
        "tp_full_load_no_block",
        "a full checkpoint loads into a tensor-parallel parameter from the whole tensor's rows, not its TP block's",
        "fsdp_strategy/engine/param.py",
        "        return self.local_rows(full if self.tp is None else self.tp.block_of(full), self.shard_rank)\n",
        "        return self.local_rows(full, self.shard_rank)\n",
        (
            "tests/test_tensor_parallel_checkpoints.py::"
            "test_a_two_d_sharded_folder_holds_fsdp2s_chunks_and_loads_into_other_layouts",
        ),
    ),
    Mutation(
        "untiled_chunks_accepted",
        "overlapping chunks of a folder are not noticed (a block read twice, another left unread)",
        "fsdp_strategy/checkpoint/chunks.py",
        '                return f"its chunks at offsets {list(other[0])} and {list(box[0])} overlap"\n',
        "                pass\n",
        (
            "tests/test_tensor_parallel_checkpoints.py::"
            "test_a_folder_whose_chunks_do_not_tile_a_tensor_is_refused_before_anything_loads",
        ),
    ),
    Mutation(
        "two_d_folder_fsdp_key",
        "a 2-D folder keeps the model under FSDPStrategy's 'model' key: ModelParallelStrategy cannot resume it",
        "fsdp_strategy/checkpoint/sharded.py",
        '    return "state_dict" if view.tensor_parallel_size > 1 else "model"\n',
        '    return "model"\n',
        (
            "tests/test_tensor_parallel_checkpoints.py::"
            "test_the_trainer_resumes_a_two_d_run_in_other_layouts_and_with_model_parallel_strategy",
        ),
    ),
    Mutation(
        "plan_dtensor_caches_kept",
        "a plan leaves DTensor's sharding caches keyed to its fake world (a later 2-D job's collectives fail)",
        "fsdp_strategy/plan/world.py",
        "        _forget_fake_meshes()\n",
        "        pass\n",
        ("tests/test_plan_tensor_parallel.py::test_a_plan_then_a_two_d_run_in_the_same_process_family",),
    ),
    Mutation(
        "plan_dtensor_stand_ins_counted",
        "a plan counts DTensor's global-shape stand-ins of its sharding propagation as live memory",
        "fsdp_strategy/plan/tracker.py",
        "        if SHADOWS.depth:\n            return func(*args, **(kwargs or {}))\n",
        "",
        ("tests/test_plan_tensor_parallel.py::test_no_rank_holds_a_whole_tensor_parallel_parameter_in_a_plan",),
    ),
    Mutation(
        "plan_fake_views_as_replaced",
        "a plan's engine takes the fake view of a gathered tensor-parallel parameter for replaced .data",
        "fsdp_strategy/engine/param.py",
        "        return isinstance(local, FakeTensor) and _same_view(local, self._full)\n",
        "        return False\n",
        ("tests/test_plan_tensor_parallel.py::test_a_plan_then_a_two_d_run_in_the_same_process_family",),
    ),
    Mutation(
        "edits_foreach_copy_skipped",
        "a unit's edits made while gathered (its own forward, training_step) are not written back into its shards",
        "fsdp_strategy/engine/edits.py",
        "                torch._foreach_copy_(targets, rows)\n",
        "                pass\n",
        ("tests/test_weight_edits.py::test_weights_changed_in_the_step_match_one_device",),
    ),
    Mutation(
        "unpadded_grad_rows_swapped",
        "an unpadded gradient enters its reduce buffer with the ranks' rows swapped (each rank reduces another's rows)",
        "fsdp_strategy/engine/param.py",
        "            out.copy_(real_view(grad.detach()).reshape(out.shape))\n",
        "            out.copy_(real_view(grad.detach()).reshape(out.shape).flip(0))\n",
        ("tests/test_parity.py::test_parity_world_2",),
    ),
    Mutation(
        "host_times_not_clocked",
        "host_times() records no time for the engine's ranges (the unit-cost benchmark reads zeros)",
        "fsdp_strategy/engine/trace.py",
        "            _host_seconds[self.name] += time.perf_counter() - self.start\n",
        "            _host_seconds[self.name] += 0.0\n",
        ("tests/test_comm_schedule.py::test_schedule_counts_bytes_and_memory",),
    ),
    Mutation(
        "prefetch_across_user_code",
        "a unit prefetches the next one across training_step's code (a WGAN's .data clamp unseen by its forward)",
        "fsdp_strategy/engine/order.py",
        "    return bool(unit.parent) and unit.parent == target.parent\n",
        "    return True\n",
        ("tests/test_weight_edits.py::test_weights_changed_in_the_step_match_one_device",),
    ),
    Mutation(
        "edits_lost_before_a_refused_one",
        "new .data of the parameters before one refused for its shape is dropped from their shards",
        "fsdp_strategy/engine/edits.py",
        "    finally:  # also when a later parameter's new ``.data`` is refused: the ones before it are kept\n",
        "    except BaseException:\n        targets = []\n        raise\n    finally:\n",
        ("tests/test_weight_edits.py::test_new_data_of_the_wrong_shape_is_an_error_and_the_others_are_kept",),
    ),
    Mutation(
        "aliased_new_data_dropped",
        "with a shard group of one (NO_SHARD, one device), new .data given while gathered is dropped",
        "fsdp_strategy/engine/unit.py",
        "        if self.state is not ShardedState.UNSHARDED:\n            return\n        # [Note: aliased shards]",
        "        if self.state is not ShardedState.UNSHARDED or self._aliased:\n"
        "            return\n        # [Note: aliased shards]",
        ("tests/test_weight_edits.py::test_new_data_given_while_gathered_is_kept_with_and_without_sharding",),
    ),
    Mutation(
        "complex_rows_at_an_odd_stride",
        "a gathered complex parameter is viewed in place even where its pairs start at an odd offset or row stride",
        "fsdp_strategy/engine/flat.py",
        " or any(stride % 2 for stride in flat.stride()[:-1]):",
        ":",
        ("tests/test_complex_tensors.py::test_complex_parameters_and_buffers_train_as_one_process",),
    ),
    Mutation(
        "complex_rows_viewed_in_place",
        "a checkpoint's gathered complex rows are viewed as complex in place (NO_SHARD: pairs at an odd offset fail)",
        "fsdp_strategy/engine/unit.py",
        "rows = [complex_from_real(c, d) if d.is_complex",
        "rows = [c.contiguous().view(d) if d.is_complex",
        ("tests/test_complex_tensors.py::test_complex_parameters_and_buffers_train_as_one_process",),
    ),
    Mutation(
        "summon_writes_back_unit_by_unit",
        "summon_full_params(writeback=True) writes each unit back as it frees it (a swap between units crashes)",
        "fsdp_strategy/engine/summon.py",
        "                    unit.keep_edits(every_param=True)\n"
        "        finally:  # also when one is refused: no unit stays pinned\n"
        "            for unit in scheduler.units:\n                unit.unpin(keep_edits=False)",
        "                    pass\n        finally:\n            for unit in scheduler.units:\n"
        "                unit.unpin(keep_edits=writeback)",
        ("tests/test_weight_edits.py::test_new_data_given_while_gathered_is_kept_with_and_without_sharding",),
    ),
    Mutation(
        "float8_in_the_reduce_promotion",
        "a unit's default reduce dtype promotes float8 parameters too (torch refuses: a frozen fp8 base fails)",
        "fsdp_strategy/engine/unit.py",
        "if not (d.is_floating_point and d.itemsize == 1)]",
        "]",
        ("tests/test_patterns.py::test_patterns_world_2",),
    ),
    Mutation(
        "meta_init_data_writes_unseen",
        "a non-floating tensor written through .data in reset_parameters() is taken for uninitialized",
        "fsdp_strategy/engine/init.py",
        "    return bool((tensor.detach().reshape(-1).contiguous().view(torch.uint8) == UNWRITTEN_BYTE).all())",
        "    return True",
        ("tests/test_meta_init.py::test_integer_and_bool_tensors_written_through_data_are_initialized",),
    ),
    Mutation(
        "meta_complex_imaginary_not_marked",
        "a complex tensor from the meta device is NaN in its real part only (a half-written one passes)",
        "fsdp_strategy/engine/init.py",
        'complex(float("nan"), float("nan")) if fresh.is_complex() else float("nan")',
        'float("nan")',
        ("tests/test_meta_init.py::test_meta_init_refuses_half_written_complex_and_leaves_no_invalid_bool",),
    ),
    Mutation(
        "meta_bools_left_invalid",
        "a bool tensor written in part keeps bytes no bool may hold",
        "fsdp_strategy/engine/init.py",
        "data.masked_fill_(data == UNWRITTEN_BYTE, 0)",
        "data.add_(0)",
        ("tests/test_meta_init.py::test_meta_init_refuses_half_written_complex_and_leaves_no_invalid_bool",),
    ),
    Mutation(
        "meta_empty_integer_refused",
        "an empty integer buffer from the meta device is taken for uninitialized",
        "fsdp_strategy/engine/init.py",
        " or not tensor.numel():  # empty",
        ":  # empty",
        ("tests/test_meta_init.py::test_meta_init_refuses_half_written_complex_and_leaves_no_invalid_bool",),
    ),
    Mutation(
        "refused_edit_leaves_unit_gathered",
        "a refused edit at reshard leaves the unit gathered, the refused full parameter in the module",
        "fsdp_strategy/engine/unit.py",
        "        finally:  # also when an edit is refused: the module gets its shards back, not the refused data\n",
        "        except BaseException:\n            raise\n        if True:\n",
        ("tests/test_weight_edits.py::test_new_data_of_the_wrong_shape_is_an_error_and_the_others_are_kept",),
    ),
    Mutation(
        "shard_hooks_not_shared",
        "gradient hooks registered on a shard between steps are not shared with its full parameter (never fire)",
        "fsdp_strategy/engine/param_hooks.py",
        "            )\n        unsharded._backward_hooks = hooks",
        "            )\n        pass",
        (
            "tests/test_param_hooks.py::test_gradient_hooks_run_on_the_full_gradient_and_post_accumulate_hooks_on_the_reduced_shard",
        ),
    ),
    Mutation(
        "original_hooks_dropped_at_sharding",
        "the original parameter's gradient hooks are dropped when the model is sharded",
        "fsdp_strategy/engine/param_hooks.py",
        "    if hooks:\n        sharded._backward_hooks = hooks",
        "    if False:\n        sharded._backward_hooks = hooks",
        (
            "tests/test_param_hooks.py::test_gradient_hooks_run_on_the_full_gradient_and_post_accumulate_hooks_on_the_reduced_shard",
        ),
    ),
    Mutation(
        "max_norm_embedding_accepted",
        "an embedding with max_norm is sharded (rows renormalized on another rank are lost)",
        "fsdp_strategy/engine/unsupported.py",
        "if sub.max_norm is not None and shard_size > 1:",
        "if sub.max_norm is not None and shard_size > 1 and False:",
        (
            "tests/test_param_hooks.py::test_gradient_hooks_run_on_the_full_gradient_and_post_accumulate_hooks_on_the_reduced_shard",
        ),
    ),
    Mutation(
        "hooks_shared_outside_backward_only",
        "gradient hooks registered on a shard during a step (after its unit's forward) are shared a step late",
        "fsdp_strategy/engine/unit.py",
        "        share_grad_hooks(self.params)  # [Note: gradient hooks on parameters]",
        "        if torch._C._current_graph_task_id() == -1:\n            share_grad_hooks(self.params)",
        (
            "tests/test_param_hooks.py::test_gradient_hooks_run_on_the_full_gradient_and_post_accumulate_hooks_on_the_reduced_shard",
        ),
    ),
    Mutation(
        "post_accumulate_hooks_not_run",
        "a shard's post-accumulate-grad hooks are not run after its reduced gradient is applied (never fire)",
        "fsdp_strategy/engine/buffers.py",
        "                run_post_accumulate_hooks(param.sharded, spec.device_layer)",
        "                pass",
        (
            "tests/test_param_hooks.py::test_gradient_hooks_run_on_the_full_gradient_and_post_accumulate_hooks_on_the_reduced_shard",
        ),
    ),
    Mutation(
        "clip_norm_zero_on_the_host",
        "clipping's norm of no gradients is a zero made on the host (copied to the GPU: a host wait per step)",
        "fsdp_strategy/engine/clipping.py",
        "        return torch.zeros((), dtype=torch.float32, device=device)",
        "        return torch.zeros((), dtype=torch.float32)",
        ("tests/test_host_reads.py::test_a_steady_state_step_reads_nothing_on_the_host",),
    ),
    Mutation(
        "host_state_left_for_the_step",
        "every host tensor of an owner's state stays on the host for its step (a 0-dim one loaded under CPU "
        "offload meets CUDA gradients there)",
        "fsdp_strategy/engine/state_layout.py",
        '    if key == "step" and value.device.type == "cpu":',
        '    if value.device.type == "cpu":',
        ("tests/test_whole_matrix.py::test_state_placed_for_an_owner_step_follows_torchs_own_rule",),
    ),
    Mutation(
        "clip_norm_order_unchecked",
        "clipping by a norm order the shards cannot add up (-inf, 0, negative) is computed anyway (-inf: 1.0)",
        "fsdp_strategy/engine/clipping.py",
        "    if not norm_type > 0:  # NaN too",
        "    if False:",
        ("tests/test_misuse.py::test_clipping_by_a_norm_the_shards_cannot_add_up_is_refused_before_any_change",),
    ),
    Mutation(
        "nonfinite_norm_unchecked",
        "clipping with error_if_nonfinite=True clips by a non-finite norm (the gradients become NaN) without an error",
        "fsdp_strategy/engine/clipping.py",
        "    if error_if_nonfinite and not torch.isfinite(total):",
        "    if False:",
        ("tests/test_misuse.py::test_clipping_by_a_norm_the_shards_cannot_add_up_is_refused_before_any_change",),
    ),
    Mutation(
        "host_values_copied_blocking",
        "a value made on the host goes to the device with a blocking copy (param group digests: a host wait per step)",
        "fsdp_strategy/engine/device.py",
        "        return staged.to(device, non_blocking=True)",
        "        return staged.to(device)",
        ("tests/test_host_reads.py::test_a_steady_state_step_reads_nothing_on_the_host",),
    ),
]


def installed_copy(folder: Path) -> Path:
    """The package in its installed layout under ``folder``."""
    shutil.copytree(ROOT / "fsdp_strategy", folder / "fsdp_strategy", ignore=shutil.ignore_patterns("__pycache__"))
    return folder


def copy_path(mutation: Mutation) -> Path:
    """Where ``mutation.path`` lies in an installed copy (the checkout's layout is the installed one)."""
    return Path(mutation.path)


def check_applies(mutation: Mutation) -> str | None:
    """None if ``mutation.old`` is found exactly once in the checkout's file, else why not."""
    count = (ROOT / mutation.path).read_text().count(mutation.old)
    return None if count == 1 else f"{mutation.name}: its text is found {count} times in {mutation.path}"


def run_tests(package: Path, tests: tuple[str, ...], log: Path) -> bool:
    """Whether ``tests`` pass against the package copy in ``package`` (their output goes to ``log``)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(package), os.environ.get("PYTHONPATH", "")])}
    # from the copy's folder: ``python -m`` puts the working directory first on sys.path, which must
    # not be the checkout (its fsdp_strategy would shadow the copy)
    command = [sys.executable, "-m", "pytest", "-x", "-p", "no:cacheprovider", *(str(ROOT / t) for t in tests)]
    with log.open("w") as output:
        done = subprocess.run(command, cwd=package, env=env, stdout=output, stderr=subprocess.STDOUT, timeout=1800)
    if "fsdp_strategy: " + str(package) not in log.read_text():  # conftest.py's header names the copy tested
        raise RuntimeError(f"the tests did not import the package copy in {package}: see {log}")
    return done.returncode == 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="mutations to run (default: all)")
    parser.add_argument("--list", action="store_true", help="print each mutation and the tests that catch it")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTATIONS if not args.names or m.name in args.names]
    unknown = sorted(set(args.names) - {m.name for m in MUTATIONS})
    if unknown:
        parser.error(f"no mutation named {unknown}; known: {[m.name for m in MUTATIONS]}")
    if args.list:
        for m in chosen:
            print(f"{m.name}: {m.what}\n    {m.path}; caught by {', '.join(m.tests)}")
        return 0
    stale = [problem for problem in map(check_applies, chosen) if problem]
    if stale:
        print("mutations that no longer apply (update tests/mutations.py):\n  " + "\n  ".join(stale))
        return 1
    with tempfile.TemporaryDirectory(prefix="fsdp-mutations-") as scratch:
        scratch_path = Path(scratch)
        baseline = installed_copy(scratch_path / "baseline")
        tests = tuple(dict.fromkeys(test for m in chosen for test in m.tests))
        start = time.monotonic()
        if not run_tests(baseline, tests, scratch_path / "baseline.log"):
            print("the tests fail without any mutation:\n" + (scratch_path / "baseline.log").read_text()[-4000:])
            return 1
        print(f"baseline: {len(tests)} tests pass on an unchanged copy ({time.monotonic() - start:.0f} s)")
        survivors = []
        for m in chosen:
            package = installed_copy(scratch_path / m.name)
            target = package / copy_path(m)
            target.write_text(target.read_text().replace(m.old, m.new, 1))
            start = time.monotonic()
            caught = not run_tests(package, m.tests, scratch_path / f"{m.name}.log")
            print(f"{'caught  ' if caught else 'SURVIVED'} {m.name} ({time.monotonic() - start:.0f} s): {m.what}")
            if not caught:
                survivors.append(m.name)
            shutil.rmtree(package)
    if survivors:
        print(f"{len(survivors)} of {len(chosen)} mutations survived: {survivors}")
        return 1
    print(f"all {len(chosen)} mutations caught")
    return 0


if __name__ == "__main__":
    sys.exit(main())
