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
from lightning.fabric.utilities.types import _PATH, ReduceOp
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.fsdp import FSDPStrategy as LightningFSDPStrategy
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
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
from fsdp_strategy.distributed import build_mesh, connect, mesh_shape, set_world_ranks
from fsdp_strategy.distributed.tensor_parallel import ParallelMesh
from fsdp_strategy.engine import Scheduler, get_scheduler, is_sharded, shard_with_options
from fsdp_strategy.engine.diagnosis import count_of, plural
from fsdp_strategy.engine.ledger import CommLedger
from fsdp_strategy.options import check_fsdp_keywords
from fsdp_strategy.precision import FSDPCustomPrecision
from fsdp_strategy.strategy_checkpoints import TrainerCheckpoints
from fsdp_strategy.strategy_placement import PlacementNotice
from fsdp_strategy.strategy_preemption import AgreedSigterm
from fsdp_strategy.strategy_requeue import DeferredRequeue
from fsdp_strategy.strategy_watchdog import RunWatchdog
from fsdp_strategy.sync_batchnorm import convert_sync_batchnorm

log = logging.getLogger(__name__)


class FSDPCustomStrategy(StrategyArguments, LightningFSDPStrategy):
    """Fully Sharded Data Parallel for the Trainer, on this project's own engine.

    ``Trainer(strategy="fsdp_custom")`` is this class with its defaults; pass an instance to set
    options. The arguments have the names and meanings of Lightning's ``FSDPStrategy``, so switching
    is one word. It is a subclass of Lightning's ``FSDPStrategy`` (whose constructor and FSDP1
    machinery are not used: every method is this engine's), so code that asks
    ``isinstance(strategy, FSDPStrategy)`` (Lightning, LitGPT, your code) takes its FSDP branch,
    which works here. Every bad value is refused when the strategy is constructed (a mesh that does
    not fit the world size: before any process group exists) with an error naming the argument, the
    value and what is accepted.

    | `sharding_strategy` | parameters | gradients, optimizer state | per step |
    |---|---|---|---|
    | `"FULL_SHARD"` (default) | sharded: gathered per unit, freed after use | sharded | 2 all-gathers, reduce-scatter |
    | `"SHARD_GRAD_OP"` | sharded: gathered in forward, kept until backward | sharded | all-gather, reduce-scatter |
    | `"NO_SHARD"` | replicated (nothing gathered or copied) | replicated | all-reduce, as DDP |
    | `"HYBRID_SHARD"` | FULL_SHARD in a shard group, replicated across | the same | + all-reduce across |
    | `"_HYBRID_SHARD_ZERO2"` | SHARD_GRAD_OP in a shard group, replicated across | the same | + all-reduce across |

    Costs: per rank, 1/N of parameters, gradients and optimizer state at rest, plus the units
    gathered at the moment (the running one, the root and one prefetched).

    Arguments: those of Lightning's ``FSDPStrategy``, each described on
    [StrategyArguments][fsdp_strategy.arguments.StrategyArguments] (the Options page).
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
        """Over every rank; in a 2-D run over "data_parallel" (tensor-parallel peers read the same rows)."""
        return self._parallel.sampler_kwargs(self.num_nodes * self.num_processes, self.global_rank)

    @property
    def device_mesh(self) -> Any:
        """The ``("data_parallel", "tensor_parallel")`` mesh of a 2-D run (after setup_environment), else
        the hybrid strategies' ``(replicate, shard)`` mesh, else None."""
        return self._parallel.mesh if self._parallel.active else self._device_mesh

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
        trainer = self.lightning_module._trainer if self.lightning_module is not None else None
        dump_dir = trainer.default_root_dir if trainer is not None else None  # failing ranks' rings go there
        self._watch.start(self.collective_timeout, self.node_rank, dump_dir)
        self._writer.setup()
        self._device_mesh = build_mesh(self._device_mesh, self.root_device.type)
        if self._parallel.active:  # the user's configure_model reads it (ModelParallelStrategy's place)
            mesh = self._parallel.build(self.num_nodes, self.num_processes, self.root_device)
            if self._watch.dog is not None:  # reports name a rank's place: "rank 3 (data 1, tensor 1; ...)"
                self._watch.dog.name_places(tuple(mesh.shape))
            if self.lightning_module is not None:
                self.lightning_module._device_mesh = mesh

    def set_world_ranks(self) -> None:
        set_world_ranks(self)

    def _configure_launcher(self) -> None:
        """Lightning's script launcher in every process, as DDP: under torchrun, SLURM or in the ranks
        Lightning's launcher starts it starts nothing, but sets the thread count DDP gives each rank
        (CPUs / processes per node, unless OMP_NUM_THREADS is set), which only rank 0 got before."""
        assert self.cluster_environment is not None
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
        self._sigterm.hold_from_registration(trainer)  # [Note: preemption at an agreed step]
        if self._parallel.active and trainer.checkpoint_callbacks:
            raise ValueError(
                "fsdp_custom cannot yet checkpoint a tensor-parallel model (tensor_parallel_size given), and the "
                "Trainer has checkpoint callbacks (ModelCheckpoint, on by default): pass "
                "Trainer(enable_checkpointing=False) and no ModelCheckpoint, or use Lightning's ModelParallelStrategy "
                "to checkpoint"
            )
        if not is_sharded(self.model):  # validate/test after fit reuse the sharded model
            if trainer.state.fn == TrainerFn.FITTING and self._layer_sync is not None:
                self.model = self._sync_layers(self.model)
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
        strict = self.lightning_module.strict_loading
        self._checkpoints.load_into_shards(self.model, trainer, strict, self.optimizers, self.world_size)

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
        data_group = self._parallel.data_parallel_group
        shard_with_options(model, options, self.root_device, data_group, self._device_mesh, self._watch.dog)
        _move_torchmetrics_to_device(model, self.root_device)
        units = self.scheduler.units
        params = self.scheduler.sharded_params()
        full_count = sum(math.prod(p.global_shape) for p in params)
        trainable = sum(math.prod(p.global_shape) for p in params if p.sharded.requires_grad)
        local = sum(p.sharded.numel() for p in params)
        rank_zero_info(
            f"fsdp_custom: {self.sharding_strategy.value} over {plural(self.world_size, 'rank')}"
            f"{self._parallel.describe()}, "
            f"{plural(len(units), 'unit')} "
            f"({', '.join(unit.name for unit in units[:8])}{', ...' if len(units) > 8 else ''}); "
            f"{count_of(full_count)} parameters ({count_of(trainable)} trainable), {count_of(local)} in this rank's "
            "shards (what Lightning's model summary counts)"
            + ("; shards offloaded to the CPU" if options.cpu_offload.offload_params else "")
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

    # ---- checkpoints: the part TrainerCheckpoints (strategy_checkpoints.py) -------------

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """False: only then does Lightning pass ``weights_only`` to ``load_checkpoint``. The file is
        read before setup; ``setup`` copies its tensors into the shards."""
        return False

    @property
    def lightning_restore_optimizer(self) -> bool:
        """True: Lightning calls ``load_optimizer_state_dict`` when it restores optimizers (a fit's
        resume, the tuner's restore), which loads them then."""
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
        model, optimizers, io, trainer, zero = (
            self.model,
            self.optimizers,
            self.checkpoint_io,
            self._trainer,
            self.is_global_zero,
        )
        self._checkpoints.save(checkpoint, filepath, storage_options, model, optimizers, io, trainer, zero)

    def remove_checkpoint(self, filepath: _PATH) -> None:
        """Delete a checkpoint file or folder (after any save in flight)."""
        self._checkpoints.remove(filepath)

    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """Read a sharded folder (any world size) or a full file; its tensors load when Lightning restores."""
        return self._checkpoints.read(checkpoint_path, weights_only, self._trainer)

    def process_dataloader(self, dataloader: object) -> object:
        """Make the training dataloader resumable mid-epoch, also on another world size (data.py)."""
        return self._checkpoints.process_dataloader(dataloader, self._trainer, self.world_size)

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
        self._evaluation_boundary()
        with self.precision_plugin.val_step_context():
            return self._redirect("validation_step", *args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        self._evaluation_boundary()
        with self.precision_plugin.test_step_context():
            return self._redirect("test_step", *args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        self._evaluation_boundary()
        with self.precision_plugin.predict_step_context():
            return self._redirect("predict_step", *args, **kwargs)

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Skip the reduce-scatter on non-final micro-batches of gradient accumulation."""
        with self.scheduler.no_sync():
            yield
        if log.isEnabledFor(logging.DEBUG):  # counting the bytes walks every parameter: only when asked
            log.debug("no_sync holds %d bytes of full gradients", self.scheduler.unsharded_grad_bytes())

    def barrier(self, name: str | None = None) -> None:
        """Wait for every rank, watched ([Note: watchdog]; device-aware on NCCL)."""
        self._watch.barrier(name, self.root_device)

    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        """Rank ``src``'s ``obj`` on every rank, watched."""
        return self._watch.broadcast(obj, src)

    def reduce(self, tensor: Tensor | Any, group: Any = None, reduce_op: ReduceOp | str | None = "mean") -> Tensor:
        """Lightning's reduce over ``group``, watched; anything but a tensor is returned as it is."""
        return self._watch.reduce(tensor, group, reduce_op)

    def on_exception(self, exception: BaseException) -> None:
        """Tell the other ranks ([Note: watchdog]: their next collective raises, naming this rank's
        exception; not Lightning's ``SIGTERMException``, which every rank raises at the same step
        after a barrier), and leave no half-done iteration behind (see ``Scheduler.reset``)."""
        self._watch.report_exception(exception)
        if self.model is not None and is_sharded(self.model):
            self.scheduler.reset()
        super().on_exception(exception)

    def on_validation_start(self) -> None:
        """Hold SIGTERM back to agreed batch boundaries, from ``fit``'s sanity check on, and between
        validation batches where every rank runs as many ([Note: preemption at an agreed step] in
        strategy_preemption.py)."""
        self._start_evaluation(self.lightning_module.trainer.val_dataloaders)
        super().on_validation_start()

    def on_validation_end(self) -> None:
        """Back to training's boundaries; at the end of ``validate``, a boundary."""
        self._end_evaluation()
        super().on_validation_end()

    def on_test_start(self) -> None:
        """As ``on_validation_start``."""
        self._start_evaluation(self.lightning_module.trainer.test_dataloaders)
        super().on_test_start()

    def on_test_end(self) -> None:
        """As ``on_validation_end``."""
        self._end_evaluation()
        super().on_test_end()

    def on_predict_start(self) -> None:
        """As ``on_validation_start`` (Lightning's predict sampler pads nothing: no batch is a boundary)."""
        self._start_evaluation(self.lightning_module.trainer.predict_dataloaders)
        super().on_predict_start()

    def on_predict_end(self) -> None:
        """As ``on_validation_end``."""
        self._end_evaluation()
        super().on_predict_end()

    def _start_evaluation(self, loaders: Any) -> None:
        self._sigterm.start_evaluation(self.lightning_module.trainer, loaders)

    def _end_evaluation(self) -> None:
        self._sigterm.in_evaluation = False
        if self.lightning_module.trainer.state.fn != TrainerFn.FITTING:
            self._sigterm.at_boundary("at the end of this evaluation", self._watch.dog)

    def _evaluation_boundary(self) -> None:
        if self._sigterm.in_evaluation:  # [Note: preemption at an agreed step]
            self._sigterm.at_boundary("before this evaluation batch", self._watch.dog)

    def on_train_start(self) -> None:
        """Hold Lightning's SLURM requeue handler back to a step all ranks agree on ([Note: requeue
        at an agreed step] in strategy_requeue.py; SIGTERM is held from the stage's start)."""
        self._requeue.install(self.lightning_module.trainer)
        super().on_train_start()

    def on_train_end(self) -> None:
        """A SIGTERM received in the last batch or validation stops every rank here, together."""
        self._sigterm.at_boundary("at the end of training", self._watch.dog)
        super().on_train_end()

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Start the ledger's count at the first batch of each optimizer step (under gradient
        accumulation a step's micro-batches are counted together); a resume's hidden warning shows
        again; SIGTERM and SLURM's requeue signal are acted on here, between two batches."""
        self._sigterm.at_step_start(self.lightning_module.trainer.global_step, self._watch.dog)
        self._checkpoints.resume_notice.remove()  # the epoch loop has checked the dataloader by now
        global_step = self.lightning_module.trainer.global_step
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
