"""No host wait inside a steady-state step ([Note: host and device] 4 in device.py): after the
first steps the engine reads no tensor's value on the host, under every precision, sharding
strategy, offload and wrapping. On a GPU each such read stops the host until the device drains,
so the next all-gather cannot be issued ahead. Counted on the CPU through the code paths CUDA
takes: the Python reads (``item``, ``tolist``, ``bool``, ``float``, ``int``) and the ATen ops that
return a value to the host (``equal``, ``nonzero``, ``is_nonzero``, ``_local_scalar_dense``),
made from the engine's own frames. A check the engine computes on the device reaches the host as
a ``HostCopy`` (pinned and ``non_blocking`` on CUDA) read only once it has landed: those reads
are not counted, and the test below checks that a copy not landed is not read."""

from __future__ import annotations

import contextlib
import sys
import warnings
import weakref
from collections import Counter
from typing import Any

import lightning as L
import pytest
import torch
from dist_utils import run_ranks
from test_strategy import LIGHTNING_ENV, quiet_trainer
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, TensorDataset

from fsdp_strategy import FSDPCustomStrategy, MixedPrecision
from fsdp_strategy.engine import edits, get_scheduler, shard_model
from fsdp_strategy.engine.device import DeviceLayer, HostCopy

ENGINE = "fsdp_strategy/"
aten = torch.ops.aten
VALUE_OPS = {aten.equal.default, aten.nonzero.default, aten.is_nonzero.default, aten._local_scalar_dense.default}
PYTHON_READS = ("item", "tolist", "__bool__", "__float__", "__int__")
# the order-stamp check on CPU tensors (gloo, whose wait() blocks the host anyway); CUDA stamps
# take ``Watchdog.defer_check``, a HostCopy read by the watchdog thread once landed
CPU_ONLY = ("engine/monitoring.py", "check")
# the SIGTERM agreement's sum: a CPU tensor on a gloo group on every device ([Note: preemption at an
# agreed step]); Lightning's own is a tensor on the root device, read with ``item()``
CPU_FLAGS = {CPU_ONLY, ("strategy_preemption.py", "_ranks_received")}
# factories whose tensor lands on the default device (the host) unless given one: on CUDA, the copy
# to the device such a tensor needs before it meets a gradient is a host wait
FACTORIES = {torch.zeros, torch.ones, torch.empty, torch.full, torch.tensor, torch.scalar_tensor, torch.arange}
COPIED_FROM_HOST = {torch.tensor, torch.as_tensor}  # Python values: made on the host, then copied blocking
MOVES = {torch.Tensor.to, torch.Tensor.cuda}  # of a host-made tensor to the device: blocking unless non_blocking
TRAINER_ROOTS = ("fsdp_strategy/", "lightning/pytorch/loops/")


def _engine_caller(roots: tuple[str, ...] = (ENGINE,)) -> str | None:
    """``file:line function`` of the innermost frame outside torch, if it is under one of ``roots``
    (the engine's, or also Lightning's loops)."""
    frame = sys._getframe(3)  # past this, ``_note`` and the read's own wrapper
    while frame is not None and frame.f_code.co_filename != __file__:
        name = frame.f_code.co_filename
        if "/torch/" not in name and "<" not in name:
            root = next((root for root in roots if root in name), None)
            if root is None:
                return None
            short = name.split(root)[-1]
            if (short, frame.f_code.co_name) in CPU_FLAGS:
                return None
            return f"{short}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    return None


class HostReads(TorchDispatchMode):
    """Count the engine's reads of tensor values on the host, except of landed ``HostCopy`` values."""

    def __init__(self, roots: tuple[str, ...] = (ENGINE,)) -> None:
        super().__init__()
        self.roots = roots
        self.places: Counter[str] = Counter()
        self.copied: list[torch.Tensor] = []  # HostCopy values: read once landed, not a wait
        self.counting = False
        self._saved: dict[str, Any] = {}

    def _note(self, tensor: Any) -> None:
        if self.counting and not any(tensor is value for value in self.copied):
            place = _engine_caller(self.roots)
            if place is not None:
                self.places[place] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in VALUE_OPS:
            self._note(args[0])
        return func(*args, **(kwargs or {}))

    def __enter__(self) -> HostReads:
        copy_to_host = DeviceLayer.copy_to_host

        def recorded(tensor: torch.Tensor) -> HostCopy:
            copy = copy_to_host(tensor)
            self.copied.append(copy.value)
            return copy

        self._saved = {name: getattr(torch.Tensor, name) for name in PYTHON_READS}
        self._saved["copy_to_host"] = copy_to_host
        DeviceLayer.copy_to_host = staticmethod(recorded)
        for name in PYTHON_READS:
            original = self._saved[name]

            def read(tensor, *args, _original=original, **kwargs):
                self._note(tensor)
                return _original(tensor, *args, **kwargs)

            setattr(torch.Tensor, name, read)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        DeviceLayer.copy_to_host = staticmethod(self._saved.pop("copy_to_host"))
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)


