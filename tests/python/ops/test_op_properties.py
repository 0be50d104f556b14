"""Property-based tests (Hypothesis; NOTE [hypothesis profiles] in conftest.py) of the ops of torch.ops.fusetrain
against float64 references in plain PyTorch: fused_step_ for every element-wise kind of the kind table (one
step of torch.optim's for-loop step, or the Lion reference, on float64 copies), grad_stats, update_scale_,
ema_decay_, ema_update_ / ema_step_, gated_copy_ and the batch-norm ops, on generated lists (0 to hundreds of
tensors, sizes at the kernels' block and chunk edges, views), dtype pairs, hyper-parameters at their edges and
non-finite values. Refusals of bad input: test_op_refusal_properties.py."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fusetrain  # noqa: F401
from fusetrain import _ops
from fusetrain.optim._kinds import KINDS

from _optim_helpers import RefLion, decay_reference, f32
from _property_helpers import (LOW, assert_close64, assert_unchanged, examples, inject, make_tensor, shaped,
                               size_lists, snapshot)
from _test_helpers import DEVICES, kind_step_args

REFERENCE = {"adam": torch.optim.Adam, "sgd": torch.optim.SGD, "lion": RefLion, "rmsprop": torch.optim.RMSprop,
             "adadelta": torch.optim.Adadelta, "radam": torch.optim.RAdam, "nadam": torch.optim.NAdam}
ELEMENTWISE = [k for k in KINDS if k in REFERENCE]
UNIT = st.sampled_from([0.0, 0.5, 0.9, 0.999, 1 - 1e-7])  # decay rates, up to just under 1
DECAY = st.sampled_from([0.0, 1e-4, 0.1, 10.0])  # weight decay: none to large
EPS = st.sampled_from([1e-30, 1e-8, 1e-3])  # tiny to large


@st.composite
def hyper(draw, kind):
    """torch's hyper-parameters of ``kind`` at their edges."""
    hp = dict(weight_decay=draw(DECAY), maximize=draw(st.booleans()))
    if kind in ("adam", "radam", "nadam", "lion"):
        hp["betas"] = (draw(UNIT), draw(UNIT))
    if kind in ("adam", "radam", "nadam", "rmsprop", "adadelta"):
        hp["eps"] = draw(EPS)
    if kind in ("adam", "radam", "nadam"):
        hp["decoupled_weight_decay"] = draw(st.booleans())
    if kind == "adam":
        hp["amsgrad"] = draw(st.booleans())
    if kind == "nadam":
        hp["momentum_decay"] = draw(st.sampled_from([0.0, 4e-3, 0.1]))
    if kind == "sgd":
        hp["momentum"] = draw(st.sampled_from([0.0, 0.5, 0.9, 1 - 1e-7]))
        hp["nesterov"] = hp["momentum"] > 0 and draw(st.booleans())
        hp["dampening"] = 0.0 if hp["nesterov"] else draw(st.sampled_from([0.0, 0.5]))
    if kind == "rmsprop":
        hp.update(momentum=draw(st.sampled_from([0.0, 0.9])), centered=draw(st.booleans()))
        # Centered with alpha 0 is the variance of one gradient: 0 up to rounding, an ill-posed comparison.
        hp["alpha"] = draw(st.sampled_from([0.5, 0.9, 0.999]) if hp["centered"] else UNIT)
    if kind == "adadelta":
        hp["rho"] = draw(st.sampled_from([0.0, 0.5, 0.9, 1.0]))
    return hp


def state_names(kind, hp):
    return [(slot, name) for slot, name, when, when_set in KINDS[kind]["state_rules"]
            if when is None or bool(hp.get(when)) == when_set]


def random_state(name, n):
    """A plausible value of torch's state ``name`` (second moments positive, above the squared first ones)."""
    if name == "mu_product":
        return torch.rand(()) * 0.5 + 0.5
    if name in ("exp_avg_sq", "square_avg", "acc_delta", "max_exp_avg_sq"):
        return torch.rand(n) * 0.01 + (2e-2 if name == "max_exp_avg_sq" else 1e-4)
    return torch.randn(n) * (1e-3 if name == "grad_avg" else 0.1)


