"""CUDA/NCCL check, run as its own process by test_cuda.py: engine parity on one GPU (fp32, bf16,
CPU offload with pinned shards) and a model built on the CPU placed by the engine."""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models import Block, TiedLM, lm_loss, make_batches  # noqa: E402

from fsdp_strategy import MixedPrecision  # noqa: E402
from fsdp_strategy.engine import get_scheduler, shard_model  # noqa: E402


def engine_parity(**options) -> float:
    torch.manual_seed(0)
    model = TiedLM().cuda()
    reference = copy.deepcopy(model)
    shard_model(model, auto_wrap_policy={Block}, device="cuda", **options)
    scheduler = get_scheduler(model)
    shards = scheduler.sharded_params()
    expected_device = "cpu" if options.get("cpu_offload") else "cuda"
    assert all(p.sharded.device.type == expected_device for p in shards)
    if options.get("cpu_offload"):
        assert all(p.sharded.is_pinned() for p in shards)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ref_optimizer = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=1e-2)
    worst = 0.0
    for batch in make_batches(5, 4).cuda():
        loss = lm_loss(model, batch)
        loss.backward()
        scheduler.clip_grad_norm_(0.5)
        optimizer.step()
        optimizer.zero_grad()
        ref_loss = lm_loss(reference, batch)
        ref_loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in reference.parameters() if p.requires_grad], 0.5)
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        worst = max(worst, abs(loss.item() - ref_loss.item()) / ref_loss.item())
    return worst


def cpu_built_model_placed_by_the_engine() -> None:
    """A model built on the CPU, ``sync_module_states=True`` and no ``device``: NCCL gets CUDA
    tensors only, everything lands on the current CUDA device, a shared buffer stays shared."""
    torch.manual_seed(0)
    model = TiedLM()
    shared = torch.arange(4.0)
    model.blocks[0].register_buffer("shared", shared)
    model.blocks[1].register_buffer("shared", shared)
    reference = copy.deepcopy(model).cuda()
    shard_model(model, auto_wrap_policy={Block}, sync_module_states=True)
    scheduler = get_scheduler(model)
    assert all(p.sharded.device.type == "cuda" for p in scheduler.sharded_params())
    assert all(b.device.type == "cuda" for b in model.buffers())
    assert model.blocks[0].shared is model.blocks[1].shared
    batch = make_batches(1, 4)[0].cuda()
    assert abs(lm_loss(model, batch).item() - lm_loss(reference, batch).item()) < 1e-5
    scheduler.close()


def main() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29541")
    dist.init_process_group("nccl", rank=0, world_size=1)
    assert engine_parity() < 1e-5
    assert engine_parity(cpu_offload=True) < 1e-5
    assert engine_parity(mixed_precision=MixedPrecision(torch.bfloat16, torch.float32, torch.bfloat16)) < 3e-2
    cpu_built_model_placed_by_the_engine()
    print("CUDA OK")


if __name__ == "__main__":
    main()
