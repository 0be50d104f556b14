"""Python side of the native ops: loads the core and registers a fake (meta)
implementation for each op so that torch.compile and FakeTensor tracing work.
Each public function is a thin call into ``torch.ops.fusetrain``."""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from . import _C  # noqa: F401  (loading _C loads libfusetrain_core, which registers the ops)

_ops = torch.ops.fusetrain


def build_info() -> dict:
    """What this build contains: ``{"cuda": bool, "cuda_archs": str, "cpu_avx2": bool}``."""
    return dict(_C.build_info())


def optim_kinds() -> list:
    """The optimizer kinds of ``fused_step_`` (the C++ kind table, generated
    from the optimizer table, fusetrain/optim/_table.py): for each, its
    ``name``, ``doc``, its record's own ``fields`` in order (``name``,
    ``type``, ``doc``, ``default``, the allowed range ``low``, ``high``,
    ``high_closed``, a choice's ``choices``) and its per-param ``states``
    (``slot`` in state1..3,
    ``name``, the condition field ``when`` and ``when_set``, ``scalar``,
    ``initial`` and ``initial_when``) and its ``value_fields``: the fields a
    schedule may change, read on the device from a group's values tensor."""
    return _C.optim_kinds()


def abandon_capture(device: torch.device, pool: tuple) -> None:
    """After a CUDA-graph capture that failed before it ended: end the device
    and pinned-host allocators' routing into the graph's memory pool and
    release the pool (NOTE [failed capture] in csrc/ops/capture.h)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    _C._abandon_capture(index, tuple(pool))


# ---- fake kernels --------------------------------------------------------------


@torch.library.register_fake("fusetrain::grad_stats")
def _grad_stats_fake(grads, inv_scale=None):
    if len(grads) > 0:
        device = grads[0].device
    elif inv_scale is not None:
        device = inv_scale.device
    else:
        device = torch.device("cpu")
    return (
        torch.empty((), dtype=torch.float32, device=device),
        torch.empty((), dtype=torch.float32, device=device),
    )


def _update_fake(*args, **kwargs):
    # The update ops only mutate their inputs in place; nothing to allocate.
    return None


for _name in ("ema_update_", "update_scale_", "fused_step_", "ema_decay_", "ema_step_", "gated_copy_"):
    torch.library.register_fake(f"fusetrain::{_name}")(_update_fake)


# ---- thin wrappers -----------------------------------------------------------------


def grad_stats(grads: Sequence[Tensor], inv_scale: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """Global L2 norm of ``grads`` (times ``inv_scale`` when given) and a
    non-finite flag (1.0 when any element is inf/NaN), as 0-d float32 tensors
    on the gradients' device. One read of each gradient; no host sync."""
    return _ops.grad_stats(list(grads), inv_scale)


def fused_step_(optimizer: str, params, grads, state_steps, state1, state2, state3, master_params, ema_params,
                group_sizes, lrs, hyper, *, inv_scale=None, found_inf=None, ema_decay=None, grad_norm_out=None,
                found_inf_out=None, grad_norm=None, group_values=(), state_scales=(), ema_remainders=(),
                stalled_out=None) -> None:
    """The whole optimizer tail for every group of one optimizer (a kind of
    ``optim_kinds()``): the stats pass when a group clips or the gradients
    are loss-scaled without a flag, then one update pass per group. Lists are
    flattened over groups; ``group_sizes``, ``lrs`` and ``hyper`` describe the
    groups (NOTE [group records] in csrc/ops/fused_step.cpp; the records'
    fields are in ``optim_kinds()`` and docs/ops.md). ``grad_norm_out``
    and ``found_inf_out`` receive the global norm (NaN when none was measured)
    and the step's non-finite flag. ``group_values``: one float64 vector per
    group holding the kind's ``value_fields``: on its params' device the
    kernels read them there (NOTE [device values] in
    csrc/common/update_launch.h); on the CPU the op reads and checks them on
    the host (NOTE [compiled settings] in fusetrain/optim/_group_values.py).
    ``state_scales``: the block scales of int8 state tensors (NOTE [group
    records]; NOTE [8-bit state] in csrc/common/lean_state.h).
    ``ema_remainders``: one int16 tensor per bfloat16 entry of ``ema_params``
    (or none), which with it is the exact float32 EMA (NOTE [ema remainder]).
    ``stalled_out``: a 0-d int64 tensor on the params' device that gets the
    step's stalled updates added (NOTE [stalled updates])."""
    _ops.fused_step_(optimizer, params, grads, state_steps, state1, state2, state3, master_params, ema_params,
                     group_sizes, lrs, hyper, inv_scale, found_inf, ema_decay, grad_norm_out, found_inf_out,
                     grad_norm, list(group_values) or None, list(state_scales) or None, list(ema_remainders) or None,
                     stalled_out)


def ema_decay_(decay_out: Tensor, step: Tensor, total_steps: Optional[Tensor], decay_type: str, decay: float,
               beta: float, warmup: bool, warmup_gamma: float, warmup_power: float) -> None:
    """The EMA decay of update number ``step + 1`` into ``decay_out`` (the
    schedules of :class:`fusetrain.ModelEMA`), evaluated on the device."""
    _ops.ema_decay_(decay_out, step, total_steps, decay_type, decay, beta, warmup, warmup_gamma, warmup_power)


