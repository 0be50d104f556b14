"""Synchronised batch norm built on fusetrain's batch-norm ops.

Training forward on each rank: ``bn_stats`` gives the local (count, mean, M2)
per channel; one all-gather exchanges them; Chan's parallel formula merges
them into the global mean and variance (a rank with no samples has count 0 and
drops out of every sum, with no mask or host branch); ``bn_elemt`` normalises.
Backward: ``bn_backward_reduce`` gives the local (sum dy, sum dy*(x-mean)); one
all-reduce makes them global; ``bn_backward_elemt`` forms the input gradient.
The collectives are the functional ones (``torch.ops._c10d_functional``), so
the layer traces into a single graph under ``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.nn.modules.batchnorm import _BatchNorm

from .._ops import bn_backward_elemt, bn_backward_reduce, bn_elemt, bn_stats

__all__ = ["SyncBatchNorm", "convert_sync_batchnorm"]

_warned_local = False
_group_info = None  # _group_name_and_size, marked constant for dynamo (see there)


def _c10d():
    return torch.ops._c10d_functional


class _SyncBatchNormFunction(torch.autograd.Function):
    """y = batch norm of x with statistics over the whole process group.
    Returns (y, mean, unbiased var); mean and var are not differentiable and
    feed the running-statistics update."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float, group_name: str,
                world_size: int):
        c = x.shape[1]
        count, mean, m2 = bn_stats(x)
        local = torch.cat([count.reshape(1), mean, m2])
        gathered = _c10d().all_gather_into_tensor(local, world_size, group_name)
        gathered = _c10d().wait_tensor(gathered).view(world_size, 2 * c + 1)
        counts = gathered[:, :1]
        means = gathered[:, 1:c + 1]
        m2s = gathered[:, c + 1:]
        # Chan's formula for all ranks at once:
        #   n = sum n_i, mean = sum n_i*mean_i / n, M2 = sum M2_i + n_i*(mean_i - mean)^2.
        n = counts.sum(0)
        n_safe = n.clamp(min=1.0)
        g_mean = (counts * means).sum(0) / n_safe
        g_m2 = (m2s + counts * (means - g_mean).square()).sum(0)
        invstd = torch.rsqrt(g_m2 / n_safe + eps)
        var_unbiased = g_m2 / (n - 1.0).clamp(min=1.0)
        y = bn_elemt(x, g_mean, invstd, weight, bias)
        ctx.save_for_backward(x, weight, g_mean, invstd, n)
        ctx.group_name = group_name
        ctx.mark_non_differentiable(g_mean, var_unbiased)
        return y, g_mean, var_unbiased

    @staticmethod
    def backward(ctx, dy: Tensor, _grad_mean, _grad_var):
        x, weight, mean, invstd, n = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        grad_x = grad_w = grad_b = None
        sum_dy, sum_dy_xmu = bn_backward_reduce(dy, x, mean)
        # As torch's SyncBatchNorm: weight/bias gradients are local (a data-
        # parallel wrapper averages them), the input gradient uses global sums.
        if need_w:
            grad_w = (sum_dy_xmu * invstd).to(weight.dtype)
        if need_b:
            grad_b = sum_dy.to(weight.dtype if weight is not None else torch.float32)
        if need_x:
            c = x.shape[1]
            both = _c10d().all_reduce(torch.cat([sum_dy, sum_dy_xmu]), "sum", ctx.group_name)
            both = _c10d().wait_tensor(both)
            grad_x = bn_backward_elemt(dy, x, mean, invstd, weight, both[:c], both[c:], n)
        return grad_x, grad_w, grad_b, None, None, None


def _group_name_and_size(group: Any) -> tuple[str, int]:
    """(name, size) of the group to synchronise over; ("", 1) when not in a
    distributed run. Constant for the life of a process group, so compiled
    code treats it as a constant instead of tracing into c10d (marked with
    torch._dynamo.assume_constant_result when the first layer is built, which
    keeps ``import fusetrain`` from importing dynamo)."""
    if not (dist.is_available() and dist.is_initialized()):
        return "", 1
    if group is None:
        group = dist.group.WORLD
    return group.group_name, dist.get_world_size(group)


def _warn_local_once() -> None:
    global _warned_local
    if not _warned_local:
        _warned_local = True
        warnings.warn("fusetrain.nn.SyncBatchNorm: torch.distributed is not initialized or the process group has "
                      "one rank; batch statistics are computed locally (as BatchNorm)", stacklevel=3)


