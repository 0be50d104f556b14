"""Fused RMSprop, RMSpropTF and Adadelta (the squared-average optimizers)."""

from __future__ import annotations

from typing import Optional, Union

import torch

from ._base import FusedOptimizer
from ._table import DEFAULT


class RMSprop(FusedOptimizer):
    """RMSprop with the arguments, defaults, state (``square_avg``,
    ``momentum_buffer`` with momentum > 0, ``grad_avg`` when centered) and
    state-dict layout of :class:`torch.optim.RMSprop`; the whole step runs as
    one fused pass per group. See :class:`fusetrain.optim.Adam` for
    ``max_grad_norm`` and ``master_weights``."""

    def __init__(self, params, lr=DEFAULT, alpha=DEFAULT, eps=DEFAULT, weight_decay=DEFAULT, momentum=DEFAULT,
                 centered=DEFAULT, capturable: bool = False, foreach: Optional[bool] = None, maximize: bool = False,
                 differentiable: bool = False, *, max_grad_norm: Optional[float] = DEFAULT,
                 master_weights: Union[bool, str] = False, state_dtype: Union[torch.dtype, str] = torch.float32,
                 state_block_size: int = 256):
        self._from_table(params, locals())


class RMSpropTF(RMSprop):
    """RMSprop in TensorFlow's form, with the arguments, defaults, semantics
    and state (``step``, ``square_avg`` starting at 1, ``momentum_buffer``
    with momentum > 0, ``grad_avg`` when centered) of timm's ``RMSpropTF``:
    eps inside the square root; ``decoupled_decay`` multiplies the weights by
    ``1 - lr * weight_decay`` instead of adding L2 decay to the gradient;
    ``lr_in_momentum`` puts the lr into the momentum buffer (so an lr change
    acts gradually, as in TensorFlow). One fused pass per group, with
    ``max_grad_norm``, ``master_weights`` and an attached EMA as in
    :class:`fusetrain.optim.Adam`."""

    def __init__(self, params, lr=DEFAULT, alpha=DEFAULT, eps=DEFAULT, weight_decay=DEFAULT, momentum=DEFAULT,
                 centered=DEFAULT, decoupled_decay: bool = DEFAULT, lr_in_momentum: bool = DEFAULT, *,
                 maximize: bool = False, max_grad_norm: Optional[float] = DEFAULT,
                 master_weights: Union[bool, str] = False, state_dtype: Union[torch.dtype, str] = torch.float32,
                 state_block_size: int = 256):
        self._from_table(params, locals())


class Adadelta(FusedOptimizer):
    """Adadelta with the arguments, defaults, state (``square_avg``,
    ``acc_delta``) and state-dict layout of :class:`torch.optim.Adadelta`;
    the whole step runs as one fused pass per group."""

    def __init__(self, params, lr=DEFAULT, rho=DEFAULT, eps=DEFAULT, weight_decay=DEFAULT,
                 foreach: Optional[bool] = None, *, capturable: bool = False, maximize: bool = False,
                 differentiable: bool = False, max_grad_norm: Optional[float] = DEFAULT,
                 master_weights: Union[bool, str] = False, state_dtype: Union[torch.dtype, str] = torch.float32,
                 state_block_size: int = 256):
        self._from_table(params, locals())
