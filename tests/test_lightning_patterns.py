"""Lightning patterns on fsdp_custom, each against the same LightningModule trained by Lightning
on one device with the global batch: a GAN with ``toggle_optimizer``, two ``manual_backward``
calls and per-optimizer clipping in one ``training_step``; a fine-tune that unfreezes its
backbone mid-run with ``BackboneFinetuning``; a teacher pass and a gradient penalty inside
``training_step``."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_utils import run_ranks
from lightning.pytorch.callbacks import BackboneFinetuning
from pattern_models import DIM, VOCAB, MLPBlock, lm_loss
from test_strategy import LIGHTNING_ENV, quiet_trainer
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from fsdp_strategy import FSDPCustomStrategy

PER_RANK = 2
WORLD = 2


class LitGAN(L.LightningModule):
    """Generator and discriminator, each a stack of units, trained alternately in one step."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(4, DIM), MLPBlock(), MLPBlock())
        self.discriminator = nn.Sequential(MLPBlock(), MLPBlock(), nn.Linear(DIM, 1))
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        noise, real = batch
        opt_g, opt_d = self.optimizers()
        self.toggle_optimizer(opt_g)  # the discriminator's weights stop requiring grad
        fake = self.generator(noise)
        g_loss = F.softplus(-self.discriminator(fake)).mean()
        self.manual_backward(g_loss)
        self.clip_gradients(opt_g, gradient_clip_val=0.02, gradient_clip_algorithm="norm")
        opt_g.step()
        opt_g.zero_grad()
        self.untoggle_optimizer(opt_g)
        self.toggle_optimizer(opt_d)
        d_loss = F.softplus(-self.discriminator(real)).mean() + F.softplus(self.discriminator(fake.detach())).mean()
        self.manual_backward(d_loss)
        self.clip_gradients(opt_d, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
        opt_d.step()
        opt_d.zero_grad()
        self.untoggle_optimizer(opt_d)
        self.losses.append(torch.stack([g_loss, d_loss]).detach())

    def configure_optimizers(self):
        return [
            torch.optim.Adam(self.generator.parameters(), lr=1e-2),
            torch.optim.Adam(self.discriminator.parameters(), lr=1e-2),
        ]


class LitFineTune(L.LightningModule):
    """A backbone frozen for the first epoch, then unfrozen by ``BackboneFinetuning``."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Embedding(VOCAB, DIM), MLPBlock(), MLPBlock())
        self.head = nn.Linear(DIM, VOCAB)
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        tokens = batch[0]
        loss = lm_loss(self.head(self.backbone(tokens)), tokens)
        self.losses.append(loss.detach().reshape(1))
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)


class LitTeacher(L.LightningModule):
    """A no-grad teacher pass of the root inside ``training_step``, then a direct call of a
    submodule of the root's unit, plus a gradient penalty through ``torch.autograd.grad``."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.Sequential(MLPBlock(), MLPBlock())
        self.head = nn.Linear(DIM, VOCAB)
        self.losses: list[torch.Tensor] = []

    def forward(self, tokens):
        return self.head(self.blocks(self.embed(tokens)))

    def training_step(self, batch, batch_idx):
        tokens = batch[0]
        with torch.no_grad():
            teacher = self(tokens)  # the root's forward, nested in the root's forward
        hidden = self.blocks(self.embed(tokens)).detach().requires_grad_(True)
        logits = self.head(hidden)  # a module of the root's unit, called directly
        (slope,) = torch.autograd.grad(logits.sum(), hidden, create_graph=True)
        loss = lm_loss(self(tokens), tokens) + F.mse_loss(logits, teacher) + 0.1 * slope.pow(2).mean()
        self.losses.append(loss.detach().reshape(1))
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _data(kind: str, steps: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(7)
    n = steps * PER_RANK * WORLD
    if kind == "gan":
        return TensorDataset(torch.randn(n, 4, generator=generator), torch.randn(n, DIM, generator=generator) + 1)
    return TensorDataset(torch.randint(0, VOCAB, (n, 6), generator=generator))


CASES = {
    # name: (module, data kind, steps per epoch, epochs, callbacks)
    "gan": (LitGAN, "gan", 4, 1, lambda: []),
    "finetune": (LitFineTune, "tokens", 3, 2, lambda: [BackboneFinetuning(unfreeze_backbone_at_epoch=1)]),
    "teacher": (LitTeacher, "tokens", 3, 1, lambda: []),
}


def _fit(name: str, devices: int, batch_size: int, **trainer_kwargs) -> list[list[float]]:
    module_cls, kind, steps, epochs, callbacks = CASES[name]
    torch.manual_seed(0)
    module = module_cls()
    trainer = quiet_trainer(
        devices=devices, max_epochs=epochs, callbacks=callbacks(), use_distributed_sampler=False, **trainer_kwargs
    )
    dataset = _data(kind, steps)  # rank r takes samples r, r + world, ...: together the one-device batch
    sampler = DistributedSampler(dataset, shuffle=False) if devices > 1 else None
    trainer.fit(module, DataLoader(dataset, batch_size=batch_size, sampler=sampler))
    losses = torch.stack(module.losses)
    if devices > 1:
        dist.all_reduce(losses)
        losses /= devices
    return losses.tolist()


def _sharded_body(rank: int, world: int, name: str, strategy: str, wrap: bool) -> list:
    policy = {MLPBlock, nn.Embedding} if wrap else None  # None: the whole model one unit, "fsdp_custom"'s default
    return _fit(name, world, PER_RANK, strategy=FSDPCustomStrategy(auto_wrap_policy=policy, sharding_strategy=strategy))


@pytest.mark.parametrize("name", list(CASES))
def test_lightning_pattern_matches_one_device(tmp_path, name):
    expected = _fit(name, 1, PER_RANK * WORLD)
    for strategy, wrap in (("FULL_SHARD", True), ("SHARD_GRAD_OP", True), ("FULL_SHARD", False)):
        losses = run_ranks(_sharded_body, WORLD, tmp_path, name, strategy, wrap, env=LIGHTNING_ENV, timeout=180)[0]
        assert len(losses) == len(expected)
        for step, (got, want) in enumerate(zip(losses, expected)):
            assert got == pytest.approx(want, rel=1e-5), (
                f"{name} ({strategy}, wrap={wrap}) step {step}: {got} vs {want}"
            )
