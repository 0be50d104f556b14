"""8-bit optimizer state: codes and block scales (NOTE [8-bit state] in
csrc/common/lean_state.h).

The kernels write int8 states inside the fused step; this module holds the
same code map for what happens outside a step: making a new state, loading
a float32 / bfloat16 state into an int8 one (rounded to nearest) and the
reverse, and the tests' reference of the kernels' rounding (``encode`` with
their random bits gives their codes bit for bit).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

#: Block sizes a state may use; the default.
BLOCK_SIZES = (64, 128, 256)
DEFAULT_BLOCK = 256
#: Tensors with fewer elements keep float32 state (biases, norms: little
#: memory, and an 8-bit block over a handful of values gains nothing).
MIN_NUMEL = 4096



def block_of(numel: int, n_scales: int) -> int:
    """The block size whose blocks of ``numel`` elements are ``n_scales`` (the
    smallest that fits, as the op reads it), or 0 when none does."""
    return next((b for b in BLOCK_SIZES if -(-numel // b) == n_scales), 0)


def scales_key(name: str) -> str:
    """The state entry holding the block scales of the int8 state ``name``."""
    return f"{name}_scales"


def _memory_order(t: Tensor) -> Tensor:
    """A 1-D view of a dense tensor's elements in memory order (the order the
    kernels number them in)."""
    return t.as_strided((t.numel(),), (1,), t.storage_offset())


def _bits_float(bits: Tensor) -> Tensor:
    return bits.to(torch.int32).view(torch.float32)


def encode(values: Tensor, block: int, rnd: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """Codes (int8, in ``values``' memory order, 1-D) and block scales of a
    dense float tensor. ``rnd``: the kernels' 16 random bits per element (the
    low half of an int64 tensor: NOTE [paired draws]), their stochastic
    rounding; None: rounded to nearest."""
    y = _memory_order(values).float()
    n = y.numel()
    nb = -(-n // block)
    padded = torch.zeros(nb * block, dtype=torch.float32, device=y.device)
    padded[:n] = y
    blocks = padded.view(nb, block)
    a = blocks.abs()
    finite = torch.isfinite(blocks).all(dim=1)
    absmax = torch.where(torch.isfinite(a), a, torch.zeros_like(a)).amax(dim=1)
    # A block below float32's smallest normal is stored as zeros (its reciprocal would overflow).
    absmax = torch.where(absmax >= torch.finfo(torch.float32).tiny, absmax, torch.zeros_like(absmax))
    negative = (blocks < 0).any(dim=1)
    scales = torch.where(finite, torch.where(negative, absmax, -absmax), torch.full_like(absmax, float("nan")))
    # The kernels multiply by the float32 reciprocal of the block's largest magnitude.
    norm = torch.where(absmax > 0, torch.ones_like(absmax) / absmax, torch.zeros_like(absmax))
    x = a * norm[:, None]
    mag = x.view(torch.int32).to(torch.int64) & 0x7FFFFFFF
    unsigned = ~negative[:, None]
    low = torch.where(unsigned, 2.0 ** -30, 2.0 ** -14).float()
    # Below the normal codes: the bits of |x| + low, one binade up (float32 addition, as the kernels).
    linear = x < low
    z = torch.where(linear, (x + low).view(torch.int32).to(torch.int64), mag)
    if rnd is None:
        add = torch.full_like(mag, 0x80000)
    else:
        r = torch.zeros(nb * block, dtype=torch.int64, device=y.device)
        r[:n] = rnd.reshape(-1).to(torch.int64) & 0xFFFF
        add = r.view(nb, block) << 4
    off = torch.where(unsigned, 768, 896) + torch.where(linear, 8, 0)
    code = torch.minimum(((z + add) >> 20) - off, torch.where(unsigned, 255, 127))
    sign = padded.view(torch.int32).view(nb, block) < 0
    code = code | torch.where(~unsigned & sign, 0x80, 0)
    code = torch.where((finite & (absmax > 0))[:, None], code, torch.zeros_like(code))
    codes = code.reshape(-1)[:n].to(torch.uint8).view(torch.int8)
    return codes, scales


def decode(codes: Tensor, scales: Tensor, block: int) -> Tensor:
    """The float32 values (1-D, memory order) of int8 ``codes`` with their block scales."""
    c = _memory_order(codes).view(torch.uint8).to(torch.int64)
    n = c.numel()
    scale = scales.float().repeat_interleave(block)[:n]
    unsigned = scale.view(torch.int32) < 0
    m = torch.where(unsigned, c, c & 0x7F)
    exp = m >> 3
    sub = m.float() * torch.where(unsigned, 2.0 ** -33, 2.0 ** -17).float()
    normal = _bits_float((m + torch.where(unsigned, 768, 896)) << 20)
    v = torch.where(exp == 0, sub, normal)
    v = torch.where(~unsigned & (c >= 0x80), -v, v)
    return v * scale.abs()


def quantize_like(values: Tensor, like: Tensor, block: int) -> Tuple[Tensor, Tensor]:
    """``values`` as an int8 state laid out as ``like`` (codes in ``like``'s
    layout, rounded to nearest) and its block scales."""
    dense = torch.empty_like(like, dtype=torch.float32, memory_format=torch.preserve_format)
    dense.copy_(values)
    codes, scales = encode(dense, block)
    out = torch.empty_like(like, dtype=torch.int8, memory_format=torch.preserve_format)
    _memory_order(out).copy_(codes)
    return out, scales


def dequantize(codes: Tensor, scales: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """An int8 state as a ``dtype`` tensor of its codes' shape and layout."""
    block = block_of(codes.numel(), scales.numel())
    if block == 0:
        raise ValueError(f"an int8 state of {codes.numel()} elements has {scales.numel()} block scales; blocks of "
                         f"{', '.join(map(str, BLOCK_SIZES))} elements give "
                         f"{', '.join(str(-(-codes.numel() // b)) for b in BLOCK_SIZES)}")
    out = torch.empty_like(codes, dtype=torch.float32, memory_format=torch.preserve_format)
    _memory_order(out).copy_(decode(codes, scales, block))
    return out.to(dtype)


