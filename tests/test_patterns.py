"""The training patterns users write, each against the oracle (DDP semantics on the unsharded
model, ``find_unused_parameters=True``): fp32 losses at every step and the final weights within
1e-5 relative. FULL_SHARD and SHARD_GRAD_OP at world 2; the unused-parameter patterns at
world 3 too (padding rows, more than one idle rank). All patterns of one configuration share
one group of forked ranks.
"""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_ranks
from oracle import assert_matches, train_pair
from pattern_models import (
    VOCAB,
    ContainerBlock,
    Containers,
    Critic,
    Dense,
    EarlyExit,
    ExpertBank,
    FreezeInStep,
    GeneratorCritic,
    InsideForward,
    LoRABlock,
    LoRAModel,
    MLPBlock,
    MoE,
    MultiTask,
    QuantizedLoRABlock,
    QuantizedLoRAModel,
    Readers,
    Recurrent,
    SharedProjection,
    Staged,
    TaskHeads,
    WeightReaders,
    gradient_penalty_loss,
    lm_loss,
)
from torch import nn

from fsdp_strategy.engine import get_scheduler


def _tokens(step: int, world: int, residues: dict[int, tuple[int, ...]] | None = None, first=None) -> list:
    """Per-rank token batches (2 x 6); ``residues[rank]`` limits tokens to those residues mod 4."""
    generator = torch.Generator().manual_seed(100 + step)
    batches = []
    for rank in range(world):
        tokens = torch.randint(0, VOCAB, (2, 6), generator=generator)
        allowed = (residues or {}).get(rank)
        if allowed is not None:
            tokens = tokens - tokens % 4 + torch.tensor(allowed)[tokens % len(allowed)]
        if first is not None:
            tokens[0, 0] = first[rank]
        batches.append(tokens)
    return batches


def _lm(model: nn.Module, tokens: torch.Tensor, rank: int, step: int) -> torch.Tensor:
    return lm_loss(model(tokens), tokens)


def _moe_data(step: int, world: int) -> list:
    # expert 2 only gets tokens on rank 0; expert 3 gets none anywhere
    return _tokens(step, world, residues={r: (0, 1, 2) if r == 0 else (0, 1) for r in range(world)})


def _multitask_data(step: int, world: int) -> list:
    # rank 0: odd first token (no early exit), task 1; rank 1: even (exit early), task 0; rank 2: task 0, no exit
    return _tokens(step, world, first=[1, 6, 9][:world])


def _finetune(model: nn.Module, step: int) -> None:
    """Backbone frozen, then unfrozen, then the head and embedding frozen: flags change between steps."""
    model.blocks.requires_grad_(step >= 2)
    model.head.requires_grad_(step < 4)
    model.embed.requires_grad_(step < 4)


def _gan_data(step: int, world: int) -> list:
    generator = torch.Generator().manual_seed(200 + step)
    return [
        (
            torch.randn(3, 8, generator=generator),
            torch.randn(3, 8, generator=generator),
            torch.rand(3, 1, generator=generator),
        )
        for _ in range(world)
    ]


def _gp(model: nn.Module, batch: tuple, rank: int, step: int) -> torch.Tensor:
    return gradient_penalty_loss(model, *batch)


def _gan(model: nn.Module, batch: tuple, rank: int, step: int) -> torch.Tensor:
    return model(batch[0], batch[1])


def _inside(model: nn.Module, tokens: torch.Tensor, rank: int, step: int) -> torch.Tensor:
    return model(torch.cat([tokens, tokens.flip(0)]))


def _two_root_forwards(model: nn.Module, tokens: torch.Tensor, rank: int, step: int) -> torch.Tensor:
    """Two calls of the model (two root forwards, e.g. a contrastive pair), then one backward: the
    reductions follow both forwards, not only the second."""
    return lm_loss(model(tokens), tokens) + 0.5 * lm_loss(model(tokens.flip(0)[:, :4]), tokens.flip(0)[:, :4])


PATTERNS = {
    # name: (build, auto_wrap_policy, loss, data, before_step, steps)
    "dense": (Dense, {MLPBlock, nn.Embedding}, _lm, _tokens, None, 4),
    "moe": (MoE, {ExpertBank, MLPBlock, nn.Embedding}, _lm, _moe_data, None, 4),
    "multitask": (MultiTask, {EarlyExit, TaskHeads, nn.Embedding}, _lm, _multitask_data, None, 4),
    "finetune": (Dense, {MLPBlock, nn.Embedding}, _lm, _tokens, _finetune, 6),
    "lora": (LoRAModel, {LoRABlock}, _lm, _tokens, None, 4),
    "int8_lora": (QuantizedLoRAModel, {QuantizedLoRABlock}, _lm, _tokens, None, 3),
    "fp8_lora": (lambda: QuantizedLoRAModel(torch.float8_e4m3fn), {QuantizedLoRABlock}, _lm, _tokens, None, 3),
    "gradient_penalty": (Critic, {MLPBlock}, _gp, _gan_data, None, 4),
    "checkpointed_stages": (lambda: Staged(reentrant=False), {MLPBlock}, _lm, _tokens, None, 3),
    "checkpointed_stages_reentrant": (lambda: Staged(reentrant=True), {MLPBlock}, _lm, _tokens, None, 3),
    "containers": (Containers, {ContainerBlock}, _lm, _tokens, None, 3),
    "shared_submodule": (SharedProjection, {MLPBlock}, _lm, _tokens, None, 3),
    "weight_readers": (Readers, {WeightReaders, MLPBlock}, _lm, _tokens, None, 3),
    "recurrent": (Recurrent, {MLPBlock}, _lm, _tokens, None, 3),
    "inside_forward": (InsideForward, {MLPBlock, nn.Embedding}, _inside, _tokens, None, 3),
    "critic_real_then_fake": (GeneratorCritic, {Critic}, _gan, _gan_data, None, 3),
    "freeze_inside_step": (FreezeInStep, {MLPBlock}, _gan, _gan_data, None, 3),
    "two_root_forwards_one_backward": (Dense, {MLPBlock, nn.Embedding}, _two_root_forwards, _tokens, None, 3),
}
UNUSED_PARAMETER_PATTERNS = ["moe", "multitask", "finetune", "lora", "int8_lora", "fp8_lora"]


