"""Optimizers written for the tests: each one a way an optimizer can defeat a measurement or a
placement (state kept outside ``optimizer.state``, state that appears after the first step, a global
statistic that moves only after a few steps)."""

from __future__ import annotations

import time

import torch


class KeyedByParameter(torch.optim.Optimizer):
    """Normalized momentum, kept in a dict keyed by the parameter object (not in ``self.state``): it
    reads whole parameters, and placing it whole must hand it the same object at every step."""

    def __init__(self, params, lr: float = 1e-2) -> None:
        super().__init__(params, {"lr": lr})
        self.memory: dict[torch.Tensor, torch.Tensor] = {}

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                momentum = self.memory.setdefault(p, torch.zeros_like(p))
                momentum.mul_(0.9).add_(p.grad)
                p.add_(momentum / (momentum.norm() + 1e-12), alpha=-group["lr"])


class LateState(torch.optim.Optimizer):
    """Normalized gradients; from step ``late`` on an average of the parameter (a new state entry of
    the parameter's shape) pulls the update."""

    def __init__(self, params, lr: float = 1e-2, late: int = 2) -> None:
        super().__init__(params, {"lr": lr})
        self.late = late

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                state["n"] = state.get("n", 0) + 1
                update = p.grad / (p.grad.norm() + 1e-12)
                if state["n"] >= self.late:
                    average = state.setdefault("average", p.detach().clone())
                    average.lerp_(p, 0.5)
                    update = update + 0.1 * (p - average)
                p.add_(update, alpha=-group["lr"])


class SlowGlobal(torch.optim.Optimizer):
    """SGD whose step size, after ``warmup`` steps (a number no hyperparameter announces as a step
    count), divides by the root of the mean squared gradient norm over every parameter so far: a
    global statistic that changes no update during the first steps."""

    def __init__(self, params, lr: float = 1e-2, warmup: int = 12) -> None:
        super().__init__(params, {"lr": lr})
        self.total, self.count, self._after = 0.0, 0, warmup

    @torch.no_grad()
    def step(self, closure=None):
        self.count += 1
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        self.total += sum(float(g.square().sum()) for g in grads)
        scale = 1.0 if self.count <= self._after else (self.total / self.count) ** -0.5
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"] * scale)


class DropsEntry(torch.optim.Optimizer):
    """Normalized gradients scaled by 2 while a scalar state entry lasts; the step deletes it at step 3."""

    def __init__(self, params, lr: float = 1e-2) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                state["n"] = state.get("n", 0) + 1
                if state["n"] == 1:
                    state["warm"] = 2.0
                elif state["n"] == 3:
                    del state["warm"]
                p.add_(p.grad / (p.grad.norm() + 1e-12), alpha=-group["lr"] * state.get("warm", 1.0))


class ClosureTwice(torch.optim.Optimizer):
    """Normalized gradients; evaluates the closure again after its update (for the loss it reports)."""

    def __init__(self, params, lr: float = 1e-2) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            with torch.enable_grad():
                closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad / (p.grad.norm() + 1e-12), alpha=-group["lr"])
        if closure is not None:
            with torch.enable_grad():
                return closure()
        return None


class StacksItsGroup(torch.optim.Optimizer):
    """Normalized gradients, computed for a group at once with ``torch.stack`` of its norms: a group
    with no parameter to step raises."""

    def __init__(self, params, lr: float = 1e-2) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            norms = torch.stack([p.grad.norm() for p in params])
            for p, norm in zip(params, norms):
                p.add_(p.grad / (norm + 1e-12), alpha=-group["lr"])


class DropsRowState(torch.optim.Optimizer):
    """Normalized momentum of the parameter's shape until step 4, where it is dropped for good (plain
    normalized gradients after)."""

    def __init__(self, params, lr: float = 1e-2) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                state["n"] = state.get("n", 0) + 1
                if state["n"] >= 4:
                    state.pop("m", None)
                    p.add_(p.grad / (p.grad.norm() + 1e-12), alpha=-group["lr"])
                    continue
                m = state.setdefault("m", torch.zeros_like(p)).mul_(0.9).add_(p.grad)
                p.add_(m / (m.norm() + 1e-12), alpha=-group["lr"])


class GroupCounter(torch.optim.Optimizer):
    """Normalized momentum with bias correction by a step counter of the param group that advances only
    when the group has a gradient (as many hand-written optimizers skip an empty group)."""

    def __init__(self, params, lr: float = 1e-2) -> None:
        super().__init__(params, {"lr": lr, "t": 0})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            group["t"] += 1
            for p in params:
                m = self.state[p].setdefault("m", torch.zeros_like(p)).mul_(0.9).add_(p.grad, alpha=0.1)
                corrected = m / (1 - 0.9 ** group["t"])
                p.add_(corrected / (corrected.norm() + 1e-12), alpha=-group["lr"])


class MaxNormSGD(torch.optim.Optimizer):
    """SGD with each parameter projected back onto the ball of radius ``max_norm``: only a parameter
    whose norm exceeds it takes the branch (of two of one shape, maybe only the second)."""

    def __init__(self, params, lr: float = 1e-4, max_norm: float = 20.0) -> None:
        super().__init__(params, {"lr": lr, "max_norm": max_norm})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                p.add_(p.grad, alpha=-group["lr"])
                norm = p.norm()
                if norm > group["max_norm"]:
                    p.mul_(group["max_norm"] / norm)


