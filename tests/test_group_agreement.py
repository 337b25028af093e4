"""A param group value one rank changed is an error on every rank, whatever the value is kept as
([Note: param groups agree]): tensors inside a tuple (``betas``), numpy scalars and arrays, ``Fraction``,
enum members, integer tensors past 2^53, -0.0, and two tensor values whose changes would cancel in a sum
of their bits; also where the change makes that rank alone measure the optimizer again, or a param
group is added on one rank only. Values equal on
every rank (an object key, a numpy object array, dtype keys) are no error. Real gloo ranks, an optimizer
that is not torch's own (the only ones compared), the default wrapping and per-Linear units; what every
rank agrees on trains to one process's weights."""

from __future__ import annotations

import enum
import math
from fractions import Fraction

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

    def __init__(self, params, lr, betas=(1.0, 0.99), momentum=1.0, weight_decay=0.0, **others):
        defaults = {"lr": lr, "betas": betas, "momentum": momentum, "weight_decay": weight_decay}
        super().__init__(params, {**defaults, **others})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            scale = float(group["lr"]) * float(group["betas"][0]) * float(group["momentum"])
            for param in group["params"]:
                if param.grad is not None:
                    param.mul_(1 - float(group["lr"]) * group["weight_decay"]).sub_(param.grad * scale)


class NormSGD(PlainSGD):
    """Steps each parameter by its gradient over the gradient's norm: measured as reading each one whole,
    so placed whole ([Note: whole-matrix placement])."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    param.mul_(1 - float(group["lr"]) * group["weight_decay"])
                    param.sub_(param.grad / param.grad.norm().clamp_min(1e-12) * float(group["lr"]))


def _next_up(tensor: torch.Tensor) -> None:
    tensor.copy_(torch.nextafter(tensor, torch.full_like(tensor, math.inf)))


def _cancelling(optimizer: PlainSGD) -> None:
    """lr's float64 bits up by 3, momentum's down by 3: equal sums of bits, other values."""
    group = optimizer.param_groups[0]
    group["lr"].view(torch.int64).add_(3)
    group["momentum"].view(torch.int64).sub_(3)


class Phase(enum.Enum):
    ADAM = 1
    SGD = 2


def _weight_decay_raised(optimizer: PlainSGD) -> None:
    optimizer.param_groups[0]["weight_decay"] = 0.01  # from 0: may switch a branch, so it is measured again


LEFT_OUT: dict[int, nn.Parameter] = {}  # id of an optimizer -> the parameter it was built without


def _optimizer(model: nn.Module, settings: dict) -> PlainSGD:
    """A ``NormSGD`` for ``placed_whole``, else a ``PlainSGD``; ``leave_out``: without the last parameter."""
    values = dict(settings)
    kind = NormSGD if values.pop("placed_whole", False) else PlainSGD
    params = list(model.parameters())
    left_out = params.pop() if values.pop("leave_out", False) else None
    optimizer = kind(params, **values)
    LEFT_OUT[id(optimizer)] = left_out
    return optimizer


def _group_added(optimizer: PlainSGD) -> None:
    """The last Linear's bias, which the optimizer was built without, as a group of its own."""
    optimizer.add_param_group({"params": [LEFT_OUT[id(optimizer)]]})


