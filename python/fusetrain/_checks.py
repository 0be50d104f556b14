"""The check of a numeric setting, shared by every class that takes one (the
optimizers' options, ``ModelEMA``, ``LossScaler``, ``TrainStep``): a value of
the wrong type is a TypeError, NaN, an infinity or a value out of range a
ValueError, each naming the owner, the setting, the value and what is allowed.
Callers check every setting before they create or change anything."""

from __future__ import annotations

import math
from typing import Any, Optional

from torch import Tensor


def _bound(x: float) -> str:
    return repr(int(x)) if float(x).is_integer() and abs(x) < 2**53 else repr(x)


def allowed_range(low: Optional[float], high: Optional[float], low_open: bool = False,
                  high_closed: bool = False) -> str:
    """The allowed values in words: "> 0", ">= 0", "in [0, 1)", "in (0, 1)", "" (any)."""
    if low is None and high is None:
        return ""
    if high is None:
        return f"{'>' if low_open else '>='} {_bound(low)}"
    if low is None:
        return f"{'<=' if high_closed else '<'} {_bound(high)}"
    return f"in {'(' if low_open else '['}{_bound(low)}, {_bound(high)}{']' if high_closed else ')'}"


def check_number(owner: str, name: str, value: Any, low: Optional[float] = None, high: Optional[float] = None, *,
                 low_open: bool = False, high_closed: bool = False, integer: bool = False,
                 tensor: bool = False, optional: bool = False) -> Any:
    """``value`` as a finite number (an int with ``integer``) between ``low``
    and ``high`` (None: unbounded; ``low`` closed unless ``low_open``, ``high``
    open unless ``high_closed``), or a clear error naming ``owner``'s setting
    ``name``. ``tensor``: a one-element tensor is read (once, at construction)
    as its number. ``optional``: None is taken too. Returns the value as given
    (a float for a tensor)."""
    if optional and value is None:
        return None
    allowed = allowed_range(low, high, low_open, high_closed) + (" or None" if optional else "")
    what = ("an int" if integer else "a finite number") + (f" {allowed}" if allowed else "")
    if tensor and isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(f"{owner}: {name} must be a number or a one-element tensor, got shape "
                             f"{tuple(value.shape)}")
        value = value.item()  # read once at construction, not per step
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        raise TypeError(f"{owner}: {name} must be {what}, got {type(value).__name__} {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{owner}: {name} must be {what}, got {value}")
    ok = (low is None or (value > low if low_open else value >= low)) and \
         (high is None or (value <= high if high_closed else value < high))
    if not ok:
        raise ValueError(f"{owner}: {name} must be {'an int ' if integer else ''}{allowed}, got {value}")
    return value


def check_flag(owner: str, name: str, value: Any) -> bool:
    """``value`` as a bool setting (a string such as "false" would count as true), or a TypeError naming it."""
    if not isinstance(value, bool):
        raise TypeError(f"{owner}: {name} must be a bool (True or False), got {type(value).__name__} {value!r}")
    return value
