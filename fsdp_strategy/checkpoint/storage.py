"""Where a checkpoint lives: a local path or any fsspec URL (``s3://``, ``gs://``, ``memory://``,
``file://``), resolved as Lightning's ``get_filesystem`` does; and how one is committed.

[Note: atomic commit]
A checkpoint is written under a hidden temporary name next to its final one (``.NAME.tmp-<id>``:
``ckpt_path="last"`` and ModelCheckpoint ignore names starting with a dot) and moved to its
final name by rank 0 once every rank has finished. Replacing a checkpoint of ours leaves no
moment without a complete checkpoint under a name ``ckpt_path="last"`` finds: on a local disk a
file is replaced by one atomic ``rename``, a folder is swapped with the new one by one atomic
``renameat2(RENAME_EXCHANGE)`` (Linux); elsewhere (other systems, object stores) the old one is
first renamed to ``STEM.replaced-<id>SUFFIX`` (``last.replaced-1f2e.ckpt``: still found by
``ckpt_path="last"``, and older than the new one) and deleted once the new one is in place.
A save never deletes what is not a checkpoint: see ``layout.refuse_to_replace``. A save killed midway
(a rank or the whole job) leaves only its hidden temporary, which the next commit of the same
name removes.
"""

from __future__ import annotations

import ctypes
import logging
import os
import uuid
import zlib
from pathlib import PurePosixPath
from typing import Any, NamedTuple

from lightning.fabric.utilities.cloud_io import get_filesystem

log = logging.getLogger(__name__)


class Location(NamedTuple):
    """A file or folder on some filesystem: ``fs``, its ``path`` there, and the ``url`` as given."""

    fs: Any
    path: str
    url: str

    @property
    def local(self) -> bool:
        """Whether it is on this machine's disk (os calls and memory-mapping apply)."""
        return "file" in _protocols(self.fs)

    @property
    def name(self) -> str:
        return PurePosixPath(self.path).name

    def child(self, name: str) -> Location:
        """The entry ``name`` inside this folder."""
        return Location(self.fs, f"{self.path.rstrip('/')}/{name}", f"{self.url.rstrip('/')}/{name}")

    def sibling(self, name: str) -> Location:
        """The entry ``name`` next to this one."""
        parent = str(PurePosixPath(self.path).parent)
        url_parent = self.url.rstrip("/").rsplit("/", 1)[0] if "/" in self.url.rstrip("/") else "."
        return Location(self.fs, f"{parent}/{name}", f"{url_parent}/{name}")

    def __str__(self) -> str:
        return self.url


def _protocols(fs: Any) -> tuple[str, ...]:
    protocol = fs.protocol
    return tuple(protocol) if isinstance(protocol, (tuple, list)) else (protocol,)


def locate(where: str | os.PathLike | Location) -> Location:
    """Resolve a path or URL as Lightning does (``get_filesystem``)."""
    if isinstance(where, Location):
        return where
    url = os.fspath(where)
    fs = get_filesystem(url)
    path = url if "file" in _protocols(fs) and "://" not in url else fs._strip_protocol(url)
    return Location(fs, path, url)


def exists(loc: Location) -> bool:
    return loc.fs.exists(loc.path)


def isdir(loc: Location) -> bool:
    return loc.fs.isdir(loc.path)


def isfile(loc: Location) -> bool:
    return loc.fs.isfile(loc.path)


def names(loc: Location) -> list[str]:
    """The names of a folder's entries (listed afresh: object stores cache listings)."""
    loc.fs.invalidate_cache(loc.path)
    return sorted(PurePosixPath(entry).name for entry in loc.fs.ls(loc.path, detail=False))


def makedirs(loc: Location) -> None:
    loc.fs.makedirs(loc.path, exist_ok=True)


def remove(loc: Location) -> None:
    """Delete a checkpoint file or folder (missing is fine)."""
    if loc.fs.exists(loc.path):
        loc.fs.rm(loc.path, recursive=True)


def crc32(loc: Location, chunk: int = 1 << 20) -> int:
    """CRC32 of a file, read in 1 MiB chunks (bounded memory for any file size)."""
    value = 0
    with loc.fs.open(loc.path, "rb") as handle:
        while block := handle.read(chunk):
            value = zlib.crc32(block, value)
    return value


def temporary(final: Location) -> Location:
    """A fresh hidden name next to ``final`` for writing before the commit."""
    return final.sibling(f".{final.name}.tmp-{uuid.uuid4().hex[:12]}")


def commit(temporary: Location, final: Location) -> None:
    """Move a finished checkpoint to its final name ([Note: atomic commit]), then remove what
    saves of the same name killed midway left (``.NAME.tmp-*``). Rank 0 only."""
    _move_into_place(temporary, final)
    prefix = f".{final.name}.tmp-"
    for name in names(Location(final.fs, str(PurePosixPath(final.path).parent), "")):
        if name.startswith(prefix):
            log.info("removing %s, left by a save that did not finish", name)
            remove(final.sibling(name))


def _move_into_place(temporary: Location, final: Location) -> None:
    final.fs.makedirs(str(PurePosixPath(final.path).parent), exist_ok=True)
    if not exists(final):
        final.fs.mv(temporary.path, final.path, recursive=True)
        return
    if final.local and isfile(final) and isfile(temporary):
        os.replace(temporary.path, final.path)
        return
    if final.local and _exchange(temporary.path, final.path):
        remove(temporary)  # holds the old checkpoint now
        return
    stem, dot, suffix = final.name.partition(".")
    replaced = final.sibling(f"{stem}.replaced-{uuid.uuid4().hex[:8]}{dot}{suffix}")
    final.fs.mv(final.path, replaced.path, recursive=True)
    try:
        final.fs.mv(temporary.path, final.path, recursive=True)
    except Exception:
        final.fs.mv(replaced.path, final.path, recursive=True)  # the old one back under its name
        raise
    remove(replaced)


_RENAME_EXCHANGE = 2


def _exchange(a: str, b: str) -> bool:
    """Swap two paths atomically (Linux ``renameat2``); False where the system cannot."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    at_fdcwd = -100
    result = renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE)
    return result == 0