AGREED = {  # name -> (the optimizer's settings, what every rank changes): no error, one process's weights
    "unchanged": (lambda: {"lr": torch.tensor(0.01)}, None),
    "weight decay raised from 0 on every rank (measured again)": (lambda: {"lr": 0.01}, _weight_decay_raised),
    "a param group added on every rank (measured again)": (lambda: {"lr": 0.01, "leave_out": True}, _group_added),
    "equal values kept as objects": (
        lambda: {
            "lr": 0.01,
            "held": np.array([float("0.9")], dtype=object),  # its bytes are addresses, other ones on each rank
            "by_dtype": {torch.float32: None, torch.bfloat16: 0.1},  # keys alike as plain data: not sorted by value
            "phase": Phase.ADAM,
        },
        None,
    ),
}
MEASURED_APART = {  # name -> (settings, what rank 1 changes): measured again on rank 1 only
    "a param group added": (lambda: {"lr": 0.01, "leave_out": True}, _group_added),
    "placed whole, weight decay raised from 0": (lambda: {"lr": 0.01, "placed_whole": True}, _weight_decay_raised),
    "weight decay raised from 0": (lambda: {"lr": 0.01}, _weight_decay_raised),
    "a tensor weight decay filled in place with its own value": (
        lambda: {"lr": 0.01, "weight_decay": torch.tensor(0.0)},
        lambda optimizer: optimizer.param_groups[0]["weight_decay"].fill_(0.0),
    ),
    "an enum member": (
        lambda: {"lr": 0.01, "phase": Phase.ADAM},
        lambda optimizer: optimizer.param_groups[0].__setitem__("phase", Phase.SGD),
    ),
}
CASES = {  # name -> (settings, what rank 1 changes): a value that differs, measured again nowhere
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
    "betas a numpy array": (
        lambda: {"lr": 0.01, "betas": np.array([0.9, 0.99])},
        lambda optimizer: optimizer.param_groups[0]["betas"].__setitem__(1, 0.999),
    ),
    "a Fraction learning rate": (
        lambda: {"lr": Fraction(1, 100)},
        lambda optimizer: optimizer.param_groups[0].__setitem__("lr", Fraction(1, 50)),
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


def _train(model: nn.Module, optimizer: PlainSGD, change, rank: int | None, world: int) -> str:
    """Train on this rank's rows of each batch (``rank`` None: one process on the global batch); ``change``
    before step ``CHANGED_BEFORE``."""
    try:
        for step, batch in enumerate(_batches()):
            if step == CHANGED_BEFORE and change is not None:
                change(optimizer)
            model(batch if rank is None else batch.chunk(world)[rank]).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    except RuntimeError as error:
        return str(error)
    return ""


def _body(rank: int, world: int) -> dict:
    padding = [object() for _ in range(1000 * rank)]  # objects at other addresses on each rank, as in processes
    out = {"padding": len(padding)}
    for wrapping, options in WRAPPINGS.items():
        for name, (settings, change) in {**AGREED, **MEASURED_APART, **CASES}.items():
            model = shard_model(_mlp(), collective_timeout=20, **options)  # a hang ends in 20 s
            changed = change if name in AGREED or rank == 1 else None
            error = _train(model, _optimizer(model, settings()), changed, rank, world)
            out[(wrapping, name)] = (error, full_state_dict(model, rank0_only=False))
            get_scheduler(model).close()
    return out


def test_a_value_one_rank_changed_is_an_error_on_every_rank_however_it_is_kept(tmp_path):
    """Also where the change makes only that rank measure the optimizer again (before: a hang until the
    collective timeout, the ranks in two different collectives)."""
    ranks = run_ranks(_body, 2, tmp_path, timeout=240)
    oracle = {}
    for name, (settings, change) in AGREED.items():
        model = _mlp()
        assert not _train(model, _optimizer(model, settings()), change, None, 2)
        oracle[name] = model.state_dict()
    changed = f"param group 0 holds other values on other ranks after its step {CHANGED_BEFORE + 1}"
    for results in ranks:
        del results["padding"]
        for (wrapping, name), (error, weights) in results.items():
            if name in AGREED:
                assert not error, (wrapping, name, error)
                for key, value in oracle[name].items():
                    torch.testing.assert_close(weights[key], value, rtol=1e-12, atol=1e-12)
            elif name in MEASURED_APART:
                kind = "NormSGD" if "placed whole" in name else "PlainSGD"
                apart = f"{kind}'s param groups or attributes were changed between its steps on some ranks only"
                if "added" in name:
                    apart = f"{kind} holds"
                    assert "param group(s) here and another number on other ranks" in error, (wrapping, error)
                assert apart in error, (wrapping, name, error)
            else:
                assert f"PlainSGD's {changed}" in error, (wrapping, name, error)
