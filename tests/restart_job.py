"""A 12-step Lightning job that saves ``last`` every 2 steps and always fits from ``ckpt_path="last"``:
what a user runs under ``torchrun --max-restarts``, a node-elastic torchrun, or SLURM's requeue
(tests/test_restarts.py, benchmarks/restarts.py).

    torchrun --nproc-per-node 2 --max-restarts 1 --rdzv-backend c10d tests/restart_job.py \
        --root OUT --kill-rank 1 --kill-step 7

Each rank appends ``{"step", "loss", "world"}`` per trained step to ``OUT/losses/rank<r>.jsonl`` and
``{"event": "started", "step", "time"}`` as training (re)starts, so a test compares the steps
trained after a resume with an uninterrupted run's. ``--kill-step`` lists the steps of the job's
faults, in order (a step may repeat: ten restarts in a row); the faulty rank writes
``OUT/fault-<n>`` as it injects fault ``n``, so a restarted job goes on to the next one.
``--kill-node`` SIGKILLs the whole node (its agent included: the node is lost for good).
``--sigusr1-step``: every rank waits there until ``OUT/signalled`` exists (the test sends SLURM's
SIGUSR1 to every rank, then writes it).

Data: 48 samples of random tokens, shuffled per epoch by the DistributedSampler Lightning adds, 2
per rank per step; an epoch is ``48 / (2 * world)`` steps (12 at world 2), so most saves are
mid-epoch and a resume continues the epoch where the checkpoint left it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).parent))
from models import Block, TiedLM, lm_loss, make_batches  # noqa: E402

from fsdp_strategy import FSDPCustomStrategy  # noqa: E402

SAMPLES = 48
PER_RANK_BATCH = 2


def kill_node_of_this_rank() -> None:
    """SIGKILL torchrun's agent of this rank and the agent's other ranks (each rank runs in a
    session of its own, so no process group holds them all)."""
    agent = os.getppid()
    siblings = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == agent and int(stat.parent.name) != os.getpid():
            siblings.append(int(stat.parent.name))
    os.kill(agent, signal.SIGKILL)
    for pid in siblings:
        os.kill(pid, signal.SIGKILL)


class RestartLM(L.LightningModule):
    """TiedLM with AdamW; records every trained step's loss and injects the job's faults."""

    def __init__(self, root: Path, kill_steps: list[int], kill_rank: int, kill_node: bool, sigusr1_step: int) -> None:
        super().__init__()
        self.net = TiedLM()
        self.root, self.kill_steps, self.kill_rank = root, kill_steps, kill_rank
        self.kill_node, self.sigusr1_step = kill_node, sigusr1_step

    def _record(self, entry: dict) -> None:
        folder = self.root / "losses"
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / f"rank{self.global_rank}.jsonl", "a") as out:
            out.write(json.dumps(entry) + "\n")

    def on_train_start(self) -> None:
        self._record({"event": "started", "step": self.global_step, "time": time.time()})

    def training_step(self, batch, batch_idx):
        self._maybe_fault()
        loss = lm_loss(self.net, batch[0])
        self._record({"step": self.global_step, "loss": loss.item(), "world": self.trainer.world_size})
        return loss

    def _maybe_fault(self) -> None:
        done = len(list(self.root.glob("fault-*")))  # faults already injected by earlier attempts
        due = done < len(self.kill_steps) and self.kill_steps[done] == self.global_step
        if due and self.global_rank == self.kill_rank:
            (self.root / f"fault-{done}").write_text(f"{time.time():.3f}")
            if self.kill_node:  # this node's agent and ranks: the node is gone for good
                kill_node_of_this_rank()
            os.kill(os.getpid(), signal.SIGKILL)
        if self.global_step == self.sigusr1_step and not (self.root / "signalled").exists():
            print(f"WAITING rank {self.global_rank} at step {self.global_step}", flush=True)
            while not (self.root / "signalled").exists():  # the test sends the signal, then writes this
                time.sleep(0.05)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", type=Path, required=True, help="checkpoints and loss records go here")
    parser.add_argument("--kill-step", type=int, nargs="*", default=[], help="SIGKILL --kill-rank at these steps")
    parser.add_argument("--kill-rank", type=int, default=1)
    parser.add_argument("--kill-node", action="store_true", help="kill the rank's whole node, its agent included")
    parser.add_argument("--sigusr1-step", type=int, default=-1, help="every rank waits there for SIGUSR1")
    parser.add_argument("--max-steps", type=int, default=12)
    parser.add_argument("--devices", type=int, default=None, help="default: torchrun's LOCAL_WORLD_SIZE")
    parser.add_argument("--num-nodes", type=int, default=None, help="default: torchrun's node count")
    parser.add_argument("--strategy", default="fsdp_custom", choices=["fsdp_custom", "ddp"])
    parser.add_argument("--state-dict-type", default="sharded", choices=["full", "sharded"])
    parser.add_argument("--accelerator", default="cpu", help='"cuda": NCCL (tests/gpu/acceptance.py)')
    parser.add_argument("--ckpt-path", default="last", help='"none": fit(ckpt_path=None), as under SLURM')
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    devices = args.devices or int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    world = int(os.environ.get("WORLD_SIZE", devices))
    num_nodes = args.num_nodes or world // devices
    strategy = "ddp_find_unused_parameters_true"  # TiedLM has a block that is never called
    if args.strategy == "fsdp_custom":
        strategy = FSDPCustomStrategy(auto_wrap_policy={Block}, state_dict_type=args.state_dict_type)
    checkpoints = ModelCheckpoint(  # last.ckpt, and every save kept as step=<n>.ckpt (to resume from elsewhere)
        args.root / "checkpoints", "{step}", save_last=True, save_top_k=-1, every_n_train_steps=2
    )
    trainer = L.Trainer(
        strategy=strategy,
        accelerator=args.accelerator,
        devices=devices,
        num_nodes=num_nodes,
        max_steps=args.max_steps,
        default_root_dir=args.root,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[checkpoints],
    )
    data = make_batches(1, SAMPLES)[0]
    module = RestartLM(args.root, args.kill_step, args.kill_rank, args.kill_node, args.sigusr1_step)
    loader = DataLoader(TensorDataset(data), batch_size=PER_RANK_BATCH, shuffle=True)
    trainer.fit(module, loader, ckpt_path=None if args.ckpt_path == "none" else args.ckpt_path)
    print(f"FINISHED rank {trainer.global_rank} at step {trainer.global_step}", flush=True)


if __name__ == "__main__":
    main()