#: (param dtype, grad dtype) pairs fused_step_ takes: the param's own, float32, or the other 16-bit type.
DTYPE_PAIRS = [(torch.float32, torch.float32), (torch.float32, torch.bfloat16), (torch.float32, torch.float16),
               (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.float16, torch.float16),
               (torch.float16, torch.float32), (torch.float16, torch.bfloat16), (torch.float64, torch.float64)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ELEMENTWISE)
@examples(0.5)
@given(data=st.data())
def test_fused_step_matches_a_float64_step(device, kind, data):
    draw = data.draw
    hp = draw(hyper(kind))
    ns = draw(size_lists(max_count=40, max_total=6000))
    pairs = [draw(st.sampled_from(DTYPE_PAIRS)) for _ in ns]
    layouts = [draw(st.sampled_from(("contiguous", "offset", "strided", "transposed"))) for _ in ns]
    masters_on = draw(st.booleans())
    lr = draw(st.sampled_from([0.0, 1e-3, 0.1]))
    # 0: no clipping; 1e-6: tiny (smaller, the squared gradients of float32 kernels underflow where float64 does not)
    clip = draw(st.sampled_from([0.0, 0.0, 1e-6, 0.5, 1e3]))
    inv_scale = draw(st.sampled_from([None, None, 0.5, 2.0**-10]))
    torch.manual_seed(draw(st.integers(0, 2**16)))
    values = [torch.randn(n, dtype=torch.float64).to(pd) for n, (pd, _) in zip(ns, pairs)]
    params = [make_tensor(v.reshape(shaped(n, lay)).to(device), lay) for v, n, lay in zip(values, ns, layouts)]
    grads = [(torch.randn(n, dtype=torch.float64) * 3).to(gd).reshape(p.shape).to(device)
             for n, (_, gd), p in zip(ns, pairs, params)]
    steps0 = [draw(st.integers(0, 50)) for _ in ns]
    names = state_names(kind, hp)
    # Fresh state (step 0) as the optimizers create it: zeros, NAdam's mu_product 1 (a float32 scalar always).
    state0 = [{name: (random_state(name, n) if s0 else torch.full((n,) if name != "mu_product" else (),
                                                                  float(name == "mu_product")))
               .to(torch.float64 if pd == torch.float64 and name != "mu_product" else torch.float32)
               for _, name in names}
              for n, (pd, _), s0 in zip(ns, pairs, steps0)]
    checked = clip > 0 or inv_scale is not None  # the op looks for non-finite gradients
    injected = checked and inject(draw, grads)
    # A master shares its param's layout (contiguous for a non-dense view).
    master_of = {i: torch.empty_like(p, dtype=torch.float32).copy_(p) for i, p in enumerate(params)
                 if masters_on and p.dtype in LOW}
    masters = [master_of[i] for i in sorted(master_of)]

    # The reference: float64 copies, one torch step (clip_grad_norm_ first when clipping).
    ref = [torch.nn.Parameter(master_of.get(i, p).detach().reshape(-1).to("cpu", torch.float64).clone())
           for i, p in enumerate(params)]
    g64 = [g.reshape(-1).to("cpu", torch.float64) * (1.0 if inv_scale is None else inv_scale) for g in grads]
    norm = torch.linalg.vector_norm(torch.cat(g64)) if g64 else torch.tensor(0.0, dtype=torch.float64)
    if clip > 0:
        coef = min(1.0, clip / (norm.item() + 1e-6))
        g64 = [g * coef for g in g64]
    cls = REFERENCE[kind]
    if ref:  # torch refuses an empty list
        ropt = cls(ref, lr=f32(lr), **hp) if cls is RefLion else cls(ref, lr=f32(lr), foreach=False, **hp)
        for r, g, st0, s0 in zip(ref, g64, state0, steps0):
            r.grad = g
            if s0 > 0:
                ropt.state[r] = dict({k: v.to(torch.float64).clone() for k, v in st0.items()},
                                     step=torch.tensor(float(s0), dtype=torch.float64))
        if not injected:
            ropt.step()

    lists = [[] for _ in range(3)]
    for slot, name in names:
        # Shaped like the param (contiguous for a non-dense view: NOTE [strided params] in fused_update.cpp).
        lists[slot] = [st0[name].to(device) if st0[name].dim() == 0 else
                       torch.empty_like(p, dtype=st0[name].dtype).copy_(st0[name].reshape(p.shape))
                       for st0, p in zip(state0, params)]
    steps = [torch.tensor(float(s), device=device) for s in steps0]
    fields = {k: v for k, v in hp.items() if k != "maximize"}
    norm_out, flag_out = torch.zeros((), device=device), torch.zeros((), device=device)
    before = snapshot(params, *lists, masters, steps)
    args, kw = kind_step_args(kind, params, grads, steps, lists, masters, lr=torch.tensor(lr, device=device),
                              maximize=hp["maximize"], max_grad_norm=clip, **fields)
    kw["inv_scale"] = None if inv_scale is None else torch.tensor(inv_scale, device=device)
    torch.ops.fusetrain.fused_step_(*args, **kw, grad_norm_out=norm_out, found_inf_out=flag_out)

    if injected:  # skipped as a whole, and flagged
        assert flag_out.item() == 1.0
        assert_unchanged(before, params, *lists, masters, steps)
        return
    assert flag_out.item() == 0.0
    if checked and ns:  # (an empty list measures nothing)
        assert_close64(norm_out, norm.float().double(), "grad norm", scale=10)
    # The clipping coefficient and a NAdam/RAdam/Adam bias correction are float32 numbers for every dtype.
    floor = torch.float32
    for i, r in enumerate(ref):
        assert steps[i].item() == steps0[i] + 1
        for slot, name in names:
            assert_close64(lists[slot][i].reshape(-1), ropt.state[r][name].reshape(-1), f"{name} of tensor {i}", floor=floor)
        if i in master_of:
            assert_close64(master_of[i].reshape(-1), r.detach(), f"master of tensor {i}", floor=floor)
            assert torch.equal(params[i], master_of[i].to(params[i].dtype))
        else:  # the reference rounded to the param's dtype (a float16 value past 65504 is inf in both)
            assert_close64(params[i].reshape(-1), r.detach().to(params[i].dtype).double(),
                           f"param {i} ({params[i].dtype})", floor=floor)


