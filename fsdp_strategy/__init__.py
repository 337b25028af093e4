"""fsdp-strategy: a Lightning strategy with its own Fully Sharded Data Parallel engine.

Importing this package registers "fsdp_custom" (and its variants) with Lightning's Trainer and
Fabric, so ``Trainer(strategy="fsdp_custom")`` and ``Fabric(strategy="fsdp_custom")`` work.
"""

from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

from fsdp_strategy.config import CPUOffload, MixedPrecision, ShardingStrategy
from fsdp_strategy.engine import summon_full_params
from fsdp_strategy.engine.muon_with_adamw import MuonWithAdamW
from fsdp_strategy.fabric import FSDPCustomFabricStrategy
from fsdp_strategy.plan import MemoryPlan, plan  # the function: fsdp_strategy.plan(...)
from fsdp_strategy.precision import FSDPCustomFabricPrecision, FSDPCustomPrecision
from fsdp_strategy.strategy import FSDPCustomStrategy

__all__ = [
    "CPUOffload",
    "FSDPCustomFabricPrecision",
    "FSDPCustomFabricStrategy",
    "FSDPCustomPrecision",
    "FSDPCustomStrategy",
    "MemoryPlan",
    "MixedPrecision",
    "MuonWithAdamW",
    "ShardingStrategy",
    "plan",
    "summon_full_params",
]
__version__ = "0.2.0"

FSDPCustomStrategy.register_strategies(StrategyRegistry)
FSDPCustomFabricStrategy.register_strategies(STRATEGY_REGISTRY)
