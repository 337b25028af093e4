"""The device layer: every pinned buffer, ``non_blocking`` copy and CUDA event the engine makes.

The rest of the engine issues its work on the current (compute) stream and never touches an
event or a pinned buffer itself; collectives run on the process group's own stream, which waits
for the stream that issued them, and ``wait()`` makes the compute stream wait for them
(collectives.py). What remains is where the host and the device meet:

[Note: host and device]
On CUDA the host enqueues work and runs ahead of the device. Four things follow, each handled
here and nowhere else:
1. Offloaded shards (CPU, pinned) are copied to the device ``non_blocking`` for a gather: the
   copy reads the shard after the host has moved on, so before the host writes shards again (an
   optimizer step on the CPU) it waits for every such copy: ``before_host_writes_shards``.
2. Offloaded gradients are copied to pinned host memory ``non_blocking`` (unless they are added
   into an existing gradient, which the host does itself): the host must not read them before the
   copy lands, so the end of backward waits for them: ``before_host_reads_grads`` (FSDP2 waits in
   the same place). The end of backward waits for the shard copies of 1 too: an optimizer
   stepping with a closure (Lightning's default) runs forward and backward inside ``step``,
   after its pre-step hook, and updates the shards right after.
3. Nothing else bounds how far the host runs ahead: every unit it gathers ahead holds a gather
   buffer. As FSDP1's rate limiter does, a reshard records an event, and a gather waits for the
   event of the reshard two back (``before_gather``): at most two units' full parameters are in
   use on the device beyond the ones being gathered.
4. A check the engine computes on the device (a change a lower ``param_dtype`` could not keep,
   an order stamp) is never read by the host inside a step: each read would stall it until the
   device drains, and the next gather could not be issued ahead. The flag is copied to pinned
   memory ``non_blocking`` with an event (``copy_to_host``), and read once the event says it
   landed: at the end of a later backward or the start of a later iteration. The other way, a
   small value made on the host (a digest of an optimizer's settings) goes to the device through
   ``copy_from_host``: staged in pinned memory and copied ``non_blocking``; a plain ``.to(device)``
   waits for the device to drain.
On the CPU there is no running ahead: copies are done when they return and all four are free.

``FSDP_CUSTOM_STREAM_CHECK=1`` replaces the layer of every engine in the process by
``StreamCheck``, a CPU model of those semantics: it treats the copies between offloaded shards
and the compute device as in flight until their wait, as CUDA does, and raises naming the
tensor, the copy and the missing wait when the host reads or writes one before it.
"""

from __future__ import annotations

import os
from collections import deque
from typing import Any, NamedTuple

import torch

RUN_AHEAD = 2  # reshards the host may be ahead of the device before a gather waits ([Note: host and device] 3)


class HostCopy(NamedTuple):
    """A device tensor's copy in host memory, started without blocking ([Note: host and device] 4)."""

    value: torch.Tensor  # valid once ``landed()``
    event: Any  # the CUDA event recorded after the copy; None where the copy was done at once

    def landed(self) -> bool:
        """Whether ``value`` may be read without waiting for the device. Costs: one event query."""
        return self.event is None or bool(self.event.query())

    def wait(self) -> torch.Tensor:
        """``value``, waiting for the copy first (a device sync: only outside a step)."""
        if self.event is not None:
            self.event.synchronize()
        return self.value