@pytest.mark.parametrize("device", DEVICES)
@examples(1.0)
@given(ns=size_lists(), dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64]),
       inv_scale=st.sampled_from([None, 0.5, 2.0**-20]), layout=st.sampled_from(("contiguous", "offset", "strided",
                                                                              "transposed", "expanded")),
       data=st.data())
def test_grad_stats_is_the_float64_norm_and_flag(device, ns, dtype, inv_scale, layout, data):
    grads = [make_tensor((torch.randn(n, dtype=torch.float64) * 4).to(dtype).reshape(shaped(n, layout)).to(device),
                         layout) for n in ns]
    injected = inject(data.draw, grads, p=0.3)
    before = snapshot(grads)
    scale = None if inv_scale is None else torch.tensor(inv_scale, device=device)
    norm, flag = _ops.grad_stats(grads, scale)
    g64 = [g.reshape(-1).to("cpu", torch.float64) for g in grads]
    assert flag.item() == float(injected or not all(torch.isfinite(g).all() for g in g64))
    if not injected:
        expected = torch.linalg.vector_norm(torch.cat(g64)) * (1.0 if inv_scale is None else inv_scale) if g64 \
            else torch.tensor(0.0, dtype=torch.float64)
        assert_close64(norm, expected, "norm", scale=10)
    assert_unchanged(before, grads)


@pytest.mark.parametrize("device", DEVICES)
@examples(1.0)
@given(scale=st.sampled_from([2.0**-126, 1.0, 2.0**16, 2.0**127, 3e38]), tracker=st.integers(0, 10),
       found=st.sampled_from([0.0, 1.0]), growth=st.sampled_from([1.0 + 2**-20, 2.0, 1e10]),
       backoff=st.sampled_from([1e-30, 0.5, 1 - 2**-20]), interval=st.sampled_from([1, 2, 3, 10, 2**31 - 1]))
