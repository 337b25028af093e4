"""The strategies' Lightning-level arguments: the budget of ``auto_wrap_policy="auto"``, weight
averaging callbacks, activation checkpointing with Lightning's warning, and ``StrategyArguments``,
the part both strategies share that keeps their checked options under Lightning's names. Every
option itself is checked in ``options.py`` (no Lightning), with what the memory plan checks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from fsdp_strategy.options import (
    FSDP_KEYWORDS,
    OPTION_NAMES,
    StrategyOptions,
    check_auto_choices,
    check_parallel_sizes,
    options_from,
)
from fsdp_strategy.wrap import already_checkpointed, apply_activation_checkpointing

if TYPE_CHECKING:
    from fsdp_strategy.config import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy


def apply_recomputation(model: torch.nn.Module, policy: Any) -> None:
    """``activation_checkpointing_policy`` applied to ``model`` as Lightning's FSDP applies it: a
    model that already holds checkpointed layers gets Lightning's warning and is left as it is
    (they would be recomputed twice)."""
    from lightning.fabric.utilities.rank_zero import rank_zero_warn

    if already_checkpointed(model):
        rank_zero_warn(
            "FSDP checkpointing is configured, but the model already contains checkpointed layers."
            " Checkpointing will be ignored."
        )
        return
    apply_activation_checkpointing(model, policy)


def refuse_whole_model_averaging(callbacks: list) -> None:
    """Raise for ``StochasticWeightAveraging`` and for more than one ``WeightAveraging``.

    SWA deep-copies the whole unsharded module before the strategy shards it and, at its end,
    runs an extra epoch of forward passes through its own copy to recompute BatchNorm statistics:
    both need every parameter on every rank. ``WeightAveraging`` (EMA, or SWA's average with
    ``avg_fn=get_swa_avg_fn()``) averages each rank's shards instead ([Note: sharded weight
    averaging] in averaging.py); two of them would overwrite each other's checkpoint entries."""
    from lightning.pytorch.callbacks import StochasticWeightAveraging, WeightAveraging
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    if any(isinstance(c, StochasticWeightAveraging) for c in callbacks):
        raise MisconfigurationException(
            "StochasticWeightAveraging cannot work with the fsdp_custom strategy: it copies the whole unsharded model "
            "and recomputes BatchNorm statistics with forward passes through that copy, while each rank holds only "
            "its shard of the parameters. Use lightning.pytorch.callbacks.WeightAveraging(avg_fn=get_swa_avg_fn()) "
            "from torch.optim.swa_utils: it averages each rank's shards (with your own BatchNorm update, if needed)"
        )
    averaging = [type(c).__name__ for c in callbacks if isinstance(c, WeightAveraging)]
    if len(averaging) > 1:
        raise MisconfigurationException(
            f"fsdp_custom supports one WeightAveraging callback at a time, got {averaging}: each writes the "
            "checkpoint's state_dict"
        )


# name -> (description, arguments): what both strategies register with their registries
STRATEGY_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "fsdp_custom": ("FSDP with the fsdp-strategy engine (FULL_SHARD)", {}),
    "fsdp_custom_cpu_offload": ("fsdp_custom with CPU offload", {"cpu_offload": True}),
    "fsdp_custom_shard_grad_op": ("fsdp_custom, SHARD_GRAD_OP", {"sharding_strategy": "SHARD_GRAD_OP"}),
    "fsdp_custom_no_shard": ("fsdp_custom, NO_SHARD (replicated, like DDP)", {"sharding_strategy": "NO_SHARD"}),
}


_KEPT_BY_PLAN = ("sharding_strategy", "mixed_precision", "forward_prefetch", "backward_prefetch", "device_mesh")


class BudgetRequest(NamedTuple):
    """``auto_wrap_policy="auto"``: the settings are chosen by a memory plan ([Note: wrapping by
    budget] in ``plan/budget.py``) within ``budget`` bytes per rank, on one ``example_batch``."""

    budget: int
    example_batch: Any
    reserve: int | None = None  # [Note: memory reserve]; None: the default

    @classmethod
    def from_arguments(cls, arguments: Mapping[str, Any]) -> BudgetRequest | None:
        """The request in a strategy's arguments, or None; a clear error for a half-given one."""
        from fsdp_strategy.plan.result import parse_bytes

        auto = isinstance(arguments["auto_wrap_policy"], str) and arguments["auto_wrap_policy"] == "auto"
        budget, batch = arguments.get("memory_budget"), arguments.get("example_batch")
        reserve = arguments.get("memory_reserve")
        if not auto:
            if budget is not None or batch is not None or reserve is not None:
                raise ValueError(
                    "memory_budget, memory_reserve and example_batch are read with auto_wrap_policy='auto' only"
                )
            return None
        if "memory_budget" not in arguments:
            raise ValueError(
                "auto_wrap_policy='auto' chooses settings before Trainer.fit creates the process group; in Fabric "
                "call fsdp_strategy.plan(model, batch, world_size=..., auto_wrap_policy='auto', memory_budget=...) "
                "before fabric.launch() and pass its plan.strategy_kwargs to the strategy"
            )
        if budget is None or batch is None:
            raise ValueError(
                "auto_wrap_policy='auto' needs memory_budget (bytes per rank, e.g. '70GiB') and example_batch (one "
                f"batch as training_step receives it; meta tensors work), got memory_budget={budget!r}"
            )
        check_auto_choices(arguments)
        return cls(
            parse_bytes(budget), batch, None if reserve is None else parse_bytes(reserve, "memory_reserve", True)
        )

    def choose(self, model: Any, world_size: int, num_nodes: int, precision: str, given: dict[str, Any]) -> Any:
        """The MemoryPlan of the fastest settings that fit (every rank computes the same one)."""
        from fsdp_strategy.plan import plan

        kept = {name: given[name] for name in _KEPT_BY_PLAN if name in given}
        return plan(
            model,
            self.example_batch,
            world_size=world_size,
            num_nodes=num_nodes,
            precision=precision,
            auto_wrap_policy="auto",
            memory_budget=self.budget,
            memory_reserve=self.reserve,
            **kept,
        )