class HostFactories(TorchFunctionMode):
    """Count tensors the engine makes without naming a device (``torch.zeros(())``), and blocking
    moves of those it makes on the host on purpose (``device="cpu"``, the string) to another device: on CPU
    every tensor is on the host, so only the arguments tell what would be where on CUDA, and that a
    plain ``.to(device)`` of a host tensor would wait there for the device to drain. Tensors others make
    without a device count as the host's too (torch's optimizers keep step counts there, to read them
    without a wait): the engine moving one waits, and leaves the optimizer reading it off the device."""

    def __init__(self, reads: HostReads) -> None:
        super().__init__()
        self.reads = reads
        self.host_made: dict[int, weakref.ref] = {}  # by id: a tensor's == is elementwise

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and "device" not in kwargs:
            self.reads._note(None)
        if func in COPIED_FROM_HOST and kwargs.get("device") != "cpu":  # a blocking copy on CUDA
            self.reads._note(None)
        made = self.host_made.get(id(args[0])) if args else None
        if func in MOVES and made is not None and made() is args[0] and not kwargs.get("non_blocking", False):
            self.reads._note(None)
        result = func(*args, **kwargs)
        if func in FACTORIES and kwargs.get("device") in ("cpu", None):  # the host, on every device
            self.host_made[id(result)] = weakref.ref(result)
        return result


class AdamWOfOurs(torch.optim.AdamW):
    """Not one of torch's own classes: measured at its first step, its param groups (a tensor
    learning rate among them) compared across ranks after every step ([Note: param groups agree])."""


CONFIGS = {
    f"{precision}/{strategy}/{wrap}{'/offload' if offload else ''}": (precision, strategy, wrap, offload, "AdamW")
    for precision in ("fp32", "bf16")
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")
    for wrap in ("per-Linear", "one unit")
    for offload in ((False, True) if strategy == "FULL_SHARD" else (False,))
}
CONFIGS["fp32/FULL_SHARD/per-Linear/an optimizer not of torch"] = ("fp32", "FULL_SHARD", "per-Linear", False, "ours")
# placed whole ([Note: whole-matrix placement]): its step count, on the host, stays there with the owner
_BASE = ("fp32", "FULL_SHARD", "per-Linear")
CONFIGS.update({f"{'/'.join(_BASE)}{'/offload' * off}/Adafactor": (*_BASE, off, "Adafactor") for off in (False, True)})


def _reads_per_step(rank: int, world: int) -> dict[str, list[Any]]:
    """The engine's host reads, and tensors it makes on the host, in each of the last three of six
    steps, per config (accumulation over two micro-batches under ``no_sync`` and gradient clipping
    included)."""
    results = {}
    for name, (precision, strategy, wrap, offload, kind) in CONFIGS.items():
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(5)])
        mixed = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if precision == "bf16" else None
        shard_model(
            model,
            auto_wrap_policy={nn.Linear} if wrap == "per-Linear" else None,
            sharding_strategy=strategy,
            cpu_offload=offload,
            mixed_precision=mixed,
        )
        scheduler = get_scheduler(model)
        if kind == "ours":
            optimizer = AdamWOfOurs(model.parameters(), lr=torch.tensor(1e-3), foreach=False)
        elif kind == "Adafactor":
            optimizer = torch.optim.Adafactor(model.parameters(), lr=1e-2)
        else:
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        steps = []
        with HostReads() as reads, HostFactories(reads):
            for step in range(6):
                reads.counting = step >= 3
                reads.places.clear()
                for micro in range(2):
                    x = torch.randn(4, 16)
                    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
                        with scheduler.no_sync() if micro == 0 else contextlib.nullcontext():
                            model(x).float().square().mean().backward()
                scheduler.clip_grad_norm_(1.0)
                optimizer.step()
                optimizer.zero_grad()
                if reads.counting:
                    steps.append(dict(reads.places))
        results[name] = steps
    return results


def test_a_steady_state_step_reads_nothing_on_the_host(tmp_path):
    results = run_ranks(_reads_per_step, 2, tmp_path, timeout=300)
    for rank, per_config in enumerate(results):
        assert set(per_config) == set(CONFIGS)
        reading = {name: steps for name, steps in per_config.items() if any(steps)}
        assert not reading, f"rank {rank}: the engine read tensors on the host inside a step: {reading}"


class _TrainerModule(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))

    def training_step(self, batch, batch_idx):
        return self.net(batch[0]).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-2)  # reads nothing itself (AdamW reads its step count)


