"""The schedule, counted: collectives per step, their bytes, freed storage, memory at rest."""

from __future__ import annotations

import math

import torch
from dist_utils import run_ranks
from models import Block, TiedLM, lm_loss, make_batches
from torch import nn

from fsdp_strategy import MixedPrecision
from fsdp_strategy.engine import get_scheduler, shard_model
from fsdp_strategy.engine.unit import ShardedState


def _padded_numel(shape: torch.Size, world: int) -> int:
    """Elements of a parameter padded to ``world * ceil(dim0 / world)`` rows (the formula)."""
    dim0 = shape[0] if len(shape) else 1
    return world * math.ceil(dim0 / world) * math.prod(shape[1:])


def _calls(snapshot: dict, kind: str) -> int:
    return snapshot.get(kind, {}).get("calls", 0)


def _schedule_body(rank: int, world: int, strategy: str, param_dtype: torch.dtype | None) -> dict:
    torch.manual_seed(0)
    model = TiedLM()
    shapes = {name: p.shape for name, p in model.named_parameters()}
    trainable_names = {name for name, p in model.named_parameters() if p.requires_grad}
    precision = MixedPrecision(param_dtype=param_dtype, buffer_dtype=param_dtype)
    shard_model(model, sharding_strategy=strategy, auto_wrap_policy={Block, nn.Embedding}, mixed_precision=precision)
    scheduler = get_scheduler(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    batches = make_batches(3, 2 * world)
    seen_gathered: list[int] = []
    next_ready: list[bool] = []
    order = {id(u.module): i for i, u in enumerate(scheduler.units)}

    def observe(module, args):
        gathered = [u for u in scheduler.units if u.state is not ShardedState.SHARDED]
        seen_gathered.append(len(gathered))
        recorded = scheduler.forward_order
        index = next((i for i, u in enumerate(recorded) if id(u.module) == id(module)), None)
        if index is not None and index + 1 < len(recorded) and order[id(module)] != 0:
            next_ready.append(recorded[index + 1].state is not ShardedState.SHARDED)

    for unit in scheduler.units:
        unit.module.register_forward_pre_hook(observe)
    result = {}
    for step in range(3):
        scheduler.ledger.start_step()
        scheduler.memory.reset_peak()
        seen_gathered.clear()
        loss = lm_loss(model, batches[step][rank::world])
        result["forward"] = scheduler.ledger.snapshot()
        result["freed_after_forward"] = {
            unit.name: all(not p.unsharded_allocated for p in unit.params) for unit in scheduler.units
        }
        loss.backward()
        result["step"] = scheduler.ledger.snapshot()
        result["freed_after_backward"] = all(not p.unsharded_allocated for p in scheduler.sharded_params())
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    result["max_gathered"] = max(seen_gathered)
    result["memory"] = (scheduler.memory.current, scheduler.memory.peak)
    result["prefetched"] = next_ready
    unit_of = {p.fqn: unit.name for unit in scheduler.units for p in unit.params}
    ran = {"root", "blocks.0", "blocks.1"}
    result["unit_numel"] = {
        name: sum(_padded_numel(shapes[fqn], world) for fqn, u in unit_of.items() if u == name) for name in ran
    }
    result["unit_trainable_numel"] = {
        name: sum(
            _padded_numel(shapes[fqn], world) for fqn, u in unit_of.items() if u == name and fqn in trainable_names
        )
        for name in ran
    }
    params = [p.sharded for p in scheduler.sharded_params()]
    result["param_bytes"] = sum(p.numel() * p.element_size() for p in params)
    result["grad_bytes"] = sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
    result["optim_bytes"] = sum(
        v.numel() * v.element_size() for s in optimizer.state.values() for k, v in s.items() if k != "step"
    )
    result["expected_shard_bytes"] = sum(4 * _padded_numel(shape, world) // world for shape in shapes.values())
    result["expected_grad_bytes"] = sum(
        4 * _padded_numel(shapes[n], world) // world
        for n in trainable_names
        if not n.startswith("skipped.") and ".unused." not in n and n != "head.weight"
    )
    return result


def _all_bodies(rank: int, world: int) -> dict:
    return {
        "full": _schedule_body(rank, world, "FULL_SHARD", None),
        "grad_op": _schedule_body(rank, world, "SHARD_GRAD_OP", None),
        "bf16": _schedule_body(rank, world, "FULL_SHARD", torch.bfloat16),
    }


def test_schedule_counts_bytes_and_memory(tmp_path):
    world = 2
    result = run_ranks(_all_bodies, world, tmp_path)[0]
    units = 3  # root (embedding+head, frozen, scale), blocks.0, blocks.1 ran; "skipped" never runs

    full = result["full"]
    assert _calls(full["forward"], "all_gather") == units
    assert _calls(full["step"], "all_gather") == units + units - 1  # backward re-gathers all but the root
    assert _calls(full["step"], "reduce_scatter") == units
    assert _calls(full["step"], "all_reduce") == 0
    gather_bytes = sum(4 * n * (world - 1) // world for n in full["unit_numel"].values())
    scatter_bytes = sum(4 * n * (world - 1) // world for n in full["unit_trainable_numel"].values())
    assert full["forward"]["all_gather"]["wire_bytes"] == gather_bytes
    assert full["step"]["reduce_scatter"]["wire_bytes"] == scatter_bytes
    assert full["freed_after_forward"] == {
        "root": False,
        "embed": True,
        "blocks.0": True,
        "blocks.1": True,
        "skipped": True,
    }
    assert full["freed_after_backward"]
    # the engine's own account: nothing gathered between steps; in a step, all 3 units at once at
    # most (the root, the running block and the prefetched one)
    assert full["memory"] == (0, sum(4 * n for n in full["unit_numel"].values()))
    assert full["max_gathered"] <= 3  # the running unit, the root and one prefetched unit
    assert full["prefetched"] and all(full["prefetched"])  # from the second step on, the next unit is in flight

    # at rest: 1/N of every parameter plus padding; gradients and Adam's two moments alike
    assert full["param_bytes"] == full["expected_shard_bytes"]
    assert full["grad_bytes"] == full["expected_grad_bytes"]
    assert full["optim_bytes"] == 2 * full["expected_grad_bytes"]

    grad_op = result["grad_op"]
    assert _calls(grad_op["step"], "all_gather") == units
    assert _calls(grad_op["step"], "reduce_scatter") == units
    assert grad_op["freed_after_forward"]["blocks.0"] is False
    assert grad_op["freed_after_backward"]

    bf16 = result["bf16"]
    assert bf16["forward"]["all_gather"]["wire_bytes"] == gather_bytes // 2  # gathered in bf16
    assert bf16["step"]["reduce_scatter"]["wire_bytes"] == scatter_bytes  # reduced in fp32
