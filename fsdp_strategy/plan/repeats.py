"""Plans of models made of many identical layers, at the cost of a few.

[Note: identical layers planned once]
A Llama of 80 decoder layers runs the same layer 80 times; planning it on fake tensors costs one
pass of every operator of every layer, twice (two steps). Where a model holds one list of at
least ``MIN_LAYERS`` identical layers (a ``ModuleList`` or ``Sequential`` whose layers have the
same classes, parameter and buffer shapes and dtypes, and the same plain attributes but for their
own index, that the wrap and recomputation policies treat alike, each holding a unit; the only such
list), and where a forward of the whole model on the meta device (cheap: shapes only, no engine)
calls each layer once, in order, and runs the same operators on the same shapes in each (so no
layer behaves otherwise by its index), the plan runs the model with the first 5, 6 and 7 layers
instead, and counts the rest:

- every number a plan reports is a sum over the layers of what one layer holds or sends (shards,
  gradients, optimizer state, the activations kept for backward, bytes sent, FLOPs) plus what does
  not depend on the count (the embedding and head, one gathered unit, its buffers). So between two
  counts it grows by the same amount per layer: it is ``a + b * N``.
- the peak, though, is the largest of many moments (the start of backward, where the most
  activations are kept; its end, where the most gradients are; the optimizer step), each of the
  form ``a + b * N`` but with its own slope: which one is the largest may change with N. So each
  moment is followed on its own. A moment is where the engine is in its sequence of memory events
  (gathers, releases, buffers) within a step's phase. With the layers named by their place from
  the end of the list the phase starts at, the three runs' events are the same over its first three
  layers (the head); named from the other end, the same over its last three (the tail). A moment
  between two events of the common head (or tail) is the same moment in every run and in the
  whole model, a given number of layers from that end; one in the middle of a longer list is
  never higher than both ends (along the list the moments are linear in a layer's index), and one
  that is a run's peak stops the counting. Between two events the engine runs one unit's
  computation (or the root's), whose operators stand on the same memory in every run: so its
  highest point is the same operator whatever the count. Where a layer holds no unit (the whole
  model one unit) its moments could not be told apart: every layer is planned.
- the plan checks that every number of every moment grows by the same amount from 5 to 6 layers
  as from 6 to 7, extends each to the real count, and takes the largest moment. If anything is
  not linear (a layer that differs by its index), or the runs' events do not line up, it plans
  the whole model instead.

Costs: three plans of 5 to 7 layers instead of one of N: for N = 80, about a quarter of the time.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from fsdp_strategy.plan.result import MemoryPlan

MIN_LAYERS = 20  # fewer are planned as they are: the three short plans (18 layers) would cost as much
COUNTS = (5, 6, 7)  # the layer counts planned: three layers at each end of the list are followed
ENDS = 3  # the layers at each end whose moments are followed
_PLAIN = (int, float, str, bool, type(None), torch.dtype)


class LayerList(NamedTuple):
    """The list of identical layers a plan counts instead of running."""

    name: str  # qualified name of the ModuleList or Sequential
    count: int


class Moment(NamedTuple):
    """A candidate peak: the highest bytes seen in a step's phase between two of the engine's events."""

    span: tuple[int, str]  # (step, phase)
    index: int  # the engine's events in that phase before it
    plan: MemoryPlan  # the run's plan as if this moment were its peak


class PlannedRun(NamedTuple):
    """What one planned run saw: its moments, in the order their peaks were reached, and the engine's
    events of each step's phase as (unit, event)."""

    moments: list[Moment]
    sequences: dict[tuple[int, str], list[tuple[str, str]]]


def find_layer_list(module: nn.Module, selections: list[set[int]]) -> LayerList | None:
    """The largest list of at least ``MIN_LAYERS`` identical layers in ``module`` that every policy
    selection in ``selections`` (ids of the modules a policy chose; the wrap policy's first) treats
    alike, each layer holding a unit (its gathers mark where each moment is), or None."""
    found: list[tuple[int, LayerList]] = []
    for name, container in module.named_modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)) or len(container) < MIN_LAYERS:
            continue
        layers = list(container)
        if not _identical(layers) or not all(_alike(layers, chosen) for chosen in selections):
            continue
        if not any(id(m) in selections[0] for m in layers[0].modules()):
            continue  # no unit in a layer: its moments cannot be told apart ([Note: identical layers ...])
        found.append((len(layers) * sum(p.numel() for p in layers[0].parameters()), LayerList(name, len(layers))))
    # two long lists (an encoder and a decoder): counting one would plan the other three times over
    return found[0][1] if len(found) == 1 else None