def test_update_scale_matches_torchs_update(device, scale, tracker, found, growth, backoff, interval):
    """update_scale_ against torch's own GradScaler update (torch._amp_update_scale_), floored at 2**-126."""
    s, t = torch.tensor(scale, device=device), torch.tensor(tracker, dtype=torch.int32, device=device)
    rs, rt = s.clone().cpu(), t.clone().cpu()
    last, skipped = torch.zeros((), device=device), torch.zeros((), device=device)
    _ops.update_scale_(s, t, torch.tensor(found, device=device), growth, backoff, interval, last, skipped)
    torch._amp_update_scale_(rs, rt, torch.tensor(found), growth, backoff, interval)
    expected = max(rs.item(), 2.0**-126)
    assert s.item() == expected or (math.isinf(rs.item()) and s.item() == scale), (s.item(), rs.item())
    assert t.item() == rt.item() or math.isinf(rs.item())
    assert last.item() == found and skipped.item() == found


@pytest.mark.parametrize("device", DEVICES)
@examples(1.0)
@given(step=st.sampled_from([0.0, 1.0, 7.0, 1e4, 1e7]), decay_type=st.sampled_from(["constant", "threshold", "exp"]),
       decay=st.sampled_from([1e-6, 0.5, 0.9999, 1 - 1e-7]), beta=st.sampled_from([1e-6, 15.0, 1e4]),
       total=st.sampled_from([1.0, 1000.0, 1e9]), warmup=st.booleans(),
       gamma=st.sampled_from([1e-6, 1.0, 1e6]), power=st.sampled_from([1e-6, 0.75, 10.0]))
def test_ema_decay_matches_the_schedule(device, step, decay_type, decay, beta, total, warmup, gamma, power):
    out = torch.zeros((), device=device)
    _ops.ema_decay_(out, torch.tensor(step, device=device), torch.tensor(total, device=device), decay_type, decay,
                    beta, warmup, gamma, power)
    expected = decay_reference(step, decay_type, decay, beta, total, warmup, gamma, power)
    assert math.isfinite(out.item()) and 0.0 <= out.item() <= 1.0
    assert out.item() == pytest.approx(expected, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@examples(1.0)
@given(ns=size_lists(max_count=100, max_total=20000), dtype=st.sampled_from([torch.float32, torch.float16,
                                                                            torch.bfloat16, torch.float64]),
       decay=st.sampled_from([0.0, 0.5, 0.9999, 1.0]), flag=st.sampled_from([None, 0.0, 1.0]),
       layout=st.sampled_from(("contiguous", "transposed", "channels_last", "offset")), remainders=st.booleans(),
       with_copies=st.booleans())
def test_ema_step_matches_the_float64_average(device, ns, dtype, decay, flag, layout, remainders, with_copies):
    ema = [make_tensor(torch.randn(n, dtype=torch.float64).to(dtype).reshape(shaped(n, layout)).to(device), layout)
           for n in ns]
    src = [torch.randn(e.shape, dtype=torch.float64).to(dtype).to(device) for e in ema]
    rems = [torch.zeros_like(e, dtype=torch.int16) for e in ema if e.dtype == torch.bfloat16] \
        if remainders and dtype == torch.bfloat16 else []
    copy_dst = [torch.randint(0, 9, (n % 5,), device=device) for n in ns[:3]] if with_copies else []
    copy_src = [torch.randint(10, 19, t.shape, device=device) for t in copy_dst]
    d, step = torch.tensor(decay, device=device), torch.tensor(3.0, device=device)
    before = snapshot(ema, copy_dst, step)
    expected = [e.to("cpu", torch.float64) + (1 - f32(decay)) * (s.to("cpu", torch.float64) - e.to("cpu", torch.float64))
                for e, s in zip(ema, src)]
    found = None if flag is None else torch.tensor(flag, device=device)
    _ops.ema_step_(ema, src, copy_dst, copy_src, d, step, found, rems)
    if flag == 1.0:
        assert_unchanged(before, ema, copy_dst, step)
        return
    assert step.item() == 4.0
    for i, (e, x) in enumerate(zip(ema, expected)):
        assert_close64(e, x, f"ema {i}", scale=1.0)
    assert all(torch.equal(a, b) for a, b in zip(copy_dst, copy_src))


@pytest.mark.parametrize("device", DEVICES)
@examples(1.0)
@given(ns=size_lists(max_count=100, max_total=20000), dtype=st.sampled_from([torch.float32, torch.bfloat16,
                                                                            torch.int64, torch.bool]),
       flag=st.sampled_from([0.0, 1.0, math.nan]), layout=st.sampled_from(("contiguous", "channels_last")))
def test_gated_copy_copies_unless_flagged(device, ns, dtype, flag, layout):
    dst = [make_tensor(torch.zeros(shaped(n, layout), dtype=dtype, device=device), layout) for n in ns]
    src = [make_tensor(torch.randn(d.shape).to(dtype).to(device), layout) for d in dst]
    before = snapshot(dst)
    _ops.gated_copy_(dst, src, torch.tensor(flag, device=device))
    if flag == 0.0:
        assert all(torch.equal(a, b) for a, b in zip(dst, src))
    else:  # any non-zero flag (NaN included) skips
        assert_unchanged(before, dst)


@pytest.mark.parametrize("device", DEVICES)
@examples(1.0)
@given(n=st.integers(0, 5), c=st.integers(1, 9), spatial=st.sampled_from([(), (1,), (7,), (3, 5), (2, 1, 3)]),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]), channels_last=st.booleans(),
       affine=st.booleans(), big=st.booleans())
