"""Mixed precision: a device-side dynamic loss scaler and the precision policy.

:class:`LossScaler` has the usage and the state dict of
``torch.amp.GradScaler`` (``scale``, ``unscale_``, ``step``, ``update``,
``get_scale``, ``state_dict``/``load_state_dict``). Its scale and growth
tracker live in device memory and are updated by the ``fusetrain::update_scale_``
op. With a fusetrain optimizer, ``step`` runs the fused step: one read-only pass
(non-finite flag, and the norm when clipping) and one update pass that unscales,
clips, updates and (with an attached EMA) updates the EMA. A step with inf/NaN
gradients is skipped on the device; nothing asks the host. With any other
optimizer it behaves as GradScaler does (unfused, one host sync per step).
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import Any, Dict, Optional, Union

import torch
from torch import Tensor

from . import _ops
from ._checks import check_flag, check_number
from .optim._base import FusedOptimizer

__all__ = ["LossScaler", "Precision", "resolve_precision", "SCALE_FLOOR"]

_READY, _UNSCALED, _STEPPED = 0, 1, 2

#: The smallest scale: ``update_scale_`` backs off no further (2**-126, the smallest
#: normal float32). A scale at this floor means every recent step was non-finite:
#: the run has diverged (the Trainer stops it and says so).
SCALE_FLOOR = 2.0**-126


#: LossScaler's numeric settings and their ranges (``check_number``'s keywords), checked by the constructor,
#: the setters, ``update(new_scale)`` and ``load_state_dict``.
_NUMBERS: Dict[str, Dict[str, Any]] = {
    "init_scale": dict(low=SCALE_FLOOR), "new_scale": dict(low=SCALE_FLOOR), "scale": dict(low=SCALE_FLOOR),
    "growth_factor": dict(low=1.0, low_open=True), "backoff_factor": dict(low=0.0, high=1.0, low_open=True),
    "growth_interval": dict(low=1, integer=True), "_growth_tracker": dict(low=0, integer=True)}


def _check(name: str, value: Any, owner: str = "LossScaler", label: Optional[str] = None) -> Any:
    """``value`` of setting ``name`` checked against its range (``label``: the name the error uses)."""
    return check_number(owner, label or name, value, **_NUMBERS[name])


class LossScaler:
    """Dynamic loss scaling with the scale in device memory.

    Args (as ``torch.amp.GradScaler``):
      device: where the scale lives; ``None`` (default) takes the device of the
        first tensor passed to :meth:`scale`.
      init_scale, growth_factor, backoff_factor, growth_interval, enabled.

    Device tensors for logs and LR schedulers (read them when you log, not per
    step): :attr:`last_step_skipped` (1.0 when the last ``update()`` saw
    non-finite gradients) and :attr:`skipped_steps` (a running count).
    """

    def __init__(self, device: Optional[Union[str, torch.device]] = None, init_scale: float = 2.0**16,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5, growth_interval: int = 2000,
                 enabled: bool = True) -> None:
        check_flag("LossScaler", "enabled", enabled)
        for name, value in (("init_scale", init_scale), ("growth_factor", growth_factor),
                            ("backoff_factor", backoff_factor), ("growth_interval", growth_interval)):
            _check(name, value)
        self._device = torch.device(device) if device is not None else None
        self._enabled = enabled
        self._init_scale = float(init_scale)
        self._growth_factor = float(growth_factor)
        self._backoff_factor = float(backoff_factor)
        self._growth_interval = int(growth_interval)
        self._init_growth_tracker = 0
        self._scale: Optional[Tensor] = None
        self._growth_tracker: Optional[Tensor] = None
        self._stats: Dict[str, Optional[Tensor]] = {"last_step_skipped": None, "skipped_steps": None}
        self._per_optimizer: Dict[int, Dict[str, Any]] = {}
        self._warned_bf16 = False

    # ---- device state ---------------------------------------------------------------

    def _lazy_init(self, device: torch.device) -> None:
        if self._scale is not None:
            return
        dev = self._device if self._device is not None else device
        self._scale = torch.full((), self._init_scale, dtype=torch.float32, device=dev)
        self._growth_tracker = torch.full((), self._init_growth_tracker, dtype=torch.int32, device=dev)
        self._stats["last_step_skipped"] = torch.zeros((), dtype=torch.float32, device=dev)
        self._stats["skipped_steps"] = torch.zeros((), dtype=torch.float32, device=dev)

    def _check_scale_initialized(self, fn: str) -> None:
        if self._scale is None:
            raise RuntimeError(f"LossScaler.{fn}: no scale yet; call scale(loss) first "
                               "(the scale is created on the loss's device)")

    def _opt_state(self, optimizer) -> Dict[str, Any]:
        key = id(optimizer)
        st = self._per_optimizer.get(key)
        if st is None:
            st = {"stage": _READY, "found_inf": None}
            self._per_optimizer[key] = st
        return st

    def _warn_if_bf16(self, device_type: str) -> None:
        if self._warned_bf16 or device_type not in ("cuda", "cpu"):
            return
        if torch.is_autocast_enabled(device_type) and torch.get_autocast_dtype(device_type) == torch.bfloat16:
            self._warned_bf16 = True
            warnings.warn("LossScaler used under bfloat16 autocast: bf16 has the range of fp32 and needs no loss "
                          "scaling; use Precision('bf16') without a scaler (scaling still works, it only costs time)",
                          stacklevel=3)

    # ---- GradScaler API ------------------------------------------------------------

    def scale(self, outputs):
        """Multiply a tensor (or a nested list/tuple of tensors) by the scale."""
        if not self._enabled:
            return outputs
        if isinstance(outputs, Tensor):
            self._lazy_init(outputs.device)
            self._warn_if_bf16(outputs.device.type)
            return outputs * self._scale.to(device=outputs.device)
        if isinstance(outputs, (list, tuple)):
            scaled = [self.scale(o) for o in outputs]
            return type(outputs)(scaled) if isinstance(outputs, tuple) else scaled
        raise TypeError(f"LossScaler.scale: outputs must be a tensor or a list/tuple of tensors, "
                        f"got {type(outputs).__name__}")

    def _inv_scale(self) -> Tensor:
        return torch.reciprocal(self._scale)

    def unscale_(self, optimizer) -> None:
        """Divide the optimizer's gradients by the scale in place (for code that
        inspects or clips gradients between ``backward`` and ``step``). With a
        fusetrain optimizer prefer its ``max_grad_norm``: clipping then happens
        in the fused step without this extra pass."""
        if not self._enabled:
            return
        self._check_scale_initialized("unscale_")
        st = self._opt_state(optimizer)
        if st["stage"] == _UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if st["stage"] == _STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        inv = self._inv_scale()
        found = torch.zeros((), dtype=torch.float32, device=self._scale.device)
        by_key: Dict[Any, list] = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                if g.is_sparse:
                    g = g.coalesce()._values()
                by_key.setdefault((g.device, g.dtype), []).append(g)
        for (dev, _), grads in by_key.items():
            f_dev = found if dev == found.device else torch.zeros((), dtype=torch.float32, device=dev)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, f_dev, inv.to(dev))
            if f_dev is not found:
                found = torch.maximum(found, f_dev.to(found.device))
        st["found_inf"] = found
        st["stage"] = _UNSCALED

    def step(self, optimizer, *args, **kwargs):
        """Step ``optimizer`` with the unscaled gradients, skipping the step
        when they are not finite. With a fusetrain optimizer the skip happens on
        the device and ``None`` is returned (the result of a skipped step is
        not known on the host); otherwise as ``GradScaler.step``."""
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("LossScaler.step: a closure is not supported while loss scaling is enabled")
        self._check_scale_initialized("step")
        st = self._opt_state(optimizer)
        if st["stage"] == _STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if isinstance(optimizer, FusedOptimizer):
            if st["stage"] == _UNSCALED:
                optimizer._set_amp(None, st["found_inf"])
            else:
                optimizer._set_amp(self._inv_scale(), None)
            ret = optimizer.step(*args, **kwargs)
            st["found_inf"] = optimizer.last_found_inf
        else:
            if st["stage"] == _READY:
                self.unscale_(optimizer)
            ret = None
            if not bool(st["found_inf"].item()):  # unfused optimizers need the host to decide
                ret = optimizer.step(*args, **kwargs)
        st["stage"] = _STEPPED
        return ret

    def update(self, new_scale: Optional[Union[float, Tensor]] = None) -> None:
        """Update the scale from the non-finite flags of this iteration's
        steps (on the device), or set it to ``new_scale``."""
        if not self._enabled:
            return
        self._check_scale_initialized("update")
        if new_scale is not None:
            if isinstance(new_scale, Tensor):
                if new_scale.numel() != 1:
                    raise ValueError("LossScaler.update: new_scale must have one element")
                self._scale.copy_(new_scale.reshape(()))
            else:
                _check("new_scale", new_scale, "LossScaler.update")
                self._scale.fill_(float(new_scale))
        else:
            flags = [st["found_inf"] for st in self._per_optimizer.values() if st["found_inf"] is not None]
            if not flags:
                raise RuntimeError("LossScaler.update: no inf checks were recorded before update(); call "
                                   "step(optimizer) (with gradients present) first")
            found = flags[0].to(self._scale.device)
            for f in flags[1:]:
                found = torch.maximum(found, f.to(self._scale.device))
            _ops.update_scale_(self._scale, self._growth_tracker, found, self._growth_factor,
                               self._backoff_factor, self._growth_interval,
                               self._stats["last_step_skipped"], self._stats["skipped_steps"])
        self._per_optimizer.clear()

    # ---- accessors ------------------------------------------------------------------

    @property
    def last_step_skipped(self) -> Optional[Tensor]:
        """Device tensor: 1.0 when the last ``update()`` backed off (skipped step)."""
        return self._stats["last_step_skipped"]

    @property
    def skipped_steps(self) -> Optional[Tensor]:
        """Device tensor: number of skipped steps so far."""
        return self._stats["skipped_steps"]

    def get_scale(self) -> float:
        """The current scale as a Python float (synchronises; not for the hot path)."""
        if not self._enabled:
            return 1.0
        return self._init_scale if self._scale is None else float(self._scale.item())

    def get_scale_tensor(self) -> Optional[Tensor]:
        """The scale as a device tensor (no sync), or None before the first scale()."""
        return self._scale

    def get_growth_factor(self) -> float:
        return self._growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        _check("growth_factor", new_factor, "LossScaler.set_growth_factor")
        self._growth_factor = float(new_factor)

    def get_backoff_factor(self) -> float:
        return self._backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        _check("backoff_factor", new_factor, "LossScaler.set_backoff_factor")
        self._backoff_factor = float(new_factor)

    def get_growth_interval(self) -> int:
        return self._growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        _check("growth_interval", new_interval, "LossScaler.set_growth_interval")
        self._growth_interval = new_interval

    def is_enabled(self) -> bool:
        return self._enabled

    def _get_growth_tracker(self) -> int:
        if self._growth_tracker is None:
            return self._init_growth_tracker
        return int(self._growth_tracker.item())

    def state_dict(self) -> Dict[str, Any]:
        """GradScaler's layout: scale, growth_factor, backoff_factor,
        growth_interval, _growth_tracker (empty when disabled)."""
        if not self._enabled:
            return {}
        return {"scale": self.get_scale(), "growth_factor": self._growth_factor,
                "backoff_factor": self._backoff_factor, "growth_interval": self._growth_interval,
                "_growth_tracker": self._get_growth_tracker()}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a state dict saved by this class or by ``torch.amp.GradScaler``."""
        if not self._enabled:
            return
        if len(state_dict) == 0:
            raise RuntimeError("LossScaler.load_state_dict: the state dict is empty, possibly because it was "
                               "saved from a disabled scaler")
        missing = [k for k in ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
                   if k not in state_dict]
        if missing:
            raise KeyError(f"LossScaler.load_state_dict: missing keys {missing}")
        # Checked as the constructor checks its arguments, all before anything changes.
        sd = {k: state_dict[k].item() if isinstance(state_dict[k], Tensor) and state_dict[k].numel() == 1
              else state_dict[k] for k in ("scale", "growth_factor", "backoff_factor", "growth_interval",
                                            "_growth_tracker")}
        for key in sd:
            _check(key, sd[key], "LossScaler.load_state_dict", f"state_dict[{key!r}]")
        self._init_scale = float(sd["scale"])
        self._growth_factor = float(sd["growth_factor"])
        self._backoff_factor = float(sd["backoff_factor"])
        self._growth_interval = int(sd["growth_interval"])
        self._init_growth_tracker = int(sd["_growth_tracker"])
        if self._scale is not None:
            self._scale.fill_(self._init_scale)
            self._growth_tracker.fill_(self._init_growth_tracker)


