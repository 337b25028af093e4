"""A memory plan of a 2-D run: the (data_parallel, tensor_parallel) mesh in the fake world and the
model's tensor-parallel plan applied to the plan's meta copy, as the strategies do in training.

[Note: planning tensor parallel]
The plan applies the model's own tensor-parallel plan, so nothing is modelled twice: a
LightningModule's ``configure_model`` runs with ``device_mesh`` set (Lightning's
``ModelParallelStrategy`` convention, which ``FSDPCustomStrategy`` follows), a plain module goes
through ``parallelize_fn(module, device_mesh)`` (Fabric's). The engine then shards over
"data_parallel" only, on rank 0 of the fake world: tensors the plan splits are 1/tp of the model's
before the engine divides their rows by dp, replicated ones are divided by dp, and activations are
what the plan's styles leave on a rank (divided where they shard them: colwise outputs,
sequence-parallel norms), because the forward runs the plan's own DTensor code on fake tensors.
Costs: one mesh of two fake process groups.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

from fsdp_strategy.options import check_parallel_sizes


@dataclasses.dataclass(frozen=True)
class TensorParallelPlan:
    """The data- and tensor-parallel sizes of a planned 2-D run and how its plan is applied."""

    data: int
    tensor: int
    parallelize_fn: Callable[[nn.Module, Any], Any] | None

    @classmethod
    def take(cls, strategy_kwargs: dict[str, Any], world_size: int, num_nodes: int) -> TensorParallelPlan | None:
        """Take ``data_parallel_size``, ``tensor_parallel_size`` and ``parallelize_fn`` out of
        ``strategy_kwargs`` (None: a 1-D plan); "auto" (or not given) tensor parallel is the devices
        per node, as ``ModelParallelStrategy`` means it, and data parallel the rest of the world.
        Raises a ``ValueError`` naming the bad value: sizes that do not multiply to ``world_size``, or
        that the strategies refuse."""
        sizes = strategy_kwargs.pop("data_parallel_size", None), strategy_kwargs.pop("tensor_parallel_size", None)
        parallelize_fn = strategy_kwargs.pop("parallelize_fn", None)
        hybrid = "HYBRID" in str(strategy_kwargs.get("sharding_strategy", "")).upper()
        budget = strategy_kwargs.get("auto_wrap_policy") == "auto"
        given = check_parallel_sizes(*sizes, hybrid, strategy_kwargs.get("device_mesh"), budget)
        if given is None:
            if parallelize_fn is not None:
                raise ValueError("parallelize_fn is the plan of a 2-D run: give tensor_parallel_size too")
            return None
        tensor = world_size // num_nodes if given[1] == "auto" else given[1]
        if given[0] == "auto" and world_size % tensor:
            raise ValueError(
                f"tensor_parallel_size={tensor} does not divide world_size={world_size}; accepted: a tensor-parallel "
                "size dividing the world size (the data-parallel size is the rest)"
            )
        data = world_size // tensor if given[0] == "auto" else given[0]
        if data * tensor != world_size:
            raise ValueError(
                f"data_parallel_size={data} x tensor_parallel_size={tensor} is {data * tensor}, not world_size="
                f"{world_size}; accepted: sizes that multiply to the world size"
            )
        if parallelize_fn is not None and not callable(parallelize_fn):
            raise TypeError(
                f"parallelize_fn is a {type(parallelize_fn).__name__}; accepted: a callable "
                "(module, device_mesh) -> module"
            )
        return cls(data, tensor, parallelize_fn)

    def mesh(self) -> Any:
        """The ``(data_parallel, tensor_parallel)`` mesh, in the fake world (a plan's rank 0)."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh("cpu", (self.data, self.tensor), mesh_dim_names=("data_parallel", "tensor_parallel"))

    def settings(self) -> dict[str, Any]:
        """What a MemoryPlan reports of it."""
        return {"data_parallel_size": self.data, "tensor_parallel_size": self.tensor}


def apply_plan(module: nn.Module, mesh: Any, parallelize_fn: Callable | None) -> nn.Module:
    """``module`` (the plan's meta copy, ``configure_model`` not run yet) with its tensor-parallel plan
    applied ([Note: planning tensor parallel]); a plain module without ``parallelize_fn`` is refused."""
    import torch
    from lightning.pytorch import LightningModule

    if isinstance(module, LightningModule) and parallelize_fn is None:
        module._device_mesh = mesh
        with torch.device("meta"), _named_failure(f"{type(module).__name__}.configure_model"):
            module.configure_model()
        return module
    if parallelize_fn is None:
        raise ValueError(
            f"tensor_parallel_size needs the model's tensor-parallel plan: a LightningModule whose configure_model "
            f"applies it to self.device_mesh['tensor_parallel'], or parallelize_fn=(module, device_mesh) -> module "
            f"for {type(module).__name__}"
        )
    name = getattr(parallelize_fn, "__name__", type(parallelize_fn).__name__)
    with torch.device("meta"), _named_failure(f"parallelize_fn {name} on {type(module).__name__}"):
        parallelized = parallelize_fn(module, mesh)
    if not isinstance(parallelized, nn.Module):
        raise TypeError(f"parallelize_fn returned {type(parallelized).__name__}; accepted: the module")
    return parallelized


@contextmanager
def _named_failure(what: str) -> Iterator[None]:
    """A failure of the user's plan (an attribute it does not find, a size it cannot split) as a
    ``ValueError`` naming the plan and the model; the original is its cause."""
    try:
        yield
    except (AttributeError, KeyError, IndexError, TypeError, ValueError, RuntimeError) as error:
        raise ValueError(f"{what} failed: {type(error).__name__}: {error}") from error
