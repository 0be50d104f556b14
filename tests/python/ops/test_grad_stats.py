"""fusetrain::grad_stats against a float64 reference.

The reference norm is ``torch.linalg.vector_norm`` of all gradients converted
to float64 and concatenated; the kernel accumulates in fp32 (fp64 for float64
gradients; block sums in a wider type), so the relative error is a few fp32 ulps. The non-finite flag
must see every inf/NaN wherever it sits and must not fire on finite values
whose squares overflow fp32.
"""

import math

import pytest
import torch

import fusetrain  # noqa: F401  (registers the ops)
from fusetrain._ops import grad_stats

from _test_helpers import CUDA, DEVICES

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]

# fp32 accumulation of up to ~65k squares: a few fp32 ulps of the norm (measured
# about 1e-7 on CPU; the CUDA reduction order differs).
NORM_RTOL = 1e-6


SEED = 20240611  # conftest.py seeds torch with it before each test


def ref_norm(grads, inv_scale=None) -> float:
    flat = [g.detach().to("cpu", torch.float64).reshape(-1) for g in grads]
    flat = [f for f in flat if f.numel() > 0]
    if not flat:
        return 0.0
    n = torch.linalg.vector_norm(torch.cat(flat)).item()
    if inv_scale is not None:
        n *= float(inv_scale)
    return n


def check_outputs(norm, found_inf, device):
    for t in (norm, found_inf):
        assert isinstance(t, torch.Tensor)
        assert t.dim() == 0
        assert t.dtype == torch.float32
        assert t.device.type == torch.device(device).type


def assert_norm(norm, expected, rtol=NORM_RTOL):
    got = norm.item()
    assert math.isfinite(got), got
    rel_err = abs(got - expected) / max(expected, 1e-30)
    assert got == pytest.approx(expected, rel=rtol, abs=1e-30), f"norm {got} vs {expected} (rel. error {rel_err:.3g})"


def randn(shape, dtype, device, scale=1.0):
    return (torch.randn(shape, device=device) * scale).to(dtype)


# ---- values --------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 7, 1031, 65537])
def test_single_tensor_odd_sizes(device, dtype, n):
    g = randn((n,), dtype, device, scale=3.0)
    before = g.clone()
    norm, found_inf = grad_stats([g])
    check_outputs(norm, found_inf, device)
    assert_norm(norm, ref_norm([g]))
    assert found_inf.item() == 0.0
    assert torch.equal(g, before), "grad_stats must not modify the gradients"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_list_of_odd_shapes(device, dtype):
    shapes = [(1,), (7,), (13, 17), (1031,), (3, 5, 7), (65537,), (2, 1, 3)]
    grads = [randn(s, dtype, device) for s in shapes]
    norm, found_inf = grad_stats(grads)
    check_outputs(norm, found_inf, device)
    assert_norm(norm, ref_norm(grads))
    assert found_inf.item() == 0.0


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_dtypes_in_one_list(device):
    grads = []
    for i, n in enumerate([5, 1031, 1, 4099, 65537, 33, 7, 2048, 513]):
        grads.append(randn((n,), DTYPES[i % 4], device, scale=float(i + 1)))
    norm, found_inf = grad_stats(grads)
    check_outputs(norm, found_inf, device)
    assert_norm(norm, ref_norm(grads))
    assert found_inf.item() == 0.0


@pytest.mark.parametrize("device", DEVICES)
def test_300_tensors(device):
    sizes = torch.randint(1, 300, (300,)).tolist()
    grads = [randn((n,), DTYPES[i % 4], device, scale=0.1 + (i % 11)) for i, n in enumerate(sizes)]
    norm, found_inf = grad_stats(grads)
    check_outputs(norm, found_inf, device)
    assert_norm(norm, ref_norm(grads))
    assert found_inf.item() == 0.0


