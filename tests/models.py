"""Tiny models for the tests: every awkward case of sharding in a few hundred parameters."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 37
DIM = 10
SEQ = 6


class Block(nn.Module):
    """A residual MLP block with odd widths (21 is divisible by neither 2 nor 4)."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 2 * dim + 1)
        self.down = nn.Linear(2 * dim + 1, dim)
        self.unused = nn.Linear(dim, 1)  # gets no gradient; dim 0 (1) is smaller than the world size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TiedLM(nn.Module):
    """Embedding tied to the LM head (different submodules), a frozen layer mixed with trainable
    parameters in the root unit, a buffer, a 0-dim parameter and a block that is never called."""

    def __init__(self, vocab: int = VOCAB, dim: int = DIM, n_blocks: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList([Block(dim) for _ in range(n_blocks)])
        self.skipped = Block(dim)
        self.frozen = nn.Linear(dim, dim)
        self.frozen.requires_grad_(False)
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.register_buffer("position", torch.randn(SEQ, dim) * 0.1)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        x = self.frozen(x) * self.scale
        return self.head(x)


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy of ``model`` on ``tokens`` (batch, SEQ + 1)."""
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))


def make_batches(steps: int, batch: int, seed: int = 0) -> torch.Tensor:
    """``steps`` global batches of random tokens, shape (steps, batch, SEQ + 1)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (steps, batch, SEQ + 1), generator=generator)
