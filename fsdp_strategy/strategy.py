"""FSDPCustomStrategy: Lightning glue around the engine. No sharding logic lives here.

It takes Lightning ``FSDPStrategy``'s arguments with the same names and meanings, launches
ranks like Lightning's DDP (``python train.py`` spawns the others; torchrun/SLURM are used as
they are), shards the LightningModule with ``shard_model`` at setup, and maps Lightning's
hooks (precision, clipping, accumulation, checkpoints) onto the engine.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import math
from collections.abc import Generator
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies.fsdp import _move_torchmetrics_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.fsdp import FSDPStrategy as LightningFSDPStrategy
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor

from fsdp_strategy import averaging
from fsdp_strategy.arguments import (
    STRATEGY_VARIANTS,
    StrategyArguments,
    apply_recomputation,
    check_fsdp_keywords,
    refuse_whole_model_averaging,
)
from fsdp_strategy.checkpoint.writer import CheckpointWriter
from fsdp_strategy.config import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy
from fsdp_strategy.distributed import build_mesh, connect, mesh_shape, set_world_ranks
from fsdp_strategy.engine import Scheduler, get_scheduler, is_sharded, shard_with_options
from fsdp_strategy.engine.ledger import CommLedger
from fsdp_strategy.engine.watchdog import Watchdog
from fsdp_strategy.precision import FSDPCustomPrecision
from fsdp_strategy.requeue import DeferredRequeue
from fsdp_strategy.strategy_checkpoints import CheckpointHooks
from fsdp_strategy.strategy_watchdog import WatchdogHooks
from fsdp_strategy.sync_batchnorm import convert_sync_batchnorm

log = logging.getLogger(__name__)


def _plural(count: int, noun: str) -> str:
    """``1 rank``, ``2 ranks``."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _count(count: int) -> str:
    return f"{count / 1e6:.1f} M" if count >= 100_000 else f"{count:,}"


