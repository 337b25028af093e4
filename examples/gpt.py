"""A small GPT and a byte-level text corpus that every machine has (the Python standard library).

Shared by the examples and the benchmarks. No download: ``ByteCorpus`` reads text files from
a folder (default: the standard library's sources) into one byte tensor.
"""

from __future__ import annotations

import math
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the model."""

    vocab_size: int = 256  # bytes
    d_model: int = 256  # width
    n_layers: int = 4  # transformer blocks (one FSDP unit each)
    n_heads: int = 4  # attention heads
    seq_len: int = 128  # context length
    tie_embeddings: bool = False  # share the token embedding with the LM head

    def __post_init__(self) -> None:
        sizes = {"vocab_size": self.vocab_size, "d_model": self.d_model, "n_layers": self.n_layers}
        sizes.update(n_heads=self.n_heads, seq_len=self.seq_len)
        small = [f"{name}={value}" for name, value in sizes.items() if value < 1]
        if small:
            raise ValueError(f"{', '.join(small)}: every size of the model must be at least 1")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}: each head takes d_model / n_heads"
            )


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and a 4x MLP."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.ln_attn = nn.LayerNorm(config.d_model)
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)
        self.ln_mlp = nn.LayerNorm(config.d_model)
        self.fc = nn.Linear(config.d_model, 4 * config.d_model)
        self.out = nn.Linear(4 * config.d_model, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(self.ln_attn(x)).split(width, dim=-1)
        q, k, v = (t.view(batch, seq, self.n_heads, -1).transpose(1, 2) for t in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(batch, seq, width))
        return x + self.out(F.gelu(self.fc(self.ln_mlp(x))))


class GPT(nn.Module):
    """Token + position embeddings, ``n_layers`` blocks, a final norm and an LM head."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.seq_len, config.d_model)
        self.blocks = nn.ModuleList([Block(config) for _ in range(config.n_layers)])
        self.ln_f = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.head.weight = self.tok_emb.weight
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def flops_per_token(self) -> int:
        """Training FLOPs per token: 6 x parameters + attention (the usual estimate)."""
        params = sum(p.numel() for p in self.parameters())
        config = self.config
        return 6 * params + 12 * config.n_layers * config.d_model * config.seq_len


def default_corpus_path() -> Path:
    """The Python standard library's source folder: text present on every machine."""
    return Path(sysconfig.get_paths()["stdlib"])


def read_corpus(path: str | Path | None, max_bytes: int, suffix: str = ".py") -> torch.Tensor:
    """Bytes of a text file, or of the ``suffix`` files under a folder (sorted, up to ``max_bytes``)."""
    root = Path(path) if path else default_corpus_path()
    if not root.exists():
        raise FileNotFoundError(f"data.path={str(root)!r} does not exist; give a text file or a folder")
    files = [root] if root.is_file() else sorted(p for p in root.rglob(f"*{suffix}") if p.is_file())
    chunks, total = [], 0
    for file in files:
        data = file.read_bytes()[: max_bytes - total]
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if total == 0:
        raise ValueError(f"no {suffix} text found under {str(root)!r}")
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8).long()


class ByteWindows(Dataset):
    """Non-overlapping windows of ``seq_len + 1`` bytes (inputs and next-byte targets)."""

    def __init__(self, data: torch.Tensor, seq_len: int) -> None:
        self.data = data
        self.seq_len = seq_len

    def __len__(self) -> int:
        return max(0, (len(self.data) - 1) // self.seq_len)

    def __getitem__(self, index: int) -> torch.Tensor:
        start = index * self.seq_len
        return self.data[start : start + self.seq_len + 1]


def split_corpus(data: torch.Tensor, val_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``1 - val_fraction`` of the bytes for training, the rest for validation."""
    cut = math.floor(len(data) * (1 - val_fraction))
    return data[:cut], data[cut:]
