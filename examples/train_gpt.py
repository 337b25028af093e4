"""Train a byte-level GPT with ``Trainer(strategy="fsdp_custom")`` on the standard library's sources.

    python examples/train_gpt.py                                  # 2 CPU processes, a few minutes
    python examples/train_gpt.py trainer.max_steps=20 strategy.sharding_strategy=SHARD_GRAD_OP
    python examples/train_gpt.py resume=last                      # continue from the last checkpoint

Any key of ``configs/gpt_small.yaml`` can be overridden as ``key=value``; ``config=FILE`` picks
another YAML file. Metrics go to W&B (offline unless ``logger.offline=false`` and you are logged
in), with the memory, throughput and communication monitors; checkpoints are sharded folders.
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
from fsdp_strategy.callbacks import CommunicationMonitor, MemoryMonitor, ThroughputMonitor
from gpt import Block
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import WandbLogger
from lit_gpt import ByteDataModule, GPTModule
from omegaconf import DictConfig, OmegaConf

import fsdp_strategy

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "gpt_small.yaml"


def load_config(argv: list[str]) -> DictConfig:
    """The YAML config (``config=FILE`` or the default) with ``key=value`` overrides merged in."""
    overrides = OmegaConf.from_dotlist(argv)
    path = overrides.pop("config", None) or DEFAULT_CONFIG
    return OmegaConf.merge(OmegaConf.load(path), overrides)


def main(argv: list[str]) -> None:
    config = load_config(argv)
    L.seed_everything(config.seed)
    root = Path(config.trainer.default_root_dir)
    every = config.monitors.log_every_n_steps
    logger = WandbLogger(
        project=config.logger.project, save_dir=str(root), offline=config.logger.offline, log_model=False
    )
    checkpoints = ModelCheckpoint(
        dirpath=root / "checkpoints", save_last=True, every_n_train_steps=config.trainer.val_check_interval
    )
    trainer = L.Trainer(
        strategy=fsdp_strategy.FSDPCustomStrategy(auto_wrap_policy={Block}, **OmegaConf.to_container(config.strategy)),
        logger=logger,
        callbacks=[
            checkpoints,
            MemoryMonitor(log_every_n_steps=every),
            ThroughputMonitor(log_every_n_steps=every),
            CommunicationMonitor(log_every_n_steps=every),
        ],
        **OmegaConf.to_container(config.trainer),
    )
    model_config = OmegaConf.to_container(config.model)
    module = GPTModule(
        model_config, OmegaConf.to_container(config.optimizer), config.trainer.max_steps, config.data.batch_size
    )
    data = ByteDataModule(seq_len=model_config["seq_len"], **OmegaConf.to_container(config.data))
    trainer.fit(module, datamodule=data, ckpt_path=config.resume)
    if trainer.is_global_zero:
        metrics = {k: round(float(v), 4) for k, v in trainer.callback_metrics.items()}
        run_dir = Path(logger.experiment.dir).parent
        logger.experiment.finish()
        print(f"done: {trainer.global_step} steps, metrics {metrics}")
        print(f"checkpoints: {checkpoints.dirpath} (resume with: python examples/train_gpt.py resume=last)")
        print(f"W&B run: {run_dir}" + (f" (upload it with: wandb sync {run_dir})" if config.logger.offline else ""))


if __name__ == "__main__":
    main(sys.argv[1:])
