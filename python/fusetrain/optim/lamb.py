"""Fused Lamb and AdamP: the layer-adaptive Adam variants of timm, with the
step's reductions (trust ratio, projection) on the device (NOTE [apply pass]
in csrc/ops/aten_stage.h)."""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from ._base import FusedOptimizer
from ._table import DEFAULT


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

    def __init__(self, params, lr=DEFAULT, bias_correction: bool = DEFAULT, betas=DEFAULT, eps=DEFAULT,
                 weight_decay=DEFAULT, grad_averaging: bool = DEFAULT, max_grad_norm: Optional[float] = DEFAULT,
                 trust_clip: bool = DEFAULT, always_adapt: bool = DEFAULT, caution: bool = DEFAULT,
                 decoupled_decay: bool = DEFAULT, corrected_weight_decay: bool = DEFAULT, *, maximize: bool = False,
                 master_weights: bool = False):
        self._from_table(params, locals())

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

    def __init__(self, params, lr=DEFAULT, betas=DEFAULT, eps=DEFAULT, weight_decay=DEFAULT, delta=DEFAULT,
                 wd_ratio=DEFAULT, nesterov: bool = DEFAULT, *, maximize: bool = False,
                 max_grad_norm: Optional[float] = DEFAULT, master_weights: bool = False):
        self._from_table(params, locals())
