"""Weights changed inside a training step ([Note: edits while gathered]): a GAN recomputing the
generator after its step, two optimizer steps on one batch, WGAN clipping with ``p.data.clamp_``,
an EMA updated after a manual step, a MoCo momentum encoder replaced by ``p.data = ...``, and a
``requires_grad_`` toggle in the step. Each runs under fsdp_custom with the default wrapping (the
whole model one unit, gathered for the whole step) and with per-module units, at world 2 and 3;
the oracle is the same LightningModule trained by Lightning on one device with the global batch
(what DDP computes). Losses and every final weight (the EMA's and the momentum encoder's too)
must agree."""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_utils import run_ranks
from pattern_models import DIM, MLPBlock
from test_strategy import LIGHTNING_ENV, quiet_trainer
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from fsdp_strategy import FSDPCustomStrategy, MixedPrecision
from fsdp_strategy.checkpoint import full_state_dict
from fsdp_strategy.engine import shard_model, summon_full_params

PER_RANK = 2
STEPS = 3


class Pattern(L.LightningModule):
    """A generator and a critic; ``training_step`` is the pattern's."""

    def __init__(self) -> None:
        super().__init__()
        self.generator = nn.Sequential(nn.Linear(4, DIM), MLPBlock())
        self.critic = nn.Sequential(MLPBlock(), nn.Linear(DIM, 1))
        self.losses: list[torch.Tensor] = []

    def critic_loss(self, noise: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        fake = self.generator(noise).detach()  # recomputed: must see the generator as it is now
        return F.softplus(-self.critic(real)).mean() + F.softplus(self.critic(fake)).mean()

    def configure_optimizers(self):
        return [
            torch.optim.Adam(self.generator.parameters(), lr=1e-2),
            torch.optim.Adam(self.critic.parameters(), lr=1e-2),
        ]


class GAN(Pattern):
    """Lightning's GAN tutorial: the critic's step regenerates with the stepped generator."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        noise, real = batch
        opt_g, opt_d = self.optimizers()
        self.toggle_optimizer(opt_g)
        g_loss = F.softplus(-self.critic(self.generator(noise))).mean()
        self.manual_backward(g_loss)
        opt_g.step()
        opt_g.zero_grad()
        self.untoggle_optimizer(opt_g)
        self.toggle_optimizer(opt_d)
        d_loss = self.critic_loss(noise, real)
        self.manual_backward(d_loss)
        opt_d.step()
        opt_d.zero_grad()
        self.untoggle_optimizer(opt_d)
        self.losses.append(torch.stack([g_loss, d_loss]).detach())


class TwoSteps(Pattern):
    """Two optimizer steps of the critic on one batch; the second loss sees the first step."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        noise, real = batch
        _, opt_d = self.optimizers()
        losses = []
        for _ in range(2):
            loss = self.critic_loss(noise, real)
            self.manual_backward(loss)
            opt_d.step()
            opt_d.zero_grad()
            losses.append(loss.detach())
        self.losses.append(torch.stack(losses))


class WGANClip(Pattern):
    """A critic step, then its weights clipped in place through ``.data``."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        noise, real = batch
        _, opt_d = self.optimizers()
        loss = self.critic_loss(noise, real)
        self.manual_backward(loss)
        opt_d.step()
        opt_d.zero_grad()
        for param in self.critic.parameters():
            param.data.clamp_(-0.05, 0.05)
        self.losses.append(loss.detach().reshape(1))


class EMA(Pattern):
    """An EMA copy of the critic (frozen parameters of the same module) updated after a manual step."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.ema = copy.deepcopy(self.critic).requires_grad_(False)

    def training_step(self, batch, batch_idx):
        noise, real = batch
        _, opt_d = self.optimizers()
        loss = self.critic_loss(noise, real)
        self.manual_backward(loss)
        opt_d.step()
        opt_d.zero_grad()
        with torch.no_grad():
            for average, param in zip(self.ema.parameters(), self.critic.parameters()):
                average.mul_(0.5).add_(param, alpha=0.5)
        self.losses.append(loss.detach().reshape(1))


class MoCo(Pattern):
    """Automatic optimization; a momentum encoder (frozen) replaced by ``p.data = ...`` in the step."""

    def __init__(self) -> None:
        super().__init__()
        self.momentum = copy.deepcopy(self.critic).requires_grad_(False)

    def training_step(self, batch, batch_idx):
        noise, real = batch
        for key, query in zip(self.momentum.parameters(), self.critic.parameters()):
            key.data = key.data * 0.5 + query.data * 0.5
        loss = self.critic_loss(noise, real) + (self.momentum(real) - self.critic(real)).pow(2).mean()
        self.losses.append(loss.detach().reshape(1))
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.critic.parameters(), lr=1e-2)


