"""What code written for Lightning's ``FSDPStrategy`` reads of a strategy works on ours: the class
(``isinstance``), ``mixed_precision_config`` on the strategies and precision plugins for every
precision (Lightning's ``ThroughputMonitor`` reads it), Lightning's arguments and attributes, its
warning for layers already checkpointed, the contexts the precision plugins return (Lightning's own
types), and ``RuntimeError`` for a strict load that does not fit."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.plugins.precision.utils import _DtypeContextManager
from lightning.fabric.strategies import FSDPStrategy as FabricFSDPStrategy
from lightning.fabric.utilities.throughput import _plugin_to_compute_dtype
from lightning.pytorch.strategies import FSDPStrategy as TrainerFSDPStrategy
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from fsdp_strategy import (
    FSDPCustomFabricPrecision,
    FSDPCustomFabricStrategy,
    FSDPCustomPrecision,
    FSDPCustomStrategy,
    ShardingStrategy,
)

PRECISIONS = {  # precision -> (param, reduce, buffer) dtypes of mixed_precision_config
    "32-true": (torch.float32,) * 3,
    "bf16-true": (torch.bfloat16,) * 3,
    "16-true": (torch.float16,) * 3,
    "bf16-mixed": (torch.bfloat16, torch.float32, torch.bfloat16),
    "16-mixed": (torch.float16, torch.float32, torch.float16),
}


def test_both_strategies_are_lightnings_fsdp_strategy_and_lightning_builds_their_precision():
    trainer = L.Trainer(strategy="fsdp_custom", accelerator="cpu", devices=1, precision="bf16-mixed", logger=False)
    assert isinstance(trainer.strategy, TrainerFSDPStrategy) and isinstance(trainer.strategy, FSDPCustomStrategy)
    assert type(trainer.strategy.precision_plugin) is FSDPCustomPrecision  # Lightning's FSDPPrecision, converted
    fabric = Fabric(strategy="fsdp_custom", accelerator="cpu", devices=1, precision="bf16-true")
    assert isinstance(fabric.strategy, FabricFSDPStrategy) and isinstance(fabric.strategy, FSDPCustomFabricStrategy)
    assert type(fabric.strategy.precision) is FSDPCustomFabricPrecision
    # Lightning's GPU-only check of its own FSDP does not apply to ours: it runs on the CPU
    assert (
        FSDPCustomStrategy.get_registered_strategies()
        and "fsdp_custom" not in TrainerFSDPStrategy.get_registered_strategies()
    )


@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_mixed_precision_config_is_an_object_for_every_precision(precision):
    for plugin in (FSDPCustomPrecision(precision), FSDPCustomFabricPrecision(precision)):
        config = plugin.mixed_precision_config
        assert (config.param_dtype, config.reduce_dtype, config.buffer_dtype) == PRECISIONS[precision]
    fabric = Fabric(strategy="fsdp_custom", accelerator="cpu", devices=1, precision=precision)
    assert fabric.strategy.mixed_precision_config == fabric.strategy.precision.mixed_precision_config
    # what Lightning's ThroughputMonitor reads (LitGPT's scripts create one): no crash, the reduce dtype
    assert _plugin_to_compute_dtype(fabric.strategy.precision) == PRECISIONS[precision][1]
    trainer = L.Trainer(strategy="fsdp_custom", accelerator="cpu", devices=1, precision=precision, logger=False)
    assert trainer.strategy.mixed_precision_config.param_dtype == PRECISIONS[precision][0]


@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_forward_context_is_what_lightnings_fsdp_precision_returns(precision):
    """Lightning's ``test_fsdp_precision_forward_context_bf16``, for every precision, both plugins:
    ``torch.autocast`` on the plugin's device type for "*-mixed", ``_DtypeContextManager`` for "*-true"."""
    low = PRECISIONS[precision][0]
    for plugin in (FSDPCustomPrecision(precision), FSDPCustomFabricPrecision(precision)):
        context = plugin.forward_context()
        if precision.endswith("-mixed"):
            assert isinstance(context, torch.autocast) and (context.device, context.fast_dtype) == ("cpu", low)
            continue
        assert isinstance(context, _DtypeContextManager), type(context)
        assert isinstance(plugin.tensor_init_context(), _DtypeContextManager)
        assert isinstance(plugin.module_init_context(), _DtypeContextManager)
        with context:
            assert torch.get_default_dtype() == low
        assert torch.get_default_dtype() == torch.float32


def test_lightnings_attributes_are_there():
    strategy = FSDPCustomStrategy(sharding_strategy="SHARD_GRAD_OP", cpu_offload=True, limit_all_gathers=True)
    assert strategy.sharding_strategy.name == "SHARD_GRAD_OP" and strategy.cpu_offload.offload_params
    assert strategy.kwargs == {"use_orig_params": True, "limit_all_gathers": True} and strategy.mixed_precision is None
    fabric_strategy = FSDPCustomFabricStrategy(use_orig_params=True)
    assert fabric_strategy._fsdp_kwargs == {"use_orig_params": True}
    assert fabric_strategy.sharding_strategy.name == "FULL_SHARD" and not fabric_strategy.cpu_offload.offload_params


class Layered(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = checkpoint_wrapper(nn.Linear(4, 4))
        self.outer = nn.Linear(4, 4)


def test_checkpointing_a_model_already_checkpointed_warns_as_lightning_and_is_left_alone():
    from fsdp_strategy.arguments import apply_recomputation

    model = Layered()
    with pytest.warns(UserWarning, match="already contains checkpointed layers. Checkpointing will be ignored"):
        apply_recomputation(model, {nn.Linear})
    assert "forward" not in model.outer.__dict__  # not made to recompute: the model is as it was given


@pytest.mark.parametrize(
    ("ours", "lightnings"),
    [(FSDPCustomStrategy, TrainerFSDPStrategy), (FSDPCustomFabricStrategy, FabricFSDPStrategy)],
    ids=["Trainer", "Fabric"],
)
def test_every_method_of_lightnings_fsdp_strategy_is_overridden(ours, lightnings):
    """Nothing falls back to Lightning's FSDP1 code: every function, property and class or static
    method Lightning's FSDPStrategy defines is defined again on the way from ours to it."""
    kinds = (property, staticmethod, classmethod)
    defined = [name for name, member in vars(lightnings).items() if callable(member) or isinstance(member, kinds)]
    assert len(defined) > 20  # Lightning's FSDPStrategy itself, not an empty stand-in
    falling_back = [name for name in defined if next(k for k in ours.__mro__ if name in vars(k)) is lightnings]
    assert not falling_back, f"{ours.__name__} inherits these from Lightning's FSDPStrategy: {falling_back}"


def test_the_sharding_options_are_read_only_views_of_the_checked_ones():
    strategy = FSDPCustomStrategy(sharding_strategy="shard_grad_op", cpu_offload=True, forward_prefetch=False)
    assert strategy.sharding_strategy is ShardingStrategy.SHARD_GRAD_OP
    assert strategy.cpu_offload.offload_params is True and strategy.forward_prefetch is False
    with pytest.raises(AttributeError, match=r"sharding_strategy is read-only: pass sharding_strategy=\.\.\. to FSDP"):
        strategy.sharding_strategy = "NO_SHARD"