class StrategyArguments:
    """The constructor arguments both strategies (Trainer and Fabric) take, checked once, kept
    under Lightning's names (read-only views of the sharding options) and private ones."""

    fsdp_keywords: tuple[str, ...] = tuple(FSDP_KEYWORDS)  # taken through **kwargs, as Lightning's FSDPStrategy

    def _choose_by_budget(self, model: Any, world_size: int, num_nodes: int, precision: str) -> Any:
        """``auto_wrap_policy="auto"``: plan, then take the chosen units, checkpointing, sharding
        strategy and offload as if given; returns the MemoryPlan. Costs: a few plans (seconds
        each for small models; see ``fsdp_strategy.plan``), on every rank alike."""
        assert self._budget is not None
        chosen = self._budget.choose(model, world_size, num_nodes, precision, self._given_options)
        arguments = {**self._given_options, **chosen.strategy_kwargs}
        self._options = options_from(arguments)
        self.activation_checkpointing_policy = chosen.strategy_kwargs.get("activation_checkpointing_policy")
        self._budget = None
        return chosen

    def _take_arguments(self, arguments: Mapping[str, Any], async_save: bool = False) -> None:
        """Check ``arguments`` (the constructor's ``locals()``) and keep them; a bad one raises
        naming the argument, the value and what is accepted."""
        self._budget = BudgetRequest.from_arguments(arguments)
        if self._budget is not None:
            arguments = {**arguments, "auto_wrap_policy": None}  # chosen before the model is sharded
        checked = StrategyOptions.from_arguments({**StrategyOptions.split(arguments)[0], "async_save": async_save})
        self._options = checked.sharding
        self._given_options = {name: arguments[name] for name in (*OPTION_NAMES, "device_mesh")}
        self.activation_checkpointing_policy = checked.activation_checkpointing_policy
        self._state_dict_type = checked.state_dict_type
        self._device_mesh = checked.device_mesh
        self._process_group_backend = checked.process_group_backend
        self._timeout = checked.timeout

    def _parallel_sizes(self, data_parallel_size: Any, tensor_parallel_size: Any) -> tuple | None:
        """The sizes of a 2-D run as given (None: 1-D), checked against the other arguments."""
        hybrid, budget = self.sharding_strategy.hybrid, self._budget is not None
        return check_parallel_sizes(data_parallel_size, tensor_parallel_size, hybrid, self._device_mesh, budget)

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(vars(StrategyArguments).get(name), property):  # an option: read-only
            raise AttributeError(
                f"{type(self).__name__}.{name} is read-only: pass {name}=... to {type(self).__name__}(...), "
                "where it is checked with the other options"
            )
        super().__setattr__(name, value)

    # ---- the checked sharding options, under Lightning's names (read-only) ---------------

    @property
    def sharding_strategy(self) -> ShardingStrategy:
        """How parameters, gradients and optimizer state are split (Lightning's name)."""
        return self._options.sharding_strategy

    @property
    def auto_wrap_policy(self) -> Any:
        """The wrap policy as given: which modules become units."""
        return self._options.auto_wrap_policy

    @property
    def mixed_precision(self) -> MixedPrecision | None:
        """The dtypes units gather, compute and reduce in; None: the precision plugin's."""
        return self._options.mixed_precision

    @property
    def cpu_offload(self) -> CPUOffload:
        """Whether shards, their gradients and optimizer state live in host memory."""
        return self._options.cpu_offload

    @property
    def param_init_fn(self) -> Any:
        """How parameters on the meta device are materialized, unit by unit."""
        return self._options.param_init_fn

    @property
    def forward_prefetch(self) -> bool:
        """Whether the next unit's all-gather is issued during this one's forward."""
        return self._options.forward_prefetch

    @property
    def backward_prefetch(self) -> BackwardPrefetch | None:
        """When the next unit's all-gather is issued in backward."""
        return self._options.backward_prefetch

    @property
    def sync_module_states(self) -> bool:
        """Whether rank 0's weights are broadcast before sharding."""
        return self._options.sync_module_states

    @property
    def ignored_modules(self) -> tuple[torch.nn.Module, ...] | None:
        """Modules left unsharded (replicated, reduced as DDP would)."""
        return self._options.ignored_modules

    @property
    def collective_timeout(self) -> float | None:
        """Seconds a collective may wait before the watchdog ends the job; None: the group's."""
        return self._options.collective_timeout

    @property
    def check_collective_order(self) -> bool:
        """Whether collectives carry order stamps that every rank checks."""
        return self._options.check_collective_order

    @property
    def optimizer_updates(self) -> dict | None:
        """Optimizer classes declared elementwise or whole-matrix, instead of measured."""
        return self._options.optimizer_updates
