"""Side-by-side step time, per-rank memory and bytes communicated: our engine vs torch's FSDP1,
FSDP2 (``fully_shard``) and DDP, on a GPT-like model (untied head, AdamW). Engine-level modes run a
plain training loop; ``L_*`` modes run ``Trainer.fit`` with Lightning's strategies
(``lightning_modes.py``): what a user compares.

    python benchmarks/compare.py --modes L_ddp L_fsdp2 L_custom L_custom_grad_op --rounds 3

    python benchmarks/compare.py                                  # main config, 2 ranks, gloo, CPU
    python benchmarks/compare.py --d-model 768 --n-layers 8 --n-heads 12 --seq-len 64 --batch 1
    python benchmarks/compare.py --vocab 1024 --d-model 128 --n-layers 2 --n-heads 4 --seq-len 64 --steps 20

Each mode runs in freshly spawned ranks (one thread each, gloo, a file:// rendezvous); the step
time is the slowest rank's, the median over timed steps; "single" is one process on the global
batch and is the reference for the losses. For our engine's modes it also prints the bytes the engine copied
outside collectives per gathered byte (its ledger's ``copied`` counts). Results go to stdout (a Markdown table) and to
``benchmarks/results/<config>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from gpt import GPT, Block, GPTConfig  # noqa: E402
from lightning_modes import LIGHTNING_MODES, run_lightning_mode  # noqa: E402
from spawn import spawn_ranks  # noqa: E402

# imported in every mode (it pulls in Lightning), so the peak RSS of all modes has the same baseline
from fsdp_strategy.engine import get_scheduler, shard_model  # noqa: E402

MODES = [
    "single",
    "ddp",
    "fsdp1",
    "fsdp1_grad_op",
    "fsdp2",
    "custom",
    "custom_grad_op",
    "custom_unstamped",  # custom without order stamps, to measure their cost
    *LIGHTNING_MODES,
]
MIB = 2**20


def build(mode: str, config: GPTConfig):
    """The GPT model of ``config`` wrapped for ``mode``, and our engine's ledger (None for others)."""
    torch.manual_seed(0)
    model = GPT(config)
    ledger = None
    if mode == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    elif mode.startswith("fsdp1"):
        from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        strategy = ShardingStrategy.SHARD_GRAD_OP if mode.endswith("grad_op") else ShardingStrategy.FULL_SHARD
        model = FullyShardedDataParallel(
            model, auto_wrap_policy=ModuleWrapPolicy({Block}), sharding_strategy=strategy, device_id=torch.device("cpu")
        )
    elif mode == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    elif mode.startswith("custom"):
        strategy = "SHARD_GRAD_OP" if mode.endswith("grad_op") else "FULL_SHARD"
        stamped = mode != "custom_unstamped"
        shard_model(model, sharding_strategy=strategy, auto_wrap_policy={Block}, check_collective_order=stamped)
        ledger = get_scheduler(model).ledger
    return model, ledger


def _local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def _state_bytes(optimizer: torch.optim.Optimizer) -> tuple[int, int, int]:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    p_bytes = sum(_local_bytes(p) for p in params)
    g_bytes = sum(_local_bytes(p.grad) for p in params if p.grad is not None)
    o_bytes = sum(_local_bytes(v) for s in optimizer.state.values() for k, v in s.items() if k != "step")
    return p_bytes, g_bytes, o_bytes


