"""Tensor parallel inside, fsdp_custom across: Lightning's tensor-parallel example on our strategy.

    python examples/tensor_parallel.py                                   # 2 CPU processes: 1 x 2
    python examples/tensor_parallel.py --devices 4 --data-parallel 2 --tensor-parallel 2

The byte-level GPT of ``gpt.py`` on the Python standard library's source (text every machine
has). ``configure_model`` applies the tensor-parallel plan on ``self.device_mesh["tensor_parallel"]``
exactly as for Lightning's ``ModelParallelStrategy``: each block's MLP is split (``fc`` by columns,
``out`` by rows), the attention, embeddings and head stay whole on every tensor-parallel rank. The
strategy then shards every parameter over "data_parallel", samples batches over it and clips
gradients by their global norm. ``--compare`` also trains the same model in one process on the same
global batches and prints both losses side by side.
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
import noise
import torch
import torch.nn.functional as F
from gpt import GPT, Block, ByteWindows, GPTConfig, read_corpus
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader

from fsdp_strategy import FSDPCustomStrategy

CONFIG = GPTConfig(d_model=64, n_layers=2, n_heads=2, seq_len=32)


class TensorParallelGPT(pl.LightningModule):
    """The GPT with its MLPs split over tensor parallel (the plan is all that differs from 1-D)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same weights on every rank, and in the one-process run
        self.model = GPT(CONFIG)
        self.losses: list[float] = []
        self.batches: list[torch.Tensor] = []  # what this rank trained on, for --compare

    def configure_model(self) -> None:
        plan = {"fc": ColwiseParallel(), "out": RowwiseParallel()}
        for block in self.model.blocks:
            parallelize_module(block, self.device_mesh["tensor_parallel"], plan)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = lm_loss(self.model, batch)
        self.losses.append(loss.item())
        self.batches.append(batch.cpu())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def lm_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())


def one_process(batches: list[torch.Tensor], steps: int) -> list[float]:
    """The same model and global batches in this process alone: the oracle."""
    torch.manual_seed(0)
    model = GPT(CONFIG)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for batch in batches[:steps]:
        loss = lm_loss(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--data-parallel", type=int, default=1, help="data_parallel_size")
    parser.add_argument("--tensor-parallel", type=int, default=2, help="tensor_parallel_size")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=4, help="per data-parallel rank")
    parser.add_argument("--compare", action="store_true", help="also train in one process and compare")
    args = parser.parse_args()
    noise.quiet_known_noise()
    windows = ByteWindows(read_corpus(None, 200_000), CONFIG.seq_len)
    strategy = FSDPCustomStrategy(
        data_parallel_size=args.data_parallel, tensor_parallel_size=args.tensor_parallel, auto_wrap_policy={Block}
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_steps=args.steps,
        gradient_clip_val=1.0,
        enable_checkpointing=False,  # a demo of the plan: docs/checkpoints.md shows 2-D checkpoints
        logger=False,
        enable_model_summary=False,
    )
    module = TensorParallelGPT()
    loader = DataLoader(windows, batch_size=args.batch_size, shuffle=False)
    trainer.fit(module, loader)
    losses = torch.tensor(module.losses)
    torch.distributed.all_reduce(losses)  # the data-parallel ranks' means (TP peers count alike)
    losses /= trainer.world_size
    if trainer.global_rank == 0:
        print(f"mesh {dict(zip(strategy.device_mesh.mesh_dim_names, strategy.device_mesh.shape))}")
        print("loss per step: " + " ".join(f"{value:.4f}" for value in losses.tolist()))
    if args.compare:
        everyone: list = [None] * trainer.world_size
        torch.distributed.all_gather_object(everyone, module.batches)
        tensor_parallel = trainer.world_size // args.data_parallel  # TP is the inner dimension of the mesh
        data_ranks = everyone[::tensor_parallel]  # the first rank of each tensor-parallel group
        batches = [torch.cat([rows[step] for rows in data_ranks]) for step in range(len(module.batches))]
        if trainer.global_rank == 0:
            reference = one_process(batches, args.steps)
            print("one process:   " + " ".join(f"{value:.4f}" for value in reference))
            worst = max(abs(a - b) / b for a, b in zip(losses.tolist(), reference))
            print(f"largest relative difference: {worst:.2e}")


if __name__ == "__main__":
    main()