@pytest.mark.parametrize("device", DEVICES)
def test_empty_tensors_inside_list(device):
    grads = [
        torch.empty(0, device=device),
        randn((7,), torch.float32, device),
        torch.empty(3, 0, device=device, dtype=torch.float16),
        randn((1031,), torch.bfloat16, device),
        torch.empty(0, device=device, dtype=torch.bfloat16),
    ]
    norm, found_inf = grad_stats(grads)
    check_outputs(norm, found_inf, device)
    assert_norm(norm, ref_norm(grads))
    assert found_inf.item() == 0.0

    # Only empty tensors: zero norm, no inf.
    norm, found_inf = grad_stats([torch.empty(0, device=device), torch.empty(2, 0, device=device)])
    check_outputs(norm, found_inf, device)
    assert norm.item() == 0.0 and found_inf.item() == 0.0


@pytest.mark.parametrize("device", DEVICES)
def test_empty_list_with_inv_scale(device):
    inv = torch.tensor(0.25, device=device)
    norm, found_inf = grad_stats([], inv)
    check_outputs(norm, found_inf, device)
    assert norm.item() == 0.0 and found_inf.item() == 0.0


def test_empty_list_without_inv_scale_returns_cpu_zeros():
    norm, found_inf = grad_stats([])
    check_outputs(norm, found_inf, "cpu")
    assert norm.item() == 0.0 and found_inf.item() == 0.0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", [1024.0, 65536.0, 1000.0])