class Toggle(Pattern):
    """The generator frozen by ``requires_grad_`` inside the step, unfrozen at the next."""

    def training_step(self, batch, batch_idx):
        noise, real = batch
        self.generator.requires_grad_(batch_idx % 2 == 1)
        loss = F.softplus(-self.critic(self.generator(noise))).mean() + self.critic_loss(noise, real)
        self.losses.append(loss.detach().reshape(1))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class ClampLinear(nn.Linear):
    """A layer that clips its own weight in its forward, through ``.data`` (no trace left)."""

    def forward(self, x):
        self.weight.data.clamp_(-0.2, 0.2)
        return super().forward(x)


class ClampInForward(Pattern):
    """The clipping happens inside the critic's own forward."""

    def __init__(self) -> None:
        super().__init__()
        self.critic[1] = ClampLinear(DIM, 1)

    def training_step(self, batch, batch_idx):
        noise, real = batch
        loss = self.critic_loss(noise, real)
        self.losses.append(loss.detach().reshape(1))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


class EditThenCall(ClampInForward):
    """A weight scaled in place (no grad) in training_step right before its module runs: a gather
    issued ahead of the call (prefetch) must not hand the module the old values."""

    def training_step(self, batch, batch_idx):
        with torch.no_grad():
            self.critic[1].weight.mul_(0.9)
        return super().training_step(batch, batch_idx)


class WGANClampFirst(Pattern):
    """The original WGAN critic iteration: the critic clipped through ``.data`` (no trace) at the start
    of the step, then real samples scored first. A gather issued ahead of the critic's first unit
    (a prefetch from the root, before ``training_step`` ran) must not hand it the unclipped weights."""

    def training_step(self, batch, batch_idx):
        noise, real = batch
        for param in self.critic.parameters():
            param.data.clamp_(-0.2, 0.2)
        loss = F.softplus(-self.critic(real)).mean() + F.softplus(self.critic(self.generator(noise).detach())).mean()
        self.losses.append(loss.detach().reshape(1))
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.critic.parameters(), lr=1e-2)


class WGANClampBetween(WGANClampFirst):
    """The fake samples generated first, then the critic clipped through ``.data``, then scored: a
    gather of the critic issued ahead from the generator's last unit must not carry the old weights."""

    def training_step(self, batch, batch_idx):
        noise, real = batch
        fake = self.generator(noise).detach()
        for param in self.critic.parameters():
            param.data.clamp_(-0.2, 0.2)
        loss = F.softplus(-self.critic(real)).mean() + F.softplus(self.critic(fake)).mean()
        self.losses.append(loss.detach().reshape(1))
        return loss


PATTERNS = {
    "gan": GAN,
    "two_steps": TwoSteps,
    "wgan_clip": WGANClip,
    "ema": EMA,
    "moco": MoCo,
    "toggle": Toggle,
    "clamp_in_forward": ClampInForward,
    "edit_then_call": EditThenCall,
    "wgan_clamp_first": WGANClampFirst,
    "wgan_clamp_between": WGANClampBetween,
}


