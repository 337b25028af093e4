"""How long a memory plan takes: a Llama-3-70B-shaped model (80 decoder layers, hidden 8192, vocab
128256) at world size 1,024, bf16-mixed, AdamW, one unit and recomputation per decoder layer, one
sequence of 4,096 tokens per rank, on the meta device. Prints the planning time (imports apart),
the peak, and the same plan at a few layer counts to show the cost does not grow with the count.

    python benchmarks/plan_speed.py [--layers 80] [--world-size 1024] [--profile]

Needs ``transformers`` (in ``'.[dev]'``).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch


def llama(layers: int) -> tuple[torch.nn.Module, type]:
    import transformers
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    config = transformers.LlamaConfig(
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=layers,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=4096,
    )
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config), LlamaDecoderLayer


def plan_once(layers: int, world_size: int) -> tuple[float, object]:
    from fsdp_strategy.plan import plan

    model, block = llama(layers)
    tokens = torch.zeros(1, 4096, dtype=torch.long, device="meta")
    start = time.perf_counter()
    result = plan(
        model,
        {"input_ids": tokens, "labels": tokens},
        world_size=world_size,
        precision="bf16-mixed",
        auto_wrap_policy={block},
        activation_checkpointing_policy={block},
    )
    return time.perf_counter() - start, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=80)
    parser.add_argument("--world-size", type=int, default=1024)
    parser.add_argument("--profile", action="store_true", help="print the 25 most expensive functions")
    args = parser.parse_args()
    import fsdp_strategy.plan  # noqa: F401 - imports apart from the planning time

    if args.profile:
        profiler = cProfile.Profile()
        profiler.enable()
    seconds, result = plan_once(args.layers, args.world_size)
    if args.profile:
        profiler.disable()
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(25)
    print(result)
    print(f"planning: {seconds:.1f} s for {args.layers} layers at world size {args.world_size}")
    for layers in (24, 40):
        seconds, small = plan_once(layers, args.world_size)
        print(f"planning: {seconds:.1f} s for {layers} layers (peak {small.peak_bytes / 2**30:.2f} GiB)")


if __name__ == "__main__":
    main()
