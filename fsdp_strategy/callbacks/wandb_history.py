"""Read the history of an offline W&B run back from its ``run-*.wandb`` file, without an account
or network: ``python -m fsdp_strategy.callbacks.wandb_history RUN_DIR [KEY ...]`` prints the rows
that hold the keys (all keys when none is given) as CSV, by ``trainer/global_step``.

The file is a log of protobuf ``Record`` messages in 32 KiB blocks, each record behind a 7-byte
header (CRC32, length, type: full/first/middle/last), after a 7-byte file header ``:W&B``.
"""

from __future__ import annotations

import argparse
import csv
import difflib
import json
import math
import os
import struct
import sys
import textwrap
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


def _run_files(run_dir: Path) -> list[Path]:
    """A run folder: its own file. A ``wandb`` folder: the files of its latest run, oldest first (a
    resumed run writes a new ``offline-run-*`` folder under the same run id each time)."""
    own = sorted(run_dir.glob("run-*.wandb"))
    if own:
        return own[-1:]
    files = sorted(run_dir.rglob("run-*.wandb"))
    if not files:
        raise FileNotFoundError(f"no offline W&B run under {run_dir}")
    return [file for file in files if file.name == files[-1].name]


def _rows(run_file: Path) -> list[dict]:
    rows = []
    for payload in _payloads(run_file.read_bytes()):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        if record.WhichOneof("record_type") == "history":
            rows.append(
                {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            )
    return rows


def history(run_dir: str | Path) -> list[dict]:
    """Every ``log()`` row of an offline run. ``run_dir`` is a run folder (``offline-run-*``: that
    folder only) or a ``wandb`` folder: then its latest run, with every folder it was resumed into,
    in order; where a resumed part starts at an earlier ``trainer/global_step`` than the previous
    part reached (it resumed from an older checkpoint), the resumed part's rows replace those from
    that step on. Costs: reads the run files whole."""
    rows: list[dict] = []
    for run_file in _run_files(Path(run_dir)):
        part = _rows(run_file)
        steps = [row["trainer/global_step"] for row in part if "trainer/global_step" in row]
        if steps:
            rows = [row for row in rows if row.get("trainer/global_step", -math.inf) < steps[0]]
        rows += part
    return rows


def one_row_per_step(rows: list[dict]) -> list[dict]:
    """``rows`` with the consecutive ones of one ``trainer/global_step`` merged (each logging call of a
    step is a row of its own in W&B: the monitors', the loss's, validation's), later values winning."""
    merged: list[dict] = []
    for row in rows:
        step = row.get("trainer/global_step")
        if merged and step is not None and merged[-1].get("trainer/global_step") == step:
            merged[-1] = {**merged[-1], **row}
        else:
            merged.append(dict(row))
    return merged


def main(argv: list[str] | None = None) -> int:
    """Print the history of an offline run as CSV; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m fsdp_strategy.callbacks.wandb_history",
        description="Print an offline W&B run's logged rows as CSV (no account or network needed).",
    )
    where = "a run folder (offline-run-*) or a wandb folder (its latest run, with the parts it was resumed into)"
    parser.add_argument("run_dir", help=where)
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
        close = [match for key in missing for match in difflib.get_close_matches(key, logged, n=2, cutoff=0.6)]
        hint = f"; did you mean {' or '.join(map(repr, dict.fromkeys(close)))}?" if close else ""
        listing = textwrap.fill(", ".join(logged), width=100, initial_indent="  ", subsequent_indent="  ")
        message = f"{args.run_dir} has no {missing}{hint}\nlogged keys:\n{listing}"
        print(f"wandb_history: error: {message}", file=sys.stderr)
        return 2
    keys = args.keys or logged
    writer = csv.writer(sys.stdout)
    try:
        writer.writerow(["trainer/global_step", *keys])
        for row in one_row_per_step([row for row in rows if any(key in row for key in keys)]):
            writer.writerow([row.get("trainer/global_step", ""), *(row.get(key, "") for key in keys)])
        sys.stdout.flush()
    except BrokenPipeError:  # piped into `head`: the reader stopped reading, which is no error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(main())
