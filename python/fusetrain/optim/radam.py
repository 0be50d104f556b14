"""Fused RAdam (rectified Adam)."""

from __future__ import annotations

from typing import Optional, Union

import torch

from ._base import FusedOptimizer
from ._table import DEFAULT


class RAdam(FusedOptimizer):
    """RAdam with the arguments, defaults, state (``exp_avg``, ``exp_avg_sq``)
    and state-dict layout of :class:`torch.optim.RAdam` (L2 weight decay
    unless ``decoupled_weight_decay=True``); the whole step runs as one fused
    pass per group. See :class:`fusetrain.optim.Adam` for ``max_grad_norm``
    and ``master_weights``."""

    def __init__(self, params, lr=DEFAULT, betas=DEFAULT, eps=DEFAULT, weight_decay=DEFAULT,
                 decoupled_weight_decay: bool = DEFAULT, *, foreach: Optional[bool] = None, maximize: bool = False,
                 capturable: bool = False, differentiable: bool = False, max_grad_norm: Optional[float] = DEFAULT,
                 master_weights: Union[bool, str] = False, state_dtype: Union[torch.dtype, str] = torch.float32,
                 state_block_size: int = 256):
        self._from_table(params, locals())
