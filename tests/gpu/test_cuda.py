"""CUDA/NCCL checks; skipped cleanly without a GPU. The check runs in its own process so that
CUDA is never initialized in the test process (the other tests fork ranks from it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or not torch.distributed.is_nccl_available(), reason="needs CUDA"),
]


def test_engine_on_cuda_with_nccl():
    script = Path(__file__).with_name("cuda_parity.py")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "CUDA OK" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
