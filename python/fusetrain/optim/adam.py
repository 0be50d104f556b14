"""Fused Adam and AdamW."""

from __future__ import annotations

from typing import Optional, Union

import torch

from ._base import FusedOptimizer
from ._table import DEFAULT


class Adam(FusedOptimizer):
    """Adam with the arguments and defaults of :class:`torch.optim.Adam`
    (L2 weight decay unless ``decoupled_weight_decay=True``), whose whole step
    runs as one fused pass per group on CPU or CUDA.

    Extra arguments:
      max_grad_norm: clip gradients to this global L2 norm inside the step
        (computed on the device, no host sync). ``None`` disables clipping.
      master_weights: how the full value of fp16/bf16 params is kept: True,
        an fp32 master copy (the update runs on it and writes the rounded
        param in the same pass); ``"remainder"``, bf16 params only: an int16
        remainder per element, param and remainder together are the exact
        fp32 master (2 bytes instead of 4; state ``master_remainder``);
        ``"stochastic"``, bf16 params only: no master, the param is written
        with stochastic rounding (unbiased, reproducible); False: none.
      state_dtype: ``torch.float32`` (default), ``torch.bfloat16``: the
        moments in bf16, written with stochastic rounding, or ``torch.int8``
        (``"int8"``): one byte per element plus a float32 scale per block of
        ``state_block_size`` elements (64, 128 or 256), for params of at
        least 4096 elements (smaller ones keep float32 state); float32, bf16
        and fp16 params. docs/optimizers.md ("Lean state") has the bytes per
        parameter of each choice.
      bias_correction: False drops Adam's ``1 - beta^t`` corrections of both
        moments (the BertAdam form: ``p -= lr * m / (sqrt(v) + eps)``).

    Arguments are checked by torch.optim.Adam's own checks (same exceptions and
    messages). ``foreach``, ``capturable`` and ``fused`` are accepted with any
    value torch accepts (they only name an implementation: the step is always
    fused and capturable); ``differentiable=True`` is not supported.
    """

    def __init__(self, params, lr=DEFAULT, betas=DEFAULT, eps=DEFAULT, weight_decay=DEFAULT, amsgrad=DEFAULT, *,
                 foreach: Optional[bool] = None, maximize: bool = False, capturable: bool = False,
                 differentiable: bool = False, fused: Optional[bool] = None, decoupled_weight_decay: bool = DEFAULT,
                 max_grad_norm: Optional[float] = DEFAULT, master_weights: Union[bool, str] = False,
                 state_dtype: Union[torch.dtype, str] = torch.float32, state_block_size: int = 256,
                 bias_correction: bool = DEFAULT):
        self._from_table(params, locals())

    def _sparse_error(self) -> str:
        return "Adam does not support sparse gradients, please consider SparseAdam instead"  # torch's message


class AdamW(Adam):
    """AdamW (decoupled weight decay) with the arguments and defaults of
    :class:`torch.optim.AdamW` (weight_decay=1e-2); see :class:`Adam` for the
    fused step and the extra arguments."""

    def __init__(self, params, lr=DEFAULT, betas=DEFAULT, eps=DEFAULT, weight_decay=DEFAULT, amsgrad=DEFAULT, *,
                 maximize: bool = False, foreach: Optional[bool] = None, capturable: bool = False,
                 differentiable: bool = False, fused: Optional[bool] = None, max_grad_norm: Optional[float] = DEFAULT,
                 master_weights: Union[bool, str] = False, state_dtype: Union[torch.dtype, str] = torch.float32,
                 state_block_size: int = 256, bias_correction: bool = DEFAULT):
        self._from_table(params, locals())
