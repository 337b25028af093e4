"""One planned run: the engine's own build and schedule, on fake tensors and a fake process group.

[Note: memory plan]
``plan`` copies the model onto the meta device (no weights are read or allocated), honours a
LightningModule's ``configure_model``, and then does what ``FSDPCustomStrategy`` does in
``setup``: convert the module for the precision, apply activation checkpointing, and shard it
with ``shard_with_options`` (materializing each unit with ``to_empty``). Under torch's
``FakeTensorMode``, on rank 0 of a fake process group of the requested size, it then runs two
training steps in Lightning's order (forward, ``zero_grad``, backward, optimizer step: the last
step's gradients are alive during the forward) while ``LiveBytes`` counts every storage.
Nothing here models the units, buffers or schedule a second time: the engine allocates what it
allocates in training, and the fake collectives keep the schedule's order. The engine skips
the two checks that read values (order stamps, edits of gathered parameters) on fake tensors.
The arguments are checked by ``StrategyOptions``, the check both strategies run, and the precision
follows ``PrecisionRules``, which their precision plugins follow too (``options.py``, ``config.py``).

A model whose forward reads tensor values (``.item()``, ``nonzero``, data-dependent routing)
cannot be planned on fake tensors; that is reported as such.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensorMode

from fsdp_strategy.config import PrecisionRules
from fsdp_strategy.engine.traversal import map_tensors
from fsdp_strategy.options import StrategyOptions
from fsdp_strategy.plan.copies import allocate, meta_copy, planned_input
from fsdp_strategy.plan.flops import FlopCount
from fsdp_strategy.plan.repeats import LayerList, Moment, PlannedRun, find_layer_list, plan_layers, runs_alike
from fsdp_strategy.plan.result import PARTS, MemoryPlan
from fsdp_strategy.plan.tensor_parallel import TensorParallelPlan, apply_plan
from fsdp_strategy.plan.tracker import ACTIVATIONS, LiveBytes
from fsdp_strategy.plan.world import fake_world
from fsdp_strategy.wrap import ModuleNames

SHARDS, GRADIENTS, OPTIMIZER = "parameter shards", "gradients", "optimizer state"
OPTIMIZERS = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}
STEPS = 2  # the second step is the steady state (the optimizer state exists)


def optimizer_factory(optimizer: Any) -> Callable[[Any], torch.optim.Optimizer]:
    """``"adamw"``, ``"adam"``, ``"sgd"``, an optimizer class or a callable ``params -> optimizer``."""
    if isinstance(optimizer, str):
        if optimizer.lower() not in OPTIMIZERS:
            raise ValueError(
                f"optimizer={optimizer!r}; accepted: {sorted(OPTIMIZERS)}, an optimizer class or a callable"
            )
        optimizer = OPTIMIZERS[optimizer.lower()]
    if isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
        cls = optimizer
        return lambda params: cls(params, lr=1e-3)
    if callable(optimizer):
        return optimizer
    raise TypeError(f"optimizer={optimizer!r}; accepted: {sorted(OPTIMIZERS)}, an optimizer class or a callable")


def loss_of(output: Any) -> torch.Tensor:
    """The scalar to call ``backward`` on: a scalar output, ``output["loss"]`` / ``output.loss``, or
    the mean of the first floating tensor in the output."""
    if isinstance(output, torch.Tensor) and output.numel() == 1:
        return output.reshape(())
    loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    values = output.values() if isinstance(output, dict) else output if isinstance(output, (tuple, list)) else [output]
    for value in values:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.float().mean()
    raise TypeError(f"cannot find a loss in the model's output ({type(output).__name__}): return a tensor or a 'loss'")


def forward(model: nn.Module, batch: Any) -> Any:
    """A LightningModule's ``training_step(batch, 0)`` (through the module's own call, as the
    strategy runs it), else ``model(*batch)`` / ``model(**batch)`` / ``model(batch)``."""
    from lightning.pytorch import LightningModule
    from lightning.pytorch.strategies.strategy import _ForwardRedirection

    if isinstance(model, LightningModule):
        return _ForwardRedirection()(model, model, "training_step", batch, 0)
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


@dataclasses.dataclass
class Planned:
    """What one run needs: the arguments as ``FSDPCustomStrategy`` takes them, checked."""

    world_size: int
    num_nodes: int
    precision: str
    optimizer: Any
    strategy_kwargs: dict[str, Any]
    tensor_parallel: TensorParallelPlan | None = None  # a 2-D run ([Note: planning tensor parallel])

    def settings(self) -> dict[str, Any]:
        """The settings a MemoryPlan reports (strategy arguments as given, classes by name)."""
        shown = {"world_size": self.world_size, "precision": self.precision}
        for key, value in self.strategy_kwargs.items():
            shown[key] = _short(value)
        return {**shown, **(self.tensor_parallel.settings() if self.tensor_parallel else {})}


def run(model: nn.Module, example_input: Any, planned: Planned) -> MemoryPlan:
    """Plan one configuration ([Note: memory plan]); the model given is not changed."""
    from fsdp_strategy.distributed import build_mesh, mesh_shape

    if planned.strategy_kwargs.get("ignored_modules") is not None:
        raise ValueError(
            "plan() copies the model, so ignored_modules cannot name its modules; plan without them and add "
            "their parameters, gradients and optimizer state (whole, on every rank) to the peak"
        )
    if not getattr(model, "automatic_optimization", True):
        raise ValueError(
            f"{type(model).__name__} uses manual optimization (automatic_optimization=False): its training_step "
            "runs its own optimizers and backward, which a plan does not have; plan the module it trains (e.g. each "
            "network of a GAN with its own batch) instead"
        )
    options = StrategyOptions.from_arguments(*StrategyOptions.split(planned.strategy_kwargs))  # as training checks
    precision = PrecisionRules(planned.precision)
    make_optimizer = optimizer_factory(planned.optimizer)
    nodes, parallel = planned.num_nodes, planned.tensor_parallel
    shape = mesh_shape(options.device_mesh, options.sharding.sharding_strategy, nodes, planned.world_size // nodes)
    with fake_world(planned.world_size), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # self.log() without a trainer, and the like
        mesh = build_mesh(shape, "cpu")  # outside fake mode: the mesh reads its rank layout
        module, data_group = meta_copy(model, configure=parallel is None), None
        if parallel is not None:  # [Note: planning tensor parallel]
            two_d = parallel.mesh()
            module, data_group = apply_plan(module, two_d, parallel.parallelize_fn), two_d["data_parallel"].get_group()

        def moments(shortened: nn.Module, layer_list: LayerList | None = None) -> PlannedRun:
            run_options = _options_for(options, shortened, layer_list)
            steps = _PlannedSteps(run_options, precision, mesh, data_group)
            return steps.run(shortened, example_input, make_optimizer)

        layer_list = find_layer_list(module, _selections(module, options))
        if layer_list is not None and not runs_alike(module, layer_list, lambda: _meta_forward(module, example_input)):
            layer_list = None
        result = None
        if layer_list is not None:  # [Note: identical layers planned once] in repeats.py
            result = plan_layers(module, layer_list, lambda shortened: moments(shortened, layer_list))
        if result is None:
            result = max((m.plan for m in moments(module).moments), key=lambda plan: plan.peak_bytes)
    sizes = parallel.settings() if parallel is not None else {}
    return dataclasses.replace(
        result, settings=planned.settings(), strategy_kwargs={**planned.strategy_kwargs, **sizes}
    )


def _meta_forward(module: nn.Module, example_input: Any) -> Any:
    """One forward of ``module`` (on the meta device) on ``example_input`` as meta tensors."""
    batch = map_tensors(example_input, lambda t: torch.zeros(t.shape, dtype=t.dtype, device="meta"))
    return forward(module, batch)


def _selections(module: nn.Module, options: StrategyOptions) -> list[set[int]]:
    """The modules the wrap policy and the recomputation policy choose in ``module`` (ids)."""
    from fsdp_strategy.wrap import ModuleNames, as_policy_fn, select_unit_modules

    checkpointing = options.activation_checkpointing_policy
    policies = [options.sharding.wrap_policy]
    if isinstance(checkpointing, ModuleNames):
        policies.append(checkpointing.policy_for(module))
    elif checkpointing is not None:
        policies.append(as_policy_fn(checkpointing, argument="activation_checkpointing_policy"))
    return [{id(m) for m in select_unit_modules(module, policy)} for policy in policies]


def _options_for(options: StrategyOptions, module: nn.Module, layer_list: LayerList | None) -> StrategyOptions:
    """``options`` for a shortened copy: a recomputation policy naming modules keeps those it has."""
    from fsdp_strategy.wrap import ModuleNames

    checkpointing = options.activation_checkpointing_policy
    if layer_list is None or not isinstance(checkpointing, ModuleNames):
        return options
    present = {name for name, _ in module.named_modules()}
    return dataclasses.replace(options, activation_checkpointing_policy=ModuleNames(checkpointing & present))


class _PlannedSteps:
    """Shard a meta model as the strategy's ``setup`` does and run ``STEPS`` steps on fake tensors."""

    def __init__(self, options: StrategyOptions, precision: PrecisionRules, mesh: Any, data_group: Any = None) -> None:
        self.options, self.precision, self.mesh, self.data_group = options, precision, mesh, data_group
        self.device = torch.device("cpu")  # byte counts do not depend on the device type
        self.offload = options.sharding.cpu_offload.offload_params
        self.state = _State()
        self.grads_of: Callable[[], int] = lambda: 0  # the bytes of the shards' gradients
        host = (SHARDS, OPTIMIZER, GRADIENTS) if self.offload else ()
        self.tracker = LiveBytes(self._describe, host_tags=host, moment=self.state.moment)

    def _describe(self) -> dict[str, Any]:
        return {**self.state.describe(), "grads": self.grads_of()}

    def run(self, module: nn.Module, example_input: Any, make_optimizer: Callable) -> PlannedRun:
        """Shard ``module`` (on the meta device) and run the steps: the plan at each moment of them as if
        it were the peak (in the order those peaks were reached) and the engine's events."""
        with FakeTensorMode(allow_non_fake_inputs=True), self.tracker:
            return self._run(module, example_input, make_optimizer)

    def _run(self, module: nn.Module, example_input: Any, make_optimizer: Callable) -> PlannedRun:
        from fsdp_strategy.engine import shard_with_options
        from fsdp_strategy.wrap import apply_activation_checkpointing

        tracker, state, precision, device = self.tracker, self.state, self.precision, self.device
        flops = FlopCount()
        module = precision.convert_module(module)
        if self.options.activation_checkpointing_policy is not None:
            apply_activation_checkpointing(module, self.options.activation_checkpointing_policy)
        options = dataclasses.replace(
            self.options.sharding,
            mixed_precision=self.options.sharding.mixed_precision or precision.engine_mixed_precision,
            param_init_fn=lambda m: allocate(m, device),
            sync_module_states=False,
        )
        scheduler = shard_with_options(module, options, device, self.data_group, self.mesh)
        try:
            shards = list(module.parameters())
            tracker.retag(shards, SHARDS)
            scheduler.memory.record()  # the engine's events: where each moment is ([Note: identical layers ...])
            state.account = scheduler.memory
            self.grads_of = lambda: tracker.bytes_of(p.grad for p in shards)
            tracker.tag = OPTIMIZER  # an optimizer that makes its state at construction (Adagrad)
            optimizer = make_optimizer([p for p in shards if p.requires_grad])
            tracker.tag = ACTIVATIONS
            batch = planned_input(example_input, precision, device)
            for step in range(STEPS):
                state.step, last = step, step == STEPS - 1
                if last:
                    scheduler.ledger.start_step()
                with flops if last else nullcontext():
                    state.phase = "forward"
                    with precision.forward_context(device.type):
                        loss = loss_of(_planned_forward(module, batch))
                    optimizer.zero_grad(set_to_none=True)  # Lightning's order: last step's gradients live to here
                    state.phase = "backward"
                    _planned_backward(loss)
                del loss
                tracker.retag([p.grad for p in shards if p.grad is not None], GRADIENTS)
                state.phase, tracker.tag = "optimizer step", OPTIMIZER
                optimizer.step()
                tracker.tag = ACTIVATIONS
            sent = sum(totals.wire_bytes for totals in scheduler.ledger.current.values())
        finally:
            scheduler.close()
        host_bytes = sum(tracker.by_tag[tag] for tag in (SHARDS, OPTIMIZER, GRADIENTS)) if self.offload else 0
        moments = []
        for (step, phase, index), peak in sorted(tracker.peaks.items(), key=lambda item: item[1].order):
            plan = MemoryPlan(
                peak_bytes=peak.bytes,
                parts=_parts(peak.bytes, peak.by_tag, peak.moment, self.offload),
                phase=phase,
                unit=peak.moment.get("unit", ""),
                host_bytes=host_bytes,
                sent_bytes_per_step=sent,
                flops_per_step=flops.total,
                shard_bytes=tracker.bytes_of(shards),
            )
            moments.append(Moment((step, phase), index, plan))
        return PlannedRun(moments, state.sequences())


