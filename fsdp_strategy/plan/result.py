"""MemoryPlan: what one planned training step needs per rank, and a readable table of it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

RUN_SETTINGS = ("world_size", "precision")  # the header's; the other settings are strategy arguments
PARTS = (
    "parameter shards",
    "gradients",
    "optimizer state",
    "gathered parameters",
    "gather/reduce buffers",
    "activations",
)


@dataclass
class MemoryPlan:
    """The per-rank peak of a training step of this engine, and its parts.

    ``peak_bytes``: the highest bytes of live tensors on a rank's compute device during the
    planned steps (the second step is the steady state: the optimizer state exists by then).
    ``parts``: name -> bytes at that moment, summing to ``peak_bytes`` ("activations" holds the
    activations, the batch, module buffers and operator temporaries). ``phase`` ("setup",
    "forward", "backward", "optimizer step") and ``unit`` (the unit that last gathered or
    released) say when it happens. ``host_bytes``: what CPU offload keeps in host memory.
    ``sent_bytes_per_step``: what each rank sends per optimizer step (ring algorithms).
    ``flops_per_step``: forward and backward (recomputation included), per rank.
    ``shard_bytes``: this rank's parameter shards (in host memory under CPU offload).
    ``settings``: the world size, precision and strategy arguments it was planned with, printable;
    ``strategy_kwargs``: those arguments as ``FSDPCustomStrategy`` takes them (an "auto" plan's
    choice: ``FSDPCustomStrategy(**plan.strategy_kwargs)``); ``reasons``: why "auto" chose them.
    """

    peak_bytes: int
    parts: dict[str, int]
    phase: str
    unit: str
    host_bytes: int
    sent_bytes_per_step: int
    flops_per_step: int
    shard_bytes: int = 0
    settings: dict[str, Any] = field(default_factory=dict)
    strategy_kwargs: dict[str, Any] = field(default_factory=dict)
    reasons: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        rows = [
            (name, _size(nbytes), f"{100 * nbytes / max(self.peak_bytes, 1):5.1f} %")
            for name, nbytes in self.parts.items()
        ]
        rows.append(
            ("peak per rank", _size(self.peak_bytes), f"in {self.phase}" + (f" of {self.unit}" if self.unit else ""))
        )
        if self.host_bytes:
            rows.append(("host memory (CPU offload)", _size(self.host_bytes), ""))
        rows.append(("sent per rank per step", _size(self.sent_bytes_per_step), ""))
        rows.append(("compute per rank per step", f"{self.flops_per_step / 1e12:.3g} TFLOP", ""))
        width = max(len(row[0]) for row in rows)
        run = ", ".join(f"{key}={value}" for key, value in self.settings.items() if key in RUN_SETTINGS)
        arguments = [f"{key}={value}" for key, value in self.settings.items() if key not in RUN_SETTINGS]
        lines = [f"memory plan ({run})"]
        lines += [f"  {name:<{width}}  {size:>10}  {note}".rstrip() for name, size, note in rows]
        lines += [f"  {reason}" for reason in self.reasons]
        if arguments:  # one per line, ready to paste (classes by name: your code imports them)
            lines += [
                "  as strategy arguments:",
                "    FSDPCustomStrategy(",
                *(f"        {a}," for a in arguments),
                "    )",
            ]
        return "\n".join(lines)


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} B"


def parse_bytes(value: Any, argument: str = "memory_budget", zero: bool = False) -> int:
    """``70GiB``, ``"512 MB"``, ``8e9`` or an int -> bytes (``zero``: 0 allowed); a clear error otherwise."""
    units = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
    units.update({"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40})
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number, unit = float(value), ""
    elif isinstance(value, str):
        text = value.strip().lower().replace(" ", "")
        digits = text.rstrip("abcdefghijklmnopqrstuvwxyz")
        number, unit = (float(digits) if digits else float("nan")), text[len(digits) :]
    else:
        number, unit = float("nan"), ""
    if unit not in units or not (0 if zero else 1) <= number * units.get(unit, 1) < float("inf"):
        least = 0 if zero else 1
        raise ValueError(
            f"{argument}={value!r} is not a size; give bytes (at least {least}, finite) or a string like '70GiB', "
            "'512MiB', '80GB'"
        )
    return int(number * units[unit])
