"""Two torchrun "nodes" of two ranks on this machine: HYBRID_SHARD shards within a node and
replicates across nodes by default (as FSDP1 and Lightning), _HYBRID_SHARD_ZERO2 is HSDP with
SHARD_GRAD_OP inside the node; both train as Lightning's DDP does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from dist_utils import excerpt, free_port, run_torchrun_nodes

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_hybrid_strategies_on_two_torchrun_nodes(tmp_path):
    nodes = run_torchrun_nodes(str(ROOT / "tests" / "multinode_hybrid.py"), [], free_port(), tmp_path)
    outputs = [output for _, output in nodes]
    assert all(code == 0 for code, _ in nodes), "\n".join(excerpt(out, 3000) for out in outputs)
    report = json.loads(next(line for line in outputs[0].splitlines() if line.startswith("REPORT "))[7:])
    for name, reshards in (("HYBRID_SHARD", True), ("_HYBRID_SHARD_ZERO2", False)):
        result = report[name]
        assert result["groups"] == [2, 2]  # 2 ranks per node hold the shards, 2 nodes replicate them
        assert result["shard_ranks"] == [0, 1]  # global rank 0's shard group is node 0's ranks
        assert result["reshard_after_forward"] is reshards
        assert result["losses"] == pytest.approx(report["ddp"], rel=1e-5), name