def runs_alike(module: nn.Module, layers: LayerList, run_forward: Callable[[], Any]) -> bool:
    """Whether a forward of the whole model (``run_forward``: on the meta device, no engine) calls each
    layer of the list once, in order, and runs the same operators on tensors of the same shapes in
    each: what no comparison of the layers' structure can see (a layer that attends globally by its
    index, a model that runs only its first half). Costs: one forward on meta tensors, a Python call
    per operator."""
    container = module.get_submodule(layers.name)
    order: list[int] = []
    traces: dict[int, list] = {}
    running: list[list] = []

    class Trace(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            if running:
                shapes = [(tuple(t.shape), t.dtype) for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
                running[-1].append((str(func), shapes))
            return out

    def before(index: int, *_: Any) -> None:
        order.append(index)
        running.append([])

    def after(index: int, *_: Any) -> None:
        traces.setdefault(index, running.pop())

    handles = []
    for index, layer in enumerate(container):
        handles.append(layer.register_forward_pre_hook(functools.partial(before, index)))
        handles.append(layer.register_forward_hook(functools.partial(after, index)))
    try:
        with Trace():
            run_forward()
    except Exception:  # noqa: BLE001 - a model that cannot run so is planned layer by layer
        return False
    finally:
        for handle in handles:
            handle.remove()
    return order == list(range(layers.count)) and all(traces[i] == traces[0] for i in range(layers.count))


def _identical(layers: list[nn.Module]) -> bool:
    """Whether the layers are the same computation on tensors of the same shapes ([Note: identical
    layers planned once]); an attribute equal to each layer's own index (``layer_idx``) is allowed."""
    signatures = [_signature(layer) for layer in layers]
    first = signatures[0]
    if any(s.keys() != first.keys() for s in signatures):
        return False
    for key in first:
        values = [s[key] for s in signatures]
        if all(v == values[0] for v in values):
            continue
        if not (key[1] == "attribute" and values == list(range(len(layers)))):
            return False
    return True


def _signature(layer: nn.Module) -> dict[tuple[str, str, str], Any]:
    signature: dict[tuple[str, str, str], Any] = {}
    for path, module in layer.named_modules(remove_duplicate=False):
        signature[(path, "class", "")] = type(module)
        for name, param in module._parameters.items():
            described = None if param is None else (param.shape, param.dtype, param.requires_grad)
            signature[(path, "param", name)] = described
        for name, buffer in module._buffers.items():
            persistent = name not in module._non_persistent_buffers_set
            signature[(path, "buffer", name)] = None if buffer is None else (buffer.shape, buffer.dtype, persistent)
        for name, value in vars(module).items():
            if not name.startswith("_") and isinstance(value, _PLAIN):
                signature[(path, "attribute", name)] = value
        for kind in ("_forward_pre_hooks", "_forward_hooks", "_backward_hooks", "_state_dict_hooks"):
            signature[(path, "hooks", kind)] = len(getattr(module, kind, {}))
    return signature


def _alike(layers: list[nn.Module], chosen: set[int]) -> bool:
    """Whether a policy chose the same modules (by their path in the layer) in every layer."""
    picks = [frozenset(path for path, m in layer.named_modules() if id(m) in chosen) for layer in layers]
    return all(p == picks[0] for p in picks)


def shortened(module: nn.Module, layers: LayerList, count: int) -> nn.Module:
    """A copy of ``module`` (on the meta device) whose layer list keeps its first ``count`` layers."""
    copied = copy.deepcopy(module)
    container = copied.get_submodule(layers.name)
    for index in range(len(container) - 1, count - 1, -1):
        del container[index]
    return copied


def role(unit: str, layers: LayerList, count: int, from_end: bool) -> str:
    """A unit's name with its layer's index replaced by its place in the list, counted from the
    list's start (``<first+2>``) or end (``<last-0>``); other units keep their name."""
    prefix = f"{layers.name}." if layers.name else ""
    head, _, rest = unit[len(prefix) :].partition(".")
    if not unit.startswith(prefix) or not head.isdigit():
        return unit
    place = f"last-{count - 1 - int(head)}" if from_end else f"first+{int(head)}"
    return f"{prefix}<{place}>" + (f".{rest}" if rest else "")


def named(role_name: str, layers: LayerList) -> str:
    """The unit name a role stands for in the whole model."""
    prefix = f"{layers.name}." if layers.name else ""
    if not role_name.startswith(f"{prefix}<"):
        return role_name
    place, _, rest = role_name[len(prefix) + 1 :].partition(">")
    offset = int(place.split("-")[1]) if place.startswith("last-") else None
    index = layers.count - 1 - offset if offset is not None else int(place.split("+")[1])
    return f"{prefix}{index}{rest}"


def extrapolate(runs: list[PlannedRun], layers: LayerList) -> MemoryPlan | None:
    """The whole model's plan from the runs at ``COUNTS`` layers, or None where that is not exact
    ([Note: identical layers planned once])."""
    if any(run.sequences.keys() != runs[0].sequences.keys() for run in runs):
        return None
    ends = {span: _common_ends([run.sequences[span] for run in runs], layers) for span in runs[0].sequences}
    keyed_runs = [_keyed(run, count, ends, layers) for count, run in zip(COUNTS, runs)]
    common = set.intersection(*(set(keyed) for keyed in keyed_runs))
    for run, keyed in zip(runs, keyed_runs):
        top = max(run.moments, key=lambda m: m.plan.peak_bytes)
        if not any(keyed[key][0] is top.plan for key in common):
            return None  # the peak is where the runs' events do not line up
    extended = []
    for key in sorted(common, key=repr):
        numbers = [_numbers(keyed[key][0]) for keyed in keyed_runs]
        first, second = _minus(numbers[1], numbers[0]), _minus(numbers[2], numbers[1])
        units = [keyed[key][1] for keyed in keyed_runs]  # the unit, named as the phase's layers are, else the other way
        unit = next((names[0] for names in zip(*units) if len(set(names)) == 1), None)
        if first != second or unit is None:
            return None
        total = {name: value + (layers.count - COUNTS[-1]) * first[name] for name, value in numbers[-1].items()}
        last, _, order = keyed_runs[-1][key]
        extended.append((-order, _plan_from(last, total, named(unit, layers))))
    return max(extended, key=lambda entry: (entry[1].peak_bytes, entry[0]))[1]  # the earliest of equal peaks


def _far(unit_role: str) -> bool:
    """Whether a unit is a layer ``ENDS`` or more places from the end its name counts from: where the
    shortest run's other end begins (those moments differ: the first layer's input is the
    embedding's output, the last one's output the head's input)."""
    place = unit_role.partition("<")[2].partition(">")[0]
    return bool(place) and int(place.replace("+", "-").split("-")[1]) >= ENDS


def _keyed(run: PlannedRun, count: int, ends: dict, layers: LayerList) -> dict[Hashable, tuple]:
    """A run's moments by where they are: so many events after a phase's start (the head) or before
    its end (the tail); a moment in both has both keys, one in neither none. Values: (plan, its unit
    named as that end names the layers and the other way, the moment's order)."""
    keyed: dict[Hashable, tuple] = {}
    for order, moment in enumerate(run.moments):
        (head, head_from_end), (tail, tail_from_end) = ends.get(moment.span, ((0, True), (0, True)))
        events = len(run.sequences.get(moment.span, ()))
        for where, place, limit, from_end in (
            ("head", moment.index, head, head_from_end),
            ("tail", events - moment.index, tail, tail_from_end),
        ):
            if place < limit:
                unit = moment.plan.unit
                units = (role(unit, layers, count, from_end), role(unit, layers, count, not from_end))
                keyed[(moment.span, where, place)] = (moment.plan, units, order)
    return keyed


def _common_ends(sequences: list[list[tuple[str, str]]], layers: LayerList) -> tuple[tuple[int, bool], ...]:
    """How many moments at the head and at the tail of a phase are the same in every run, and whether
    the layers there are named by their place from the list's end: the moments before the first
    event that differs (after the last one, for the tail), under the naming that goes furthest."""
    ends = []
    for reverse in (False, True):
        best = (0, True)
        for from_end in (True, False):
            named_runs = [[(role(u, layers, c, from_end), e) for u, e in seq] for c, seq in zip(COUNTS, sequences)]
            if reverse:
                named_runs = [list(reversed(r)) for r in named_runs]
            common = 0
            while all(common < len(r) and r[common] == named_runs[0][common] for r in named_runs):
                if _far(named_runs[0][common][0]):
                    break
                common += 1
            if all(len(r) == common for r in named_runs):
                common += 1  # a phase alike in every run: every moment of it, the one after its last event too
            best = max(best, (common, from_end))
        ends.append(best)
    return tuple(ends)


def _numbers(plan: MemoryPlan) -> dict[str, int]:
    numbers = {f"part:{name}": value for name, value in plan.parts.items()}
    for name in ("peak_bytes", "host_bytes", "sent_bytes_per_step", "flops_per_step", "shard_bytes"):
        numbers[name] = getattr(plan, name)
    return numbers


def _minus(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {name: a[name] - b[name] for name in a}


def _plan_from(like: MemoryPlan, numbers: dict[str, int], unit: str) -> MemoryPlan:
    parts = {name[5:]: value for name, value in numbers.items() if name.startswith("part:")}
    plain = {name: value for name, value in numbers.items() if not name.startswith("part:")}
    return dataclasses.replace(like, parts=parts, unit=unit, **plain)


def plan_layers(module: nn.Module, layers: LayerList, run: Callable[[nn.Module], PlannedRun]) -> MemoryPlan | None:
    """Plan ``module`` from three runs of its shortened copies ([Note: identical layers planned
    once]); None where that is not exact (the caller then plans the whole model)."""
    runs = []
    for count in COUNTS:
        try:
            runs.append(run(shortened(module, layers, count)))
        except Exception:  # noqa: BLE001 - a model that needs all its layers (indexing them by count) is planned whole
            return None
    return extrapolate(runs, layers)
