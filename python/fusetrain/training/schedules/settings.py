"""Schedules of the optimizer's momentum and weight decay (training_params
``momentum_schedule`` / ``momentum_final`` and ``weight_decay_schedule`` /
``weight_decay_final``), evaluated on the host from the step index like the lr
(training/schedules.py) and written into the param groups before each
optimizer step. A fusetrain optimizer reads them on the device (NOTE [device
values] in csrc/common/update_args.h), so a compiled or captured step follows
them without recompiling; resume needs only the step index.
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

from .lr import LRSchedule, _cos_anneal

__all__ = ["SettingSchedule"]


def _shape(mode: str, start: float, final: float, t: float) -> float:
    if mode == "cosine":
        return _cos_anneal(start, final, t)
    return start + (final - start) * t  # linear


class SettingSchedule:
    """The momentum and weight decay of optimizer step ``k`` (0-based).

    ``cosine`` and ``linear`` go from the optimizer's value (``optimizer_params``)
    to the ``*_final`` value over the steps after the lr warmup, on the lr
    schedule's progress (held at the start during the warmup, at the final
    value during ``lr_cooldown_epochs``). A momentum ``onecycle`` follows
    ``lr_mode: onecycle`` inversely, as torch's ``OneCycleLR(cycle_momentum=True)``:
    from the optimizer's momentum down to ``momentum_final`` while the lr rises,
    and back while it anneals. The momentum is SGD's and RMSprop's ``momentum``
    or the first of ``betas`` (Adam family, Lion, Lamb, ...). The weight decay
    of each group is scaled by the same factor, so groups without decay keep 0.
    """

    def __init__(self, params, lr_schedule: LRSchedule, optimizer: Any) -> None:
        self.p = params
        self.lr = lr_schedule
        self.momentum_mode = params.momentum_schedule
        self.decay_mode = params.weight_decay_schedule
        groups = optimizer.param_groups
        name = type(optimizer).__name__
        self.momentum_key: Optional[str] = None
        self.momentum_start: List[float] = []
        if self.momentum_mode != "constant":
            self.momentum_key = "betas" if all("betas" in g for g in groups) else \
                "momentum" if all("momentum" in g for g in groups) else None
            if self.momentum_key is None:
                raise ValueError(f"training_params.momentum_schedule: got {self.momentum_mode!r}, but the optimizer "
                                 f"{name} has neither 'momentum' nor 'betas'; allowed: 'constant' for it")
            self.momentum_start = [float(g["betas"][0] if self.momentum_key == "betas" else g["momentum"])
                                   for g in groups]
            if any(m == 0.0 for m in self.momentum_start):
                raise ValueError(f"training_params.momentum_schedule: got {self.momentum_mode!r}, but the optimizer "
                                 f"{name}'s momentum is 0 (no momentum buffer to schedule); set a momentum in "
                                 "optimizer_params, e.g. optimizer_params: {momentum: 0.9}")
            if self.momentum_mode == "onecycle" and params.lr_mode != "onecycle":
                raise ValueError(f"training_params.momentum_schedule: got 'onecycle' with lr_mode "
                                 f"{params.lr_mode!r}; allowed: lr_mode 'onecycle' (or momentum_schedule 'cosine', "
                                 "'linear' or 'constant')")
        self.decay_start: List[float] = []
        if self.decay_mode != "constant":
            main = float(optimizer.defaults.get("weight_decay", 0.0) or 0.0)
            if main == 0.0:
                raise ValueError(f"training_params.weight_decay_schedule: got {self.decay_mode!r}, but the "
                                 f"optimizer {name}'s weight_decay is 0; set one in optimizer_params")
            self.decay_main = main
            self.decay_start = [float(g.get("weight_decay", 0.0) or 0.0) for g in groups]

    @property
    def active(self) -> bool:
        return self.momentum_mode != "constant" or self.decay_mode != "constant"

    def _progress(self, step: int) -> Tuple[float, bool]:
        """(the lr schedule's post-warmup progress in [0, 1], whether in the warmup)."""
        s = self.lr
        if step < s.warmup_steps:
            return 0.0, True
        step = min(step, max(s.warmup_steps, s.sched_end - 1))  # NOTE [cooldown] in schedules.py
        span = max(1, s.sched_end - s.warmup_steps - 1)
        return min(1.0, (step - s.warmup_steps) / span), False

    def momentum(self, step: int, start: float) -> float:
        """The momentum of step ``step`` for a group that starts at ``start``."""
        t, _ = self._progress(step)
        final = self.p.momentum_final
        if self.momentum_mode == "onecycle":
            peak = self.p.onecycle_pct_start
            if t <= peak:
                return _cos_anneal(start, final, t / peak if peak > 0 else 1.0)
            return _cos_anneal(final, start, (t - peak) / (1.0 - peak))
        return _shape(self.momentum_mode, start, final, t)

    def decay_factor(self, step: int) -> float:
        """Each group's weight decay at step ``step`` over its value in ``optimizer_params``."""
        t, _ = self._progress(step)
        return _shape(self.decay_mode, self.decay_main, self.p.weight_decay_final, t) / self.decay_main

    def apply(self, optimizer: Any, step: int) -> None:
        """Writes step ``step``'s momentum and weight decay into the param groups."""
        groups = optimizer.param_groups
        if self.momentum_key is not None:
            for g, start in zip(groups, self.momentum_start):
                m = self.momentum(step, start)
                if self.momentum_key == "betas":
                    g["betas"] = (m, *tuple(g["betas"])[1:])
                else:
                    g["momentum"] = m
        if self.decay_start:
            f = self.decay_factor(step)
            for g, wd in zip(groups, self.decay_start):
                g["weight_decay"] = wd * f
