"""The dtype and layout of a param's optimizer state: float32, bfloat16 or
int8 moments (NOTE [lean state], NOTE [8-bit state]), the remainder form of
bfloat16 params, and state tensors laid out as their param is (NOTE [state
layout])."""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Sequence

import torch
from torch import Tensor

from . import _int8_state, _sharded

_LOW = (torch.float16, torch.bfloat16)


def _state_dtype(p: Tensor, complex_state: bool = True, group: Optional[Mapping[str, Any]] = None) -> torch.dtype:
    """The dtype of ``p``'s optimizer state: float64 (complex128) for float64
    (complex128) params, float32 (complex64) for the others, unless ``group``
    keeps bfloat16 or int8 state (NOTE [lean state]; int8 for params of at
    least ``_int8_state.MIN_NUMEL`` elements, NOTE [8-bit state])."""
    lean = "float32" if group is None else group.get("state_dtype", "float32")
    if lean != "float32" and p.dtype in _LOW + (torch.float32,):
        if lean == "bfloat16":
            return torch.bfloat16
        if p.numel() >= _int8_state.MIN_NUMEL:
            return torch.int8
    wide = p.dtype in (torch.float64, torch.complex128)
    if p.is_complex() and complex_state:
        return torch.complex128 if wide else torch.complex64
    return torch.float64 if wide else torch.float32


def _same(t: Tensor) -> Tensor:
    return t


def _split_remainder(x: Tensor):
    """NOTE [lean state]: float32 ``x`` as its bfloat16 value (rounded to
    nearest, ties away from zero) and int16 remainder, the kernels' split."""
    b = x.float().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    hi = (b + 0x8000) >> 16
    rem = (b - (hi << 16)).to(torch.int16)
    hi = hi & 0xFFFF
    return torch.where(hi >= 0x8000, hi - 0x10000, hi).to(torch.int16).view(torch.bfloat16), rem


def _join_remainder(p: Tensor, rem: Tensor) -> Tensor:
    """The float32 value of a bfloat16 param and its int16 remainder."""
    v = (((p.view(torch.int16).to(torch.int64) & 0xFFFF) << 16) + rem.to(torch.int64)) & 0xFFFFFFFF
    return torch.where(v >= 2**31, v - 2**32, v).to(torch.int32).view(torch.float32)


# NOTE [state layout]: a state tensor (and a master copy) is laid out as its
# param is, or contiguously for a param that is a strided view (NOTE [strided
# params] in csrc/ops/fused_update.cpp), and has the dtype the step needs. A
# param whose layout, dtype or device changes after its state was made
# (``model.to(memory_format=torch.channels_last)``, ``model.double()``, a
# column-major ``p.data``, a state dict saved from a model of another layout)
# gets its state copied into the new layout before its next step, values kept.
def _dense(t: Tensor) -> bool:
    """Whether ``t``'s elements fill its memory without gaps or overlap, in some dimension order."""
    expected = 1
    for stride, size in sorted((s, n) for s, n in zip(t.stride(), t.shape) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _state_strides(p: Tensor) -> Sequence[int]:
    """The strides of ``p``'s state tensors (NOTE [state layout])."""
    if _dense(p):
        return p.stride()
    strides, acc = [], 1
    for n in reversed(p.shape):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))


def _fits(t: Any, p: Tensor, dtype: torch.dtype) -> bool:
    """Whether state tensor ``t`` has the layout, dtype and device a step of ``p`` needs."""
    if not isinstance(t, Tensor) or t.dtype != dtype or t.device != p.device:
        return False
    if t.stride() == p.stride() or t.shape != p.shape:  # a shape mismatch is the op's error to report
        return True
    return t.stride() == tuple(_state_strides(p))


def _conform(t: Tensor, p: Tensor, dtype: torch.dtype) -> Tensor:
    """``t`` with the layout, dtype and device a step of ``p`` needs (``t`` when it has them already)."""
    if t.shape != p.shape or _fits(t, p, dtype):  # a shape mismatch is the op's error to report
        return t
    return torch.empty_strided(p.shape, _state_strides(p), dtype=dtype, device=p.device).copy_(t)


def _put_in_form(state: Dict[str, Any], name: str, p: Tensor, dtype: torch.dtype, block: int,
                 initial: float) -> None:
    """NOTE [8-bit state]: ``state[name]`` made, converted or laid out for a
    step of ``p`` (on its local shard for a DTensor: NOTE [sharded 8-bit state])."""
    put = _int8_state.put_in_form_sharded if _sharded.is_sharded(p) else _int8_state.put_in_form
    put(state, name, p, dtype, block, initial, _fits, _conform)
