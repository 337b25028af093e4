"""What a checkpoint is on disk: file names, metadata and checksums.

A *sharded* checkpoint is a folder in the layout of Lightning's FSDPStrategy (see
[Note: Lightning's sharded layout] in sharded.py): the tensor files and ``.metadata`` written by
``torch.distributed.checkpoint`` (an ordinary DCP checkpoint), ``meta.pt`` (everything that is
not a tensor: epoch, loops, callbacks, LR schedulers) and our ``fsdp_meta.json`` (format and
package version, world size, sharding plan, dtypes, a CRC32 per file). A *full* checkpoint is
one file in Lightning's usual layout. Both live on any filesystem ``storage.py`` resolves, and
are committed atomically ([Note: atomic commit] there).
"""

from __future__ import annotations

import json
import os
import pickle
import zipfile
from typing import Any

import torch

from fsdp_strategy.checkpoint import storage
from fsdp_strategy.checkpoint.storage import Location

FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
META_FILE = "fsdp_meta.json"
LIGHTNING_FILE = "meta.pt"  # Lightning's name (lightning.fabric.utilities.load._METADATA_FILENAME)
LEGACY_LIGHTNING_FILE = "lightning.pt"  # format 1
DCP_METADATA = ".metadata"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: names the file and the key at fault."""


class StrictLoadError(CheckpointError, RuntimeError):
    """A checkpoint whose keys or shapes do not fit the model: a ``RuntimeError`` as torch's
    ``load_state_dict`` raises (code that catches that catches this), naming the file and the keys."""


def shortened(keys: Any, shown: int = 5) -> str:
    """``keys`` sorted, as a list of the first ``shown`` and a count of the rest (an error stays readable
    for a model of thousands of keys)."""
    ordered = sorted(map(str, keys))
    head = ", ".join(repr(k) for k in ordered[:shown])
    return f"[{head}, ... {len(ordered) - shown} more]" if len(ordered) > shown else f"[{head}]"


class CheckpointSaveError(OSError):
    """A save that failed on some rank (a full disk, a lost connection): raised on every rank."""


def write_meta(folder: Location, meta: dict[str, Any]) -> None:
    """Write ``fsdp_meta.json`` into ``folder``."""
    with folder.fs.open(folder.child(META_FILE).path, "w") as handle:
        handle.write(json.dumps(meta, indent=1, sort_keys=True))


def is_sharded_checkpoint(path: str | os.PathLike | Location) -> bool:
    """Whether ``path`` is a sharded checkpoint folder: ours, Lightning's (FSDPStrategy,
    ModelParallelStrategy, Fabric's), or any ``torch.distributed.checkpoint`` folder (FSDP2, torchtitan)."""
    folder = storage.locate(path)
    return storage.isdir(folder) and (storage.isfile(folder.child(META_FILE)) or is_dcp_folder(folder))


def is_dcp_folder(folder: Location) -> bool:
    """Whether ``folder`` holds a DCP checkpoint (its ``.metadata``), whoever wrote it."""
    return storage.isfile(folder.child(DCP_METADATA))


def has_lightning_state(folder: Location) -> bool:
    """Whether a folder holds Lightning's state beside its tensors (``meta.pt``)."""
    return storage.isfile(folder.child(LIGHTNING_FILE))


def folder_meta(path: str | os.PathLike | Location) -> dict[str, Any] | None:
    """Our ``fsdp_meta.json`` (checked), or None for a DCP folder another library wrote (Lightning's
    FSDP, ModelParallel and Fabric strategies, FSDP2, torchtitan)."""
    folder = storage.locate(path)
    if storage.isdir(folder) and not storage.exists(folder.child(META_FILE)) and is_dcp_folder(folder):
        return None
    return read_meta(folder)