class ToggleNorm(torch.optim.Optimizer):
    """Momentum SGD; the param group's flag ``normalize`` (the user sets it later) normalizes each
    parameter's update, which then reads the whole parameter."""

    def __init__(self, params, lr: float = 1e-2, normalize: bool = False) -> None:
        super().__init__(params, {"lr": lr, "normalize": normalize})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                m = self.state[p].setdefault("m", torch.zeros_like(p)).mul_(0.9).add_(p.grad)
                p.add_(m / (m.norm() + 1e-12) if group["normalize"] else m, alpha=-group["lr"])


class TensorLearningRate(torch.optim.Optimizer):
    """SGD with its learning rate kept as a tensor, set in place at step ``switch`` from the largest
    gradient element its step sees (on a shard: this rank's)."""

    def __init__(self, params, lr: float = 1e-2, switch: int = 12) -> None:
        super().__init__(params, {"lr": torch.tensor(lr, dtype=torch.float64)})
        self.count, self.switch = 0, switch

    @torch.no_grad()
    def step(self, closure=None):
        self.count += 1
        for group in self.param_groups:
            grads = [p.grad for p in group["params"] if p.grad is not None]
            if self.count == self.switch and grads:
                group["lr"].fill_(0.01 / (1.0 + 10 * max(float(g.abs().max()) for g in grads)))
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad * -group["lr"])


class GlobalScaleLater(torch.optim.Optimizer):
    """SGD whose step size, from step ``switch``, divides by the norm of every gradient it steps, kept
    as an attribute."""

    def __init__(self, params, lr: float = 1e-2, switch: int = 12) -> None:
        super().__init__(params, {"lr": lr})
        self.count, self.switch, self.scale = 0, switch, 1.0

    @torch.no_grad()
    def step(self, closure=None):
        self.count += 1
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        if self.count >= self.switch:
            self.scale = 1.0 / (1e-3 + sum(float(g.square().sum()) for g in grads) ** 0.5)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"] * self.scale)


class NaNAttribute(torch.optim.SGD):
    """torch's SGD with an attribute holding NaN that nothing reads (a best loss not known yet)."""

    def __init__(self, params, lr: float = 1e-2) -> None:
        super().__init__(params, lr=lr)
        self.best_loss = float("nan")


class NormAdam(torch.optim.Optimizer):
    """Adam with its step count kept per parameter; the param group's flag ``normalize`` divides each
    update by its norm (then it reads whole parameters)."""

    def __init__(self, params, lr: float = 1e-2, normalize: bool = True) -> None:
        super().__init__(params, {"lr": lr, "normalize": normalize})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if len(state) == 0:
                    state.update(step=0, m=torch.zeros_like(p), v=torch.zeros_like(p))
                state["step"] += 1
                state["m"].mul_(0.9).add_(p.grad, alpha=0.1)
                state["v"].mul_(0.99).addcmul_(p.grad, p.grad, value=0.01)
                update = (state["m"] / (1 - 0.9 ** state["step"])) / (
                    (state["v"] / (1 - 0.99 ** state["step"])).sqrt() + 1e-8
                )
                if group["normalize"]:
                    update = update / (update.norm() + 1e-12)
                p.add_(update, alpha=-group["lr"])


class TensorScaleLater(GlobalScaleLater):
    """``GlobalScaleLater`` with its scale kept as a 0-dim tensor attribute, written in place."""

    def __init__(self, params, lr: float = 1e-2, switch: int = 12) -> None:
        super().__init__(params, lr, switch)
        self.scale = torch.ones((), dtype=torch.float64)

    @torch.no_grad()
    def step(self, closure=None):
        self.count += 1
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        if self.count >= self.switch:
            self.scale.fill_(1.0 / (1e-3 + sum(float(g.square().sum()) for g in grads) ** 0.5))
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad * (-group["lr"] * self.scale))


class NaNGroupValue(torch.optim.SGD):
    """torch's SGD with a param group value holding NaN that nothing reads (a last loss not known yet)."""

    def __init__(self, params, lr: float = 1e-2) -> None:
        super().__init__(params, lr=lr)
        for group in self.param_groups:
            group["last_loss"] = float("nan")


class TimedSGD(torch.optim.SGD):
    """torch's SGD that records when its last step ended (bookkeeping its update never reads)."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = super().step(closure)
        self._last_step_time = time.time()
        return loss


class RowNormSGD(torch.optim.Optimizer):
    """SGD with each matrix's gradient divided by its rows' norms (Adam-mini-style statistics per
    output neuron): an element's update reads its row only. Exact on dim-0 row shards, not on a
    tensor-parallel block of columns (a RowwiseParallel weight's Shard(1))."""

    def __init__(self, params, lr: float = 0.01) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                if grad.ndim == 2:
                    grad = grad / (grad.norm(dim=1, keepdim=True) + 1e-8)
                p.add_(grad, alpha=-group["lr"])
