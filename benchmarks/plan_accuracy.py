"""How close ``fsdp_strategy.plan`` comes to the peak of a real run: predicted vs measured per rank.

    python benchmarks/plan_accuracy.py                      # the full table (5 models x 3 strategies
                                                            # x 2 precisions x checkpointing on/off, world 2 and 3)
    python benchmarks/plan_accuracy.py --models gpt gpt2 --worlds 2

For each configuration the plan runs in this process (fake tensors, fake process group) and a
real ``Trainer.fit`` of two steps runs on forked CPU ranks over gloo, with gloo's own collectives
(``FSDP_CUSTOM_GLOO_P2P=0``: the calls NCCL gets, no receive buffers of the point-to-point
exchange, which a GPU run does not have). The measured peak is the
highest bytes of live tensor storage on rank 0 during the second step, counted by torch's
``MemTracker`` (not the plan's own counter): the shards, gradients, optimizer state and batch
alive at its start, and every tensor the step allocates. HYBRID_SHARD runs as 2 replicas x
``world / 2`` shards where the world divides by 2, else as one replica. Results: a Markdown table on stdout and
``benchmarks/results/plan_accuracy.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils.data import DataLoader

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "examples"), str(ROOT / "tests")]
from dist_utils import run_ranks  # noqa: E402

from fsdp_strategy import FSDPCustomStrategy  # noqa: E402
from fsdp_strategy.plan import plan  # noqa: E402
from fsdp_strategy.plan.run import STEPS, forward, loss_of  # noqa: E402

# gloo's own collectives, the calls NCCL gets: the point-to-point exchange (gloo's default here)
# also holds N - 2 received slices per reduce-scatter, which no GPU run allocates. gloo's own
# reduce_scatter_tensor in turn copies its whole input (seen by a tracker only at the wait), which
# no GPU run allocates either: a configuration that peaks in the last reductions' wait (small
# activations, bf16-mixed's fp32 reduce input) measures that copy; at world 2 the exchange holds
# no slices (N - 2 = 0) and measures what NCCL would (docs/memory-plans.md)
LIGHTNING_ENV = {"LOCAL_RANK": "{rank}", "NODE_RANK": "0", "FSDP_CUSTOM_GLOO_P2P": "0"}


class Wrapped(L.LightningModule):
    """An ``nn.Module`` trained on its own loss (``loss_of(forward(...))``) with AdamW."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return loss_of(forward(self.model, batch))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _gpt(d_model: int, n_layers: int, seq_len: int, batch: int) -> tuple[L.LightningModule, Any, set]:
    from gpt import Block, GPTConfig
    from lit_gpt import GPTModule, OptimizerSettings

    config = GPTConfig(d_model=d_model, n_layers=n_layers, n_heads=4, seq_len=seq_len)
    module = GPTModule(config, OptimizerSettings(), max_steps=STEPS, batch_size=batch)
    return module, torch.zeros(batch, seq_len + 1, dtype=torch.long), {Block}


def _gpt_tensor_parallel(d_model: int, n_layers: int, seq_len: int, batch: int) -> tuple[L.LightningModule, Any, set]:
    """The GPT example with a tensor-parallel plan in ``configure_model`` (planned and trained 2-D): each
    block's MLP split (``fc`` by columns, ``out`` by rows), the token embedding by rows, the head by
    columns; attention (one fused ``qkv``) and the position embedding whole."""
    from gpt import Block, GPTConfig
    from lit_gpt import GPTModule, OptimizerSettings
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    class TensorParallelGPT(GPTModule):
        def configure_model(self) -> None:
            mesh = self.device_mesh["tensor_parallel"]
            for block in self.model.blocks:
                parallelize_module(block, mesh, {"fc": ColwiseParallel(), "out": RowwiseParallel()})
            plan = {
                "tok_emb": RowwiseParallel(input_layouts=Replicate()),
                "head": ColwiseParallel(output_layouts=Replicate()),
            }
            parallelize_module(self.model, mesh, plan)

    config = GPTConfig(d_model=d_model, n_layers=n_layers, n_heads=4, seq_len=seq_len)
    module = TensorParallelGPT(config, OptimizerSettings(), max_steps=STEPS, batch_size=batch)
    return module, torch.zeros(batch, seq_len + 1, dtype=torch.long), {Block}


