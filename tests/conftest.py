"""Every test runs its engines under the stream check (fsdp_strategy/engine/device.py): the copies
between offloaded shards and the compute device are treated as in flight until their wait, as on
CUDA, and a host access before it fails the test.

The session also checks that nothing was written into the checkout: every test writes into its
own temporary folder (a run's logs, checkpoints, flight-recorder files), so a suite that passes
leaves the source tree as it found it; and its header says which copy of the package it tests (CI
installs a wheel: the installed package, not the source tree)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("FSDP_CUSTOM_STREAM_CHECK", "1")

ROOT = Path(__file__).resolve().parents[1]
CHECKOUT = pytest.StashKey[set]()
NOT_WATCHED = {".git", ".venv", "__pycache__", ".pytest_cache", ".ruff_cache", "build", "dist"}


def _checkout_files() -> set[str]:
    found = set()
    for folder, subfolders, files in os.walk(ROOT):
        subfolders[:] = [s for s in subfolders if s not in NOT_WATCHED and not s.endswith(".egg-info")]
        found.update(os.path.relpath(os.path.join(folder, name), ROOT) for name in files)
    return found


@pytest.fixture(autouse=True)
def _in_own_folder(tmp_path, monkeypatch):
    """Each test (and every process it starts) works in its own temporary folder: what a run writes
    relative to its working directory (Lightning's logs, flight-recorder files) lands there. The
    processes it starts start their own W&B service: an earlier in-process run exports
    WANDB_SERVICE, and a rank killed in a restart test would leave its run open in that shared one
    (the restarted rank is then told "run ID ... is in use"), which no user's launcher does."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("WANDB_SERVICE", raising=False)
    for name in LAUNCH_VARIABLES:  # restored after the test: [Note: a clean launch environment]
        monkeypatch.delenv(name, raising=False)


LAUNCH_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "GLOBAL_RANK", "WORLD_SIZE", "RANK")
"""[Note: a clean launch environment] An in-process Trainer or Fabric run sets these in the test
process's environment (Lightning's launcher exports them); a later test that starts a job inherited
them, and with LOCAL_RANK set Lightning's launcher takes the job for an already launched rank and
starts no other: rank 0 waited for rank 1 for ever (test_fabric's dead-rank job after
test_strategy). Each test starts without them, and what a test sets is undone after it."""


def pytest_report_header(config) -> str:
    import fsdp_strategy

    where = Path(fsdp_strategy.__file__).resolve().parent
    kind = "the source tree (an editable install)" if where.is_relative_to(ROOT) else "an installed package"
    return f"fsdp_strategy: {where} ({kind})"


def pytest_sessionstart(session) -> None:
    session.config.stash[CHECKOUT] = _checkout_files()


def pytest_sessionfinish(session, exitstatus) -> None:
    written = sorted(_checkout_files() - session.config.stash[CHECKOUT])
    if written:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        message = f"tests wrote into the checkout (write into tmp_path instead): {written[:20]}"
        if reporter is not None:
            reporter.write_line(message, red=True)
        session.exitstatus = 1
