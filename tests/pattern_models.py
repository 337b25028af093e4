"""Tiny models for the training patterns users write, each with the odd case it exercises.

Tokens are integers in [0, VOCAB); where routing or task choice depends on the data, the data
decides it (hash routing: expert = token % experts), so a test can give one rank an idle
expert or another task.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

VOCAB = 24
DIM = 8


class MLPBlock(nn.Module):
    """A residual MLP block; every parameter is used on every call."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 2 * dim + 1)
        self.down = nn.Linear(2 * dim + 1, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Dense(nn.Module):
    """Every parameter used and trainable: embed -> 3 blocks -> norm -> head."""

    def __init__(self, n_blocks: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([MLPBlock() for _ in range(n_blocks)])
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def features(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.norm(x)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(tokens))


def lm_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Cross entropy of logits (batch, seq, vocab) against the next tokens."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


class ExpertBank(nn.Module):
    """Residual bank of hash-routed experts: expert e runs on the tokens with ``token % n == e``
    only; an expert with no tokens on this rank does not run (its parameters get no gradient)."""

    def __init__(self, experts: list[int], n_total: int) -> None:
        super().__init__()
        self.ids = experts
        self.n_total = n_total
        self.experts = nn.ModuleList([nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for _ in experts])

    def forward(self, x: torch.Tensor, tokens: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        flat, route, weight = x.reshape(-1, DIM), (tokens % self.n_total).reshape(-1), gate.reshape(-1, self.n_total)
        out = flat
        for expert_id, expert in zip(self.ids, self.experts):
            index = (route == expert_id).nonzero().squeeze(1)
            if index.numel():
                out = out.index_add(0, index, expert(flat[index]) * weight[index, expert_id : expert_id + 1])
        return out.reshape(x.shape)


class MoE(nn.Module):
    """Top-1 hash-routed mixture of experts with a learned gate. Experts 0-1 in one bank, expert
    2 alone in another (a unit whose parameters all go unused where no token is routed to it),
    expert 3 in the first bank never gets a token anywhere (its gradient stays None, as DDP)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.gate = nn.Linear(DIM, 4)
        self.bank_a = ExpertBank([0, 1, 3], 4)
        self.bank_b = ExpertBank([2], 4)
        self.block = MLPBlock()
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        gate = self.gate(x).softmax(-1)
        x = self.bank_b(self.bank_a(x, tokens, gate), tokens, gate)
        return self.head(self.block(x))


class TaskHeads(nn.Module):
    """Two heads; each batch uses the one its first token chooses (the other gets no gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.head_a = nn.Linear(DIM, VOCAB)
        self.head_b = nn.Linear(DIM, VOCAB)

    def forward(self, x: torch.Tensor, task: int) -> torch.Tensor:
        return self.head_a(x) if task == 0 else self.head_b(x)


class EarlyExit(nn.Module):
    """A block that skips its second half for batches whose first token is even."""

    def __init__(self) -> None:
        super().__init__()
        self.first = MLPBlock()
        self.second = MLPBlock()

    def forward(self, x: torch.Tensor, skip: bool) -> torch.Tensor:
        x = self.first(x)
        return x if skip else self.second(x)


class MultiTask(nn.Module):
    """Per-batch task head and early exit: parameters used on some ranks only, inside units."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.body = EarlyExit()
        self.heads = TaskHeads()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        first = int(tokens[0, 0])
        return self.heads(self.body(self.embed(tokens), skip=first % 2 == 0), task=first % 3 % 2)


class LoRALinear(nn.Module):
    """A frozen base layer plus a trainable low-rank adapter."""

    def __init__(self, dim: int = DIM, rank: int = 2) -> None:
        super().__init__()
        self.base = nn.Linear(dim, dim)
        self.base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(rank, dim) * 0.1)
        self.lora_b = nn.Parameter(torch.randn(dim, rank) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + F.linear(F.linear(x, self.lora_a), self.lora_b)


class LoRABlock(nn.Module):
    """A residual block of two LoRA layers (frozen base and trainable adapter in one unit)."""

    def __init__(self) -> None:
        super().__init__()
        self.one = LoRALinear()
        self.two = LoRALinear()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.two(torch.tanh(self.one(x)))


class LoRAModel(nn.Module):
    """A frozen embedding and head around 8 LoRA blocks."""

    def __init__(self, n_blocks: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.embed.requires_grad_(False)
        self.blocks = nn.ModuleList([LoRABlock() for _ in range(n_blocks)])
        self.head = nn.Linear(DIM, VOCAB)
        self.head.requires_grad_(False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class QuantizedLoRALinear(nn.Module):
    """Weight-only quantization (int8 or float8 codes and a per-row scale, both frozen parameters, as
    QLoRA-style base layers hold them) plus a trainable low-rank adapter: an integer or float8
    nn.Parameter beside float32 ones."""

    def __init__(self, codes_dtype: torch.dtype, dim: int = DIM, rank: int = 2) -> None:
        super().__init__()
        weight = torch.randn(dim, dim) * 0.3
        largest = 127 if codes_dtype == torch.int8 else torch.finfo(codes_dtype).max
        scale = weight.abs().amax(dim=1, keepdim=True) / largest
        codes = weight / scale
        codes = torch.round(codes) if codes_dtype == torch.int8 else codes
        self.codes = nn.Parameter(codes.to(codes_dtype), requires_grad=False)
        self.scale = nn.Parameter(scale, requires_grad=False)
        self.lora_a = nn.Parameter(torch.randn(rank, dim) * 0.1)
        self.lora_b = nn.Parameter(torch.randn(dim, rank) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = F.linear(x, self.codes.to(x.dtype) * self.scale)
        return base + F.linear(F.linear(x, self.lora_a), self.lora_b)


class QuantizedLoRABlock(nn.Module):
    """A residual block of two quantized LoRA layers."""

    def __init__(self, codes_dtype: torch.dtype) -> None:
        super().__init__()
        self.one = QuantizedLoRALinear(codes_dtype)
        self.two = QuantizedLoRALinear(codes_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.two(torch.tanh(self.one(x)))


class QuantizedLoRAModel(Dense):
    """Dense with 3 quantized LoRA blocks (int8 codes by default) for its MLP blocks."""

    def __init__(self, codes_dtype: torch.dtype = torch.int8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([QuantizedLoRABlock(codes_dtype) for _ in range(3)])


class Critic(nn.Module):
    """A WGAN critic on continuous inputs (for the gradient penalty)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([MLPBlock(), MLPBlock()])
        self.out = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def gradient_penalty_loss(critic: nn.Module, real: torch.Tensor, fake: torch.Tensor, alpha: torch.Tensor):
    """WGAN-GP critic loss: ``torch.autograd.grad(create_graph=True)`` then one backward through both."""
    interp = (alpha * real + (1 - alpha) * fake).requires_grad_(True)
    (grads,) = torch.autograd.grad(critic(interp).sum(), interp, create_graph=True)
    penalty = ((grads.norm(2, dim=1) - 1) ** 2).mean()
    return critic(fake).mean() - critic(real).mean() + 10 * penalty


class GeneratorCritic(nn.Module):
    """A critic (blocks as units) run on real data first, whose inputs need no gradient, then on
    the generator's output, whose inputs do: the same units with and without a post-backward."""

    def __init__(self) -> None:
        super().__init__()
        self.generator = MLPBlock()
        self.critic = Critic()

    def forward(self, real: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        return self.critic(real).mean() - self.critic(torch.tanh(self.generator(noise))).mean()


class FreezeInStep(GeneratorCritic):
    """A GAN step as written inside ``training_step`` (so inside the root forward): the critic
    frozen with ``requires_grad_`` for the generator's loss, unfrozen for its own."""

    def forward(self, real: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        fake = torch.tanh(self.generator(noise))
        self.critic.requires_grad_(False)
        generator_loss = -self.critic(fake).mean()
        self.critic.requires_grad_(True)
        return generator_loss + self.critic(fake.detach()).mean() - self.critic(real).mean()


class Staged(nn.Module):
    """Activation checkpointing of a stage that contains units (non-reentrant or reentrant)."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.embed = nn.Embedding(VOCAB, DIM)
        self.stages = nn.ModuleList([nn.Sequential(MLPBlock(), MLPBlock()) for _ in range(2)])
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for stage in self.stages:
            x = checkpoint(stage, x, use_reentrant=self.reentrant)
        return self.head(x)


@dataclass
class BlockOutput:
    """A dataclass output (as Hugging Face blocks return)."""

    hidden: torch.Tensor
    aux: torch.Tensor


class Pair(NamedTuple):
    hidden: torch.Tensor
    aux: torch.Tensor


class ContainerBlock(nn.Module):
    """A block whose output is a dataclass, a NamedTuple or a dict, with an auxiliary loss term."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.block = MLPBlock()
        self.aux = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor):
        hidden = self.block(x)
        aux = self.aux(hidden).pow(2).mean()
        if self.kind == "dataclass":
            return BlockOutput(hidden, aux)
        if self.kind == "namedtuple":
            return Pair(hidden, aux)
        return {"hidden": hidden, "aux": aux}


class Containers(nn.Module):
    """Units that return a dataclass, a NamedTuple and a dict; the root uses every field."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([ContainerBlock(k) for k in ("dataclass", "namedtuple", "dict")])
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x, aux = self.embed(tokens), 0.0
        for block in self.blocks:
            out = block(x)
            x, extra = (out["hidden"], out["aux"]) if isinstance(out, dict) else (out.hidden, out.aux)
            aux = aux + extra
        return self.head(x + aux)  # added to the logits, aux would cancel in the softmax: a gradient of rounding noise


class SharedProjection(nn.Module):
    """Two blocks (units) that both register one projection module object."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        shared = nn.Linear(DIM, DIM)
        self.blocks = nn.ModuleList([MLPBlock(), MLPBlock()])
        for block in self.blocks:
            block.proj = shared
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block.proj(block(x))
        return self.head(x)


class ScaleByWeight(torch.autograd.Function):
    """``x @ w.T`` whose backward reads ``w`` from the context and gives it no gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.weight = w.detach()
        return x @ w.detach().T

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad @ ctx.weight, None


class WeightReaders(nn.Module):
    """A unit whose weights are read by nodes that run after their last gradient arrived: a
    stop-gradient use (``W.detach()``) and a custom Function that reads ``W`` in backward, both
    created before the ordinary uses, so backward reaches them last."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)
        self.mix = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        stop_gradient = F.linear(torch.tanh(x), self.fc.weight.detach())
        custom = ScaleByWeight.apply(torch.sin(x), self.mix.weight)
        return self.mix(self.fc(x)) + stop_gradient + custom


class Readers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.body = WeightReaders()
        self.block = MLPBlock()
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.body(self.embed(tokens))))


class Recurrent(nn.Module):
    """One block object registered (and run) three times, as ALBERT shares its layer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        shared = MLPBlock()
        self.blocks = nn.ModuleList([shared, shared, shared])
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class InsideForward(nn.Module):
    """What Lightning's ``training_step`` does inside the root forward: a no-grad nested call of
    the root (a teacher pass), a direct call of a submodule the root's unit holds, and two
    backward passes before returning."""

    def __init__(self) -> None:
        super().__init__()
        self.net = Dense()

    def forward(self, tokens: torch.Tensor, mode: str = "step") -> torch.Tensor:
        if mode == "logits":
            return self.net(tokens)
        half = tokens.shape[0] // 2
        with torch.no_grad():
            teacher = self(tokens[:half], mode="logits")
        logits = self.net.head(self.net.features(tokens[:half]))
        first = lm_loss(logits, tokens[:half]) + F.mse_loss(logits, teacher)
        first.backward()
        second = lm_loss(self(tokens[half:], mode="logits"), tokens[half:])
        second.backward()
        return (first + second).detach()


class FailInBackward(torch.autograd.Function):
    """Identity whose backward raises (an OOM in backward, say)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        raise RuntimeError("injected failure in backward")


class FaultyBlock(MLPBlock):
    """An MLP block that raises in forward, or in backward, when told to."""

    fail: str | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail == "forward":
            raise RuntimeError("injected failure in forward")
        if self.fail == "interrupt":
            raise KeyboardInterrupt
        out = super().forward(x)
        return FailInBackward.apply(out) if self.fail == "backward" else out


class FaultyDense(Dense):
    """Dense whose middle block can be told to fail."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks[1] = FaultyBlock()