class _State:
    """What the tracker reads: at every operator the moment (step, phase, the engine's events in it so
    far), at a new peak the phase and the engine's account."""

    def __init__(self) -> None:
        self.step = -1  # -1: setup
        self._phase = "setup"
        self._phase_from = 0  # the engine's events before the phase began
        self.spans: dict[tuple[int, str], int] = {}  # (step, phase) -> its first event's index
        self.account: Any = None

    def events(self) -> int:
        """The engine's memory events recorded so far."""
        timeline = self.account.timeline if self.account is not None else None
        return len(timeline) if timeline is not None else 0

    @property
    def phase(self) -> str:
        """ "setup", "forward", "backward" or "optimizer step"."""
        return self._phase

    @phase.setter
    def phase(self, phase: str) -> None:
        self._phase, self._phase_from = phase, self.events()
        self.spans[(self.step, phase)] = self._phase_from

    def moment(self) -> tuple[int, str, int]:
        """(step, phase, the engine's events in this phase so far): cheap, read at every operator."""
        return self.step, self._phase, self.events() - self._phase_from

    def sequences(self) -> dict[tuple[int, str], list[tuple[str, str]]]:
        """Each (step, phase)'s engine events as (unit, event), from the account's timeline."""
        timeline = self.account.stop() if self.account is not None else []
        starts = sorted(self.spans.items(), key=lambda item: item[1])
        ends = [start for _, start in starts[1:]] + [len(timeline)]
        return {span: [(e.unit, e.event) for e in timeline[start:end]] for (span, start), end in zip(starts, ends)}

    def describe(self) -> dict[str, Any]:
        """What a peak keeps of its moment: the phase, the unit, the engine's buffers."""
        engine = dict(self.account.by_kind) if self.account is not None else {}
        unit = self.account.last_unit if self.account is not None else ""
        return {"phase": self.phase, "unit": unit, "engine": engine}


