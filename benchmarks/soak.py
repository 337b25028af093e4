"""Soak: the GPT example for many steps, watching for leaks and checking that runs repeat bitwise.

    python benchmarks/soak.py --steps 2000        # the table in docs/troubleshooting.md (about 10 minutes here)
    python benchmarks/soak.py --steps 200 --repeat-steps 40 --small   # the CI version (tests/test_soak.py)

Three fits of the example's GPT (examples/configs/gpt_small.yaml, or with ``--small`` a 2-layer
model of width 32 on sequences of 32 bytes, as the example's tests train; 2 CPU ranks, fsdp_custom with
the memory, throughput and communication monitors and an offline W&B logger):
1. ``--steps`` steps, sampling every ``--every`` steps on every rank: RSS, threads, open file
   descriptors, the flight recorder's ring, the ledger's and the memory account's entries, and
   the entries the monitors keep;
2. the same run again (same seed, same LR schedule) to ``--repeat-steps`` (default: ``--steps``):
   its final weights must equal run 1's at that step bit for bit;
3. half of ``--repeat-steps`` with a checkpoint at the end, then a resume to ``--repeat-steps``:
   its final weights must equal run 1's at that step bit for bit.
Rank 0 prints one JSON line ``SOAK {...}`` with the samples, the growth after warm-up and the
three weight hashes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

import lightning as L
import psutil
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import WandbLogger
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import noise  # noqa: E402
from gpt import Block, GPTConfig  # noqa: E402
from lit_gpt import ByteDataModule, GPTModule, OptimizerSettings  # noqa: E402

from fsdp_strategy import FSDPCustomStrategy  # noqa: E402
from fsdp_strategy.callbacks import CommunicationMonitor, MemoryMonitor, ThroughputMonitor  # noqa: E402
from fsdp_strategy.engine import get_scheduler, summon_full_params  # noqa: E402

CONFIG = OmegaConf.load(Path(__file__).resolve().parents[1] / "examples" / "configs" / "gpt_small.yaml")
SMALL = {"d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 32}  # --small: what the example's tests train


def _entries(value: object) -> int:
    """Entries held by a callback's containers (one level deep)."""
    return sum(len(item) for item in vars(value).values() if isinstance(item, (list, dict, set, tuple)))


