"""fusetrain's optimizers against their references, one behaviour per test, run for each row of the optimizer
table (_optim_helpers.OPTIMS) it applies to: Adam, AdamW, SGD (plain, momentum, nesterov, dampening) and
Lion on grids of hyper-parameters, and RMSprop, Adadelta, RAdam and NAdam on the behaviours
test_optim_family.py does not cover.

The reference is torch.optim's for-loop implementation (a hand-written one for Lion, which torch lacks),
always run in float32 on the CPU, or float64 for float64 params. The fused step performs the same element
operations in the same order, so float32 results agree to a few ulps even after 100 steps.

Low-precision params without master weights are compared with a reference that does what the fused kernel
is specified to do: compute the step in float32 from the stored low-precision value and round the result
back to the param dtype after every step. Both sides then round the same float32 numbers, so nearly every
element is bit-equal and the rest differ by one ulp of the param dtype.
"""

import copy
import itertools
import math

import pytest
import torch

import fusetrain  # noqa: F401

from _optim_helpers import (F32, LOW, OPTIMS, STEPS, assert_low_precision_equal, assert_params_close,
                            assert_snapshot_equal, assert_state_close, assign, case_id, cpu32, fused, make_params,
                            new_grads, optimizers, ref_copies, round_to, snapshot)
from _test_helpers import DEVICES

SEED = 1234  # conftest.py seeds torch with it before each test

#: Steps of the comparisons whose point is not the long run (layouts, gradient dtypes, clipping); the float32
#: grid and the low-precision ones run the row's steps.
SHORT = 30
CORE = ["Adam", "AdamW", "SGD", "Lion"]
FAMILY = ["RMSprop", "Adadelta", "RAdam", "NAdam"]


def cases(rows):
    """``(name, overrides)`` rows as pytest params named by both."""
    rows = [(r, None) if isinstance(r, str) else r for r in rows]
    return pytest.mark.parametrize("name,hp", [pytest.param(n, hp, id=case_id(n, hp)) for n, hp in rows])


def run_both(opt, ropt, params, ref, steps, low=None, **grad_kw):
    """``steps`` steps of both optimizers on the same random gradients; ``low``: the reference is rounded to
    that dtype after each step (low-precision params without masters)."""
    for _ in range(steps):
        assign(params, ref, new_grads(params, **grad_kw))
        opt.step()
        ropt.step()
        if low is not None:
            round_to(ref, low)


def assert_masters_follow(opt, params, ref, **tol):
    """Each float16/bfloat16 param has a float32 master close to the reference and is that master rounded;
    a float32 param has none and is itself close to the reference."""
    for p, r in zip(params, ref):
        if p.dtype == torch.float32:
            assert "master_param" not in opt.state[p]
            torch.testing.assert_close(cpu32(p), r.detach(), **tol)
        else:
            master = opt.state[p]["master_param"]
            assert master.dtype == torch.float32 and master.device == p.device and master.shape == p.shape
            torch.testing.assert_close(cpu32(master), r.detach(), **tol)
            assert torch.equal(p.detach(), master.to(p.dtype)), "param must be the master rounded to its dtype"


# ---- float32 and float64 against the reference ----------------------------------------------

ADAM_GRID = [dict(lr=1e-2, eps=1e-8, weight_decay=wd, amsgrad=ams, maximize=mx, betas=b)
             for wd, ams, mx, b in itertools.product([0.0, 0.1], [False, True], [False, True],
                                                     [(0.9, 0.999), (0.5, 0.9)])]
SGD_MOMENTUM = [(0.0, 0.0, False), (0.0, 0.1, False), (0.9, 0.0, False), (0.9, 0.0, True), (0.5, 0.1, False)]
SGD_GRID = [dict(lr=1e-2, momentum=m, dampening=d, nesterov=n, weight_decay=wd, maximize=mx)
            for (m, d, n), wd, mx in itertools.product(SGD_MOMENTUM, [0.0, 0.1], [False, True])]
LION_GRID = [dict(lr=1e-3, weight_decay=wd, maximize=mx, betas=b)
             for wd, mx, b in itertools.product([0.0, 0.1], [False, True], [(0.9, 0.99), (0.95, 0.98), (0.5, 0.9)])]
