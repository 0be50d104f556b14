"""fusetrain's batch-norm ops (bn_stats, bn_backward_reduce, bn_elemt,
bn_backward_elemt) against float64 references computed with plain torch ops.

Inputs are random with a non-zero mean per channel (so a naive sum of squares
would lose accuracy), in fp32/fp16/bf16, contiguous and channels-last, for 2-D,
3-D, 4-D and 5-D shapes with odd sizes, N=1 and empty batches. The reference
works on the same rounded inputs in float64, so the tolerance only covers the
kernels' fp32 arithmetic (and, for the element-wise outputs, the rounding to
the input dtype).
"""

import pytest
import torch

import fusetrain  # noqa: F401  (registers the ops)
from fusetrain._ops import bn_backward_elemt, bn_backward_reduce, bn_elemt, bn_stats

from _test_helpers import DEVICES

DTYPES = [torch.float32, torch.float16, torch.bfloat16]

SHAPES = [
    (1, 3, 7, 13),     # N=1, odd C, 7x13
    (5, 7, 1, 1),      # 1x1 spatial
    (4, 6, 7, 13),
    (3, 70, 5, 9),     # more channels than one CPU tile
    (2, 5, 31, 37),    # long rows
    (9, 11),           # (N, C)
    (1, 5),            # (N, C) with N=1: one value per channel, M2 = 0
    (6, 5, 19),        # (N, C, L)
    (2, 3, 4, 5, 6),   # (N, C, D, H, W)
    (4, 1, 2000),      # one channel, several blocks
]


SEED = 20240707  # conftest.py seeds torch with it before each test


def make_input(shape, dtype, device, channels_last=False, mean_scale=3.0):
    c = shape[1]
    offset = (torch.randn(c, dtype=torch.float64) * mean_scale).view(1, c, *([1] * (len(shape) - 2)))
    scale = (torch.rand(c, dtype=torch.float64) + 0.5).view_as(offset)
    x = (torch.randn(shape, dtype=torch.float64) * scale + offset).to(dtype)
    x = x.to(device)
    if channels_last:
        fmt = torch.channels_last if len(shape) == 4 else torch.channels_last_3d
        x = x.contiguous(memory_format=fmt)
    return x


def ref_stats(x):
    xd = x.detach().to("cpu", torch.float64)
    dims = [0] + list(range(2, xd.dim()))
    n = xd.numel() // xd.shape[1] if xd.shape[1] else 0
    if n == 0:
        z = torch.zeros(xd.shape[1], dtype=torch.float64)
        return 0, z, z.clone()
    mean = xd.mean(dims)
    shape = [1, -1] + [1] * (xd.dim() - 2)
    m2 = ((xd - mean.view(shape)) ** 2).sum(dims)
    return n, mean, m2


def bshape(x):
    return [1, -1] + [1] * (x.dim() - 2)


def assert_close_f32(got, ref, rtol=1e-5, atol_scale=1e-6):
    """got (float32 tensor) vs float64 reference; absolute slack relative to the reference's magnitude."""
    ref = ref.to(torch.float64)
    got = got.detach().to("cpu", torch.float64)
    atol = atol_scale * float(ref.abs().max()) if ref.numel() else 0.0
    torch.testing.assert_close(got, ref, rtol=rtol, atol=atol)


def layouts(shape):
    return [False, True] if len(shape) in (4, 5) else [False]


CASES = [(s, cl) for s in SHAPES for cl in layouts(s)]
CASE_IDS = [f"{'x'.join(map(str, s))}{'-cl' if cl else ''}" for s, cl in CASES]


# ---- bn_stats ----------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,channels_last", CASES, ids=CASE_IDS)
def test_bn_stats(device, dtype, shape, channels_last):
    x = make_input(shape, dtype, device, channels_last)
    before = x.clone()
    count, mean, m2 = bn_stats(x)
    n, rmean, rm2 = ref_stats(x)
    assert count.dim() == 0 and count.dtype == torch.float32 and count.device == x.device
    assert mean.shape == (shape[1],) and mean.dtype == torch.float32 and m2.dtype == torch.float32
    assert count.item() == n
    assert_close_f32(mean, rmean, rtol=1e-6, atol_scale=1e-6)
    assert_close_f32(m2, rm2, rtol=1e-5, atol_scale=1e-6)
    assert torch.equal(x, before)