class Probe(Callback):
    """Samples what could grow, every ``every`` steps, on this rank."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.samples: list[dict] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step % self.every:
            return
        scheduler = get_scheduler(trainer.strategy.model)
        process = psutil.Process()
        self.samples.append(
            {
                "step": step,
                "rss_mib": process.memory_info().rss / 2**20,
                "threads": process.num_threads(),
                "fds": process.num_fds(),
                "flight_ring": len(scheduler.observer.recorder.ring),
                "ledger_units": len(scheduler.ledger.per_unit) + len(scheduler.ledger.last_step_per_unit),
                "memory_timeline": len(scheduler.memory.timeline or []),
                "monitor_entries": sum(_entries(c) for c in trainer.callbacks if c is not self),
            }
        )


class WeightHash(Callback):
    """The SHA-256 of every full parameter after step ``at_step``, or at the end of training when
    None (a collective: all ranks)."""

    def __init__(self, at_step: int | None = None) -> None:
        self.at_step = at_step
        self.digest = ""

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.at_step:
            self.digest = self.weights(trainer, module)

    def on_train_end(self, trainer, module) -> None:
        if self.at_step is None:
            self.digest = self.weights(trainer, module)

    @staticmethod
    def weights(trainer, module) -> str:
        digest = hashlib.sha256()
        with summon_full_params(trainer.strategy.model):
            for name, param in sorted(module.named_parameters()):
                digest.update(name.encode())
                digest.update(param.detach().cpu().clone().view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()


def fit(
    steps: int,
    stop: int,
    root: Path,
    callbacks: list,
    logger=False,
    resume: str | None = None,
    hash_at: int | None = None,
) -> WeightHash:
    """Train the example's GPT (its LR schedule for ``steps``) until step ``stop``; the weights'
    hash after step ``hash_at`` (default: at the end)."""
    L.seed_everything(0)
    weights = WeightHash(hash_at)
    trainer = L.Trainer(
        strategy=FSDPCustomStrategy(auto_wrap_policy={Block}, state_dict_type="sharded"),
        accelerator="cpu",
        devices=2,
        max_steps=stop,
        limit_val_batches=0,
        gradient_clip_val=1.0,
        logger=logger,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(root),
        callbacks=[*callbacks, weights],
    )
    module = GPTModule(GPTConfig(**CONFIG.model), OptimizerSettings(**CONFIG.optimizer), steps, 8)
    data = ByteDataModule(seq_len=CONFIG.model.seq_len, **OmegaConf.to_container(CONFIG.data))
    trainer.fit(module, datamodule=data, ckpt_path=resume)
    return weights


def growth(samples: list[dict], key: str, warmup: int) -> float:
    """Relative growth of ``key`` from the first sample after ``warmup`` steps to the last."""
    after = [s[key] for s in samples if s["step"] >= warmup]
    return (after[-1] - after[0]) / after[0] if after and after[0] else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--every", type=int, default=50, help="steps between samples")
    parser.add_argument("--repeat-steps", type=int, default=None, help="steps of the repeated and resumed runs")
    parser.add_argument("--small", action="store_true", help="a 2-layer model of width 32 (the CI version)")
    parser.add_argument("--root", default=None, help="run folder (default: a new temporary one)")
    args = parser.parse_args()
    repeat = args.steps if args.repeat_steps is None else args.repeat_steps
    warmup_steps = CONFIG.optimizer.warmup_steps  # before its end the LR does not depend on --steps
    if not warmup_steps < repeat <= args.steps:
        parser.error(
            f"--repeat-steps={repeat}: expected more than the LR warmup ({warmup_steps} steps, where a wrong "
            f"schedule would go unseen) and at most --steps={args.steps}"
        )
    if args.small:
        CONFIG.model = OmegaConf.merge(CONFIG.model, SMALL)
    noise.quiet_known_noise()
    torch.set_num_threads(1)
    root = Path(args.root or os.environ.get("SOAK_ROOT") or tempfile.mkdtemp(prefix="soak-"))
    os.environ["SOAK_ROOT"] = str(root)  # the ranks Lightning launches use the same folder
    probe = Probe(args.every)
    monitors = [MemoryMonitor(log_every_n_steps=10), ThroughputMonitor(log_every_n_steps=10), CommunicationMonitor()]
    logger = WandbLogger(project="fsdp-soak", save_dir=str(root), offline=True)
    first = fit(args.steps, args.steps, root / "first", [probe, *monitors], logger, hash_at=repeat)
    again = fit(args.steps, repeat, root / "again", [])
    half = repeat // 2
    checkpoint = ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=half, save_last=True)
    fit(args.steps, half, root / "half", [checkpoint])
    resumed = fit(args.steps, repeat, root / "half", [ModelCheckpoint(dirpath=root / "ckpt")], resume="last")
    rank = int(os.environ.get("LOCAL_RANK", 0))
    (root / f"samples_rank{rank}.json").write_text(json.dumps(probe.samples))
    if rank != 0:
        return
    warmup = max(args.every, min(args.steps // 2, 200))  # the allocator settles within ~100 steps
    keys = ("rss_mib", "threads", "fds", "flight_ring", "ledger_units", "memory_timeline", "monitor_entries")
    report = {
        "steps": args.steps,
        "repeat_steps": repeat,
        "warmup": warmup,
        "growth": {key: growth(probe.samples, key, warmup) for key in keys},
        "samples": probe.samples,
        "hash_first": first.digest,
        "hash_again": again.digest,
        "hash_resumed": resumed.digest,
    }
    print("SOAK " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
