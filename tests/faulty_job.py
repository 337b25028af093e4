"""A Lightning job with one fault injected on one rank, for tests/test_faults.py.

    python tests/faulty_job.py --fault kill --rank 1 --step 3          # Lightning's launcher, 2 ranks
    torchrun --nproc_per_node=2 tests/faulty_job.py --fault raise ...   # torchrun

Faults, at ``--step`` on ``--rank``: ``kill`` (SIGKILL of itself), ``exit`` (``os._exit(3)``),
``raise`` (ValueError in training_step), ``hang`` (sleeps in training_step), ``drift`` (calls
block 0 once more than the other ranks, a unit of the same size as block 1), ``save_kill``
and ``save_kill_all`` (SIGKILL of the rank, or of the whole job, in the middle of the sharded
save of ``last.ckpt`` into ``--checkpoints``, after the rank's shards are written).
"""

from __future__ import annotations

import argparse
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


class FaultyLM(L.LightningModule):
    def __init__(self, fault: str, rank: int, step: int) -> None:
        super().__init__()
        self.net = TiedLM()
        self.fault, self.fault_rank, self.fault_step = fault, rank, step

    def training_step(self, batch, batch_idx):
        due = self.global_rank == self.fault_rank and self.global_step == self.fault_step
        if due and self.fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if due and self.fault == "exit":
            os._exit(3)
        if due and self.fault == "raise":
            raise ValueError("injected failure in training_step")
        if self.fault == "caught" and self.global_step == self.fault_step and not self.trainer.sanity_checking:
            raise ValueError("the same failure on every rank")
        if due and self.fault == "hang":
            time.sleep(600)
        if due and self.fault == "slow":  # an honest wait for the other ranks, below any timeout
            time.sleep(1.5)
        loss = lm_loss(self.net, batch[0])
        if due and self.fault == "drift":
            x = self.net.embed(batch[0][:, :-1])
            loss = loss + self.net.blocks[0](x).sum() * 0
        return loss

    def on_train_start(self):
        print(f"STARTED rank {self.global_rank} at step {self.global_step}", flush=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def die_during_save(trainer: L.Trainer, rank: int, step: int, whole_job: bool) -> None:
    """SIGKILL ``rank`` (or every process of the job) in the sharded save at ``step``, after this
    rank's shards are written and before the ranks agree to commit."""
    import fsdp_strategy.checkpoint.sharded as sharded

    write_dcp = sharded.write_dcp

    def write_then_die(*args, **kwargs):
        write_dcp(*args, **kwargs)
        if trainer.global_rank == rank and trainer.global_step == step:
            if whole_job:
                os.killpg(os.getpgid(0), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)

    sharded.write_dcp = write_then_die


def fail_before_save(trainer: L.Trainer, rank: int, step: int) -> None:
    """``rank`` raises while preparing the sharded save at ``step``, before DCP's collectives."""
    import fsdp_strategy.checkpoint.sharded as sharded

    prepare_state = sharded.prepare_state

    def failing(*args, **kwargs):
        if trainer.global_rank == rank and trainer.global_step == step:
            raise OSError("injected failure while preparing the save")
        return prepare_state(*args, **kwargs)

    sharded.prepare_state = failing


def build_trainer(args: argparse.Namespace) -> L.Trainer:
    kwargs = {} if args.collective_timeout is None else {"collective_timeout": args.collective_timeout}
    async_save = args.fault == "async_after_fit"
    strategy = FSDPCustomStrategy(auto_wrap_policy={Block}, state_dict_type="sharded", async_save=async_save, **kwargs)
    return L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=args.devices,
        num_nodes=args.num_nodes,
        max_steps=8,
        logger=False,
        enable_checkpointing=args.checkpoints is not None,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ModelCheckpoint(args.checkpoints, save_last=True, save_top_k=0, every_n_train_steps=1)]
        if args.checkpoints
        else [],
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fault", required=True)
    parser.add_argument("--rank", type=int, default=1)
    parser.add_argument("--step", type=int, default=3)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--collective-timeout", type=float, default=None)
    parser.add_argument("--checkpoints", default=None, help="save last.ckpt there after every step")
    parser.add_argument("--resume", action="store_true", help='fit from ckpt_path="last"')
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    trainer = build_trainer(args)
    if args.fault in ("save_kill", "save_kill_all"):
        die_during_save(trainer, args.rank, args.step, whole_job=args.fault == "save_kill_all")
    if args.fault == "save_raise":
        fail_before_save(trainer, args.rank, args.step)
    data = make_batches(8, 4 * args.devices * args.num_nodes).reshape(-1, make_batches(1, 1).shape[-1])
    module = FaultyLM(args.fault, args.rank, args.step)
    loader = DataLoader(TensorDataset(data), batch_size=4)
    if args.fault == "caught":  # every rank fails alike, the script goes on with a new run
        try:
            trainer.fit(module, loader)
        except ValueError:
            pass
        trainer, module.fault = build_trainer(args), "slow"  # rank 1 is slow at step 2 of the new run
    if args.resume:
        trainer.fit(module, loader, ckpt_path="last")
    else:
        trainer.fit(module, loader)
    if args.fault == "async_after_fit":  # the background group was released at the end of fit
        for _ in range(2):  # a new one, then a replacement; the second finishes as the process exits
            trainer.save_checkpoint(os.path.join(args.checkpoints, "after.ckpt"))
    print(f"FINISHED rank {trainer.global_rank} at step {trainer.global_step}", flush=True)


if __name__ == "__main__":
    main()