@pytest.mark.parametrize("device", DEVICES)
def test_bn_stats_large_mean_small_spread(device):
    # |mean| / std = 1e4: sums of squares in fp32 would lose every digit of M2.
    x = (torch.randn(8, 4, 33, 17, dtype=torch.float64) * 0.01 + 100.0).float().to(device)
    count, mean, m2 = bn_stats(x)
    _, rmean, rm2 = ref_stats(x)
    assert_close_f32(mean, rmean, rtol=1e-7, atol_scale=0)
    assert_close_f32(m2, rm2, rtol=1e-4, atol_scale=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_bn_stats_many_elements_per_channel(device, dtype):
    # Several work items / blocks per channel in both layouts.
    for cl in (False, True):
        x = make_input((16, 3, 64, 65), dtype, device, channels_last=cl)
        count, mean, m2 = bn_stats(x)
        n, rmean, rm2 = ref_stats(x)
        assert count.item() == n
        assert_close_f32(mean, rmean, rtol=1e-6, atol_scale=1e-6)
        assert_close_f32(m2, rm2, rtol=1e-5, atol_scale=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(0, 5, 3, 3), (0, 4), (3, 4, 0), (0, 3, 2, 2, 2)])
def test_bn_stats_empty_batch(device, dtype, shape):
    x = torch.empty(shape, dtype=dtype, device=device)
    count, mean, m2 = bn_stats(x)
    assert count.item() == 0.0
    assert torch.equal(mean.cpu(), torch.zeros(shape[1])) and torch.equal(m2.cpu(), torch.zeros(shape[1]))


@pytest.mark.parametrize("device", DEVICES)
def test_bn_stats_non_dense_and_permuted_inputs(device):
    base = make_input((6, 5, 9, 8), torch.float32, device)
    cases = [base[:, :, ::2], base.permute(0, 1, 3, 2), base[::2], base.transpose(0, 1).contiguous().transpose(0, 1)]
    for x in cases:
        count, mean, m2 = bn_stats(x)
        n, rmean, rm2 = ref_stats(x)
        assert count.item() == n
        assert_close_f32(mean, rmean)
        assert_close_f32(m2, rm2)


# ---- bn_backward_reduce ---------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,channels_last", CASES, ids=CASE_IDS)
def test_bn_backward_reduce(device, dtype, shape, channels_last):
    x = make_input(shape, dtype, device, channels_last)
    dy = make_input(shape, dtype, device, channels_last, mean_scale=0.5)
    _, mean, _ = bn_stats(x)
    sum_dy, sum_dy_xmu = bn_backward_reduce(dy, x, mean)
    xd, dyd = x.to("cpu", torch.float64), dy.to("cpu", torch.float64)
    dims = [0] + list(range(2, x.dim()))
    rmean = mean.cpu().double().view(bshape(x))
    assert sum_dy.dtype == torch.float32 and sum_dy.shape == (shape[1],)
    # Per-element terms are exact in fp32 products; the slack is the fp32 sum.
    scale = (dyd.abs() * (xd - rmean).abs()).sum(dims)
    assert_close_f32(sum_dy, dyd.sum(dims), rtol=1e-5, atol_scale=1e-5)
    err = (sum_dy_xmu.cpu().double() - (dyd * (xd - rmean)).sum(dims)).abs()
    assert bool((err <= 1e-5 * scale + 1e-6).all()), (err, scale)


