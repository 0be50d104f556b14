"""Strategies and checks shared by the property-based tests (ops/test_op_properties.py,
ops/test_op_refusals_properties.py, optim/test_optim_properties.py): tensor sizes around the kernels' block and
chunk boundaries, layouts (views), dtype pairs, hyper-parameters at their edges, non-finite values injected
into a tensor, tolerances per dtype, snapshots of every tensor of a call, and each test's share of the example
budget (NOTE [hypothesis profiles] in conftest.py)."""

import math

import torch
from hypothesis import settings
from hypothesis import strategies as st

#: The element counts where the kernels split work: the 8-bit state blocks (64, 128, 256), the AVX2 lanes (8,
#: 16), the CPU kernels' L1 blocks (512 update and EMA, 1024 grad_stats, 2048 batch norm) and work chunks
#: (32768, 65536), the CUDA thread block (512 threads x 4 elements) and chunk (65536).
BOUNDARIES = (8, 16, 64, 128, 256, 512, 1024, 2048, 32768, 65536)
EDGE_SIZES = sorted({0, 1, 2, 3, 7} | {b + d for b in BOUNDARIES[:7] for d in (-1, 0, 1)})
LARGE_SIZES = sorted({b + d for b in BOUNDARIES[8:] for d in (-1, 0, 1)})

#: Tolerances of a float64 reference, by the dtype compared (one step of an update from the same state).
TOL = {torch.float64: dict(rtol=1e-10, atol=1e-12), torch.float32: dict(rtol=1e-5, atol=1e-6),
       torch.float16: dict(rtol=2e-3, atol=2e-3), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}
LOW = (torch.float16, torch.bfloat16)
NONFINITE = (math.inf, -math.inf, math.nan)


def examples(share: float = 1.0) -> settings:
    """This test's budget: ``share`` of the loaded profile's max_examples (at least 2)."""
    return settings(max_examples=max(2, int(settings.default.max_examples * share)))


def sizes(large: bool = True):
    """An element count: an edge of a block or chunk, any small one, or (rarely) a large one at a chunk edge."""
    options = [st.sampled_from(EDGE_SIZES), st.integers(0, 300)]
    return st.one_of(*options, st.sampled_from(LARGE_SIZES)) if large else st.one_of(*options)


@st.composite
def size_lists(draw, max_count=300, max_total=40000, large=True):
    """0 to ``max_count`` element counts summing to at most ``max_total`` (one large count at most)."""
    count = draw(st.one_of(st.integers(0, 4), st.integers(0, max_count)))
    out, total = [], 0
    for _ in range(count):
        n = draw(sizes(large=large and total == 0))
        if total + n > max_total:
            n = draw(st.integers(0, 3))
        out.append(n)
        total += n
    return out


def shaped(n: int, layout: str):
    """A shape for ``n`` elements fitting ``layout`` (channels_last needs 4 dims)."""
    if layout == "channels_last" and n % 6 == 0 and n > 0:
        return (n // 6, 3, 2, 1)
    if layout in ("2d", "transposed") and n % 2 == 0 and n > 0:
        return (2, n // 2)
    return (n,)


def make_tensor(values: torch.Tensor, layout: str) -> torch.Tensor:
    """``values`` (any shape) as a tensor of ``layout`` holding the same values: a contiguous tensor, a
    transposed or channels-last view, an offset view into a larger buffer, a strided slice, or an expanded
    (overlapping) view when the values are all equal."""
    if layout == "transposed" and values.dim() == 2:
        return values.t().contiguous().t()
    if layout == "channels_last" and values.dim() == 4:
        return values.contiguous(memory_format=torch.channels_last)
    if layout == "offset":
        buf = torch.empty(values.numel() + 5, dtype=values.dtype, device=values.device)
        view = buf[5:].view(values.shape)
        view.copy_(values)
        return view
    if layout == "strided":
        buf = torch.empty((*values.shape, 2), dtype=values.dtype, device=values.device)
        view = buf[..., 0]
        view.copy_(values)
        return view
    if layout == "expanded" and values.numel() > 1:
        return values.reshape(-1)[:1].expand(values.shape)
    return values.clone()


def inject(draw, tensors, p: float = 0.3):
    """With probability ``p``, one non-finite value into one element of one of ``tensors`` (floating, non-empty);
    returns whether one was put."""
    live = [t for t in tensors if t.numel() > 0 and t.is_floating_point()]
    if not live or draw(st.integers(0, 99)) >= p * 100:
        return False
    t = live[draw(st.integers(0, len(live) - 1))]
    where = torch.unravel_index(torch.tensor(draw(st.integers(0, t.numel() - 1))), t.shape)
    t[tuple(where)] = draw(st.sampled_from(NONFINITE))
    return True


def snapshot(*groups):
    """Clones of every tensor of the lists/tensors given (None kept)."""
    out = []
    for g in groups:
        for t in (g if isinstance(g, (list, tuple)) else [g]):
            out.append(None if t is None else t.detach().clone())
    return out


def assert_unchanged(before, *groups):
    """Every tensor equals its snapshot, bit for bit (NaN included)."""
    now = snapshot(*groups)
    assert len(now) == len(before)
    for i, (a, b) in enumerate(zip(before, now)):
        if a is None:
            continue
        assert a.dtype == b.dtype and a.shape == b.shape, i
        torch.testing.assert_close(b, a, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"tensor {i} changed: {m}")


def assert_close64(actual: torch.Tensor, expected64: torch.Tensor, what: str = "", scale: float = 1.0,
                   floor: torch.dtype = torch.float64):
    """``actual`` close to the float64 reference at the tolerance of its dtype, or of ``floor`` where that is
    looser (a float32 factor such as the clipping coefficient), times ``scale``."""
    tol = max(TOL[actual.dtype], TOL[floor], key=lambda t: t["rtol"])
    torch.testing.assert_close(actual.detach().to("cpu", torch.float64), expected64.detach().to("cpu", torch.float64),
                               rtol=tol["rtol"] * scale, atol=tol["atol"] * scale, equal_nan=True,
                               msg=lambda m: f"{what}: {m}")
