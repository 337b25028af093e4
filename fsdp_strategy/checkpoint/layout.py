"""What a checkpoint is on disk: file names, metadata, checksums and the atomic commit.

A *sharded* checkpoint is a folder in the layout of Lightning's FSDPStrategy (see
[Note: Lightning's sharded layout] in sharded.py): the tensor files and ``.metadata`` written by
``torch.distributed.checkpoint`` (an ordinary DCP checkpoint), ``meta.pt`` (everything that is
not a tensor: epoch, loops, callbacks, LR schedulers) and our ``fsdp_meta.json`` (format and
package version, world size, sharding plan, dtypes, a CRC32 per file). A *full* checkpoint is
one file in Lightning's usual layout.

[Note: atomic commit]
Every checkpoint is written under a hidden temporary name next to its final one
(``.NAME.tmp-<id>``) and renamed once every rank has finished writing; an older checkpoint of
the same name is moved aside first and deleted after the rename. A crash at any point leaves
the previous checkpoint (or none) under the final name, never a partial one.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import uuid
import zlib
from pathlib import Path
from typing import Any

import torch

FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
META_FILE = "fsdp_meta.json"
LIGHTNING_FILE = "meta.pt"  # Lightning's name (lightning.fabric.utilities.load._METADATA_FILENAME)
LEGACY_LIGHTNING_FILE = "lightning.pt"  # format 1
DCP_METADATA = ".metadata"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: names the file and the key at fault."""


def temporary_path(final: Path) -> Path:
    """A fresh hidden name next to ``final`` for writing before the commit."""
    return final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:12]}"


def commit(temporary: Path, final: Path) -> None:
    """Move a finished checkpoint to its final name (see [Note: atomic commit]). Rank 0 only."""
    final.parent.mkdir(parents=True, exist_ok=True)
    old = None
    if final.exists() or final.is_symlink():
        old = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:12]}"
        os.replace(final, old)
    os.replace(temporary, final)
    if old is not None:
        remove(old)


def remove(path: Path) -> None:
    """Delete a checkpoint file or folder (missing is fine)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()


def file_crc32(path: Path, chunk: int = 1 << 20) -> int:
    """CRC32 of a file, read in 1 MiB chunks (bounded memory for any file size)."""
    value = 0
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            value = zlib.crc32(block, value)
    return value


def write_meta(folder: Path, meta: dict[str, Any]) -> None:
    """Write ``fsdp_meta.json`` into ``folder``."""
    (folder / META_FILE).write_text(json.dumps(meta, indent=1, sort_keys=True))


def is_sharded_checkpoint(path: Path) -> bool:
    """Whether ``path`` is a sharded checkpoint folder: ours, or one of Lightning's FSDPStrategy."""
    return path.is_dir() and ((path / META_FILE).is_file() or _is_lightning_folder(path))


def _is_lightning_folder(path: Path) -> bool:
    return (path / LIGHTNING_FILE).is_file() and (path / DCP_METADATA).is_file()


def folder_meta(folder: Path) -> dict[str, Any] | None:
    """Our ``fsdp_meta.json`` (checked), or None for a folder of Lightning's FSDPStrategy."""
    if folder.is_dir() and not (folder / META_FILE).exists() and _is_lightning_folder(folder):
        return None
    return read_meta(folder)


def load_object(path: Path, weights_only: bool | None, mmap: bool = False) -> Any:
    """``torch.load`` a checkpoint file on the CPU; errors name the file (``weights_only``: as
    ``torch.load``'s, None being torch's default)."""
    if not path.is_file():
        raise CheckpointError(f"{path}: missing")
    try:
        return torch.load(path, map_location="cpu", weights_only=weights_only, mmap=mmap)
    except pickle.UnpicklingError as error:
        raise CheckpointError(
            f"{path}: refused by weights_only loading ({error}). Pass weights_only=False to "
            "trainer.fit/validate/test only for a checkpoint you trust"
            if "Weights only load failed" in str(error)
            else f"{path}: not a readable checkpoint file (UnpicklingError: {error})"
        ) from None
    except Exception as error:  # torch raises several types for damaged zip/pickle data
        raise CheckpointError(f"{path}: not a readable checkpoint file ({type(error).__name__}: {error})") from None


def read_meta(folder: Path) -> dict[str, Any]:
    """Read and check ``fsdp_meta.json``: present, parseable, of a known format version."""
    if not folder.exists():
        raise FileNotFoundError(f"checkpoint {str(folder)!r} does not exist")
    if not folder.is_dir():
        raise CheckpointError(
            f"{str(folder)!r} is a file, but a sharded checkpoint (a folder with {META_FILE}) is expected"
        )
    meta_path = folder / META_FILE
    if not meta_path.is_file():
        raise CheckpointError(
            f"{str(folder)!r} has no {META_FILE} (nor Lightning FSDP's {LIGHTNING_FILE} and {DCP_METADATA}): "
            "not a sharded checkpoint"
        )
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{meta_path}: unreadable ({error})") from None
    version = meta.get("format_version")
    if version not in READABLE_VERSIONS:
        raise CheckpointError(
            f"{meta_path}: key 'format_version' is {version!r}; this fsdp_strategy reads formats {READABLE_VERSIONS}"
        )
    return meta


def verify_files(folder: Path, checksums: dict[str, int], names: list[str]) -> list[str]:
    """Problems (missing file, wrong size or CRC32) among ``names``; [] when all are intact."""
    problems = []
    for name in names:
        path = folder / name
        if not path.is_file():
            problems.append(f"{path}: missing (written by the checkpoint, key 'checksums.{name}')")
        elif file_crc32(path) != checksums[name]:
            problems.append(f"{path}: corrupted or truncated (CRC32 differs from key 'checksums.{name}')")
    return problems
