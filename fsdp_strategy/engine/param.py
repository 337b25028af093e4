"""ShardedParam: one original parameter as a dim-0 shard at rest and a full tensor while gathered.

[Note: shard layout]
A parameter of shape ``(d0, *rest)`` is viewed as ``d0`` rows of ``prod(rest)`` elements
(a 0-dim parameter as one row of one element). With ``c = ceil(d0 / N)`` over a shard group
of N ranks, rank r keeps rows ``[r*c, (r+1)*c)`` (torch.chunk semantics), zero-padded to c
rows, so every rank's shard has the same size. The gathered buffer is the rank-major
concatenation of the N padded shards; the full parameter is its first ``d0`` rows.
Padding rows stay zero: their gradients are zero, so optimizers leave them at zero. A
tensor-parallel (DTensor) parameter's rows are those of its TP-local tensor ([Note: tensor parallel
parameters] in tensor_parallel.py).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.tensor import DTensor

from fsdp_strategy.engine.device import DeviceLayer
from fsdp_strategy.engine.flat import complex_from_real, real_view
from fsdp_strategy.engine.param_hooks import move_grad_hooks, register_post_accumulate
from fsdp_strategy.engine.tensor_parallel import TPSpec, local_of


class ShardLayout(NamedTuple):
    """Where a parameter's shard goes: its rank and group size, devices and gathered dtype."""

    rank: int  # this rank's index in the shard group
    size: int  # ranks in the shard group
    storage_device: torch.device  # where the shard lives (the CPU with offload)
    compute_device: torch.device  # where the full parameter is gathered
    param_dtype: torch.dtype | None  # dtype of a floating full parameter; None: the parameter's own
    device_layer: DeviceLayer | None = None  # keeps the shard (pinned when offloaded from CUDA); None: as is