# ---- precision policy ----------------------------------------------------------------

_ALLOWED = "False, True (best for the device), 'fp16', 'bf16' or 'fp32'"
_ALIASES = {"fp16": "fp16", "float16": "fp16", "half": "fp16", "bf16": "bf16", "bfloat16": "bf16",
            "fp32": "fp32", "float32": "fp32", "no": "fp32", "none": "fp32"}


@dataclass(frozen=True)
class Precision:
    """How a step runs: ``fp32`` (no autocast), ``fp16`` (autocast + loss
    scaling) or ``bf16`` (autocast, no scaler and no scaling work at all)."""

    name: str
    device_type: str

    def __post_init__(self):
        if self.name not in ("fp32", "fp16", "bf16"):
            raise ValueError(f"Precision: name must be one of 'fp32', 'fp16', 'bf16', got {self.name!r}")

    @property
    def dtype(self) -> torch.dtype:
        return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[self.name]

    @property
    def uses_scaler(self) -> bool:
        return self.name == "fp16"

    def autocast(self):
        """Context manager for forward passes (training, validation, inference)."""
        if self.name == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.dtype)

    def make_scaler(self, **kwargs) -> LossScaler:
        """A LossScaler for this precision: enabled for fp16 only."""
        return LossScaler(device=None, enabled=self.uses_scaler, **kwargs)


