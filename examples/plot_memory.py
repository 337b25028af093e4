"""Plot per-rank memory over one training step, from the engine's own accounting.

    python examples/plot_memory.py --out memory_step.png
    python examples/plot_memory.py --world 3 --d-model 256 --n-layers 6 --sharding SHARD_GRAD_OP

Each rank trains the GPT model with the engine (no Lightning) for one warm-up step, then records
one step: the sharded state at rest (parameters, gradients, optimizer state) and every gather and
free of a unit's full parameters. The PNG shows, per rank, at-rest bytes plus gathered bytes over
the step, with the units named where they are gathered.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from gpt import GPT, Block, GPTConfig

from fsdp_strategy.engine import get_scheduler, shard_model

MIB = 2**20


def _rank(rank: int, world: int, args: argparse.Namespace, rendezvous: str, queue: mp.Queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    torch.manual_seed(0)
    config = GPTConfig(256, args.d_model, args.n_layers, args.n_heads, args.seq_len)
    model = shard_model(GPT(config), sharding_strategy=args.sharding, auto_wrap_policy={Block})
    scheduler = get_scheduler(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 256, (2, args.batch, config.seq_len + 1))
    for step in range(2):
        if step == 1:
            scheduler.memory.record()
        logits = model(tokens[step, :, :-1])
        F.cross_entropy(logits.flatten(0, 1), tokens[step, :, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    events = scheduler.memory.stop()
    at_rest = scheduler.sharded_bytes()
    at_rest["optimizer"] = sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values())
    queue.put((rank, {"events": [tuple(e) for e in events], "at_rest": at_rest}))
    dist.destroy_process_group()


def record(args: argparse.Namespace) -> dict[int, dict]:
    """Run the ranks and collect each one's timeline and at-rest bytes."""
    context = mp.get_context("fork")
    queue = context.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        rendezvous = os.path.join(tmp, "rendezvous")
        ranks = [
            context.Process(target=_rank, args=(r, args.world, args, rendezvous, queue)) for r in range(args.world)
        ]
        for process in ranks:
            process.start()
        results = dict(queue.get(timeout=600) for _ in ranks)
        for process in ranks:
            process.join()
    return results


def plot(results: dict[int, dict], out: Path, title: str) -> None:
    """Write the PNG: one line per rank, at rest + gathered bytes over the step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(10, 5))
    end = max((e[0] for r in results.values() for e in r["events"]), default=0.0) * 1000
    at_rest = results[0]["at_rest"]
    bottom = 0.0
    for name, color in (("params", "#c6dbef"), ("grads", "#9ecae1"), ("optimizer", "#6baed6")):
        top = bottom + at_rest[name] / MIB
        axis.fill_between([0, end], bottom, top, color=color, label=f"sharded {name} at rest (rank 0)")
        bottom = top
    highest = bottom
    for rank, result in sorted(results.items()):
        rest = sum(result["at_rest"].values()) / MIB
        times = [0.0] + [e[0] * 1000 for e in result["events"]]
        values = [rest] + [rest + e[3] / MIB for e in result["events"]]
        axis.step(times, values, where="post", label=f"rank {rank}: at rest + gathered full parameters")
        highest = max(highest, *values)
        if rank == 0:
            for seconds, unit, event, now in result["events"]:
                if event == "gather":
                    axis.annotate(
                        unit,
                        (seconds * 1000, rest + now / MIB),
                        textcoords="offset points",
                        xytext=(0, 3),
                        fontsize=7,
                        rotation=70,
                    )
    axis.set_ylim(0, highest * 1.25)  # room above the peak for the unit labels
    axis.set_xlabel("time in the step (ms)")
    axis.set_ylabel("MiB per rank")
    axis.set_title(title, pad=12)
    axis.legend(loc="lower right", fontsize=8)
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("memory_step.png"))
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--sharding", default="FULL_SHARD")
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--n-layers", type=int, default=6)
    parser.add_argument("--n-heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args()
    results = record(args)
    title = f"{args.sharding}, {args.world} ranks, GPT d_model={args.d_model} x {args.n_layers} layers"
    plot(results, args.out, title)
    peak = max(max((e[3] for e in r["events"]), default=0) for r in results.values()) / MIB
    rest = sum(results[0]["at_rest"].values()) / MIB
    print(f"wrote {args.out}: at rest {rest:.1f} MiB per rank, gathered peak {peak:.1f} MiB")


if __name__ == "__main__":
    main()
