"""Fused Muon: orthogonalised momentum for matrices and convolution filters,
AdamW for the other parameters, in one optimizer."""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

import torch

from ._base import FusedOptimizer
from ._table import DEFAULT


class Muon(FusedOptimizer):
    """Muon with the arguments, defaults, update and state (``momentum_buffer``)
    of :class:`torch.optim.Muon` for parameters of 2 or more dimensions (a
    convolution filter is the matrix ``out_channels x the rest``), and AdamW
    (``adamw_betas``, ``adamw_eps``, the group's ``lr`` and ``weight_decay``;
    state ``exp_avg``, ``exp_avg_sq``) for the others, so one object trains a
    whole model. The Newton-Schulz iterations run batched over the parameters
    whose matrices share a shape (NOTE [muon apply] in
    csrc/ops/fused_muon.cpp); the global-norm clipping, the non-finite skip,
    loss-scale unscaling, fp32 master weights and the attached EMA cover both
    kinds of parameters in the same step, without a host sync.

    Each group given is split into a Muon group and an AdamW group (the
    ``use_muon`` key, which a group may also set itself to choose). With
    ``adjust_lr_fn="match_rms_adamw"`` Muon's update has AdamW's RMS, so the
    one ``lr`` and ``weight_decay`` suit both kinds (the ``original``
    adjustment wants a larger lr, about 0.02, than AdamW's)."""

    _own_fields = ("use_muon",)  # from the group's params when it does not say (_uses_muon)

    def __init__(self, params, lr=DEFAULT, weight_decay=DEFAULT, momentum=DEFAULT, nesterov=DEFAULT,
                 ns_coefficients: Sequence[float] = DEFAULT, eps=DEFAULT, ns_steps=DEFAULT,
                 adjust_lr_fn: Optional[str] = None, *, adamw_betas: Sequence[float] = DEFAULT,
                 adamw_eps: float = DEFAULT, max_grad_norm: Optional[float] = DEFAULT, master_weights: bool = False):
        self._from_table(params, locals())

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """Adds the group as given when it sets ``use_muon``; otherwise as two
        groups: its params of 2 or more dimensions (Muon) and the others (AdamW).
        Params may be named (``model.named_parameters()``), as in torch.optim."""
        params = param_group.get("params") if isinstance(param_group, dict) else None
        if params is None or isinstance(params, set):
            super().add_param_group(param_group)  # torch's error for the group
            return
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        tensors = [p[1] if isinstance(p, tuple) and len(p) == 2 else p for p in params]
        if not all(isinstance(t, torch.Tensor) for t in tensors):
            super().add_param_group({**param_group, "params": params})  # torch's error for the params
            return
        if "use_muon" in param_group:
            super().add_param_group({**param_group, "params": params})
            return
        parts = [[p for p, t in zip(params, tensors) if t.dim() >= 2],
                 [p for p, t in zip(params, tensors) if t.dim() < 2]]
        added = False
        for use, ps in zip((True, False), parts):
            if ps or (not added and use is False):
                super().add_param_group({**param_group, "params": ps, "use_muon": use})
                added = True

    def _init_group(self, group, params, grads, steps, masters, emas, state1, state2, state3, scales,
                    ema_rems=None):
        # Orthogonalisation is defined for real matrices: a complex param in a Muon group is refused at the step,
        # where torch.optim.Muon refuses it (its words), before anything is applied.
        if self._uses_muon(group):
            for i, p in enumerate(group["params"]):
                if p.grad is not None and p.is_complex():
                    raise RuntimeError(f"Muon does not support complex parameters: param {i} has dtype {p.dtype}; "
                                       "give complex params a group with use_muon=False (AdamW)")
        return super()._init_group(group, params, grads, steps, masters, emas, state1, state2, state3, scales,
                                   ema_rems)

    @staticmethod
    def _uses_muon(group) -> bool:
        # A group loaded from torch.optim.Muon's state dict has no use_muon key: its params are matrices.
        use = group.get("use_muon")
        return all(p.dim() >= 2 for p in group.get("params", ())) if use is None else bool(use)

    def _kind_values(self, group):
        return {"use_muon": self._uses_muon(group)}