def test_batch_norm_ops_match_float64(device, n, c, spatial, dtype, channels_last, affine, big):
    if big:
        spatial = (2047,) if not spatial else spatial  # a block edge of the CPU kernels (2048 floats)
    x = (torch.randn(n, c, *spatial, dtype=torch.float64) * 3 + 1).to(dtype).to(device)
    if channels_last and x.dim() == 4:
        x = x.contiguous(memory_format=torch.channels_last)
    dy = torch.randn(x.shape, dtype=torch.float64).to(dtype).to(device)
    x64, dy64 = x.to("cpu", torch.float64), dy.to("cpu", torch.float64)
    dims = [0] + list(range(2, x.dim()))
    count = x64.numel() // c
    cnt, mean, m2 = _ops.bn_stats(x)
    assert cnt.item() == count
    if count == 0:
        return
    mean64 = x64.mean(dims)
    assert_close64(mean, mean64, "mean", scale=10)
    assert_close64(m2, ((x64 - mean64.view(1, c, *[1] * len(spatial))) ** 2).sum(dims), "m2", scale=100)
    shape = (1, c) + (1,) * len(spatial)
    invstd = torch.rand(c, device=device) + 0.5
    w = torch.randn(c, device=device) if affine else None
    b = torch.randn(c, device=device) if affine else None
    y = _ops.bn_elemt(x, mean, invstd, w, b)
    y64 = (x64 - mean.double().cpu().view(shape)) * invstd.double().cpu().view(shape)
    if affine:
        y64 = y64 * w.double().cpu().view(shape) + b.double().cpu().view(shape)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert_close64(y, y64, "bn_elemt", scale=10)
    sum_dy, sum_dy_xmu = _ops.bn_backward_reduce(dy, x, mean)
    xmu = x64 - mean.double().cpu().view(shape)
    assert_close64(sum_dy, dy64.sum(dims), "sum_dy", scale=100)
    assert_close64(sum_dy_xmu, (dy64 * xmu).sum(dims), "sum_dy_xmu", scale=100)
    wt = w if affine else torch.ones(c, device=device)
    dx = _ops.bn_backward_elemt(dy, x, mean, invstd, wt, sum_dy, sum_dy_xmu, torch.tensor(float(count), device=device))
    iv = invstd.double().cpu().view(shape)
    dx64 = iv * wt.double().cpu().view(shape) * (dy64 - sum_dy.double().cpu().view(shape) / count
                                                 - xmu * iv ** 2 * sum_dy_xmu.double().cpu().view(shape) / count)
    assert_close64(dx, dx64, "bn_backward_elemt", scale=10)
