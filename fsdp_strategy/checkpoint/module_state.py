"""State dicts of a sharded model through each module's own state-dict machinery.

[Note: state dicts through the modules' own code]
``nn.Module.state_dict`` and ``load_state_dict`` run code a module may override or hook:
``_save_to_state_dict`` / ``_load_from_state_dict`` (LitGPT's LoRA layers load a base model's
``attn.qkv.weight`` into ``attn.qkv.linear.weight``), state-dict pre and post hooks, load pre and
post hooks, ``get_extra_state`` / ``set_extra_state``. A sharded parameter holds only this rank's
rows, so that code cannot run on it; matching keys by name instead skips what the code renames
(LoRA then fine-tunes random base weights, silently). So the code runs on stand-ins:

- Saving: each sharded parameter is replaced, at every place it is registered, by a tensor on the
  meta device of its full shape; ``state_dict()`` runs; an entry whose value *is* such a stand-in
  (any alias with its shape and layout) is that parameter under the key the module chose. Buffers,
  parameters left whole (``ignored_modules``) and extra entries are real and kept as they are.
- Loading: every parameter and buffer is replaced by a stand-in and every tensor of the checkpoint
  by a meta tensor of its stored shape; ``load_state_dict`` runs under a dispatch mode that records
  each ``copy_``: which checkpoint key lands in which parameter, with torch's own checks (size
  mismatch; with ``strict``, missing and unexpected keys) raised before anything is written. The
  caller then moves the bytes (each rank its rows), and ``load_state_dict`` runs once more with the
  real values of everything that is not a sharded parameter (buffers, whole parameters, extra
  state) while the sharded ones are still stand-ins.

A module that computes a saved value from a parameter, or loads a parameter from anything but one
checkpoint tensor as it is (a transpose, a slice, a sum), cannot be served shard by shard: that is
an error naming the key, never a silent approximation. Costs: two or three passes of the module
tree's state-dict code on meta tensors (no data).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_strategy.checkpoint.layout import CheckpointError, StrictLoadError, shortened
from fsdp_strategy.engine.param import ShardedParam
from fsdp_strategy.engine.view import ShardsView


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.stride() == b.stride() and a.storage_offset() == b.storage_offset()


def _stand_in(like: torch.Tensor, shape: torch.Size, parameter: bool) -> torch.Tensor:
    tensor = torch.empty(shape, dtype=like.dtype, device="meta")
    return nn.Parameter(tensor, requires_grad=like.requires_grad) if parameter else tensor


class _StandIns:
    """Meta stand-ins for the tensors registered in a module tree (ties kept: one stand-in per
    tensor), and what each stands for."""

    def __init__(self, view: ShardsView, everything: bool) -> None:
        self.view = view
        self.everything = everything  # also buffers and whole parameters (a load's first pass)
        self.sharded: dict[int, tuple[torch.Tensor, ShardedParam]] = {}  # storage -> (stand-in, param)
        self.plain: dict[int, torch.Tensor] = {}  # storage -> stand-in of a buffer or whole parameter
        self._made: dict[int, torch.Tensor] = {}  # id(original) -> its stand-in
        self._replaced: list[tuple[dict, str, torch.Tensor]] = []

    @contextmanager
    def installed(self) -> Iterator[None]:
        """The stand-ins in place of the tensors, for the duration; the tensors back afterwards."""
        try:
            for module in self.view.module.modules():
                for slots, parameter in ((module._parameters, True), (module._buffers, False)):
                    for name, tensor in list(slots.items()):
                        stand_in = self._stand_in_for(tensor, parameter)
                        if stand_in is not None:
                            self._replaced.append((slots, name, tensor))
                            slots[name] = stand_in
            yield
        finally:
            for slots, name, tensor in reversed(self._replaced):
                slots[name] = tensor
            self._replaced = []

    def _stand_in_for(self, tensor: torch.Tensor | None, parameter: bool) -> torch.Tensor | None:
        if tensor is None:
            return None
        if id(tensor) in self._made:
            return self._made[id(tensor)]
        param = self.view.by_id.get(id(tensor))
        if param is None and not self.everything:
            return None
        stand_in = _stand_in(tensor, param.global_shape if param is not None else tensor.shape, parameter)
        if param is not None:
            self.sharded[_storage(stand_in)] = (stand_in, param)
        else:
            self.plain[_storage(stand_in)] = stand_in
        self._made[id(tensor)] = stand_in
        return stand_in


def saved_state(view: ShardsView) -> dict[str, ShardedParam | Any]:
    """``state_dict(keep_vars=True)`` of the model through its modules' own code ([Note: state
    dicts through the modules' own code]), in its order: a ``ShardedParam`` for each sharded
    parameter, under the key the modules chose; buffers, whole parameters and extra entries as
    ``state_dict()`` gave them."""
    stand_ins = _StandIns(view, everything=False)
    with stand_ins.installed():
        state = view.module.state_dict(keep_vars=True)
    saved: dict[str, ShardedParam | Any] = {}
    for key, value in state.items():
        if not (torch.is_tensor(value) and value.is_meta):
            saved[key] = value
            continue
        found = stand_ins.sharded.get(_storage(value))
        if found is None or not _same_layout(value, found[0]):
            raise CheckpointError(
                f"state_dict() of {type(view.module).__name__} computes {key!r} from its parameters (a module's "
                "_save_to_state_dict or state-dict hook): a sharded model cannot run that computation on its shards. "
                "Save the parameters as they are and convert after fsdp-consolidate"
            )
        saved[key] = found[1]
    return saved


class _Copies(TorchDispatchMode):
    """Records every ``copy_(destination, source)`` made under it."""

    def __init__(self) -> None:
        super().__init__()
        self.copies: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is torch.ops.aten.copy_.default:
            self.copies.append((args[0], args[1]))
        return func(*args, **(kwargs or {}))


class LoadPlan(NamedTuple):
    """Where a checkpoint's entries go: into shards (``params``) or, for everything else, through a
    plain ``load_state_dict`` (``load_plain``)."""

    params: dict[str, list[ShardedParam]]  # checkpoint key -> the sharded parameters it loads into
    missing: list[str]  # the model's keys the checkpoint lacks (as torch's load_state_dict reports them)
    unexpected: list[str]


def load_plan(
    view: ShardsView,
    stored: Mapping[str, Any],
    strict: bool,
    source: Any,
    shapes: Mapping[str, tuple] | None = None,
    dtypes: Mapping[str, torch.dtype] | None = None,
) -> LoadPlan:
    """Run ``load_state_dict`` of the model on stand-ins ([Note: state dicts through the modules'
    own code]) for a checkpoint holding ``stored`` (key -> tensor, or any other value);
    ``shapes`` and ``dtypes``: key -> stored shape and dtype for entries whose tensor is not read
    yet (a folder's). Raises
    ``StrictLoadError`` naming ``source`` for a size mismatch or, with ``strict``, missing or
    unexpected keys; nothing is written."""
    probes: dict[int, tuple[torch.Tensor, str]] = {}
    values: dict[str, Any] = {}
    for key, value in stored.items():
        shape = shapes.get(key) if shapes is not None else None
        if torch.is_tensor(value) or shape is not None:
            dtype = value.dtype if torch.is_tensor(value) else (dtypes or {}).get(key) or torch.float32
            probe = torch.empty(tuple(value.shape) if torch.is_tensor(value) else shape, dtype=dtype, device="meta")
            probes[_storage(probe)] = (probe, key)
            values[key] = probe
        else:
            values[key] = value
    stand_ins = _StandIns(view, everything=True)
    recorder = _Copies()
    with stand_ins.installed():
        try:
            with recorder:
                result = view.module.load_state_dict(values, strict=False)
        except RuntimeError as error:  # torch's size mismatches and the modules' own errors
            raise StrictLoadError(f"{source}: {error}") from None
    missing, unexpected = list(result.missing_keys), list(result.unexpected_keys)
    if strict and (missing or unexpected):
        expected = len(values) - len(unexpected) + len(missing)
        raise StrictLoadError(
            f"{source}: checkpoint of another model? {len(missing)} of the model's {expected} keys are missing from "
            f"it and it holds {len(unexpected)} the model does not have; nothing was loaded: keys missing from it "
            f"{shortened(missing)}, unexpected keys {shortened(unexpected)}"
        )
    for destination, origin in recorder.copies:
        _refuse_complex_mismatch(source, probes.get(_storage(origin)), destination)
    params: dict[str, list[ShardedParam]] = {}
    for destination, origin in recorder.copies:
        target = stand_ins.sharded.get(_storage(destination))
        if target is None:
            continue  # into a buffer or a whole parameter: the plain pass loads it
        stand_in, param = target
        probe = probes.get(_storage(origin))
        if probe is None or not _same_layout(origin, probe[0]) or not _same_layout(destination, stand_in):
            raise CheckpointError(
                f"{source}: load_state_dict() of {type(view.module).__name__} fills parameter {param.fqn!r} with "
                "something other than one checkpoint tensor as it is (a module's _load_from_state_dict or hook "
                "transforms it); a sharded model cannot run that on its shards"
            )
        params.setdefault(probe[1], [])
        if param not in params[probe[1]]:
            params[probe[1]].append(param)
    return LoadPlan(params, missing, unexpected)


def _refuse_complex_mismatch(source: Any, probe: tuple[torch.Tensor, str] | None, destination: torch.Tensor) -> None:
    """A complex checkpoint tensor loading into a real one (its imaginary part would be dropped) or a
    real one into a complex tensor (a rotary table saved as its real part: cosines where rotations
    belong) is an error naming the key, never a silent ``copy_``."""
    if probe is not None and probe[0].is_complex() != destination.is_complex():
        stored, live = str(probe[0].dtype).removeprefix("torch."), str(destination.dtype).removeprefix("torch.")
        lost = (
            "drop its imaginary part" if probe[0].is_complex() else "keep only a real part where the model is complex"
        )
        raise CheckpointError(
            f"{source}: the checkpoint holds {probe[1]!r} as {stored} and the model as {live}; loading it would "
            f"{lost}. fsdp_strategy 0.2.0 and earlier saved the complex buffers of a '*-true' model (a rotary table "
            "freqs_cis) as their real part: recompute that tensor (leave it out of the loaded state, or make it a "
            "non-persistent buffer) rather than loading it"
        )


def load_plain(view: ShardsView, values: Mapping[str, Any], plan: LoadPlan) -> None:
    """The second ``load_state_dict``: the real ``values`` of every entry the plan does not load into
    shards (buffers, whole parameters, extra state), the sharded parameters still stand-ins (an
    entry of ``plan.params`` may be given as a meta tensor of its shape)."""
    real = {}
    for key, value in values.items():
        if key in plan.params and not value.is_meta:
            value = torch.empty(value.shape, dtype=value.dtype, device="meta")  # copied into a stand-in: nothing
        real[key] = value
    with _StandIns(view, everything=False).installed(), torch.no_grad():
        view.module.load_state_dict(real, strict=False)
