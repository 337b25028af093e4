"""The GPU acceptance suite (tests/gpu/acceptance.py) under pytest; skipped cleanly without a GPU.
It runs in its own process so that CUDA is never initialized in the test process (the other
tests fork ranks from it), on the device layer users get: conftest.py turns the stream check on for
every test, so it is turned off here."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or not torch.distributed.is_nccl_available(), reason="needs CUDA"),
]


def test_gpu_acceptance_suite():
    script = Path(__file__).with_name("acceptance.py")
    env = {**os.environ, "FSDP_CUSTOM_STREAM_CHECK": "0"}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=1800, env=env)
    assert done.returncode == 0 and "all checks passed" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
