"""``Trainer(sync_batchnorm=True)``: BatchNorm statistics over the global batch, on CPU and CUDA.

The strategy converts BatchNorm layers into :class:`SyncBatchNorm`, a ``torch.nn.SyncBatchNorm``
(code that checks ``isinstance(layer, torch.nn.SyncBatchNorm)`` holds). Where torch's accepts
the input (CUDA), its own forward runs, with its fused kernels. On CPU, which torch's refuses,
each rank's per-channel count, mean and squared deviations are all-gathered over the layer's
``process_group`` (the data-parallel ranks; default: all) and combined (Chan's parallel formula,
as torch's ``batch_norm_gather_stats_with_counts``), and backward all-reduces the two
per-channel sums the input gradient needs. The layer keeps BatchNorm's attribute names, so
checkpoints and the engine's sharding of its weight and bias are unchanged. Costs on CPU: one
all-gather of 3 values per channel in forward and one all-reduce of 2 per channel in backward,
per layer call.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fsdp_strategy.engine import control


class _SyncBatchNormFunction(torch.autograd.Function):
    """Normalize with the global batch's statistics; gradients as BatchNorm on the global batch."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        eps: float,
        group: Any,
        dog: Any,
    ) -> Any:
        dims = [d for d in range(x.dim()) if d != 1]
        shape = [1, -1] + [1] * (x.dim() - 2)
        work = x.float()
        count = torch.tensor([x.numel() // x.shape[1]], dtype=torch.float32, device=x.device)
        mean = work.sum(dims) / count.clamp(min=1)  # a rank with an empty batch adds count 0, not NaN
        m2 = ((work - mean.view(shape)) ** 2).sum(dims)
        rows = control.all_gather_rows(torch.cat([count.expand_as(mean), mean, m2]), group, dog)  # (world, 3C)
        counts, means, m2s = rows.view(rows.shape[0], 3, -1).unbind(1)
        total = counts.sum(0)
        global_mean = (counts * means).sum(0) / total
        global_m2 = (m2s + counts * (means - global_mean) ** 2).sum(0)
        var = global_m2 / total
        invstd = torch.rsqrt(var + eps)
        xhat = (work - global_mean.view(shape)) * invstd.view(shape)
        ctx.save_for_backward(xhat, invstd, weight)
        ctx.total, ctx.group, ctx.dog = total, group, dog
        unbiased_var = var * total / (total - 1).clamp(min=1)
        ctx.mark_non_differentiable(global_mean, unbiased_var)
        out = xhat
        if weight is not None:
            out = out * weight.float().view(shape) + bias.float().view(shape)
        return out.to(x.dtype), global_mean, unbiased_var

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor, _grad_mean: Any, _grad_var: Any) -> Any:
        xhat, invstd, weight = ctx.saved_tensors
        dims = [d for d in range(xhat.dim()) if d != 1]
        shape = [1, -1] + [1] * (xhat.dim() - 2)
        grad = grad_out.float()
        sum_dy = grad.sum(dims)
        sum_dy_xhat = (grad * xhat).sum(dims)
        grad_weight = sum_dy_xhat.to(weight.dtype) if weight is not None else None
        grad_bias = sum_dy.to(weight.dtype) if weight is not None else None
        sums = control.all_reduce_sum_(torch.cat([sum_dy, sum_dy_xhat]), ctx.group, ctx.dog)
        global_dy, global_dy_xhat = sums.chunk(2)
        scale = invstd if weight is None else invstd * weight.float()
        grad_x = grad - (global_dy / ctx.total).view(shape) - xhat * (global_dy_xhat / ctx.total).view(shape)
        grad_x = grad_x * scale.view(shape)
        return grad_x.to(grad_out.dtype), grad_weight, grad_bias, None, None, None


class SyncBatchNorm(nn.SyncBatchNorm):
    """torch's ``SyncBatchNorm``, which also runs on CPU (see the module docstring).

    Outside training, or with one rank, it is plain BatchNorm. ``watchdog``: watches its CPU
    collectives ([Note: watchdog]); the strategy sets it for each run.
    """

    watchdog: Any = None

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if input.device.type != "cpu":  # torch's accepts it: its fused kernels
            return super().forward(input)
        self._check_input_dim(input)
        if not self.training or control.process_rank(self.process_group)[1] == 1:
            return nn.modules.batchnorm._BatchNorm.forward(self, input)
        out, mean, unbiased_var = _SyncBatchNormFunction.apply(
            input, self.weight, self.bias, self.eps, self.process_group, self.watchdog
        )
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                momentum = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
                self.running_mean.lerp_(mean.to(self.running_mean.dtype), momentum)
                self.running_var.lerp_(unbiased_var.to(self.running_var.dtype), momentum)
        return out


def convert_sync_batchnorm(module: nn.Module, process_group: Any = None) -> nn.Module:
    """Replace every BatchNorm layer (``_BatchNorm``) below ``module`` by a :class:`SyncBatchNorm`
    over ``process_group`` (None: all ranks) holding the same parameters and buffers; returns
    ``module`` (or the new layer if it is one)."""
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(module, SyncBatchNorm):
        converted = SyncBatchNorm(
            module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats, process_group
        )
        if module.affine:
            converted.weight, converted.bias = module.weight, module.bias
        converted.running_mean, converted.running_var = module.running_mean, module.running_var
        converted.num_batches_tracked = module.num_batches_tracked
        converted.train(module.training)
        return converted
    for name, child in module.named_children():
        replaced = convert_sync_batchnorm(child, process_group)
        if replaced is not child:
            setattr(module, name, replaced)
    return module


def apply_layer_sync(layer_sync: Any, model: nn.Module) -> nn.Module:
    """``Trainer(sync_batchnorm=True)``: our SyncBatchNorm (torch's refuses CPU tensors); any
    other ``LayerSync`` plugin (``layer_sync``) is applied as given. Not reverted at teardown: the
    layers hold sharded parameters, and ours is plain BatchNorm outside training. Costs: a walk
    over the modules."""
    from lightning.pytorch.plugins import TorchSyncBatchNorm

    if type(layer_sync) is TorchSyncBatchNorm:
        return convert_sync_batchnorm(model)
    return layer_sync.apply(model)