class SyncBatchNorm(_BatchNorm):
    """Batch norm over (N, C, *) inputs whose training statistics are computed
    over the whole process group (``process_group``, default: the world).

    Drop-in for ``torch.nn.SyncBatchNorm``: same constructor, parameters,
    buffers and state-dict keys (it is a ``_BatchNorm``). Differences: it runs
    on CPU (gloo) and CUDA, one all-gather per layer in the forward and one
    all-reduce in the backward, ranks may hold any number of samples including
    none, the running-average factor for ``momentum=None`` stays on the device,
    and it compiles with ``torch.compile(fullgraph=True)`` without graph
    breaks. Outside a distributed run (or with a one-rank group) it is exactly
    ``F.batch_norm`` and warns once.

    Gradients of ``weight``/``bias`` are the local ones, as with torch's
    SyncBatchNorm (DistributedDataParallel averages them); the input gradient
    accounts for every rank's samples.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: Optional[float] = 0.1, affine: bool = True,
                 track_running_stats: bool = True, process_group: Any = None, device=None, dtype=None) -> None:
        if not isinstance(num_features, int) or isinstance(num_features, bool) or num_features <= 0:
            raise ValueError(f"SyncBatchNorm: num_features must be a positive int, got {num_features!r}")
        if momentum is not None and not 0.0 <= float(momentum) <= 1.0:
            raise ValueError(f"SyncBatchNorm: momentum must be None or in [0, 1], got {momentum!r}")
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        self.process_group = process_group
        global _group_info
        if _group_info is None:
            import torch._dynamo

            _group_info = torch._dynamo.assume_constant_result(_group_name_and_size)

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm: expected an input of shape (N, C, *) with at least 2 dims, got "
                             f"{input.dim()}D input")

    def forward(self, input: Tensor) -> Tensor:
        self._check_input_dim(input)
        if input.shape[1] != self.num_features:
            raise ValueError(f"SyncBatchNorm: input has {input.shape[1]} channels (dim 1) but num_features is "
                             f"{self.num_features}")
        bn_training = self.training or (self.running_mean is None and self.running_var is None)
        update_stats = self.training and self.track_running_stats
        group_name, world_size = _group_info(self.process_group)
        if not (self.training and bn_training and world_size > 1):
            if self.training:
                _warn_local_once()
            return self._local_forward(input, bn_training)

        if update_stats:
            self.num_batches_tracked.add_(1)
        y, mean, var = _SyncBatchNormFunction.apply(input, self.weight, self.bias, self.eps, group_name, world_size)
        if update_stats:
            with torch.no_grad():
                if self.momentum is None:
                    # Cumulative average, factor 1/num_batches_tracked as a device tensor.
                    factor = 1.0 / self.num_batches_tracked
                else:
                    factor = self.momentum
                self.running_mean.copy_(mean * factor + self.running_mean * (1.0 - factor))
                self.running_var.copy_(var * factor + self.running_var * (1.0 - factor))
        return y

    def _local_forward(self, input: Tensor, bn_training: bool) -> Tensor:
        # torch.nn.BatchNorm's forward, step for step.
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                factor = 1.0 / float(self.num_batches_tracked)
        track = not self.training or self.track_running_stats
        return F.batch_norm(input, self.running_mean if track else None, self.running_var if track else None,
                            self.weight, self.bias, bn_training, factor, self.eps)


def convert_sync_batchnorm(module: torch.nn.Module, process_group: Any = None) -> torch.nn.Module:
    """Replace every batch-norm layer of ``module`` (any ``_BatchNorm``:
    BatchNorm1d/2d/3d, torch's SyncBatchNorm, ...) by a fusetrain
    ``SyncBatchNorm`` that shares its parameters and buffers (so values,
    ``requires_grad``, device and dtype carry over) and its training flag.
    Returns the module (a new one when ``module`` itself is a batch norm)."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"convert_sync_batchnorm: module must be a torch.nn.Module, got {type(module).__name__}")
    out = module
    if isinstance(module, _BatchNorm):
        out = SyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                            module.track_running_stats, process_group)
        if module.affine:
            with torch.no_grad():
                out.weight = module.weight
                out.bias = module.bias
        out.running_mean = module.running_mean
        out.running_var = module.running_var
        out.num_batches_tracked = module.num_batches_tracked
        out.training = module.training
        if hasattr(module, "qconfig"):
            out.qconfig = module.qconfig
    for name, child in module.named_children():
        out.add_module(name, convert_sync_batchnorm(child, process_group))
    return out
