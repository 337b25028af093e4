"""``ignored_modules`` (FSDP1's meaning): left whole on every rank, not reduced, in
checkpoints and clipping; a frozen ignored encoder trains exactly like the oracle."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dist_utils import run_ranks
from models import Block, TiedLM, lm_loss, make_batches
from oracle import assert_matches, train_pair
from test_checkpoint import _assert_same_state
from torch import nn

from fsdp_strategy import MixedPrecision
from fsdp_strategy.checkpoint import full_optimizer_state_dict, full_state_dict, load_folder, save_folder
from fsdp_strategy.engine import get_scheduler, is_sharded, shard_model


class EncodedLM(nn.Module):
    """TiedLM behind an encoder (a linear layer with BatchNorm statistics), the part to ignore."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = TiedLM()
        self.encoder = nn.ModuleDict({"proj": nn.Linear(10, 10), "norm": nn.BatchNorm1d(10)})

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.lm.embed(tokens)
        x = self.encoder.norm(self.encoder.proj(x).transpose(1, 2)).transpose(1, 2)
        for block in self.lm.blocks:
            x = block(x)
        return self.lm.head(x)


def _loss(model, batch, rank, step):
    return lm_loss(model, batch)


def _frozen_encoder() -> EncodedLM:
    model = EncodedLM()
    model.encoder.requires_grad_(False)
    model.encoder.eval()  # a frozen pretrained encoder: statistics fixed too (the oracle runs every rank's batch)
    return model


def _frozen_body(rank: int, world: int) -> dict:
    batches = make_batches(3, 2 * world)
    whole = []

    def note_encoder(model: nn.Module, step: int) -> None:
        if is_sharded(model):
            sharded = {p.fqn for p in get_scheduler(model).sharded_params()}
            whole.append(
                not any(n.startswith("encoder.") for n in sharded) and model.encoder.proj.weight.shape == (10, 10)
            )

    result = train_pair(
        rank,
        world,
        _frozen_encoder,
        _loss,
        lambda step, world: [batches[step][r::world] for r in range(world)],
        steps=3,
        before_step=note_encoder,
        shard_kwargs_for=lambda model: {"ignored_modules": [model.encoder]},
        auto_wrap_policy={Block},
    )
    return {**result, "encoder_whole": all(whole) and len(whole) == 3}


def test_a_frozen_ignored_encoder_trains_like_the_oracle(tmp_path):
    for result in run_ranks(_frozen_body, 2, tmp_path):
        assert_matches(result, "frozen ignored encoder")
        assert result["encoder_whole"]  # not sharded: whole on every rank


def _trainable_body(rank: int, world: int, folder: str) -> dict:
    torch.manual_seed(0)
    model = EncodedLM()
    with pytest.warns(UserWarning, match="not synchronized across ranks"):
        shard_model(
            model,
            auto_wrap_policy={Block},
            ignored_modules=[model.encoder],
            mixed_precision=MixedPrecision(buffer_dtype=torch.bfloat16),
        )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    lm_loss(model, make_batches(1, 2 * world)[0][rank::world]).backward()
    scheduler = get_scheduler(model)
    sharded_sq = sum(p.sharded.grad.pow(2).sum() for p in scheduler.sharded_params() if p.sharded.grad is not None)
    sharded_sq = sharded_sq.clone()
    torch.distributed.all_reduce(sharded_sq)
    own_sq = sum(p.grad.pow(2).sum() for p in model.encoder.parameters())
    total = scheduler.clip_grad_norm_(1e9)  # no clipping, just the norm
    optimizer.step()
    saved = {"model": full_state_dict(model), "optim": full_optimizer_state_dict(model, optimizer)}
    save_folder(Path(folder), model, [optimizer], {})
    torch.manual_seed(1)
    fresh = EncodedLM()
    with pytest.warns(UserWarning):
        shard_model(fresh, auto_wrap_policy={Block}, ignored_modules=[fresh.encoder])
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    load_folder(Path(folder), fresh, [fresh_optimizer])
    errors = []
    for ignored in (lambda m: [m], lambda m: [nn.Linear(2, 2)]):
        other = EncodedLM()
        try:
            shard_model(other, ignored_modules=ignored(other))
        except ValueError as error:
            errors.append(str(error))
    return {
        "norm": total.item(),
        "expected_norm": (sharded_sq + own_sq).sqrt().item(),
        "norm_buffer_dtype": model.encoder.norm.running_mean.dtype,
        "saved": saved,
        "loaded": {"model": full_state_dict(fresh), "optim": full_optimizer_state_dict(fresh, fresh_optimizer)},
        "errors": errors,
    }


def test_ignored_parameters_clip_and_checkpoint_whole(tmp_path):
    result = run_ranks(_trainable_body, 2, tmp_path, str(tmp_path / "ckpt"))[0]
    assert result["norm"] == pytest.approx(result["expected_norm"], rel=1e-5)  # FSDP1: their local norm counts
    assert result["norm_buffer_dtype"] == torch.float32  # no buffer_dtype cast below an ignored module
    _assert_same_state(result["loaded"], result["saved"])
    assert any("not a submodule of the model" in e for e in result["errors"])
    assert any("is the model itself" in e for e in result["errors"])