class FSDPCustomStrategy(StrategyArguments, WatchdogHooks, CheckpointHooks, LightningFSDPStrategy):
    """Fully Sharded Data Parallel with this project's own engine.

    A subclass of Lightning's ``FSDPStrategy`` (its constructor and FSDP1 machinery are not used:
    every method is this engine's), so code that asks ``isinstance(strategy, FSDPStrategy)``
    (Lightning itself, LitGPT, user code) takes its FSDP branch, which works here.

    Arguments (names and meanings as Lightning's ``FSDPStrategy``):
        sharding_strategy: "FULL_SHARD" (default), "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD",
            "_HYBRID_SHARD_ZERO2" (SHARD_GRAD_OP within the shard group), or the enum (ours or torch's).
        auto_wrap_policy: which modules become units: a set of classes, an int (minimum
            parameter count) or a callable ``(module, recurse, nonwrapped_numel) -> bool``.
            None: the whole model is one unit. "auto" (with ``memory_budget`` and ``example_batch``):
            the units, activation checkpointing per unit, SHARD_GRAD_OP or FULL_SHARD and CPU
            offload are chosen by a memory plan before the process group is created: the fastest
            that fits, printed with why ([Note: wrapping by budget]; costs a few plans on every rank).
        memory_budget: bytes per rank for "auto" (an int or a string like "70GiB").
        example_batch: one batch as ``training_step`` receives it, for "auto" (meta tensors work).
        mixed_precision: :class:`MixedPrecision` (or torch's, or a dict); overrides the one
            derived from ``Trainer(precision=...)``.
        cpu_offload: True or :class:`CPUOffload`: shards, gradients and optimizer state on CPU.
        activation_checkpointing_policy: modules to recompute in backward (same forms as
            ``auto_wrap_policy``); ``activation_checkpointing`` (a class or list): Lightning's older form.
        state_dict_type: "full" (one file, gathered unit by unit to rank 0) or "sharded" (a DCP
            folder each rank writes its shards into; loads at any world size).
        async_save: write sharded checkpoints in the background (the step goes on).
        device_mesh: ``(replicate, shard)`` sizes or a 2-D ``DeviceMesh``, for the hybrid strategies;
            default there: ``(num_nodes, devices)``, one shard group per node (as FSDP1).
        param_init_fn: ``(module) -> None``, called on each module that still has tensors on the
            meta device (``trainer.init_module(empty_init=True)``) to allocate and initialize them;
            default: ``reset_parameters()`` and the enclosing ``_init_weights`` (Hugging Face).
        forward_prefetch: issue the next unit's all-gather when a unit's forward starts (default
            True, unlike FSDP1's False: the engine never holds more than one unit ahead).
        backward_prefetch: "BACKWARD_PRE" (default), "BACKWARD_POST" or None, as FSDP1's.
        sync_module_states: broadcast global rank 0's parameters and buffers before sharding.
        ignored_modules: modules of the model whose parameters are not sharded nor synchronized
            (FSDP1's meaning: every rank keeps them whole; freeze them or sync them yourself).
        collective_timeout: seconds (or a ``timedelta``) a collective of the engine may wait before
            every rank stops with a report of where each rank was (default None: ``timeout``, the
            process group's, 30 minutes unless set; ``math.inf``: no limit). Barriers, broadcasts and
            checkpoint gathers are left to ``timeout``. A dead or raising rank stops the others at
            their next collective whatever this is; a rank outside every collective is ended only
            after this long ([Note: watchdog]).
        check_collective_order: stamp every collective so that ranks issuing different ones (a
            unit called an extra time on one rank) stop at the first (default True; costs 16
            elements per collective).
        optimizer_updates: ``{optimizer class (or dotted path): "elementwise" | "whole_matrix"}``:
            how an optimizer the engine does not know updates a parameter. Elementwise ones (torch's
            SGD, Adam, AdamW, ...) step shards; whole-matrix ones (torch's Muon, Adafactor declared
            so, your own) are stepped whole, each matrix on one rank (costs about 5x the matrices'
            bytes over the shard group per step for Muon); an unknown one warns once; LBFGS is refused.
        process_group_backend: "gloo", "nccl", ...; default: by device.
        timeout: a ``timedelta``: timeout of every collective (a rank that dies fails the others after it).
        FSDP keywords Lightning passes through: ``use_orig_params=True`` and
        ``limit_all_gathers=True`` are what the engine does; other values, ``process_group``,
        ``device_id`` and ``ignored_states`` are refused saying why (``arguments.py``).

    Costs: per rank, 1/N of parameters, gradients and optimizer state at rest, plus the
    units gathered at the moment (the running one, the root and one prefetched).
    """

    strategy_name = "fsdp_custom"
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
        example_batch: Any = None,
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
        self._writer = CheckpointWriter(async_save=async_save)
        self._watchdog: Watchdog | None = None  # started at each run's setup, closed at its teardown
        self._ledger_global_step: int | None = None  # the global_step the ledger's count started at
        self._requeue = DeferredRequeue(self._writer.in_foreground)  # SLURM's signal, at an agreed step
        self._init_checkpoint_hooks()

    # ---- Lightning plumbing --------------------------------------------------------------

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

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
    def distributed_sampler_kwargs(self) -> dict:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

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
        """Set ranks, check the mesh against the world size, create the process group(s)."""
        ParallelStrategy.setup_environment(self)  # not Lightning FSDPStrategy's (it creates the group its way)
        reset_seed()
        self.set_world_ranks()
        self._device_mesh = mesh_shape(self._device_mesh, self.sharding_strategy, self.num_nodes, self.num_processes)
        assert self.cluster_environment is not None
        if self._budget is not None and self.lightning_module is not None:  # before the process group exists
            chosen = self._choose_by_budget(
                self.lightning_module,
                self.num_nodes * self.num_processes,
                self.num_nodes,
                self.precision_plugin.precision,
            )
            rank_zero_info(f"fsdp_custom: auto_wrap_policy='auto' chose\n{chosen}")
        if self.lightning_module is not None and self.lightning_module._trainer is not None:
            callbacks = self.lightning_module.trainer.callbacks
            refuse_whole_model_averaging(callbacks)  # before the callbacks' setup copies anything
            averaging.defer(averaging.averaging_callbacks(self.lightning_module.trainer))
        self._process_group_backend = connect(
            self.cluster_environment, self._process_group_backend, self.root_device, self._timeout
        )
        self._start_watchdog()
        self._writer.setup()
        self._device_mesh = build_mesh(self._device_mesh, self.root_device.type)

    def set_world_ranks(self) -> None:
        set_world_ranks(self)

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

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
        if not is_sharded(self.model):  # validate/test after fit reuse the sharded model
            if trainer.state.fn == TrainerFn.FITTING and self._layer_sync is not None:
                self.model = self._sync_layers(self.model)
            self.model = self._setup_model(self.model)
        self.scheduler.open()  # closed at teardown ([Note: edits while gathered])
        self._attach_watchdog(self._watchdog)  # this run's (validate/test after fit reuse the model)
        wait = self.scheduler.device_layer.before_host_writes_shards  # before an update after a closure
        self.precision_plugin.attach(self.root_device.type, self.scheduler.clip_grad_norm_, wait)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            for callback in averaging.averaging_callbacks(trainer):  # [Note: sharded weight averaging]
                averaging.build(callback, self.model)
        self.setup_precision_plugin()
        self._load_into_shards(trainer)

    def _sync_layers(self, model: torch.nn.Module) -> torch.nn.Module:
        """``Trainer(sync_batchnorm=True)``: our SyncBatchNorm (torch's refuses CPU tensors); any
        other ``LayerSync`` plugin is applied as given. Not reverted at teardown: the layers hold
        sharded parameters, and ours is plain BatchNorm outside training."""
        from lightning.pytorch.plugins import TorchSyncBatchNorm

        if type(self._layer_sync) is TorchSyncBatchNorm:
            return convert_sync_batchnorm(model)
        return self._layer_sync.apply(model)

    def _shard(self, model: torch.nn.Module) -> None:
        self.model = model = self.precision_plugin.convert_module(model)
        if self.activation_checkpointing_policy is not None:
            apply_recomputation(model, self.activation_checkpointing_policy)
        options = dataclasses.replace(self._options, mixed_precision=self._engine_mixed_precision())
        shard_with_options(model, options, self.root_device, device_mesh=self._device_mesh, watchdog=self._watchdog)
        _move_torchmetrics_to_device(model, self.root_device)
        units = self.scheduler.units
        params = self.scheduler.sharded_params()
        full_count = sum(math.prod(p.shape) for p in params)
        trainable = sum(math.prod(p.shape) for p in params if p.sharded.requires_grad)
        local = sum(p.sharded.numel() for p in params)
        rank_zero_info(
            f"fsdp_custom: {self.sharding_strategy.value} over {_plural(self.world_size, 'rank')}, "
            f"{_plural(len(units), 'unit')} "
            f"({', '.join(unit.name for unit in units[:8])}{', ...' if len(units) > 8 else ''}); "
            f"{_count(full_count)} parameters ({_count(trainable)} trainable), {_count(local)} in this rank's "
            "shards (what Lightning's model summary counts)"
        )

    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        self._reset_optimizers_and_schedulers()
        super().setup_optimizers(trainer)

    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Shard ``model`` with this engine (Lightning ``FSDPStrategy``'s hook; ``setup`` calls it)."""
        self._shard(model)
        return self.model

    @contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        """Nothing: ``configure_model`` builds plain modules, sharded at setup by the wrap policy."""
        yield

    def _get_process_group_backend(self) -> str:
        """The backend in use (or about to be: gloo on a CPU, nccl on CUDA), as Lightning's."""
        from lightning.fabric.utilities.distributed import _get_default_process_group_backend_for_device

        return self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)

    def _determine_device_ids(self) -> list[int] | None:
        """The rank's device index on an accelerator (for NCCL's barrier), else None."""
        return None if self.root_device.type == "cpu" else [self.root_device.index]

    # ---- steps run through the root's forward, so the engine's root hooks fire ----------

    def _redirect(self, method: str, *args: Any, **kwargs: Any) -> Any:
        assert self.model is not None and self.lightning_module is not None
        with self._reported():
            return self._forward_redirection(self.model, self.lightning_module, method, *args, **kwargs)

    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        with self._reported():
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.train_step_context():
            return self._redirect("training_step", *args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            return self._redirect("validation_step", *args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            return self._redirect("test_step", *args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
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
        self._report_exception(exception)
        if self.model is not None and is_sharded(self.model):
            self.scheduler.reset()
        super().on_exception(exception)

    def on_train_start(self) -> None:
        """Hold Lightning's SLURM requeue handler back to a step all ranks agree on ([Note: requeue
        at an agreed step] in requeue.py)."""
        self._requeue.install(self.lightning_module.trainer)
        super().on_train_start()

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Start the ledger's count at the first batch of each optimizer step (under gradient
        accumulation a step's micro-batches are counted together); a resume's hidden warning shows
        again; SLURM's requeue signal is acted on here, between two optimizer steps."""
        self._resume_notice.remove()  # the epoch loop has checked the dataloader by now
        global_step = self.lightning_module.trainer.global_step
        self._requeue.at_batch_start(global_step)
        self.scheduler.comm.recorder.step = global_step  # the flight recorder names steps as the trainer does
        if global_step != self._ledger_global_step:
            self.comm_ledger.start_step()
            self._ledger_global_step = global_step
        super().on_train_batch_start(batch, batch_idx)

    def teardown(self) -> None:
        """Finish any checkpoint in flight, close the engine's hooks and threads and the watchdog,
        then tear down as Lightning does."""
        self._requeue.remove()
        self._writer.teardown()
        self._resume_notice.remove()
        self._close_watchdog()
        if self.lightning_module is not None and self.lightning_module._trainer is not None:
            averaging.restore(averaging.averaging_callbacks(self.lightning_module.trainer))
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
