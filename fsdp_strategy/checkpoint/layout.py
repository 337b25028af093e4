"""What a checkpoint is on disk: file names, metadata, checksums and the atomic commit.

A *sharded* checkpoint is a folder: the tensor files and ``.metadata`` written by
``torch.distributed.checkpoint`` (an ordinary DCP checkpoint), ``fsdp_meta.json`` (format and
package version, world size, sharding plan, dtypes, a CRC32 per file) and ``lightning.pt``
(everything that is not a tensor shard: epoch, loops, callbacks, LR schedulers, optimizer
hyper-parameters). A *full* checkpoint is one file in Lightning's usual layout.

[Note: atomic commit]
Every checkpoint is written under a hidden temporary name next to its final one
(``.NAME.tmp-<id>``) and renamed once every rank has finished writing; an older checkpoint of
the same name is moved aside first and deleted after the rename. A crash at any point leaves
the previous checkpoint (or none) under the final name, never a partial one.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
import zlib
from pathlib import Path
from typing import Any

FORMAT_VERSION = 1
META_FILE = "fsdp_meta.json"
LIGHTNING_FILE = "lightning.pt"
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
    """Whether ``path`` is a folder written by ``state_dict_type="sharded"``."""
    return path.is_dir() and (path / META_FILE).is_file()


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
        raise CheckpointError(f"{str(folder)!r} has no {META_FILE}: not a checkpoint written by fsdp_strategy")
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{meta_path}: unreadable ({error})") from None
    version = meta.get("format_version")
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"{meta_path}: key 'format_version' is {version!r}; this fsdp_strategy reads format {FORMAT_VERSION}"
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
