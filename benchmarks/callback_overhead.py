"""Step-time overhead of each monitor at its default interval, on the GPT example's model.

    python benchmarks/callback_overhead.py                 # 2 CPU ranks, Lightning launches the second
    python benchmarks/callback_overhead.py --steps 200 --repeats 3

Every configuration (no monitor, each monitor alone, all three) trains the same model for
``--steps`` steps in the same job; configurations are interleaved over ``--repeats`` rounds so
that drift of the machine spreads evenly. Two measures on rank 0: the time spent inside the
monitors' hooks (all-gathers included) as a share of the training time, which is exact, and the
mean step time against the no-monitor run, which carries the machine's noise (about 1 %).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from gpt import Block, GPTConfig  # noqa: E402
from lit_gpt import ByteDataModule, GPTModule, OptimizerSettings  # noqa: E402

import fsdp_strategy  # noqa: E402
from fsdp_strategy.callbacks import CommunicationMonitor, MemoryMonitor, ThroughputMonitor  # noqa: E402

CONFIGS = {
    "none": list,
    "MemoryMonitor": lambda: [MemoryMonitor()],
    "ThroughputMonitor": lambda: [ThroughputMonitor()],
    "CommunicationMonitor": lambda: [CommunicationMonitor()],
    "all three": lambda: [MemoryMonitor(), ThroughputMonitor(), CommunicationMonitor()],
}


def timed(callback: Callback, spent: list[float]) -> Callback:
    """Wrap the callback's training hooks so that the time spent in them adds up in ``spent``."""
    for hook in ("on_train_start", "on_train_batch_start", "on_train_batch_end"):
        original = getattr(callback, hook)

        def wrapper(*args, _original=original, **kwargs):
            start = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - start

        setattr(callback, hook, wrapper)
    return callback


class StepTimer(Callback):
    """Wall time of every training step (batch start to batch end)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, *_) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, *_) -> None:
        self.times.append(time.perf_counter() - self._start)


def run(config: str, args: argparse.Namespace, root: Path) -> tuple[list[float], float]:
    L.seed_everything(0)
    timer = StepTimer()
    spent = [0.0]
    model = GPTConfig(vocab_size=256, d_model=128, n_layers=4, n_heads=4, seq_len=128)
    optimizer = OptimizerSettings(lr=1e-3, weight_decay=0.1, warmup_steps=5)
    trainer = L.Trainer(
        strategy=fsdp_strategy.FSDPCustomStrategy(auto_wrap_policy={Block}),
        accelerator="cpu",
        devices=2,
        max_steps=args.steps,
        logger=CSVLogger(root, name=config.replace(" ", "_")),
        callbacks=[timer, *(timed(callback, spent) for callback in CONFIGS[config]())],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    data = ByteDataModule(max_bytes=2_000_000, batch_size=8, seq_len=128)
    trainer.fit(GPTModule(model, optimizer, args.steps), datamodule=data)
    return timer.times[args.warmup :], spent[0] / sum(timer.times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=110)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    times: dict[str, list[float]] = {name: [] for name in CONFIGS}
    shares: dict[str, list[float]] = {name: [] for name in CONFIGS}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeats):
            for name in CONFIGS:
                step_times, share = run(name, args, Path(tmp))
                times[name].extend(step_times)
                shares[name].append(share)
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        base = statistics.mean(times["none"])
        print("| monitors | time in their hooks / training time | mean step s | vs none |")
        print("|---|---|---|---|")
        for name, values in times.items():
            mean = statistics.mean(values)
            share = 100 * statistics.mean(shares[name])
            print(f"| {name} | {share:.3f} % | {mean:.4f} | {100 * (mean - base) / base:+.2f} % |")


if __name__ == "__main__":
    main()
