"""Loud misuse: computing with sharded parameters outside a gathered state raises; the model
is gathered for such code with ``summon_full_params`` (optionally writing changes back)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from dist_utils import run_ranks
from oracle import weight_error
from pattern_models import VOCAB, Dense, MLPBlock
from torch import nn

from fsdp_strategy import MixedPrecision, summon_full_params
from fsdp_strategy.checkpoint import full_state_dict
from fsdp_strategy.engine import get_scheduler, shard_model


def _greedy(model: Dense, tokens: torch.Tensor, steps: int) -> torch.Tensor:
    """A generate() that calls submodules directly, outside the model's forward."""
    for _ in range(steps):
        logits = model.head(model.features(tokens))
        tokens = torch.cat([tokens, logits[:, -1:].argmax(-1)], dim=1)
    return tokens


def _misuse_body(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = Dense()
    reference = copy.deepcopy(model)
    shard_model(model, auto_wrap_policy={MLPBlock, nn.Embedding})
    tokens = torch.randint(0, VOCAB, (2, 3), generator=torch.Generator().manual_seed(1))
    out = {"errors": []}
    for call in (lambda: model.blocks[0].up(torch.randn(1, 8)), lambda: _greedy(model, tokens, 2)):
        try:
            call()
        except RuntimeError as error:
            out["errors"].append(str(error))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad(), summon_full_params(model):
            out["generated"] = _greedy(model, tokens, 4)
            out["logits"] = model(tokens)  # a forward inside: nothing gathered again or freed
        out["read_only"] = [str(w.message) for w in caught]
        with torch.no_grad(), summon_full_params(model):
            model.head.weight.add_(1.0)  # without writeback: discarded, and said
        out["not_written_back"] = [str(w.message) for w in caught][len(out["read_only"]) :]
    out["reference"] = _greedy(reference, tokens, 4)
    out["ref_logits"] = reference(tokens).detach()
    out["unchanged"] = weight_error(model, reference)
    with summon_full_params(model, writeback=True):
        with torch.no_grad():
            model.head.weight.add_(1.0)
            model.blocks[0].up.weight.mul_(2.0)
    with torch.no_grad():
        reference.head.weight.add_(1.0)
        reference.blocks[0].up.weight.mul_(2.0)
    out["written_back"] = weight_error(model, reference)
    out["resharded"] = all(not p.unsharded_allocated for p in get_scheduler(model).sharded_params())
    try:
        with summon_full_params(model):
            with summon_full_params(model):  # nested: fine
                pass
            model.blocks[0].up(torch.randn(1, 8))  # still gathered
    except RuntimeError as error:
        out["errors"].append(str(error))
    bf16 = shard_model(Dense(), mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))
    try:
        with summon_full_params(bf16, writeback=True):
            pass
    except ValueError as error:
        out["writeback_error"] = str(error)
    return out


def test_sharded_modules_refuse_to_run_and_summon_gathers_them(tmp_path):
    for result in run_ranks(_misuse_body, 2, tmp_path):
        assert len(result["errors"]) == 2, result["errors"]  # the nested summon case raised nothing
        assert "'blocks.0.up'" in result["errors"][0] and "summon_full_params" in result["errors"][0]
        assert "'norm'" in result["errors"][1]  # features() runs the units, then the root's norm
        assert torch.equal(result["generated"], result["reference"])
        torch.testing.assert_close(result["logits"], result["ref_logits"], rtol=1e-5, atol=1e-6)
        assert result["unchanged"] < 1e-7  # changes inside summon without writeback do not reach the shards
        assert not [line for line in result["read_only"] if "fsdp_custom" in line], result["read_only"]
        told = " ".join(result["not_written_back"])
        assert "without writeback=True are discarded on exit: head.weight." in told, told
        assert result["written_back"] < 1e-7  # with writeback they do, exactly
        assert result["resharded"]
        assert "param_dtype" in result["writeback_error"] and " more are gathered" in result["writeback_error"]


def test_summon_inside_forward_is_refused():
    class Root(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(2, 2)

        def forward(self, x):
            with summon_full_params(self):
                return self.layer(x)

    model = shard_model(Root())
    with pytest.raises(RuntimeError, match="outside forward and backward"):
        model(torch.randn(1, 2))
    assert model.layer.weight.shape == (2, 2)  # world of one: the shard is the whole tensor
    assert set(full_state_dict(model)) == {"layer.weight", "layer.bias"}  # the failed forward left it usable


def _stale_optimizer_body(rank: int, world: int) -> dict:
    """An optimizer created before sharding (it holds the model's old parameters) is refused at its
    first step, instead of stepping tensors the model no longer uses; one created after steps."""
    from lightning.fabric import Fabric

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    early = torch.optim.SGD(model.parameters(), lr=0.1)
    shard_model(model, auto_wrap_policy={nn.Linear})
    model(torch.randn(3, 4)).sum().backward()
    told = {}
    try:
        early.step()
    except RuntimeError as error:
        told["engine"] = str(error)
    torch.optim.SGD(model.parameters(), lr=0.1).step()  # created after sharding: fine
    get_scheduler(model).close()

    fabric = Fabric(strategy="fsdp_custom", accelerator="cpu", devices=world)
    fabric.launch()
    net = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(net.parameters()))  # the wrong order
    net = fabric.setup_module(net)
    fabric.backward(net(torch.randn(3, 4)).sum())
    try:
        optimizer.step()
    except RuntimeError as error:
        told["fabric"] = str(error)
    return told


def test_an_optimizer_created_before_sharding_is_refused(tmp_path):
    from test_strategy import LIGHTNING_ENV

    told = run_ranks(_stale_optimizer_body, 2, tmp_path, env=LIGHTNING_ENV)[0]
    assert "SGD holds 4 parameters of the model from before it was sharded (0.weight, 0.bias, 1.weight" in told.get(
        "engine", ""
    ), told
    assert "AdamW holds 4 parameters" in told.get("fabric", "") and "fabric.setup(model, optimizer)" in told["fabric"]


def test_clipping_by_a_norm_the_shards_cannot_add_up_is_refused_before_any_change():
    """``norm_type`` 0, negative and -inf are not sums or maxima over shards (-inf gave 1.0 where torch
    gives the smallest gradient; 0 raised ZeroDivisionError): a clear error, the gradients unchanged.
    A non-finite norm with ``error_if_nonfinite`` (Fabric's default) raises before clipping, as torch's."""
    model = shard_model(nn.Linear(3, 2))
    model(torch.randn(4, 3)).square().sum().backward()
    before = [p.grad.clone() for p in model.parameters()]
    for norm_type in (0, -1.0, float("-inf"), float("nan")):
        with pytest.raises(ValueError, match=f"norm_type={float(norm_type)!r}: accepted: a positive number or inf"):
            get_scheduler(model).clip_grad_norm_(1.0, norm_type)
    assert all(torch.equal(p.grad, old) for p, old in zip(model.parameters(), before))
    expected = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()], 3.0)
    assert torch.allclose(get_scheduler(model).clip_grad_norm_(1e6, 3.0), expected)
    model.weight.grad[0, 0] = float("inf")  # torch's error_if_nonfinite: raised before any gradient changes
    before = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="non-finite, so it cannot be clipped"):
        get_scheduler(model).clip_grad_norm_(1.0, error_if_nonfinite=True)
    assert all(torch.equal(p.grad, old) for p, old in zip(model.parameters(), before))