# (AdamW without weight decay is Adam: its half of the grid is the one with weight decay.)
GRID = ([("Adam", hp) for hp in ADAM_GRID] + [("AdamW", hp) for hp in ADAM_GRID if hp["weight_decay"]]
        + [("SGD", hp) for hp in SGD_GRID] + [("Lion", hp) for hp in LION_GRID])


@pytest.mark.parametrize("device", DEVICES)
@cases(GRID)
def test_float32_matches_reference_over_many_steps(device, name, hp):
    params = make_params(device)
    ref = ref_copies(params)
    opt, ropt = optimizers(name, params, ref, hp)
    for step in range(STEPS):
        if step == STEPS // 2:  # as an LR scheduler does
            for g in opt.param_groups + ropt.param_groups:
                g["lr"] = g["lr"] * 0.3
        run_both(opt, ropt, params, ref, 1)
        if step % 25 == 0:
            assert_params_close(params, ref, **F32)
    assert_params_close(params, ref, **F32)
    assert_state_close(opt, params, ropt, ref, STEPS, **F32)


@cases([("Adam", dict(amsgrad=False)), "Adam", ("AdamW", dict(amsgrad=False, betas=(0.8, 0.9))), "SGD",
        ("SGD", dict(momentum=0.0, nesterov=False, maximize=True)), "Lion",
        ("Lion", dict(maximize=True, betas=(0.5, 0.9)))])