@pytest.mark.parametrize("device", DEVICES)
def test_bn_backward_reduce_mixed_layouts_and_empty(device):
    x = make_input((4, 6, 5, 7), torch.float32, device, channels_last=True)
    dy = make_input((4, 6, 5, 7), torch.float32, device)  # contiguous while x is channels_last
    _, mean, _ = bn_stats(x)
    a = bn_backward_reduce(dy, x, mean)
    b = bn_backward_reduce(dy.contiguous(memory_format=torch.channels_last), x, mean)
    torch.testing.assert_close(a[0], b[0], rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(a[1], b[1], rtol=1e-6, atol=1e-5)
    e = torch.empty(0, 6, 5, 7, device=device)
    s1, s2 = bn_backward_reduce(e, e, mean)
    assert torch.equal(s1.cpu(), torch.zeros(6)) and torch.equal(s2.cpu(), torch.zeros(6))


# ---- element-wise ops ---------------------------------------------------------------------------


def elemt_tolerance(dtype):
    # The reference is rounded to dtype once; the kernel's fp32 math may land on
    # the neighbouring value.
    return {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}[dtype]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("affine", ["none", "fp32", "param_dtype"])
@pytest.mark.parametrize("shape,channels_last", CASES, ids=CASE_IDS)
def test_bn_elemt(device, dtype, affine, shape, channels_last):
    c = shape[1]
    x = make_input(shape, dtype, device, channels_last)
    mean = torch.randn(c, device=device)
    invstd = torch.rand(c, device=device) + 0.5
    w = b = None
    if affine != "none":
        wdt = torch.float32 if affine == "fp32" else dtype
        w = torch.randn(c, device=device).to(wdt)
        b = torch.randn(c, device=device).to(wdt)
    y = bn_elemt(x, mean, invstd, w, b)
    assert y.dtype == dtype and y.shape == x.shape and y.stride() == x.stride()
    s = bshape(x)
    ref = (x.cpu().double() - mean.cpu().double().view(s)) * invstd.cpu().double().view(s)
    if w is not None:
        ref = ref * w.cpu().double().view(s) + b.cpu().double().view(s)
    rtol, atol = elemt_tolerance(dtype)
    torch.testing.assert_close(y.cpu().double(), ref.to(dtype).double(), rtol=rtol, atol=atol)


def ref_backward_elemt(dy, x, mean, invstd, w, sum_dy, sum_dy_xmu, count):
    s = bshape(x)
    d = lambda t: t.detach().cpu().double()  # noqa: E731
    a = d(invstd) * (d(w) if w is not None else 1.0)
    n = float(count)
    return a.view(s) * (d(dy) - (d(sum_dy) / n).view(s) - (d(x) - d(mean).view(s)) * (d(invstd) ** 2 * d(sum_dy_xmu)
                                                                                       / n).view(s))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("affine", [False, True])
@pytest.mark.parametrize("shape,channels_last", CASES, ids=CASE_IDS)
def test_bn_backward_elemt(device, dtype, affine, shape, channels_last):
    c = shape[1]
    x = make_input(shape, dtype, device, channels_last)
    dy = make_input(shape, dtype, device, channels_last, mean_scale=0.5)
    mean = torch.randn(c, device=device)
    invstd = torch.rand(c, device=device) + 0.5
    w = torch.randn(c, device=device) if affine else None
    # Global sums over "more ranks" than this one: count larger than the local batch.
    count = torch.tensor(float(x.numel() // c * 3), device=device)
    sum_dy = torch.randn(c, device=device) * 10
    sum_dy_xmu = torch.randn(c, device=device) * 10
    dx = bn_backward_elemt(dy, x, mean, invstd, w, sum_dy, sum_dy_xmu, count)
    assert dx.dtype == dtype and dx.shape == x.shape and dx.stride() == x.stride()
    ref = ref_backward_elemt(dy, x, mean, invstd, w, sum_dy, sum_dy_xmu, count)
    rtol, atol = elemt_tolerance(dtype)
    torch.testing.assert_close(dx.cpu().double(), ref.to(dtype).double(), rtol=rtol, atol=atol * 4)


@pytest.mark.parametrize("device", DEVICES)
def test_elemt_ops_on_empty_and_odd_strides(device):
    c = 5
    mean, invstd = torch.randn(c, device=device), torch.rand(c, device=device) + 0.5
    e = torch.empty(0, c, 3, 3, device=device)
    assert bn_elemt(e, mean, invstd).shape == e.shape
    cnt = torch.tensor(0.0, device=device)
    z = torch.zeros(c, device=device)
    assert bn_backward_elemt(e, e, mean, invstd, None, z, z, cnt).shape == e.shape
    # A dense permutation that is neither layout: output keeps x's strides.
    x = make_input((3, c, 4, 6), torch.float32, device).permute(0, 1, 3, 2)
    y = bn_elemt(x, mean, invstd)
    assert y.stride() == torch.empty_like(x).stride()
    ref = (x.double() - mean.double().view(1, -1, 1, 1)) * invstd.double().view(1, -1, 1, 1)
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)


# ---- batch norm end to end (one process) ---------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("channels_last", [False, True])
def test_ops_compose_to_batch_norm(device, dtype, channels_last):
    # stats -> elemt -> backward reduce -> backward elemt reproduces
    # F.batch_norm's forward and input/weight/bias gradients (float64 reference).
    shape, c, eps = (6, 7, 5, 9), 7, 1e-5
    x = make_input(shape, dtype, device, channels_last)
    dy = make_input(shape, dtype, device, channels_last, mean_scale=0.2)
    w, b = torch.randn(c, device=device), torch.randn(c, device=device)
    count, mean, m2 = bn_stats(x)
    invstd = torch.rsqrt(m2 / count + eps)
    y = bn_elemt(x, mean, invstd, w, b)
    sum_dy, sum_dy_xmu = bn_backward_reduce(dy, x, mean)
    dx = bn_backward_elemt(dy, x, mean, invstd, w, sum_dy, sum_dy_xmu, count)

    xr = x.detach().cpu().double().requires_grad_()
    wr, br = w.cpu().double().requires_grad_(), b.cpu().double().requires_grad_()
    yr = torch.nn.functional.batch_norm(xr, None, None, wr, br, True, 0.0, eps)
    yr.backward(dy.cpu().double())
    rtol, atol = elemt_tolerance(dtype)
    torch.testing.assert_close(y.cpu().double(), yr.detach().to(dtype).double(), rtol=rtol, atol=atol * 2)
    torch.testing.assert_close(dx.cpu().double(), xr.grad.to(dtype).double(), rtol=rtol, atol=atol * 4)
    torch.testing.assert_close((sum_dy_xmu * invstd).cpu().double(), wr.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(sum_dy.cpu().double(), br.grad, rtol=1e-5, atol=1e-4)


# ---- errors ------------------------------------------------------------------------------------------


def test_errors_name_op_and_argument():
    x = torch.randn(4, 3, 5)
    mean, invstd = torch.zeros(3), torch.ones(3)
    with pytest.raises(RuntimeError, match=r"bn_stats: x must have shape \(N, C, \*\)"):
        bn_stats(torch.randn(5))
    with pytest.raises(RuntimeError, match="bn_stats: x has dtype"):
        bn_stats(x.double())
    with pytest.raises(RuntimeError, match=r"bn_elemt: mean must have shape \(3,\)"):
        bn_elemt(x, torch.zeros(4), invstd)
    with pytest.raises(RuntimeError, match="bn_elemt: invstd must be float32"):
        bn_elemt(x, mean, invstd.half())
    with pytest.raises(RuntimeError, match="bn_elemt: weight must have shape"):
        bn_elemt(x, mean, invstd, torch.ones(2))
    with pytest.raises(RuntimeError, match="bn_backward_reduce: dy has shape"):
        bn_backward_reduce(torch.randn(4, 3, 6), x, mean)
    with pytest.raises(RuntimeError, match="bn_backward_reduce: dy has dtype"):
        bn_backward_reduce(x.half(), x, mean)
    with pytest.raises(RuntimeError, match="bn_backward_elemt: count must be a float32 tensor with one element"):
        bn_backward_elemt(x, x, mean, invstd, None, mean, mean, torch.ones(2))


# ---- registration -------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    ops = torch.ops.fusetrain
    for shape, cl, dtype in [((3, 5, 4, 6), False, torch.float32), ((3, 5, 4, 6), True, torch.bfloat16),
                             ((7, 4), False, torch.float16), ((2, 3, 9), False, torch.float32),
                             ((0, 3, 2, 2), False, torch.float32)]:
        c = shape[1]
        x = make_input(shape, dtype, device, cl) if shape[0] else torch.empty(shape, device=device, dtype=dtype)
        dy = torch.randn_like(x)
        mean, invstd = torch.randn(c, device=device), torch.rand(c, device=device) + 0.5
        w, b = torch.randn(c, device=device), torch.randn(c, device=device)
        cnt = torch.tensor(float(max(x.numel() // c, 1)), device=device)
        torch.library.opcheck(ops.bn_stats, (x,))
        torch.library.opcheck(ops.bn_backward_reduce, (dy, x, mean))
        torch.library.opcheck(ops.bn_elemt, (x, mean, invstd, w, b))
        torch.library.opcheck(ops.bn_elemt, (x, mean, invstd))
        torch.library.opcheck(ops.bn_backward_elemt, (dy, x, mean, invstd, w, mean, invstd, cnt))
        torch.library.opcheck(ops.bn_backward_elemt, (dy, x, mean, invstd, None, mean, invstd, cnt))
