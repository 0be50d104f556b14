"""Fused SGD."""

from __future__ import annotations

from typing import Optional

from .. import _ops
from ._base import FusedOptimizer, _check_range, _compat_kwargs


class SGD(FusedOptimizer):
    """SGD with the arguments and defaults of :class:`torch.optim.SGD`
    (momentum, dampening, nesterov, weight decay, maximize), whose whole step
    runs as one fused pass per group. See :class:`fusetrain.optim.Adam` for
    ``max_grad_norm`` and ``master_weights``.

    The state holds ``momentum_buffer`` as torch's SGD does, plus a per-param
    ``step`` tensor that tells the first momentum step on the device.
    """

    _opt_name = "SGD"

    def __init__(self, params, lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, *,
                 maximize: bool = False, foreach: Optional[bool] = None, differentiable: bool = False,
                 fused: Optional[bool] = None, max_grad_norm: Optional[float] = None, master_weights: bool = False):
        name = self._opt_name
        _check_range(name, "lr", lr, 0.0)
        _check_range(name, "momentum", momentum, 0.0)
        _check_range(name, "dampening", dampening, 0.0)
        _check_range(name, "weight_decay", weight_decay, 0.0)
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError(f"{name}: nesterov=True requires momentum > 0 and dampening == 0, "
                             f"got momentum={momentum}, dampening={dampening}")
        compat = _compat_kwargs(name, foreach, False, differentiable, fused)
        compat.pop("capturable")
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                        nesterov=bool(nesterov), maximize=bool(maximize), **compat)
        super().__init__(params, defaults, max_grad_norm, master_weights)

    def _state_names(self, group):
        return ("momentum_buffer",) if group["momentum"] != 0 else ()

    def _new_step_value(self, state) -> float:
        # A momentum buffer loaded from torch.optim.SGD is past its first step.
        return 1.0 if state.get("momentum_buffer") is not None else 0.0

    def _update(self, group, lists, lr, tail) -> None:
        s1, _, _ = lists["states"]
        _ops.fused_sgd_(lists["params"], lists["grads"], s1, lists["steps"], lists["masters"], lists["emas"], lr=lr,
                        momentum=float(group["momentum"]), dampening=float(group["dampening"]),
                        weight_decay=float(group["weight_decay"]), nesterov=bool(group["nesterov"]),
                        maximize=bool(group["maximize"]), **tail)
