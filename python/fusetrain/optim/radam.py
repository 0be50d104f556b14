"""Fused RAdam (rectified Adam)."""

from __future__ import annotations

from typing import Optional, Union

import torch

from ._base import FusedOptimizer
from ._settings import _no_differentiable, _torch_checks


class RAdam(FusedOptimizer):
    """RAdam with the arguments, defaults, state (``exp_avg``, ``exp_avg_sq``)
    and state-dict layout of :class:`torch.optim.RAdam` (L2 weight decay
    unless ``decoupled_weight_decay=True``); the whole step runs as one fused
    pass per group. See :class:`fusetrain.optim.Adam` for ``max_grad_norm``
    and ``master_weights``."""

    _opt_name = "RAdam"
    _kind = "radam"

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 decoupled_weight_decay: bool = False, *, foreach: Optional[bool] = None, maximize: bool = False,
                 capturable: bool = False, differentiable: bool = False, max_grad_norm: Optional[float] = None,
                 master_weights: Union[bool, str] = False,
                 state_dtype: Union[torch.dtype, str] = torch.float32, state_block_size: int = 256):
        _no_differentiable(self._opt_name, differentiable)
        defaults = _torch_checks(torch.optim.RAdam, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                 decoupled_weight_decay=decoupled_weight_decay, foreach=foreach, maximize=maximize,
                                 capturable=capturable)
        super().__init__(params, defaults, max_grad_norm, master_weights, state_dtype, state_block_size)

    def _kind_values(self, group):
        beta1, beta2 = group["betas"]
        return {"beta1": beta1, "beta2": beta2}
