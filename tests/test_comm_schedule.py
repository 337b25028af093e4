"""The schedule, counted: collectives per step, their bytes, prefetching, and the memory that
gathering and reducing hold, measured from the storages themselves and compared with the
engine's own account."""

from __future__ import annotations

import math
import time

import torch
from dist_utils import run_ranks
from models import Block, TiedLM, lm_loss, make_batches
from pattern_models import DIM, VOCAB, Critic, InsideForward, LoRABlock, LoRAModel, MLPBlock, Staged
from pattern_models import lm_loss as next_token_loss
from torch import nn

from fsdp_strategy import MixedPrecision
from fsdp_strategy.engine import get_scheduler, shard_model, trace
from fsdp_strategy.engine.flight import STAMP_SLOTS
from fsdp_strategy.engine.trace import PREFIX, host_times
from fsdp_strategy.engine.unit import ShardedState

HOOKS = ("pre_forward", "post_forward", "pre_backward", "post_backward", "end_of_backward")


def _padded_numel(shape: torch.Size, world: int) -> int:
    """Elements of a parameter padded to ``world * ceil(dim0 / world)`` rows (the formula)."""
    dim0 = shape[0] if len(shape) else 1
    return world * math.ceil(dim0 / world) * math.prod(shape[1:])


def _calls(snapshot: dict, kind: str) -> int:
    return snapshot.get(kind, {}).get("calls", 0)


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct live storages behind ``tensors`` (measured, not from the account)."""
    storages = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.nbytes():
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _engine_bytes(scheduler) -> int:
    """Every buffer the engine holds beyond the shards, read off the tensors."""
    tensors = [p._padded_full for p in scheduler.sharded_params() if not p.aliased]
    tensors += [p.stashed_grad for p in scheduler.sharded_params() if p.stashed_grad is not None]
    for unit in scheduler.units:
        if unit._gather is not None:
            tensors.append(unit._gather.gathered)
    tensors += scheduler.reductions.buffers()
    return _storage_bytes(tensors)


class Observer:
    """At every module call and every unit output's backward: gathered units (from storage) and
    engine bytes measured vs accounted."""

    def __init__(self, model: nn.Module) -> None:
        self.scheduler = get_scheduler(model)
        self.max_gathered = 0
        self.mismatches: list[tuple[int, int]] = []
        self.points = 0
        for module in model.modules():
            module.register_forward_pre_hook(lambda *_: self.observe())
            module.register_forward_hook(self._hook_outputs)

    def _hook_outputs(self, module, args, output) -> None:
        self.observe()
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(lambda grad: self.observe())

    def observe(self) -> None:
        self.points += 1
        gathered = [u for u in self.scheduler.units if any(p.unsharded_allocated for p in u.params if not p.aliased)]
        self.max_gathered = max(self.max_gathered, len(gathered))
        measured, accounted = _engine_bytes(self.scheduler), self.scheduler.memory.current
        if measured != accounted:
            self.mismatches.append((measured, accounted))


def _schedule_body(rank: int, world: int, strategy: str, param_dtype: torch.dtype | None) -> dict:
    torch.manual_seed(0)
    model = TiedLM()
    shapes = {name: p.shape for name, p in model.named_parameters()}
    trainable_names = {name for name, p in model.named_parameters() if p.requires_grad}
    precision = MixedPrecision(param_dtype=param_dtype, buffer_dtype=param_dtype)
    shard_model(model, sharding_strategy=strategy, auto_wrap_policy={Block, nn.Embedding}, mixed_precision=precision)
    scheduler = get_scheduler(model)
    observer = Observer(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    batches = make_batches(3, 2 * world)
    order = ["root", "blocks.0", "blocks.1"]
    units = {u.name: u for u in scheduler.units}
    next_ready: list[bool] = []
    for name, successor in zip(order[1:], order[2:]):  # when blocks.0 starts, blocks.1 is on its way
        units[name].module.register_forward_pre_hook(
            lambda *_, s=successor: next_ready.append(units[s].state is not ShardedState.SHARDED)
        )
    result = {}
    for step in range(3):
        scheduler.ledger.start_step()
        next_ready.clear()
        loss = lm_loss(model, batches[step][rank::world])
        result["forward"] = scheduler.ledger.snapshot()
        result["freed_after_forward"] = {
            unit.name: all(not p.unsharded_allocated for p in unit.params) for unit in scheduler.units
        }
        loss.backward()
        result["step"] = scheduler.ledger.snapshot()
        result["freed_after_backward"] = all(not p.unsharded_allocated for p in scheduler.sharded_params())
        result["prefetched"] = list(next_ready)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    result["max_gathered"] = observer.max_gathered
    result["mismatches"] = observer.mismatches
    result["memory_now"] = scheduler.memory.current
    unit_of = {p.fqn: unit.name for unit in scheduler.units for p in unit.params}
    result["unit_numel"] = {
        name: sum(_padded_numel(shapes[fqn], world) for fqn, u in unit_of.items() if u == name) for name in order
    }
    result["unit_trainable"] = {
        name: [_padded_numel(shapes[fqn], world) for fqn, u in unit_of.items() if u == name and fqn in trainable_names]
        for name in order
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


def _profiled_body(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = TiedLM()
    shard_model(model, auto_wrap_policy={Block, nn.Embedding})
    scheduler = get_scheduler(model)
    lm_loss(model, make_batches(1, 2 * world)[0][rank::world]).backward()  # the second step prefetches
    scheduler.ledger.start_step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        lm_loss(model, make_batches(1, 2 * world)[0][rank::world]).backward()
    spans = [(e.name, e.time_range.start, e.time_range.end) for e in profile.events() if e.name.startswith(PREFIX)]
    hooks = [(start, end) for name, start, end in spans if name.removeprefix(PREFIX) in HOOKS]
    counts: dict[str, int] = {}
    for name, _, _ in spans:
        counts[name.removeprefix(PREFIX)] = counts.get(name.removeprefix(PREFIX), 0) + 1
    ledger = scheduler.ledger.snapshot()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    start = time.perf_counter()
    with host_times() as seconds:  # the same ranges clocked without a profiler, an optimizer step included
        lm_loss(model, make_batches(1, 2 * world)[0][rank::world]).backward()
        optimizer.step()
    step_seconds = time.perf_counter() - start
    return {
        "host_seconds": dict(seconds),
        "step_seconds": step_seconds,
        "clock_off_after": trace._host_seconds is None,
        "counts": counts,
        "ledger": ledger,
        "inside_hooks": all(
            any(h0 <= start and end <= h1 for h0, h1 in hooks)
            for name, start, end in spans
            if name.removeprefix(PREFIX) not in HOOKS
        ),
    }


def _all_bodies(rank: int, world: int) -> dict:
    return {
        "full": _schedule_body(rank, world, "FULL_SHARD", None),
        "grad_op": _schedule_body(rank, world, "SHARD_GRAD_OP", None),
        "bf16": _schedule_body(rank, world, "FULL_SHARD", torch.bfloat16),
        "profiled": _profiled_body(rank, world),
    }


def test_schedule_counts_bytes_and_memory(tmp_path):
    world = 2
    result = run_ranks(_all_bodies, world, tmp_path)[0]
    # a profiler sees every gather's copies and every reduction inside the engine's hook ranges
    profiled, ledger = result["profiled"]["counts"], result["profiled"]["ledger"]
    assert profiled["gather_copy_in"] == profiled["gather_copy_out"] == _calls(ledger, "all_gather") > 0
    assert profiled["reduce_copy_in"] == profiled["reduce_apply"] == _calls(ledger, "reduce_scatter") > 0
    assert profiled["wait_all_gather"] == _calls(ledger, "all_gather")
    assert all(profiled.get(hook, 0) > 0 for hook in HOOKS) and result["profiled"]["inside_hooks"]
    # a unit's turn to reduce, inside a hook: every unit that ran, the embedding's too (its tied weight is the
    # root's, so it has nothing to reduce-scatter)
    assert profiled["reduce"] == _calls(ledger, "reduce_scatter") + 1
    # host_times(): every range clocked, the hooks (which hold the rest) within the step's wall time
    host = result["profiled"]["host_seconds"]
    top_level = [*HOOKS, "before_optimizer_step", "after_optimizer_step"]
    assert all(host.get(name, 0) > 0 for name in [*top_level, "reduce", "wait_all_gather", "gather_copy_in"])
    assert sum(host[name] for name in top_level) <= result["profiled"]["step_seconds"]
    assert host["reduce"] <= host["post_backward"] + host["end_of_backward"]
    assert result["profiled"]["clock_off_after"]
    units = 3  # root (embedding+head, frozen, scale), blocks.0, blocks.1 ran; "skipped" never runs

    full = result["full"]
    assert _calls(full["forward"], "all_gather") == units
    assert _calls(full["step"], "all_gather") == units + units - 1  # backward re-gathers all but the root
    assert _calls(full["step"], "reduce_scatter") == units
    assert _calls(full["step"], "all_reduce") == 0
    # each rank's row also carries the order stamp ([Note: order stamps])
    gather_bytes = sum(4 * (n + world * STAMP_SLOTS) * (world - 1) // world for n in full["unit_numel"].values())
    # each rank's row carries its gradient columns, one usage flag per trainable parameter and the stamp
    scatter_payload = {
        name: 4 * (sum(sizes) + world * (len(sizes) + STAMP_SLOTS)) for name, sizes in full["unit_trainable"].items()
    }
    assert full["forward"]["all_gather"]["wire_bytes"] == gather_bytes
    assert full["step"]["reduce_scatter"]["payload_bytes"] == sum(scatter_payload.values())
    assert full["freed_after_forward"] == {
        "root": False,
        "embed": True,
        "blocks.0": True,
        "blocks.1": True,
        "skipped": True,
    }
    assert full["freed_after_backward"]
    assert full["max_gathered"] <= 3  # the running unit, the root and one prefetched unit
    assert full["prefetched"] == [True]  # the next unit is in flight when a block starts
    # the account equals the storages measured at every module call and backward hook
    assert full["mismatches"] == [] and full["memory_now"] == 0

    # at rest: 1/N of every parameter plus padding; gradients and Adam's two moments alike
    assert full["param_bytes"] == full["expected_shard_bytes"]
    assert full["grad_bytes"] == full["expected_grad_bytes"]
    assert full["optim_bytes"] == 2 * full["expected_grad_bytes"]

    grad_op = result["grad_op"]
    assert _calls(grad_op["step"], "all_gather") == units
    assert _calls(grad_op["step"], "reduce_scatter") == units
    assert grad_op["freed_after_forward"]["blocks.0"] is False
    assert grad_op["freed_after_backward"] and grad_op["mismatches"] == []

    bf16 = result["bf16"]
    assert bf16["forward"]["all_gather"]["wire_bytes"] == gather_bytes // 2  # gathered in bf16
    assert bf16["step"]["reduce_scatter"]["payload_bytes"] == sum(scatter_payload.values())  # reduced in fp32
    assert bf16["mismatches"] == []


def _lora_memory_body(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = shard_model(LoRAModel(), auto_wrap_policy={LoRABlock})
    scheduler = get_scheduler(model)
    observer = Observer(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    tokens = torch.randint(0, VOCAB, (4, 2, 6), generator=torch.Generator().manual_seed(rank))
    for step in range(2):  # a normal step: reduce in backward
        next_token_loss(model(tokens[step]), tokens[step]).backward()
        optimizer.step()
        optimizer.zero_grad()
    normal = observer.max_gathered
    observer.max_gathered = 0
    with scheduler.no_sync():  # gradient accumulation: full parameters still freed per unit
        for step in (2, 3):
            next_token_loss(model(tokens[step]), tokens[step]).backward()
            after_micro_batch = [u.name for u in scheduler.units if u.state is not ShardedState.SHARDED]
    return {
        "normal": normal,
        "no_sync": observer.max_gathered,
        "after_micro_batch": after_micro_batch,
        "units": len(scheduler.units),
        "mismatches": observer.mismatches,
        "stashed": scheduler.memory.by_kind["stashed_grads"],
        "stashed_measured": sum(p.stashed_nbytes for p in scheduler.sharded_params()),
    }


def test_frozen_and_unused_parameters_and_no_sync_keep_memory_bounded(tmp_path):
    for result in run_ranks(_lora_memory_body, 2, tmp_path):
        assert result["units"] == 9  # the root and 8 LoRA blocks, each a frozen base + an adapter
        assert result["normal"] <= 3 and result["no_sync"] <= 3  # root + running + prefetched, not 8 of 8
        assert result["after_micro_batch"] == []
        assert result["mismatches"] == []
        assert result["stashed"] == result["stashed_measured"] > 0  # full adapter gradients, counted


def _prefetch_body(rank: int, world: int) -> dict:
    """Units a, b, c, d in a row; c is skipped from step 2 on (every rank alike)."""

    class Chain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(VOCAB, 8)
            self.blocks = nn.ModuleList([MLPBlock() for _ in range(4)])
            self.head = nn.Linear(8, VOCAB)

        def forward(self, tokens, skip: bool):
            x = self.embed(tokens)
            for index, block in enumerate(self.blocks):
                if not (skip and index == 2):
                    x = block(x)
            return self.head(x)

    torch.manual_seed(0)
    model = shard_model(Chain(), auto_wrap_policy={MLPBlock})
    ledger = get_scheduler(model).ledger
    tokens = torch.randint(0, VOCAB, (2, 6))
    gathers = []
    for step in range(5):
        ledger.start_step()
        with torch.no_grad():
            model(tokens, skip=step >= 2)
        gathers.append(_calls(ledger.snapshot(), "all_gather"))
    get_scheduler(model).close()
    trained = {}
    for name, skip_from in (("dropped", 2), ("never", 0), ("always", 99)):  # training steps: forward + backward
        torch.manual_seed(0)
        model = shard_model(Chain(), auto_wrap_policy={MLPBlock})
        ledger = get_scheduler(model).ledger
        counts = []
        for step in range(4):
            ledger.start_step()
            model(tokens, skip=step >= skip_from).sum().backward()
            counts.append(_calls(ledger.snapshot(), "all_gather"))
        get_scheduler(model).close()
        trained[name] = counts
    return {"gathers": gathers, "trained": trained}


def test_prefetch_follows_the_previous_step_in_forward_and_this_steps_units_in_backward(tmp_path):
    result = run_ranks(_prefetch_body, 2, tmp_path)[0]
    # 5 units ran (root + 4 blocks); from step 2 on block 2 is skipped: step 2 still prefetches it
    # once (the previous step ran it), steps 3 and 4 follow step 2's order and gather 4 units
    assert result["gathers"] == [5, 5, 5, 4, 4]
    # training: the backward keeps only the units that ran forward in this step, so a block dropped at
    # step 2 is not gathered by that step's backward; only its forward's prefetch (learned from step 1)
    # gathers it once more than a model that never ran it (the oracle), and from step 3 on they are equal
    trained = result["trained"]
    assert trained["always"][0] == trained["always"][3] == trained["dropped"][1], trained
    assert trained["dropped"][2] == trained["never"][2] + 1, trained
    assert trained["dropped"][3] == trained["never"][3], trained


def _returns_input_body(rank: int, world: int) -> dict:
    class Tap(nn.Module):
        """Returns its input unchanged next to a value computed from it (as a probe or a cache)."""

        def __init__(self) -> None:
            super().__init__()
            self.probe = nn.Linear(8, 1)

        def forward(self, x):
            return x, self.probe(x).mean()

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(VOCAB, 8)
            self.block = MLPBlock()
            self.tap = Tap()
            self.head = nn.Linear(8, VOCAB)

        def forward(self, tokens):
            x, probe = self.tap(self.block(self.embed(tokens)))
            return self.head(x) + probe

    torch.manual_seed(0)
    model = shard_model(Model(), auto_wrap_policy={MLPBlock, Tap})
    ledger = get_scheduler(model).ledger
    tokens = torch.randint(0, VOCAB, (2, 6))
    ledger.start_step()
    next_token_loss(model(tokens), tokens).backward()
    return {"gathers": _calls(ledger.snapshot(), "all_gather")}


def test_a_unit_returning_its_input_is_gathered_once_in_backward(tmp_path):
    # forward: root, block, tap; backward: tap and block again (the root stays gathered)
    assert run_ranks(_returns_input_body, 2, tmp_path)[0]["gathers"] == 5


def _no_shard_body(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = shard_model(TiedLM(), sharding_strategy="NO_SHARD", auto_wrap_policy={Block, nn.Embedding})
    scheduler = get_scheduler(model)
    trainable = {
        u.name: [p.shard_numel for p in u.params if p.trainable] for u in scheduler.units if u.name != "skipped"
    }
    batches = make_batches(2, 2 * world)
    for step in range(2):
        scheduler.ledger.start_step()
        lm_loss(model, batches[step][rank::world]).backward()
    # gradients of one unit: one copy into a flat buffer, all-reduced in place, viewed by sharded.grad
    flat_views = [
        p.sharded.grad.untyped_storage().data_ptr() for p in scheduler.units[0].params if p.sharded.grad is not None
    ]
    return {"step": scheduler.ledger.snapshot(), "trainable": trainable, "flat_views": flat_views}


def test_no_shard_all_reduces_each_unit_once_in_place(tmp_path):
    world = 2
    result = run_ranks(_no_shard_body, world, tmp_path)[0]
    reduced = {name: sizes for name, sizes in result["trainable"].items() if sizes}
    assert _calls(result["step"], "all_reduce") == len(reduced)
    assert _calls(result["step"], "reduce_scatter") == 0 and _calls(result["step"], "all_gather") == 0
    payload = sum(4 * (sum(s) + len(s) + STAMP_SLOTS) for s in reduced.values())
    assert result["step"]["all_reduce"]["payload_bytes"] == payload
    assert len(set(result["flat_views"])) == 1  # the root's gradients are views of its one reduced buffer


class _Probe(torch.autograd.Function):
    """Identity whose backward calls ``record()``: what is gathered at that point of backward."""

    @staticmethod
    def forward(ctx, x, record):
        ctx.record = record
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.record()
        return grad, None


class _ProbedBlock(MLPBlock):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Probe.apply(super().forward(x), self.at_output)


class _ProbedChain(nn.Module):
    """Four blocks; probes at each block's output (inside it) and between blocks (in the root)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.blocks = nn.ModuleList([_ProbedBlock(8) for _ in range(4)])
        self.head = nn.Linear(8, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for index, block in enumerate(self.blocks):
            if index > 0:
                x = _Probe.apply(x, self.between[index])
            x = block(x)
        return self.head(x)


def _instrument(model: _ProbedChain) -> dict[str, list[bool]]:
    """Record whether block k+1 is gathered as block k's forward starts, and whether block k-1 is
    gathered when block k's backward starts (at its output) and once its gradients are done (between)."""
    units = {u.module: u for u in get_scheduler(model).units}
    blocks = [units[b] for b in model.blocks]
    log: dict[str, list[bool]] = {"forward": [], "at_output": [], "between": []}

    def note(kind: str, unit) -> bool:
        log[kind].append(unit.state is not ShardedState.SHARDED)  # gathered or on its way
        return True

    for k, block in enumerate(model.blocks):
        block.at_output = lambda k=k: k > 0 and note("at_output", blocks[k - 1])
        if k + 1 < len(blocks):
            block.register_forward_pre_hook(lambda *_, k=k: note("forward", blocks[k + 1]) and None)
    model.between = {k: lambda k=k: note("between", blocks[k - 1]) for k in range(1, 4)}
    return log


def _prefetch_modes_body(rank: int, world: int) -> dict:
    from fsdp_strategy.checkpoint import full_state_dict

    results = {}
    for forward, backward in [(True, "BACKWARD_PRE"), (False, "BACKWARD_POST"), (True, None)]:
        torch.manual_seed(0)
        model = _ProbedChain()
        shard_model(model, auto_wrap_policy={_ProbedBlock}, forward_prefetch=forward, backward_prefetch=backward)
        log = _instrument(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for batch in make_batches(2, 2 * world):
            for values in log.values():
                values.clear()
            lm_loss(model, batch[rank::world] % VOCAB).backward()
            optimizer.step()
            optimizer.zero_grad()
        results[f"{forward}/{backward}"] = {**log, "state": full_state_dict(model)}
    return results


def test_forward_and_backward_prefetch_options_change_when_not_what(tmp_path):
    results = run_ranks(_prefetch_modes_body, 2, tmp_path)[0]
    pre, post, none = results["True/BACKWARD_PRE"], results["False/BACKWARD_POST"], results["True/None"]
    # step 2: forward prefetch gathers block k+1 as block k starts, unless forward_prefetch=False
    assert pre["forward"] == [True] * 3 and none["forward"] == [True] * 3 and post["forward"] == [False] * 3
    # BACKWARD_PRE: block k-1 is on its way when block k's backward starts; POST: once k's gradients
    # are computed (between the blocks); None: only when backward reaches block k-1 itself
    assert pre["at_output"] == [True] * 3 and pre["between"] == [True] * 3
    assert post["at_output"] == [False] * 3 and post["between"] == [True] * 3
    assert none["at_output"] == [False] * 3 and none["between"] == [False] * 3
    for mode in (post, none):  # the schedule changes, the numbers do not
        assert all(torch.equal(mode["state"][k], v) for k, v in pre["state"].items())


class _TwoBackwardGAN(nn.Module):
    """A GAN step inside the root forward: the critic's backward first, then the generator's."""

    def __init__(self) -> None:
        super().__init__()
        self.generator = nn.Sequential(MLPBlock(), MLPBlock())
        self.critic = Critic()

    def forward(self, real: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        fake = torch.tanh(self.generator(noise))
        critic_loss = self.critic(fake.detach()).mean() - self.critic(real).mean()
        critic_loss.backward()
        generator_loss = -self.critic(fake).mean()
        generator_loss.backward()
        return (critic_loss + generator_loss).detach()


def _prefetch_patterns_body(rank: int, world: int) -> dict:
    """All-gathers per step and backward prefetches per step, with and without prefetching, for
    patterns whose backward order is not the reverse of one forward."""
    torch.manual_seed(rank)
    tokens = torch.randint(0, VOCAB, (4, 6))
    real, noise = torch.randn(4, DIM), torch.randn(4, DIM)
    patterns = {
        "gan_two_backwards": (_TwoBackwardGAN, lambda m: m(real, noise)),
        "inside_forward": (InsideForward, lambda m: m(tokens)),
        "reentrant_checkpoint": (lambda: Staged(True), lambda m: next_token_loss(m(tokens), tokens).backward()),
    }
    out = {}
    for name, (build, step) in patterns.items():
        for prefetch in (True, False):
            torch.manual_seed(0)
            model = shard_model(
                build(),
                auto_wrap_policy={MLPBlock},
                forward_prefetch=prefetch,
                backward_prefetch="BACKWARD_PRE" if prefetch else None,
            )
            scheduler = get_scheduler(model)
            record, prefetched = scheduler._order.record, []

            def counted(phase, unit, record=record, prefetched=prefetched):
                target = record(phase, unit)
                if target is not None and phase[0] == "backward":
                    prefetched[-1] += 1
                return target

            scheduler._order.record = counted
            gathers = []
            for _ in range(4):
                scheduler.ledger.start_step()
                prefetched.append(0)
                step(model)
                gathers.append(_calls(scheduler.ledger.snapshot(), "all_gather"))
            scheduler.close()
            out[f"{name}/{prefetch}"] = {"gathers": gathers, "backward_prefetches": list(prefetched)}
    return out


def test_prefetching_never_adds_a_gather_when_backwards_do_not_mirror_one_forward(tmp_path):
    """Two backwards in a step (a GAN, Lightning's training_step with manual backwards) and reentrant
    activation checkpointing (whose forward runs without grad): from step 2 on, prefetching gathers
    exactly what gathering on arrival does (the oracle: prefetch off), and the backward still prefetches."""
    result = run_ranks(_prefetch_patterns_body, 2, tmp_path)[0]
    for name in ("gan_two_backwards", "inside_forward", "reentrant_checkpoint"):
        on, off = result[f"{name}/True"], result[f"{name}/False"]
        assert on["gathers"][1:] == off["gathers"][1:], (name, on, off)
        assert all(count > 0 for count in on["backward_prefetches"][1:]), (name, on)
