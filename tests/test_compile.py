"""``torch.compile`` sees plain modules: compiling the whole sharded model, or each unit, trains
to the losses of eager mode (which equal the oracle's)."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_ranks
from oracle import assert_matches, train_pair
from pattern_models import VOCAB, Dense, MLPBlock, lm_loss
from torch import nn

from fsdp_strategy.engine import get_scheduler


def _tokens(step: int, world: int) -> list:
    generator = torch.Generator().manual_seed(300 + step)
    return [torch.randint(0, VOCAB, (2, 6), generator=generator) for _ in range(world)]


def _compiled_whole(rank: int, world: int) -> dict:
    compiled = {}

    def loss(model, tokens, rank, step):
        if get_scheduler_or_none(model) is None:
            return lm_loss(model(tokens), tokens)  # the oracle runs eagerly
        if "model" not in compiled:
            compiled["model"] = torch.compile(model, backend="inductor")
        return lm_loss(compiled["model"](tokens), tokens)

    result = train_pair(rank, world, Dense, loss, _tokens, steps=3, auto_wrap_policy={MLPBlock, nn.Embedding})
    return {**result, "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"]}


def _compiled_units(rank: int, world: int) -> dict:
    def loss(model, tokens, rank, step):
        if step == 0 and get_scheduler_or_none(model) is not None:
            for block in model.blocks:
                block.compile(backend="inductor")
        return lm_loss(model(tokens), tokens)

    result = train_pair(rank, world, Dense, loss, _tokens, steps=3, auto_wrap_policy={MLPBlock, nn.Embedding})
    return {**result, "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"]}


def get_scheduler_or_none(model: nn.Module):
    try:
        return get_scheduler(model)
    except ValueError:
        return None


@pytest.mark.slow
def test_compiled_model_and_compiled_units_train_like_eager(tmp_path):
    torch._dynamo.reset()
    for body, what in ((_compiled_whole, "torch.compile(model)"), (_compiled_units, "block.compile()")):
        for result in run_ranks(body, 2, tmp_path, timeout=600):
            assert result["graphs"] > 0, f"{what}: nothing was compiled"
            assert_matches(result, what, rel=1e-5)
