"""Checks of the optimizers' settings, shared by their constructors and
param groups: each bad value is a clear error naming the setting and what is
allowed, raised before any state changes."""

from __future__ import annotations

from typing import Any, Dict

import torch
from . import _int8_state
from ._kinds import LEAN_CLASSES


# NOTE [lean state] in csrc/common/lean_state.h: how a group keeps its
# bfloat16 params' full value (master_weights) and its moments (state_dtype).
#: master_weights values and their code in a group record.
_MASTER_CODES = {False: 0.0, True: 1.0, "remainder": 2.0, "stochastic": 3.0}
_MASTER_NAMES = "False, True, 'remainder' or 'stochastic'"
_STATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}
#: The state entry holding a param's full value, by master_weights value.
_MASTER_KEYS = {True: "master_param", "remainder": "master_remainder"}


def _check_master_weights(opt: str, value: Any, lean: bool) -> Any:
    """``value`` as a group's master_weights setting, or a clear error."""
    if not isinstance(value, (bool, str)):
        raise TypeError(f"{opt}: master_weights must be {_MASTER_NAMES}, got {value!r}")
    if not (isinstance(value, bool) or value in ("remainder", "stochastic")):
        raise ValueError(f"{opt}: master_weights must be {_MASTER_NAMES}, got {value!r}")
    if not isinstance(value, bool) and not lean:
        raise ValueError(f"{opt}: master_weights={value!r} is for the element-wise optimizers "
                         f"({', '.join(LEAN_CLASSES)}); use master_weights=True")
    return value


def _check_state_dtype(opt: str, value: Any, lean: bool) -> str:
    """``value`` (a torch dtype or its name) as a group's state_dtype setting
    ("float32", "bfloat16" or "int8"), or a clear error."""
    name = next((n for n, d in _STATE_DTYPES.items() if value == d or value == n), None)
    if name is None:
        raise ValueError(f"{opt}: state_dtype must be torch.float32, torch.bfloat16 or torch.int8 (or their "
                         f"names), got {value!r}")
    if name != "float32" and not lean:
        raise ValueError(f"{opt}: state_dtype={value!r} is for the element-wise optimizers "
                         f"({', '.join(LEAN_CLASSES)})")
    return name


def _check_block_size(opt: str, value: Any) -> int:
    """``value`` as a group's state_block_size (NOTE [8-bit state]), or a clear error."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{opt}: state_block_size must be an int, got {type(value).__name__} {value!r}")
    if value not in _int8_state.BLOCK_SIZES:
        what = "not a power of two" if value <= 0 or value & (value - 1) else "out of range"
        raise ValueError(f"{opt}: state_block_size must be a power of two among "
                         f"{', '.join(map(str, _int8_state.BLOCK_SIZES))} (elements per int8 block), got {value} "
                         f"({what})")
    return value


def _torch_checks(torch_cls, **kwargs) -> Dict[str, Any]:
    """torch.optim's own argument checks, run by building the matching torch
    optimizer over a stand-in parameter: the same exception types and messages
    for the same configurations, so code written against torch may match them.
    ``foreach``, ``fused`` and ``capturable`` only name an implementation (the
    fused step is always used) but combinations torch rejects are rejected.
    Returns torch's defaults (the keys of its param groups)."""
    # A matrix: torch.optim.Muon takes 2-d params only.
    return dict(torch_cls([torch.zeros(1, 1)], **kwargs).defaults)


def _no_differentiable(opt: str, differentiable: Any) -> None:
    if differentiable:
        raise ValueError(f"{opt}: differentiable=True is not supported: the fused step runs outside autograd; "
                         f"use torch.optim.{opt} to differentiate through optimizer steps")
