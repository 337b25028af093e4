"""``fsdp-plan``: will it fit? The per-rank memory of a training step, planned on this CPU.

    fsdp-plan llama-7b --world-size 64 --precision bf16-mixed --batch 1 --seq-len 4096
    fsdp-plan llama-70b --world-size 512 --precision bf16-mixed --activation-checkpointing
    fsdp-plan llama-7b --world-size 8 --precision bf16-mixed --budget 70GiB
    fsdp-plan mypackage.models:build --input 8x1024:long --world-size 16 --wrap mypackage.models.Block
    fsdp-plan llama3-70b --world-size 256 --tensor-parallel-size 8 --precision bf16-mixed --activation-checkpointing

A preset (``llama-7b``, ``llama-13b``, ``llama3-8b``, ``llama-70b``, ``gpt2``, ``gpt2-xl``: Hugging Face shapes
built from a config on the meta device, trained on their own language-model loss) or
``module:function`` returning an ``nn.Module`` (or a LightningModule). Presets are units per
decoder layer unless ``--wrap`` says otherwise. ``--tensor-parallel-size`` plans a 2-D run: the
Llama presets with torchtitan's plan (``preset_plans.py``), other models with ``--parallelize
module:function`` (``(module, device_mesh) -> module``) or a LightningModule's ``configure_model``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
from typing import Any

import torch

PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-7b": ("llama", {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                           "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000}),
    "llama-13b": ("llama", {"hidden_size": 5120, "intermediate_size": 13824, "num_hidden_layers": 40,
                            "num_attention_heads": 40, "num_key_value_heads": 40, "vocab_size": 32000}),
    "llama3-8b": ("llama", {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                            "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256}),
    "llama-70b": ("llama", {"hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                            "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 32000}),
    "llama3-70b": ("llama", {"hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                             "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256}),
    "gpt2": ("gpt2", {"n_embd": 768, "n_layer": 12, "n_head": 12}),
    "gpt2-xl": ("gpt2", {"n_embd": 1600, "n_layer": 48, "n_head": 25}),
}  # fmt: skip


class UsageError(ValueError):
    """A command-line mistake: printed as one ``fsdp-plan:`` line, exit status 2."""


DTYPES = {"long": torch.long, "int": torch.int, "float": torch.float, "bf16": torch.bfloat16, "half": torch.half}


def preset(name: str, seq_len: int, batch: int) -> tuple[torch.nn.Module, Any, set]:
    """A preset's model (meta device), its batch (meta tokens; labels are the tokens) and block class."""
    try:
        import transformers
    except ImportError:
        raise SystemExit(
            f"fsdp-plan: the preset {name!r} builds a Hugging Face model: pip install '.[plan]' in the checkout "
            "(or pip install transformers)"
        ) from None
    family, sizes = PRESETS[name]
    if family == "llama":
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        config = transformers.LlamaConfig(**sizes, max_position_embeddings=max(seq_len, 2048))
        build, block = transformers.LlamaForCausalLM, LlamaDecoderLayer
    else:
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        config = transformers.GPT2Config(**sizes, n_positions=max(seq_len, 1024))
        build, block = transformers.GPT2LMHeadModel, GPT2Block
    with torch.device("meta"):
        model = build(config)
        tokens = torch.zeros(batch, seq_len, dtype=torch.long)
    return model, {"input_ids": tokens, "labels": tokens}, {block}


def factory(path: str) -> Callable[[], torch.nn.Module]:
    """``"package.module:function"`` -> the function."""
    module_name, _, function = path.partition(":")
    if not module_name or not function:
        raise UsageError(f"model {path!r} is neither a preset ({', '.join(PRESETS)}) nor module:function")
    try:
        return getattr(importlib.import_module(module_name), function)
    except (ImportError, AttributeError) as error:
        raise UsageError(f"cannot import {path!r}: {error}") from None


