"""Shared by the lean-state tests (tests/python/optim/test_lean_state.py, test_int8_state.py): the
optimizers that take lean state and the kernels' random stream recomputed (NOTE [lean state] in
csrc/common/lean_state.h)."""

import torch

import fusetrain.optim as fo

M32 = 0xFFFFFFFF

#: (class, keyword arguments) of every optimizer that takes lean state, with settings that use its states.
LEAN = [
    (fo.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    (fo.Adam, dict(lr=1e-2, weight_decay=0.05, amsgrad=True)),
    (fo.SGD, dict(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=1e-3)),
    (fo.Lion, dict(lr=1e-3, weight_decay=0.1)),
    (fo.RMSprop, dict(lr=1e-3, momentum=0.9, centered=True)),
    (fo.Adadelta, dict(lr=1.0, weight_decay=0.01)),
    (fo.RAdam, dict(lr=1e-2)),
    (fo.NAdam, dict(lr=1e-2, weight_decay=0.01)),
]
LEAN_IDS = [c.__name__ for c, _ in LEAN]


def mix32(x):
    """The kernels' 32-bit hash (csrc/common/lean_state.h), elementwise on an int64 tensor."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def rounding_bits(step, tensor, stream, n):
    """The 32 random bits of elements 0..n-1 of a stream: the param's step count, the tensor's position
    in its launch, the stream (0 the param, 1..3 the state slots)."""
    key = mix32(torch.tensor((int(step) * 0x9E3779B9 + stream) & M32)) ^ ((tensor * 0x85EBCA6B) & M32)
    key = mix32(key)
    i = torch.arange(n, dtype=torch.int64)
    return mix32(((key ^ (i & M32)) + (i >> 32) * 0x27D4EB2F) & M32)


def state_draw(slot):
    """NOTE [paired draws]: (stream, shift) of the bits with which state slot ``slot`` (0..2) rounds to
    bfloat16 or to an 8-bit code: slots 0 and 1 share stream 1's draws (low and high halves), slot 2 draws
    from stream 3."""
    return ((1, 0), (1, 16), (3, 0))[slot]


def state_bits(step, tensor, slot, n):
    """The random bits (in their low 16) with which state slot ``slot`` (0..2) of elements 0..n-1 rounds."""
    stream, shift = state_draw(slot)
    return rounding_bits(step, tensor, stream, n) >> shift


def grads(params, seed, scale=1.0):
    """Seeded gradients of bfloat16 values in each param's dtype and device."""
    g = torch.Generator().manual_seed(seed)
    # bfloat16 values, so that float32 and bfloat16 params step with the same gradients
    return [(torch.randn(p.shape, generator=g) * scale).bfloat16().to(device=p.device, dtype=p.dtype)
            for p in params]


def run(cls, kw, params, steps, seed=1, **lean):
    """An optimizer of ``cls`` over ``params`` after ``steps`` steps on ``grads(params, seed + k)``."""
    opt = cls(params, **kw, **lean)
    for k in range(steps):
        for p, g in zip(params, grads(params, seed + k)):
            p.grad = g
        opt.step()
    return opt