def resolve_precision(mixed_precision: Union[bool, str, None], device: Union[str, torch.device]) -> Precision:
    """Turn a ``mixed_precision`` setting into a :class:`Precision`.
    ``True`` picks the best for the device: bf16 on GPUs that support it (and
    on CPU), fp16 on older GPUs."""
    device_type = torch.device(device).type
    if mixed_precision is None or mixed_precision is False:
        return Precision("fp32", device_type)
    if mixed_precision is True:
        if device_type == "cuda":
            return Precision("bf16" if torch.cuda.is_bf16_supported() else "fp16", device_type)
        return Precision("bf16", device_type)
    if isinstance(mixed_precision, str) and mixed_precision.lower() in _ALIASES:
        name = _ALIASES[mixed_precision.lower()]
        if name == "fp16" and device_type == "cpu":
            _warn_slow_fp16()
        return Precision(name, device_type)
    raise ValueError(f"mixed_precision: got {mixed_precision!r}; allowed: {_ALLOWED}")


_warned_slow_fp16 = False


def _warn_slow_fp16() -> None:
    """NOTE [fp16 on the CPU]: the CPU has no fast float16 kernels, so fp16 autocast there runs
    slower than float32, and much slower than bf16. Said once per process, naming bf16, which needs
    no loss scaler either."""
    global _warned_slow_fp16
    if _warned_slow_fp16:
        return
    _warned_slow_fp16 = True
    warnings.warn("mixed_precision 'fp16' on the CPU: the CPU has no fast float16 kernels, so this runs slower "
                  "than float32; use mixed_precision 'bf16' (or true, which picks bf16 on the CPU; no loss scaler "
                  "needed)", UserWarning, stacklevel=3)