class _PerStep(L.Callback):
    """The reads of each Trainer step from the fourth on, between one batch's start and the next's."""

    def __init__(self, reads: HostReads) -> None:
        self.reads, self.steps = reads, []

    def on_train_batch_start(self, trainer, *args) -> None:
        if self.reads.counting:
            self.steps.append(dict(self.reads.places))
        self.reads.places.clear()
        self.reads.counting = trainer.global_step >= 3


def _trainer_reads(rank: int, world: int) -> dict[str, list]:
    warnings.filterwarnings("ignore")
    data = DataLoader(TensorDataset(torch.randn(64, 8, generator=torch.Generator().manual_seed(0))), batch_size=4)
    out = {}
    for name in ("fsdp_custom", "ddp"):
        factories = HostFactories if name == "fsdp_custom" else lambda reads: contextlib.nullcontext()
        with HostReads(TRAINER_ROOTS) as reads, factories(reads):
            per_step = _PerStep(reads)
            strategy = FSDPCustomStrategy(auto_wrap_policy={nn.Linear}) if name == "fsdp_custom" else "ddp"
            trainer = quiet_trainer(strategy=strategy, devices=world, max_steps=7, callbacks=[per_step])
            trainer.fit(_TrainerModule(), data)
        out[name] = per_step.steps
    return out


def test_a_trainer_step_reads_nothing_on_the_host_where_ddp_reads_its_sigterm_flag(tmp_path):
    """The Trainer's own step under fsdp_custom: no read by the engine, the strategy or Lightning's
    loops, and no tensor made on the host there (Lightning's per-batch SIGTERM broadcast is replaced
    by a sum on the CPU: [Note: preemption at an agreed step]); DDP's step reads one (that
    broadcast's ``item()`` on the root device)."""
    for rank, runs in enumerate(run_ranks(_trainer_reads, 2, tmp_path, env=LIGHTNING_ENV, timeout=300)):
        assert len(runs["fsdp_custom"]) == len(runs["ddp"]) == 3
        assert all(step == {} for step in runs["fsdp_custom"]), (rank, runs["fsdp_custom"])
        assert all(sum(step.values()) == 1 for step in runs["ddp"]), (rank, runs["ddp"])
        assert all("_broadcast_sigterm_tensor" in next(iter(step)) for step in runs["ddp"]), runs["ddp"]


class _Event:
    """A CUDA event's stand-in: ``query()`` says whether the device has reached it."""

    def __init__(self) -> None:
        self.reached = False
        self.synchronized = False

    def query(self) -> bool:
        return self.reached

    def synchronize(self) -> None:
        self.synchronized = self.reached = True


def test_lost_edit_flags_are_read_a_step_later_on_every_rank_alike(monkeypatch):
    """CUDA's order of events, modelled: the flags sent at a report are not read there (their copy
    may be in flight) but at the next report, whether or not this rank's copy has landed by then
    (a rule every rank follows alike: a rank whose device is slower raises at the same place);
    they raise naming the parameter, or, where only another rank's rows changed (the verdict
    all-reduced into the first flag), saying so; teardown (``everything``) reads the last ones."""
    copies: list[HostCopy] = []

    def in_flight(tensor: torch.Tensor) -> HostCopy:
        copies.append(HostCopy(tensor.clone(), _Event()))
        return copies[-1]

    monkeypatch.setattr(DeviceLayer, "copy_to_host", staticmethod(in_flight))
    lost = edits.LostEdits([], None, torch.device("cpu"))  # one rank: no verdict to combine
    check = edits.LostEditCheck("block", "block.weight", torch.bfloat16, torch.float32, torch.tensor(True))
    lost.add([check])
    lost.send()
    lost.raise_due()  # the newest copy: not read at its own report
    assert not copies[0].event.synchronized
    lost.add([check._replace(lost=torch.tensor(False))])
    lost.send()
    with pytest.raises(RuntimeError, match=r"parameters \['block.weight'\] of unit 'block' were changed while"):
        lost.raise_due()  # the previous one is due, landed or not on this rank
    assert copies[0].event.synchronized and not copies[1].event.synchronized
    lost.add([check._replace(fqn="block.bias")])
    lost.send()
    lost.raise_due()  # copies[1] kept exactly: no error; copies[2] not due yet
    with pytest.raises(RuntimeError, match=r"\['block.bias'\]"):
        lost.raise_due(everything=True)  # teardown: the last one too
    lost.add([check._replace(lost=torch.tensor(False))])
    lost.send()
    copies[3].value[0] = True  # another rank's rows changed
    with pytest.raises(RuntimeError, match="another rank found a change made while its parameters were gathered"):
        lost.raise_due(everything=True)
    lost.add([check])
    lost.drop_pending()  # a failed iteration's checks
    lost.send(agree=False)  # nothing of this rank's own to send
    assert len(copies) == 4
