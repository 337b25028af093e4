"""Lightning-level benchmark modes: the GPT model trained by ``Trainer.fit`` as a user would run
it, with Lightning's DDP, FSDP2 through ``ModelParallelStrategy``, and ``fsdp_custom``. Used by
``compare.py`` (modes ``L_*``). Lightning's ``FSDPStrategy`` (FSDP1) is absent: the Trainer and
FSDP1 itself refuse CPU devices ("FSDP needs a non-CPU accelerator device").

Each mode runs in freshly spawned ranks (torchrun-style environment, so Lightning launches
nothing itself; one thread each; gloo). A callback times every training step on every rank
(``on_train_batch_start`` to ``on_train_batch_end``, after a barrier); the step time of a step is
the slowest rank's. Checkpointing, logging, the progress bar and the model summary are off.
"""

from __future__ import annotations

import os
import resource
import socket
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from spawn import spawn_ranks

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

LIGHTNING_MODES = ["L_ddp", "L_fsdp2", "L_custom", "L_custom_grad_op"]


def _strategy(mode: str):
    from gpt import Block
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    from fsdp_strategy import FSDPCustomStrategy

    if mode == "L_ddp":
        return DDPStrategy(process_group_backend="gloo")
    if mode == "L_fsdp2":
        return ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1, process_group_backend="gloo")
    sharding = "SHARD_GRAD_OP" if mode.endswith("grad_op") else "FULL_SHARD"
    return FSDPCustomStrategy(auto_wrap_policy={Block}, sharding_strategy=sharding)


def _module(mode: str, config, lr: float):
    import lightning as L
    from gpt import GPT

    class GPTStep(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = None if mode == "L_fsdp2" else GPT(config)
            self.losses: list[float] = []

        def configure_model(self) -> None:
            if self.model is not None:
                return
            from torch.distributed.fsdp import fully_shard

            torch.manual_seed(0)
            self.model = GPT(config)
            mesh = self.device_mesh["data_parallel"]
            for block in self.model.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(self.model, mesh=mesh)

        def training_step(self, batch, batch_idx):
            (tokens,) = batch
            logits = self.model(tokens[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            self.losses.append(loss.detach().clone())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=lr)

    torch.manual_seed(0)
    return GPTStep()


THREAD_KINDS = ("training", "gloo", "exchange", "other")


def thread_cpu_seconds() -> dict[int, tuple[str, float]]:
    """CPU seconds each thread of this process has run so far, by native id, with its OS name (Linux:
    ``/proc/self/task/<id>/schedstat``, nanoseconds; ``{}`` elsewhere). Costs: two small file reads per
    thread."""
    tasks = Path("/proc/self/task")
    if not tasks.is_dir():
        return {}
    seconds = {}
    for task in tasks.iterdir():
        try:
            name = (task / "comm").read_text().strip()
            seconds[int(task.name)] = (name, int((task / "schedstat").read_text().split()[0]) * 1e-9)
        except (OSError, ValueError, IndexError):  # a thread that ended meanwhile
            continue
    return seconds


def cpu_by_kind(start: dict[int, tuple[str, float]], end: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds between two ``thread_cpu_seconds()`` readings of the calling (training) thread,
    gloo's threads (OS names ``gloo*`` / ``pt_gloo*``), the engine's exchange thread
    (``fsdp_custom-exchange``) and all other threads."""
    exchange = {t.native_id for t in threading.enumerate() if t.name == "fsdp_custom-exchange"}
    training = threading.get_native_id()
    totals = dict.fromkeys(THREAD_KINDS, 0.0)
    for tid, (name, seconds) in end.items():
        if tid == training:
            kind = "training"
        elif tid in exchange:
            kind = "exchange"
        elif name.startswith(("gloo", "pt_gloo")):
            kind = "gloo"
        else:
            kind = "other"
        totals[kind] += seconds - start.get(tid, (name, 0.0))[1]
    return totals


def _timer(warmup: int):
    import lightning as L

    from fsdp_strategy.engine.trace import host_times

    class StepTimer(L.Callback):
        """Per-step wall time of this rank, started after a barrier; from step ``warmup`` on, the
        engine's host seconds per range (``host``, empty for other strategies) and the CPU seconds
        of this process's threads by kind (``cpu``: ``cpu_by_kind``)."""

        def __init__(self) -> None:
            self.times: list[float] = []
            self._start = 0.0
            self._recording = host_times()
            self.host: dict[str, float] = {}
            self._threads: dict[int, tuple[str, float]] = {}
            self.cpu: dict[str, float] = {}

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if batch_idx == warmup:
                self.host = self._recording.__enter__()
                self._threads = thread_cpu_seconds()
            dist.barrier()
            self._start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.times.append(time.perf_counter() - self._start)

        def on_train_end(self, trainer, pl_module) -> None:
            self.cpu = cpu_by_kind(self._threads, thread_cpu_seconds())
            self._recording.__exit__(None, None, None)

    return StepTimer()


def _rank(rank: int, world: int, mode: str, args, port: int, queue) -> None:
    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "WORLD_SIZE": str(world),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world),
            "GROUP_RANK": "0",
            "TORCHELASTIC_RUN_ID": "bench",
        }
    )
    torch.set_num_threads(1)
    import lightning as L
    from gpt import GPTConfig
    from torch.utils.data import DataLoader, TensorDataset

    config = GPTConfig(args.vocab, args.d_model, args.n_layers, args.n_heads, args.seq_len, tie_embeddings=False)
    total = args.warmup + args.steps
    generator = torch.Generator().manual_seed(1)
    data = torch.randint(0, args.vocab, (total * args.batch * world, args.seq_len + 1), generator=generator)
    module = _module(mode, config, lr=1e-3)
    timer = _timer(args.warmup)
    trainer = L.Trainer(
        strategy=_strategy(mode),
        accelerator="cpu",
        devices=world,
        max_steps=total,
        callbacks=[timer],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(TensorDataset(data), batch_size=args.batch, shuffle=False))
    times = torch.tensor(timer.times[args.warmup :], dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    losses = torch.stack(module.losses[:5]).double()
    dist.all_reduce(losses)
    ledger = getattr(trainer.strategy, "comm_ledger", None)
    comm = None
    if ledger is not None:
        totals = [vars(t) for t in ledger.last_step.values()]
        comm = (sum(t["payload_bytes"] for t in totals), sum(t["wire_bytes"] for t in totals))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    queue.put(
        (
            rank,
            {
                "times": times.tolist(),
                "losses": (losses / world).tolist(),
                "rss": rss,
                "comm": comm,
                "host": {name: seconds / args.steps for name, seconds in timer.host.items()},
                "cpu": {kind: seconds / args.steps for kind, seconds in timer.cpu.items()},
            },
        )
    )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_lightning_mode(mode: str, args) -> dict:
    """Run one Lightning-level mode; the row ``compare.py`` prints (memory of P/G/O not measured)."""
    import statistics

    world = args.world
    results = spawn_ranks(_rank, world, world, mode, args, _free_port())
    first = results[0]
    return {
        "mode": mode,
        "world": world,
        "step_s": statistics.median(first["times"]),
        "step_min": min(first["times"]),
        "step_max": max(first["times"]),
        "pgo_mib": None,
        "rss_mib": max(r["rss"] for r in results.values()) / 2**20,
        "comm_mib": None if first["comm"] is None else (first["comm"][0] / 2**20, first["comm"][1] / 2**20),
        "losses": first["losses"],
        "host_s": first["host"],
        "cpu_s": first["cpu"],
    }
