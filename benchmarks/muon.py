"""Optimizers placed whole (Muon, LAMB, Adafactor) under ``fsdp_custom`` against the same optimizer
under Lightning's DDP, on the GPT example's model.

    python benchmarks/muon.py                 # 2 CPU ranks, gloo, the example's small config
    python benchmarks/muon.py --steps 30 --d-model 256 --n-layers 6
    python benchmarks/muon.py --optimizer lamb  # pytorch-optimizer's LAMB on every parameter (measured)

``--optimizer lamb`` / ``adafactor``: pytorch-optimizer's ``Lamb`` / ``AdaFactor`` on every parameter,
which the engine measures before the first step and places whole; the probe's time and the bytes
it allocated are printed first.

The GPT example's LightningModule with ``optimizer.name=muon`` (``MuonWithAdamW``: Muon for the
blocks' weight matrices, AdamW for the rest) trains ``--steps`` steps under each strategy on
forked ranks. Reported per rank: the median step time of the last half (the slowest rank's), the
bytes each collective kind carried per step (``fsdp_custom``: its communication ledger, where the
whole-matrix placement's all-to-alls show as ``all_to_all``; DDP: its gradient all-reduce, the
model's gradient bytes), the parameters, gradients and optimizer state held, and the peak resident
memory (VmHWM). The losses of the two runs are printed side by side.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "examples"), str(ROOT / "tests")]
from dist_utils import run_ranks  # noqa: E402

ENV = {"LOCAL_RANK": "{rank}", "NODE_RANK": "0"}


class Timed(L.Callback):
    """Step times (after a barrier), the ledger of the last step, the losses."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.ledgers: list[dict] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        dist.barrier()
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.times.append(time.perf_counter() - self.start)
        ledger = getattr(trainer.strategy, "comm_ledger", None)
        if ledger is not None:
            self.ledgers.append({kind: totals.payload_bytes for kind, totals in ledger.current.items()})


def _peak_rss() -> int:
    with open("/proc/self/status") as handle:
        return next(int(line.split()[1]) * 1024 for line in handle if line.startswith("VmHWM"))


def _body(rank: int, world: int, args: argparse.Namespace, strategy_name: str) -> dict:
    from gpt import Block, GPTConfig
    from lit_gpt import ByteDataModule, GPTModule, OptimizerSettings

    from fsdp_strategy import FSDPCustomStrategy

    torch.manual_seed(0)
    config = GPTConfig(d_model=args.d_model, n_layers=args.n_layers, n_heads=4, seq_len=args.seq_len)
    module = GPTModule(config, OptimizerSettings(name="muon"), args.steps, batch_size=8)
    if args.optimizer != "muon":
        module.configure_optimizers = lambda: _third_party(args.optimizer)(module.parameters())
    strategy = FSDPCustomStrategy(auto_wrap_policy={Block}) if strategy_name == "fsdp_custom" else "ddp"
    timed = Timed()
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, max_steps=args.steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[timed],
        limit_val_batches=0,
    )  # fmt: skip
    trainer.fit(module, datamodule=ByteDataModule(max_bytes=400_000, batch_size=8, seq_len=args.seq_len))
    optimizer = trainer.optimizers[0]
    held = [*module.parameters(), *(p.grad for p in module.parameters() if p.grad is not None)]
    held += [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    times = torch.tensor(timed.times[len(timed.times) // 2 :])
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    grads = sum(p.numel() * p.element_size() for p in module.parameters())
    return {
        "step_s": statistics.median(times.tolist()),
        "bytes": timed.ledgers[-1] if timed.ledgers else {"all_reduce (gradients)": grads},
        "held_mib": sum(t.numel() * t.element_size() for t in held) / 2**20,
        "peak_rss_mib": _peak_rss() / 2**20,
        "loss": float(trainer.callback_metrics.get("train_loss", float("nan"))),
    }


def _third_party(name: str):
    import pytorch_optimizer

    make = {"lamb": pytorch_optimizer.Lamb, "adafactor": pytorch_optimizer.AdaFactor}[name]
    return lambda params: make(params, lr=3e-3)


def _probe_cost(name: str) -> str:
    """The probe's time and the bytes it allocated at its peak, measuring ``name`` once."""
    from fsdp_strategy.engine.optimizer_probe import measure
    from fsdp_strategy.plan.tracker import LiveBytes

    optimizer = _third_party(name)([torch.nn.Parameter(torch.zeros(4, 4))])
    tracker = LiveBytes()
    start = time.perf_counter()
    with tracker:
        measured = measure(optimizer, optimizer.param_groups[0])
    seconds = time.perf_counter() - start
    peak = tracker.peak.bytes / 1024
    return f"probe: {measured.kind}, {seconds * 1000:.0f} ms, peak {peak:.1f} KiB ({measured.reason})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--n-layers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--optimizer", choices=["muon", "lamb", "adafactor"], default="muon")
    args = parser.parse_args()
    if args.optimizer != "muon":
        print(_probe_cost(args.optimizer))
    folder = Path(__file__).resolve().parent / "results"
    folder.mkdir(exist_ok=True)
    print(
        "| strategy | step s (median) | MiB per step and rank, by collective | P+G+O MiB/rank | peak RSS MiB | loss |"
    )
    print("|---|---|---|---|---|---|")
    for name in ("ddp", "fsdp_custom"):
        result = run_ranks(_body, args.world, folder, args, name, env=ENV, timeout=1800)[0]
        carried = ", ".join(f"{kind} {value / 2**20:.2f}" for kind, value in sorted(result["bytes"].items()))
        print(
            f"| {name} | {result['step_s']:.3f} | {carried} | {result['held_mib']:.2f} | "
            f"{result['peak_rss_mib']:.0f} | {result['loss']:.4f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
