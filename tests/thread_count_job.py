"""One step under whichever launcher started this script; each rank prints its thread count
(tests/test_threads.py). ``trainer`` or ``fabric``, then a strategy: ``ours`` or ``ddp``."""

from __future__ import annotations

import os
import sys
import warnings

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fsdp_strategy import FSDPCustomFabricStrategy, FSDPCustomStrategy


def report(rank: int) -> None:
    print(f"THREADS rank={rank} threads={torch.get_num_threads()} omp={os.environ.get('OMP_NUM_THREADS')}", flush=True)


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        report(self.global_rank)
        return self.net(batch[0]).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main(loop: str, strategy: str) -> None:
    warnings.filterwarnings("ignore")
    data = TensorDataset(torch.randn(8, 4))
    if loop == "trainer":
        chosen = FSDPCustomStrategy() if strategy == "ours" else "ddp"
        trainer = L.Trainer(
            strategy=chosen,
            accelerator="cpu",
            devices=2,
            max_steps=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(Model(), DataLoader(data, batch_size=2))
    else:
        fabric = L.Fabric(
            strategy=FSDPCustomFabricStrategy() if strategy == "ours" else "ddp", accelerator="cpu", devices=2
        )
        fabric.launch()
        report(fabric.global_rank)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
