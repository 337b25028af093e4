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
    under Lightning's names (read-only views of the sharding options) and private ones. Every bad
    value is refused when the strategy is constructed with an error naming the argument, the value
    and what is accepted. The arguments, as ``FSDPCustomStrategy`` takes them
    (``FSDPCustomFabricStrategy``'s differences are on its own page). What ``sharding_strategy``
    shards, and what it costs per step:

    | `sharding_strategy` | parameters | gradients, optimizer state | per step |
    |---|---|---|---|
    | `"FULL_SHARD"` (default) | sharded: gathered per unit, freed after use | sharded | 2 all-gathers, reduce-scatter |
    | `"SHARD_GRAD_OP"` | sharded: gathered in forward, kept until backward | sharded | all-gather, reduce-scatter |
    | `"NO_SHARD"` | replicated (nothing gathered or copied) | replicated | all-reduce, as DDP |
    | `"HYBRID_SHARD"` | FULL_SHARD in a shard group, replicated across | the same | + all-reduce across |
    | `"_HYBRID_SHARD_ZERO2"` | SHARD_GRAD_OP in a shard group, replicated across | the same | + all-reduce across |

    Costs: per rank, 1/N of parameters, gradients and optimizer state at rest, plus the units
    gathered at the moment (the running one, the root and one prefetched).

    Args:
        accelerator: set by the Trainer (``Trainer(accelerator=...)``).
        parallel_devices: set by the Trainer (``devices`` and ``num_nodes`` set the world size).
        cluster_environment: set by the Trainer (Lightning's, torchrun's, SLURM's).
        checkpoint_io: Lightning's ``CheckpointIO`` for full checkpoints; sharded ones are written
            by torch's distributed checkpoint.
        precision_plugin: set from ``Trainer(precision=...)`` or ``plugins=[...]``: Lightning's
            ``Precision``, ``MixedPrecision``, ``HalfPrecision`` and ``FSDPPrecision`` are converted
            by their precision name (a ``GradScaler`` becomes a ``ShardedGradScaler`` with the same
            settings); any other plugin is a ``TypeError`` naming it, since its behaviour would be lost.
        process_group_backend: ``"gloo"``, ``"nccl"``, ``"cpu:gloo,cuda:nccl"``; default: by
            device; checked against the backends torch knows. On an accelerator the process group is
            created with ``device_id``, so NCCL binds it at once.
        timeout: a positive ``timedelta`` for every collective of the process group (default: 30
            minutes, Lightning's; None: torch's), so that a rank that dies makes the others fail
            after it instead of hanging.
        cpu_offload: ``True`` or ``CPUOffload(offload_params=True)`` (or
            ``strategy="fsdp_custom_cpu_offload"``): shards, gradients and optimizer state live in CPU
            memory (pinned, on CUDA); each unit is copied to the device before its all-gather, reduced
            gradients are copied back, and the optimizer steps on the CPU.
        mixed_precision: ``MixedPrecision(param_dtype, reduce_dtype, buffer_dtype)``, torch's
            ``MixedPrecision`` or a dict such as ``{"param_dtype": "bf16"}``. Shards stay in their
            dtype (fp32 master weights); units are all-gathered in ``param_dtype`` (half the bytes for
            bf16), gradients reduced in ``reduce_dtype`` (default: the shard's dtype), buffers cast to
            ``buffer_dtype``, and floating-point inputs of the root's forward cast to ``param_dtype``.
            Takes precedence over the one derived from ``Trainer(precision=...)``.
        auto_wrap_policy: which modules become units (one all-gather and one reduce-scatter each):
            a set of classes (``{Block}``), an int (the minimum parameter count not yet in a unit), a
            callable ``(module, recurse, nonwrapped_numel) -> bool``, or torch's policy objects
            (``ModuleWrapPolicy({Block})``). ``None`` (default): the whole model is one unit. Finer
            units lower peak memory and cost more collectives; the root is always a unit for what no
            other unit holds. Tied parameters go to the lowest unit containing every module that uses
            them; frozen ones are sharded but never reduced. ``"auto"`` (with ``memory_budget`` and
            ``example_batch``): the units, activation checkpointing per block, FULL_SHARD or
            SHARD_GRAD_OP and CPU offload are chosen by a memory plan before the process group is
            created: the fastest that fits, printed with why (costs a few plans on every rank).
        activation_checkpointing: Lightning's older form of ``activation_checkpointing_policy``:
            a class or a list of classes.
        activation_checkpointing_policy: modules whose activations are recomputed in backward
            instead of stored, in the forms of ``auto_wrap_policy``, or ``ModuleNames(["blocks.0"])``
            (``fsdp_strategy.wrap``: by qualified name; a name the model lacks is an error). Parameter
            names do not change. On a model that already has checkpointed layers: a warning, and the
            policy is ignored (as Lightning).
        sharding_strategy: what is sharded (the table above): a name in any case, our
            ``ShardingStrategy`` or torch's.
        state_dict_type: ``"full"`` (default: one file in Lightning's layout, gathered unit by unit
            to rank 0) or ``"sharded"`` (a folder each rank writes its shards into; loads at any world
            size). See the checkpoints page.
        device_mesh: ``(replicate, shard)`` sizes or a 2-D ``DeviceMesh``, for the hybrid
            strategies; the product must equal ``num_nodes * devices``. Default there:
            ``(num_nodes, devices)``, one shard group per node (as FSDP1 and Lightning).
        async_save: sharded checkpoints are written in the background while training goes on.
        param_init_fn: ``(module) -> None``, called on each module that still has tensors on the
            meta device (``trainer.init_module(empty_init=True)``) to allocate and initialize them;
            default: ``reset_parameters()`` and the enclosing ``_init_weights`` (Hugging Face).
        forward_prefetch: issue the next unit's all-gather when a unit's forward starts, where both
            are called from the same module (default ``True``, unlike FSDP1's ``False``: the engine
            never holds more than one unit ahead, so it costs one unit of memory; never from the
            root, whose forward runs ``training_step``: [Note: no prefetch across user code]).
        backward_prefetch: ``"BACKWARD_PRE"`` (default: the next unit is gathered when a unit's
            backward starts), ``"BACKWARD_POST"`` (once its gradients are computed: less memory, less
            overlap) or ``None`` (only when backward reaches it). The numbers do not change.
        sync_module_states: every rank takes global rank 0's parameters and buffers before
            sharding (one broadcast per tensor at setup), for models initialized differently per rank.
        ignored_modules: modules whose parameters are not sharded, gathered or reduced (FSDP1's
            meaning): every rank keeps them whole, their gradients are the rank's own (a warning says
            so if any is trainable: freeze them or synchronize them yourself); saved whole, stepped by
            optimizers, counted locally by gradient clipping.
        collective_timeout: seconds or a ``timedelta`` one collective of the engine may wait before
            every rank stops with a report of where each rank was (default ``None``: ``timeout``, 30
            minutes unless set; ``math.inf``: no limit). A dead or raising rank stops the others at
            their next collective whatever this is; this bounds a hang. Barriers, broadcasts,
            Lightning's ``reduce`` and the checkpoint's gathers are left to ``timeout``.
        check_collective_order: stamp every collective (16 extra elements per rank) so that ranks
            issuing different ones (a unit called an extra time on one rank, a branch around a unit)
            stop at the first, both named, instead of mixing tensors or hanging (default ``True``;
            no cost measured beyond noise).
        optimizer_updates: ``{optimizer class or dotted path: "elementwise" | "whole_matrix"}``:
            how an optimizer the engine does not know updates a parameter. Elementwise ones (torch's
            SGD, Adam, AdamW, ...) step shards; whole-matrix ones (torch's Muon, Adafactor declared
            so, your own) step each matrix whole on one rank (about 5x the matrices' bytes over the
            shard group per step for Muon); an unknown one warns once; LBFGS is refused.
        memory_budget: bytes per rank for ``auto_wrap_policy="auto"`` (an int or ``"70GiB"``).
        memory_reserve: bytes of ``memory_budget`` the plan leaves for what it does not see (the CUDA
            context, NCCL's buffers, fragmentation; default: 2 GiB plus 5 % of the budget; 0: none).
        example_batch: one batch as ``training_step`` receives it, for ``"auto"`` (meta tensors work).
        data_parallel_size: with ``tensor_parallel_size``, a 2-D run as Lightning's
            ``ModelParallelStrategy``'s (the same names and meaning): the ranks over which the engine
            shards ("auto": the number of nodes). ``self.device_mesh`` of the LightningModule is the
            ``("data_parallel", "tensor_parallel")`` mesh in ``configure_model``, where you apply the
            tensor-parallel plan (``parallelize_module``); batches are sampled over "data_parallel".
            Both unset (default): one data-parallel dimension. See "Tensor parallel + FSDP".
        tensor_parallel_size: the ranks of a tensor-parallel group ("auto": the devices per node).
        **fsdp_kwargs: the FSDP keywords Lightning's ``FSDPStrategy`` passes to torch:
            ``use_orig_params=True`` and ``limit_all_gathers=True`` are what the engine always does;
            ``False``, ``process_group``, ``device_id`` and ``ignored_states`` are refused saying why.
    """

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
        if arguments.get("auto_wrap_policy") == "auto":  # refused with tensor parallel before the budget is read
            sizes = arguments.get("data_parallel_size"), arguments.get("tensor_parallel_size")
            check_parallel_sizes(*sizes, hybrid=False, device_mesh=None, budget=True)
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
