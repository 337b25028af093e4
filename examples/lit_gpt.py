"""The Lightning side of the GPT example: the LightningModule and the byte-corpus DataModule.

Used by ``train_gpt.py`` (omegaconf config) and ``cli.py`` (LightningCLI).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

import lightning as L
import torch
import torch.nn.functional as F
from gpt import GPT, ByteWindows, GPTConfig, read_corpus, split_corpus
from lightning.fabric.utilities.throughput import measure_flops
from torch.utils.data import DataLoader
from torchmetrics.classification import MulticlassAccuracy
from torchmetrics.text import Perplexity

from fsdp_strategy import MuonWithAdamW

OPTIMIZERS = ("adamw", "muon")


@dataclass(frozen=True)
class OptimizerSettings:
    """AdamW (``name="adamw"``), or Muon for the blocks' weight matrices beside AdamW for the rest
    (``name="muon"``, at ``muon_lr``: what Muon's authors recommend), with a linear warmup and a
    cosine decay to a tenth of the learning rates at ``max_steps``."""

    lr: float = 3.0e-3
    weight_decay: float = 0.1  # not on biases, norms and embeddings
    warmup_steps: int = 20
    name: str = "adamw"
    muon_lr: float = 0.02

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ValueError(f"name={self.name!r}: accepted: {list(OPTIMIZERS)}")
        if not self.lr > 0 or not self.muon_lr > 0:
            raise ValueError(f"lr={self.lr}, muon_lr={self.muon_lr}: learning rates must be positive")
        if self.weight_decay < 0 or self.warmup_steps < 0:
            raise ValueError(
                f"weight_decay={self.weight_decay}, warmup_steps={self.warmup_steps}: neither may be negative"
            )


class GPTModule(L.LightningModule):
    """Next-byte prediction; AdamW with parameter groups chosen by name; warmup + cosine LR.

    ``model`` and ``optimizer`` are typed settings (LightningCLI checks every key); checkpoints keep
    them as plain dicts, so reading one needs none of this code (``load_from_checkpoint`` passes
    those dicts back, which are accepted too). ``flops_per_batch`` (for the ThroughputMonitor) is
    measured once on the meta device.
    """

    def __init__(self, model: GPTConfig, optimizer: OptimizerSettings, max_steps: int, batch_size: int = 8) -> None:
        super().__init__()
        config = model if isinstance(model, GPTConfig) else GPTConfig(**model)
        self.settings = optimizer if isinstance(optimizer, OptimizerSettings) else OptimizerSettings(**optimizer)
        settings = {"model": asdict(config), "optimizer": asdict(self.settings)}
        self.save_hyperparameters({**settings, "max_steps": max_steps, "batch_size": batch_size})
        self.model = GPT(config)
        self.val_perplexity = Perplexity()
        self.val_accuracy = MulticlassAccuracy(num_classes=config.vocab_size, average="micro")
        with torch.device("meta"):
            meta_model = GPT(config)
            tokens = torch.zeros(batch_size, config.seq_len, dtype=torch.long)
            self.flops_per_batch = measure_flops(meta_model, lambda: meta_model(tokens), loss_fn=torch.Tensor.sum)

    def _logits(self, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model(batch[:, :-1]), batch[:, 1:]

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits, targets = self._logits(batch)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        logits, targets = self._logits(batch)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        self.val_perplexity.update(logits.float(), targets)
        self.val_accuracy.update(logits.argmax(-1).flatten(), targets.flatten())
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        self.log("val_perplexity", self.val_perplexity)
        self.log("val_accuracy", self.val_accuracy)

    def configure_optimizers(self):
        optimizer = (muon if self.settings.name == "muon" else adamw)(self.named_parameters(), self.settings)
        schedule = warmup_cosine(self.settings.warmup_steps, self.hparams.max_steps)
        return [optimizer], [{"scheduler": torch.optim.lr_scheduler.LambdaLR(optimizer, schedule), "interval": "step"}]


def adamw(named_parameters: Iterable[tuple[str, torch.nn.Parameter]], settings: OptimizerSettings) -> torch.optim.AdamW:
    """AdamW with weight decay on the weight matrices only (not biases, norms, embeddings)."""
    return torch.optim.AdamW(_decay_groups(named_parameters, settings), lr=settings.lr)


def muon(named_parameters: Iterable[tuple[str, torch.nn.Parameter]], settings: OptimizerSettings) -> MuonWithAdamW:
    """Muon on the blocks' weight matrices (at ``muon_lr``), AdamW on the rest (as ``adamw``), as one
    optimizer: the engine steps each matrix whole on one rank ([Note: whole-matrix placement])."""
    named = [(name, p) for name, p in named_parameters if p.requires_grad]
    matrices = [(n, p) for n, p in named if ".blocks." in n and p.ndim == 2]
    others = [(n, p) for n, p in named if all(p is not m for _, m in matrices)]
    return MuonWithAdamW(
        [p for _, p in matrices],
        _decay_groups(others, settings),
        muon={"lr": settings.muon_lr, "weight_decay": settings.weight_decay},
        adamw={"lr": settings.lr},
    )


def _decay_groups(named_parameters: Iterable[tuple[str, torch.nn.Parameter]], settings: OptimizerSettings) -> list:
    """Two groups: weight decay on the weight matrices, none on biases, norms and embeddings."""
    named = [(name, p) for name, p in named_parameters if p.requires_grad]

    def no_decay(name: str) -> bool:
        return name.endswith("bias") or ".ln" in name or "emb" in name

    return [
        {"params": [p for n, p in named if not no_decay(n)], "weight_decay": settings.weight_decay},
        {"params": [p for n, p in named if no_decay(n)], "weight_decay": 0.0},
    ]


def warmup_cosine(warmup: int, max_steps: int) -> Callable[[int], float]:
    """The LR factor at a step: linear warmup over ``warmup`` steps, then a cosine decay to 0.1 at ``max_steps``."""
    total = max(max_steps, 1)

    def schedule(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))

    return schedule


class ByteDataModule(L.LightningDataModule):
    """Byte windows of a text corpus: a file or folder (``path``), by default the standard library."""

    def __init__(
        self,
        path: str | None = None,
        max_bytes: int = 4_000_000,
        val_fraction: float = 0.02,
        batch_size: int = 8,
        seq_len: int = 128,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self._train: torch.Tensor | None = None
        self._val: torch.Tensor | None = None

    def setup(self, stage: str) -> None:
        if self._train is None:
            corpus = read_corpus(self.hparams.path, self.hparams.max_bytes)
            self._train, self._val = split_corpus(corpus, self.hparams.val_fraction)

    def _loader(self, data: torch.Tensor, shuffle: bool) -> DataLoader:
        return DataLoader(
            ByteWindows(data, self.hparams.seq_len),
            batch_size=self.hparams.batch_size,
            shuffle=shuffle,
            num_workers=self.hparams.num_workers,
            drop_last=shuffle,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader(self._train, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self._val, shuffle=False)