def test_float64_matches_reference_to_rounding(name, hp):
    params = make_params("cpu", (torch.float64,))
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt, ropt = optimizers(name, params, ref, dict(hp or {}, lr=2.0**-7))  # lr exact in the float32 device lr
    for _ in range(25):
        grads = new_grads(params)
        for p, r, g in zip(params, ref, grads):
            p.grad, r.grad = g, g.clone()
        opt.step()
        ropt.step()
    for p, r in zip(params, ref):
        assert p.dtype == torch.float64
        torch.testing.assert_close(p, r, rtol=1e-11, atol=1e-12)
    assert_state_close(opt, params, ropt, ref, 25, rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
@cases([("Adam", {}), ("AdamW", {}), ("SGD", dict(lr=0.05)), ("SGD", dict(lr=0.05, momentum=0.9)), ("Lion", {})])
def test_small_model_with_defaults_matches_reference(device, name, hp):
    torch.manual_seed(7)
    model = torch.nn.Sequential(torch.nn.Linear(9, 17), torch.nn.Tanh(), torch.nn.Linear(17, 3)).to(device)
    ref_model = copy.deepcopy(model).cpu()
    opt, ropt = optimizers(name, model.parameters(), ref_model.parameters(), hp, base=False)
    for _ in range(STEPS):
        x = torch.randn(8, 9)
        y = torch.randn(8, 3)
        for m, o, xx, yy in ((model, opt, x.to(device), y.to(device)), (ref_model, ropt, x, y)):
            o.zero_grad()
            torch.nn.functional.mse_loss(m(xx), yy).backward()
            o.step()
    assert_params_close(list(model.parameters()), list(ref_model.parameters()), **F32)


@pytest.mark.parametrize("name", ["Adam", "AdamW", "SGD"] + FAMILY)
def test_defaults_are_torchs(name):
    p = [torch.nn.Parameter(torch.randn(3))]
    ours, theirs = OPTIMS[name].ours(p).defaults, OPTIMS[name].reference(p).defaults
    assert {k: ours.get(k) for k in theirs} == theirs
    assert ours["max_grad_norm"] is None and ours["master_weights"] is False


def test_lion_defaults_and_update_is_sign_times_lr():
    p = torch.nn.Parameter(torch.randn(1031))
    d = OPTIMS["Lion"].ours([p]).defaults
    assert d["lr"] == 1e-4 and tuple(d["betas"]) == (0.9, 0.99) and d["weight_decay"] == 0.0
    assert d["maximize"] is False and d["max_grad_norm"] is None and d["master_weights"] is False
    # One step from zero state without weight decay: every element moves by exactly lr against the sign of
    # its gradient.
    start = p.detach().clone()
    g = torch.randn(1031)
    p.grad = g.clone()
    lr = 2.0 ** -7  # exact in float32, and p - lr is exact for |p| < 2
    OPTIMS["Lion"].ours([p], lr=lr).step()
    mask = start.abs() < 2
    assert torch.equal(p.detach()[mask], (start - lr * torch.sign(g))[mask])


@pytest.mark.parametrize("device", DEVICES)
@cases(CORE + FAMILY)
def test_non_contiguous_params_and_grads(device, name, hp):
    # A channels_last weight and a transposed matrix: state follows the param's layout; the gradients arrive
    # in another layout (contiguous, or transposed).
    w = torch.nn.Parameter(torch.randn(4, 3, 5, 5, device=device).to(memory_format=torch.channels_last))
    t = torch.nn.Parameter(torch.randn(7, 5, device=device).t())
    params = [w, t]
    ref = ref_copies(params)
    opt, ropt = optimizers(name, params, ref, hp)
    for _ in range(SHORT):
        grads = [torch.randn(p.shape, device=device) for p in params]  # contiguous
        grads[1] = torch.randn(5, 7, device=device).t().contiguous().t()  # transposed layout, like t
        assign(params, ref, grads)
        opt.step()
        ropt.step()
    assert params[0].is_contiguous(memory_format=torch.channels_last)
    assert params[1].stride() == (1, 5)
    for p in params:
        for k, v in opt.state[p].items():
            if v.dim() > 0:  # not step, not NAdam's mu_product
                assert v.stride() == p.stride(), k
    assert_params_close(params, ref, **F32)


# ---- low precision ---------------------------------------------------------------------------

LOW_CASES = [("Adam", dict(amsgrad=False)), "Adam", ("AdamW", dict(amsgrad=False)), "AdamW", "SGD",
             ("SGD", dict(momentum=0.0, nesterov=False, weight_decay=0.0)),
             ("SGD", dict(momentum=0.5, dampening=0.1, nesterov=False, maximize=True)), "Lion",
             ("Lion", dict(weight_decay=0.0, maximize=True, betas=(0.5, 0.9)))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", LOW, ids=str)
@cases(LOW_CASES + FAMILY)
def test_low_precision_params_without_master(device, dtype, name, hp):
    params = make_params(device, (dtype,))
    ref = ref_copies(params)
    opt, ropt = optimizers(name, params, ref, hp)
    run_both(opt, ropt, params, ref, OPTIMS[name].steps, low=dtype)
    for p in params:
        assert p.dtype == dtype
    assert_low_precision_equal(params, ref, dtype)
    # The float32 state sees the params only through weight decay.
    assert_state_close(opt, params, ropt, ref, OPTIMS[name].steps, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", LOW, ids=str)
@cases(LOW_CASES)
def test_master_weights(device, dtype, name, hp):
    # Low-precision and float32 params in one group: only the former get a master. (test_optim_family.py
    # compares its rows' masters of bfloat16 params.)
    params = make_params(device, (dtype, torch.float32, dtype))
    ref = ref_copies(params)
    opt, ropt = optimizers(name, params, ref, hp, master_weights=True)
    for step in range(OPTIMS[name].steps):
        run_both(opt, ropt, params, ref, 1)
        if step % 25 == 0:
            for p in params:
                if p.dtype != torch.float32:
                    assert torch.equal(p.detach(), opt.state[p]["master_param"].to(p.dtype))
    assert_masters_follow(opt, params, ref, **F32)
    assert_state_close(opt, params, ropt, ref, OPTIMS[name].steps, **F32)


# (param dtype, grad dtype, master weights); the rows of test_optim_family.py take two of them.
GRAD_DTYPES = {"p32-gbf16": (torch.float32, torch.bfloat16, False), "p32-g16": (torch.float32, torch.float16, False),
               "pbf16-g32-master": (torch.bfloat16, torch.float32, True),
               "p16-gbf16-master": (torch.float16, torch.bfloat16, True)}
GRAD_DTYPE_CASES = ([pytest.param(n, *v, id=f"{n}-{k}") for n in CORE for k, v in GRAD_DTYPES.items()]
                    + [pytest.param(n, *GRAD_DTYPES[k], id=f"{n}-{k}") for n in FAMILY
                       for k in ("p32-gbf16", "pbf16-g32-master")])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name,param_dtype,grad_dtype,master", GRAD_DTYPE_CASES)
def test_grad_dtype_differs_from_param(device, name, param_dtype, grad_dtype, master):
    params = make_params(device, (param_dtype,))
    ref = ref_copies(params)
    opt, ropt = optimizers(name, params, ref, master_weights=master)
    for _ in range(SHORT):
        assign(params, ref, new_grads(params, grad_dtype))
        assert params[0].grad.dtype == grad_dtype
        opt.step()
        ropt.step()
    assert_masters_follow(opt, params, ref, **F32)
    assert_state_close(opt, params, ropt, ref, SHORT, **F32)


# ---- clipping, loss-scale tail, skipping -----------------------------------------------------

#: Row -> the overrides of its second and third param groups: the rows of the clipping test (test_optim_family.py
#: clips its rows' single group). The skip test's second group takes both (or half the lr for another row).
GROUPS = {
    "Adam": ({"lr": 3e-3, "weight_decay": 0.05}, {"amsgrad": False, "betas": (0.8, 0.99)}),
    "AdamW": ({"lr": 3e-3, "weight_decay": 0.05}, {"amsgrad": False, "betas": (0.8, 0.99)}),
    "SGD": ({"lr": 3e-3, "weight_decay": 0.05, "nesterov": False}, {"momentum": 0.0, "nesterov": False}),
    "Lion": ({"lr": 3e-3, "weight_decay": 0.05}, {"betas": (0.5, 0.9)}),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("loss_scale", [None, 1024.0], ids=["plain", "loss-scaled"])
@pytest.mark.parametrize("name", list(GROUPS))
def test_clipping_is_global_over_groups(device, loss_scale, name):
    params = make_params(device, shapes=[(1,), (7,), (13, 17), (1031,), (3, 5, 7), (65,)])
    ref = ref_copies(params)
    second, third = GROUPS[name]

    def groups(ps):
        return [{"params": ps[:2]}, dict(second, params=ps[2:4]), dict(third, params=ps[4:])]

    max_norm = 2.0
    opt, ropt = optimizers(name, groups(params), groups(ref), max_grad_norm=max_norm)
    clipped = 0
    for step in range(SHORT):
        scale = (0.01, 1.0, 10.0)[step % 3]  # total norm ~0.3, ~35, ~350: some steps clip, some do not
        grads = new_grads(params, scale=scale)
        assign(params, ref, grads)
        if loss_scale is None:
            opt.step()
        else:
            # Scaled gradients with the inverse scale in the step: the norm and the clip coefficient are those
            # of the unscaled gradients.
            assign(params, [None] * len(params), [g * loss_scale for g in grads])
            opt._fused_step(inv_scale=torch.tensor(1.0 / loss_scale, device=device))
        total = torch.nn.utils.clip_grad_norm_(ref, max_norm, foreach=False)
        ropt.step()
        clipped += int(total.item() > max_norm)
        assert opt.last_grad_norm is not None and opt.last_grad_norm.device == params[0].device
        assert opt.last_grad_norm.item() == pytest.approx(total.item(), rel=1e-5)
        assert opt.last_found_inf.item() == 0.0
    assert 0 < clipped < SHORT
    assert_params_close(params, ref, **F32)
    # The state mixes clipped gradients (Lion's moment weighs them against its own): to float32 rounding.
    assert_state_close(opt, params, ropt, ref, SHORT, rtol=1e-5, atol=1e-6)


def _skip_setup(device, name, max_grad_norm):
    params = make_params(device, (torch.float32, torch.bfloat16))
    second, third = GROUPS.get(name, ({"lr": OPTIMS[name].hp["lr"] / 2}, {}))
    opt = fused(name, [{"params": params[:3]}, dict(second, **third, params=params[3:])], master_weights=True,
                max_grad_norm=max_grad_norm)
    emas = [p.detach().clone() for p in params]
    opt.attach_ema(dict(zip(params, emas)), torch.tensor(0.9, device=device))
    return params, opt, emas


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("max_grad_norm", [None, 1.0])
@pytest.mark.parametrize("skip_first", [False, True])
@pytest.mark.parametrize("name", CORE + FAMILY)
def test_found_inf_skips_step_bit_identically(device, max_grad_norm, skip_first, name):
    params, opt, emas = _skip_setup(device, name, max_grad_norm)
    twin_params, twin, twin_emas = _skip_setup(device, name, max_grad_norm)
    with torch.no_grad():
        for p, q in zip(params, twin_params):
            q.copy_(p)
        for e, f in zip(emas, twin_emas):
            f.copy_(e)

    def both_step():
        grads = new_grads(params)
        assign(params, [None] * len(params), grads)
        assign(twin_params, [None] * len(params), [g.clone() for g in grads])
        opt.step()
        twin.step()

    # skip_first: the skipped step is the very first one (the next step must still be step 1: bias
    # correction, SGD's first momentum step).
    for _ in range(0 if skip_first else 3):
        both_step()
    assert skip_first or any("master_param" in opt.state[p] for p in params)
    before = snapshot(opt, emas)
    assign(params, [None] * len(params), new_grads(params, scale=100.0))
    opt._fused_step(inv_scale=torch.tensor(1 / 1024, device=device), found_inf=torch.ones((), device=device))
    after = snapshot(opt, emas)
    if skip_first:
        # State may be created lazily by the skipped call, but only as fresh state (torch's initial values).
        for p in params:
            for k, v in opt.state[p].items():
                initial = torch.full_like(v, 1.0 if k == "mu_product" else 0.0)
                assert torch.equal(v, p.detach().float() if k == "master_param" else initial), k
        after = {k: after[k] for k in before}
    assert_snapshot_equal(before, after)
    assert opt.last_found_inf.item() == 1.0
    # The skipped step left no trace: the next steps equal a twin that never skipped.
    for _ in range(3):
        both_step()
    assert_snapshot_equal(snapshot(twin, twin_emas), snapshot(opt, emas))


# (grad dtype, loss scale, whether unscaling is exact); the rows of test_optim_family.py take two of them.
SCALES = {"g32-pow2": (torch.float32, 1024.0, True), "g16-pow2": (torch.float16, 256.0, True),
          "gbf16-pow2": (torch.bfloat16, 65536.0, True), "g32-1000": (torch.float32, 1000.0, False)}
UNSCALE_CASES = ([pytest.param(name, *v, id=f"{name}-{k}") for name in CORE for k, v in SCALES.items()]
                 + [pytest.param(name, *SCALES[k], id=f"{name}-{k}") for name in FAMILY
                    for k in ("g16-pow2", "g32-1000")])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name,grad_dtype,scale,exact", UNSCALE_CASES)
def test_unscale_equals_plain_step(device, name, grad_dtype, scale, exact):
    params = make_params(device)
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt, topt = fused(name, params), fused(name, twin)
    inv = torch.tensor(1.0 / scale, device=device)
    for _ in range(10):
        grads = new_grads(params, grad_dtype)
        assign(twin, [None] * len(params), grads)
        assign(params, [None] * len(params), [(g.float() * scale).to(grad_dtype) for g in grads])
        opt._fused_step(inv_scale=inv)
        topt.step()
        assert opt.last_found_inf.item() == 0.0
        ref_norm = torch.linalg.vector_norm(torch.cat([g.double().reshape(-1) for g in grads])).item()
        assert opt.last_grad_norm.item() == pytest.approx(ref_norm, rel=1e-5)
    for p, q in zip(params, twin):
        assert opt.state[p].keys() == topt.state[q].keys()
        for a, b in [(p.detach(), q.detach())] + [(opt.state[p][k], topt.state[q][k]) for k in opt.state[p]]:
            if exact:  # scaling by a power of two and back is exact
                assert torch.equal(a, b)
            else:
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("name", CORE + FAMILY)
def test_nonfinite_grad_with_clipping_skips(device, value, name):
    params = make_params(device, (torch.float32, torch.float16))
    opt = fused(name, params, max_grad_norm=1.0, master_weights=True)
    for _ in range(2):
        assign(params, [None] * len(params), new_grads(params))
        opt.step()
    before = snapshot(opt)
    grads = new_grads(params)
    grads[3][517] = value
    assign(params, [None] * len(params), grads)
    opt.step()
    assert_snapshot_equal(before, snapshot(opt))
    assert opt.last_found_inf.item() == 1.0
    # A finite step afterwards goes through.
    assign(params, [None] * len(params), new_grads(params))
    opt.step()
    assert opt.last_found_inf.item() == 0.0
    assert all(opt.state[p]["step"].item() == 3.0 for p in params)
    assert not torch.equal(before["param 0.3"], params[3].detach())


# ---- EMA and params without a gradient ---------------------------------------------------------------


# (param dtype, master weights); the rows of test_optim_family.py take bfloat16 params with masters.
EMA_DTYPES = {"fp32": (torch.float32, False), "bf16-master": (torch.bfloat16, True), "bf16": (torch.bfloat16, False),
              "fp16-master": (torch.float16, True)}
EMA_CASES = ([pytest.param(n, hp, *v, id=f"{case_id(n, hp)}-{k}") for n, hp in
              [("Adam", None), ("AdamW", None), ("SGD", dict(lr=5e-2, nesterov=False)), ("Lion", None)]
              for k, v in EMA_DTYPES.items()]
             + [pytest.param(n, None, *EMA_DTYPES["bf16-master"], id=f"{n}-bf16-master") for n in FAMILY])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name,hp,dtype,master", EMA_CASES)
def test_ema_rides_the_step(device, name, hp, dtype, master):
    params = make_params(device, (dtype,))
    ref = ref_copies(params)
    opt, ropt = optimizers(name, params, ref, hp, master_weights=master)
    emas = [(p.detach() + 0.5 * torch.randn_like(p.detach().float()).to(dtype)) for p in params]
    ref_emas = [cpu32(e).clone() for e in emas]
    stale_emas = [cpu32(e).clone() for e in emas]  # what a decay frozen at 0.9 would give
    decay = torch.tensor(0.9, device=device)
    opt.attach_ema(dict(zip(params, emas)), decay)
    for step in range(30):
        if step == 10:
            decay.fill_(0.5)
        if step == 20:
            decay.fill_(0.99)
        run_both(opt, ropt, params, ref, 1, low=dtype if dtype != torch.float32 and not master else None)
        w = 1.0 - decay.cpu()  # float32, as the kernel computes it
        for e, s, r in zip(ref_emas, stale_emas, ref):
            e.lerp_(r.detach(), w)
            s.lerp_(r.detach(), 0.1)
            if dtype != torch.float32:
                e.copy_(e.to(dtype).float())
    if dtype == torch.float32:
        assert_params_close(emas, ref_emas, **F32)
    else:
        for e in emas:
            assert e.dtype == dtype
        assert_low_precision_equal(emas, ref_emas, dtype)
    # The in-place decay changes took effect (a decay read once at attach time would give stale_emas).
    assert max((cpu32(e) - s).abs().max().item() for e, s in zip(emas, stale_emas)) > 1e-2


@pytest.mark.parametrize("device", DEVICES)
@cases([("Adam", dict(weight_decay=0.0)), ("AdamW", dict(weight_decay=0.0)), ("SGD", dict(nesterov=False)),
        ("Lion", dict(lr=1e-3, weight_decay=0.0))] + FAMILY)
def test_params_without_grad_are_skipped(device, name, hp):
    params = make_params(device, (torch.float32, torch.bfloat16))
    ref = ref_copies(params)
    frozen = params[1].detach().clone()
    opt, ropt = optimizers(name, params, ref, hp, master_weights=True)
    for step in range(20):
        grads = new_grads(params)
        grads[1] = None  # never has a gradient
        if step % 2:
            grads[3] = None  # has one every other step
        assign(params, ref, grads)
        opt.step()
        ropt.step()
    assert torch.equal(params[1].detach(), frozen)
    assert len(opt.state[params[1]]) == 0
    assert opt.state[params[3]]["step"].item() == 10.0
    for i, (p, r) in enumerate(zip(params, ref)):
        if i != 1:
            value = opt.state[p]["master_param"] if p.dtype != torch.float32 else p
            torch.testing.assert_close(cpu32(value), r.detach(), **F32)
