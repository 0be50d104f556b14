"""Fused RMSprop, RMSpropTF and Adadelta (the squared-average optimizers)."""

from __future__ import annotations

from typing import Optional, Union

import torch

from ._base import FusedOptimizer
from ._settings import _check_range, _no_differentiable, _torch_checks


class RMSprop(FusedOptimizer):
    """RMSprop with the arguments, defaults, state (``square_avg``,
    ``momentum_buffer`` with momentum > 0, ``grad_avg`` when centered) and
    state-dict layout of :class:`torch.optim.RMSprop`; the whole step runs as
    one fused pass per group. See :class:`fusetrain.optim.Adam` for
    ``max_grad_norm`` and ``master_weights``."""

    _opt_name = "RMSprop"
    _kind = "rmsprop"

    def __init__(self, params, lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0.0, momentum=0.0, centered=False,
                 capturable: bool = False, foreach: Optional[bool] = None, maximize: bool = False,
                 differentiable: bool = False, *, max_grad_norm: Optional[float] = None,
                 master_weights: Union[bool, str] = False,
                 state_dtype: Union[torch.dtype, str] = torch.float32, state_block_size: int = 256):
        _no_differentiable(self._opt_name, differentiable)
        defaults = _torch_checks(torch.optim.RMSprop, lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay,
                                 momentum=momentum, centered=centered, capturable=capturable, foreach=foreach,
                                 maximize=maximize)
        super().__init__(params, defaults, max_grad_norm, master_weights, state_dtype, state_block_size)

    def _kind_values(self, group):
        return {"tf_style": False, "lr_in_momentum": False, "decoupled_weight_decay": False}


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

    _opt_name = "RMSpropTF"

    def __init__(self, params, lr=1e-2, alpha=0.9, eps=1e-10, weight_decay=0.0, momentum=0.0, centered=False,
                 decoupled_decay: bool = False, lr_in_momentum: bool = True, *, maximize: bool = False,
                 max_grad_norm: Optional[float] = None, master_weights: Union[bool, str] = False,
                 state_dtype: Union[torch.dtype, str] = torch.float32, state_block_size: int = 256):
        for name, value in (("lr", lr), ("alpha", alpha), ("eps", eps), ("weight_decay", weight_decay),
                            ("momentum", momentum)):
            _check_range(self._opt_name, name, value, 0.0)
        defaults = dict(lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay, momentum=momentum,
                        centered=bool(centered), decoupled_decay=bool(decoupled_decay),
                        lr_in_momentum=bool(lr_in_momentum), maximize=bool(maximize))
        super(RMSprop, self).__init__(params, defaults, max_grad_norm, master_weights, state_dtype, state_block_size)

    def _initial_state_value(self, name):
        return 1.0 if name == "square_avg" else 0.0

    def _kind_values(self, group):
        return {"tf_style": True, "decoupled_weight_decay": group["decoupled_decay"]}


class Adadelta(FusedOptimizer):
    """Adadelta with the arguments, defaults, state (``square_avg``,
    ``acc_delta``) and state-dict layout of :class:`torch.optim.Adadelta`;
    the whole step runs as one fused pass per group."""

    _opt_name = "Adadelta"
    _kind = "adadelta"

    def __init__(self, params, lr=1.0, rho=0.9, eps=1e-6, weight_decay=0.0, foreach: Optional[bool] = None, *,
                 capturable: bool = False, maximize: bool = False, differentiable: bool = False,
                 max_grad_norm: Optional[float] = None, master_weights: Union[bool, str] = False,
                 state_dtype: Union[torch.dtype, str] = torch.float32, state_block_size: int = 256):
        _no_differentiable(self._opt_name, differentiable)
        defaults = _torch_checks(torch.optim.Adadelta, lr=lr, rho=rho, eps=eps, weight_decay=weight_decay,
                                 foreach=foreach, capturable=capturable, maximize=maximize)
        super().__init__(params, defaults, max_grad_norm, master_weights, state_dtype, state_block_size)
