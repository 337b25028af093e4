"""Shard layout: every shape splits into equal padded dim-0 shards that reassemble exactly."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from fsdp_strategy.engine.param import ParamUse, ShardedParam, ShardLayout

SHAPES = [(7, 3), (5,), (1, 4), (2, 3, 2), (), (4, 4), (3,), (0, 5)]  # (0, 5): an empty parameter


def _shards(param: nn.Parameter, world: int) -> list[ShardedParam]:
    holder = nn.Module()
    holder.weight = param
    cpu = torch.device("cpu")
    return [
        ShardedParam("weight", param, [ParamUse(holder, "weight")], ShardLayout(rank, world, cpu, cpu, None))
        for rank in range(world)
    ]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("shape", SHAPES)
def test_shards_are_equal_sized_chunks_that_reassemble(shape, world):
    full = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape) + 1
    shards = _shards(nn.Parameter(full.clone()), world)
    dim0 = shape[0] if shape else 1
    rows = math.ceil(dim0 / world)
    row_numel = math.prod(shape[1:])
    expected_chunks = list(full.reshape(dim0, row_numel).chunk(world)) if dim0 >= world else None
    for rank, shard in enumerate(shards):
        assert shard.sharded.shape == (rows, *shape[1:])
        local = shard.sharded.detach().reshape(rows, row_numel)
        start = rank * rows
        real = max(0, min(rows, dim0 - start))
        assert torch.equal(local[:real], full.reshape(dim0, row_numel)[start : start + real])
        assert torch.count_nonzero(local[real:]) == 0  # padding is zero
        if expected_chunks is not None and rank < len(expected_chunks):
            assert torch.equal(local[: expected_chunks[rank].shape[0]], expected_chunks[rank])
    gathered = torch.cat([s.sharded.detach().reshape(-1) for s in shards]).view(world, -1)
    assert torch.equal(shards[0].full_from_rows(gathered), full)
    for rank, shard in enumerate(shards):
        assert torch.equal(shard.local_rows(full, rank), shard.sharded.detach())


def test_unsharded_storage_is_freed_and_refilled():
    shards = _shards(nn.Parameter(torch.randn(5, 3)), 2)
    shard = shards[0]
    shard.install(unsharded=False)  # as shard_model registers the shards
    assert not shard.unsharded_allocated
    gathered = torch.cat([s.sharded.detach().reshape(-1) for s in shards]).view(2, -1)
    shard.allocate_unsharded().copy_(gathered[:, : shard.shard_numel])
    assert shard.unsharded_allocated and torch.equal(shard.unsharded.detach(), shard.full_from_rows(gathered))
    shard.install(unsharded=True)
    assert shard.uses[0].module.weight is shard.unsharded
    shard.install(unsharded=False)
    shard.free_unsharded()
    assert shard.unsharded.untyped_storage().size() == 0
    assert shard.uses[0].module.weight is shard.sharded


def test_a_group_of_one_aliases_the_shard_and_frees_nothing():
    (shard,) = _shards(nn.Parameter(torch.randn(5, 3)), 1)
    assert shard.aliased and shard.unsharded_nbytes == 0
    assert shard.unsharded.data_ptr() == shard.sharded.data_ptr()  # no second copy of the weights
    shard.free_unsharded()
    assert shard.unsharded_allocated
    with torch.no_grad():
        shard.sharded.add_(1.0)  # an optimizer step on the shard is seen by the full parameter
    assert torch.equal(shard.unsharded, shard.sharded)
    cpu = torch.device("cpu")
    mixed = ShardedParam("w", nn.Parameter(torch.randn(2)), [], ShardLayout(0, 1, cpu, cpu, torch.bfloat16))
    assert not mixed.aliased  # a cast copy is needed for bf16


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("shape", SHAPES)
def test_grad_rows_land_padded_in_strided_columns_with_the_stash_added(shape, world):
    (shard, *_) = _shards(nn.Parameter(torch.zeros(shape, dtype=torch.bfloat16)), world)
    first = torch.randn(shape, dtype=torch.bfloat16)
    second = torch.randn(shape, dtype=torch.bfloat16)
    shard.unsharded.grad = first
    assert shard.stash_grad(torch.float32) == 4 * math.prod(shape)  # kept in the reduce dtype
    assert shard.unsharded.grad is None and shard.stashed_grad.dtype == torch.float32
    shard.unsharded.grad = second
    buffer = torch.full((world, shard.shard_numel + 5), 7.0)  # other columns around ours
    assert shard.take_grad_rows(buffer[:, 2 : 2 + shard.shard_numel])
    expected = first.float() + second.float()  # summed in fp32, not in bf16
    padded = buffer[:, 2 : 2 + shard.shard_numel].reshape(world * shard.chunk_rows, shard.row_numel)
    dim0 = shape[0] if shape else 1
    assert torch.equal(padded[:dim0], expected.reshape(dim0, shard.row_numel))
    assert torch.count_nonzero(padded[dim0:]) == 0  # padding rows are zero
    assert torch.all(buffer[:, :2] == 7.0) and torch.all(buffer[:, 2 + shard.shard_numel :] == 7.0)
    assert shard.unsharded.grad is None and shard.stashed_grad is None
    assert not shard.take_grad_rows(buffer[:, 2 : 2 + shard.shard_numel])  # nothing left: zeros, unused
    assert torch.count_nonzero(buffer[:, 2 : 2 + shard.shard_numel]) == 0
