"""Fused Muon: orthogonalised momentum for matrices and convolution filters,
AdamW for the other parameters, in one optimizer."""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

import torch

from ._base import FusedOptimizer
from ._settings import _check_range

ADJUST_LR_FNS = (None, "original", "match_rms_adamw")


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

    _opt_name = "Muon"
    _shard_local = False  # per-tensor reductions (NOTE [sharded steps])
    _kind = "muon"

    def __init__(self, params, lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True,
                 ns_coefficients: Sequence[float] = (3.4445, -4.775, 2.0315), eps=1e-7, ns_steps=5,
                 adjust_lr_fn: Optional[str] = None, *, adamw_betas: Sequence[float] = (0.9, 0.95),
                 adamw_eps: float = 1e-8, max_grad_norm: Optional[float] = None, master_weights: bool = False):
        name = self._opt_name
        for arg, value in (("lr", lr), ("weight_decay", weight_decay), ("eps", eps), ("adamw_eps", adamw_eps)):
            _check_range(name, arg, value, 0.0)
        _check_range(name, "momentum", momentum, 0.0, 1.0)
        if not isinstance(ns_steps, int) or isinstance(ns_steps, bool) or not 0 <= ns_steps < 100:
            raise ValueError(f"{name}: ns_steps must be an int in [0, 100), got {ns_steps!r}")
        if not isinstance(ns_coefficients, (tuple, list)) or len(ns_coefficients) != 3:
            raise ValueError(f"{name}: ns_coefficients must be 3 numbers (a, b, c), got {ns_coefficients!r}")
        if adjust_lr_fn not in ADJUST_LR_FNS:
            raise ValueError(f"{name}: adjust_lr_fn must be None, 'original' or 'match_rms_adamw', got "
                             f"{adjust_lr_fn!r}")
        if not isinstance(adamw_betas, (tuple, list)) or len(adamw_betas) != 2:
            raise ValueError(f"{name}: adamw_betas must be a pair (beta1, beta2), got {adamw_betas!r}")
        for k, beta in enumerate(adamw_betas):
            _check_range(name, f"adamw_betas[{k}]", beta, 0.0, 1.0)
        betas = tuple(float(b) for b in adamw_betas)
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=bool(nesterov),
                        ns_coefficients=tuple(float(c) for c in ns_coefficients), eps=eps, ns_steps=ns_steps,
                        adjust_lr_fn=adjust_lr_fn, adamw_betas=betas, adamw_eps=adamw_eps, maximize=False)
        super().__init__(params, defaults, max_grad_norm, master_weights)

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
            self._refuse_complex(params, tensors, bool(param_group["use_muon"]))
            super().add_param_group({**param_group, "params": params})
            return
        parts = [[p for p, t in zip(params, tensors) if t.dim() >= 2],
                 [p for p, t in zip(params, tensors) if t.dim() < 2]]
        self._refuse_complex(parts[0], [t for t in tensors if t.dim() >= 2], True)
        added = False
        for use, ps in zip((True, False), parts):
            if ps or (not added and use is False):
                super().add_param_group({**param_group, "params": ps, "use_muon": use})
                added = True

    def _refuse_complex(self, params, tensors, use_muon: bool) -> None:
        """Orthogonalisation is defined for real matrices: a complex param in a
        Muon group is refused, as torch.optim.Muon refuses it."""
        for i, (p, t) in enumerate(zip(params, tensors)):
            if use_muon and t.is_complex():
                name = f" ({p[0]!r})" if isinstance(p, tuple) else ""
                raise TypeError(f"{self._opt_name}: param {i}{name} of a Muon group has dtype {t.dtype}; "
                                "Muon orthogonalises real matrices only (float32, float16, bfloat16, float64). "
                                "Give complex params a group with use_muon=False (AdamW)")

    def _init_group(self, group, params, grads, steps, masters, emas, state1, state2, state3, scales,
                    ema_rems=None):
        # A group changed after construction (use_muon set, a param swapped): checked before anything is applied.
        if self._uses_muon(group):
            for p in group["params"]:
                if p.grad is not None and p.is_complex():
                    raise RuntimeError("Muon does not support complex parameters")
        return super()._init_group(group, params, grads, steps, masters, emas, state1, state2, state3, scales,
                                   ema_rems)

    @staticmethod
    def _uses_muon(group) -> bool:
        # A group loaded from torch.optim.Muon's state dict has no use_muon key: its params are matrices.
        use = group.get("use_muon")
        return all(p.dim() >= 2 for p in group["params"]) if use is None else bool(use)

    def _kind_values(self, group):
        a, b, c = group["ns_coefficients"]
        beta1, beta2 = group["adamw_betas"]
        return {"use_muon": self._uses_muon(group), "ns_a": a, "ns_b": b, "ns_c": c,
                "match_rms_adamw": group["adjust_lr_fn"] == "match_rms_adamw", "adamw_beta1": beta1,
                "adamw_beta2": beta2}
