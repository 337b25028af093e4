"""Run under two torchrun "nodes" of 2 ranks (tests/test_multinode.py): Lightning DDP, then
HYBRID_SHARD with its default mesh and _HYBRID_SHARD_ZERO2, on the same data; global rank 0
prints one JSON line with the losses and what each strategy built."""

import json
import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).parent))
from models import Block, make_batches  # noqa: E402
from test_strategy import LitLM  # noqa: E402

from fsdp_strategy import FSDPCustomStrategy  # noqa: E402


def fit(strategy) -> tuple[list[float], L.Trainer]:
    torch.manual_seed(0)
    module = LitLM()
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        num_nodes=2,
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = make_batches(3, 8).reshape(24, -1)
    trainer.fit(module, DataLoader(TensorDataset(data), batch_size=2))
    losses = torch.stack(module.losses)
    dist.all_reduce(losses)
    return (losses / dist.get_world_size()).tolist(), trainer


report = {"ddp": fit("ddp_find_unused_parameters_true")[0]}
for name in ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"):
    losses, trainer = fit(FSDPCustomStrategy(sharding_strategy=name, auto_wrap_policy={Block}))
    scheduler = trainer.strategy.scheduler
    unit = scheduler.root_unit
    report[name] = {
        "losses": losses,
        "groups": [unit.shard_comm.size, unit.replicate_comm.size],
        "shard_ranks": sorted(dist.get_process_group_ranks(unit.shard_comm.group)) if unit.shard_comm.group else [],
        "reshard_after_forward": scheduler.sharding_strategy.reshard_after_forward,
    }
if dist.get_rank() == 0:
    print("REPORT " + json.dumps(report))
