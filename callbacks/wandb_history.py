"""Read the history of an offline W&B run back from its ``run-*.wandb`` file.

The file is a log of protobuf ``Record`` messages in 32 KiB blocks, each record behind a 7-byte
header (CRC32, length, type: full/first/middle/last), after a 7-byte file header ``:W&B``.
"""

from __future__ import annotations

import json
import struct
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


def history(run_dir: Path) -> list[dict]:
    """Every ``log()`` row of the offline run under ``run_dir`` (a ``wandb`` folder or a run folder)."""
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
