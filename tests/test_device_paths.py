"""The checks of the CUDA/NCCL paths that CPU ranks can make: what the engine hands to its
collectives and checkpoint views (dtypes, divide factors, devices, tensor identity) is what NCCL
and a GPU would need. One spawned group of 3 ranks runs them all."""

from __future__ import annotations

from pathlib import Path

import torch
from dist_utils import excerpt, run_ranks
from models import Block, TiedLM, lm_loss, make_batches
from torch import nn

from fsdp_strategy import MixedPrecision
from fsdp_strategy.checkpoint import full_optimizer_state_dict, full_state_dict, load_folder, save_folder
from fsdp_strategy.engine import get_scheduler, shard_model


def _float16_mean_of_large_gradients(rank: int, world: int) -> dict:
    """Each rank's gradient is 30000 (float16's largest finite value is 65504): the sum of three
    overflows, the mean must not."""
    results = {}
    for strategy in ("FULL_SHARD", "NO_SHARD"):
        torch.manual_seed(0)
        model = nn.Linear(4, 6, bias=False)
        precision = MixedPrecision(param_dtype=torch.float32, reduce_dtype=torch.float16)
        shard_model(model, sharding_strategy=strategy, mixed_precision=precision)
        (model(torch.ones(1, 4)) * 30000.0).sum().backward()
        scheduler = get_scheduler(model)
        (unit,) = scheduler.units
        (grad,) = unit.gather_full([p.sharded.grad for p in unit.params])
        results[strategy] = grad
        scheduler.close()
    return results


def _hsdp_offloaded(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """HSDP with CPU-offloaded shards, its mesh swapped for a CUDA-typed one over the same groups:
    what a GPU job's checkpoints see (a CUDA mesh, shards on the CPU)."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    torch.manual_seed(seed)
    model = TiedLM()
    mesh = init_device_mesh("cpu", (1, 3), mesh_dim_names=("replicate", "shard"))
    shard_model(model, sharding_strategy="HYBRID_SHARD", device_mesh=mesh, auto_wrap_policy={Block}, cpu_offload=True)
    groups = [mesh.get_group(0), mesh.get_group(1)]
    cuda_mesh = DeviceMesh.from_group(groups, "cuda", mesh=mesh.mesh, mesh_dim_names=mesh.mesh_dim_names)
    get_scheduler(model).device_mesh = cuda_mesh
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _offloaded_hsdp_checkpoint(rank: int, world: int, folder: str) -> dict:
    model, optimizer = _hsdp_offloaded(0)
    lm_loss(model, make_batches(1, 2 * world)[0][rank::world]).backward()
    optimizer.step()
    save_folder(Path(folder), model, [optimizer], {})
    saved = {"model": full_state_dict(model), "optim": full_optimizer_state_dict(model, optimizer)}
    fresh, fresh_optimizer = _hsdp_offloaded(1)
    load_folder(Path(folder), fresh, [fresh_optimizer])
    loaded = {"model": full_state_dict(fresh), "optim": full_optimizer_state_dict(fresh, fresh_optimizer)}
    for model_ in (model, fresh):
        get_scheduler(model_).close()
    return {"saved": saved, "loaded": loaded}


class _SharedBuffer(nn.Module):
    """One buffer tensor registered in two modules (a shared positional table)."""

    def __init__(self) -> None:
        super().__init__()
        table = torch.arange(6.0)
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)
        self.a.register_buffer("table", table)
        self.b.register_buffer("table", table)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x + self.a.table)) + self.b.table


def _shared_buffer_stays_shared(rank: int, world: int) -> bool:
    model = _SharedBuffer()
    shard_model(model, mixed_precision=MixedPrecision(buffer_dtype=torch.bfloat16), auto_wrap_policy={nn.Linear})
    model.a.table.add_(1)  # an in-place update through one registration is seen by the other
    shared = model.a.table is model.b.table and model.b.table.dtype == torch.bfloat16
    get_scheduler(model).close()
    return shared


def _device_paths_body(rank: int, world: int, folder: str) -> dict:
    return {
        "float16_mean": _float16_mean_of_large_gradients(rank, world),
        "offloaded_hsdp": _offloaded_hsdp_checkpoint(rank, world, folder),
        "shared_buffer": _shared_buffer_stays_shared(rank, world),
    }


def test_device_paths_world_3(tmp_path):
    results = run_ranks(_device_paths_body, 3, tmp_path, str(tmp_path / "hsdp"))
    assert results[0]["offloaded_hsdp"]["saved"]["optim"]["state"]  # rank 0 holds the full states
    for result in results:
        for strategy, grad in result["float16_mean"].items():
            # the exact mean: every rank's gradient is 30000, so is their mean (sum then divide gave inf)
            assert torch.equal(grad.float(), torch.full((6, 4), 30000.0)), (strategy, grad)
        # the checkpoint view's mesh is on the shards' device: a load fills the CPU shards themselves
        saved, loaded = result["offloaded_hsdp"]["saved"], result["offloaded_hsdp"]["loaded"]
        for name, tensor in saved["model"].items():
            assert torch.equal(loaded["model"][name], tensor), name
        for fqn, entries in saved["optim"].get("state", {}).items():
            for key, value in entries.items():
                assert torch.equal(loaded["optim"]["state"][fqn][key], value), (fqn, key)
        assert result["shared_buffer"], "a buffer registered in two modules was split by its placement"


def test_gpu_acceptance_script_runs_on_the_cpu():
    """The GPU suite's own logic, on the CPU with gloo (its CUDA-only rows skip): it runs, every
    other row passes, its multi-rank checks run on two spawned ranks, and the table names each check."""
    import subprocess
    import sys

    script = Path(__file__).with_name("gpu") / "acceptance.py"
    done = subprocess.run([sys.executable, str(script), "--cpu"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "all checks passed" in done.stdout, done.stdout + excerpt(done.stderr, 3000)
    lines = [line for line in done.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    per_rank = [line for line in lines if line.startswith("| rank ")]  # printed by each rank as a check ends
    rows = [line for line in lines if line not in per_rank][1:]
    assert len(per_rank) == 12 and all("| pass |" in line for line in per_rank), per_rank
    assert len(rows) == 23 and all("| pass |" in row or "| skip | not implemented: needs CUDA |" in row for row in rows)
    assert sum("world 2 (gloo)" in row and "| pass |" in row for row in rows) == 6, rows  # the multi-rank checks