def ema_step_(ema: Sequence[Tensor], src: Sequence[Tensor], copy_dst: Sequence[Tensor], copy_src: Sequence[Tensor],
              decay: Tensor, step: Tensor, found_inf: Optional[Tensor] = None,
              remainders: Sequence[Tensor] = ()) -> None:
    """One EMA update: ``ema += (1 - decay) * (src - ema)`` pairwise,
    ``copy_dst <- copy_src`` and ``step += 1``; nothing changes when
    ``found_inf`` is non-zero (decided on the device). ``remainders``: one
    int16 tensor per bfloat16 ``ema`` tensor, or none (NOTE [ema remainder])."""
    _ops.ema_step_(list(ema), list(src), list(copy_dst), list(copy_src), decay, step, found_inf,
                   list(remainders) or None)


def ema_update_(ema: Sequence[Tensor], src: Sequence[Tensor], decay: Tensor, found_inf: Optional[Tensor] = None,
                remainders: Sequence[Tensor] = ()) -> None:
    """``ema += (1 - decay) * (src - ema)`` for every pair, in one multi-tensor
    pass; ``decay`` is a 0-d float32 device tensor; nothing changes when
    ``found_inf`` is non-zero (checked on the device). ``remainders``: one
    int16 tensor per bfloat16 ``ema`` tensor, or none; each such pair is then
    the exact float32 EMA (NOTE [ema remainder] in csrc/common/lean_state.h)."""
    _ops.ema_update_(list(ema), list(src), decay, found_inf, list(remainders) or None)



def gated_copy_(dst: Sequence[Tensor], src: Sequence[Tensor], found_inf: Tensor) -> None:
    """``dst[i].copy_(src[i])`` for every pair (one dtype, shape and dense
    layout each) in one pass, unless ``found_inf`` (a 0-d float32 tensor on
    their device) is non-zero, which is checked on the device."""
    _ops.gated_copy_(list(dst), list(src), found_inf)

def update_scale_(scale: Tensor, growth_tracker: Tensor, found_inf: Tensor, growth_factor: float,
                  backoff_factor: float, growth_interval: int, last_skipped: Optional[Tensor] = None,
                  skipped_steps: Optional[Tensor] = None) -> None:
    """Dynamic loss-scale update in device memory (GradScaler semantics):
    ``scale *= backoff_factor`` on a non-finite step, ``scale *= growth_factor``
    after ``growth_interval`` consecutive clean steps. The optional skip
    counters get ``found_inf`` copied (``last_skipped``) and added
    (``skipped_steps``)."""
    _ops.update_scale_(scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval,
                       last_skipped, skipped_steps)


# ---- batch norm (fusetrain.nn.SyncBatchNorm) -----------------------------------------


def _bn_check_input(x, op):
    torch._check(x.dim() >= 2, lambda: f"{op}: x must have shape (N, C, *), got {tuple(x.shape)}")


@torch.library.register_fake("fusetrain::bn_stats")
def _bn_stats_fake(x):
    _bn_check_input(x, "bn_stats")
    c = x.shape[1]
    return (x.new_empty((), dtype=torch.float32), x.new_empty((c,), dtype=torch.float32),
            x.new_empty((c,), dtype=torch.float32))


@torch.library.register_fake("fusetrain::bn_backward_reduce")
def _bn_backward_reduce_fake(dy, x, mean):
    _bn_check_input(x, "bn_backward_reduce")
    c = x.shape[1]
    return x.new_empty((c,), dtype=torch.float32), x.new_empty((c,), dtype=torch.float32)


@torch.library.register_fake("fusetrain::bn_elemt")
def _bn_elemt_fake(x, mean, invstd, weight=None, bias=None):
    _bn_check_input(x, "bn_elemt")
    return torch.empty_like(x)


@torch.library.register_fake("fusetrain::bn_backward_elemt")
def _bn_backward_elemt_fake(dy, x, mean, invstd, weight, sum_dy, sum_dy_xmu, count):
    _bn_check_input(x, "bn_backward_elemt")
    return torch.empty_like(x)


def bn_stats(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-channel (dim 1) statistics of ``x`` (N, C, *): the element count per
    channel (0-d float32), the mean and M2 (sum of squared deviations from the
    mean), float32 of shape (C,). One pass over ``x``; zeros for an empty batch."""
    return _ops.bn_stats(x)


def bn_backward_reduce(dy: Tensor, x: Tensor, mean: Tensor) -> tuple[Tensor, Tensor]:
    """Per-channel ``sum(dy)`` and ``sum(dy * (x - mean))`` in float32."""
    return _ops.bn_backward_reduce(dy, x, mean)


def bn_elemt(x: Tensor, mean: Tensor, invstd: Tensor, weight: Optional[Tensor] = None,
             bias: Optional[Tensor] = None) -> Tensor:
    """``(x - mean) * invstd * weight + bias`` per channel, in the dtype and
    memory format of ``x``."""
    return _ops.bn_elemt(x, mean, invstd, weight, bias)


def bn_backward_elemt(dy: Tensor, x: Tensor, mean: Tensor, invstd: Tensor, weight: Optional[Tensor], sum_dy: Tensor,
                      sum_dy_xmu: Tensor, count: Tensor) -> Tensor:
    """Input gradient of batch norm from the global per-channel sums and count:
    ``invstd * weight * (dy - sum_dy/count - (x - mean) * invstd^2 * sum_dy_xmu/count)``."""
    return _ops.bn_backward_elemt(dy, x, mean, invstd, weight, sum_dy, sum_dy_xmu, count)
