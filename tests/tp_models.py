"""A tiny transformer-shaped model and its tensor-parallel plans, as Lightning's
``examples/pytorch/tensor_parallel`` writes them (made tiny), for the 2-D tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

VOCAB, DIM, HIDDEN, SEQ = 16, 8, 16, 4


class FeedForward(nn.Module):
    """SwiGLU as in Llama: w2(silu(w1(x)) * w3(x))."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM)
        self.w3 = nn.Linear(DIM, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.ff = FeedForward()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ff(self.norm(x))


class TinyLM(nn.Module):
    """Embedding, two blocks, a final norm and an output projection."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(DIM)
        self.out = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.out(self.norm(h))


def parallelize(
    model: TinyLM, mesh, sequence_parallel: bool = False, loss_parallel: bool = False, norms_forgotten: bool = False
) -> TinyLM:
    """Lightning's example's plan: rowwise embedding, colwise w1/w3, rowwise w2, colwise output; with
    ``sequence_parallel`` the norms run on sequence-sharded activations (SequenceParallel).
    ``norms_forgotten``: the blocks' norms lack their SequenceParallel style (a plan's mistake)."""
    out_layout = Shard(-1) if loss_parallel else Replicate()
    if sequence_parallel:
        plan = {
            "tok": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "out": ColwiseParallel(
                input_layouts=Shard(1), output_layouts=out_layout, use_local_output=not loss_parallel
            ),
        }
    else:
        plan = {
            "tok": RowwiseParallel(input_layouts=Replicate()),
            "out": ColwiseParallel(output_layouts=out_layout, use_local_output=not loss_parallel),
        }
    parallelize_module(model, mesh, plan)
    for block in model.layers:
        block_plan = {
            "ff.w1": ColwiseParallel(),
            "ff.w2": RowwiseParallel(output_layouts=Shard(1) if sequence_parallel else Replicate()),
            "ff.w3": ColwiseParallel(),
        }
        if sequence_parallel and not norms_forgotten:
            block_plan["norm"] = SequenceParallel()
        if sequence_parallel:
            block_plan["ff"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        parallelize_module(block, mesh, block_plan)
    return model


def batches(steps: int, batch: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` global batches of (tokens, targets)."""
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(0, VOCAB, (batch, SEQ), generator=g), torch.randint(0, VOCAB, (batch, SEQ), generator=g))
        for _ in range(steps)
    ]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def parallelize_on_mesh(model: TinyLM, device_mesh) -> TinyLM:
    """``parallelize`` as a ``parallelize_fn`` (Fabric's and the memory plan's ``(module, device_mesh)``)."""
    return parallelize(model, device_mesh["tensor_parallel"])


def parallelize_sequence_on_mesh(model: TinyLM, device_mesh) -> TinyLM:
    """``parallelize`` with sequence parallel, as a ``parallelize_fn``."""
    return parallelize(model, device_mesh["tensor_parallel"], sequence_parallel=True)
