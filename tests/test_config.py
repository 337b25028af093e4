"""Configuration values: conversions from strings, dicts, omegaconf and torch's types; clear errors."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from torch.distributed.fsdp import CPUOffload as TorchCPUOffload
from torch.distributed.fsdp import MixedPrecision as TorchMixedPrecision
from torch.distributed.fsdp import ShardingStrategy as TorchShardingStrategy

from fsdp_strategy import CPUOffload, MixedPrecision, ShardingStrategy


@pytest.mark.parametrize(
    "value", ["FULL_SHARD", "full_shard", ShardingStrategy.FULL_SHARD, TorchShardingStrategy.FULL_SHARD]
)
def test_sharding_strategy_accepts_names_and_enums(value):
    assert ShardingStrategy.from_any(value) is ShardingStrategy.FULL_SHARD


def test_sharding_strategy_errors_name_value_and_choices():
    with pytest.raises(ValueError, match=r"sharding_strategy='ZERO9'.*FULL_SHARD.*HYBRID_SHARD"):
        ShardingStrategy.from_any("ZERO9")
    with pytest.raises(TypeError, match="sharding_strategy must be a string"):
        ShardingStrategy.from_any(3)
    with pytest.raises(ValueError, match=r"not supported \(did you mean 'FULL_SHARD'\?\); accepted") as misspelled:
        ShardingStrategy.from_any("FULL_SHRAD")
    assert "_HYBRID_SHARD_ZERO2" not in str(misspelled.value)  # a private member is not offered


def test_mixed_precision_conversions():
    expected = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    assert MixedPrecision.from_any({"param_dtype": "bf16", "reduce_dtype": "float32"}) == expected
    assert MixedPrecision.from_any(OmegaConf.create({"param_dtype": "bfloat16", "reduce_dtype": "fp32"})) == expected
    assert MixedPrecision.from_any(TorchMixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)) == (
        expected
    )
    assert MixedPrecision.from_any(None) is None


def test_mixed_precision_errors():
    with pytest.raises(ValueError, match="mixed_precision.param_dtype='int8' is not a known dtype"):
        MixedPrecision.from_any({"param_dtype": "int8"})
    with pytest.raises(ValueError, match="not a floating dtype"):
        MixedPrecision(param_dtype=torch.int32)
    with pytest.raises(ValueError, match=r"unknown keys \['param'\]"):
        MixedPrecision.from_any({"param": "bf16"})
    with pytest.raises(TypeError, match="mixed_precision must be"):
        MixedPrecision.from_any("bf16")


def test_cpu_offload_conversions_and_errors():
    assert CPUOffload.from_any(True) == CPUOffload(offload_params=True)
    assert CPUOffload.from_any(None) == CPUOffload(offload_params=False)
    assert CPUOffload.from_any(TorchCPUOffload(offload_params=True)).offload_params
    assert CPUOffload.from_any({"offload_params": True}).offload_params
    with pytest.raises(TypeError, match="cpu_offload must be a bool"):
        CPUOffload.from_any("yes")
    with pytest.raises(TypeError, match="offload_params must be a bool"):
        CPUOffload(offload_params="yes")


def test_the_plan_refuses_what_the_strategies_refuse_without_building_one():
    """``StrategyOptions`` is the one check: the Trainer strategy, Fabric's and the memory plan raise
    the same error for the same bad argument; the defaults a plan assumes are the Trainer's."""
    import dataclasses
    import inspect

    from fsdp_strategy import FSDPCustomFabricStrategy, FSDPCustomStrategy
    from fsdp_strategy.options import STRATEGY_DEFAULTS, ShardingOptions, StrategyOptions
    from fsdp_strategy.plan import plan

    model, batch = torch.nn.Linear(4, 4), torch.zeros(2, 4)
    for bad in (
        {"state_dict_type": "bogus"},
        {"sharding_strategy": "ZERO9"},
        {"device_mesh": (2, 2), "sharding_strategy": "FULL_SHARD"},
        {"collective_timeout": -1},
        {"activation_checkpointing": [int]},
        {"use_orig_params": False},
        {"auto_wrap_polcy": {torch.nn.Linear}},
    ):
        told = []
        for build, args in (
            (FSDPCustomStrategy, ()),
            (FSDPCustomFabricStrategy, ()),
            (plan, (model, batch)),
        ):
            extra = {"world_size": 2} if build is plan else {}
            with pytest.raises((TypeError, ValueError)) as error:
                build(*args, **extra, **bad)
            message = str(error.value).replace("FSDPCustomFabricStrategy", "FSDPCustomStrategy")
            told.append(message.split(" Accepted:")[0])  # each lists its own arguments
        assert len(set(told)) == 1, (bad, told)
    signature = inspect.signature(FSDPCustomStrategy.__init__).parameters
    defaults = {f.name: f.default for f in dataclasses.fields(ShardingOptions)} | STRATEGY_DEFAULTS
    differ = {name: (value, signature[name].default) for name, value in defaults.items() if name != "timeout"}
    differ = {
        name: pair
        for name, pair in differ.items()
        if StrategyOptions.from_arguments({name: pair[1]}) != (StrategyOptions.from_arguments({name: pair[0]}))
    }
    assert not differ, differ


