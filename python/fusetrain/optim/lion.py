"""Fused Lion (sign momentum)."""

from __future__ import annotations

from typing import Optional, Union

import torch

from ._base import FusedOptimizer
from ._settings import _check_betas, _check_range


class Lion(FusedOptimizer):
    """Lion: ``p -= lr * (sign(beta1 * m + (1 - beta1) * g) + weight_decay * p)``,
    then ``m = beta2 * m + (1 - beta2) * g`` (weight decay decoupled, applied as
    ``p *= 1 - lr * weight_decay``). Defaults lr=1e-4, betas=(0.9, 0.99),
    weight_decay=0. One fused pass per group; see :class:`fusetrain.optim.Adam`
    for ``max_grad_norm`` and ``master_weights``. State: ``exp_avg`` and ``step``.
    """

    _opt_name = "Lion"
    _kind = "lion"

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, *, maximize: bool = False,
                 max_grad_norm: Optional[float] = None, master_weights: Union[bool, str] = False,
                 state_dtype: Union[torch.dtype, str] = torch.float32, state_block_size: int = 256):
        name = self._opt_name
        _check_range(name, "lr", lr, 0.0)
        _check_range(name, "weight_decay", weight_decay, 0.0)
        _check_betas(name, betas)
        defaults = dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay, maximize=bool(maximize))
        super().__init__(params, defaults, max_grad_norm, master_weights, state_dtype, state_block_size)

    def _kind_values(self, group):
        beta1, beta2 = group["betas"]
        return {"beta1": beta1, "beta2": beta2}
