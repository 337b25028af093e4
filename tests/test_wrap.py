"""Wrap policies: which modules become units, and errors for policies of the wrong kind."""

from __future__ import annotations

import functools

import pytest
import torch
from models import Block, TiedLM, lm_loss, make_batches
from torch import nn
from torch.distributed.fsdp.wrap import ModuleWrapPolicy, size_based_auto_wrap_policy

from fsdp_strategy.engine import get_scheduler, shard_model
from fsdp_strategy.engine.init import meta_tensor_names
from fsdp_strategy.wrap import apply_activation_checkpointing, as_policy_fn, select_unit_modules


def _names(model: nn.Module, policy) -> list[str]:
    names = {id(m): n for n, m in model.named_modules()}
    return [names[id(m)] for m in select_unit_modules(model, as_policy_fn(policy))]


def test_class_set_int_callable_and_torch_policies_agree():
    model = TiedLM()
    blocks = ["blocks.0", "blocks.1", "skipped"]
    assert _names(model, {Block}) == blocks
    assert _names(model, ModuleWrapPolicy({Block})) == blocks
    assert _names(model, lambda module, recurse, numel: recurse or isinstance(module, Block)) == blocks
    torch_size = functools.partial(size_based_auto_wrap_policy, min_num_params=300)
    assert _names(model, 300) == _names(model, torch_size)
    assert _names(model, None) == []
    for dotted in ("models.Block", ["models.Block"], {"models.Block"}, ("models.Block",)):  # as YAML/CLI give them
        assert _names(model, dotted) == blocks, dotted


@pytest.mark.parametrize("policy", ["Block", {"Block"}, True, 0, [Block, "x"], 2.5, [3], "nope.Block"])
def test_bad_policy_names_argument_and_value(policy):
    with pytest.raises((TypeError, ValueError), match="auto_wrap_policy=") as error:
        as_policy_fn(policy)
    if isinstance(policy, (str, set)):  # a name that is not an importable dotted path says what is
        assert "dotted" in str(error.value)


def test_tied_parameter_goes_to_lowest_common_unit_and_names_are_kept():
    model = TiedLM()
    names_before = [n for n, _ in model.named_parameters()]
    shard_model(model, auto_wrap_policy={Block, nn.Embedding})
    scheduler = get_scheduler(model)
    owner = {p.fqn: unit.name for unit in scheduler.units for p in unit.params}
    assert owner["embed.weight"] == "root"  # used by embed and head: hoisted to their common unit
    assert owner["blocks.0.up.weight"] == "blocks.0"
    assert [n for n, _ in model.named_parameters()] == names_before
    assert model.head.weight is model.embed.weight


def test_meta_device_model_is_materialized_or_rejected():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    shard_model(model, auto_wrap_policy={nn.Linear})
    assert meta_tensor_names(model) == []
    assert model(torch.ones(1, 4)).shape == (1, 2)

    class Custom(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.empty(3))

    with torch.device("meta"):
        bad = Custom()
    with pytest.raises(ValueError, match=r"cannot initialize \['weight'\] from the meta device"):
        shard_model(bad)


def test_activation_checkpointing_recomputes_and_keeps_names():
    model = TiedLM()
    names_before = [n for n, _ in model.named_parameters()]
    chosen = apply_activation_checkpointing(model, {Block})
    assert len(chosen) == 3
    shard_model(model, auto_wrap_policy={Block})
    calls = []
    model.blocks[0].up.register_forward_pre_hook(lambda module, args: calls.append(torch.is_grad_enabled()))
    lm_loss(model, make_batches(1, 2)[0]).backward()
    assert len(calls) == 2  # the forward, then its recomputation during backward
    assert [n for n, _ in model.named_parameters()] == names_before
    assert model.blocks[0].up.weight.grad is not None