def _hf_causal_lm(family: str) -> tuple[L.LightningModule, Any, set]:
    """A small Hugging Face causal LM of ``family`` ("gpt2" or "llama") from a config, trained on its own loss."""
    import transformers
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    if family == "gpt2":
        config = transformers.GPT2Config(vocab_size=512, n_positions=64, n_embd=96, n_layer=3, n_head=4)
        build, block = transformers.GPT2LMHeadModel, GPT2Block
    else:
        config = transformers.LlamaConfig(
            vocab_size=512, hidden_size=96, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64,
        )  # fmt: skip
        build, block = transformers.LlamaForCausalLM, LlamaDecoderLayer
    tokens = torch.zeros(4, 64, dtype=torch.long)
    return Wrapped(build(config)), {"input_ids": tokens, "labels": tokens}, {block}


def _hf_vit() -> tuple[L.LightningModule, Any, set]:
    from transformers import ViTConfig, ViTForImageClassification
    from transformers.models.vit.modeling_vit import ViTLayer

    config = ViTConfig(
        image_size=32,
        patch_size=4,
        hidden_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        intermediate_size=256,
        num_labels=10,
    )
    batch = {"pixel_values": torch.zeros(8, 3, 32, 32), "labels": torch.zeros(8, dtype=torch.long)}
    return Wrapped(ViTForImageClassification(config)), batch, {ViTLayer}


MODELS = {
    "gpt": lambda: _gpt(128, 4, 64, 8),  # the GPT example (examples/lit_gpt.py)
    "gpt-heavy": lambda: _gpt(192, 2, 256, 8),  # activation-heavy: long sequences, few wide blocks
    "gpt2": lambda: _hf_causal_lm("gpt2"),  # Hugging Face GPT-2 from a config
    "llama": lambda: _hf_causal_lm("llama"),  # Hugging Face Llama from a config
    "vit": _hf_vit,  # Hugging Face ViT from a config
    "gpt-tp": lambda: _gpt_tensor_parallel(128, 4, 64, 8),  # the GPT example, 2-D: tensor parallel 2 inside
}
TENSOR_PARALLEL = {"gpt-tp": 2}  # models planned and run 2-D: their tensor-parallel size


def configurations(models: list[str], worlds: list[int]) -> list[dict[str, Any]]:
    """Every (model, world, sharding strategy, precision, activation checkpointing) asked for."""
    grid = []
    for model in models:
        for world in worlds:
            if world % TENSOR_PARALLEL.get(model, 1):
                continue
            for sharding in ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD")[: 2 if model in TENSOR_PARALLEL else 3]:
                for precision in ("32-true", "bf16-mixed"):
                    for checkpointing in (False, True):
                        grid.append(
                            {
                                "model": model,
                                "world": world,
                                "sharding": sharding,
                                "precision": precision,
                                "checkpointing": checkpointing,
                            }
                        )
    return grid


