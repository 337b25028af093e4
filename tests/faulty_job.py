"""A Lightning job with one fault injected on one rank, for tests/test_faults.py.

    python tests/faulty_job.py --fault kill --rank 1 --step 3          # Lightning's launcher, 2 ranks
    torchrun --nproc_per_node=2 tests/faulty_job.py --fault raise ...   # torchrun

Faults, at ``--step`` on ``--rank``: ``kill`` (SIGKILL of itself), ``exit`` (``os._exit(3)``),
``raise`` (ValueError in training_step), ``hang`` (sleeps in training_step), ``drift`` (calls
block 0 once more than the other ranks, a unit of the same size as block 1), ``save_kill``
and ``save_kill_all`` (SIGKILL of the rank, or of the whole job, in the middle of the sharded
save of ``last.ckpt`` into ``--checkpoints``, after the rank's shards are written). The faulty
rank prints ``FAULT at <wall time>`` as it injects one (the tests time the end from it).
Healthy jobs that must end well: ``caught_slow`` (every rank raises ``StopTraining`` at
``--step``, rank 0 after 6 s of its own work; the script catches it and rank 0 post-processes
for ``--post-seconds``), ``barrier_raise`` (rank 0 waits in a barrier while ``--rank`` raises:
rank 0 must fail there and run its handlers),
``slow_save`` (rank 0's full checkpoint write at ``--step`` takes ``--save-seconds``), and
``none`` with ``--step-seconds`` (a slow step, to send signals to). ``--tensor-parallel N``: a
model split by a tensor-parallel plan over N ranks (tp_models).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).parent))
import tp_models  # noqa: E402
from models import Block, TiedLM, lm_loss, make_batches  # noqa: E402

from fsdp_strategy import FSDPCustomStrategy  # noqa: E402


class StopTraining(Exception):
    """A user's own "stop here" signal, raised on every rank."""


INJECTED_IN_STEP = ("kill", "exit", "raise", "barrier_raise", "hang", "drift")


def announce_fault() -> None:
    """Print the wall time of the fault (the tests measure from it to the end of every rank)."""
    print(f"FAULT at {time.time():.3f}", flush=True)


class FaultyLM(L.LightningModule):
    def __init__(self, fault: str, rank: int, step: int) -> None:
        super().__init__()
        self.net = TiedLM()
        self.fault, self.fault_rank, self.fault_step = fault, rank, step
        self.step_seconds = 0.0

    def training_step(self, batch, batch_idx):
        due = self.global_rank == self.fault_rank and self.global_step == self.fault_step
        if due and self.fault in INJECTED_IN_STEP:
            announce_fault()
        if due and self.fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if due and self.fault == "exit":
            os._exit(3)
        if due and self.fault in ("raise", "barrier_raise"):
            raise ValueError("injected failure in training_step")
        if self.fault == "barrier_raise" and self.global_step == self.fault_step:
            self.trainer.strategy.barrier("user")  # the other rank raised instead of joining
        if self.fault == "caught" and self.global_step == self.fault_step and not self.trainer.sanity_checking:
            raise ValueError("the same failure on every rank")
        if due and self.fault == "hang":
            time.sleep(600)
        if due and self.fault == "slow":  # an honest wait for the other ranks, below any timeout
            time.sleep(1.5)
        if self.fault == "caught_slow" and self.global_step == self.fault_step:
            if self.global_rank == 0:
                time.sleep(6)  # its own work first (an upload), longer than any grace period
            raise StopTraining(f"rank {self.global_rank} stops here")
        time.sleep(self.step_seconds)
        loss = self.loss(batch[0])
        if due and self.fault == "drift":
            x = self.net.embed(batch[0][:, :-1])
            loss = loss + self.net.blocks[0](x).sum() * 0
        return loss

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        return lm_loss(self.net, tokens)

    def _init_weights(self, module):  # meta init: what reset_parameters() does not cover
        if module is self.net:
            module.scale.fill_(1.5)
            module.position.normal_(0, 0.1)

    def on_train_start(self):
        print(f"STARTED rank {self.global_rank} at step {self.global_step}", flush=True)
        dog = getattr(getattr(self.trainer.strategy, "_watch", None), "dog", None)  # fsdp_custom only
        if dog is not None:
            collective, control = dog.limits
            print(f"LIMITS rank {self.global_rank}: collective {collective:g} s, blocking calls {control:g} s")

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class FaultyTensorParallelLM(FaultyLM):
    """FaultyLM on tp_models' TinyLM, split by its tensor-parallel plan (``--tensor-parallel``): a
    peer's death then first shows in tensor parallel's own collectives, inside the forward."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.net = tp_models.TinyLM()

    def configure_model(self) -> None:
        tp_models.parallelize(self.net, self.device_mesh["tensor_parallel"], sequence_parallel=True)

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self.net(tokens % tp_models.VOCAB)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), (tokens % tp_models.VOCAB).flatten())


def die_during_save(trainer: L.Trainer, rank: int, step: int, whole_job: bool) -> None:
    """SIGKILL ``rank`` (or every process of the job) in the sharded save at ``step``, after this
    rank's shards are written and before the ranks agree to commit."""
    import fsdp_strategy.checkpoint.sharded as sharded

    write_dcp = sharded.write_dcp

    def write_then_die(*args, **kwargs):
        write_dcp(*args, **kwargs)
        if trainer.global_rank == rank and trainer.global_step == step:
            announce_fault()
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
            announce_fault()
            raise OSError("injected failure while preparing the save")
        return prepare_state(*args, **kwargs)

    sharded.prepare_state = failing


