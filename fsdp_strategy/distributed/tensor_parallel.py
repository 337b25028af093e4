"""The (data_parallel, tensor_parallel) mesh of a 2-D run, shared by the Trainer and Fabric strategies.

With ``data_parallel_size`` / ``tensor_parallel_size`` given, a strategy builds Lightning's
``ModelParallelStrategy`` mesh (its ``_setup_device_mesh``: TP inner, consecutive ranks; the same
error for sizes that do not multiply to the world size), hands it to the user's code (the
LightningModule's ``device_mesh`` before ``configure_model``; Fabric's ``parallelize_fn``), shards
over its "data_parallel" group, and samples over it: tensor-parallel peers read the same rows.
Neither given: nothing here runs ([Note: tensor parallel parameters] in engine/tensor_parallel.py).
"""

from __future__ import annotations

from typing import Any


class ParallelMesh:
    """The 2-D mesh a strategy owns, from the sizes as given (ints or "auto"; None: a 1-D run).
    Costs: one mesh (two process groups) at setup."""

    def __init__(self, sizes: tuple[int | str, int | str] | None) -> None:
        self.sizes = sizes
        self.mesh: Any = None

    @property
    def active(self) -> bool:
        """Whether this run is 2-D (sizes were given)."""
        return self.sizes is not None

    def build(self, num_nodes: int, num_processes: int, device: Any) -> Any:
        """The mesh, once the process group exists: "auto" data parallel is ``num_nodes``, "auto" tensor
        parallel ``num_processes`` (``ModelParallelStrategy``'s meaning). Raises Lightning's
        ``RuntimeError`` for sizes whose product is not the world size."""
        from lightning.fabric.strategies.model_parallel import _setup_device_mesh

        assert self.sizes is not None
        data, tensor = self.sizes
        data = num_nodes if data == "auto" else data
        tensor = num_processes if tensor == "auto" else tensor
        self.mesh = _setup_device_mesh(data, tensor, num_nodes * num_processes, device)
        return self.mesh

    @property
    def data_parallel_group(self) -> Any:
        """The process group the engine shards over (None: the strategy's default)."""
        return self.mesh["data_parallel"].get_group() if self.mesh is not None else None

    def sampler_kwargs(self, world_size: int, global_rank: int) -> dict[str, int]:
        """A DistributedSampler's replicas and rank: over "data_parallel" (TP peers read the same rows)."""
        if self.mesh is None:
            return {"num_replicas": world_size, "rank": global_rank}
        data = self.mesh["data_parallel"]
        return {"num_replicas": data.size(), "rank": data.get_local_rank()}

    def describe(self) -> str:
        """How the ranks are laid out, for the setup line ("" for a 1-D run)."""
        if self.mesh is None:
            return ""
        data, tensor = self.mesh["data_parallel"].size(), self.mesh["tensor_parallel"].size()
        return f" ({data} data-parallel x {tensor} tensor-parallel)"
