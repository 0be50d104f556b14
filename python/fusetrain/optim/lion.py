"""Fused Lion (sign momentum)."""

from __future__ import annotations

from typing import Optional, Union

import torch

from ._base import FusedOptimizer
from ._table import DEFAULT


class Lion(FusedOptimizer):
    """Lion: ``p -= lr * (sign(beta1 * m + (1 - beta1) * g) + weight_decay * p)``,
    then ``m = beta2 * m + (1 - beta2) * g`` (weight decay decoupled, applied as
    ``p *= 1 - lr * weight_decay``). Defaults lr=1e-4, betas=(0.9, 0.99),
    weight_decay=0. One fused pass per group; see :class:`fusetrain.optim.Adam`
    for ``max_grad_norm`` and ``master_weights``. State: ``exp_avg`` and ``step``.
    """

    def __init__(self, params, lr=DEFAULT, betas=DEFAULT, weight_decay=DEFAULT, *, maximize: bool = False,
                 max_grad_norm: Optional[float] = DEFAULT, master_weights: Union[bool, str] = False,
                 state_dtype: Union[torch.dtype, str] = torch.float32, state_block_size: int = 256):
        self._from_table(params, locals())
