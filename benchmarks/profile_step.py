"""Where a training step's time goes, per rank, for our engine, DDP and FSDP2 (engine level).

    python benchmarks/profile_step.py                              # main config, 2 ranks, gloo, CPU
    python benchmarks/profile_step.py --modes custom fsdp2 --vocab 1024 --d-model 128 --n-layers 2 \\
        --n-heads 4 --seq-len 64 --steps 20

Runs the same loop as ``compare.py`` and records the timed steps with ``torch.profiler`` (CPU
activity, every op recorded: the step is a few percent slower than unprofiled). Per mode, it
prints rank 0's milliseconds per step in:

- the engine's hooks, all in (``fsdp_custom::pre_forward`` ... or FSDP2's ``FSDP::...``);
- inside them: the waits on collectives (the host blocked: communication not hidden), the
  copies into and out of collective buffers, and the rest (Python bookkeeping, hooks' calls);
- the optimizer step; and everything else (forward and backward compute, autograd, the loss).

The engine's ranges are listed in ``fsdp_strategy/engine/trace.py``. DDP has no such ranges:
its reducer runs in C++ inside autograd, so its row shows only the optimizer and the rest.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.nn.functional as F
from compare import add_config_args, build
from gpt import GPTConfig
from spawn import spawn_ranks

from fsdp_strategy.engine import get_scheduler

MODES = ["ddp", "fsdp2", "custom", "custom_grad_op"]
HOOKS = {
    "custom": ["pre_forward", "post_forward", "pre_backward", "post_backward", "end_of_backward"],
    "fsdp2": ["root_pre_forward", "pre_forward", "post_forward", "pre_backward", "post_backward"]
    + ["root_post_backward_callback"],
}
WAITS = {"custom": ["wait_all_gather", "wait_reduce_scatter", "wait_all_reduce"], "fsdp2": ["post_backward_rs_wait"]}
COPIES = {
    "custom": ["gather_copy_in", "gather_copy_out", "reduce_copy_in", "reduce_apply"],
    "fsdp2": ["all_gather_copy_in", "all_gather_copy_out", "post_backward_reduce_copy_in", "post_backward_accumulate"],
}
PREFIXES = {"custom": "fsdp_custom::", "fsdp2": "FSDP::"}


def _per_step_ms(profile: torch.profiler.profile, steps: int) -> dict[str, float]:
    """Inclusive CPU milliseconds per step of every range, the module's name stripped (``FSDP::x (blocks.0)``)."""
    totals: dict[str, float] = defaultdict(float)
    for event in profile.key_averages():
        totals[event.key.split(" (")[0]] += event.cpu_time_total / 1e3 / steps
    return totals


def _rank(rank: int, world: int, mode: str, args: argparse.Namespace, rendezvous: str, queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    config = GPTConfig(args.vocab, args.d_model, args.n_layers, args.n_heads, args.seq_len, tie_embeddings=False)
    model, _ = build(mode, config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.randint(0, args.vocab, (args.warmup + args.steps, args.batch, args.seq_len + 1))

    def step(batch: torch.Tensor) -> None:
        logits = model(batch[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)

    for batch in data[: args.warmup]:
        step(batch)
    dist.barrier()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        start = time.perf_counter()
        for batch in data[args.warmup :]:
            step(batch)
        elapsed = (time.perf_counter() - start) / args.steps
    units = len(get_scheduler(model).units) if mode.startswith("custom") else None
    queue.put((rank, {"step_ms": elapsed * 1e3, "ranges": dict(_per_step_ms(profile, args.steps)), "units": units}))
    dist.destroy_process_group()


def _profile(mode: str, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        return spawn_ranks(_rank, args.world, args.world, mode, args, os.path.join(tmp, "rendezvous"))[0]


def breakdown(mode: str, result: dict) -> dict[str, float]:
    """Rank 0's milliseconds per step by category (see the module docstring)."""
    family = "custom" if mode.startswith("custom") else mode
    ranges, step = result["ranges"], result["step_ms"]
    optimizer = sum(ms for name, ms in ranges.items() if name.startswith("Optimizer.step#"))
    row = {"step": step, "optimizer": optimizer}
    if family in PREFIXES:
        prefix = PREFIXES[family]
        hooks = sum(ranges.get(prefix + name, 0.0) for name in HOOKS[family])
        waits = sum(ranges.get(prefix + name, 0.0) for name in WAITS[family])
        copies = {name: ranges.get(prefix + name, 0.0) for name in COPIES[family]}
        row.update(hooks=hooks, waits=waits, **{f"copy: {k}": v for k, v in copies.items()})
        row["hooks' own work"] = hooks - waits - sum(copies.values())
        if result["units"]:
            row["hooks' own work per unit"] = row["hooks' own work"] / result["units"]
    row["compute and the rest"] = step - optimizer - row.get("hooks", 0.0)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(parser)
    parser.add_argument("--modes", nargs="+", default=MODES, choices=MODES)
    args = parser.parse_args()
    rows = {}
    for mode in args.modes:
        rows[mode] = breakdown(mode, _profile(mode, args))
        print(f"{mode}: {rows[mode]['step']:.1f} ms/step profiled", file=sys.stderr, flush=True)
    keys = list(dict.fromkeys(key for row in rows.values() for key in row))
    print("| ms per step (rank 0, profiled) | " + " | ".join(rows) + " |")
    print("|---|" + "---|" * len(rows))
    for key in keys:
        print(f"| {key} | " + " | ".join(f"{row[key]:.2f}" if key in row else "-" for row in rows.values()) + " |")


if __name__ == "__main__":
    main()