def _data(world: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(3)
    n = STEPS * PER_RANK * world
    return TensorDataset(torch.randn(n, 4, generator=generator), torch.randn(n, DIM, generator=generator) + 1)


def _fit(name: str, world: int, devices: int, strategy: object = "auto") -> dict:
    torch.manual_seed(0)
    module = PATTERNS[name]()
    trainer = quiet_trainer(devices=devices, max_steps=STEPS, strategy=strategy, use_distributed_sampler=False)
    dataset = _data(world)  # rank r takes samples r, r + world, ...: together the one-device batch
    sampler = DistributedSampler(dataset, shuffle=False) if devices > 1 else None
    batch_size = PER_RANK if devices > 1 else PER_RANK * world
    trainer.fit(module, DataLoader(dataset, batch_size=batch_size, sampler=sampler))
    losses = torch.stack(module.losses)
    if devices > 1:
        dist.all_reduce(losses)
        losses /= devices
        state = full_state_dict(trainer.strategy.model, rank0_only=False)
    else:
        state = {name: value.detach().clone() for name, value in module.state_dict().items()}
    return {"losses": losses, "state": state}


CONFIGS = {  # None: the whole model one unit, the strategy's default
    "default wrapping": (None, "FULL_SHARD"),
    "per-module units": ({MLPBlock, nn.Linear}, "FULL_SHARD"),
    "per-module units, SHARD_GRAD_OP": ({MLPBlock, nn.Linear}, "SHARD_GRAD_OP"),
}


def _sharded_body(rank: int, world: int) -> dict:
    results = {}
    for name in PATTERNS:
        for config, (policy, sharding) in CONFIGS.items():
            strategy = FSDPCustomStrategy(auto_wrap_policy=policy, sharding_strategy=sharding)
            results[name, config] = _fit(name, world, world, strategy)
    return results


@pytest.mark.parametrize("world", [2, 3])
def test_weights_changed_in_the_step_match_one_device(tmp_path, world):
    expected = {name: _fit(name, world, 1) for name in PATTERNS}
    results = run_ranks(_sharded_body, world, tmp_path, env=LIGHTNING_ENV, timeout=400)[0]
    for (name, config), got in results.items():
        want = expected[name]
        what = f"{name} ({config}, world {world})"
        torch.testing.assert_close(
            got["losses"], want["losses"], rtol=1e-5, atol=1e-6, msg=lambda m, what=what: f"{what}: {m}"
        )
        assert got["state"].keys() == want["state"].keys(), what
        for key, value in want["state"].items():
            torch.testing.assert_close(
                got["state"][key], value, rtol=1e-5, atol=1e-6, msg=lambda m, what=what, key=key: f"{what} {key}: {m}"
            )


class L2Penalty(Pattern):
    """An L2 penalty over ``self.parameters()`` computed in training_step."""

    def training_step(self, batch, batch_idx):
        noise, real = batch
        penalty = sum(p.pow(2).sum() for p in self.parameters())
        return self.critic_loss(noise, real) + 1e-3 * penalty

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class WithLBFGS(Toggle):
    def configure_optimizers(self):
        return torch.optim.LBFGS(self.parameters())


def _refused_body(rank: int, world: int) -> dict:
    mixed = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    per_module = {MLPBlock, nn.Linear}
    cases = {
        "wgan_bf16": ("wgan_clip", FSDPCustomStrategy(mixed_precision=mixed)),
        "forward_clamp_bf16": (
            "clamp_in_forward",
            FSDPCustomStrategy(auto_wrap_policy=per_module, mixed_precision=mixed),
        ),
        "l2_on_shards": ("l2", FSDPCustomStrategy(auto_wrap_policy=per_module)),
        "lbfgs": ("lbfgs", FSDPCustomStrategy()),
    }
    PATTERNS.update(l2=L2Penalty, lbfgs=WithLBFGS)
    messages = {}
    for case, (name, strategy) in cases.items():
        try:
            _fit(name, world, world, strategy)
            messages[case] = "no error"
        except (RuntimeError, TypeError) as error:
            messages[case] = str(error)
    return messages


def test_changes_and_computations_that_cannot_be_exact_are_errors(tmp_path):
    messages = run_ranks(_refused_body, 2, tmp_path, env=LIGHTNING_ENV, timeout=240)[0]
    # bfloat16 copies of float32 shards: a change to them cannot be kept exactly
    assert "of unit 'root' were changed while gathered in bfloat16" in messages["wgan_bf16"], messages
    assert "critic.0.norm.weight" in messages["wgan_bf16"]
    assert "float32 shards cannot keep the change exactly" in messages["wgan_bf16"]
    assert "parameters ['critic.1.weight'] of unit 'critic.1'" in messages["forward_clamp_bf16"], messages
    # a loss over shards (per-module units: training_step sees this rank's rows) is refused
    assert "was used in a computation that needs its gradient while it is this rank's shard" in messages["l2_on_shards"]
    assert "LBFGS cannot step sharded parameters" in messages["lbfgs"], messages


class BackwardThenEdit(nn.Module):
    """One unit whose forward runs a backward, then changes row 0 of its weight (rank 0's rows at
    world 2): as manual optimization's training_step does after its last step."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.lin(x)
        out.sum().backward()
        with torch.no_grad():
            self.lin.weight[0].add_(0.123)
        return out.detach()


def _lost_edit_timing_body(rank: int, world: int) -> dict:
    from fsdp_strategy.engine import get_scheduler, shard_model

    mixed = MixedPrecision(param_dtype=torch.bfloat16)
    results = {}
    # NO_SHARD: ranks that run different numbers of forward-only iterations (an uneven predict)
    # issue no collective for the checks: nothing to hang on
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    shard_model(model, sharding_strategy="NO_SHARD", mixed_precision=mixed, auto_wrap_policy={nn.Linear})
    with torch.no_grad():
        for _ in range(3 if rank == 0 else 2):
            model(torch.randn(2, 8))
    get_scheduler(model).close(agree=True)
    results["uneven_forward_only"] = "ok"
    # a change in the last step that only rank 0's rows show: every rank raises at the teardown's close
    torch.manual_seed(0)
    model = BackwardThenEdit()
    shard_model(model, mixed_precision=mixed)
    model(torch.randn(2, 8))
    try:
        get_scheduler(model).close(agree=True)
        results["last_step_edit"] = "no error"
    except RuntimeError as error:
        results["last_step_edit"] = str(error)
    return results


def test_lost_edits_are_raised_on_every_rank_and_forward_only_iterations_need_no_collective(tmp_path):
    first, second = run_ranks(_lost_edit_timing_body, 2, tmp_path, timeout=120)
    assert first["uneven_forward_only"] == second["uneven_forward_only"] == "ok"
    assert "parameters ['lin.weight'] of unit 'root' were changed while gathered in bfloat16" in first["last_step_edit"]
    assert "another rank found a change made while its parameters were gathered" in second["last_step_edit"], second


class TwoLayers(nn.Module):
    """After its own use in forward: ``a.weight`` given new data, then ``b.weight`` data of the wrong shape."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 3)
        self.edit = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.b(self.a(x))
        if self.edit:
            self.a.weight.data = self.a.weight.data * 0.5
            self.b.weight.data = torch.zeros(2, 2)
        return out


def _wrong_shape_body(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = TwoLayers()
    before, b_before = model.a.weight.detach().clone(), model.b.weight.detach().clone()
    a_bias, b_bias = model.a.bias.detach().clone(), model.b.bias.detach().clone()
    shard_model(model)  # one unit: the write-back at its reshard sees both
    try:
        with torch.no_grad():
            model(torch.randn(2, 4))
        error = "no error"
    except RuntimeError as raised:
        error = str(raised)
    full = full_state_dict(model, rank0_only=False)  # right after the caught error: the unit is resharded
    kept, b_weight = full["a.weight"], full["b.weight"]
    model.edit = False
    x = torch.randn(2, 4)
    with torch.no_grad():
        expected = F.linear(F.linear(x, before * 0.5, a_bias), b_before, b_bias)
        after = model(x)
    return {
        "error": error,
        "a kept": torch.equal(kept, before * 0.5),
        "b unchanged": torch.equal(b_weight, b_before),
        "next forward": torch.allclose(after, expected),
    }


def test_new_data_of_the_wrong_shape_is_an_error_and_the_others_are_kept(tmp_path):
    result = run_ranks(_wrong_shape_body, 2, tmp_path)[0]
    assert "'b.weight' was given data of shape (2, 2) while gathered; its shape is (3, 4)" in result["error"]
    assert result["a kept"], result  # the valid new data of the parameter before it is in its shard
    assert result["b unchanged"] and result["next forward"], result  # the refused data left with the error


class HalveInForward(nn.Module):
    """A MoCo / EMA-style replacement: ``weight.data`` given a new tensor in the module's forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.lin.weight.data = self.lin.weight.data * 0.5
        return self.lin(x)


def _new_data_body(rank: int, world: int) -> dict:
    results = {}
    for sharding in ("FULL_SHARD", "NO_SHARD"):  # NO_SHARD: a shard group of one, the shard is the full parameter
        torch.manual_seed(0)
        model = HalveInForward()
        before = model.lin.weight.detach().clone()
        shard_model(model, sharding_strategy=sharding)
        with torch.no_grad():
            model(torch.randn(2, 4))
        after_forward = full_state_dict(model, rank0_only=False)["lin.weight"]
        with summon_full_params(model, writeback=True):
            model.lin.weight.data = model.lin.weight.data * 0.5
        after_summon = full_state_dict(model, rank0_only=False)["lin.weight"]
        results[sharding] = (torch.equal(after_forward, before * 0.5), torch.equal(after_summon, before * 0.25))
    for wrap in ("default", "per-layer"):
        results[f"swap {wrap}"] = _swap_between_units(rank, world, {nn.Linear} if wrap == "per-layer" else None)
    return results


def _swap_between_units(rank: int, world: int, policy: set | None) -> float:
    """An EMA-style weight swap between two layers (``a.data, b.data = b.data, a.data``) inside
    ``summon_full_params(writeback=True)`` before each step; the largest difference from one process."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    reference = copy.deepcopy(model)
    shard_model(model, auto_wrap_policy=policy)
    optimizer, ref_optimizer = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference))
    inputs = torch.randn(3, world, 3, 4)
    for batch in inputs:
        with summon_full_params(model, writeback=True):
            model[0].weight.data, model[2].weight.data = model[2].weight.data, model[0].weight.data
        reference[0].weight.data, reference[2].weight.data = reference[2].weight.data, reference[0].weight.data
        model(batch[rank]).square().sum().backward()
        (sum(reference(x).square().sum() for x in batch) / world).backward()
        for opt in (optimizer, ref_optimizer):
            opt.step()
            opt.zero_grad()
    full = full_state_dict(model, rank0_only=False)
    return max((full[name] - value).abs().max().item() for name, value in reference.state_dict().items())


def test_new_data_given_while_gathered_is_kept_with_and_without_sharding(tmp_path):
    results = run_ranks(_new_data_body, 2, tmp_path)[0]
    assert results["FULL_SHARD"] == (True, True) and results["NO_SHARD"] == (True, True), results
    assert results["swap default"] < 1e-6 and results["swap per-layer"] < 1e-6, results  # the swap crashed per layer
