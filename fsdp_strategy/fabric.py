"""FSDPCustomFabricStrategy: ``Fabric(strategy="fsdp_custom")`` on the same engine and checkpoints.

It takes Fabric ``FSDPStrategy``'s arguments with the same names and meanings (and the engine's
own, as ``FSDPCustomStrategy`` does), shards each module at ``setup_module`` with
``shard_with_options``, points optimizers set up together with their module at its shards,
clips by the global norm of the shards, maps ``no_backward_sync`` to the engine's ``no_sync``,
and saves and loads Fabric's layouts through the checkpoint package: a sharded folder whose DCP
keys are the saved state's own names (``meta.pt`` for the rest), or one full file. No sharding
logic lives here.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack, nullcontext
from datetime import timedelta
from typing import Any, Literal

import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies import ParallelStrategy
from lightning.fabric.strategies.fsdp import FSDPStrategy as LightningFSDPStrategy
from lightning.fabric.strategies.fsdp import _move_torchmetrics_to_device
from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.fabric.utilities.types import _PATH, Optimizable, ReduceOp
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader

from fsdp_strategy.arguments import STRATEGY_VARIANTS, StrategyArguments, apply_recomputation
from fsdp_strategy.checkpoint.writer import CheckpointWriter
from fsdp_strategy.config import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy
from fsdp_strategy.distributed.tensor_parallel import ParallelMesh
from fsdp_strategy.engine import get_scheduler, is_sharded, shard_with_options
from fsdp_strategy.fabric_checkpoints import FabricCheckpoints
from fsdp_strategy.fabric_setup import NoBackwardSync, sharded_with_optimizers
from fsdp_strategy.options import check_fsdp_keywords
from fsdp_strategy.precision import FSDPCustomFabricPrecision
from fsdp_strategy.strategy_placement import PlacementNotice
from fsdp_strategy.strategy_preemption import FabricSigterm
from fsdp_strategy.strategy_processes import WatchedProcesses
from fsdp_strategy.strategy_watchdog import RunWatchdog

log = logging.getLogger(__name__)


class FSDPCustomFabricStrategy(StrategyArguments, WatchedProcesses, LightningFSDPStrategy):
    """Fabric strategy: Fully Sharded Data Parallel on this package's engine.

    A subclass of Fabric's ``FSDPStrategy`` (its constructor and FSDP1 machinery are not used:
    every method is this engine's), so code that asks ``isinstance(fabric.strategy, FSDPStrategy)``
    (LitGPT's ``load_checkpoint`` and ``initialize_weights``, Fabric itself) takes its FSDP branch,
    which works here.

    Costs: those of the engine; a joint ``setup(model, optimizer)`` rewrites the optimizer's
    parameter lists once.

    Args:
        precision: set from ``Fabric(precision=...)`` or ``plugins=[...]``, converted as the
            Trainer's ``precision_plugin`` is.
        state_dict_type: ``"sharded"`` (default, as Fabric's: a folder each rank writes its shards
            into; loads at any world size) or ``"full"`` (one file, gathered to rank 0).
        parallelize_fn: ``(module, device_mesh) -> module``, as Fabric's ``ModelParallelStrategy``
            takes it: applies your tensor-parallel plan to each module ``setup`` gets, on the
            ``("data_parallel", "tensor_parallel")`` mesh, before the engine shards it over
            "data_parallel" (a 2-D run; the sizes default to "auto"). Or apply the plan yourself on
            ``fabric.strategy.device_mesh`` before ``setup``.
        data_parallel_size: the "data_parallel" size of a 2-D run, as the Trainer's (and
            ``ModelParallelStrategy``'s): "auto" is the number of nodes.
        tensor_parallel_size: the "tensor_parallel" size of a 2-D run: "auto" is the devices per
            node.
        **fsdp_kwargs: the FSDP keywords Fabric's ``FSDPStrategy`` passes to torch, as the Trainer's.

    Every other argument has the name, default and meaning it has on
    [StrategyArguments][fsdp_strategy.arguments.StrategyArguments] (Fabric's ``FSDPStrategy`` takes the same);
    ``auto_wrap_policy="auto"`` is refused here: plan first with ``fsdp_strategy.plan`` and pass its
    ``strategy_kwargs``.
    """

    _launcher_class = _SubprocessScriptLauncher  # Fabric's

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        precision: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        cpu_offload: bool | CPUOffload | Any = None,
        mixed_precision: MixedPrecision | Any = None,
        auto_wrap_policy: Any = None,
        activation_checkpointing: type[nn.Module] | list[type[nn.Module]] | None = None,
        activation_checkpointing_policy: Any = None,
        sharding_strategy: str | ShardingStrategy | Any = "FULL_SHARD",
        state_dict_type: Literal["full", "sharded"] = "sharded",
        device_mesh: tuple[int, int] | Any = None,
        param_init_fn: Any = None,
        forward_prefetch: bool = True,
        backward_prefetch: str | BackwardPrefetch | Any = "BACKWARD_PRE",
        sync_module_states: bool = False,
        ignored_modules: list[nn.Module] | None = None,
        collective_timeout: float | timedelta | None = None,
        check_collective_order: bool = True,
        optimizer_updates: dict | None = None,
        parallelize_fn: Callable[[nn.Module, Any], nn.Module] | None = None,
        data_parallel_size: int | Literal["auto"] | None = None,
        tensor_parallel_size: int | Literal["auto"] | None = None,
        **fsdp_kwargs: Any,
    ) -> None:
        parameters = list(inspect.signature(FSDPCustomFabricStrategy.__init__).parameters)[1:-1]
        check_fsdp_keywords(fsdp_kwargs, parameters, owner=type(self).__name__)
        ParallelStrategy.__init__(  # not Fabric FSDPStrategy's: it builds FSDP1's arguments
            self,
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            precision=precision,
        )
        self._num_nodes = 1
        self._fsdp_kwargs = {"use_orig_params": True, **fsdp_kwargs}  # Fabric's name: the FSDP keywords honoured
        self._take_arguments(locals())
        if parallelize_fn is not None and data_parallel_size is None and tensor_parallel_size is None:
            data_parallel_size = tensor_parallel_size = "auto"  # ModelParallelStrategy(parallelize_fn)'s defaults
        self._parallel = ParallelMesh(self._parallel_sizes(data_parallel_size, tensor_parallel_size))
        self._parallelize_fn = parallelize_fn
        self._writer = CheckpointWriter()
        self._watch = RunWatchdog(self._writer)  # a watchdog per run: started at setup, closed at teardown
        self._checkpoints = FabricCheckpoints(self._writer, lambda: self._state_dict_type, self.broadcast)
        self._placement = PlacementNotice()  # how a whole-matrix optimizer places its parameters
        self._sigterm, self._said_preempted = FabricSigterm(), False  # ``preempted``
        self._backward_sync_control = NoBackwardSync()
        self._modules: list[nn.Module] = []  # every module this strategy sharded, closed at teardown

    # ---- Fabric plumbing ----------------------------------------------------------------

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def checkpoint_io(self) -> CheckpointIO:
        """Fabric's default ``CheckpointIO``: saves do not use it (the checkpoint package writes), its
        ``teardown`` is what Fabric calls (Fabric FSDPStrategy's raises here)."""
        return ParallelStrategy.checkpoint_io.fget(self)

    @checkpoint_io.setter
    def checkpoint_io(self, io: CheckpointIO | None) -> None:
        ParallelStrategy.checkpoint_io.fset(self, io)

    @property
    def mixed_precision_config(self) -> MixedPrecision:
        """The dtypes training runs in (Fabric's name; an object for every precision):
        ``mixed_precision`` if given, else the one derived from ``Fabric(precision=...)``."""
        return self.mixed_precision or self.precision.mixed_precision_config

    @property
    def precision(self) -> FSDPCustomFabricPrecision:
        plugin = self._precision
        return plugin if plugin is not None else FSDPCustomFabricPrecision("32-true")

    @precision.setter
    def precision(self, precision: Precision | None) -> None:
        self._precision = None if precision is None else FSDPCustomFabricPrecision.from_plugin(precision)

    @property
    def model(self) -> nn.Module | None:
        """The module set up last (the watchdog hooks attach to it)."""
        return self._modules[-1] if self._modules else None

    def setup_environment(self) -> None:
        """Set ranks, check the mesh against the world size, create the process group(s) and start the
        watchdog on them (strategy_processes.py)."""
        ParallelStrategy.setup_environment(self)  # not Fabric FSDPStrategy's (it creates the group its way)
        self._set_ranks_and_mesh_shape()
        self._open_process_groups(None)
        self.precision.attach(self.root_device.type)

    # ---- modules and optimizers -----------------------------------------------------------

    def setup_module(self, module: nn.Module) -> nn.Module:
        """Shard ``module`` (its full parameters are freed unit by unit as they are sharded)."""
        if is_sharded(module):
            raise ValueError("this module is sharded already: set it up once")
        if self._parallelize_fn is not None:
            module = self._parallelize_fn(module, self._parallel.mesh)
            if not isinstance(module, nn.Module):
                raise TypeError(
                    f"The `parallelize_fn` must return a `nn.Module` instance, but got: {type(module).__name__} "
                    "(return the module it parallelized)"
                )
        if self.activation_checkpointing_policy is not None:
            apply_recomputation(module, self.activation_checkpointing_policy)
        mixed = self.mixed_precision or self.precision.engine_mixed_precision
        options = dataclasses.replace(self._options, mixed_precision=mixed)
        data_group = self._parallel.data_parallel_group
        shard_with_options(module, options, self.root_device, data_group, self._device_mesh, self._watch.dog)
        _move_torchmetrics_to_device(module, self.root_device)
        self._modules.append(module)
        return module

    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[Optimizer], scheduler: Any = None
    ) -> tuple[nn.Module, list[Optimizer], Any]:
        """Shard ``module`` and point each optimizer (created before, with no state yet) at its shards."""
        return sharded_with_optimizers(module, optimizers, self.setup_module), optimizers, scheduler

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Check that ``optimizer`` steps the shards (it was created after ``setup_module``)."""
        held = {id(p.sharded) for module in self._modules for p in get_scheduler(module).sharded_params()}
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if held and not any(id(p) in held for p in params):
            raise ValueError(
                "The optimizer does not seem to reference any sharded parameters. HINT: Make sure to create the "
                "optimizer after setting up the model (fabric.setup_module), or set both up together with fabric.setup"
            )
        return optimizer

    def _setup_distributed(self) -> None:
        """Fabric ``FSDPStrategy``'s hook: ranks and process group, as ``setup_environment`` makes them."""
        self.setup_environment()

    def _set_world_ranks(self) -> None:
        self.set_world_ranks()

    def module_to_device(self, module: nn.Module) -> None:
        """Nothing: ``setup_module`` moves each unit's shards to the device as it shards them."""

    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        """Create the model on the meta device (``empty_init``) or the CPU; ``setup_module``
        materializes (``reset_parameters`` or ``param_init_fn``) and shards it unit by unit."""
        stack = ExitStack()
        if empty_init:
            stack.enter_context(torch.device("meta"))
        stack.enter_context(self.precision.module_init_context())
        return stack

    def module_sharded_context(self) -> AbstractContextManager:
        """Nothing: modules are sharded at ``setup_module``, by the wrap policy."""
        return nullcontext()

    # ---- checkpoints: the part FabricCheckpoints (fabric_checkpoints.py) --------------------

    def process_dataloader(self, dataloader: DataLoader) -> DataLoader:
        """Fabric's DistributedSampler made resumable inside an epoch; its position is saved with it."""
        return self._checkpoints.process_dataloader(dataloader)

    def save_checkpoint(
        self, path: _PATH, state: dict[str, Any], storage_options: Any = None, filter: dict | None = None
    ) -> None:
        """Save as Fabric's FSDP does: "sharded" (a folder) or "full" (one file by rank 0), atomically."""
        self._checkpoints.save(path, state, storage_options, filter, self.is_global_zero)

    def load_checkpoint(
        self, path: _PATH, state: Any = None, strict: bool = True, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Load a sharded folder (any world size, ours, Fabric's or the Trainer's) or a full file into
        the state; returns what the state did not ask for."""
        return self._checkpoints.load(path, state, strict, weights_only)

    # ---- steps ------------------------------------------------------------------------------

    def backward(self, tensor: Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        """Backward; an exception is reported to the other ranks at once ([Note: watchdog])."""
        with self._watch.reported():
            super().backward(tensor, module, *args, **kwargs)

    def optimizer_step(self, optimizer: Optimizable, **kwargs: Any) -> Any:
        """Fabric's step, watched; after a whole-matrix optimizer's first, a line on its placement."""
        with self._watch.reported():
            result = super().optimizer_step(optimizer, **kwargs)
        self._placement.after_step(self.model, optimizer)
        return result

    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        """Clip ``optimizer``'s gradients by their global norm over every rank's shards (one
        all-reduce); returns the norm before clipping. ``module`` must have been set up here.
        ``error_if_nonfinite`` (Fabric's default) reads the norm on the host, as torch's
        ``clip_grad_norm_`` does: on CUDA a wait for the device at each call."""
        if not is_sharded(module):
            raise TypeError(
                f"Gradient clipping with {type(self).__name__} needs the module that fabric.setup returned, got "
                f"{type(module).__name__}"
            )
        self.precision.unscale_gradients(optimizer)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        return get_scheduler(module).clip_grad_norm_(max_norm, norm_type, params, error_if_nonfinite)

    def all_reduce(self, tensor: Tensor, group: Any = None, reduce_op: ReduceOp | str | None = "mean") -> Tensor:
        return self.reduce(tensor, group, reduce_op)

    def preempted(self) -> bool:
        """Whether any rank received SIGTERM (a preemption, a time limit, an eviction): True on every
        rank alike. Call it at the same place of every rank's loop, once per step; the first call
        installs a handler that only records the signal, so a loop that calls it saves and exits
        itself ([Note: preemption at an agreed step]). Costs: one 8-byte all-reduce on the CPU."""
        ranks = self._sigterm.agree(self.launcher, self._watch.dog)
        if ranks and not self._said_preempted and self.global_rank == 0:
            self._said_preempted = True
            log.warning("fsdp_custom: SIGTERM received by %d of %d ranks", ranks, self.world_size)
        return ranks > 0

    def teardown(self) -> None:
        """Finish any save in flight, close every sharded module's hooks and the watchdog."""
        self._sigterm.remove()
        self._writer.teardown()
        self._watch.close(self._modules)
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register "fsdp_custom" and its variants with Fabric."""
        for name, (description, init_params) in STRATEGY_VARIANTS.items():
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description=description, **init_params)