def test_plan_accepts_lightnings_plumbing_and_refuses_what_auto_chooses_as_the_strategy_does():
    from fsdp_strategy import FSDPCustomStrategy
    from fsdp_strategy.plan import plan

    model, batch = torch.nn.Sequential(torch.nn.Linear(4, 4)), torch.zeros(2, 4)
    assert plan(model, batch, world_size=2, accelerator=None, cluster_environment=None).peak_bytes > 0
    with pytest.raises(ValueError, match="second argument"):
        plan(model, batch, world_size=2, example_batch=batch)
    auto = {"auto_wrap_policy": "auto", "memory_budget": "1GiB"}
    for chosen in ({"cpu_offload": True}, {"sharding_strategy": "SHARD_GRAD_OP"}, {"activation_checkpointing": [int]}):
        told = []
        with pytest.raises(ValueError) as error:
            FSDPCustomStrategy(**auto, example_batch=batch, **chosen)
        told.append(str(error.value))
        with pytest.raises(ValueError) as error:
            plan(model, batch, world_size=2, **auto, **chosen)
        told.append(str(error.value))
        assert told[0] == told[1] and "itself; drop" in told[0], told


def test_precision_rules_convert_a_batch_as_the_precision_plugins_do():
    """The memory plan converts inputs with ``planned_input`` (the engine's traversal and
    ``PrecisionRules``' dtype), training by Lightning's ``convert_input``: the same dtypes inside
    dicts, lists, named tuples and dataclasses."""
    import dataclasses
    from collections import OrderedDict, defaultdict
    from typing import NamedTuple

    from fsdp_strategy import FSDPCustomPrecision
    from fsdp_strategy.config import PrecisionRules
    from fsdp_strategy.plan.copies import planned_input

    @dataclasses.dataclass
    class Batch:
        x: torch.Tensor
        rest: list

    class Pair(NamedTuple):
        a: torch.Tensor
        n: int

    batch = {
        "batch": Batch(torch.ones(2, dtype=torch.float64), [torch.ones(1), torch.arange(3)]),
        "pair": Pair(torch.ones(2), 3),
        "ordered": OrderedDict(k=torch.ones(1)),
        "default": defaultdict(list, {"q": torch.ones(1, dtype=torch.float16)}),
    }

    def leaves(data):
        return [
            data["batch"].x.dtype,
            data["batch"].rest[0].dtype,
            data["batch"].rest[1].dtype,
            data["pair"].a.dtype,
            type(data["pair"]),
            data["ordered"]["k"].dtype,
            type(data["ordered"]),
            data["default"]["q"].dtype,
            type(data["default"]),
        ]

    for precision in ("32-true", "16-true", "bf16-true", "16-mixed", "bf16-mixed"):
        ours, lightnings = (
            planned_input(batch, PrecisionRules(precision), torch.device("cpu")),
            FSDPCustomPrecision(precision).convert_input(batch),
        )
        assert leaves(ours) == leaves(lightnings), precision