def _run_patterns(rank: int, world: int, strategy: str, names: list[str]) -> dict:
    results = {}
    for name in names:
        build, policy, loss, data, before_step, steps = PATTERNS[name]
        results[name] = train_pair(
            rank,
            world,
            build,
            loss,
            data,
            steps=steps,
            before_step=before_step,
            sharding_strategy=strategy,
            auto_wrap_policy=policy,
        )
    return results


@pytest.mark.parametrize("collectives", ["1", "0"], ids=["point_to_point", "gloo_collectives"])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])
def test_patterns_world_2(tmp_path, strategy, collectives):
    env = {"FSDP_CUSTOM_GLOO_P2P": collectives}  # "0": gloo's collectives, the calls NCCL gets
    for rank_result in run_ranks(_run_patterns, 2, tmp_path, strategy, list(PATTERNS), timeout=240, env=env):
        for name, result in rank_result.items():
            assert_matches(result, f"{name} ({strategy})")


def test_unused_parameter_patterns_world_3(tmp_path):
    def body(rank, world):
        return {
            strategy: _run_patterns(rank, world, strategy, UNUSED_PARAMETER_PATTERNS)
            for strategy in ("FULL_SHARD", "SHARD_GRAD_OP")
        }

    for rank_result in run_ranks(body, 3, tmp_path, timeout=240):
        for strategy, results in rank_result.items():
            for name, result in results.items():
                assert_matches(result, f"{name} ({strategy}, world 3)")


def _globally_unused_stays_none(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    from fsdp_strategy.engine import shard_model

    model = shard_model(MoE(), auto_wrap_policy={ExpertBank, MLPBlock, nn.Embedding})
    tokens = _moe_data(0, world)[rank]
    lm_loss(model(tokens), tokens).backward()
    grads = {p.fqn: p.sharded.grad for p in get_scheduler(model).sharded_params()}
    return {
        "expert3_none": grads["bank_a.experts.2.0.weight"] is None,  # expert 3 is the bank's third
        "expert2_set": grads["bank_b.experts.0.0.weight"] is not None,  # used on rank 0 only
        "expert2_shard": grads["bank_b.experts.0.0.weight"],
    }


def test_a_parameter_no_rank_used_keeps_no_gradient_and_one_used_somewhere_gets_it_everywhere(tmp_path):
    results = run_ranks(_globally_unused_stays_none, 2, tmp_path)
    for result in results:
        assert result["expert3_none"]  # as DDP: optimizers skip it (no Adam step from momentum)
        assert result["expert2_set"]  # rank 1 had no token for it, and still gets its rows
    assert results[1]["expert2_shard"].abs().sum() > 0  # rank 1's rows carry rank 0's gradient / 2


def test_no_shard_patterns_world_2(tmp_path):
    results = run_ranks(_run_patterns, 2, tmp_path, "NO_SHARD", ["dense", "moe", "multitask", "int8_lora", "fp8_lora"])
    for rank_result in results:
        for name, result in rank_result.items():
            assert_matches(result, f"{name} (NO_SHARD)")


def test_shared_submodule_belongs_to_the_lowest_common_unit():
    from fsdp_strategy.engine import shard_model

    model = shard_model(SharedProjection(), auto_wrap_policy={MLPBlock})
    unit_of = {p.fqn: unit.name for unit in get_scheduler(model).units for p in unit.params}
    assert unit_of["blocks.0.proj.weight"] == "root"  # registered in blocks.0 and blocks.1
    assert unit_of["blocks.0.up.weight"] == "blocks.0" and unit_of["blocks.1.up.weight"] == "blocks.1"
    recurrent = shard_model(Recurrent(), auto_wrap_policy={MLPBlock})
    unit_of = {p.fqn: unit.name for unit in get_scheduler(recurrent).units for p in unit.params}
    assert unit_of["blocks.0.up.weight"] == "blocks.0"  # one object at three places: its own unit
    assert [u.name for u in get_scheduler(recurrent).units] == ["root", "blocks.0"]
