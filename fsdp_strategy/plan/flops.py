"""FlopCount: the floating-point operations of what runs under it, by torch's own formulas.

torch's ``FlopCounterMode`` also attributes FLOPs to modules through a ``ModuleTracker``, whose
hooks on every module's inputs and outputs form reference cycles with autograd nodes: the
saved tensors of those nodes then live until Python's cycle collector runs, not until backward
has used them. A plan counting live bytes at the same time would see activations a training
run has freed (up to +18 % at the peak with activation checkpointing). This mode keeps only the
total and registers no hooks. It uses ``torch.utils.flop_counter.flop_registry``; the CPU
variants of flash attention are counted by the CUDA kernels' formulas (same shapes, same work).
Operators without a formula count zero (elementwise work, as ``FlopCounterMode`` has it). A
tensor-parallel (DTensor) operator is counted by the local operators it runs: what this rank computes.

Costs: one dict lookup per operator.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from fsdp_strategy.plan.tracker import SHADOWS

aten = torch.ops.aten
_FORMULAS = {
    **flop_registry,
    aten._scaled_dot_product_flash_attention_for_cpu: flop_registry[aten._scaled_dot_product_flash_attention],
    aten._scaled_dot_product_flash_attention_for_cpu_backward: flop_registry[
        aten._scaled_dot_product_flash_attention_backward
    ],
}


class FlopCount(TorchDispatchMode):
    """The total FLOPs of the operators dispatched under it (``total``)."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor runs its local operators, which come back here: this rank's work
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = _FORMULAS.get(func._overloadpacket)
        if formula is not None and not SHADOWS.depth:  # not DTensor's global-shape stand-ins
            self.total += formula(*args, **kwargs, out_val=out)
        return out
