"""fusetrain::ema_update_ against a float64 reference.

The op computes ``ema += w * (src - ema)`` with ``w = 1 - decay`` evaluated in
float32 from the float32 decay tensor and the rest of the math in float32. The
reference takes the same float32 ``w`` and does the update in float64; an fp32
result is then within a couple of fp32 ulps of it (whether the kernel fuses the
multiply-add or not), and an fp16/bf16 result is the reference rounded to the
dtype, give or take one ulp of that dtype (a double rounding can land on the
neighbour). A non-zero ``found_inf`` leaves every ema tensor bit-identical.
"""

import pytest
import torch

import fusetrain  # noqa: F401  (registers the ops)
from fusetrain._ops import ema_update_

from _test_helpers import CUDA, DEVICES

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]

# fp32: a couple of ulps of the operands (the ema and w * (src - ema) terms are
# O(1) here). fp16/bf16: one ulp of the dtype, relative.
TOL = {
    torch.float32: dict(rtol=1e-6, atol=1e-6),
    torch.float64: dict(rtol=1e-14, atol=1e-14),
    torch.float16: dict(rtol=torch.finfo(torch.float16).eps, atol=1e-5),
    torch.bfloat16: dict(rtol=torch.finfo(torch.bfloat16).eps, atol=1e-5),
}


SEED = 20240612  # conftest.py seeds torch with it before each test


def randn(shape, dtype, device, scale=1.0):
    return (torch.randn(shape, device=device) * scale).to(dtype)


def ref_update(ema, src, decay):
    """float64 reference with the kernel's float32 weight; returns a float64 tensor."""
    w = (torch.ones((), dtype=torch.float32) - decay.detach().to("cpu", torch.float32).reshape(())).double()
    e = ema.detach().to("cpu", torch.float64)
    s = src.detach().to("cpu", torch.float64)
    return e + w * (s - e)


def assert_matches(got, ref64, dtype):
    assert got.dtype == dtype
    torch.testing.assert_close(got.detach().cpu().double(), ref64.to(dtype).double(), **TOL[dtype])


# ---- values --------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 7, 1031, 65537])
def test_odd_sizes(device, dtype, n):
    ema = randn((n,), dtype, device)
    src = randn((n,), dtype, device, scale=2.0)
    src_before = src.clone()
    decay = torch.tensor(0.973, device=device)
    expected = ref_update(ema, src, decay)
    ema_update_([ema], [src], decay)
    assert_matches(ema, expected, dtype)
    assert torch.equal(src, src_before), "src must not be modified"
    assert decay.item() == pytest.approx(0.973), "decay must not be modified"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_float32_formula_to_operand_rounding(device, dtype):
    # Tighter than the float64 comparison: against the same formula evaluated
    # in float32, the kernel may differ only by whether the multiply-add is
    # fused, i.e. by one rounding of the operands' magnitude (one ulp of the
    # larger of ``ema`` and ``w * (src - ema)``, in the ema's dtype).
    n = 4099
    ema = randn((n,), dtype, device)
    src = randn((n,), dtype, device)
    decay = torch.tensor(0.99, device=device)
    w = torch.tensor(1.0, device=device) - decay
    e32 = ema.float()
    step = w * (src.float() - e32)
    expected = (e32 + step).to(dtype)
    ema_update_([ema], [src], decay)
    diff = (ema.float() - expected.float()).abs()
    bound = torch.finfo(dtype).eps * torch.maximum(e32.abs(), step.abs())
    assert bool((diff <= bound).all()), f"max diff {diff.max().item()} exceeds the operand rounding"
    assert (diff == 0).float().mean().item() > 0.9, "most elements must match the float32 formula exactly"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("decay_value", [0.0, 0.3, 0.5, 0.9, 0.9999, 0.99999994])
