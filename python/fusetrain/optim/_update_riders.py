"""What the fused update pass writes besides params and state: EMA copies
(``attach_ema``) and the count of stalled updates (NOTE [stalled updates] in
csrc/common/lean_state.h). A mixin of ``FusedOptimizer`` (_base.py)."""

from __future__ import annotations

from typing import List, Mapping, Optional

import torch
from torch import Tensor

from ._kinds import KINDS


class UpdateRiders:
    """EMA copies and the stalled-update counter, written in the update pass."""

    def attach_ema(self, ema_params: Mapping[Tensor, Tensor], decay: Tensor,
                   remainders: Optional[Mapping[Tensor, Tensor]] = None) -> None:
        """Update EMA copies in the same pass as the params:
        ``ema += (1 - decay) * (param_new - ema)`` for every param updated by a
        step. ``ema_params`` maps params of this optimizer to tensors of the
        same shape, dtype and device; ``decay`` is a 0-d float32 device tensor
        (change it in place; it is read on the device). Every param of a group
        needs an EMA tensor, or none of that group's params. ``remainders``
        maps params with a bfloat16 EMA to an int16 tensor of its shape: the
        EMA tensor and its remainder are then the exact float32 EMA (NOTE [ema
        remainder] in csrc/common/lean_state.h; the element-wise optimizers)."""
        if not isinstance(decay, Tensor) or decay.numel() != 1 or decay.dtype != torch.float32:
            raise TypeError(f"{self._opt_name}.attach_ema: decay must be a one-element float32 tensor, got {decay!r}")
        by_id = {id(k): v for k, v in ema_params.items()}
        known = {id(p) for g in self.param_groups for p in g["params"]}
        unknown = [k for k in by_id if k not in known]
        if unknown:
            raise ValueError(f"{self._opt_name}.attach_ema: {len(unknown)} key(s) of ema_params are not params "
                             "of this optimizer")
        rem_by_id = {id(k): v for k, v in (remainders or {}).items()}
        if rem_by_id and not KINDS[self._kind]["lean"]:
            raise ValueError(f"{self._opt_name}.attach_ema: EMA remainders are for the element-wise optimizers "
                             "(NOTE [ema remainder]); keep this optimizer's EMA without them")
        lists: List[Optional[List[Tensor]]] = []
        rem_lists: List[Optional[List[Optional[Tensor]]]] = []
        for gi, group in enumerate(self.param_groups):
            covered = [id(p) in by_id for p in group["params"]]
            if not any(covered):
                lists.append(None)
                rem_lists.append(None)
                continue
            if not all(covered):
                raise ValueError(f"{self._opt_name}.attach_ema: group {gi} has {covered.count(False)} param(s) "
                                 "without an EMA tensor; give every param of the group one, or none")
            emas, rems = [], []
            for i, p in enumerate(group["params"]):
                e = by_id[id(p)]
                if e.shape != p.shape or e.dtype != p.dtype or e.device != p.device:
                    raise ValueError(f"{self._opt_name}.attach_ema: EMA of param {i} of group {gi} has "
                                     f"shape {tuple(e.shape)}, dtype {e.dtype}, device {e.device}; the param has "
                                     f"shape {tuple(p.shape)}, dtype {p.dtype}, device {p.device}")
                r = rem_by_id.get(id(p))
                if rem_by_id and (r is None) != (e.dtype != torch.bfloat16):
                    raise ValueError(f"{self._opt_name}.attach_ema: param {i} of group {gi} ({e.dtype}) "
                                     f"{'needs' if r is None else 'cannot have'} an EMA remainder: remainders "
                                     "go with every bfloat16 EMA tensor and only with those")
                if r is not None and (r.dtype != torch.int16 or r.shape != e.shape or r.device != e.device):
                    raise ValueError(f"{self._opt_name}.attach_ema: the EMA remainder of param {i} of group {gi} "
                                     f"must be an int16 tensor of shape {tuple(e.shape)} on {e.device}, got "
                                     f"{r.dtype} of shape {tuple(r.shape)} on {r.device}")
                emas.append(e)
                rems.append(r)
            lists.append(emas)
            rem_lists.append(rems if rem_by_id else None)
        self._ema_lists = lists
        self._ema_rem_lists = rem_lists
        self._ema_decay = decay
        self._forget_lists()

    def detach_ema(self) -> None:
        """Stop updating EMA copies in the update pass."""
        self._ema_lists = None
        self._ema_rem_lists = None
        self._ema_decay = None
        self._forget_lists()

    def track_stalled_updates(self, enabled: bool = True) -> Optional[Tensor]:
        """Count, on the device, the updates that float16/bfloat16 params
        kept without a master (``master_weights`` False or ``"stochastic"``)
        lose: elements whose stored value did not change although the step
        computed a different one (NOTE [stalled updates] in
        csrc/common/lean_state.h). Many of them say the learning rate is too
        small for the weights' precision. Every step adds to the counter it
        returns, a 0-d int64 tensor on the params' device (also
        :attr:`stalled_updates`): read it (``.item()``, one sync) when you
        want the number and ``zero_()`` it to start again; no step waits for
        it. Enable it before compiling or capturing a step. ``False`` stops
        counting."""
        if not enabled:
            self._results.pop("stalled", None)
            self._forget_lists()
            return None
        if not KINDS[self._kind]["lean"]:
            raise ValueError(f"{self._opt_name}.track_stalled_updates: the element-wise optimizers count stalled "
                             "updates; this one does not")
        devices = {p.device for g in self.param_groups for p in g["params"]}
        if len(devices) != 1:
            raise ValueError(f"{self._opt_name}.track_stalled_updates: needs the params on one device, got "
                             f"{sorted(str(d) for d in devices)}")
        device = devices.pop()
        if self._results.get("stalled") is None or self._results["stalled"].device != device:
            self._results["stalled"] = torch.zeros((), dtype=torch.int64, device=device)
        self._forget_lists()
        return self._results["stalled"]

    @property
    def stalled_updates(self) -> Optional[Tensor]:
        """The counter of :meth:`track_stalled_updates` (None when not counting)."""
        return self._results.get("stalled")
