"""Learning-rate schedules evaluated on the host from the step index.

The value for optimizer step ``k`` is a pure function of ``k`` (plain float
math, no tensor reads), written into each param group's lr *tensor* with
``fill_``: no host sync, and torch.compile sees a tensor, so a changing lr never
recompiles. Resume needs only the step index.
"""

from __future__ import annotations

import math
from typing import Sequence

__all__ = ["LRSchedule"]


class LRSchedule:
    """lr(step) for the ``lr_mode`` of training_params, with linear warmup.

    ``steps_per_epoch`` converts the epoch-based settings (lr_updates,
    cyclic_period_epochs, lr_warmup_epochs) into optimizer steps."""

    def __init__(self, params, steps_per_epoch: int) -> None:
        self.mode = params.lr_mode
        self.initial_lr = float(params.initial_lr)
        self.steps_per_epoch = max(1, int(steps_per_epoch))
        self.total_steps = max(1, params.max_epochs * self.steps_per_epoch)
        warmup = params.lr_warmup_steps or params.lr_warmup_epochs * self.steps_per_epoch
        self.warmup_steps = min(int(warmup), self.total_steps)
        wil = params.warmup_initial_lr
        self.warmup_initial_lr = self.initial_lr * 0.01 if wil is None else float(wil)
        self.p = params

    def __call__(self, step: int) -> float:
        """lr of the optimizer step with 0-based index ``step``."""
        if step < self.warmup_steps:
            frac = (step + 1) / self.warmup_steps
            return self.warmup_initial_lr + (self.initial_lr - self.warmup_initial_lr) * frac
        p, lr0 = self.p, self.initial_lr
        # Progress after warmup, in [0, 1]: 0 at the first step after warmup, 1 at
        # the last step of the run (the documented final values are those of the
        # last optimizer step).
        span = max(1, self.total_steps - self.warmup_steps - 1)
        t = min(1.0, (step - self.warmup_steps) / span)
        if self.mode == "constant":
            return lr0
        if self.mode == "step":
            epoch = step // self.steps_per_epoch
            passed = sum(1 for e in p.lr_updates if epoch >= e)
            return lr0 * (p.lr_decay_factor ** passed)
        if self.mode == "cosine":
            final = lr0 * p.cosine_final_lr_ratio
            return final + 0.5 * (lr0 - final) * (1.0 + math.cos(math.pi * t))
        if self.mode == "linear":
            final = lr0 * p.linear_final_lr_ratio
            return lr0 + (final - lr0) * t
        if self.mode == "onecycle":
            start = lr0 / p.onecycle_div_factor
            end = start / p.onecycle_final_div_factor
            peak = p.onecycle_pct_start
            if t <= peak:
                return _cos_anneal(start, lr0, t / peak if peak > 0 else 1.0)
            return _cos_anneal(lr0, end, (t - peak) / (1.0 - peak))
        if self.mode == "cyclic":
            low = lr0 * p.cyclic_min_lr_ratio
            period = max(1.0, p.cyclic_period_epochs * self.steps_per_epoch)
            phase = ((step - self.warmup_steps) % period) / period
            tri = 1.0 - abs(2.0 * phase - 1.0)  # 0 -> 1 -> 0 over a period
            return low + (lr0 - low) * tri
        raise ValueError(f"training_params.lr_mode: unknown mode {self.mode!r}")

    def sample(self, steps: Sequence[int]):
        return [self(s) for s in steps]


def _cos_anneal(a: float, b: float, t: float) -> float:
    return b + (a - b) * 0.5 * (1.0 + math.cos(math.pi * min(max(t, 0.0), 1.0)))
