"""Learning-rate schedules evaluated on the host from the step index.

The value for optimizer step ``k`` is a pure function of ``k`` (plain float
math, no tensor reads), written into each param group's lr *tensor* with
``fill_``: no host sync, and torch.compile sees a tensor, so a changing lr never
recompiles. Resume needs only the step index, except for ``plateau``, whose
reductions follow the validation metric (``observe``) and are saved in the
checkpoint (``state_dict``).
"""

from __future__ import annotations

import csv
import math
import os
from typing import Callable, Optional, Sequence

import torch

__all__ = ["LRSchedule", "run_epochs", "run_steps", "write_schedule", "base_lr", "set_lr"]


def base_lr(initial_lr) -> float:
    """The rate the schedule scales: ``initial_lr``, or its ``default`` entry
    when it sets rates by parameter-name prefix (each group's ``lr_scale``
    carries its rate relative to it)."""
    return float(initial_lr["default"] if isinstance(initial_lr, dict) else initial_lr)


def run_steps(params, steps_per_epoch: int) -> int:
    """The optimizer steps of the whole run: ``max_steps``, else ``max_epochs`` epochs."""
    return max(1, params.max_steps or params.max_epochs * max(1, int(steps_per_epoch)))


def run_epochs(params, steps_per_epoch: int) -> int:
    """The epochs of the whole run (the last one may end early at ``max_steps``)."""
    if params.max_steps:
        return -(-params.max_steps // max(1, int(steps_per_epoch)))
    return params.max_epochs


class LRSchedule:
    """lr(step) for the ``lr_mode`` of training_params, after a warmup of the
    form ``lr_warmup_mode``.

    ``steps_per_epoch`` converts the epoch-based settings (lr_updates,
    cyclic_period_epochs, cosine_restart_epochs, lr_warmup_epochs, the
    per-epoch factor of ``exponential``) into optimizer steps. ``lr_mode`` may
    also be a function of the 0-based step index (from Python), which then is
    the whole schedule."""

    def __init__(self, params, steps_per_epoch: int) -> None:
        self.mode = params.lr_mode
        self.initial_lr = base_lr(params.initial_lr)
        self.steps_per_epoch = max(1, int(steps_per_epoch))
        self.total_steps = run_steps(params, self.steps_per_epoch)
        warmup = params.lr_warmup_steps or params.lr_warmup_epochs * self.steps_per_epoch
        self.warmup_steps = min(int(warmup), self.total_steps)
        self.warmup_mode = params.lr_warmup_mode
        # NOTE [cooldown]: the decaying schedules end at sched_end; the cooldown steps after it repeat the lr of
        # the step before it.
        cooldown = min(params.lr_cooldown_epochs * self.steps_per_epoch, self.total_steps - self.warmup_steps - 1)
        self.sched_end = self.total_steps - max(0, cooldown)
        wil = params.warmup_initial_lr
        if wil is None:
            wil = (self.initial_lr / (params.lr_warmup_epochs + 1) if self.warmup_mode == "linear_epoch"
                   else self.initial_lr * 0.01)
        self.warmup_initial_lr = float(wil)
        self.p = params
        # plateau: reductions so far, the best watched value and the validations since it improved
        self.reductions, self.best, self.bad = 0, None, 0

    def observe(self, value: float, greater_is_better: bool) -> None:
        """``lr_mode: plateau``: the watched metric after a validation. After
        more than ``plateau_patience`` validations without an improvement of more
        than ``plateau_min_delta``, the rate drops by ``lr_decay_factor``
        (torch's ReduceLROnPlateau with an absolute threshold)."""
        if self.mode != "plateau" or value is None or not math.isfinite(value):
            return
        delta = self.p.plateau_min_delta
        if self.best is None or (value > self.best + delta if greater_is_better else value < self.best - delta):
            self.best, self.bad = float(value), 0
            return
        self.bad += 1
        if self.bad > self.p.plateau_patience:
            self.reductions += 1
            self.bad = 0

    def state_dict(self) -> dict:
        return {"reductions": self.reductions, "best": self.best, "bad": self.bad}

    def load_state_dict(self, state: Optional[dict]) -> None:
        if state:
            self.reductions, self.best, self.bad = int(state["reductions"]), state["best"], int(state["bad"])

    def __call__(self, step: int) -> float:
        """lr of the optimizer step with 0-based index ``step``."""
        if callable(self.mode):
            return _user_lr(self.mode, step)
        if step < self.warmup_steps:
            return self._warmup(step)
        if step >= self.sched_end:  # NOTE [cooldown]
            step = max(self.warmup_steps, self.sched_end - 1)
        p, lr0 = self.p, self.initial_lr
        k = step - self.warmup_steps  # steps since warmup
        # Progress after warmup, in [0, 1]: 0 at the first step after warmup, 1 at
        # the last scheduled step of the run (the documented final values are
        # those of the last optimizer step before any cooldown).
        span = max(1, self.sched_end - self.warmup_steps - 1)
        t = min(1.0, k / span)
        if self.mode == "constant":
            return lr0
        if self.mode == "plateau":
            return lr0 * p.lr_decay_factor ** self.reductions
        if self.mode == "step":
            if p.step_lr_update_freq is not None:
                return lr0 * p.lr_decay_factor ** self._decays_every(step, p.step_lr_update_freq)
            epoch = step // self.steps_per_epoch
            passed = sum(1 for e in p.lr_updates if epoch >= e)
            return lr0 * (p.lr_decay_factor ** passed)
        if self.mode == "cosine":
            final = lr0 * p.cosine_final_lr_ratio
            return final + 0.5 * (lr0 - final) * (1.0 + math.cos(math.pi * t))
        if self.mode == "linear":
            final = lr0 * p.linear_final_lr_ratio
            return lr0 + (final - lr0) * t
        if self.mode == "poly":
            # k / K with K the post-warmup steps: the last step keeps a small positive rate.
            frac = min(1.0, k / max(1, self.sched_end - self.warmup_steps))
            return lr0 * (1.0 - frac) ** p.poly_power
        if self.mode == "exponential":
            return lr0 * p.lr_decay_factor ** (k / self.steps_per_epoch)
        if self.mode == "cosine_restarts":
            pos, length = _restart_position(k, max(1.0, p.cosine_restart_epochs * self.steps_per_epoch),
                                            p.cosine_restart_mult)
            final = lr0 * p.cosine_final_lr_ratio
            return final + 0.5 * (lr0 - final) * (1.0 + math.cos(math.pi * pos / length))
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
            phase = (k % period) / period
            tri = 1.0 - abs(2.0 * phase - 1.0)  # 0 -> 1 -> 0 over a period
            return low + (lr0 - low) * tri
        raise ValueError(f"training_params.lr_mode: unknown mode {self.mode!r}")

    def _decays_every(self, step: int, freq: float) -> int:
        """The decays of ``step_lr_update_freq`` passed at ``step``: the points
        x * freq epochs (x = 1, 2, ...), each at the first step at or after it
        (ceil(x * P) with P = freq * steps_per_epoch), counting those at or
        after the end of warmup."""
        period = freq * self.steps_per_epoch
        eps = 1e-9  # x * P lands on a whole step despite rounding (0.1 * 30)
        upto = math.floor(step / period + eps)  # ceil(x * P) <= step
        before = math.floor((self.warmup_steps - 1) / period + eps) if self.warmup_steps > 0 else 0
        return max(0, upto - before)  # ceil(x * P) >= warmup_steps

    def _warmup(self, step: int) -> float:
        """Warmup step ``step`` of W: from ``warmup_initial_lr`` to ``initial_lr``
        at the last warmup step (linear, geometric) or flat at ``warmup_initial_lr``;
        ``linear_epoch``: a staircase of one rate per epoch; ``linspace``: the
        first step at ``warmup_initial_lr``, the last of at most one epoch at
        ``initial_lr``."""
        start, lr0 = self.warmup_initial_lr, self.initial_lr
        if self.warmup_mode == "linear_epoch":
            epochs = max(1, self.p.lr_warmup_epochs)  # W of the staircase, even when the run is shorter
            return start + (lr0 - start) * (step // self.steps_per_epoch) / epochs
        if self.warmup_mode == "linspace":
            n = min(self.warmup_steps, self.steps_per_epoch)
            if step >= n:
                return lr0
            return start if n == 1 else start + (lr0 - start) * step / (n - 1)
        frac = (step + 1) / self.warmup_steps
        if self.warmup_mode == "constant":
            return start
        if self.warmup_mode == "exponential":
            return start * (lr0 / start) ** frac
        return start + (lr0 - start) * frac

    def sample(self, steps: Sequence[int]):
        return [self(s) for s in steps]


def write_schedule(schedule: LRSchedule, path: str) -> str:
    """Write the lr of every optimizer step of the run: a ``.csv`` table
    (step, epoch, lr) or an image (``.png``/``.svg``/``.pdf``, matplotlib) with
    the epoch boundaries marked. Returns a one-line summary."""
    n = schedule.total_steps
    lrs = schedule.sample(range(n))
    spe = schedule.steps_per_epoch
    ext = os.path.splitext(path)[1].lower()
    if ext not in (".csv", ".png", ".svg", ".pdf"):
        raise ValueError(f"--plot-lr: got {path!r}; allowed: a path ending in .csv, .png, .svg or .pdf")
    if ext == ".csv":
        with open(path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["step", "epoch", "lr"])
            for k, lr in enumerate(lrs):
                w.writerow([k, k // spe, repr(lr)])
    else:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as e:
            raise ValueError(f"--plot-lr {path}: an image needs matplotlib (pip install 'fusetrain[logging]'); "
                             f"a .csv path needs nothing") from e
        fig, ax = plt.subplots(figsize=(8, 3.5))
        ax.plot(range(n), lrs, lw=1.2)
        for e in range(1, -(-n // spe)):
            ax.axvline(e * spe, color="0.85", lw=0.6, zorder=0)
        mode = getattr(schedule.mode, "__name__", schedule.mode)
        note = " (reductions follow the validation metric)" if mode == "plateau" else ""
        ax.set(xlabel=f"optimizer step ({spe} per epoch)", ylabel="learning rate",
               title=f"lr_mode {mode}{note}, warmup {schedule.warmup_steps} step(s) ({schedule.warmup_mode})")
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
    peak = max(range(n), key=lambda k: lrs[k])
    return (f"{n} steps ({spe} per epoch): lr {lrs[0]:.4g} at step 0, peak {lrs[peak]:.4g} at step {peak}, "
            f"{lrs[-1]:.4g} at the last step -> {path}")


def _user_lr(fn: Callable[[int], float], step: int) -> float:
    value = fn(step)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"training_params.lr_mode: the schedule function {getattr(fn, '__name__', fn)!r} returned "
                         f"{value!r} for step {step}; allowed: a finite float >= 0 (a Python number, not a tensor)")
    return float(value)


def _restart_position(k: int, first: float, mult: int):
    """(position in the current cycle, its length) for SGDR cycles of
    ``first`` steps, each ``mult`` times longer than the one before."""
    if mult == 1:
        return k % first, first
    length = first
    while k >= length:
        k -= length
        length *= mult
    return k, length


def _cos_anneal(a: float, b: float, t: float) -> float:
    return b + (a - b) * 0.5 * (1.0 + math.cos(math.pi * min(max(t, 0.0), 1.0)))


def set_lr(opt, value: float) -> None:
    """Each group's lr: ``value * lr_scale`` (filling the lr tensors of NOTE [lr tensor] in place)."""
    seen = set()
    for g in opt.param_groups:
        lr, scaled = g["lr"], value * g.get("lr_scale", 1.0)
        if isinstance(lr, torch.Tensor):
            if id(lr) not in seen:
                seen.add(id(lr))
                lr.fill_(scaled)
        else:
            g["lr"] = scaled
