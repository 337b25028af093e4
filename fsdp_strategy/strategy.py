"""FSDPCustomStrategy: Lightning glue around the engine. No sharding logic lives here.

It takes Lightning ``FSDPStrategy``'s arguments (arguments.py), launches ranks like Lightning's DDP
and watches its collectives (strategy_processes.py), shards the LightningModule at setup, and maps
Lightning's hooks onto the engine and its parts: checkpoints (strategy_checkpoints.py), SIGTERM and
requeue at agreed steps (strategy_preemption.py, strategy_requeue.py), the watchdog.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from collections.abc import Generator, Mapping
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies.fsdp import _move_torchmetrics_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.fsdp import FSDPStrategy as LightningFSDPStrategy
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from torch.optim import Optimizer

from fsdp_strategy import averaging
from fsdp_strategy.arguments import (
    STRATEGY_VARIANTS,
    StrategyArguments,
    apply_recomputation,
    refuse_whole_model_averaging,
)
from fsdp_strategy.checkpoint.writer import CheckpointWriter
from fsdp_strategy.config import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy
from fsdp_strategy.distributed.tensor_parallel import ParallelMesh
from fsdp_strategy.engine import Scheduler, get_scheduler, is_sharded, shard_with_options
from fsdp_strategy.engine.ledger import CommLedger
from fsdp_strategy.options import check_fsdp_keywords
from fsdp_strategy.precision import FSDPCustomPrecision
from fsdp_strategy.strategy_checkpoints import TrainerCheckpoints
from fsdp_strategy.strategy_placement import PlacementNotice, describe_sharding
from fsdp_strategy.strategy_preemption import AgreedSigterm, AgreedStopHooks
from fsdp_strategy.strategy_processes import WatchedProcesses
from fsdp_strategy.strategy_requeue import DeferredRequeue
from fsdp_strategy.strategy_watchdog import RunWatchdog
from fsdp_strategy.sync_batchnorm import apply_layer_sync

log = logging.getLogger(__name__)


class FSDPCustomStrategy(StrategyArguments, WatchedProcesses, AgreedStopHooks, LightningFSDPStrategy):
    """Fully Sharded Data Parallel for the Trainer, on this project's own engine.

    ``Trainer(strategy="fsdp_custom")`` is this class with its defaults; pass an instance to set
    options. The arguments have the names and meanings of Lightning's ``FSDPStrategy``, so switching
    is one word. It is a subclass of Lightning's ``FSDPStrategy`` (whose constructor and FSDP1
    machinery are not used: only plain accessors such as ``root_device`` are inherited), so code
    that asks ``isinstance(strategy, FSDPStrategy)`` (Lightning, LitGPT, your code) takes its FSDP
    branch, which works here. Every bad value is refused when the strategy is constructed (a mesh that does
    not fit the world size: before any process group exists) with an error naming the argument, the
    value and what is accepted.

    Costs: per rank, 1/N of parameters, gradients and optimizer state at rest, plus the units
    gathered at the moment; the collectives per step by ``sharding_strategy`` are tabled, and the
    arguments described, on [StrategyArguments][fsdp_strategy.arguments.StrategyArguments] (the
    Options page).
    """

    strategy_name = "fsdp_custom"
    _launcher_class = _SubprocessScriptLauncher  # the Trainer's
    _registered_strategies: list[str] = []

    def __init__(
        self,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        cpu_offload: bool | CPUOffload | Any = None,
        mixed_precision: MixedPrecision | Any = None,
        auto_wrap_policy: Any = None,
        activation_checkpointing: type[torch.nn.Module] | list[type[torch.nn.Module]] | None = None,
        activation_checkpointing_policy: Any = None,
        sharding_strategy: str | ShardingStrategy | Any = "FULL_SHARD",
        state_dict_type: Literal["full", "sharded"] = "full",
        device_mesh: tuple[int, int] | Any = None,
        async_save: bool = False,
        param_init_fn: Any = None,
        forward_prefetch: bool = True,
        backward_prefetch: str | BackwardPrefetch | Any = "BACKWARD_PRE",
        sync_module_states: bool = False,
        ignored_modules: list[torch.nn.Module] | None = None,
        collective_timeout: float | timedelta | None = None,
        check_collective_order: bool = True,
        optimizer_updates: dict | None = None,
        memory_budget: int | str | None = None,
        memory_reserve: int | str | None = None,
        example_batch: Any = None,
        data_parallel_size: int | Literal["auto"] | None = None,
        tensor_parallel_size: int | Literal["auto"] | None = None,
        **fsdp_kwargs: Any,
    ) -> None:
        check_fsdp_keywords(fsdp_kwargs, list(inspect.signature(FSDPCustomStrategy.__init__).parameters)[1:-1])
        ParallelStrategy.__init__(  # not Lightning FSDPStrategy's: it builds FSDP1's arguments
            self,
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self.num_nodes = 1
        self.kwargs = {"use_orig_params": True, **fsdp_kwargs}  # Lightning's name: the FSDP keywords honoured
        self._take_arguments(locals(), async_save)
        self._parallel = ParallelMesh(self._parallel_sizes(data_parallel_size, tensor_parallel_size))
        self._writer = CheckpointWriter(async_save=async_save)
        self._watch = RunWatchdog(self._writer)  # a watchdog per run: started at setup, closed at teardown
        self._ledger_global_step: int | None = None  # the global_step the ledger's count started at
        self._requeue = DeferredRequeue(self._writer.in_foreground)  # SLURM's signal, at an agreed step
        self._sigterm = AgreedSigterm()  # [Note: preemption at an agreed step]
        self._checkpoints = TrainerCheckpoints(self._writer, lambda: self._state_dict_type, self.broadcast)
        self._placement = PlacementNotice()  # how a whole-matrix optimizer places its parameters

    # ---- Lightning plumbing --------------------------------------------------------------

    @property
    def mixed_precision_config(self) -> MixedPrecision:
        """The dtypes training runs in (Lightning's name; an object for every precision):
        ``mixed_precision`` if given, else the one derived from ``Trainer(precision=...)``."""
        return self.mixed_precision or self.precision_plugin.mixed_precision_config

    def _engine_mixed_precision(self) -> MixedPrecision | None:
        """What the engine casts to: ``mixed_precision``, or a "*-mixed" precision's (None: nothing)."""
        return self.mixed_precision or self.precision_plugin.engine_mixed_precision

    @property
    def is_distributed(self) -> bool:
        """Always True, so Lightning adds a DistributedSampler."""
        return True

    @property
    def precision_plugin(self) -> FSDPCustomPrecision:
        plugin = self._precision_plugin
        return plugin if plugin is not None else FSDPCustomPrecision("32-true")

    @precision_plugin.setter
    def precision_plugin(self, precision_plugin: Precision | None) -> None:
        self._precision_plugin = None if precision_plugin is None else FSDPCustomPrecision.from_plugin(precision_plugin)

    @property
    def scheduler(self) -> Scheduler:
        """The engine's scheduler of the sharded model (after setup)."""
        assert self.model is not None, "the model is sharded in setup(); no scheduler before"
        return get_scheduler(self.model)

    @property
    def comm_ledger(self) -> CommLedger:
        """Calls and bytes per collective kind: ``last_step`` (the previous optimizer step, its
        micro-batches summed) and ``current``."""
        return self.scheduler.ledger

    def setup_environment(self) -> None:
        """Set ranks, check the mesh against the world size, choose the units by the memory budget,
        create the process group(s) and start the watchdog on them (strategy_processes.py)."""
        ParallelStrategy.setup_environment(self)  # not Lightning FSDPStrategy's (it creates the group its way)
        reset_seed()
        self._set_ranks_and_mesh_shape()
        module, trainer = self.lightning_module, self._trainer
        if self._budget is not None and module is not None:  # before the process group exists
            world, precision = self.num_nodes * self.num_processes, self.precision_plugin.precision
            chosen = self._choose_by_budget(module, world, self.num_nodes, precision)
            rank_zero_info(f"fsdp_custom: auto_wrap_policy='auto' chose\n{chosen}")
        if trainer is not None:
            refuse_whole_model_averaging(trainer.callbacks)  # before the callbacks' setup copies anything
            averaging.defer(averaging.averaging_callbacks(trainer))
        mesh = self._open_process_groups(trainer.default_root_dir if trainer is not None else None)
        self._writer.setup()
        if mesh is not None and module is not None:  # configure_model reads it (ModelParallelStrategy's place)
            module._device_mesh = mesh

    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """Create the model on the meta device (``empty_init``) or the CPU; setup shards it to the device."""
        device_context = torch.device("meta") if empty_init else nullcontext()
        with device_context, self.precision_plugin.tensor_init_context():
            yield

    def model_to_device(self) -> None:
        """Nothing: ``setup`` moves each unit's shards to the device as it shards them."""

    def setup(self, trainer: pl.Trainer) -> None:
        """Shard the model (once: validate/test after fit reuse it), then set up optimizers and precision."""
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self._sigterm.hold_from_registration(trainer)  # [Note: preemption at an agreed step]
        self._checkpoints.end_dataloader_setup()
        if not is_sharded(self.model):  # validate/test after fit reuse the sharded model
            if trainer.state.fn == TrainerFn.FITTING and self._layer_sync is not None:
                self.model = apply_layer_sync(self._layer_sync, self.model)
            self.model = self._setup_model(self.model)
        self.scheduler.open()  # closed at teardown ([Note: edits while gathered])
        self._watch.attach(self.model, self._watch.dog)  # this run's (validate/test after fit reuse the model)
        wait = self.scheduler.device_layer.before_host_writes_shards  # before an update after a closure
        self.precision_plugin.attach(self.root_device.type, self.scheduler.clip_grad_norm_, wait)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            for callback in averaging.averaging_callbacks(trainer):  # [Note: sharded weight averaging]
                averaging.build(callback, self.model)
        self.setup_precision_plugin()
        parts = self.model, trainer, self.lightning_module.strict_loading, self.optimizers, self.world_size
        self._checkpoints.load_into_shards(*parts)

    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Shard ``model`` with this engine (Lightning ``FSDPStrategy``'s hook; ``setup`` calls it)."""
        self.model = model = self.precision_plugin.convert_module(model)
        if self.activation_checkpointing_policy is not None:
            apply_recomputation(model, self.activation_checkpointing_policy)
        options = dataclasses.replace(self._options, mixed_precision=self._engine_mixed_precision())
        data_group = self._parallel.data_parallel_group
        shard_with_options(model, options, self.root_device, data_group, self._device_mesh, self._watch.dog)
        _move_torchmetrics_to_device(model, self.root_device)
        offloaded, layout = options.cpu_offload.offload_params, self._parallel.describe()
        rank_zero_info(describe_sharding(model, self.sharding_strategy.value, self.world_size, layout, offloaded))
        return model

    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        """Lightning's base one (its FSDPStrategy's adds FSDP1's flat-parameter checks), fresh each stage."""
        ParallelStrategy.setup_optimizers(self, trainer)

    @contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        """Nothing: ``configure_model`` builds plain modules, sharded at setup by the wrap policy."""
        yield

    # ---- checkpoints: the part TrainerCheckpoints (strategy_checkpoints.py) -------------

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """False: only then does Lightning pass ``weights_only`` to ``load_checkpoint``. The file is
        read before setup; ``setup`` copies its tensors into the shards."""
        return False

    @property
    def lightning_restore_optimizer(self) -> bool:
        """True: Lightning calls ``load_optimizer_state_dict`` when it restores optimizers, which loads them."""
        return True

    @property
    def _trainer(self) -> pl.Trainer | None:
        return self.lightning_module._trainer if self.lightning_module is not None else None

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Full: the gathered model state on rank 0 ({} elsewhere). Sharded: views of the shards."""
        return self._checkpoints.model_state(self.model)

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """Full: the gathered optimizer state in torch's layout on rank 0. Sharded: {}."""
        return self._checkpoints.optimizer_state(self.model, optimizer)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """The read checkpoint's weights into the shards now if sharded (a restore after setup), else at setup."""
        model, trainer, world = self.model, self._trainer, self.world_size
        self._checkpoints.load_weights_now(model, checkpoint, strict, trainer, self.optimizers, world)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """The read checkpoint's optimizer states (Lightning restores optimizers after setup)."""
        self._checkpoints.load_optimizers(self.model, self.optimizers, checkpoint)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any = None) -> None:
        """Write atomically, full (Lightning's layout) or sharded (a folder), to a path or fsspec URL."""
        parts = self.model, self.optimizers, self.checkpoint_io, self._trainer, self.is_global_zero
        self._checkpoints.save(checkpoint, filepath, storage_options, *parts)

    def remove_checkpoint(self, filepath: _PATH) -> None:
        """Delete a checkpoint file or folder (after any save in flight)."""
        self._checkpoints.remove(filepath)

    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """Read a sharded folder (any world size) or a full file; its tensors load when Lightning restores."""
        return self._checkpoints.read(checkpoint_path, weights_only, self._trainer)

    def process_dataloader(self, dataloader: object) -> object:
        """Make the training dataloader resumable mid-epoch, also on another world size (data.py)."""
        return self._checkpoints.process_dataloader(dataloader, self._trainer)

    # ---- steps run through the root's forward, so the engine's root hooks fire ----------

    def _redirect(self, method: str, *args: Any, **kwargs: Any) -> Any:
        assert self.model is not None and self.lightning_module is not None
        with self._watch.reported():
            return self._forward_redirection(self.model, self.lightning_module, method, *args, **kwargs)

    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        with self._watch.reported():
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    def optimizer_step(self, optimizer: Optimizer, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """Lightning's step; after a whole-matrix optimizer's first, a line on how it places its parameters."""
        result = super().optimizer_step(optimizer, closure, model, **kwargs)
        self._placement.after_step(self.model, optimizer)
        return result

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.train_step_context():
            return self._redirect("training_step", *args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        self._sigterm.before_evaluation_batch(self._watch.dog)
        with self.precision_plugin.val_step_context():
            return self._redirect("validation_step", *args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        self._sigterm.before_evaluation_batch(self._watch.dog)
        with self.precision_plugin.test_step_context():
            return self._redirect("test_step", *args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        self._sigterm.before_evaluation_batch(self._watch.dog)
        with self.precision_plugin.predict_step_context():
            return self._redirect("predict_step", *args, **kwargs)

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Skip the reduce-scatter on non-final micro-batches of gradient accumulation."""
        with self.scheduler.no_sync():
            yield
        if log.isEnabledFor(logging.DEBUG):  # counting the bytes walks every parameter: only when asked
            log.debug("no_sync holds %d bytes of full gradients", self.scheduler.unsharded_grad_bytes())

    def on_exception(self, exception: BaseException) -> None:
        """Tell the other ranks ([Note: watchdog]: their next collective raises, naming this rank's
        exception; not Lightning's ``SIGTERMException``, which every rank raises at the same step
        after a barrier), and leave no half-done iteration behind (see ``Scheduler.reset``)."""
        self._watch.report_exception(exception)
        if self.model is not None and is_sharded(self.model):
            self.scheduler.reset()
        super().on_exception(exception)

    def on_train_start(self) -> None:
        """Check the resumed data positions (strategy_data.py); hold SLURM's requeue handler back to an
        agreed step ([Note: requeue at an agreed step] in strategy_requeue.py)."""
        replicas = self.distributed_sampler_kwargs["num_replicas"]  # data-parallel ranks: TP peers read alike
        self._checkpoints.position_training_data(self.lightning_module.trainer, replicas)
        self._requeue.install(self.lightning_module.trainer)
        super().on_train_start()

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Start the ledger's count at the first batch of each optimizer step (under gradient
        accumulation a step's micro-batches are counted together); the dataloaders' setup has ended;
        SIGTERM and SLURM's requeue signal are acted on here, between two batches."""
        global_step = self.lightning_module.trainer.global_step
        self._sigterm.at_step_start(global_step, self._watch.dog)
        self._checkpoints.end_dataloader_setup(self.lightning_module.trainer)
        self._requeue.at_batch_start(global_step)
        self.scheduler.observer.at_step(global_step)  # the flight recorder names steps as the trainer does
        if global_step != self._ledger_global_step:
            self.comm_ledger.start_step()
            self._ledger_global_step = global_step
        super().on_train_batch_start(batch, batch_idx)

    def teardown(self) -> None:
        """Finish any checkpoint in flight, close the engine's hooks and threads and the watchdog,
        then tear down as Lightning does."""
        self._sigterm.remove()
        self._requeue.remove()
        self._writer.teardown()
        self._checkpoints.resume_notice.remove()
        self._watch.close([self.model] if self.model is not None else [])
        if self._trainer is not None:
            averaging.restore(averaging.averaging_callbacks(self._trainer))
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()

    @classmethod
    def get_registered_strategies(cls) -> list[str]:
        return cls._registered_strategies

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register "fsdp_custom" and its variants with Lightning."""
        for name, (description, init_params) in STRATEGY_VARIANTS.items():
            if name in strategy_registry:
                continue
            strategy_registry.register(name, cls, description=description, **init_params)
            cls._registered_strategies.append(name)