def strategy_kwargs(config: dict[str, Any], blocks: set) -> dict[str, Any]:
    """The ``FSDPCustomStrategy`` arguments of ``config``."""
    kwargs: dict[str, Any] = {"sharding_strategy": config["sharding"], "auto_wrap_policy": blocks}
    tensor = TENSOR_PARALLEL.get(config.get("model"))
    if tensor is not None:
        kwargs.update(data_parallel_size=config["world"] // tensor, tensor_parallel_size=tensor)
    if config["sharding"] == "HYBRID_SHARD":
        world = config["world"]
        kwargs["device_mesh"] = (2, world // 2) if world % 2 == 0 else (1, world)
    if config["checkpointing"]:
        kwargs["activation_checkpointing_policy"] = blocks
    return kwargs


def predict(config: dict[str, Any]) -> int:
    """The plan's peak per rank for ``config`` (in this process)."""
    module, batch, blocks = MODELS[config["model"]]()
    result = plan(
        module, batch, world_size=config["world"], precision=config["precision"], **strategy_kwargs(config, blocks)
    )
    return result.peak_bytes


class PeakOfLastStep(L.Callback):
    """Rank 0's peak of live tensor bytes during the last training step, counted by torch's own
    ``MemTracker`` (torch.distributed._tools), not by the ``LiveBytes`` the plan counts with: it is
    given what is alive when the step starts (the module's shards and buffers, the optimizer's
    state, the batch) and the full parameters the engine frees by resizing their storage."""

    def __init__(self) -> None:
        self.tracker: MemTracker | None = None
        self.peak = 0

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step != STEPS - 1:
            return
        self.tracker = MemTracker()
        full = [param.unsharded for param in trainer.strategy.scheduler.sharded_params()]
        self.tracker.track_external(pl_module, *trainer.optimizers, *full, *torch.utils._pytree.tree_leaves(batch))
        self.tracker.__enter__()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.tracker is not None:
            self.tracker.__exit__(None, None, None)
            peaks = self.tracker.get_tracker_snapshot("peak")
            self.peak = next(peak["Total"] for device, peak in peaks.items() if str(device) == "cpu")
            self.tracker = None


def measure_body(rank: int, world: int, configs: list[dict[str, Any]]) -> list[int]:
    """Run ``configs`` one after another on this rank (a real ``Trainer.fit`` each); rank 0's peaks."""
    peaks = []
    for config in configs:
        torch.manual_seed(0)
        module, batch, blocks = MODELS[config["model"]]()
        peak = PeakOfLastStep()
        trainer = L.Trainer(
            accelerator="cpu",
            devices=world,
            strategy=FSDPCustomStrategy(**strategy_kwargs(config, blocks)),
            precision=config["precision"],
            max_steps=STEPS,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[peak],
            use_distributed_sampler=False,
        )
        trainer.fit(module, DataLoader([batch] * STEPS, batch_size=None))
        peaks.append(peak.peak)
    return peaks


def measure(configs: list[dict[str, Any]], world: int, folder: Path) -> list[int]:
    """Rank 0's measured peaks of ``configs`` (all at world ``world``), one group of forked ranks."""
    return run_ranks(measure_body, world, folder, configs, env=LIGHTNING_ENV, timeout=60 + 30 * len(configs))[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--worlds", nargs="+", type=int, default=[2, 3])
    args = parser.parse_args()
    grid = configurations(args.models, args.worlds)
    start = time.monotonic()
    for config in grid:
        config["predicted"] = predict(config)
    with tempfile.TemporaryDirectory() as folder:
        for world in args.worlds:
            at_world = [config for config in grid if config["world"] == world]
            for config, measured in zip(at_world, measure(at_world, world, Path(folder))):
                config["measured"] = measured
    print("| model | ranks | sharding | precision | act. ckpt | predicted MiB | measured MiB | error |")
    print("|---|---|---|---|---|---|---|---|")
    for c in grid:
        error = (c["predicted"] - c["measured"]) / c["measured"]
        checkpointing = "on" if c["checkpointing"] else "off"
        print(
            f"| {c['model']} | {c['world']} | {c['sharding']} | {c['precision']} | {checkpointing} "
            f"| {c['predicted'] / 2**20:.2f} | {c['measured'] / 2**20:.2f} | {100 * error:+.1f} % |"
        )
    worst = max(abs(c["predicted"] - c["measured"]) / c["measured"] for c in grid)
    print(f"\n{len(grid)} configurations, worst error {100 * worst:.1f} %, {time.monotonic() - start:.0f} s")
    out = ROOT / "benchmarks" / "results" / "plan_accuracy.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(grid, indent=1))


if __name__ == "__main__":
    main()