def load_object(path: str | os.PathLike | Location, weights_only: bool | None, mmap: bool = False) -> Any:
    """``torch.load`` a checkpoint file on the CPU (memory-mapped with ``mmap`` on a local disk);
    errors name the file. ``weights_only``: as ``torch.load``'s, None meaning False, as Lightning's
    FSDP reads its checkpoints (their metadata holds callbacks' and hyperparameters' objects);
    True refuses anything but tensors and plain values."""
    weights_only = False if weights_only is None else weights_only
    where = storage.locate(path)
    if not storage.isfile(where):
        raise CheckpointError(f"{where}: missing")
    try:
        if where.local:
            return torch.load(where.path, map_location="cpu", weights_only=weights_only, mmap=mmap)
        with where.fs.open(where.path, "rb") as handle:
            return torch.load(handle, map_location="cpu", weights_only=weights_only)
    except pickle.UnpicklingError as error:
        raise CheckpointError(
            f"{path}: refused by weights_only loading ({error}). Pass weights_only=False to "
            "trainer.fit/validate/test only for a checkpoint you trust"
            if "Weights only load failed" in str(error)
            else f"{path}: not a readable checkpoint file (UnpicklingError: {error})"
        ) from None
    except Exception as error:  # torch raises several types for damaged zip/pickle data
        raise CheckpointError(f"{path}: not a readable checkpoint file ({type(error).__name__}: {error})") from None


def read_meta(path: str | os.PathLike | Location) -> dict[str, Any]:
    """Read and check ``fsdp_meta.json``: present, parseable, of a known format version."""
    folder = storage.locate(path)
    if not storage.exists(folder):
        raise FileNotFoundError(f"checkpoint {str(folder)!r} does not exist")
    if not storage.isdir(folder):
        raise CheckpointError(
            f"{str(folder)!r} is a file, but a sharded checkpoint (a folder with {META_FILE}) is expected"
        )
    meta_path = folder.child(META_FILE)
    if not storage.isfile(meta_path):
        found = storage.names(folder)
        raise CheckpointError(
            f"{str(folder)!r} is not a checkpoint: it holds {found[:8]}{' ...' if len(found) > 8 else ''}; expected "
            f"a sharded checkpoint folder (a {DCP_METADATA} file and *.distcp shards, as torch.distributed.checkpoint "
            "writes them) or a checkpoint file"
        )
    try:
        with meta_path.fs.open(meta_path.path, "r") as handle:
            meta = json.loads(handle.read())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{meta_path}: unreadable ({error})") from None
    version = meta.get("format_version")
    if version not in READABLE_VERSIONS:
        raise CheckpointError(
            f"{meta_path}: key 'format_version' is {version!r}; this fsdp_strategy reads formats {READABLE_VERSIONS}"
        )
    return meta


def verify_files(folder: Location, checksums: dict[str, int], names: list[str]) -> list[str]:
    """Problems (missing file, wrong size or CRC32) among ``names``; [] when all are intact."""
    problems = []
    for name in names:
        path = folder.child(name)
        if not storage.isfile(path):
            problems.append(f"{path}: missing (written by the checkpoint, key 'checksums.{name}')")
        elif storage.crc32(path) != checksums[name]:
            problems.append(f"{path}: corrupted or truncated (CRC32 differs from key 'checksums.{name}')")
    return problems


def refuse_to_replace(final: Location, state_dict_type: str) -> BaseException | None:
    """The error a save to ``final`` must raise before writing anything, or None.

    A save replaces only a checkpoint: a file torch wrote, or a folder holding a sharded
    checkpoint (ours or Lightning FSDP's), or an empty folder (sharded only). A full save onto
    another folder is Lightning's ``IsADirectoryError``; anything else is a ``FileExistsError``.
    """
    if not storage.exists(final):
        return None
    if storage.isdir(final):
        if is_sharded_checkpoint(final):
            return None
        if state_dict_type == "full":
            return IsADirectoryError(f"The checkpoint path exists and is a directory: {final}")
        entries = storage.names(final)
        if not entries:
            return None
        return FileExistsError(
            f"{final} is a folder of other files ({entries[:5]}{' ...' if len(entries) > 5 else ''}), not a "
            "checkpoint: a sharded save would mix with them. Save to another path"
        )
    if _is_torch_file(final):
        return None
    return FileExistsError(f"{final} exists and is not a checkpoint written by torch; it is not overwritten")


def _is_torch_file(loc: Location) -> bool:
    try:
        with loc.fs.open(loc.path, "rb") as handle, zipfile.ZipFile(handle) as archive:
            return any(name.endswith("data.pkl") for name in archive.namelist())
    except (zipfile.BadZipFile, OSError):
        return False