class ParamUse(NamedTuple):
    """A place a parameter is registered: ``module._parameters[name]``."""

    module: nn.Module
    name: str


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors view the same storage the same way (``is_set_to`` without its pointer test)."""
    same = a.untyped_storage()._cdata == b.untyped_storage()._cdata
    return same and (a.storage_offset(), a.shape, a.stride()) == (b.storage_offset(), b.shape, b.stride())


def _free_storage(tensor: torch.Tensor) -> None:
    storage = tensor.untyped_storage()
    if storage.size() != 0:
        storage.resize_(0)


class ShardedParam:
    """One parameter's shard, the full tensor it gathers into, and the swap between the two.

    The sharded ``nn.Parameter`` (what the optimizer sees) and the unsharded one (what the
    module computes with while gathered) are both created once and keep their identity; the
    unsharded one's storage is allocated before each use and freed after (see
    [Note: shard layout]). Costs at rest: ``c * prod(rest)`` elements of the original dtype.

    [Note: aliased shards] With a shard group of one (one rank, NO_SHARD), no mixed precision
    and no offload, the shard *is* the full parameter: the unsharded parameter shares its
    storage, nothing is gathered, copied or freed, and memory stays that of DDP.
    """

    def __init__(self, fqn: str, param: nn.Parameter, uses: list[ParamUse], layout: ShardLayout) -> None:
        shard_rank, shard_size = layout.rank, layout.size
        storage_device, compute_device = layout.storage_device, layout.compute_device
        self.fqn = fqn
        self.uses = uses
        self.replaced = weakref.ref(param)  # the model's parameter before sharding (an optimizer may still hold it)
        self.tp = TPSpec.of(param)  # None: a plain parameter ([Note: tensor parallel parameters])
        requires_grad = param.requires_grad  # a DTensor's, not its local tensor's
        original, param = param, local_of(param)
        self.shape = param.shape
        self.dim0 = param.shape[0] if param.dim() > 0 else 1
        self.row_numel = math.prod(param.shape[1:])
        self.row_shape = tuple(param.shape[1:])
        self.world = shard_size
        self.shard_rank = shard_rank
        self.chunk_rows = math.ceil(self.dim0 / shard_size)
        self.shard_numel = self.chunk_rows * self.row_numel
        floating = layout.param_dtype is not None and param.is_floating_point()
        self.param_dtype = layout.param_dtype if floating else param.dtype  # a complex one stays complex
        self.real_row_numel = self.row_numel * (2 if param.is_complex() else 1)  # its real pairs, per row
        self.real_shard_numel = self.chunk_rows * self.real_row_numel  # its columns in a reduce buffer

        rows = param.detach().reshape(self.dim0, self.row_numel)
        local = rows[shard_rank * self.chunk_rows : (shard_rank + 1) * self.chunk_rows]
        shard = torch.zeros(self.chunk_rows, self.row_numel, dtype=param.dtype, device=storage_device)
        shard[: local.shape[0]].copy_(local)
        if layout.device_layer is not None:
            shard = layout.device_layer.storage_tensor(shard)
        self.sharded = nn.Parameter(shard.view(self.chunk_rows, *self.row_shape), requires_grad=requires_grad)

        self.aliased = shard_size == 1 and self.param_dtype == param.dtype and storage_device == compute_device
        if self.aliased:  # [Note: aliased shards]; .data: a version counter of its own
            self._padded_full = self.sharded.data.view(-1)
        else:
            self._padded_full = torch.empty(
                self.world * self.shard_numel, dtype=self.param_dtype, device=compute_device
            )
        self._full = self._padded_full[: self.dim0 * self.row_numel].view(self.shape)
        # views of the full parameter's storage, made once: they follow its storage through each resize
        self._full_rows = self._padded_full.view(self.world, self.shard_numel)  # a gather's layout
        self._own_rows = self._full.view(self.dim0, self.row_numel)[shard_rank * self.chunk_rows :][: self.chunk_rows]
        self._even = self.chunk_rows > 0 and self.chunk_rows * self.world == self.dim0  # no padding rows
        self.unsharded = nn.Parameter(self._wrapped(self._full), requires_grad=requires_grad)
        move_grad_hooks(original, self.sharded, self.unsharded)  # [Note: gradient hooks on parameters]
        self._agreed_requires_grad = requires_grad  # [Note: requires_grad on either side]
        self.stashed_grad: torch.Tensor | None = None  # no_sync: the full gradient so far, in reduce dtype
        self._stash_mark: tuple[weakref.ref, int] | None = None  # sharded.grad and its version at the stash
        self._filled_version = 0  # the full parameter's version counter when it was last filled
        self.free_unsharded()

    @property
    def global_shape(self) -> torch.Size:
        """The parameter's shape in the model: a tensor-parallel one's whole, not its block's."""
        return self.tp.shape if self.tp is not None else self.shape

    def _wrapped(self, local: torch.Tensor) -> torch.Tensor:
        """The module's view of a full local tensor: itself, or its DTensor for a TP parameter."""
        return local if self.tp is None else self.tp.wrap(local)

    def _holds_full(self) -> bool:
        """Whether the full parameter still holds the engine's storage (not new ``.data``). On a memory
        plan's fake tensors ``is_set_to`` is False for a view of the same storage (a tensor-parallel
        parameter's local tensor is one), so there the storage and the view are compared."""
        local = self.unsharded if self.tp is None else local_of(self.unsharded)  # a call less per plain one
        if local.is_set_to(self._full):
            return True
        return isinstance(local, FakeTensor) and _same_view(local, self._full)

    def _local_grad(self, grad: torch.Tensor | None) -> torch.Tensor | None:
        """A gradient of the full parameter as its local tensor (a TP one in its placements)."""
        return grad if grad is None or self.tp is None else self.tp.local_grad(grad)

    @property
    def unsharded_allocated(self) -> bool:
        """Whether the full parameter currently holds memory (always, when aliased)."""
        return self._padded_full.untyped_storage().size() != 0

    @property
    def unsharded_nbytes(self) -> int:
        """Bytes gathering adds: the full parameter, padding included (0 when aliased)."""
        return 0 if self.aliased else self._padded_full.numel() * self._padded_full.element_size()

    @property
    def trainable(self) -> bool:
        """Whether the parameter trains now (``requires_grad``, reconciled: see below)."""
        self.sync_requires_grad()
        return self.sharded.requires_grad

    def sync_requires_grad(self) -> None:
        """Make ``requires_grad`` of the sharded and the full parameter agree, at any time.

        [Note: requires_grad on either side]
        A user freezes or unfreezes whichever tensor the module holds at that moment: the shard
        between steps (``toggle_optimizer``, callbacks), the full parameter while its unit is
        gathered (``self.disc.requires_grad_(False)`` inside ``training_step``). The side whose
        flag differs from the value agreed at the last sync was changed since, and wins.
        """
        sharded, full = self.sharded.requires_grad, self.unsharded.requires_grad
        if sharded == full:
            self._agreed_requires_grad = sharded
            return
        value = full if sharded == self._agreed_requires_grad else sharded
        self.sharded.requires_grad_(value)
        self.unsharded.requires_grad_(value)
        self._agreed_requires_grad = value

    def install(self, unsharded: bool) -> None:
        """Register the unsharded (or sharded) parameter at every place the parameter is used."""
        tensor = self.unsharded if unsharded else self.sharded
        for use in self.uses:
            if unsharded:
                self._check_registered(use)
            use.module._parameters[use.name] = tensor

    def _check_registered(self, use: ParamUse) -> None:
        """Refuse a parameter replaced after sharding: the engine would install its own over it and
        train that, the replacement silently dropped. Costs: a dict lookup."""
        current = use.module._parameters.get(use.name)
        if current is self.sharded or current is self.unsharded:
            return
        now = "removed" if current is None else f"now a {type(current).__name__}"
        if isinstance(current, DTensor):
            fix = (
                "A DTensor: a tensor-parallel plan (parallelize_module) applied after sharding? Apply it before: in "
                "configure_model (the strategy shards after it), before fabric.setup_module, or in "
                "FSDPCustomFabricStrategy(parallelize_fn=...)"
            )
        else:
            fix = (
                "Add or replace parameters (new layers, adapters, parametrizations) before sharding: in "
                "configure_model, or before fabric.setup_module; to change a value, edit the parameter in place"
            )
        raise RuntimeError(
            f"fsdp_custom: the parameter {self.fqn!r} ({use.name!r} of a {type(use.module).__name__}) is no longer the "
            f"engine's ({now}): it was replaced after the model was sharded, and the engine would train its own "
            f"shard instead. {fix}"
        )

    def allocate_unsharded(self) -> torch.Tensor:
        """Allocate the full parameter's memory (if freed) and return it as ``(N, shard_numel)``
        rows, the layout of its slice of a gather, for the caller to fill ([Note: shard layout]).

        Autograd saved the full parameter at its forward version; refilling it for backward
        writes the same values, so fill it under ``_unsafe_preserve_version_counter``.
        """
        if not self._holds_full():  # ``.data`` replaced while sharded: ours again
            self.unsharded.data = self._wrapped(self._full)
        if not self.unsharded_allocated:
            self._padded_full.untyped_storage().resize_(self.unsharded_nbytes)
        return self._full_rows

    def rows_to_keep(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(shard rows, full rows)``: this rank's rows of the shard and of the full parameter's
        current value, for edits.py's ``keep_full_edits`` ([Note: edits while gathered]).

        A full parameter whose ``.data`` was replaced (``p.data = ...``) gives its new value and is
        pointed back at the engine's storage. Costs: a few views (none of the full parameter's own
        rows: made once)."""
        rows = self._own_rows
        if not self._holds_full():
            value = local_of(self.unsharded).detach()
            if value.shape != self.shape:
                raise RuntimeError(
                    f"fsdp_custom: the full parameter {self.fqn!r} was given data of shape {tuple(value.shape)} "
                    f"while gathered; its shape is {tuple(self.shape)}"
                )
            self.unsharded.data = self._wrapped(self._full)
            rows = value.reshape(self.dim0, self.row_numel)[self.shard_rank * self.chunk_rows :][: self.chunk_rows]
        target = self.sharded.detach().view(self.chunk_rows, self.row_numel)[: rows.shape[0]]
        return target, rows

    def lost_edit_check(self) -> torch.Tensor:
        """Where the full parameter is gathered in a lower ``param_dtype``, whose changes its shard
        cannot keep exactly: a 0-dim bool tensor on the device, True where this rank's rows differ
        from the shard, for the caller to read when it syncs anyway; nothing is changed ([Note: edits
        while gathered] in edits.py, which copies the changes of the other parameters). Costs: a
        comparison of this rank's rows (1/N of the parameter)."""
        target, rows = self.rows_to_keep()
        kept = target.to(rows.device, rows.dtype)
        return ~((rows == kept) | (rows.isnan() & kept.isnan())).all()

    def mark_filled(self) -> None:
        """Note that the full parameter now holds the gathered values (see ``visibly_edited``)."""
        self._filled_version = self.unsharded._version

    def visibly_edited(self) -> bool:
        """Whether the full parameter was changed since it was filled in a way that leaves a trace:
        an in-place operation on it (its version counter) or new ``.data``. Edits through
        ``p.data.<op>_()`` leave none. Costs: two attribute reads."""
        return self.unsharded._version != self._filled_version or not self._holds_full()

    def free_unsharded(self) -> None:
        """Release the full parameter's memory (its gradient, if any, is kept); never an aliased shard."""
        if self.aliased:
            return
        if not self._padded_full.untyped_storage().resizable():
            raise RuntimeError(
                f"fsdp_custom: the full parameter {self.fqn!r} was handed to NumPy (`.numpy()` shares its memory and "
                "makes it impossible to free for good). Copy it instead: `param.detach().clone().numpy()`"
            )
        _free_storage(self._padded_full)

    @property
    def stashed_nbytes(self) -> int:
        """Bytes of the full gradient kept between micro-batches (0 unless inside ``no_sync``)."""
        stashed = self.stashed_grad
        return 0 if stashed is None else stashed.numel() * stashed.element_size()

    def stash_grad(self, dtype: torch.dtype) -> int:
        """Move the full gradient into ``stashed_grad`` (summed in ``dtype``) and clear it: no_sync.

        Returns the bytes this newly keeps (the first micro-batch's gradient, in ``dtype``).
        """
        grad = self._local_grad(self.unsharded.grad)
        if grad is None:
            return 0
        self.unsharded.grad = None
        if self.stashed_grad is not None:
            self.stashed_grad += grad.detach()
            return 0
        self.stashed_grad = grad.detach().to(dtype if grad.is_floating_point() else grad.dtype)  # complex stays
        if self.sharded.grad is None:  # [Note: zero_grad under no_sync]: a gradient for zero_grad to clear
            self.sharded.grad = torch.zeros_like(self.sharded)
        self._stash_mark = (weakref.ref(self.sharded.grad), self.sharded.grad._version)
        return self.stashed_nbytes

    def register_grad_hooks(self, on_full: Callable, on_shard: Callable) -> None:
        """Hooks after a gradient accumulates into the full parameter (``on_full``) and, unless they
        are one tensor, into the shard (``on_shard``: a use of the shard outside its unit), kept when
        the parameter is unfrozen later ([Note: a backward no unit hook sees] in runtime.py). None for an
        integer parameter (frozen for good: autograd refuses ``requires_grad`` on it)."""
        for tensor, hook in ((self.unsharded, on_full), (None if self.aliased else self.sharded, on_shard)):
            if tensor is not None and (tensor.is_floating_point() or tensor.is_complex()):
                register_post_accumulate(tensor, hook)

    def stash_cleared(self) -> bool:
        """[Note: zero_grad under no_sync] Whether the gradients were zeroed since the stash began:
        ``zero_grad`` (to None, or in place) of the module, a submodule or an optimizer, between the
        micro-batches of a ``no_sync`` accumulation. The stash, a gradient of the full parameter no
        optimizer sees, is then void, as the accumulated ``grad`` of one process or DDP would be: a
        ``stash_grad`` keeps the parameter's ``grad`` (zeros if it had none: 1/N of the full
        gradient's bytes, which the reduction allocates anyway; an optimizer stepping inside
        ``no_sync`` sees zeros, not None) and its version, and the next stash or reduction checks
        them. Costs: per parameter and micro-batch, a weak reference and a version read."""
        if self.stashed_grad is None or self._stash_mark is None:
            return False
        grad, (marked, version) = self.sharded.grad, self._stash_mark
        return grad is None or grad is not marked() or grad._version != version

    def take_grad_rows(self, out: torch.Tensor) -> bool:
        """Write the full gradient (stashed + current) into ``out`` (this parameter's ``(N, shard_numel)``
        columns of a reduce buffer, twice that for a complex one's real pairs: [Note: flat buffers of
        any dtype] in flat.py; padding rows zero) and clear both; zeros and False without one."""
        grad, stashed = self._local_grad(self.unsharded.grad), self.stashed_grad
        self.unsharded.grad = self.stashed_grad = None
        if grad is None and stashed is None:
            out.zero_()
            return False
        if stashed is None and self._even:  # no padding rows: every rank's rows are a row of ``out``
            out.copy_(real_view(grad.detach()).reshape(out.shape))
            return True
        padded = out.view(self.world, self.chunk_rows, self.real_row_numel)
        first, second = (stashed, grad) if stashed is not None else (grad, None)
        full_chunks, rest = self._write_rows(padded, first.detach(), add=False)
        if second is not None:
            self._write_rows(padded, second.detach(), add=True)
        if full_chunks < self.world:  # [Note: shard layout]: padding rows stay zero
            padded[full_chunks, rest:].zero_()
            padded[full_chunks + 1 :].zero_()
        return True

    def _write_rows(self, padded: torch.Tensor, full: torch.Tensor, add: bool) -> tuple[int, int]:
        """Copy (or add) a full-shape tensor (its real pairs) into ``(N, c, row)`` padded rows without a
        padded temporary."""
        if self.chunk_rows == 0:  # an empty parameter (dim 0 of size 0): no rows, no padding
            return self.world, 0
        rows = real_view(full).view(self.dim0, self.real_row_numel)
        full_chunks, rest = divmod(self.dim0, self.chunk_rows)
        write = torch.Tensor.add_ if add else torch.Tensor.copy_
        if full_chunks:
            write(padded[:full_chunks], rows[: full_chunks * self.chunk_rows].reshape(full_chunks, self.chunk_rows, -1))
        if rest:
            write(padded[full_chunks, :rest], rows[full_chunks * self.chunk_rows :])
        return full_chunks, rest

    def drop_grads(self) -> None:
        """Discard the full and stashed gradients (a frozen parameter, or a failed iteration)."""
        self.unsharded.grad = self.stashed_grad = None

    def accumulate_sharded_grad(self, reduced: torch.Tensor, device_layer: DeviceLayer) -> None:
        """Add this parameter's slice of a reduced gradient shard (real pairs for a complex one) into
        ``sharded.grad`` (brought to the shard's device and dtype by ``device_layer``)."""
        if self.sharded.is_complex():
            reduced = complex_from_real(reduced, self.sharded.dtype)
        accumulate = self.sharded.grad is not None
        grad = device_layer.grad_to_storage(reduced, self.sharded, self.fqn, accumulate)
        if not accumulate:
            self.sharded.grad = grad
        else:
            self.sharded.grad += grad

    def full_from_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """A full tensor of this parameter's shape from its ``(N, shard_numel)`` slice of a gather."""
        return rows.reshape(self.world * self.chunk_rows, self.row_numel)[: self.dim0].reshape(self.shape)

    def shard_of_full(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's zero-padded shard of a tensor of the parameter's global shape (a full
        checkpoint's): a tensor-parallel parameter's rows are those of this rank's TP block."""
        return self.local_rows(full if self.tp is None else self.tp.block_of(full), self.shard_rank)

    def local_rows(self, full: torch.Tensor, shard_rank: int) -> torch.Tensor:
        """This rank's zero-padded shard of a full tensor of this parameter's shape."""
        rows = full.reshape(self.dim0, self.row_numel)[
            shard_rank * self.chunk_rows : (shard_rank + 1) * self.chunk_rows
        ]
        shard = rows.new_zeros(self.chunk_rows, self.row_numel)
        shard[: rows.shape[0]].copy_(rows)
        return shard.view(self.sharded.shape)
