"""Gradient accumulation keeps its full gradients in reduce_dtype, and clipping by norm clips
each optimizer's parameters by their own norm."""

from __future__ import annotations

import copy

import torch
from dist_utils import run_ranks
from oracle import assert_matches, reference_step, weight_error
from pattern_models import VOCAB, Dense, MLPBlock, lm_loss
from torch import nn

from fsdp_strategy import MixedPrecision
from fsdp_strategy.engine import get_scheduler, shard_model

MICRO_BATCHES = 16


def _loss(model: nn.Module, tokens: torch.Tensor, rank: int, step: int) -> torch.Tensor:
    return lm_loss(model(tokens), tokens)


def _bf16_accumulation_body(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = Dense()
    reference = copy.deepcopy(model).to(torch.bfloat16)  # computes what the gathered bf16 weights compute
    precision = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    shard_model(model, auto_wrap_policy={MLPBlock, nn.Embedding}, mixed_precision=precision)
    scheduler = get_scheduler(model)
    generator = torch.Generator().manual_seed(3)
    batches = [[torch.randint(0, VOCAB, (2, 6), generator=generator) for _ in range(world)] for _ in range(16)]
    expected = {name: torch.zeros_like(p, dtype=torch.float32) for name, p in reference.named_parameters()}
    for index, micro in enumerate(batches):
        last = index == MICRO_BATCHES - 1
        with scheduler.no_sync() if not last else torch.enable_grad():
            _loss(model, micro[rank], rank, index).backward()
        for other in range(world):  # the exact formula: every bf16 micro-batch gradient summed in fp32
            _loss(reference, micro[other], other, index).backward()
            for name, param in reference.named_parameters():
                expected[name] += param.grad.float() / world
                param.grad = None
    gathered = {}
    for unit in scheduler.units:
        fulls = unit.gather_full([p.sharded.grad for p in unit.params])
        gathered.update({p.fqn: full for p, full in zip(unit.params, fulls)})
    return {
        "error": max(
            ((gathered[name] - value).abs().max() / value.abs().max()).item() for name, value in expected.items()
        )
    }


def test_no_sync_accumulates_bf16_gradients_in_fp32(tmp_path):
    for result in run_ranks(_bf16_accumulation_body, 2, tmp_path):
        # summing 16 bf16 gradients in bf16 is off by ~8e-3; in fp32 only the order of sums differs
        assert result["error"] < 1e-5, result["error"]


def _clip_body(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = Dense()
    reference = copy.deepcopy(model)
    shard_model(model, auto_wrap_policy={MLPBlock, nn.Embedding})
    scheduler = get_scheduler(model)

    def split(net):
        blocks = list(net.blocks.parameters())
        rest = [p for p in net.parameters() if all(p is not b for b in blocks)]
        return [torch.optim.SGD(blocks, lr=0.5), torch.optim.SGD(rest, lr=0.5)]

    optimizers, ref_optimizers = split(model), split(reference)
    generator = torch.Generator().manual_seed(4)
    losses, ref_losses, norms, ref_norms = [], [], [], []
    for step in range(4):
        batches = [torch.randint(0, VOCAB, (2, 6), generator=generator) for _ in range(world)]
        loss = _loss(model, batches[rank], rank, step)
        loss.backward()
        ref_losses.append(reference_step(reference, _loss, batches, world, step)[rank])
        for optimizer, ref_optimizer, max_norm in zip(optimizers, ref_optimizers, (0.05, 0.2)):
            params = [p for group in optimizer.param_groups for p in group["params"]]
            ref_params = [p for group in ref_optimizer.param_groups for p in group["params"]]
            norms.append(scheduler.clip_grad_norm_(max_norm, parameters=params).item())
            ref_norms.append(torch.nn.utils.clip_grad_norm_(ref_params, max_norm).item())
            optimizer.step()
            optimizer.zero_grad()
            ref_optimizer.step()
            ref_optimizer.zero_grad()
        losses.append(loss.item())
    return {
        "losses": losses,
        "ref_losses": ref_losses,
        "norms": norms,
        "ref_norms": ref_norms,
        "weight_error": weight_error(model, reference),
    }


def test_each_optimizer_is_clipped_by_its_own_norm(tmp_path):
    for result in run_ranks(_clip_body, 2, tmp_path):
        assert_matches(result, "two optimizers, clipped separately")
        for norm, ref in zip(result["norms"], result["ref_norms"]):
            assert abs(norm - ref) <= 1e-5 * ref
        assert all(n > 0.2 for n in result["ref_norms"])  # both clips are active


ZEROINGS = {  # how the gradients are zeroed between a no_sync micro-batch and the synced one
    "none": lambda net, optimizer: None,
    "module": lambda net, optimizer: net.zero_grad(),
    "optimizer in place": lambda net, optimizer: optimizer.zero_grad(set_to_none=False),
    "one block": lambda net, optimizer: net.blocks[0].zero_grad(),
}


def _zero_grad_body(rank: int, world: int) -> dict:
    errors = {}
    for name, zero in ZEROINGS.items():
        torch.manual_seed(0)
        model = Dense()
        reference = copy.deepcopy(model)
        shard_model(model, auto_wrap_policy={MLPBlock, nn.Embedding})
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
        ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5, momentum=0.9)
        generator = torch.Generator().manual_seed(5)
        for step in range(3):
            for micro in range(2):  # the first under no_sync, then a zeroing, then the synced one
                batches = [torch.randint(0, VOCAB, (2, 6), generator=generator) for _ in range(world)]
                with get_scheduler(model).no_sync() if micro == 0 else torch.enable_grad():
                    _loss(model, batches[rank], rank, step).backward()
                for other in range(world):  # DDP's semantics: the ranks' gradients averaged
                    (_loss(reference, batches[other], other, step) / world).backward()
                if micro == 0 and step > 0:
                    zero(model, optimizer)
                    zero(reference, ref_optimizer)
            optimizer.step()
            optimizer.zero_grad()
            ref_optimizer.step()
            ref_optimizer.zero_grad()
        errors[name] = weight_error(model, reference)
    return errors


def test_zero_grad_between_micro_batches_discards_what_no_sync_accumulated(tmp_path):
    """[Note: zero_grad under no_sync] in engine/param.py: a ``zero_grad`` of the module, an optimizer (to
    None or in place) or one block after a ``no_sync`` micro-batch discards its gradients, as in one
    process and DDP."""
    for errors in run_ranks(_zero_grad_body, 2, tmp_path):
        assert all(error < 1e-5 for error in errors.values()), errors