def parse_input(text: str) -> torch.Tensor:
    """``8x1024:long`` -> a meta tensor of that shape and dtype (default float)."""
    shape, _, dtype = text.partition(":")
    try:
        sizes = [int(size) for size in shape.lower().split("x")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise UsageError(f"--input {text!r}: give a shape of positive sizes like 8x1024 or 8x1024:long")
    if dtype and dtype not in DTYPES:
        raise UsageError(f"--input {text!r}: dtype {dtype!r}; accepted: {', '.join(DTYPES)}")
    return torch.empty(sizes, dtype=DTYPES[dtype or "float"], device="meta")


def main(argv: list[str] | None = None) -> int:
    """Parse the command line, plan, print; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="fsdp-plan", description=__doc__.replace("``", ""), formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("model", help=f"a preset ({', '.join(PRESETS)}) or module:function returning the model")
    parser.add_argument("--world-size", type=int, required=True, help="ranks (all nodes together)")
    parser.add_argument("--num-nodes", type=int, default=1, help="nodes (HYBRID_SHARD shards within one)")
    parser.add_argument("--precision", default="32-true", help='"32-true", "bf16-mixed", "bf16-true", ...')
    parser.add_argument("--optimizer", default="adamw", help="adamw, adam or sgd")
    parser.add_argument("--sharding-strategy", default="FULL_SHARD")
    parser.add_argument("--wrap", nargs="+", help="dotted paths of the module classes that become units")
    parser.add_argument(
        "--activation-checkpointing", nargs="*", help="dotted class paths to recompute (none given: the units)"
    )
    parser.add_argument("--cpu-offload", action="store_true")
    parser.add_argument("--tensor-parallel-size", type=int, help="a 2-D run: ranks each layer is split over")
    parser.add_argument("--data-parallel-size", type=int, help="a 2-D run: default world size / tensor-parallel size")
    parser.add_argument("--parallelize", help="a 2-D run's plan: module:function taking (module, device_mesh)")
    parser.add_argument(
        "--no-sequence-parallel", action="store_true", help="Llama presets, 2-D: whole activations between split layers"
    )
    parser.add_argument("--budget", help="bytes per rank (e.g. 70GiB): choose the fastest settings that fit")
    parser.add_argument(
        "--reserve",
        help="bytes of the budget left for the CUDA context, NCCL and fragmentation (default: 2GiB + 5%% of it)",
    )
    parser.add_argument("--input", action="append", help="module:function models: an input shape, 8x1024:long")
    parser.add_argument("--batch", type=int, default=1, help="presets: sequences per rank")
    parser.add_argument("--seq-len", type=int, default=2048, help="presets: tokens per sequence")
    args = parser.parse_args(argv)
    from fsdp_strategy.plan import plan

    try:
        model, batch, kwargs = _what_to_plan(args)
        result = plan(
            model, batch, world_size=args.world_size, num_nodes=args.num_nodes, precision=args.precision,
            optimizer=args.optimizer, **kwargs,
        )  # fmt: skip
    except (ValueError, TypeError, RuntimeError) as error:
        print(f"fsdp-plan: {error}", file=sys.stderr)
        return 2
    print(result)
    return 0


def _what_to_plan(args: argparse.Namespace) -> tuple[torch.nn.Module, Any, dict[str, Any]]:
    """The model, its batch and the strategy arguments the command line asks for."""
    for name in ("batch", "seq_len"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')}={getattr(args, name)} must be at least 1")
    if args.model in PRESETS:
        model, batch, blocks = preset(args.model, args.seq_len, args.batch)
    else:
        model = factory(args.model)()
        if not isinstance(model, torch.nn.Module):
            raise UsageError(f"{args.model} returned {type(model).__name__}, not an nn.Module")
        batch, blocks = tuple(parse_input(text) for text in args.input or []), set()
    wrap = set(args.wrap) if args.wrap else blocks or None
    if args.reserve is not None and args.budget is None:
        raise UsageError("--reserve is the part of --budget left unplanned: give --budget too")
    if args.budget is not None:
        return model, batch, {"auto_wrap_policy": "auto", "memory_budget": args.budget, "memory_reserve": args.reserve}
    kwargs: dict[str, Any] = {"sharding_strategy": args.sharding_strategy, "cpu_offload": args.cpu_offload}
    kwargs.update(_two_d(args))
    kwargs["auto_wrap_policy"] = wrap
    if args.activation_checkpointing is not None:
        if not (args.activation_checkpointing or wrap):
            raise UsageError(
                "--activation-checkpointing needs class paths here (or --wrap, whose classes it then takes)"
            )
        kwargs["activation_checkpointing_policy"] = set(args.activation_checkpointing) or wrap
    return model, batch, kwargs


def _two_d(args: argparse.Namespace) -> dict[str, Any]:
    """The strategy arguments of a 2-D plan the command line asks for (none for a 1-D one)."""
    if args.tensor_parallel_size is None:
        if args.data_parallel_size is not None or args.parallelize is not None or args.no_sequence_parallel:
            raise UsageError(
                "--data-parallel-size, --parallelize and --no-sequence-parallel plan a 2-D run: give "
                "--tensor-parallel-size"
            )
        return {}
    kwargs: dict[str, Any] = {"tensor_parallel_size": args.tensor_parallel_size}
    if args.data_parallel_size is not None:
        kwargs["data_parallel_size"] = args.data_parallel_size
    if args.parallelize is not None:
        kwargs["parallelize_fn"] = factory(args.parallelize)
    elif args.model in PRESETS and PRESETS[args.model][0] == "llama":
        from functools import partial

        from fsdp_strategy.plan.preset_plans import llama_tensor_parallel

        kwargs["parallelize_fn"] = partial(llama_tensor_parallel, sequence_parallel=not args.no_sequence_parallel)
    elif args.model in PRESETS:
        raise UsageError(
            f"--tensor-parallel-size: the preset {args.model!r} has no built-in tensor-parallel plan (the Llama "
            "presets have); give --parallelize module:function"
        )
    return kwargs


if __name__ == "__main__":
    sys.exit(main())
