"""Fused Adam and AdamW."""

from __future__ import annotations

from typing import Optional

from .. import _ops
from ._base import FusedOptimizer, _check_betas, _check_range, _compat_kwargs


class Adam(FusedOptimizer):
    """Adam with the arguments and defaults of :class:`torch.optim.Adam`
    (L2 weight decay unless ``decoupled_weight_decay=True``), whose whole step
    runs as one fused pass per group on CPU or CUDA.

    Extra arguments:
      max_grad_norm: clip gradients to this global L2 norm inside the step
        (computed on the device, no host sync). ``None`` disables clipping.
      master_weights: keep an fp32 master copy of fp16/bf16 params; the update
        runs on the master and writes the rounded param in the same pass.

    ``foreach``, ``capturable`` and ``fused`` are accepted for compatibility
    (the step is always fused and capturable); ``differentiable`` is not supported.
    """

    _opt_name = "Adam"
    _decoupled_default = False

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, *,
                 foreach: Optional[bool] = None, maximize: bool = False, capturable: bool = False,
                 differentiable: bool = False, fused: Optional[bool] = None,
                 decoupled_weight_decay: Optional[bool] = None, max_grad_norm: Optional[float] = None,
                 master_weights: bool = False):
        name = self._opt_name
        _check_range(name, "lr", lr, 0.0)
        _check_range(name, "eps", eps, 0.0)
        _check_range(name, "weight_decay", weight_decay, 0.0)
        _check_betas(name, betas)
        if decoupled_weight_decay is None:
            decoupled_weight_decay = self._decoupled_default
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=bool(amsgrad),
                        maximize=bool(maximize), **_compat_kwargs(name, foreach, capturable, differentiable, fused),
                        decoupled_weight_decay=bool(decoupled_weight_decay))
        super().__init__(params, defaults, max_grad_norm, master_weights)

    def _state_names(self, group):
        if group["amsgrad"]:
            return ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
        return ("exp_avg", "exp_avg_sq")

    def _update(self, group, lists, lr, tail) -> None:
        beta1, beta2 = group["betas"]
        s1, s2, s3 = lists["states"]
        _ops.fused_adam_(lists["params"], lists["grads"], s1, s2, s3, lists["steps"], lists["masters"],
                         lists["emas"], lr=lr, beta1=float(beta1), beta2=float(beta2),
                         weight_decay=float(group["weight_decay"]), eps=float(group["eps"]),
                         amsgrad=bool(group["amsgrad"]), maximize=bool(group["maximize"]),
                         decoupled_weight_decay=bool(group["decoupled_weight_decay"]), **tail)


class AdamW(Adam):
    """AdamW (decoupled weight decay) with the arguments and defaults of
    :class:`torch.optim.AdamW` (weight_decay=1e-2); see :class:`Adam` for the
    fused step and the extra arguments."""

    _opt_name = "AdamW"
    _decoupled_default = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
                 maximize: bool = False, foreach: Optional[bool] = None, capturable: bool = False,
                 differentiable: bool = False, fused: Optional[bool] = None, max_grad_norm: Optional[float] = None,
                 master_weights: bool = False):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         foreach=foreach, maximize=maximize, capturable=capturable, differentiable=differentiable,
                         fused=fused, decoupled_weight_decay=True, max_grad_norm=max_grad_norm,
                         master_weights=master_weights)