def test_decay_values(device, decay_value):
    # Weights >= 0.5 (schedules start with small decays) and tiny weights (decay
    # next to 1) use the same formula.
    ema = randn((513,), torch.float32, device)
    src = randn((513,), torch.float32, device)
    decay = torch.tensor(decay_value, device=device)
    expected = ref_update(ema, src, decay)
    ema_update_([ema], [src], decay)
    assert_matches(ema, expected, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_one_element_decay_of_shape_1(device):
    ema = randn((9,), torch.float32, device)
    src = randn((9,), torch.float32, device)
    decay = torch.tensor([0.8], device=device)
    expected = ref_update(ema, src, decay)
    ema_update_([ema], [src], decay)
    assert_matches(ema, expected, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_repeated_updates_track_reference(device):
    # 100 updates with a fresh src each time: the fp32 EMA stays within a few
    # ulps of a float64 EMA fed the same inputs (errors do not accumulate: each
    # update contracts the previous error by the decay).
    ema = randn((1031,), torch.float32, device)
    ref = ema.detach().cpu().double()
    decay = torch.tensor(0.95, device=device)
    w = float(torch.tensor(1.0) - decay.cpu())
    for _ in range(100):
        src = randn((1031,), torch.float32, device)
        ref = ref + w * (src.cpu().double() - ref)
        ema_update_([ema], [src], decay)
    torch.testing.assert_close(ema.cpu().double(), ref, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_multidim_shapes(device, dtype):
    shapes = [(3, 5), (2, 3, 7), (1, 1), (17, 1, 3), (64, 65)]
    emas = [randn(s, dtype, device) for s in shapes]
    srcs = [randn(s, dtype, device) for s in shapes]
    decay = torch.tensor(0.9, device=device)
    expected = [ref_update(e, s, decay) for e, s in zip(emas, srcs)]
    ema_update_(emas, srcs, decay)
    for e, r in zip(emas, expected):
        assert e.shape == r.shape
        assert_matches(e, r, dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_empty_list(device):
    decay = torch.tensor(0.9, device=device)
    ema_update_([], [], decay)
    ema_update_([], [], decay, torch.zeros((), device=device))
    ema_update_([], [], decay, torch.ones((), device=device))
    assert decay.item() == pytest.approx(0.9)


@pytest.mark.parametrize("device", DEVICES)
def test_zero_size_tensors_in_list(device):
    emas = [randn((0,), torch.float32, device), randn((5,), torch.float32, device),
            randn((3, 0), torch.float16, device)]
    srcs = [randn((0,), torch.float32, device), randn((5,), torch.float32, device),
            randn((3, 0), torch.float16, device)]
    decay = torch.tensor(0.7, device=device)
    expected = ref_update(emas[1], srcs[1], decay)
    ema_update_(emas, srcs, decay)
    assert emas[0].shape == (0,) and emas[2].shape == (3, 0)
    assert_matches(emas[1], expected, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_300_tensors(device):
    sizes = [1 + (i * 37) % 523 for i in range(300)]
    emas = [randn((n,), torch.float32, device) for n in sizes]
    srcs = [randn((n,), torch.float32, device) for n in sizes]
    decay = torch.tensor(0.999, device=device)
    expected = [ref_update(e, s, decay) for e, s in zip(emas, srcs)]
    ema_update_(emas, srcs, decay)
    for e, r in zip(emas, expected):
        assert_matches(e, r, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_dtypes_in_one_list(device):
    dtypes = [DTYPES[i % 3] for i in range(12)]
    sizes = [1, 7, 1031, 33, 65537, 2, 130, 9, 4097, 5, 64, 3]
    emas = [randn((n,), dt, device) for n, dt in zip(sizes, dtypes)]
    srcs = [randn((n,), dt, device, scale=3.0) for n, dt in zip(sizes, dtypes)]
    decay = torch.tensor(0.9, device=device)
    expected = [ref_update(e, s, decay) for e, s in zip(emas, srcs)]
    ema_update_(emas, srcs, decay)
    for e, r, dt in zip(emas, expected, dtypes):
        assert_matches(e, r, dt)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_non_contiguous_src(device, dtype):
    decay = torch.tensor(0.8, device=device)
    base = randn((33, 66), dtype, device)
    cases = [
        base.t(),  # transposed view
        base[:, ::2].t().contiguous().t(),  # dense but column-major
        randn((33, 2, 33), dtype, device)[:, 1, :].t(),  # strided slice, not dense
        randn((1, 33), dtype, device).expand(66, 33),  # stride 0
    ]
    for src in cases:
        assert not src.is_contiguous() or src.stride() != (33, 1)
        ema = randn(src.shape, dtype, device)
        src_before = src.clone()
        expected = ref_update(ema, src, decay)
        ema_update_([ema], [src], decay)
        assert_matches(ema, expected, dtype)
        assert torch.equal(src, src_before)


@pytest.mark.parametrize("device", DEVICES)
def test_non_contiguous_dense_ema(device):
    # A transposed (dense, non-contiguous) ema and a channels_last ema are
    # updated in place with their own layout.
    decay = torch.tensor(0.75, device=device)
    ema_t = randn((17, 9), torch.float32, device).t()
    src_t = randn((9, 17), torch.float32, device)
    ema_cl = randn((2, 3, 5, 7), torch.float16, device).contiguous(memory_format=torch.channels_last)
    src_cl = randn((2, 3, 5, 7), torch.float16, device)
    exp_t, exp_cl = ref_update(ema_t, src_t, decay), ref_update(ema_cl, src_cl, decay)
    ptr_t, ptr_cl = ema_t.data_ptr(), ema_cl.data_ptr()
    ema_update_([ema_t, ema_cl], [src_t, src_cl], decay)
    assert ema_t.data_ptr() == ptr_t and ema_cl.data_ptr() == ptr_cl
    assert ema_cl.is_contiguous(memory_format=torch.channels_last)
    assert_matches(ema_t, exp_t, torch.float32)
    assert_matches(ema_cl, exp_cl, torch.float16)


@pytest.mark.parametrize("device", DEVICES)
def test_inf_and_nan_in_src_propagate(device):
    # No filtering: only found_inf decides whether the update happens.
    ema = randn((8,), torch.float32, device)
    src = randn((8,), torch.float32, device)
    src[2] = float("inf")
    src[5] = float("nan")
    ema_update_([ema], [src], torch.tensor(0.9, device=device))
    assert ema[2].item() == float("inf")
    assert torch.isnan(ema[5]).item()
    assert torch.isfinite(ema[[0, 1, 3, 4, 6, 7]]).all()


# ---- found_inf -----------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("flag", [1.0, 2.0, float("inf"), float("nan")])
def test_found_inf_skips_bit_identical(device, flag):
    dtypes = [torch.float32, torch.float16, torch.bfloat16, torch.float32]
    sizes = [1031, 7, 65537, 1]
    emas = [randn((n,), dt, device) for n, dt in zip(sizes, dtypes)]
    srcs = [randn((n,), dt, device) for n, dt in zip(sizes, dtypes)]
    before = [e.clone() for e in emas]
    found_inf = torch.tensor(flag, device=device)
    ema_update_(emas, srcs, torch.tensor(0.5, device=device), found_inf)
    for e, b in zip(emas, before):
        assert torch.equal(e, b)
    assert found_inf.isnan().item() or found_inf.item() == flag, "found_inf must not be modified"


@pytest.mark.parametrize("device", DEVICES)
def test_found_inf_zero_updates(device):
    ema = randn((1031,), torch.bfloat16, device)
    src = randn((1031,), torch.bfloat16, device)
    decay = torch.tensor(0.6, device=device)
    expected = ref_update(ema, src, decay)
    ema_update_([ema], [src], decay, torch.zeros((), device=device))
    assert_matches(ema, expected, torch.bfloat16)


@pytest.mark.parametrize("device", DEVICES)
def test_found_inf_of_shape_1(device):
    ema = randn((5,), torch.float32, device)
    before = ema.clone()
    ema_update_([ema], [randn((5,), torch.float32, device)], torch.tensor(0.5, device=device),
                torch.ones(1, device=device))
    assert torch.equal(ema, before)


# ---- errors --------------------------------------------------------------------------


def test_rejects_list_length_mismatch():
    with pytest.raises(RuntimeError, match="got 1 ema tensors but 2 src tensors"):
        ema_update_([torch.randn(3)], [torch.randn(3), torch.randn(3)], torch.tensor(0.9))


@pytest.mark.parametrize("ema_dtype,src_dtype", [(torch.float32, torch.float16), (torch.bfloat16, torch.float16),
                                                 (torch.float16, torch.float32)])
def test_rejects_dtype_mismatch(ema_dtype, src_dtype):
    ema = [torch.randn(4), torch.randn(3).to(ema_dtype)]
    src = [torch.randn(4), torch.randn(3).to(src_dtype)]
    before = ema[0].clone()
    with pytest.raises(RuntimeError, match=r"src\[1\] has dtype .* but ema\[1\] has dtype"):
        ema_update_(ema, src, torch.tensor(0.9))
    assert torch.equal(ema[0], before), "a rejected call must not update earlier tensors"


def test_rejects_integer_tensors():
    with pytest.raises(RuntimeError, match=r"ema\[0\] has dtype Long"):
        ema_update_([torch.arange(3)], [torch.arange(3)], torch.tensor(0.9))


@pytest.mark.parametrize("src_shape", [(4,), (4, 3), (1, 12), (3, 4, 1)])
def test_rejects_shape_mismatch(src_shape):
    with pytest.raises(RuntimeError, match=r"src\[0\] has shape .* but ema\[0\] has shape"):
        ema_update_([torch.randn(3, 4)], [torch.randn(src_shape)], torch.tensor(0.9))


def test_rejects_non_dense_ema():
    ema = torch.randn(6, 8)[:, ::2]
    with pytest.raises(RuntimeError, match=r"ema\[0\] must be a dense tensor"):
        ema_update_([ema], [torch.randn(6, 4)], torch.tensor(0.9))


@pytest.mark.parametrize("decay", [torch.tensor(0.9, dtype=torch.float64), torch.tensor(0.9, dtype=torch.float16),
                                   torch.tensor([0.9, 0.8]), torch.empty(0)])
def test_rejects_bad_decay(decay):
    with pytest.raises(RuntimeError, match="decay must be a float32 tensor with one element"):
        ema_update_([torch.randn(3)], [torch.randn(3)], decay)


@pytest.mark.parametrize("found_inf", [torch.tensor(0.0, dtype=torch.float64), torch.tensor(0, dtype=torch.int32),
                                       torch.zeros(2)])
def test_rejects_bad_found_inf(found_inf):
    with pytest.raises(RuntimeError, match="found_inf must be a float32 tensor with one element"):
        ema_update_([torch.randn(3)], [torch.randn(3)], torch.tensor(0.9), found_inf)


@CUDA
def test_rejects_ema_on_other_device():
    with pytest.raises(RuntimeError, match=r"ema\[0\] is on cpu but decay is on cuda"):
        ema_update_([torch.randn(3)], [torch.randn(3, device="cuda")], torch.tensor(0.9, device="cuda"))


@CUDA
def test_rejects_src_on_other_device():
    with pytest.raises(RuntimeError, match=r"src\[1\] is on cpu but decay is on cuda"):
        ema_update_([torch.randn(3, device="cuda"), torch.randn(2, device="cuda")],
                    [torch.randn(3, device="cuda"), torch.randn(2)], torch.tensor(0.9, device="cuda"))


@CUDA
def test_rejects_decay_on_other_device():
    with pytest.raises(RuntimeError, match=r"ema\[0\] is on cuda:0 but decay is on cpu"):
        ema_update_([torch.randn(3, device="cuda")], [torch.randn(3, device="cuda")], torch.tensor(0.9))


@CUDA
def test_rejects_found_inf_on_other_device():
    with pytest.raises(RuntimeError, match="found_inf is on cpu but decay is on cuda"):
        ema_update_([torch.randn(3, device="cuda")], [torch.randn(3, device="cuda")],
                    torch.tensor(0.9, device="cuda"), torch.zeros(()))


# ---- registration --------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    op = torch.ops.fusetrain.ema_update_

    def lists(dtypes, shapes):
        return ([randn(s, dt, device) for s, dt in zip(shapes, dtypes)],
                [randn(s, dt, device) for s, dt in zip(shapes, dtypes)])

    decay = torch.tensor(0.9, device=device)
    e1, s1 = lists([torch.float32, torch.float16, torch.bfloat16], [(3, 4), (7,), (1,)])
    e2, s2 = lists([torch.float32], [(1031,)])
    cases = [
        ((e1, s1, decay), {}),
        ((e2, s2, decay), {"found_inf": torch.zeros((), device=device)}),
        ((e2, s2, decay), {"found_inf": torch.ones((), device=device)}),
        (([], [], decay), {}),
    ]
    for args, kwargs in cases:
        torch.library.opcheck(op, args, kwargs)


def test_compiles_without_graph_break():
    # The fake kernel lets dynamo/inductor trace the op inside a full graph.
    ema = [torch.randn(7), torch.randn(3, 5).half()]
    src = [torch.randn(7), torch.randn(3, 5).half()]
    decay = torch.tensor(0.9)
    expected = [e.clone() for e in ema]
    ema_update_(expected, src, decay)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def fn(e, s, d):
        ema_update_(e, s, d)

    fn(ema, src, decay)
    for got, exp in zip(ema, expected):
        assert torch.equal(got, exp)