def test_inv_scale(device, dtype, scale):
    # Gradients as a loss scaler produces them: scaled in their own dtype.
    base = [randn((n,), torch.float32, device, scale=1e-3) for n in (1, 7, 1031, 4097)]
    grads = [(b * scale).to(dtype) for b in base]
    inv = torch.tensor(1.0 / scale, dtype=torch.float32, device=device)
    norm, found_inf = grad_stats(grads, inv)
    check_outputs(norm, found_inf, device)
    assert_norm(norm, ref_norm(grads, inv_scale=1.0 / scale))
    assert found_inf.item() == 0.0
    # The unscaled norm is within the dtype's rounding of the norm of the base grads.
    rtol = {torch.float32: 1e-5, torch.float64: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    assert norm.item() == pytest.approx(ref_norm(base), rel=rtol)


# ---- non-finite detection --------------------------------------------------------------


def _nonfinite_case(position, value, device):
    """A list of gradients with one non-finite ``value`` at ``position``."""
    grads = [
        randn((7,), torch.float32, device),
        randn((1031,), torch.float16, device),
        randn((13, 17), torch.bfloat16, device),
        randn((65537,), torch.float32, device),
    ]
    if position == "first":
        grads[0][0] = value
    elif position == "last_of_65537":
        grads[3][-1] = value
    elif position == "fp16":
        grads[1][517] = value
    elif position == "bf16":
        grads[2][12, 16] = value
    elif position == "middle_of_65537":
        grads[3][40000] = value
    else:
        raise AssertionError(position)
    return grads


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("position", ["first", "last_of_65537", "fp16", "bf16", "middle_of_65537"])
@pytest.mark.parametrize("with_inv_scale", [False, True])
def test_detects_nonfinite_anywhere(device, value, position, with_inv_scale):
    grads = _nonfinite_case(position, value, device)
    inv = torch.tensor(0.5, device=device) if with_inv_scale else None
    norm, found_inf = grad_stats(grads, inv)
    check_outputs(norm, found_inf, device)
    assert found_inf.item() == 1.0
    assert not math.isfinite(norm.item())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_nonfinite_in_single_element_tensor(device, dtype):
    for value in (math.inf, -math.inf, math.nan):
        grads = [randn((1031,), torch.float32, device), torch.full((1,), value, dtype=dtype, device=device)]
        _, found_inf = grad_stats(grads)
        assert found_inf.item() == 1.0, (dtype, value)


@pytest.mark.parametrize("device", DEVICES)
def test_large_finite_values_are_not_inf(device):
    # 1e30 ** 2 overflows fp32: the norm may be inf (fp32 accumulation), but the
    # gradients are finite, so found_inf must stay 0.
    grads = [torch.full((1031,), 1e30, device=device), randn((7,), torch.float32, device)]
    grads[0][::2] = -3e38
    _, found_inf = grad_stats(grads)
    assert found_inf.item() == 0.0
    # The largest finite values of each low-precision dtype.
    f16 = torch.full((4097,), torch.finfo(torch.float16).max, dtype=torch.float16, device=device)
    f16[1::2] = -torch.finfo(torch.float16).max
    bf16 = torch.full((33,), torch.finfo(torch.bfloat16).max, dtype=torch.bfloat16, device=device)
    _, found_inf = grad_stats([f16, bf16])
    assert found_inf.item() == 0.0
    # fp16 max squared fits in fp32: that norm is exact to fp32 rounding.
    norm, found_inf = grad_stats([f16])
    assert found_inf.item() == 0.0
    assert_norm(norm, ref_norm([f16]))


# ---- layouts ---------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_non_contiguous_grads(device, dtype):
    transposed = randn((37, 53), dtype, device).t()
    assert not transposed.is_contiguous()
    permuted = randn((3, 5, 7), dtype, device).permute(2, 0, 1)
    strided = randn((3 * 1031,), dtype, device)[::3]  # not dense: read through a copy
    expanded = randn((1, 65), dtype, device).expand(9, 65)  # stride 0: every element counts
    grads = [transposed, permuted, strided, expanded, randn((7,), dtype, device)]
    norm, found_inf = grad_stats(grads)
    check_outputs(norm, found_inf, device)
    assert_norm(norm, ref_norm(grads))
    assert found_inf.item() == 0.0
    # A non-finite value inside a transposed view is found too.
    transposed[40, 3] = math.nan
    _, found_inf = grad_stats(grads)
    assert found_inf.item() == 1.0


# ---- errors ----------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_float64_norm_beyond_float32_range(device):
    # Squares of 1e30 overflow float32, not the float64 accumulation: the
    # norm is finite (it fits float32) and nothing is flagged.
    g = torch.full((4,), 1e30, dtype=torch.float64, device=device)
    norm, found_inf = grad_stats([g, torch.randn(3, dtype=torch.float64, device=device)])
    assert_norm(norm, ref_norm([g, torch.zeros(0)]), rtol=1e-6)
    assert found_inf.item() == 0.0
    g[2] = float("inf")
    assert grad_stats([g])[1].item() == 1.0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,name", [(torch.int64, "Long"), (torch.complex64, "ComplexFloat")])
def test_rejects_unsupported_dtypes(device, dtype, name):
    with pytest.raises(RuntimeError, match=rf"grads\[1\] has dtype {name}; supported: .*float64"):
        grad_stats([torch.randn(3, device=device), torch.ones(4, dtype=dtype, device=device)])


@pytest.mark.parametrize("device", DEVICES)
def test_rejects_bad_inv_scale(device):
    g = [torch.randn(5, device=device)]
    with pytest.raises(RuntimeError, match="inv_scale"):
        grad_stats(g, torch.tensor(0.5, dtype=torch.float64, device=device))
    with pytest.raises(RuntimeError, match="inv_scale"):
        grad_stats(g, torch.ones(2, device=device))


def test_rejects_sparse_grads():
    with pytest.raises(RuntimeError):
        grad_stats([torch.randn(4, 3).to_sparse()])


@CUDA
def test_rejects_mismatched_devices():
    with pytest.raises(RuntimeError, match=r"grads\[1\] is on"):
        grad_stats([torch.randn(3, device="cuda"), torch.randn(3)])
    with pytest.raises(RuntimeError, match=r"grads\[1\] is on"):
        grad_stats([torch.randn(3), torch.randn(3, device="cuda")])
    with pytest.raises(RuntimeError, match="inv_scale"):
        grad_stats([torch.randn(3, device="cuda")], torch.tensor(0.5))


# ---- registration ----------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    op = torch.ops.fusetrain.grad_stats
    cases = [
        (([randn((3, 4), torch.float32, device), randn((7,), torch.float16, device)],), {}),
        (([randn((1031,), torch.bfloat16, device), torch.empty(0, device=device)],),
         {"inv_scale": torch.tensor(0.125, device=device)}),
        (([],), {"inv_scale": torch.tensor(2.0, device=device)}),
        (([],), {}),
    ]
    for args, kwargs in cases:
        torch.library.opcheck(op, args, kwargs)