class DeviceLayer:
    """The host/device boundary of one sharded model ([Note: host and device]).

    ``compute``: where full parameters and collectives live; ``storage``: where shards live (the
    CPU with offload). Every copy and event is on the compute device's current stream, so waiting
    for the last event of a kind waits for all before it. Costs on CUDA: one event per offloaded
    copy and per reshard; on the CPU: nothing.
    """

    def __init__(self, compute: torch.device, storage: torch.device) -> None:
        self.compute, self.storage = compute, storage
        self.offloaded = storage != compute
        self.asynchronous = compute.type == "cuda"  # the host runs ahead of the device
        self._pin = self.asynchronous and storage.type == "cpu"
        self._last: dict[str, Any] = {}  # wait -> the last event it waits for (1, 2)
        self._reshards: deque[Any] = deque()  # events: units freed on the device (3)

    # ---- buffers ------------------------------------------------------------------------

    def storage_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` (on the storage device) as a shard is kept: pinned when it is offloaded from
        a CUDA device, so copies to and from the device can be ``non_blocking``."""
        return tensor.pin_memory() if self._pin else tensor

    @staticmethod
    def copy_to_host(tensor: torch.Tensor) -> HostCopy:
        """Start copying a small device ``tensor`` (a flag) to host memory without blocking
        ([Note: host and device] 4). On CUDA: pinned memory and an event on the tensor's device's
        current stream; elsewhere the tensor itself, landed at once."""
        if tensor.device.type != "cuda":
            return HostCopy(tensor.detach(), None)
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        with torch.cuda.device(tensor.device):
            host.copy_(tensor, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        return HostCopy(host, event)

    @staticmethod
    def copy_from_host(values: torch.Tensor, device: torch.device) -> torch.Tensor:
        """A small tensor made on the host, on ``device`` without a host wait ([Note: host and device] 4).
        On CUDA it is copied into a new pinned block of torch's caching host allocator, which keeps the
        block until the ``non_blocking`` copy has read it (an event), so ``values`` may change at once; a
        blocking copy, or one from pageable memory (which CUDA may synchronize), would wait for the
        device. Costs: two copies of its bytes."""
        staged = values
        if device.type == "cuda" and values.device.type == "cpu":
            staged = torch.empty(values.shape, dtype=values.dtype, pin_memory=True).copy_(values)
        return staged.to(device, non_blocking=True)

    # ---- copies -------------------------------------------------------------------------

    def copy_shards_in(self, pieces: list[torch.Tensor], shards: list[torch.Tensor], unit: str) -> None:
        """Copy each shard into its piece of a gather buffer (on the compute device); offloaded
        shards go ``non_blocking`` ([Note: host and device] 1)."""
        torch._foreach_copy_(pieces, shards, non_blocking=True)
        if self.offloaded and self.asynchronous:
            self._issued("before_host_writes_shards", f"copy of unit {unit!r}'s shards to the device", shards)

    def grad_to_storage(self, reduced: torch.Tensor, shard: torch.Tensor, fqn: str, accumulate: bool) -> torch.Tensor:
        """A reduced gradient shard (on the compute device) as a tensor shaped, typed and placed
        like ``shard``. Offloaded and not ``accumulate``d into an existing gradient: a
        ``non_blocking`` copy into pinned memory, valid after ``before_host_reads_grads``
        ([Note: host and device] 2)."""
        reduced = reduced.view(shard.shape)
        if not (self.offloaded and self.asynchronous) or accumulate:
            if reduced.dtype == shard.dtype and reduced.device == shard.device:
                return reduced  # what ``to`` returns, without its call
            return reduced.to(device=shard.device, dtype=shard.dtype)
        out = torch.empty(shard.shape, dtype=shard.dtype, device=shard.device, pin_memory=self._pin)
        out.copy_(reduced, non_blocking=True)
        self._issued("before_host_reads_grads", f"copy of {fqn}'s gradient to host memory", [out])
        return out

    # ---- waits --------------------------------------------------------------------------

    def before_host_writes_shards(self) -> None:
        """Wait for every shard copy to the device still in flight (before an optimizer step)."""
        self._wait("before_host_writes_shards")

    def before_host_reads_grads(self) -> None:
        """Wait for every gradient copy to host memory still in flight (at the end of backward)."""
        self._wait("before_host_reads_grads")

    def resharded(self) -> None:
        """A unit's full parameters were freed on the compute stream ([Note: host and device] 3)."""
        if self.compute.type == "cuda":
            self._reshards.append(self._record())

    def before_gather(self) -> None:
        """Wait until the device is at most ``RUN_AHEAD`` reshards behind the host."""
        while len(self._reshards) >= RUN_AHEAD:
            self._reshards.popleft().synchronize()

    def check_optimizer_step(self, optimizer: Any) -> None:
        """Called right after an optimizer step (before anything is copied again); ``StreamCheck``
        checks that no copy its update raced with is still in flight."""

    def close(self) -> None:
        """Wait for everything in flight (a failed iteration, or the model is discarded)."""
        self.before_host_reads_grads()
        self.before_host_writes_shards()
        self._reshards.clear()

    # ---- what is in flight --------------------------------------------------------------

    def _record(self) -> Any:
        """An event recorded on the compute device's current stream, where the engine's copies run
        whichever device is current."""
        return torch.cuda.current_stream(self.compute).record_event()

    def _issued(self, wait: str, what: str, tensors: list[torch.Tensor]) -> None:
        """A copy was just issued on the compute stream; ``wait`` waits for it."""
        self._last[wait] = self._record()

    def _wait(self, wait: str) -> None:
        event = self._last.pop(wait, None)
        if event is not None:
            event.synchronize()


class StreamCheck(DeviceLayer):
    """``DeviceLayer`` that models CUDA's host/device semantics on the CPU ([Note: host and
    device]): a copy between an offloaded shard and the compute device stays in flight until its
    wait, and an optimizer step that writes one of its shards or reads one of its gradients before
    that raises ``StreamCheckError`` naming the tensor, the copy and the wait missing. Costs: a dict
    entry per tensor copied, a scan of the optimizer's parameters per step."""

    def __init__(self, compute: torch.device, storage: torch.device, offloaded: bool) -> None:
        super().__init__(compute, storage)
        self.offloaded = offloaded  # on the CPU both devices are the CPU: the offload option says it
        self.asynchronous = True
        self._in_flight: dict[str, dict[int, str]] = {}  # wait -> host-side storage pointer -> copy

    def _issued(self, wait: str, what: str, tensors: list[torch.Tensor]) -> None:
        if self.compute.type == "cuda":  # on a GPU the check comes on top of the real events
            super()._issued(wait, what, tensors)
        pending = self._in_flight.setdefault(wait, {})
        pending.update({tensor.untyped_storage().data_ptr(): what for tensor in tensors})

    def _wait(self, wait: str) -> None:
        super()._wait(wait)
        self._in_flight.pop(wait, None)

    def check_optimizer_step(self, optimizer: Any) -> None:
        """Raise if a copy of a shard the step wrote or of a gradient it read is still in flight:
        nothing copies inside a step after its update, so such a copy raced with the update."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        self._check(params, "writes", "before_host_writes_shards")
        self._check([p.grad for p in params if p.grad is not None], "reads", "before_host_reads_grads")

    def _check(self, tensors: list[torch.Tensor], access: str, wait: str) -> None:
        pending = self._in_flight.get(wait, {})
        if not pending:
            return
        for tensor in tensors:
            what = pending.get(tensor.untyped_storage().data_ptr())
            if what is not None:
                raise StreamCheckError(
                    f"fsdp_custom stream check: an optimizer step {access} a tensor of shape {tuple(tensor.shape)} "
                    f"while the {what} (issued on the compute stream) may still be in flight; missing wait: "
                    f"DeviceLayer.{wait}()"
                )


class StreamCheckError(RuntimeError):
    """A host access that CUDA would let race with a copy in flight (``StreamCheck``)."""


def device_layer(compute: torch.device, storage: torch.device, offloaded: bool) -> DeviceLayer:
    """The layer for one model: ``StreamCheck`` under ``FSDP_CUSTOM_STREAM_CHECK=1``, else the real one."""
    if os.environ.get("FSDP_CUSTOM_STREAM_CHECK", "0") == "1":
        return StreamCheck(compute, storage, offloaded)
    return DeviceLayer(compute, storage)
