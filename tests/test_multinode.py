"""Two torchrun "nodes" of two ranks on this machine: HYBRID_SHARD shards within a node and
replicates across nodes by default (as FSDP1 and Lightning), _HYBRID_SHARD_ZERO2 is HSDP with
SHARD_GRAD_OP inside the node; both train as Lightning's DDP does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_hybrid_strategies_on_two_torchrun_nodes():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    script = str(ROOT / "tests" / "multinode_hybrid.py")
    common = ["--nnodes=2", "--nproc_per_node=2", "--master_addr=127.0.0.1", "--master_port=29561"]
    nodes = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", *common, f"--node_rank={rank}", script],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    outputs = []
    try:
        for node in nodes:
            outputs.append(node.communicate(timeout=300)[0])
    finally:
        for node in nodes:
            node.kill()
    assert all(node.returncode == 0 for node in nodes), "\n".join(out[-3000:] for out in outputs)
    report = json.loads(next(line for line in outputs[0].splitlines() if line.startswith("REPORT "))[7:])
    for name, reshards in (("HYBRID_SHARD", True), ("_HYBRID_SHARD_ZERO2", False)):
        result = report[name]
        assert result["groups"] == [2, 2]  # 2 ranks per node hold the shards, 2 nodes replicate them
        assert result["shard_ranks"] == [0, 1]  # global rank 0's shard group is node 0's ranks
        assert result["reshard_after_forward"] is reshards
        assert result["losses"] == pytest.approx(report["ddp"], rel=1e-5), name
