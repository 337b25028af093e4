"""The engine's own host cost: per unit per step, per phase, and the fixed cost per step.

    python benchmarks/unit_cost.py                   # 3 interleaved rounds, about 12 minutes here
    python benchmarks/unit_cost.py --rounds 1 --steps 10

``Trainer.fit`` with Lightning's DDP, FSDP2 (``ModelParallelStrategy``, each block a unit) and
``fsdp_custom`` (``auto_wrap_policy={Block}``), 2 ranks, gloo, one thread each
(``lightning_modes.py``), on:

- a GPT of tiny blocks (vocab 1024, d_model 64, 4 heads, seq 32, 2 sequences per rank) with 4 and
  with 32 blocks: the step-time slope per block, minus DDP's, is the cost each unit adds per step
  (the blocks' compute is in DDP's slope; DDP's communication is one bucketed all-reduce);
- the tiny model of ``docs/benchmarks.md`` (0.67M: vocab 1024, d_model 128, 2 layers, seq 64, 4
  sequences per rank): its step time minus DDP's is the fixed cost per step.

Every mode and size runs in each round, interleaved (the machine's speed drifts); figures are the
median over rounds of each run's median step. For ``fsdp_custom`` it also records the engine's host
time per range (``fsdp_strategy.engine.trace.host_times``: wall time inside each hook, no profiler)
and prints it per step at 4 and 32 units and per unit (the slope). Losses of the first 5 steps are
compared with DDP's (they must be equal).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from types import SimpleNamespace

from lightning_modes import THREAD_KINDS, run_lightning_mode

MODES = ["L_ddp", "L_fsdp2", "L_custom"]
BLOCKS = (4, 32)
PHASES = [
    "pre_forward",
    "post_forward",
    "pre_backward",
    "post_backward",
    "reduce",
    "end_of_backward",
    "before_optimizer_step",
    "after_optimizer_step",
]
TOP_LEVEL = [phase for phase in PHASES if phase != "reduce"]  # reduce runs inside post_backward / end_of_backward
INSIDE = ["wait_all_gather", "wait_reduce_scatter", "gather_copy_in", "gather_copy_out", "reduce_copy_in"]
INSIDE += ["reduce_apply"]


def _config(args: argparse.Namespace, **model) -> SimpleNamespace:
    shared = {"world": 2, "warmup": args.warmup, "steps": args.steps}
    return SimpleNamespace(**shared, **model)


def tiny_blocks(args: argparse.Namespace, blocks: int) -> SimpleNamespace:
    """The GPT of tiny blocks with ``blocks`` blocks (each one unit)."""
    return _config(args, vocab=1024, d_model=64, n_layers=blocks, n_heads=4, seq_len=32, batch=2)


def tiny_model(args: argparse.Namespace) -> SimpleNamespace:
    """The latency-bound 0.67M model of docs/benchmarks.md."""
    return _config(args, vocab=1024, d_model=128, n_layers=2, n_heads=4, seq_len=64, batch=4)


def _median_row(rows: list[dict]) -> dict:
    row = dict(rows[0])
    row["step_s"] = statistics.median(r["step_s"] for r in rows)
    row["rounds"] = [r["step_s"] for r in rows]
    row["host_s"] = {name: statistics.median(r["host_s"].get(name, 0.0) for r in rows) for name in rows[0]["host_s"]}
    row["cpu_s"] = {kind: statistics.median(r["cpu_s"].get(kind, 0.0) for r in rows) for kind in rows[0]["cpu_s"]}
    return row


def measure(args: argparse.Namespace) -> dict[tuple[str, str], dict]:
    """Every (mode, size) row, ``size`` one of ``"4"``, ``"32"``, ``"tiny"``; interleaved rounds."""
    runs: dict[tuple[str, str], list[dict]] = {}
    configs = {str(blocks): tiny_blocks(args, blocks) for blocks in BLOCKS}
    configs["tiny"] = tiny_model(args)
    for round_index in range(args.rounds):
        for size, config in configs.items():
            for mode in MODES:
                row = run_lightning_mode(mode, config)
                runs.setdefault((mode, size), []).append(row)
                print(f"round {round_index}: {mode} {size}: {row['step_s'] * 1e3:.1f} ms", file=sys.stderr, flush=True)
    return {key: _median_row(rows) for key, rows in runs.items()}


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def report(rows: dict[tuple[str, str], dict]) -> str:
    """The Markdown tables: step times and costs over DDP, then ours per phase."""
    span = BLOCKS[1] - BLOCKS[0]
    ddp_slope = (rows["L_ddp", "32"]["step_s"] - rows["L_ddp", "4"]["step_s"]) / span
    lines = [
        "| mode | step, 4 / 32 units, ms | added cost per unit over DDP, ms | tiny model step, ms "
        "| fixed cost per step over DDP, ms | max abs dloss vs DDP |",
        "|---|---|---|---|---|---|",
    ]
    for mode in MODES:
        four, many, tiny = rows[mode, "4"], rows[mode, "32"], rows[mode, "tiny"]
        slope = (many["step_s"] - four["step_s"]) / span
        added = "-" if mode == "L_ddp" else _ms(slope - ddp_slope)
        fixed = "-" if mode == "L_ddp" else _ms(tiny["step_s"] - rows["L_ddp", "tiny"]["step_s"])
        dloss = max(
            abs(a - b)
            for size in ("4", "32", "tiny")
            for a, b in zip(rows[mode, size]["losses"], rows["L_ddp", size]["losses"])
        )
        lines.append(
            f"| {mode} | {_ms(four['step_s'])} / {_ms(many['step_s'])} | {added} | {_ms(tiny['step_s'])} "
            f"| {fixed} | {dloss:.1e} |"
        )
    lines += ["", *_cpu_table(rows)]
    four, many = rows["L_custom", "4"]["host_s"], rows["L_custom", "32"]["host_s"]
    lines += ["", "| fsdp_custom host time, ms per step | 4 units | 32 units | per unit |", "|---|---|---|---|"]
    for phase in [*PHASES, *INSIDE]:
        a, b = four.get(phase, 0.0), many.get(phase, 0.0)
        name = phase if phase in TOP_LEVEL else f"(inside) {phase}"
        lines.append(f"| {name} | {_ms(a)} | {_ms(b)} | {_ms((b - a) / span)} |")
    total_a, total_b = (sum(host.get(p, 0.0) for p in TOP_LEVEL) for host in (four, many))
    lines.append(f"| all hooks | {_ms(total_a)} | {_ms(total_b)} | {_ms((total_b - total_a) / span)} |")
    return "\n".join(lines)


def _cpu_table(rows: dict[tuple[str, str], dict]) -> list[str]:
    """CPU time per unit per step over DDP's, by thread (rank 0's process): the slope from 4 to 32
    units of each kind's CPU per step, minus DDP's; beside it the wall time per unit over DDP. With
    both ranks on 2 cores the wall time follows the CPU time of all threads."""
    if not rows["L_ddp", "4"]["cpu_s"]:
        return ["(CPU by thread: needs Linux's /proc)"]
    span = BLOCKS[1] - BLOCKS[0]

    def slope(mode: str, kind: str | None) -> float:
        four, many = rows[mode, "4"], rows[mode, "32"]
        if kind is None:
            return (many["step_s"] - four["step_s"]) / span
        return (many["cpu_s"].get(kind, 0.0) - four["cpu_s"].get(kind, 0.0)) / span

    kinds = " | ".join(THREAD_KINDS)
    lines = [
        f"| mode | CPU per unit over DDP, ms: {kinds} | all threads | wall per unit over DDP, ms |",
        "|---|" + "---|" * (len(THREAD_KINDS) + 2),
    ]
    for mode in MODES[1:]:
        kinds = [slope(mode, kind) - slope("L_ddp", kind) for kind in THREAD_KINDS]
        wall = slope(mode, None) - slope("L_ddp", None)
        lines.append(f"| {mode} | " + " | ".join(map(_ms, kinds)) + f" | {_ms(sum(kinds))} | {_ms(wall)} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved repeats of every mode and size")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    print(report(measure(args)))


if __name__ == "__main__":
    main()