def ready(state: dict, name: str, p: Tensor, block: int, fits) -> bool:
    """Whether ``state[name]`` is an int8 state of ``p`` in blocks of ``block``
    that a step can take as it is (``fits(t, p, dtype)``: layout and device)."""
    t, sc = state.get(name), state.get(scales_key(name))
    return (fits(t, p, torch.int8) and isinstance(sc, Tensor) and sc.dtype == torch.float32
            and sc.device == p.device and sc.dim() == 1 and sc.is_contiguous()
            and sc.numel() == -(-p.numel() // block))


@torch.no_grad()
def put_in_form(state: dict, name: str, p: Tensor, dtype: torch.dtype, block: int, initial: float, fits,
                conform) -> None:
    """Makes ``state[name]`` the state a step of ``p`` needs: int8 codes in
    blocks of ``block`` with ``state[scales_key(name)]`` when ``dtype`` is
    int8, else a ``dtype`` tensor (``conform(t, p, dtype)``: layout and
    device; ``fits(t, p, dtype)``: whether it has them); a new one holds
    ``initial``. An int8 state in another block size or layout and a float
    state are converted (rounded to nearest); one in the same form is only
    moved to ``p``'s device."""
    key = scales_key(name)
    t, sc = state.get(name), state.get(key)
    values = None
    if dtype == torch.int8 and isinstance(t, Tensor) and t.dtype == torch.int8 and isinstance(sc, Tensor) \
            and t.shape == p.shape and -(-p.numel() // block) == sc.numel() and fits(t.to(p.device), p, torch.int8):
        state[name], state[key] = t.to(p.device), sc.to(device=p.device, dtype=torch.float32).contiguous()
        return
    if isinstance(t, Tensor) and t.dtype == torch.int8 and isinstance(sc, Tensor):
        values = dequantize(t.to(p.device), sc.to(p.device))
    elif isinstance(t, Tensor):
        values = t.to(p.device)
    if dtype != torch.int8:
        state.pop(key, None)
        state[name] = (torch.full_like(p, initial, dtype=dtype, memory_format=torch.preserve_format)
                       if values is None else conform(values, p, dtype) if values.shape == p.shape else values)
        return
    if values is None:
        # Every block of a new state holds `initial`: one block's code and scale
        # repeated (no float32 state-sized temporary).
        code, scale = encode(torch.full((block,), float(initial), dtype=torch.float32, device=p.device), block)
        state[name] = torch.empty_like(p, dtype=torch.int8, memory_format=torch.preserve_format).fill_(code[0])
        state[key] = scale.expand(-(-p.numel() // block)).contiguous()
        return
    if values.shape != p.shape:
        raise ValueError(f"optimizer state '{name}' has shape {tuple(values.shape)} but its param has shape "
                         f"{tuple(p.shape)}")
    state[name], state[key] = quantize_like(values, p, block)


# NOTE [sharded 8-bit state]: a DTensor param's (FSDP2) int8 state is a
# DTensor of codes sharded like it, and the block scales of this rank's shard
# are a plain tensor: blocks start at the shard's first element and never
# straddle two ranks. Its state dict holds the state decoded into a float32
# DTensor (no scales), which torch.distributed.checkpoint saves, reshards and
# loads as any sharded state; loading encodes it again (to nearest; on the
# same shards the same codes and scales: a resume continues bit for bit).


def put_in_form_sharded(state: dict, name: str, p: Tensor, dtype: torch.dtype, block: int, initial: float, fits,
                        conform) -> None:
    """put_in_form for a DTensor param, on its local shard (NOTE [sharded 8-bit state])."""
    from torch.distributed.tensor import DTensor

    key = scales_key(name)
    local = {k: (v.to_local() if isinstance(v, DTensor) else v) for k, v in state.items() if k in (name, key)}
    put_in_form(local, name, p.to_local(), dtype, block, initial, fits, conform)
    state[name] = DTensor.from_local(local[name], p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                     stride=p.stride())
    if key in local:
        state[key] = local[key]
    else:
        state.pop(key, None)


def widen_sharded(states: dict) -> None:
    """The int8 DTensor states of a state dict's ``states`` decoded into float32
    DTensors, their scales dropped (NOTE [sharded 8-bit state]); the entries
    are replaced, not changed in place."""
    from torch.distributed.tensor import DTensor

    for pid, st in list(states.items()):
        names = [k for k, v in st.items() if isinstance(v, DTensor) and v.dtype == torch.int8]
        if not names:
            continue
        st = dict(st)
        for k in names:
            c = st[k]
            values = dequantize(c.to_local(), st.pop(scales_key(k)))
            st[k] = DTensor.from_local(values, c.device_mesh, c.placements, run_check=False, shape=c.shape,
                                       stride=c.stride())
        states[pid] = st


def full_precision_state_dict(state_dict: dict) -> dict:
    """A copy of an optimizer state dict with its lean moments as float32: int8
    states decoded (their block scales dropped), bfloat16 states widened,
    and every group's ``state_dtype`` "float32". It loads into a fusetrain
    optimizer with float32 state or into the matching torch.optim optimizer
    (NOTE [8-bit state]); masters are left as they are."""
    out = {"state": {}, "param_groups": [dict(g, state_dtype="float32") if "state_dtype" in g else dict(g)
                                         for g in state_dict["param_groups"]]}
    for pid, st in state_dict["state"].items():
        coded = {k for k, v in st.items() if isinstance(v, Tensor) and v.dtype == torch.int8
                 and isinstance(st.get(scales_key(k)), Tensor)}
        scale_keys = {scales_key(k) for k in coded}
        new = {}
        for k, v in st.items():
            if k in scale_keys:
                continue
            if k in coded:
                v = dequantize(v, st[scales_key(k)])
            elif isinstance(v, Tensor) and v.dtype == torch.bfloat16:
                v = v.float()
            new[k] = v
        out["state"][pid] = new
    return out
