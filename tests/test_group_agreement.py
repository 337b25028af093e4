"""A param group value one rank changed is an error on every rank, whatever the value is kept as
([Note: param groups agree]): tensors inside a tuple (``betas``), numpy's scalars, integer tensors past
2^53, -0.0, and two tensor values whose changes would cancel in a sum of their bits. Real gloo ranks,
an optimizer that is not torch's own (the only ones compared), the default wrapping and per-Linear
units; the unchanged control trains to one process's weights."""

from __future__ import annotations

import math

import numpy as np
import torch
from dist_utils import run_ranks
from torch import nn

from fsdp_strategy.checkpoint import full_state_dict
from fsdp_strategy.engine import get_scheduler, shard_model

WRAPPINGS = {"default": {}, "per Linear": {"auto_wrap_policy": {nn.Linear}}}
CHANGED_BEFORE = 2  # rank 1 changes the value before this step (counted from 0): the error names step 3


class PlainSGD(torch.optim.Optimizer):
    """SGD with weight decay, reading ``lr``, ``betas[0]`` and ``momentum`` as plain numbers or tensors."""

    def __init__(self, params, lr, betas=(1.0, 0.99), momentum=1.0, weight_decay=0.0):
        super().__init__(params, {"lr": lr, "betas": betas, "momentum": momentum, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            scale = float(group["lr"]) * float(group["betas"][0]) * float(group["momentum"])
            for param in group["params"]:
                if param.grad is not None:
                    param.mul_(1 - float(group["lr"]) * group["weight_decay"]).sub_(param.grad * scale)


def _next_up(tensor: torch.Tensor) -> None:
    tensor.copy_(torch.nextafter(tensor, torch.full_like(tensor, math.inf)))


def _cancelling(optimizer: PlainSGD) -> None:
    """lr's float64 bits up by 3, momentum's down by 3: equal sums of bits, other values."""
    group = optimizer.param_groups[0]
    group["lr"].view(torch.int64).add_(3)
    group["momentum"].view(torch.int64).sub_(3)


CASES = {  # name -> (the optimizer's settings, what rank 1 changes)
    "unchanged": (lambda: {"lr": torch.tensor(0.01)}, None),
    "betas a tuple of tensors, one ulp": (
        lambda: {"lr": 0.01, "betas": (torch.tensor(0.9), torch.tensor(0.99))},
        lambda optimizer: _next_up(optimizer.param_groups[0]["betas"][0]),
    ),
    "a numpy float32 learning rate": (
        lambda: {"lr": np.float32(0.01)},
        lambda optimizer: optimizer.param_groups[0].__setitem__("lr", np.float32(0.02)),
    ),
    "two tensors whose bits change by +3 and -3": (
        lambda: {"lr": torch.tensor(0.01, dtype=torch.float64), "momentum": torch.tensor(0.5, dtype=torch.float64)},
        _cancelling,
    ),
    "an int64 tensor past 2^53, plus one": (
        lambda: {"lr": 0.01, "momentum": torch.tensor(2**60)},
        lambda optimizer: optimizer.param_groups[0]["momentum"].add_(1),
    ),
    "a learning rate of -0.0 for 0.0": (
        lambda: {"lr": torch.tensor(0.0)},
        lambda optimizer: optimizer.param_groups[0]["lr"].neg_(),
    ),
}


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 3)).double()


def _batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(6, 6, dtype=torch.float64, generator=generator) for _ in range(4)]


def _train(model: nn.Module, optimizer: PlainSGD, change, rank: int, world: int) -> str:
    """Train on this rank's rows of each batch; rank 1 applies ``change`` before step ``CHANGED_BEFORE``."""
    try:
        for step, batch in enumerate(_batches()):
            if step == CHANGED_BEFORE and rank == 1 and change is not None:
                change(optimizer)
            model(batch.chunk(world)[rank]).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    except RuntimeError as error:
        return str(error)
    return ""


def _body(rank: int, world: int) -> dict:
    out = {}
    for wrapping, options in WRAPPINGS.items():
        for name, (settings, change) in CASES.items():
            model = shard_model(_mlp(), **options)
            error = _train(model, PlainSGD(model.parameters(), **settings()), change, rank, world)
            out[(wrapping, name)] = (error, full_state_dict(model, rank0_only=False))
            get_scheduler(model).close()
    return out


def test_a_value_one_rank_changed_is_an_error_on_every_rank_however_it_is_kept(tmp_path):
    ranks = run_ranks(_body, 2, tmp_path, timeout=240)
    model = _mlp()
    optimizer = PlainSGD(model.parameters(), **CASES["unchanged"][0]())
    for batch in _batches():  # one process on the global batch: the mean over both ranks' rows
        model(batch).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    for results in ranks:
        for (wrapping, name), (error, weights) in results.items():
            if name == "unchanged":
                assert not error, (wrapping, error)
                for key, value in model.state_dict().items():
                    torch.testing.assert_close(weights[key], value, rtol=1e-12, atol=1e-12)
            else:
                expected = f"param group 0 holds other values on other ranks after its step {CHANGED_BEFORE + 1}"
                assert f"PlainSGD's {expected}" in error, (wrapping, name, error)
