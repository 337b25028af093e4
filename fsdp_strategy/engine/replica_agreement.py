"""Tensor-parallel replicas that train apart: an error naming the parameters, read without a host wait.

[Note: TP replicas agree]
A plain parameter of a tensor-parallel model (a norm, an unsplit attention or head) is replicated
over TP: every rank of a TP group holds it and must compute the same gradient, since they see the
same rows and, after TP's collectives, the same activations. A plan can break that without an
error: a norm applied to sequence-sharded activations (after ``SequenceParallel`` or a
``RowwiseParallel`` with ``output_layouts=Shard(1)``) without the ``SequenceParallel`` style itself
computes its weight's gradient from this rank's part of the sequence only. The engine reduces it
over data parallel, not TP, so each TP rank would step its own copy: a silent divergence. So after
each backward that reduced gradients, every rank fingerprints the gradient shard of each
TP-replicated parameter (its sum and the sum of its absolute values, in float64, where it lives),
and one all-reduce MAX over the TP group of the fingerprints and their negations finds the ones
whose maximum and minimum differ by more than ``TOLERANCE`` of their size (healthy replicas agree
to the bit; a sequence split differs by orders more). The verdict is read by the rule of
``LostEdits`` ([Note: edits while gathered] in edits.py): on the CPU at once, on CUDA a backward
later, at ``close`` the rest. Costs per backward of a TP model: two reductions per replicated
parameter and an all-reduce of 32 bytes per replicated parameter over TP.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

import torch
from torch._subclasses.fake_tensor import FakeTensor

from fsdp_strategy.engine import collectives
from fsdp_strategy.engine.collectives import CommContext, CommGroup
from fsdp_strategy.engine.device import DeviceLayer, HostCopy
from fsdp_strategy.engine.flat import real_view
from fsdp_strategy.engine.param import ShardedParam

TOLERANCE = 1e-3  # relative difference of fingerprints that counts as apart


class _Sent(NamedTuple):
    copy: HostCopy  # per parameter: whether the TP ranks' gradients differ
    backward: int  # counted from 1


class ReplicaAgreement:
    """Compares the gradients of a model's TP-replicated parameters across each TP group after every
    backward that reduced ([Note: TP replicas agree]). Costs: see the note."""

    def __init__(self, params: list[ShardedParam], comm: CommGroup, ctx: CommContext, device: torch.device) -> None:
        self._params, self._comm, self._ctx, self._device = params, comm, ctx, device
        self._sent: deque[_Sent] = deque()
        self._backwards = 0

    @classmethod
    def of(cls, params: list[ShardedParam], ctx: CommContext, device: torch.device) -> ReplicaAgreement | None:
        """The check of a model's parameters; None for a model without tensor parallel (or without a
        TP-replicated parameter)."""
        spec = next((p.tp for p in params if p.tp is not None and p.tp.size > 1), None)
        replicated = [p for p in params if p.tp is None or not p.tp.sharded]
        if spec is None or not replicated:
            return None
        return cls(replicated, CommGroup.of(spec.mesh.get_group()), ctx, device)

    def send(self) -> None:
        """Start the comparison of this backward's gradients (every rank, at the same place); reads
        nothing. Then raises for the comparisons that are due."""
        self._backwards += 1
        prints = torch.stack([_fingerprint(p.sharded.grad, self._device) for p in self._params])
        both = torch.cat([prints, -prints])
        collectives.all_reduce(both, self._comm, self._ctx, "tensor-parallel replicas", op="max").wait()
        highest, lowest = both[: len(self._params)], -both[len(self._params) :]
        scale = torch.maximum(highest[:, 1].abs(), lowest[:, 1].abs())
        differ = ((highest - lowest).abs() > TOLERANCE * scale[:, None]).any(dim=1)
        self._sent.append(_Sent(DeviceLayer.copy_to_host(differ), self._backwards))
        self.raise_due()

    def raise_due(self, everything: bool = False) -> None:
        """Raise for the first comparison due that found gradients apart. Due: on the CPU every one
        sent; on CUDA every one but the last; ``everything``: the last too (outside a step only)."""
        due = len(self._sent)
        if not everything and self._sent and self._sent[-1].copy.event is not None:
            due -= 1
        for _ in range(due):
            sent = self._sent.popleft()
            verdict = sent.copy.wait()
            if isinstance(verdict, FakeTensor):  # a memory plan computes no verdict
                continue
            differ = verdict.tolist()
            apart = [p.fqn for p, flag in zip(self._params, differ) if flag]
            if apart:
                self._sent.clear()
                raise RuntimeError(_apart_message(apart, sent.backward))


def _fingerprint(grad: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """(sum, sum of absolute values) of a gradient shard in float64 on ``device``; (0, -1) without one
    (filled on the device: ``torch.tensor`` would copy from the host, a host wait on CUDA)."""
    if grad is None:
        return torch.cat([torch.full((1,), value, dtype=torch.float64, device=device) for value in (0.0, -1.0)])
    values = real_view(grad.detach()).to(torch.float64)
    return torch.stack([values.sum(), values.abs().sum()]).to(device)


def _apart_message(names: list[str], backward: int) -> str:
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return (
        f"fsdp_custom: the tensor-parallel-replicated parameters {shown} got different gradients on the ranks of a "
        f"tensor-parallel group (backward {backward}): each rank would train its own copy of them. A module that "
        "computes on sequence-sharded activations (after SequenceParallel, or a RowwiseParallel with "
        "output_layouts=Shard(1)) needs the SequenceParallel style itself (a norm), or a plan that gives it "
        "replicated inputs (PrepareModuleInput with desired_input_layouts=Replicate()); and the ranks of a "
        "tensor-parallel group must be fed the same rows (a sampler over the data-parallel ranks only: the "
        "strategy's own, or DistributedSampler(num_replicas=data-parallel size, rank=data-parallel rank))"
    )
