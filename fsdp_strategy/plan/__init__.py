"""Will it fit? The memory plan of a training step at any world size, and settings chosen by a budget.

    plan = fsdp_strategy.plan(model, torch.zeros(8, 1024, dtype=torch.long), world_size=64,
                              precision="bf16-mixed", auto_wrap_policy={Block})
    print(plan)              # a table: parts of the per-rank peak, when it happens, bytes sent
    plan.peak_bytes          # int

``auto_wrap_policy="auto"`` with ``memory_budget=...`` chooses the units, activation
checkpointing per unit, the sharding strategy and CPU offload: the fastest choice that fits
(see ``budget.py``). See [Note: memory plan] in ``run.py`` for how a plan is made.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from fsdp_strategy.options import check_auto_choices
from fsdp_strategy.plan.result import MemoryPlan, parse_bytes
from fsdp_strategy.plan.run import Planned, run
from fsdp_strategy.plan.tensor_parallel import TensorParallelPlan

__all__ = ["plan", "MemoryPlan", "parse_bytes"]


def plan(
    model: nn.Module,
    example_input: Any,
    *,
    world_size: int,
    num_nodes: int = 1,
    precision: str = "32-true",
    optimizer: Any = "adamw",
    memory_budget: Any = None,
    memory_reserve: Any = None,
    **strategy_kwargs: Any,
) -> MemoryPlan:
    """The per-rank memory of training ``model`` with ``FSDPCustomStrategy(**strategy_kwargs)`` on
    ``world_size`` ranks (``num_nodes`` nodes: HYBRID_SHARD shards within a node by default).

    ``model``: an ``nn.Module`` or a LightningModule (its ``configure_model`` is run; its
    ``training_step(example_input, 0)`` is the step), on any device, the meta device included;
    it is copied onto the meta device and not changed. ``example_input``: one batch (a tensor,
    or a tuple, list or dict of them; meta tensors allowed: only shapes and dtypes are read).
    ``optimizer``: "adamw", "adam", "sgd", an optimizer class or ``params -> optimizer``.
    ``auto_wrap_policy="auto"`` with ``memory_budget`` (bytes or "70GiB") returns the plan of
    the fastest settings that fit, with ``reasons``; a ValueError says what would fit if nothing does.
    The budget is planned less ``memory_reserve`` (bytes or "4GiB"; default: 2 GiB plus 5 % of the
    budget, for the CUDA context, NCCL's buffers and fragmentation, which no plan sees; 0: none).

    Costs: one CPU process, no model memory; a few seconds for small models, under a minute
    for a 70B Llama-shaped model (fake tensors: time grows with the number of operators).
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be a positive int (the number of ranks)")
    if isinstance(num_nodes, bool) or not isinstance(num_nodes, int) or num_nodes < 1 or world_size % num_nodes:
        raise ValueError(f"num_nodes={num_nodes!r} must be a positive int dividing world_size={world_size}")
    if "example_batch" in strategy_kwargs:
        raise ValueError(
            "plan() takes the batch as its second argument (example_input); example_batch is the strategies' "
            "argument for auto_wrap_policy='auto'"
        )
    parallel = TensorParallelPlan.take(strategy_kwargs, world_size, num_nodes)
    planned = Planned(world_size, num_nodes, precision, optimizer, strategy_kwargs, parallel)
    if strategy_kwargs.get("auto_wrap_policy") == "auto":
        from fsdp_strategy.plan.budget import choose

        check_auto_choices(strategy_kwargs)
        if memory_budget is None:
            raise ValueError("auto_wrap_policy='auto' needs memory_budget (bytes per rank, e.g. '70GiB')")
        reserve = None if memory_reserve is None else parse_bytes(memory_reserve, "memory_reserve", zero=True)
        return choose(model, example_input, planned, parse_bytes(memory_budget), reserve)
    if memory_budget is not None or memory_reserve is not None:
        raise ValueError(
            "memory_budget and memory_reserve are read with auto_wrap_policy='auto' only; plan() reports the peak "
            "itself"
        )
    return run(model, example_input, planned)