def _parts(peak: int, by_tag: dict[str, int], moment: dict[str, Any], offload: bool) -> dict[str, int]:
    """The parts of the peak: tags, the engine's account of its buffers, and the rest as activations."""
    engine = moment.get("engine", {})
    parts = dict.fromkeys(PARTS, 0)
    if not offload:
        parts[SHARDS] = by_tag.get(SHARDS, 0)
        parts[OPTIMIZER] = by_tag.get(OPTIMIZER, 0)
        parts[GRADIENTS] = by_tag.get(GRADIENTS, 0)
    parts[GRADIENTS] += max(moment.get("grads", 0) - by_tag.get(GRADIENTS, 0), 0) + engine.get("stashed_grads", 0)
    parts["gathered parameters"] = engine.get("params", 0)
    parts["gather/reduce buffers"] = engine.get("gather_buffer", 0) + engine.get("reduce_buffer", 0)
    known = sum(value for name, value in parts.items() if name != "activations")
    parts["activations"] = max(peak - known, 0)
    return parts


def _planned_backward(loss: torch.Tensor) -> None:
    """``loss.backward()``; a loss on vocabulary-split logits (``loss_parallel``), whose backward torch runs
    only inside ``loss_parallel()``, is refused with what to plan instead."""
    try:
        loss.backward()
    except RuntimeError as error:
        if "mixed torch.Tensor and DTensor" not in str(error):
            raise
        raise RuntimeError(
            f"the model's loss needs tensor parallel's loss_parallel() around its backward ({error}), which a plan "
            "does not run: plan the model with replicated logits (the head's output_layouts=Replicate()); the split "
            "loss holds less (its logits divided by the tensor-parallel size)"
        ) from error


def _planned_forward(module: nn.Module, batch: Any) -> Any:
    try:
        return forward(module, batch)
    except (DataDependentOutputException, DynamicOutputShapeException) as error:
        raise RuntimeError(
            f"the model's forward reads tensor values ({error}), which a plan on fake tensors does not have "
            "(e.g. .item(), nonzero or data-dependent routing); measure such a model in a short real run "
            "with the MemoryMonitor callback instead"
        ) from error


def _short(value: Any) -> Any:
    """A strategy argument as Python a user pastes (classes by name, which their code imports)."""
    if isinstance(value, type):
        return value.__name__
    if isinstance(value, ModuleNames):
        return repr(value)
    if isinstance(value, (set, frozenset)):
        return "{" + ", ".join(sorted(str(_short(v)) for v in value)) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(str(_short(v)) for v in value) + "]"
    if isinstance(value, str):
        return repr(value)
    return value
