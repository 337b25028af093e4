"""WatchedProcesses: what both strategies (Trainer and Fabric) do with their processes. Lightning's
script launcher in every process, the process group(s) and meshes of a run with its watchdog
started on them, the sampler's replicas over them, and Lightning's ``barrier``, ``broadcast`` and
``reduce`` watched
([Note: watchdog] in engine/watchdog.py).

A base class of both strategies, before Lightning's: it reads the strategy's own attributes
(``cluster_environment``, the watchdog part ``_watch``, the 2-D mesh ``_parallel``, ...), as
Lightning's ``ParallelStrategy`` methods it replaces do. It also defines the plain accessors
Lightning's ``FSDPStrategy`` defines (``root_device``, ...), so that nothing of ours falls back to
that class (tests/test_lightning_compat.py).
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.utilities.distributed import _get_default_process_group_backend_for_device
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.strategies.strategy import TBroadcast
from torch import Tensor

from fsdp_strategy.distributed import build_mesh, connect, mesh_shape, set_world_ranks


class WatchedProcesses:
    """The launcher, process groups and watched collectives of a strategy. Costs: the process
    group's rendezvous and the watchdog's thread at setup; per watched call, a few host reads."""

    _launcher_class: type  # Lightning's ``_SubprocessScriptLauncher``: the Trainer's, or Fabric's

    @property
    def root_device(self) -> torch.device:
        """This rank's device."""
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        """Processes per node (the devices given)."""
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def process_group_backend(self) -> str | None:
        """The backend of the process group once created (None before)."""
        return self._process_group_backend

    def _get_process_group_backend(self) -> str:
        """The backend in use (or about to be: gloo on a CPU, nccl on CUDA), as Lightning's."""
        return self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)

    def _determine_device_ids(self) -> list[int] | None:
        """The rank's device index on an accelerator, else None (Lightning's barrier asks; ours is watched)."""
        return None if self.root_device.type == "cpu" else [self.root_device.index]

    def set_world_ranks(self) -> None:
        """Global rank and world size from the node rank, local rank and processes per node."""
        set_world_ranks(self)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Over every rank; in a 2-D run over "data_parallel" (tensor-parallel peers read the same rows)."""
        return self._parallel.sampler_kwargs(self.num_nodes * self.num_processes, self.global_rank)

    @property
    def device_mesh(self) -> Any:
        """The ``("data_parallel", "tensor_parallel")`` mesh of a 2-D run (once the process groups
        exist), else the hybrid strategies' ``(replicate, shard)`` mesh, else None."""
        return self._parallel.mesh if self._parallel.active else self._device_mesh

    def _configure_launcher(self) -> None:
        """Lightning's script launcher in every process, as DDP: under torchrun, SLURM or in the ranks
        Lightning's launcher starts it starts nothing, but sets the thread count DDP gives each rank
        (CPUs / processes per node, unless OMP_NUM_THREADS is set), which only rank 0 got before."""
        assert self.cluster_environment is not None
        self._launcher = self._launcher_class(self.cluster_environment, self.num_processes, self.num_nodes)

    def _set_ranks_and_mesh_shape(self) -> None:
        """Set the ranks, and check the mesh against the world size (before any process group exists)."""
        self.set_world_ranks()
        self._device_mesh = mesh_shape(self._device_mesh, self.sharding_strategy, self.num_nodes, self.num_processes)

    def _open_process_groups(self, dump_dir: str | None) -> Any:
        """Create the process group(s), start the watchdog on them (failing ranks' rings dumped into
        ``dump_dir``), build the hybrid strategies' mesh and, in a 2-D run, the ("data_parallel",
        "tensor_parallel") mesh, whose coordinates the watchdog's reports then name ("rank 3 (data 1,
        tensor 1)"). Returns that 2-D mesh, or None."""
        assert self.cluster_environment is not None
        environment, device = self.cluster_environment, self.root_device
        self._process_group_backend = connect(environment, self._process_group_backend, device, self._timeout)
        self._watch.start(self.collective_timeout, self.node_rank, dump_dir)
        self._device_mesh = build_mesh(self._device_mesh, device.type)
        if not self._parallel.active:
            return None
        mesh = self._parallel.build(self.num_nodes, self.num_processes, device)
        if self._watch.dog is not None:
            self._watch.dog.reports.layout = tuple(mesh.shape)  # "rank 3 (data 1, tensor 1; node 0, ...)"
        return mesh

    def barrier(self, name: str | None = None) -> None:
        """Wait for every rank, watched ([Note: watchdog]; device-aware on NCCL)."""
        self._watch.barrier(name, self.root_device)

    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        """Rank ``src``'s ``obj`` on every rank, watched."""
        return self._watch.broadcast(obj, src)

    def reduce(self, tensor: Tensor | Any, group: Any = None, reduce_op: ReduceOp | str | None = "mean") -> Tensor:
        """Lightning's reduce over ``group``, watched; anything but a tensor is returned as it is."""
        return self._watch.reduce(tensor, group, reduce_op)