class SlowOnException(L.Callback):
    """Rank 0 spends ``seconds`` in ``on_exception`` (an upload) after the checkpoint is saved."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_exception(self, trainer, pl_module, exception):
        if trainer.global_rank == 0:
            time.sleep(self.seconds)
        print(f"ON_EXCEPTION rank {trainer.global_rank}: {type(exception).__name__}", flush=True)


def slow_down_save(trainer: L.Trainer, step: int, seconds: float) -> None:
    """Rank 0's write of the (full) checkpoint at ``step`` takes ``seconds`` more."""
    io = trainer.strategy.checkpoint_io
    save = io.save_checkpoint

    def slow_save(*args, **kwargs):
        if trainer.global_rank == 0 and trainer.global_step == step:
            time.sleep(seconds)
        return save(*args, **kwargs)

    io.save_checkpoint = slow_save


def build_strategy(args: argparse.Namespace) -> object:
    if args.strategy != "fsdp_custom":
        return args.strategy
    kwargs = {} if args.collective_timeout is None else {"collective_timeout": args.collective_timeout}
    if args.pg_timeout is not None:
        kwargs["timeout"] = timedelta(seconds=args.pg_timeout)
    async_save = args.fault == "async_after_fit"
    state_dict_type = "full" if args.fault == "slow_save" else "sharded"
    if args.tensor_parallel:
        kwargs["tensor_parallel_size"] = args.tensor_parallel
    block = tp_models.Block if args.tensor_parallel else Block
    return FSDPCustomStrategy(
        auto_wrap_policy={block}, state_dict_type=state_dict_type, async_save=async_save, **kwargs
    )


def build_trainer(args: argparse.Namespace) -> L.Trainer:
    strategy = build_strategy(args)
    return L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=args.devices,
        num_nodes=args.num_nodes,
        max_steps=8,
        default_root_dir=os.getcwd(),  # failing ranks' rings go here (the test's own folder)
        logger=False,
        enable_checkpointing=args.checkpoints is not None,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks(args),
    )


def callbacks(args: argparse.Namespace) -> list[L.Callback]:
    if args.on_exception_seconds is not None:  # then save a checkpoint on exception
        return [OnExceptionCheckpoint(args.checkpoints), SlowOnException(args.on_exception_seconds)]
    if args.checkpoints:
        return [ModelCheckpoint(args.checkpoints, save_last=True, save_top_k=0, every_n_train_steps=1)]
    return [SlowOnException(0.0)]  # says that on_exception ran


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fault", required=True)
    parser.add_argument("--rank", type=int, default=1)
    parser.add_argument("--step", type=int, default=3)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--collective-timeout", type=float, default=None)
    parser.add_argument("--pg-timeout", type=float, default=None, help="the strategy's timeout, in seconds")
    parser.add_argument("--save-seconds", type=float, default=8.0, help="slow_save: rank 0's write takes this")
    parser.add_argument("--post-seconds", type=float, default=2.0, help="caught_slow: rank 0's post-processing")
    parser.add_argument("--step-seconds", type=float, default=0.0, help="each training step sleeps this")
    parser.add_argument("--on-exception-seconds", type=float, default=None, help="rank 0's on_exception takes this")
    parser.add_argument("--meta-init", action="store_true", help="build the model on the meta device")
    parser.add_argument("--strategy", default="fsdp_custom", choices=["fsdp_custom", "ddp_find_unused_parameters_true"])
    parser.add_argument("--checkpoints", default=None, help="save last.ckpt there after every step")
    parser.add_argument("--resume", action="store_true", help='fit from ckpt_path="last"')
    parser.add_argument("--tensor-parallel", type=int, default=None, help="tensor_parallel_size, tp_models' plan")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    trainer = build_trainer(args)
    if args.fault in ("save_kill", "save_kill_all"):
        die_during_save(trainer, args.rank, args.step, whole_job=args.fault == "save_kill_all")
    if args.fault == "save_raise":
        fail_before_save(trainer, args.rank, args.step)
    if args.fault == "slow_save":
        slow_down_save(trainer, args.step, args.save_seconds)
    data = make_batches(8, 4 * args.devices * args.num_nodes).reshape(-1, make_batches(1, 1).shape[-1])
    with trainer.init_module(empty_init=args.meta_init):  # meta: the engine materializes it unit by unit
        module = (FaultyTensorParallelLM if args.tensor_parallel else FaultyLM)(args.fault, args.rank, args.step)
    module.step_seconds = args.step_seconds
    loader = DataLoader(TensorDataset(data), batch_size=4)
    if args.fault == "caught":  # every rank fails alike, the script goes on with a new run
        try:
            trainer.fit(module, loader)
        except ValueError:
            pass
        trainer, module.fault = build_trainer(args), "slow"  # rank 1 is slow at step 2 of the new run
    if args.fault == "caught_slow":
        try:
            trainer.fit(module, loader)
        except StopTraining as stop:
            if trainer.global_rank == 0:
                time.sleep(args.post_seconds)  # post-processing of its own (an upload)
            print(f"CAUGHT {stop} at step {trainer.global_step}", flush=True)
        return
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
