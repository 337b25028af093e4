"""SyncBatchNorm (``Trainer(sync_batchnorm=True)``) against BatchNorm on the concatenated global
batch: outputs, input and weight gradients, running statistics; uneven and empty per-rank batches,
2-D and 4-D inputs; a ``torch.nn.SyncBatchNorm``, over its ``process_group``."""

from __future__ import annotations

import torch
from dist_utils import run_ranks
from torch import nn

from fsdp_strategy.sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm

SIZES = {"uneven": (3, 2), "empty_on_rank1": (3, 0)}
SHAPES = {"1d": (4,), "2d": (4, 3, 2)}


def _inputs(sizes: tuple[int, int], shape: tuple[int, ...]) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(n, *shape, generator=generator) * 2 + 1 for n in sizes]


def _body(rank: int, world: int) -> dict:
    results = {}
    for size_name, sizes in SIZES.items():
        for shape_name, shape in SHAPES.items():
            torch.manual_seed(0)
            layer = convert_sync_batchnorm(nn.BatchNorm1d(4) if len(shape) == 1 else nn.BatchNorm2d(4))
            assert isinstance(layer, SyncBatchNorm) and isinstance(layer, nn.SyncBatchNorm)
            nn.init.normal_(layer.weight)
            x = _inputs(sizes, shape)[rank].requires_grad_(True)
            out = layer(x)
            (out.pow(3).sum() if out.numel() else out.sum()).backward()
            grads = torch.cat([layer.weight.grad, layer.bias.grad])
            torch.distributed.all_reduce(grads)  # what the engine's reduction sums (before its divide)
            results[(size_name, shape_name)] = (out.detach(), x.grad, grads, layer.running_mean, layer.running_var)
    return results


def test_sync_batchnorm_equals_batchnorm_on_the_global_batch(tmp_path):
    ranks = run_ranks(_body, 2, tmp_path)
    for size_name, sizes in SIZES.items():
        for shape_name, shape in SHAPES.items():
            torch.manual_seed(0)
            reference = nn.BatchNorm1d(4) if len(shape) == 1 else nn.BatchNorm2d(4)
            nn.init.normal_(reference.weight)
            x = torch.cat(_inputs(sizes, shape)).requires_grad_(True)
            out = reference(x)
            out.pow(3).sum().backward()
            expected_grads = torch.cat([reference.weight.grad, reference.bias.grad])
            for rank, result in enumerate(ranks):
                got_out, got_grad, got_param_grads, mean, var = result[(size_name, shape_name)]
                rows = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
                what = f"{size_name}/{shape_name} rank {rank}"
                assert torch.allclose(got_out, out[rows].detach(), atol=1e-5), what
                assert torch.allclose(got_grad, x.grad[rows], atol=1e-4), what
                assert torch.allclose(got_param_grads, expected_grads, atol=1e-4), what
                assert torch.allclose(mean, reference.running_mean, atol=1e-6), what
                assert torch.allclose(var, reference.running_var, atol=1e-5), what


def _group_body(rank: int, world: int) -> torch.Tensor:
    groups = [torch.distributed.new_group([0, 1]), torch.distributed.new_group([2])]  # every rank creates both
    layer = convert_sync_batchnorm(nn.BatchNorm1d(4), process_group=groups[0 if rank < 2 else 1])
    layer(_inputs((3, 2, 4), (4,))[rank])
    return layer.running_mean


def test_statistics_cover_the_layers_process_group_only(tmp_path):
    means = run_ranks(_group_body, 3, tmp_path)
    inputs = _inputs((3, 2, 4), (4,))
    for ranks, mean in (((0, 1), means[0]), ((0, 1), means[1]), ((2,), means[2])):
        reference = nn.BatchNorm1d(4)
        reference(torch.cat([inputs[r] for r in ranks]))
        assert torch.allclose(mean, reference.running_mean, atol=1e-6), ranks
