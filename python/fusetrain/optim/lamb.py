"""Fused Lamb and AdamP: the layer-adaptive Adam variants of timm, with the
step's reductions (trust ratio, projection) on the device (NOTE [apply pass]
in csrc/ops/aten_stage.h)."""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from ._base import FusedOptimizer
from ._settings import _check_betas, _check_flags, _check_range


def _check_common(opt: str, lr, betas, eps, weight_decay) -> None:
    _check_range(opt, "lr", lr, 0.0)
    _check_betas(opt, betas)
    _check_range(opt, "eps", eps, 0.0)
    _check_range(opt, "weight_decay", weight_decay, 0.0)


class Lamb(FusedOptimizer):
    """Lamb with the arguments, defaults and semantics of timm's ``Lamb``
    (the NVLAMB form: Adam moments, then the update scaled per tensor by the
    trust ratio ``||w|| / ||update||``, for tensors with weight decay or with
    ``always_adapt``). ``max_grad_norm`` (default 1.0, None to disable) is
    timm's built-in global-norm clipping, here the fused step's clipping;
    ``trust_clip`` caps the ratio at 1; ``caution`` masks update entries whose
    sign disagrees with the gradient; ``decoupled_decay`` decays the weights
    directly (by ``lr * weight_decay``, or ``lr**2 / lr_max * weight_decay``
    with ``corrected_weight_decay``, lr_max being the constructor's lr).

    State: ``step``, ``exp_avg``, ``exp_avg_sq`` per param. timm counts steps
    per group (``param_groups[i]['step']``): ``state_dict()`` writes that key
    too and ``load_state_dict`` reads it, so state dicts move both ways. One
    difference: a param without a gradient in a step does not advance its own
    step count here (timm's group count advances). ``master_weights`` and an
    attached EMA as in :class:`fusetrain.optim.Adam`."""

    _opt_name = "Lamb"
    _shard_local = False  # per-tensor reductions (NOTE [sharded steps])
    _kind = "lamb"

    def __init__(self, params, lr=1e-3, bias_correction: bool = True, betas=(0.9, 0.999), eps=1e-6,
                 weight_decay=0.01, grad_averaging: bool = True, max_grad_norm: Optional[float] = 1.0,
                 trust_clip: bool = False, always_adapt: bool = False, caution: bool = False,
                 decoupled_decay: bool = False, corrected_weight_decay: bool = False, *, maximize: bool = False,
                 master_weights: bool = False):
        _check_common(self._opt_name, lr, betas, eps, weight_decay)
        flags = dict(bias_correction=bias_correction, grad_averaging=grad_averaging, trust_clip=trust_clip,
                     always_adapt=always_adapt, caution=caution, decoupled_decay=decoupled_decay,
                     corrected_weight_decay=corrected_weight_decay, maximize=maximize)
        _check_flags(self._opt_name, **flags)
        defaults = dict(lr=lr, betas=tuple(float(b) for b in betas), eps=eps, weight_decay=weight_decay, **flags)
        super().__init__(params, defaults, max_grad_norm, master_weights)
        self._max_lr = float(lr)  # corrected_weight_decay's lr_max, read once (lr may be a device tensor)

    def __setstate__(self, state):
        super().__setstate__(state)
        self.__dict__.setdefault("_max_lr", float(self.defaults["lr"]))

    def _kind_values(self, group):
        beta1, beta2 = group["betas"]
        corrected = group["decoupled_decay"] and group["corrected_weight_decay"]
        return {"beta1": beta1, "beta2": beta2, "decoupled_weight_decay": group["decoupled_decay"],
                "decay_max_lr": self._max_lr if corrected else 0.0}

    def state_dict(self) -> Dict[str, Any]:
        sd = super().state_dict()
        for packed, group in zip(sd["param_groups"], self.param_groups):
            steps = [self.state[p]["step"] for p in group["params"] if "step" in self.state.get(p, {})]
            if steps:  # timm's per-group count (read once, outside the step)
                packed["step"] = int(max(float(s) for s in steps))
        return sd

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            count = group.pop("step", None)
            if count is None:
                continue
            for p in group["params"]:
                st = self.state.get(p)
                if st and "step" not in st:  # a timm state dict: the group's count
                    st["step"] = torch.tensor(float(count), dtype=torch.float32, device=p.device)


class AdamP(FusedOptimizer):
    """AdamP with the arguments, defaults and semantics of timm's ``AdamP``:
    Adam whose update of a weight with 2 or more dims is projected off the
    weight's direction when the gradient is nearly orthogonal to it (per
    channel, else per layer; ``delta`` sets the threshold) and whose weight
    decay is then scaled by ``wd_ratio``. timm decides the projection on the
    host; here both views are computed and chosen on the device (NOTE [adamp
    projection] in csrc/ops/fused_adamp.cpp), so a step never syncs. State:
    ``step``, ``exp_avg``, ``exp_avg_sq`` (timm's keys). ``maximize``,
    ``max_grad_norm``, ``master_weights`` and an attached EMA as in
    :class:`fusetrain.optim.Adam`."""

    _opt_name = "AdamP"
    _shard_local = False  # per-tensor reductions (NOTE [sharded steps])
    _kind = "adamp"

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, delta=0.1, wd_ratio=0.1,
                 nesterov: bool = False, *, maximize: bool = False, max_grad_norm: Optional[float] = None,
                 master_weights: bool = False):
        _check_common(self._opt_name, lr, betas, eps, weight_decay)
        _check_range(self._opt_name, "delta", delta, 0.0)
        _check_range(self._opt_name, "wd_ratio", wd_ratio, 0.0)
        _check_flags(self._opt_name, nesterov=nesterov, maximize=maximize)
        defaults = dict(lr=lr, betas=tuple(float(b) for b in betas), eps=eps, weight_decay=weight_decay, delta=delta,
                        wd_ratio=wd_ratio, nesterov=nesterov, maximize=maximize)
        super().__init__(params, defaults, max_grad_norm, master_weights)

    def _kind_values(self, group):
        beta1, beta2 = group["betas"]
        return {"beta1": beta1, "beta2": beta2}