def _rank(rank: int, world: int, mode: str, args: argparse.Namespace, rendezvous: str, queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    config = GPTConfig(args.vocab, args.d_model, args.n_layers, args.n_heads, args.seq_len, tie_embeddings=False)
    model, ledger = build(mode, config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(1)
    total = args.warmup + args.steps
    global_batch = args.batch * (2 if mode == "single" else 1) * (1 if mode == "single" else world)
    data = torch.randint(0, args.vocab, (total, args.batch * 2, args.seq_len + 1), generator=generator)
    times, losses, comm, copies = [], [], [], []  # copies: bytes copied per gathered byte, per step
    for step in range(total):
        batch = data[step] if mode == "single" else data[step][rank * args.batch : (rank + 1) * args.batch]
        assert batch.shape[0] == global_batch // (1 if mode == "single" else world)
        if ledger is not None:
            ledger.start_step()
        dist.barrier()
        start = time.perf_counter()
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        elapsed = torch.tensor(time.perf_counter() - start)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        losses.append(mean_loss.item() / world)
        if step >= args.warmup:
            times.append(elapsed.item())
        if ledger is not None:
            totals = ledger.snapshot().values()
            comm.append((sum(t["payload_bytes"] for t in totals), sum(t["wire_bytes"] for t in totals)))
            gathers = ledger.current.get("all_gather")
            if gathers is not None and gathers.payload_bytes:
                copied = ledger.copied["gather_copy_in"] + ledger.copied["gather_copy_out"]
                copies.append(copied / gathers.payload_bytes)
    p_bytes, g_bytes, o_bytes = _state_bytes(optimizer)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    result = {"times": times, "losses": losses[:5], "pgo": (p_bytes, g_bytes, o_bytes), "rss": rss, "comm": comm}
    result["gather_copies"] = copies[-1] if copies else None
    queue.put((rank, result))
    dist.destroy_process_group()


def run_mode(mode: str, args: argparse.Namespace) -> dict:
    world = 1 if mode == "single" else args.world
    with tempfile.TemporaryDirectory() as tmp:
        results = spawn_ranks(_rank, world, world, mode, args, os.path.join(tmp, "rendezvous"))
    first = results[0]
    comm = first["comm"][-1] if first["comm"] else None
    return {
        "mode": mode,
        "world": world,
        "step_s": statistics.median(first["times"]),
        "step_min": min(first["times"]),
        "step_max": max(first["times"]),
        "pgo_mib": [b / MIB for b in first["pgo"]],
        "rss_mib": max(r["rss"] for r in results.values()) / MIB,
        "comm_mib": None if comm is None else (comm[0] / MIB, comm[1] / MIB),
        "losses": first["losses"],
        "gather_copies": first["gather_copies"],
    }


def _table(rows: list[dict]) -> str:
    ddps = {r["mode"]: r for r in rows if r["mode"] in ("ddp", "L_ddp")}
    references = {r["mode"]: r for r in rows if r["mode"] in ("single", "L_ddp")}
    lines = [
        "| mode | ranks | step s median [min-max] | x ddp | P+G+O MiB/rank (P/G/O) | peak RSS MiB/rank | "
        "comm MiB/step/rank payload (wire) | max abs dloss vs single / L_ddp (first 5) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lightning = r["mode"].startswith("L_")
        ddp = ddps.get("L_ddp" if lightning else "ddp", rows[0])
        reference = references.get("L_ddp" if lightning else "single")
        pgo = r["pgo_mib"]
        memory = "-" if pgo is None else f"{sum(pgo):.1f} ({pgo[0]:.1f}/{pgo[1]:.1f}/{pgo[2]:.1f})"
        comm = "-" if r["comm_mib"] is None else f"{r['comm_mib'][0]:.1f} ({r['comm_mib'][1]:.1f})"
        dloss = "-"
        if reference is not None and r is not reference:
            dloss = f"{max(abs(a - b) for a, b in zip(r['losses'], reference['losses'])):.2e}"
        lines.append(
            f"| {r['mode']} | {r['world']} | {r['step_s']:.3f} [{r['step_min']:.3f}-{r['step_max']:.3f}] | "
            f"{r['step_s'] / ddp['step_s']:.2f} | {memory} | {r['rss_mib']:.0f} | {comm} | {dloss} |"
        )
    for r in rows:
        if r.get("gather_copies") is not None:
            lines.append(
                f"\n{r['mode']}: bytes copied outside collectives per gather (copy-in + copy-out) = "
                f"{r['gather_copies']:.2f} x the unit's gathered size"
            )
    return "\n".join(lines)


def _over_rounds(repeats: list[dict]) -> dict:
    """One row from interleaved repeats of a mode: the median of their medians, their min-max."""
    if len(repeats) == 1:
        return repeats[0]
    medians = [r["step_s"] for r in repeats]
    row = dict(repeats[0])
    row.update(
        step_s=statistics.median(medians),
        step_min=min(medians),
        step_max=max(medians),
        rss_mib=max(r["rss_mib"] for r in repeats),
        rounds=medians,
    )
    return row


def add_config_args(parser: argparse.ArgumentParser) -> None:
    """The model, batch and run length options every benchmark script shares."""
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--d-model", type=int, default=384)
    parser.add_argument("--n-layers", type=int, default=6)
    parser.add_argument("--n-heads", type=int, default=6)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(parser)
    parser.add_argument("--modes", nargs="+", default=MODES[:7], choices=MODES)
    parser.add_argument("--rounds", type=int, default=1, help="interleaved repeats of all modes; median of them")
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {mode: [] for mode in args.modes}
    for _ in range(args.rounds):
        for mode in args.modes:
            row = run_lightning_mode(mode, args) if mode.startswith("L_") else run_mode(mode, args)
            runs[mode].append(row)
            print(f"{mode}: {row['step_s']:.3f} s/step", file=sys.stderr, flush=True)
    rows = [_over_rounds(repeats) for repeats in runs.values()]
    table = _table(rows)
    print(table)
    name = f"v{args.vocab}_d{args.d_model}_l{args.n_layers}_s{args.seq_len}_b{args.batch}_w{args.world}"
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    (out / f"{name}.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
