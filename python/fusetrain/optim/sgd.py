"""Fused SGD."""

from __future__ import annotations

from typing import Optional, Union

import torch

from ._base import FusedOptimizer
from ._table import DEFAULT


class SGD(FusedOptimizer):
    """SGD with the arguments and defaults of :class:`torch.optim.SGD`
    (momentum, dampening, nesterov, weight decay, maximize), whose whole step
    runs as one fused pass per group. See :class:`fusetrain.optim.Adam` for
    ``max_grad_norm`` and ``master_weights``.

    The state holds ``momentum_buffer`` as torch's SGD does, plus a per-param
    ``step`` tensor that tells the first momentum step on the device.
    """

    _sparse_grads = True  # as torch.optim.SGD (NOTE [sparse gradients] in _base.py)

    def __init__(self, params, lr=DEFAULT, momentum=DEFAULT, dampening=DEFAULT, weight_decay=DEFAULT,
                 nesterov=DEFAULT, *, maximize: bool = False, foreach: Optional[bool] = None,
                 differentiable: bool = False, fused: Optional[bool] = None, max_grad_norm: Optional[float] = DEFAULT,
                 master_weights: Union[bool, str] = False, state_dtype: Union[torch.dtype, str] = torch.float32,
                 state_block_size: int = 256):
        self._from_table(params, locals())

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
