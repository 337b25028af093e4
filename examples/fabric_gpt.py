"""Pretrain the byte-level GPT with ``Fabric(strategy="fsdp_custom")``: a LitGPT-style loop.

    python examples/fabric_gpt.py                                         # 2 CPU processes
    python examples/fabric_gpt.py resume=last train.max_steps=60 fabric.devices=1   # go on, on 1 rank
    python examples/fabric_gpt.py --help                                  # this text and every key

The model is created on the meta device (``fabric.init_module(empty_init=True)``) and
materialized unit by unit as it is sharded; each optimizer step accumulates ``train.accumulate``
micro-batches under ``fabric.no_backward_sync`` and clips to ``train.max_norm``; the memory,
throughput and communication monitors log to W&B (offline unless ``logger.offline=false``). A
sharded checkpoint (model, optimizer, LR schedule, step) is written every
``train.save_every_n_steps`` steps and at the end; ``resume=last`` continues it on any number of
ranks, in the same W&B run (the data starts a new pass). Any key of ``configs/fabric_gpt.yaml``
can be overridden as ``key=value``; ``fabric.*`` and ``strategy.*`` take any argument of
``Fabric`` and ``FSDPCustomFabricStrategy``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import example_config
import noise
import torch
import torch.nn.functional as F
import wandb
from gpt import GPT, Block, GPTConfig
from lightning.fabric import Fabric
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.loggers import WandbLogger
from lit_gpt import ByteDataModule, OptimizerSettings, adamw, warmup_cosine
from omegaconf import DictConfig, OmegaConf
from train_gpt import checkpoint_state

from fsdp_strategy import FSDPCustomFabricStrategy
from fsdp_strategy.callbacks import CommunicationMonitor, MemoryMonitor, ThroughputMonitor

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "fabric_gpt.yaml"


def settings_or_exit(config: DictConfig) -> list:
    """The strategy, model shape and optimizer settings, built before anything starts; a value they
    refuse ends the script with its message (status 2)."""
    keys = ("max_steps", "accumulate", "log_every_n_steps", "save_every_n_steps")
    example_config.positive_ints_or_exit(config, "train", keys, "a positive int")
    return example_config.build_or_exit(
        config,
        {
            "strategy": lambda values: FSDPCustomFabricStrategy(**{"auto_wrap_policy": {Block}, **values}),
            "model": lambda values: GPTConfig(**values),
            "optimizer": lambda values: OptimizerSettings(**values),
        },
    )


def endless(loader: Iterator) -> Iterator[torch.Tensor]:
    """The loader's batches, pass after pass (each pass reshuffled: Fabric sets the sampler's epoch)."""
    while True:
        yield from loader


def main(argv: list[str]) -> None:
    noise.quiet_known_noise()
    config = example_config.parse_or_exit(
        argv,
        DEFAULT_CONFIG,
        __doc__,
        {
            "fabric": (Fabric, {"strategy", "loggers", "callbacks", "plugins"}),
            "strategy": (FSDPCustomFabricStrategy, {"accelerator", "parallel_devices", "cluster_environment"}),
        },
    )
    strategy, model_config, settings = settings_or_exit(config)
    train, out = config.train, Path(config.train.out_dir)
    resume = example_config.resume_or_exit(config, out / "last.ckpt", "step", "train.max_steps", checkpoint_state, argv)
    run_id = checkpoint_state(resume).get("wandb_run_id") if resume is not None else None
    logger = WandbLogger(
        project=config.logger.project,
        save_dir=str(out.resolve()),
        offline=config.logger.offline,
        id=run_id,
        settings=wandb.Settings(silent=config.logger.offline, disable_git=True),  # offline: no W&B chatter
    )
    logger = noise.without_unused_wandb_settings(logger)
    every = train.log_every_n_steps
    monitors = [MemoryMonitor(every), ThroughputMonitor(every), CommunicationMonitor(every)]
    try:
        options = OmegaConf.to_container(config.fabric)
        fabric = Fabric(strategy=strategy, loggers=[logger], callbacks=monitors, **options)
    except (MisconfigurationException, ValueError, TypeError) as error:  # e.g. fabric.devices=0
        example_config.exit_with(f"fabric: {error}")
    fabric.launch()
    fabric.seed_everything(config.seed)
    with fabric.init_module(empty_init=True):
        model = GPT(model_config)
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(adamw(model.named_parameters(), settings))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(settings.warmup_steps, train.max_steps))
    run_id = fabric.broadcast(logger.experiment.id if fabric.is_global_zero else None)  # rank 0 starts the run
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 0, "wandb_run_id": run_id}
    if resume is not None:
        fabric.load(resume, state)
        ranks = f"{fabric.world_size} rank" + ("s" if fabric.world_size != 1 else "")
        fabric.print(f"resumed from {resume} at step {state['step']} on {ranks}")
    data = ByteDataModule(seq_len=model_config.seq_len, **OmegaConf.to_container(config.data))
    data.setup("fit")
    batches = endless(fabric.setup_dataloaders(data.train_dataloader()))
    while state["step"] < train.max_steps:
        step = state["step"]
        fabric.call("on_fabric_step_start", fabric=fabric, model=model, step=step)
        for micro in range(train.accumulate):
            batch = next(batches)
            with fabric.no_backward_sync(model, enabled=micro < train.accumulate - 1):
                logits = model(batch[:, :-1])
                loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
                fabric.backward(loss / train.accumulate)
        fabric.clip_gradients(model, optimizer, max_norm=train.max_norm)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        fabric.call(
            "on_fabric_step_end",
            fabric=fabric,
            model=model,
            step=step,
            optimizers=[optimizer],
            batch=batch,
            micro_batches=train.accumulate,
        )
        mean_loss = fabric.all_reduce(loss.detach(), reduce_op="mean").item()
        if (step + 1) % every == 0:
            fabric.log_dict({"train_loss": mean_loss, "lr": scheduler.get_last_lr()[0]}, step=step)
        state["step"] = step + 1
        if state["step"] % train.save_every_n_steps == 0 or state["step"] == train.max_steps:
            fabric.save(out / "last.ckpt", state)
    if fabric.is_global_zero:
        logger.experiment.finish()  # closes the run in W&B's service, so that a resume can reopen it
    fabric.print(f"done: {state['step']} steps, train_loss {mean_loss:.4f}; checkpoint: {out / 'last.ckpt'}")
    again = example_config.continue_command(argv, "last", "train.max_steps", 2 * train.max_steps)
    fabric.print(f"train further with: {again}")


if __name__ == "__main__":
    main(sys.argv[1:])
