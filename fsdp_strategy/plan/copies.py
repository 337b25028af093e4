"""The model and the batch as a plan runs them: a copy on the meta device, its parameters given
(fake) storage unit by unit, and the example batch in the dtypes the precision computes in."""

from __future__ import annotations

import copy
import itertools
from typing import Any

import torch
from torch import nn

from fsdp_strategy.config import PrecisionRules
from fsdp_strategy.engine.traversal import map_tensors


def meta_copy(model: nn.Module, configure: bool = True) -> nn.Module:
    """A copy of ``model`` with every parameter and buffer on the meta device (ties kept, nothing
    allocated), a LightningModule's ``configure_model`` run on the meta device (with ``configure``),
    no trainer attached."""
    from lightning.pytorch import LightningModule

    memo: dict[int, Any] = {}
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        meta = tensor.detach().to("meta")
        memo[id(tensor)] = nn.Parameter(meta, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else meta
    for attribute in ("_trainer", "_fabric"):
        attached = getattr(model, attribute, None)
        if attached is not None:
            memo[id(attached)] = None
    copied = copy.deepcopy(model, memo)
    if configure and isinstance(copied, LightningModule):
        with torch.device("meta"):
            copied.configure_model()
    return copied


def allocate(module: nn.Module, device: torch.device) -> None:
    """Give ``module``'s own meta parameters and buffers (fake) storage on ``device``; values are never
    read. New objects, not ``to_empty``'s swap: the fake mode holds weak references to the meta ones."""
    for name, param in module._parameters.items():
        if param is not None and param.is_meta:
            module._parameters[name] = nn.Parameter(torch.empty_like(param, device=device), param.requires_grad)
    for name, buffer in module._buffers.items():
        if buffer is not None and buffer.is_meta:
            module._buffers[name] = torch.empty_like(buffer, device=device)


def planned_input(batch: Any, precision: PrecisionRules, device: torch.device) -> Any:
    """``batch`` as the planned step receives it: each tensor (inside mappings, lists, tuples, named
    tuples and dataclasses, as Lightning's ``convert_input`` enters them) a new one of its shape on
    ``device``, floating ones in the dtype the precision computes in. Under ``FakeTensorMode``: fake."""

    def planned(tensor: torch.Tensor) -> torch.Tensor:
        dtype = precision.input_dtype_of(tensor.dtype)
        return torch.zeros(tensor.shape, dtype=dtype, device=device)

    return map_tensors(batch, planned)
