"""Settings chosen by a memory budget: the fastest that fits ([Note: wrapping by budget]).

[Note: wrapping by budget]
The choices are the units (the root alone, or one unit per instance of the model's repeated
block class: the class whose instances hold the most parameters), activation checkpointing of
the first k of those blocks (k = 0, L/4, L/2, 3L/4, L), SHARD_GRAD_OP or FULL_SHARD, and CPU
offload. Each candidate gets an estimated step time from nominal hardware rates (below): the
step's FLOPs (measured once by the baseline plan) plus the forward of the recomputed blocks,
the bytes each rank sends (a second gather per step under FULL_SHARD), the host copies and the
CPU optimizer step of offload, and a fixed latency per collective. Candidates are planned in
that order, fastest first, and the first whose peak fits is chosen; a candidate at least as
heavy in every choice as one that did not fit is skipped without planning (memory only grows
with coarser units, SHARD_GRAD_OP and no offload). Not with fewer recomputed blocks: recomputing
the last block saves nothing (its backward runs right after the forward) and adds its
recomputation, so k = L can peak above k = 3L/4. So the lightest settings at each k (per-block
units, FULL_SHARD, offload) are planned first, those over the budget rule out every candidate at
their k, and candidates are compared only at equal k. When nothing fits, the lightest of them
gives the smallest budget that would fit, and doubling the world size finds the smallest world
(up to 64 times larger) at which it fits.

[Note: memory reserve]
A plan counts the tensors of a training step; a GPU also holds what no plan sees: the CUDA context
and cuBLAS/cuDNN workspaces (0.5-1 GiB on an H100), NCCL's buffers (a few MiB per channel and peer,
0.5-1 GiB at scale) and the caching allocator's fragmentation (a few percent of what it holds). So
a budget is planned less a reserve: by default ``RESERVE_FIXED`` (2 GiB, or a tenth of a budget under
20 GiB) plus ``RESERVE_FRACTION`` (5 %) of the budget: 5.73 GiB of an 80 GB card's 74.51 GiB.
``memory_reserve`` (plan(), the strategy; ``--reserve`` on fsdp-plan) sets it in bytes, 0 for none.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter
from typing import Any, NamedTuple

from torch import nn

from fsdp_strategy.config import ShardingStrategy
from fsdp_strategy.engine.diagnosis import plural
from fsdp_strategy.plan.copies import meta_copy
from fsdp_strategy.plan.result import MemoryPlan, _size
from fsdp_strategy.plan.run import Planned, run
from fsdp_strategy.wrap import ModuleNames

FLOPS_PER_SECOND = {"32": 60e12, "16": 400e12, "bf16": 400e12}  # nominal dense rates (H100-class, TF32 for fp32)
NETWORK_BYTES_PER_SECOND = 100e9  # what one rank sends per second in a ring collective
HOST_BYTES_PER_SECOND = 25e9  # PCIe, each way
HOST_ADAM_BYTES_PER_SECOND = 20e9  # a CPU optimizer step streams parameters, gradients and two states
LATENCY_PER_COLLECTIVE = 30e-6
RESERVE_FIXED = 2 << 30  # [Note: memory reserve]: CUDA context and workspaces, NCCL's buffers
RESERVE_FRACTION = 0.05  # [Note: memory reserve]: the caching allocator's fragmentation


class Candidate(NamedTuple):
    """One choice: unit boundaries, checkpointed blocks, sharding, offload."""

    per_block: bool
    checkpointed: int
    sharding: str
    offload: bool

    def heavier_or_equal(self, other: Candidate) -> bool:
        """Whether this choice holds at least as much memory as ``other`` in every dimension."""
        return (
            (not self.per_block) >= (not other.per_block)
            and self.checkpointed == other.checkpointed
            and (self.sharding == "SHARD_GRAD_OP") >= (other.sharding == "SHARD_GRAD_OP")
            and (not self.offload) >= (not other.offload)
        )


def block_class(model: nn.Module) -> tuple[type[nn.Module], list[str]]:
    """The repeated block class (most parameters over its instances, at least two of them) and
    the qualified names of its instances in module order; a clear error if the model has none."""
    counts: Counter = Counter()
    params: Counter = Counter()
    for module in model.modules():
        if list(module.children()) and not isinstance(module, (nn.ModuleList, nn.ModuleDict, nn.Sequential)):
            counts[type(module)] += 1
            params[type(module)] += sum(p.numel() for p in module.parameters())
    repeated = [cls for cls, n in counts.items() if n >= 2]
    if not repeated:
        raise ValueError(
            f"auto_wrap_policy='auto' looks for a block class repeated in the model (a transformer layer); "
            f"{type(model).__name__} has none. Give auto_wrap_policy (e.g. a set of module classes) instead"
        )
    chosen = max(repeated, key=lambda cls: params[cls])
    return chosen, [name for name, module in model.named_modules() if type(module) is chosen]


def _candidates(blocks: int, shardings: list[str]) -> list[Candidate]:
    """Every setting tried: one unit, or one per block with 0, 1/4, 1/2, 3/4 or all blocks
    recomputed; each sharding strategy allowed; with and without CPU offload."""
    steps = sorted({0, blocks // 4, blocks // 2, 3 * blocks // 4, blocks})
    return [
        Candidate(per_block, k, sharding, offload)
        for per_block in (False, True)
        for k in (steps if per_block else [0])
        for sharding in shardings
        for offload in (False, True)
    ]


def reserve_of(budget: int, reserve: int | None) -> int:
    """The bytes of ``budget`` left unplanned ([Note: memory reserve]): ``reserve``, or by default a
    fixed part (a tenth of a budget under 20 GiB) plus ``RESERVE_FRACTION`` of the budget."""
    if reserve is not None:
        if reserve >= budget:
            raise ValueError(f"memory_reserve={_size(reserve)} leaves nothing of memory_budget={_size(budget)}")
        return reserve
    return min(RESERVE_FIXED, budget // 10) + int(RESERVE_FRACTION * budget)


def budget_with(peak: int, reserve: int | None) -> int:
    """The smallest budget whose planned part (``reserve_of``) holds ``peak``."""
    if reserve is not None:
        return peak + reserve
    large = int((peak + RESERVE_FIXED) / (1 - RESERVE_FRACTION)) + 1
    return large if large // 10 >= RESERVE_FIXED else int(peak / (1 - RESERVE_FRACTION - 0.1)) + 1


def choose(
    model: nn.Module, example_input: Any, planned: Planned, budget: int, reserve: int | None = None
) -> MemoryPlan:
    """The plan of the fastest candidate whose peak fits ``budget`` bytes per rank less a reserve
    ([Note: memory reserve]), with reasons; a ValueError naming the smallest budget and world size
    that would fit when none does."""
    set_aside = reserve_of(budget, reserve)
    usable = budget - set_aside
    blocks_of, names = block_class(meta_copy(model))
    fixed = {key: value for key, value in planned.strategy_kwargs.items() if key not in _CHOSEN}
    given = ShardingStrategy.from_any(planned.strategy_kwargs.get("sharding_strategy", "FULL_SHARD"))
    kept = given.hybrid or given is ShardingStrategy.NO_SHARD  # chosen by the mesh or the user, not the budget
    shardings = [given.value] if kept else ["SHARD_GRAD_OP", "FULL_SHARD"]
    candidates = _candidates(len(names), shardings)

    def kwargs_of(candidate: Candidate) -> dict[str, Any]:
        chosen = {"sharding_strategy": candidate.sharding, "cpu_offload": candidate.offload}
        chosen["auto_wrap_policy"] = {blocks_of} if candidate.per_block else None
        if candidate.checkpointed:
            chosen["activation_checkpointing_policy"] = ModuleNames(names[: candidate.checkpointed])
        return {**fixed, **chosen}

    def plan_of(candidate: Candidate, world_size: int | None = None) -> MemoryPlan:
        at = dataclasses.replace(planned, strategy_kwargs=kwargs_of(candidate))
        if world_size is not None:
            at = dataclasses.replace(at, world_size=world_size)
        return run(model, example_input, at)

    light = {c: plan_of(c) for c in candidates if c.per_block and c.sharding == shardings[-1] and c.offload}
    lightest = min(light, key=lambda c: light[c].peak_bytes)  # over k: not always every block recomputed
    if light[lightest].peak_bytes > usable:
        described = _describe(lightest, blocks_of, len(names))
        at_world = functools.partial(plan_of, lightest)
        raise ValueError(_nothing_fits(budget, usable, reserve, light[lightest], described, at_world, planned))
    baseline = light[Candidate(True, len(names), shardings[-1], True)]  # its FLOPs: every block recomputed
    estimate = _Estimate(baseline, planned, len(names))

    def line_of(candidate: Candidate, result: MemoryPlan) -> str:
        return f"{_describe(candidate, blocks_of, len(names))}: {_size(result.peak_bytes)}"

    failed = [c for c in light if light[c].peak_bytes > usable]  # everything heavier at their k is skipped
    tried = [f"{line_of(c, light[c])} (over)" for c in failed]
    for candidate in sorted(candidates, key=estimate.seconds):
        if any(candidate.heavier_or_equal(other) for other in failed):
            continue
        result = light[candidate] if candidate in light else plan_of(candidate)
        line = line_of(candidate, result)
        if result.peak_bytes > usable:
            failed.append(candidate)
            tried.append(f"{line} (over)")
            continue
        reasons = [
            f"budget {_size(budget)} per rank, {_size(usable)} planned ({_size(set_aside)} memory_reserve: the CUDA "
            "context, NCCL, fragmentation)",
            "the lightest settings at each number of recomputed blocks, then the fastest first (estimated step time):",
        ]
        reasons += [f"  {entry}" for entry in tried]
        reasons.append(f"  {line}: fits, chosen")
        return dataclasses.replace(result, reasons=reasons, strategy_kwargs=kwargs_of(candidate))
    raise AssertionError("the lightest candidate fits, so one candidate fits")


_CHOSEN = ("auto_wrap_policy", "activation_checkpointing_policy", "activation_checkpointing", "cpu_offload")


class _Estimate:
    """Estimated step seconds of a candidate from nominal rates ([Note: wrapping by budget])."""

    def __init__(self, baseline: MemoryPlan, planned: Planned, blocks: int) -> None:
        low = planned.precision.split("-")[0]
        self.rate = FLOPS_PER_SECOND.get(low, FLOPS_PER_SECOND["32"])
        forward = baseline.flops_per_step / 4  # forward + backward (2x) + every block's forward again
        self.flops = 3 * forward
        self.block_forward = forward / max(blocks, 1)
        self.param_bytes = baseline.shard_bytes
        self.world = planned.world_size
        self.blocks = blocks

    def seconds(self, candidate: Candidate) -> float:
        compute = (self.flops + candidate.checkpointed * self.block_forward) / self.rate
        full = self.param_bytes * self.world  # the model's parameters, as one rank's shard times N
        ring = (self.world - 1) / max(self.world, 1)
        gathers = 2 if candidate.sharding in ("FULL_SHARD", "HYBRID_SHARD") else 1
        network = (gathers + 1) * full * ring / NETWORK_BYTES_PER_SECOND
        units = 1 + (self.blocks if candidate.per_block else 0)
        latency = 3 * units * LATENCY_PER_COLLECTIVE
        offload = 0.0
        if candidate.offload:
            offload = 3 * self.param_bytes / HOST_BYTES_PER_SECOND + 4 * self.param_bytes / HOST_ADAM_BYTES_PER_SECOND
        return compute + network + latency + offload


def _describe(candidate: Candidate, blocks_of: type, blocks: int) -> str:
    units = f"one unit per {blocks_of.__name__}" if candidate.per_block else "the whole model one unit"
    checkpointing = (
        f"{candidate.checkpointed} of {blocks} blocks recomputed" if candidate.checkpointed else "no recomputation"
    )
    offload = "CPU offload" if candidate.offload else "no offload"
    return f"{units}, {checkpointing}, {candidate.sharding}, {offload}"


def _nothing_fits(
    budget: int, usable: int, reserve: int | None, lightest: MemoryPlan, described: str, plan_at: Any, planned: Planned
) -> str:
    world = planned.world_size
    fits_at = None
    for factor in (2, 4, 8, 16, 32, 64):
        if plan_at(world * factor).peak_bytes <= usable:
            fits_at = world * factor
            break
    larger = f"it fits at {fits_at} ranks" if fits_at else f"it does not fit at {64 * world} ranks either"
    return (
        f"nothing fits memory_budget={_size(budget)} per rank at {plural(world, 'rank')} ({_size(usable)} planned, "
        f"the rest kept by memory_reserve): the lightest settings ({described}) peak at "
        f"{_size(lightest.peak_bytes)} per rank; the smallest budget that would fit is "
        f"{_size(budget_with(lightest.peak_bytes, reserve))}; {larger}. A smaller batch also lowers the peak"
    )
