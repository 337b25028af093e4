"""A failed iteration (an exception in forward or backward, caught by the training loop) leaves
no trace: the next iteration starts clean and training goes on exactly like a run that skipped
the failed step."""

from __future__ import annotations

import copy

import pytest
import torch
from dist_utils import run_ranks
from oracle import assert_matches, reference_step, weight_error
from pattern_models import VOCAB, FaultyBlock, FaultyDense, MLPBlock, lm_loss
from torch import nn

from fsdp_strategy.engine import get_scheduler, shard_model

FAILURES = {1: "backward", 3: "forward", 5: "interrupt"}  # step -> what fails


def _loss(model: nn.Module, tokens: torch.Tensor, rank: int, step: int) -> torch.Tensor:
    return lm_loss(model(tokens), tokens)


def _recovery_body(rank: int, world: int, strategy: str, accumulate: bool) -> dict:
    torch.manual_seed(0)
    model = FaultyDense()
    reference = copy.deepcopy(model)
    shard_model(model, sharding_strategy=strategy, auto_wrap_policy={MLPBlock, FaultyBlock, nn.Embedding})
    scheduler = get_scheduler(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(5)
    losses, ref_losses, errors = [], [], []
    for step in range(7):
        batches = [torch.randint(0, VOCAB, (2, 6), generator=generator) for _ in range(world)]
        failure = FAILURES.get(step)
        if accumulate:  # a micro-batch under no_sync first: its stashed gradients must be dropped too
            with scheduler.no_sync():
                _loss(model, batches[rank], rank, step).backward()
        model.blocks[1].fail = failure
        try:
            loss = _loss(model, batches[rank], rank, step)
            loss.backward()
        except RuntimeError as error:
            errors.append(str(error))
            optimizer.zero_grad()
            continue
        except KeyboardInterrupt:  # not an Exception: the loop must reset the engine itself
            scheduler.reset()
            optimizer.zero_grad()
            continue
        finally:
            model.blocks[1].fail = None
        optimizer.step()
        optimizer.zero_grad()
        if accumulate:
            reference_step(reference, _loss, batches, world, step)
        ref_losses.append(reference_step(reference, _loss, batches, world, step)[rank])
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        losses.append(loss.item())
    return {
        "losses": losses,
        "ref_losses": ref_losses,
        "weight_error": weight_error(model, reference),
        "errors": errors,
        "engine_bytes": scheduler.memory.current,
    }


@pytest.mark.parametrize("accumulate", [False, True])
def test_training_goes_on_after_failed_iterations(tmp_path, accumulate):
    FaultyBlock.fail = None
    for result in run_ranks(_recovery_body, 2, tmp_path, "FULL_SHARD", accumulate):
        assert len(result["losses"]) == 4  # steps 1, 3 and 5 failed and were skipped
        assert any("in backward" in e for e in result["errors"]) and any("in forward" in e for e in result["errors"])
        assert_matches(result, f"recovery (accumulate={accumulate})")
        assert result["engine_bytes"] == 0  # nothing left gathered or stashed
