"""A user's gradient hooks on parameters run on the full gradient, as without sharding, and post-accumulate-grad
hooks on the shard's reduced gradient, as FSDP2 runs them ([Note: gradient hooks on parameters]); what the engine
cannot do exactly is refused by name ([Note: modules refused at sharding]): embeddings with ``max_norm`` or
``sparse=True``."""

from __future__ import annotations

import copy

import pytest
import torch
from dist_utils import run_ranks
from oracle import weight_error
from pattern_models import VOCAB, Dense, MLPBlock, lm_loss
from torch import nn

from fsdp_strategy.engine import shard_model

POLICIES = {"default": None, "per_block": {MLPBlock}, "per_module": {MLPBlock, nn.Embedding}}
MASK = torch.ones(VOCAB, 1)
MASK[:8] = 0  # the first rows of the embedding: rank 0's shard at world 2 and 3


def _mask_rows(grad: torch.Tensor) -> torch.Tensor:
    return grad * MASK


def _half(grad: torch.Tensor) -> torch.Tensor:
    return grad * 0.5


def _double(grad: torch.Tensor) -> torch.Tensor:
    return grad * 2


def _train_with_hooks(rank: int, world: int, policy: set | None) -> float:
    """Hooks registered before sharding (on the original parameter), after (on the shard, from
    ``named_parameters()`` at rest) and during a step between forward and backward (on whatever the
    module holds then), one removed by its handle after the second step; 4 SGD steps against one
    process with the same hooks on the same batches (DDP's mean)."""
    torch.manual_seed(0)
    model = Dense()
    reference = copy.deepcopy(model)
    reference.embed.weight.register_hook(_mask_rows)
    reference_half = reference.blocks[1].up.weight.register_hook(_half)
    model.embed.weight.register_hook(_mask_rows)
    shard_model(model, auto_wrap_policy=policy)
    half = dict(model.named_parameters())["blocks.1.up.weight"].register_hook(_half)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    for step in range(4):
        if step == 2:
            half.remove()
            reference_half.remove()
        generator = torch.Generator().manual_seed(step)
        batches = [torch.randint(0, VOCAB, (2, 6), generator=generator) for _ in range(world)]
        loss = lm_loss(model(batches[rank]), batches[rank])
        if step == 1:  # mid-step: the block's unit was resharded after its forward (per block)
            dict(model.named_parameters())["blocks.0.up.weight"].register_hook(_double)
            reference.blocks[0].up.weight.register_hook(_double)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        for tokens in batches:
            lm_loss(reference(tokens), tokens).backward()
        for param in reference.parameters():
            param.grad /= world
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    return weight_error(model, reference)


def _refusal(build) -> str:
    try:
        build()
    except (RuntimeError, ValueError) as error:
        return str(error)
    return "not refused"


def _recorded_grads_are_the_shards(rank: int, world: int) -> dict:
    """Post-accumulate-grad hooks registered before sharding and on a shard after it run once per
    backward with the shard's reduced gradient in ``grad`` (FSDP2's rule), as torch's MemTracker
    reads it."""
    torch.manual_seed(0)
    model = Dense()
    seen: dict[str, list[torch.Tensor]] = {"head.weight": [], "blocks.0.up.weight": []}
    model.head.weight.register_post_accumulate_grad_hook(lambda p: seen["head.weight"].append(p.grad.clone()))
    shard_model(model, auto_wrap_policy={MLPBlock})
    shard = dict(model.named_parameters())["blocks.0.up.weight"]
    shard.register_post_accumulate_grad_hook(lambda p: seen["blocks.0.up.weight"].append(p.grad.clone()))
    tokens = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(rank))
    lm_loss(model(tokens), tokens).backward()
    params = dict(model.named_parameters())
    return {name: (len(grads), (grads[-1] - params[name].grad).abs().max().item()) for name, grads in seen.items()}


def _optimizer_in_backward(rank: int, world: int, policy: set | None, optimizer_class: type = torch.optim.SGD) -> float:
    """torch's optimizer-in-backward pattern: one optimizer per parameter (SGD; AdamW keeps its state
    on the shard), stepped by its post-accumulate-grad hook; 3 steps against one process doing the
    same on the mean gradient."""
    torch.manual_seed(0)
    model = Dense()
    reference = copy.deepcopy(model)
    shard_model(model, auto_wrap_policy=policy)
    for net in (model, reference):
        lr = 0.5 if optimizer_class is torch.optim.SGD else 1e-2
        optimizers = {param: optimizer_class([param], lr=lr) for param in net.parameters()}

        def step(param: torch.Tensor, optimizers: dict = optimizers) -> None:
            optimizers[param].step()
            optimizers[param].zero_grad()

        for param in net.parameters():
            param.register_post_accumulate_grad_hook(step)
    for index in range(3):
        generator = torch.Generator().manual_seed(index)
        batches = [torch.randint(0, VOCAB, (2, 6), generator=generator) for _ in range(world)]
        lm_loss(model(batches[rank]), batches[rank]).backward()
        sum(lm_loss(reference(tokens), tokens) for tokens in batches).div(world).backward()
    return weight_error(model, reference)


def _embedding(**kwargs) -> None:
    model = Dense()
    model.embed = nn.Embedding(VOCAB, model.embed.embedding_dim, **kwargs)
    shard_model(model, auto_wrap_policy={MLPBlock})


def _hooks_body(rank: int, world: int) -> dict:
    out = {name: _train_with_hooks(rank, world, policy) for name, policy in POLICIES.items()}
    out["post_accumulate"] = _recorded_grads_are_the_shards(rank, world)
    out["optimizer_in_backward"] = {name: _optimizer_in_backward(rank, world, p) for name, p in POLICIES.items()}
    out["optimizer_in_backward"]["AdamW, per block"] = _optimizer_in_backward(
        rank, world, {MLPBlock}, torch.optim.AdamW
    )
    out["max_norm"] = _refusal(lambda: _embedding(max_norm=0.5))
    out["sparse"] = _refusal(lambda: _embedding(sparse=True))
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_gradient_hooks_run_on_the_full_gradient_and_post_accumulate_hooks_on_the_reduced_shard(tmp_path, world):
    for result in run_ranks(_hooks_body, world, tmp_path, timeout=240):
        for policy in POLICIES:
            assert result[policy] < 1e-6, (policy, result[policy])
        assert result["post_accumulate"] == {"head.weight": (1, 0.0), "blocks.0.up.weight": (1, 0.0)}
        for policy, error in result["optimizer_in_backward"].items():
            assert error < 1e-6, (policy, error)
        assert "embed (Embedding) has max_norm=0.5" in result["max_norm"]
        assert "embed (Embedding) has sparse=True" in result["sparse"]


def test_max_norm_embedding_is_kept_where_nothing_is_sharded():
    """One process (a shard group of one): each rank's rows are all the rows, so ``max_norm`` stays
    exact and is not refused (its in-place renormalization is the shard's own)."""
    torch.manual_seed(0)
    model = Dense()
    model.embed = nn.Embedding(VOCAB, model.embed.embedding_dim, max_norm=0.5)
    reference = copy.deepcopy(model)
    shard_model(model, auto_wrap_policy={MLPBlock})
    tokens = torch.randint(0, VOCAB, (2, 6))
    for net in (model, reference):
        optimizer = torch.optim.SGD(net.parameters(), lr=0.5)
        for _ in range(2):
            lm_loss(net(tokens), tokens).backward()
            optimizer.step()
            optimizer.zero_grad()
    assert weight_error(model, reference) < 1e-6
