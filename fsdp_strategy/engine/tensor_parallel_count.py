"""Tensor parallel's own collectives, counted into the communication ledger apart from the engine's.

[Note: counting tensor parallel's collectives]
With a tensor-parallel plan, DTensor communicates too: the all-reduce after a row-wise Linear,
SequenceParallel's all-gathers and reduce-scatters, ``loss_parallel``'s reductions, a gradient
redistributed to its TP placement. It issues them as functional collectives
(``torch.ops._c10d_functional``, ``_c10d_functional_autograd``, ``_dtensor.shard_dim_alltoall``),
which the engine never uses (its own go through ``torch.distributed``: collectives.py), so a
``TorchDispatchMode`` that counts those operators counts tensor parallel's traffic and nothing of
the engine's. Each is recorded in ``CommLedger.tensor_parallel`` with its buffer size and the bytes
a ring algorithm sends, as the engine's are; no times (DTensor waits where it uses the result).

Costs: while entered, every operator of the step passes through one Python call (a few
microseconds each), so ``CommunicationMonitor`` enters it only on the steps it logs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_strategy.engine.ledger import CommLedger

_NAMESPACES = ("_c10d_functional", "_c10d_functional_autograd", "c10d_functional", "_dtensor")


def _bytes(tensors: Any) -> int:
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    return sum(_bytes(tensor) for tensor in tensors)


def _size(group: Any) -> int:
    if isinstance(group, dist.ProcessGroup):
        return group.size()
    return dist.distributed_c10d._resolve_process_group(group).size()


def _gathered(args: tuple) -> tuple[int, int]:  # (input, group_size, group): the output is group_size inputs
    payload = _bytes(args[0]) * args[1]
    return payload, payload * (args[1] - 1) // args[1]


def _scattered(args: tuple) -> tuple[int, int]:  # (input, reduce_op, group_size, group)
    payload = _bytes(args[0])
    return payload, payload * (args[2] - 1) // args[2]


def _reduced(args: tuple) -> tuple[int, int]:  # (input, reduce_op, group)
    payload, size = _bytes(args[0]), _size(args[2])
    return payload, 2 * payload * (size - 1) // size


def _exchanged(args: tuple) -> tuple[int, int]:  # (input, ..., group) as the last argument
    payload, size = _bytes(args[0]), _size(args[-1])
    return payload, payload * (size - 1) // size


_KINDS: dict[str, tuple[str, Callable[[tuple], tuple[int, int]]]] = {
    "all_reduce": ("all_reduce", _reduced),
    "all_reduce_": ("all_reduce", _reduced),
    "all_reduce_coalesced": ("all_reduce", _reduced),
    "all_gather_into_tensor": ("all_gather", _gathered),
    "all_gather_into_tensor_out": ("all_gather", _gathered),
    "all_gather_into_tensor_coalesced": ("all_gather", _gathered),
    "reduce_scatter_tensor": ("reduce_scatter", _scattered),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", _scattered),
    "all_to_all_single": ("all_to_all", _exchanged),
    "shard_dim_alltoall": ("all_to_all", _exchanged),
    "broadcast": ("broadcast", _exchanged),
    "broadcast_": ("broadcast", _exchanged),
}


class TensorParallelCount(TorchDispatchMode):
    """While entered, counts each functional collective (tensor parallel's, DTensor's) into
    ``ledger.tensor_parallel`` per kind (``all_reduce``, ``all_gather``, ``reduce_scatter``,
    ``all_to_all``, ``broadcast``): calls, payload bytes, ring wire bytes. The engine's own
    collectives are not seen ([Note: counting tensor parallel's collectives]).

    Costs: one Python call per operator run inside it.
    """

    def __init__(self, ledger: CommLedger) -> None:
        super().__init__()
        self.ledger = ledger

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if any(issubclass(kind, DTensor) for kind in types):
            return NotImplemented  # DTensor runs first and desugars into the collectives counted here
        out = func(*args, **(kwargs or {}))
        if isinstance(func, torch._ops.OpOverload) and func.namespace in _NAMESPACES:
            known = _KINDS.get(func._opname)
            if known is not None:
                kind, sizes = known
                self.ledger.record_tensor_parallel(kind, *sizes(args))
        return out
