"""Read the history of an offline W&B run back from its ``run-*.wandb`` file, without an account
or network: ``python -m fsdp_strategy.callbacks.wandb_history RUN_DIR [KEY ...]`` prints the rows
that hold the keys (all keys when none is given) as CSV, by ``trainer/global_step``.

The file is a log of protobuf ``Record`` messages in 32 KiB blocks, each record behind a 7-byte
header (CRC32, length, type: full/first/middle/last), after a 7-byte file header ``:W&B``.
"""

from __future__ import annotations

import argparse
import csv
import json
import struct
import sys
from collections.abc import Iterator
from pathlib import Path

from wandb.proto import wandb_internal_pb2

BLOCK = 32768
HEADER = 7


def _payloads(data: bytes) -> Iterator[bytes]:
    if data[:4] != b":W&B":
        raise ValueError("not a W&B run file")
    position, pending = HEADER, b""
    while position + HEADER <= len(data):
        room = BLOCK - position % BLOCK
        if room < HEADER:
            position += room
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + HEADER])
        if kind == 0 and length == 0:
            position += room
            continue
        payload = data[position + HEADER : position + HEADER + length]
        position += HEADER + length
        if kind == 1:
            yield payload
        elif kind == 2:
            pending = payload
        elif kind == 3:
            pending += payload
        elif kind == 4:
            yield pending + payload


def history(run_dir: str | Path) -> list[dict]:
    """Every ``log()`` row of the offline run under ``run_dir`` (a ``wandb`` folder: its latest run;
    or a run folder). Costs: reads the whole run file."""
    files = sorted(Path(run_dir).rglob("run-*.wandb"))
    if not files:
        raise FileNotFoundError(f"no offline W&B run under {run_dir}")
    rows = []
    for payload in _payloads(files[-1].read_bytes()):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        if record.WhichOneof("record_type") == "history":
            rows.append(
                {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    """Print the history of an offline run as CSV; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m fsdp_strategy.callbacks.wandb_history",
        description="Print an offline W&B run's logged rows as CSV (no account or network needed).",
    )
    parser.add_argument("run_dir", help="a run folder (offline-run-*) or a wandb folder (its latest run)")
    parser.add_argument("keys", nargs="*", help="metrics to print, e.g. train_loss memory/gathered_peak/max")
    args = parser.parse_args(argv)
    try:
        rows = history(args.run_dir)
    except (FileNotFoundError, ValueError) as error:
        print(f"wandb_history: error: {error}", file=sys.stderr)
        return 2
    logged = sorted({key for row in rows for key in row if not key.startswith("_")} - {"trainer/global_step"})
    missing = [key for key in args.keys if key not in logged]
    if missing:
        message = f"{args.run_dir} has no {missing}; logged keys: {', '.join(logged)}"
        print(f"wandb_history: error: {message}", file=sys.stderr)
        return 2
    keys = args.keys or logged
    writer = csv.writer(sys.stdout)
    writer.writerow(["trainer/global_step", *keys])
    for row in rows:
        if any(key in row for key in keys):
            writer.writerow([row.get("trainer/global_step", ""), *(row.get(key, "") for key in keys)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
