"""Fused SGD."""

from __future__ import annotations

from typing import Optional, Union

import torch

from ._base import FusedOptimizer
from ._settings import _no_differentiable, _torch_checks


class SGD(FusedOptimizer):
    """SGD with the arguments and defaults of :class:`torch.optim.SGD`
    (momentum, dampening, nesterov, weight decay, maximize), whose whole step
    runs as one fused pass per group. See :class:`fusetrain.optim.Adam` for
    ``max_grad_norm`` and ``master_weights``.

    The state holds ``momentum_buffer`` as torch's SGD does, plus a per-param
    ``step`` tensor that tells the first momentum step on the device.
    """

    _opt_name = "SGD"
    _kind = "sgd"
    _sparse_grads = True  # as torch.optim.SGD (NOTE [sparse gradients] in _base.py)

    def __init__(self, params, lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, *,
                 maximize: bool = False, foreach: Optional[bool] = None, differentiable: bool = False,
                 fused: Optional[bool] = None, max_grad_norm: Optional[float] = None, master_weights: Union[bool, str] = False,
                 state_dtype: Union[torch.dtype, str] = torch.float32, state_block_size: int = 256):
        _no_differentiable(self._opt_name, differentiable)
        _torch_checks(torch.optim.SGD, lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                      nesterov=nesterov, maximize=maximize, foreach=foreach, fused=fused)
        if isinstance(weight_decay, torch.Tensor):
            weight_decay = float(weight_decay)  # read once here, not by every step
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                        nesterov=bool(nesterov), maximize=bool(maximize), foreach=foreach, differentiable=False,
                        fused=fused)
        super().__init__(params, defaults, max_grad_norm, master_weights, state_dtype, state_block_size)

    def _new_step_value(self, state) -> float:
        # A momentum buffer loaded from torch.optim.SGD is past its first step.
        return 1.0 if state.get("momentum_buffer") is not None else 0.0

    def _ensure_state(self, group, p) -> None:
        state = self.state[p]
        fresh = group["momentum"] != 0 and state.get("momentum_buffer") is None
        super()._ensure_state(group, p)
        if fresh and state.get("step") is not None:
            # NOTE [momentum start]: ``step`` counts the steps of the momentum
            # buffer, whose first one sets it to the gradient as torch does, also
            # when momentum is turned on after steps without it (or a checkpoint
            # saved without momentum is resumed with it).
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
