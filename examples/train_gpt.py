"""Train a byte-level GPT with ``Trainer(strategy="fsdp_custom")`` on the standard library's sources.

    python examples/train_gpt.py                                  # 2 CPU processes, a few minutes
    python examples/train_gpt.py trainer.max_steps=20 strategy.sharding_strategy=SHARD_GRAD_OP
    python examples/train_gpt.py resume=last                      # continue from the last checkpoint

Any key of ``configs/gpt_small.yaml`` can be overridden as ``key=value``; ``config=FILE`` picks
another YAML file. Perplexity and next-byte accuracy come from torchmetrics, synced over ranks.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from gpt import GPT, Block, ByteWindows, GPTConfig, read_corpus, split_corpus
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader
from torchmetrics.classification import MulticlassAccuracy
from torchmetrics.text import Perplexity

import fsdp_strategy

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "gpt_small.yaml"


def load_config(argv: list[str]) -> DictConfig:
    """The YAML config (``config=FILE`` or the default) with ``key=value`` overrides merged in."""
    overrides = OmegaConf.from_dotlist(argv)
    path = overrides.pop("config", None) or DEFAULT_CONFIG
    return OmegaConf.merge(OmegaConf.load(path), overrides)


class GPTModule(L.LightningModule):
    """Next-byte prediction; AdamW with parameter groups chosen by name; warmup + cosine LR."""

    def __init__(self, model: dict, optimizer: dict, max_steps: int) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = GPT(GPTConfig(**model))
        self.val_perplexity = Perplexity()
        self.val_accuracy = MulticlassAccuracy(num_classes=model["vocab_size"], average="micro")

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
        settings = self.hparams.optimizer
        named = [(name, p) for name, p in self.named_parameters() if p.requires_grad]
        no_decay = [p for name, p in named if name.endswith("bias") or ".ln" in name or "emb" in name]
        decay = [p for name, p in named if not (name.endswith("bias") or ".ln" in name or "emb" in name)]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": settings["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}],
            lr=settings["lr"],
        )
        warmup, total = settings["warmup_steps"], max(self.hparams.max_steps, 1)

        def schedule(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))

        return [optimizer], [{"scheduler": torch.optim.lr_scheduler.LambdaLR(optimizer, schedule), "interval": "step"}]


def main(argv: list[str]) -> None:
    config = load_config(argv)
    L.seed_everything(config.seed)
    root = Path(config.trainer.default_root_dir)
    corpus = read_corpus(config.data.path, config.data.max_bytes)
    train_bytes, val_bytes = split_corpus(corpus, config.data.val_fraction)
    seq_len = config.model.seq_len

    def loader(data: torch.Tensor, shuffle: bool) -> DataLoader:
        return DataLoader(
            ByteWindows(data, seq_len),
            batch_size=config.data.batch_size,
            shuffle=shuffle,
            num_workers=config.data.num_workers,
            drop_last=shuffle,
        )

    strategy = fsdp_strategy.FSDPCustomStrategy(auto_wrap_policy={Block}, **OmegaConf.to_container(config.strategy))
    checkpoints = ModelCheckpoint(
        dirpath=root / "checkpoints", save_last=True, every_n_train_steps=config.trainer.val_check_interval
    )
    trainer = L.Trainer(
        strategy=strategy,
        logger=CSVLogger(root, name="logs"),
        callbacks=[checkpoints],
        **OmegaConf.to_container(config.trainer),
    )
    module = GPTModule(
        OmegaConf.to_container(config.model), OmegaConf.to_container(config.optimizer), config.trainer.max_steps
    )
    trainer.fit(module, loader(train_bytes, True), loader(val_bytes, False), ckpt_path=config.resume)
    if trainer.is_global_zero:
        metrics = {k: round(float(v), 4) for k, v in trainer.callback_metrics.items()}
        print(f"done: {trainer.global_step} steps, metrics {metrics}")
        print(f"checkpoints: {checkpoints.dirpath} (resume with: python examples/train_gpt.py resume=last)")
        print(f"logs: {trainer.logger.log_dir}")


if __name__ == "__main__":
    main(sys.argv[1:])
