"""Train a byte-level GPT with ``Trainer(strategy="fsdp_custom")`` on the standard library's sources.

    python examples/train_gpt.py                                  # 2 CPU processes, about a minute
    python examples/train_gpt.py trainer.max_steps=20 strategy.sharding_strategy=SHARD_GRAD_OP
    python examples/train_gpt.py resume=last trainer.max_steps=300  # train a finished run further
    torchrun --nproc-per-node 2 --max-restarts 3 --rdzv-backend c10d examples/train_gpt.py resume=auto  # restarts
    python examples/train_gpt.py --help                           # this text and every key

Any key of ``configs/gpt_small.yaml`` can be overridden as ``key=value`` or ``--key=value``;
``trainer.*`` and ``strategy.*`` take any argument of ``lightning.Trainer`` and
``FSDPCustomStrategy``; ``config=FILE`` picks another YAML file. Metrics go to W&B (offline
unless ``logger.offline=false`` and you are logged in; a resumed run continues the same W&B run),
with the memory, throughput and communication monitors; checkpoints are sharded folders.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import example_config
import lightning as L
import noise
import progress
import torch
import wandb
from gpt import Block, GPTConfig
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import WandbLogger
from lit_gpt import ByteDataModule, GPTModule, OptimizerSettings
from omegaconf import DictConfig, OmegaConf

import fsdp_strategy
from fsdp_strategy.callbacks import CommunicationMonitor, MemoryMonitor, ThroughputMonitor

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "gpt_small.yaml"


def checkpoint_state(path: Path) -> dict:
    """The trainer state stored in a checkpoint (a sharded folder or a full file), weights not read."""
    state_file = path / "meta.pt" if path.is_dir() else path  # a sharded folder keeps it in meta.pt, as Lightning's
    return torch.load(state_file, map_location="cpu", weights_only=False, mmap=True)


class WandbRunInCheckpoint(Callback):
    """Stores the W&B run id in every checkpoint, so a resume continues the run that saved it."""

    def __init__(self, logger: WandbLogger) -> None:
        self.logger = logger

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        checkpoint["wandb_run_id"] = self.logger.version


def wandb_logger(config: DictConfig, root: Path, resume: Path | None) -> WandbLogger:
    """The W&B logger; a resumed run continues the W&B run that saved the checkpoint (same id)."""
    run_id = checkpoint_state(resume).get("wandb_run_id") if resume is not None else None
    logger = WandbLogger(
        project=config.logger.project,
        save_dir=str(root.resolve()),
        offline=config.logger.offline,
        log_model=False,
        id=run_id,  # Lightning's WandbLogger passes resume="allow": the run goes on under this id
        settings=wandb.Settings(silent=config.logger.offline, disable_git=True),  # offline: no W&B chatter
    )
    return noise.without_unused_wandb_settings(logger)


def settings_or_exit(config: DictConfig) -> list:
    """The strategy, model shape and optimizer settings the config describes, built before anything
    starts; a value they refuse (or a step count the schedule cannot use) ends the script with its
    message."""
    need = (
        "a positive number of steps (the learning-rate schedule spans max_steps; checkpoints are written "
        "every val_check_interval)"
    )
    example_config.positive_ints_or_exit(config, "trainer", ("max_steps", "val_check_interval"), need)
    return example_config.build_or_exit(
        config,
        {
            "strategy": lambda values: fsdp_strategy.FSDPCustomStrategy(**{"auto_wrap_policy": {Block}, **values}),
            "model": lambda values: GPTConfig(**values),
            "optimizer": lambda values: OptimizerSettings(**values),
        },
    )


def main(argv: list[str]) -> None:
    noise.quiet_known_noise()
    config = example_config.parse_or_exit(
        argv,
        DEFAULT_CONFIG,
        __doc__,
        {
            "trainer": (L.Trainer, {"strategy", "logger", "callbacks"}),
            "strategy": (fsdp_strategy.FSDPCustomStrategy, {"accelerator", "parallel_devices", "precision_plugin"}),
        },
    )
    strategy, model_config, optimizer = settings_or_exit(config)
    root = Path(config.trainer.default_root_dir)
    checkpoint_dir = root / "checkpoints"
    resume = example_config.resume_or_exit(
        config, checkpoint_dir / "last.ckpt", "global_step", "trainer.max_steps", checkpoint_state, argv
    )
    if resume is not None:
        noise.quiet_resume_noise()
    L.seed_everything(config.seed)
    logger = wandb_logger(config, root, resume)
    every = config.monitors.log_every_n_steps
    checkpoints = ModelCheckpoint(
        dirpath=checkpoint_dir,
        save_last=True,
        every_n_train_steps=config.trainer.val_check_interval,
        enable_version_counter=False,  # a new run replaces last.ckpt instead of adding last-v1.ckpt
    )
    callbacks = [
        checkpoints,
        WandbRunInCheckpoint(logger),
        MemoryMonitor(log_every_n_steps=every),
        ThroughputMonitor(log_every_n_steps=every),
        CommunicationMonitor(log_every_n_steps=every),
        *([progress.ResumedEpochProgressBar()] if config.trainer.get("enable_progress_bar", True) else []),
    ]
    try:
        options = OmegaConf.to_container(config.trainer)
        trainer = L.Trainer(strategy=strategy, logger=logger, callbacks=callbacks, **options)
    except (MisconfigurationException, ValueError, TypeError) as error:  # e.g. trainer.devices=0
        example_config.exit_with(f"trainer: {error}")
    logger.log_hyperparams(OmegaConf.to_container(config))
    module = GPTModule(model_config, optimizer, config.trainer.max_steps, config.data.batch_size)
    data = ByteDataModule(seq_len=model_config.seq_len, **OmegaConf.to_container(config.data))
    trainer.fit(module, datamodule=data, ckpt_path=resume)
    if trainer.is_global_zero:
        metrics = {k: round(float(v), 4) for k, v in trainer.callback_metrics.items()}
        run_dir = Path(logger.experiment.dir).parent
        run_dir = run_dir.relative_to(Path.cwd()) if run_dir.is_relative_to(Path.cwd()) else run_dir
        logger.experiment.finish()
        steps = trainer.global_step
        print(f"done: {steps} steps, metrics {metrics}")
        print(f"checkpoints: {checkpoint_dir}")
        print(f"train further with: {example_config.continue_command(argv, 'last', 'trainer.max_steps', 2 * steps)}")
        upload = f" (upload it with: wandb sync {shlex.quote(str(run_dir))})" if config.logger.offline else ""
        print(f"W&B run: {run_dir}{upload}")


if __name__ == "__main__":
    main(sys.argv[1:])
