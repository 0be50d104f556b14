"""fusetrain.optim.Lion and the "lion" kind of fusetrain::fused_step_ against a hand-written torch reference.

torch has no Lion, so the reference below writes its math with torch ops,
in float32 on the CPU, in the order the fused kernel uses:

    u = beta1 * m + (1 - beta1) * g
    p *= 1 - lr * weight_decay
    p -= lr * sign(u)
    m = beta2 * m + (1 - beta2) * g

Low-precision params without master weights are compared with the same
reference computed in fp32 from the stored value and rounded to the param
dtype after every step (what the fused kernel is specified to do), so nearly
every element is bit-equal and the rest differ by one ulp.
"""

import copy
import itertools
import math

import pytest
import torch

import fusetrain  # noqa: F401
from fusetrain.optim import Lion

from _optim_helpers import (F32, LOW, STEPS, assert_low_precision_equal, assert_params_close, assert_snapshot_equal,
                            assign, cpu32, f32, make_params, new_grads, ref_copies, round_to, snapshot)
from _test_helpers import CUDA, DEVICES, kind_step, kind_step_args


SEED = 2718  # conftest.py seeds torch with it before each test


class RefLion(torch.optim.Optimizer):
    """Reference Lion: plain torch ops, one tensor at a time (state 'step', 'exp_avg')."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, maximize=False):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay, maximize=maximize))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            lr = f32(group["lr"])  # the fused op reads lr from a float32 tensor
            beta1, beta2 = group["betas"]
            wd = group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad.float()
                if group["maximize"]:
                    g = -g
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                state["step"] += 1
                m = state["exp_avg"]
                u = m * beta1 + g * (1 - beta1)
                if wd != 0:
                    p.mul_(1 - lr * wd)
                p.add_(torch.sign(u), alpha=-lr)
                m.mul_(beta2).add_(g, alpha=1 - beta2)


# ---- helpers ---------------------------------------------------------------------------


def assert_state_close(opt, params, ropt, ref_params, **tol):
    for i, (p, r) in enumerate(zip(params, ref_params)):
        st, rst = opt.state[p], ropt.state[r]
        assert st["step"].dtype == torch.float32 and st["step"].device == p.device and st["step"].dim() == 0
        assert st["step"].item() == rst["step"].item()
        m = st["exp_avg"]
        assert m.dtype == torch.float32 and m.device == p.device
        torch.testing.assert_close(cpu32(m), rst["exp_avg"], **tol, msg=lambda msg: f"exp_avg of param {i}: {msg}")


# ---- optimizer vs reference, fp32 --------------------------------------------------------

GRID = [dict(weight_decay=wd, maximize=mx, betas=b)
        for wd, mx, b in itertools.product([0.0, 0.1], [False, True], [(0.9, 0.99), (0.95, 0.98), (0.5, 0.9)])]


def _hp_id(hp):
    return f"wd{hp['weight_decay']}-max{int(hp['maximize'])}-b{hp['betas'][0]}_{hp['betas'][1]}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("hp", GRID, ids=_hp_id)
def test_matches_reference_fp32(device, hp):
    params = make_params(device)
    ref = ref_copies(params)
    opt = Lion(params, lr=1e-3, **hp)
    ropt = RefLion(ref, lr=1e-3, **hp)
    for step in range(STEPS):
        if step == STEPS // 2:  # as an LR scheduler does
            for g in opt.param_groups + ropt.param_groups:
                g["lr"] = 3e-4
        assign(params, ref, new_grads(params))
        opt.step()
        ropt.step()
        if step % 25 == 0:
            assert_params_close(params, ref, **F32)
    assert_params_close(params, ref, **F32)
    assert_state_close(opt, params, ropt, ref, **F32)


def test_update_is_sign_times_lr():
    # One step from zero state without weight decay: every element moves by exactly lr
    # against the sign of its gradient.
    p = torch.nn.Parameter(torch.randn(1031))
    start = p.detach().clone()
    g = torch.randn(1031)
    p.grad = g.clone()
    lr = 2.0 ** -7  # exact in fp32, and p - lr is exact for |p| < 2
    Lion([p], lr=lr).step()
    expected = start - lr * torch.sign(g)
    mask = start.abs() < 2
    assert torch.equal(p.detach()[mask], expected[mask])


def test_defaults():
    p = [torch.nn.Parameter(torch.randn(3))]
    d = Lion(p).defaults
    assert d["lr"] == 1e-4 and tuple(d["betas"]) == (0.9, 0.99) and d["weight_decay"] == 0.0
    assert d["maximize"] is False and d["max_grad_norm"] is None and d["master_weights"] is False


@pytest.mark.parametrize("device", DEVICES)
def test_small_model_with_defaults_matches_reference(device):
    torch.manual_seed(7)
    model = torch.nn.Sequential(torch.nn.Linear(9, 17), torch.nn.Tanh(), torch.nn.Linear(17, 3)).to(device)
    ref_model = copy.deepcopy(model).cpu()
    opt = Lion(model.parameters())
    ropt = RefLion(ref_model.parameters())
    for _ in range(STEPS):
        x = torch.randn(8, 9)
        y = torch.randn(8, 3)
        for m, o, xx, yy in ((model, opt, x.to(device), y.to(device)), (ref_model, ropt, x, y)):
            o.zero_grad()
            torch.nn.functional.mse_loss(m(xx), yy).backward()
            o.step()
    assert_params_close(list(model.parameters()), list(ref_model.parameters()), **F32)


@pytest.mark.parametrize("device", DEVICES)
def test_non_contiguous_params_and_grads(device):
    # A channels_last weight and a transposed matrix: state follows the param's
    # layout; the gradients arrive in another layout (contiguous, or transposed).
    w = torch.nn.Parameter(torch.randn(4, 3, 5, 5, device=device).to(memory_format=torch.channels_last))
    t = torch.nn.Parameter(torch.randn(7, 5, device=device).t())
    params = [w, t]
    ref = ref_copies(params)
    opt = Lion(params, lr=1e-3, weight_decay=0.1)
    ropt = RefLion(ref, lr=1e-3, weight_decay=0.1)
    for _ in range(STEPS):
        grads = [torch.randn(p.shape, device=device) for p in params]  # contiguous
        grads[1] = torch.randn(5, 7, device=device).t().contiguous().t()  # transposed layout, like t
        assign(params, ref, grads)
        opt.step()
        ropt.step()
    assert params[0].is_contiguous(memory_format=torch.channels_last)
    assert params[1].stride() == (1, 5)
    for p in params:
        for k, v in opt.state[p].items():
            if k != "step":
                assert v.stride() == p.stride(), k
    assert_params_close(params, ref, **F32)


# ---- low precision ---------------------------------------------------------------------------

LOW_HP = [dict(weight_decay=0.1), dict(weight_decay=0.0, maximize=True, betas=(0.5, 0.9))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("hp", LOW_HP, ids=["wd", "max"])
def test_low_precision_params_without_master(device, dtype, hp):
    params = make_params(device, (dtype,))
    ref = ref_copies(params)
    opt = Lion(params, lr=1e-2, **hp)  # large enough to move fp16/bf16 values
    ropt = RefLion(ref, lr=1e-2, **hp)
    for _ in range(STEPS):
        assign(params, ref, new_grads(params))
        opt.step()
        ropt.step()
        round_to(ref, dtype)
    for p in params:
        assert p.dtype == dtype
    assert_low_precision_equal(params, ref, dtype)
    # The fp32 moment does not depend on the params.
    assert_state_close(opt, params, ropt, ref, **F32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("hp", LOW_HP, ids=["wd", "max"])
def test_master_weights(device, dtype, hp):
    # Low-precision and fp32 params in one group: only the former get a master.
    params = make_params(device, (dtype, torch.float32, dtype))
    ref = ref_copies(params)
    opt = Lion(params, lr=1e-3, master_weights=True, **hp)
    ropt = RefLion(ref, lr=1e-3, **hp)
    for step in range(STEPS):
        assign(params, ref, new_grads(params))
        opt.step()
        ropt.step()
        if step % 25 == 0:
            for p in params:
                if p.dtype != torch.float32:
                    assert torch.equal(p.detach(), opt.state[p]["master_param"].to(p.dtype))
    for p, r in zip(params, ref):
        if p.dtype == torch.float32:
            assert "master_param" not in opt.state[p]
            torch.testing.assert_close(cpu32(p), r.detach(), **F32)
        else:
            master = opt.state[p]["master_param"]
            assert master.dtype == torch.float32 and master.device == p.device and master.shape == p.shape
            torch.testing.assert_close(cpu32(master), r.detach(), **F32)
            assert torch.equal(p.detach(), master.to(p.dtype)), "param must be the master rounded to its dtype"
    assert_state_close(opt, params, ropt, ref, **F32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("param_dtype,grad_dtype,master", [
    (torch.float32, torch.bfloat16, False),
    (torch.float32, torch.float16, False),
    (torch.bfloat16, torch.float32, True),
    (torch.float16, torch.bfloat16, True),
], ids=["p32-gbf16", "p32-g16", "pbf16-g32-master", "p16-gbf16-master"])
def test_grad_dtype_differs_from_param(device, param_dtype, grad_dtype, master):
    params = make_params(device, (param_dtype,))
    ref = ref_copies(params)
    hp = dict(lr=1e-3, weight_decay=0.05)
    opt = Lion(params, master_weights=master, **hp)
    ropt = RefLion(ref, **hp)
    for _ in range(STEPS):
        assign(params, ref, new_grads(params, grad_dtype))
        assert params[0].grad.dtype == grad_dtype
        opt.step()
        ropt.step()
    for p, r in zip(params, ref):
        value = opt.state[p]["master_param"] if master else p
        torch.testing.assert_close(cpu32(value), r.detach(), **F32)
        if master:
            assert torch.equal(p.detach(), value.to(p.dtype))
    assert_state_close(opt, params, ropt, ref, **F32)


# ---- clipping, loss-scale tail, skipping -----------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("loss_scale", [None, 1024.0], ids=["plain", "loss-scaled"])
def test_clipping_is_global_over_groups(device, loss_scale):
    params = make_params(device, shapes=[(1,), (7,), (13, 17), (1031,), (3, 5, 7), (65,)])
    ref = ref_copies(params)

    def groups(ps):
        return [{"params": ps[:2]}, {"params": ps[2:4], "lr": 3e-3, "weight_decay": 0.05},
                {"params": ps[4:], "betas": (0.5, 0.9)}]

    max_norm = 2.0
    opt = Lion(groups(params), lr=1e-3, max_grad_norm=max_norm)
    ropt = RefLion(groups(ref), lr=1e-3)
    clipped = 0
    for step in range(STEPS):
        scale = (0.01, 1.0, 10.0)[step % 3]  # total norm ~0.3, ~35, ~350: some steps clip, some do not
        grads = new_grads(params, scale=scale)
        if loss_scale is None:
            assign(params, ref, grads)
            opt.step()
        else:
            # Scaled gradients with the inverse scale in the step: the norm and
            # the clip coefficient are those of the unscaled gradients.
            assign(params, ref, grads)
            assign(params, [None] * len(params), [g * loss_scale for g in grads])
            opt._fused_step(inv_scale=torch.tensor(1.0 / loss_scale, device=device))
        total = torch.nn.utils.clip_grad_norm_(ref, max_norm, foreach=False)
        ropt.step()
        clipped += int(total.item() > max_norm)
        assert opt.last_grad_norm is not None and opt.last_grad_norm.device == params[0].device
        assert opt.last_grad_norm.item() == pytest.approx(total.item(), rel=1e-5)
        assert opt.last_found_inf.item() == 0.0
    assert 0 < clipped < STEPS
    assert_params_close(params, ref, **F32)
    # Clipping shrinks the gradient's weight against the moment, so the moment
    # (which mixes clipped gradients) is compared to fp32 rounding as well.
    assert_state_close(opt, params, ropt, ref, rtol=1e-5, atol=1e-6)


def _skip_setup(device, max_grad_norm):
    params = make_params(device, (torch.float32, torch.bfloat16))
    opt = Lion([{"params": params[:3]}, {"params": params[3:], "lr": 3e-3}], lr=1e-2, weight_decay=0.1,
               master_weights=True, max_grad_norm=max_grad_norm)
    emas = [p.detach().clone() for p in params]
    decay = torch.tensor(0.9, device=device)
    opt.attach_ema(dict(zip(params, emas)), decay)
    return params, opt, emas


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("max_grad_norm", [None, 1.0])
@pytest.mark.parametrize("skip_first", [False, True])
def test_found_inf_skips_step_bit_identically(device, max_grad_norm, skip_first):
    params, opt, emas = _skip_setup(device, max_grad_norm)
    twin_params, twin, twin_emas = _skip_setup(device, max_grad_norm)
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

    for _ in range(0 if skip_first else 3):
        both_step()
    before = snapshot(opt, emas)
    assign(params, [None] * len(params), new_grads(params, scale=100.0))
    inv = torch.tensor(1 / 1024, device=device)
    opt._fused_step(inv_scale=inv, found_inf=torch.ones((), device=device))
    after = snapshot(opt, emas)
    if skip_first:
        # State may be created lazily by the skipped call, but only as fresh state.
        for p in params:
            assert opt.state[p]["step"].item() == 0.0
            assert not opt.state[p]["exp_avg"].any()
            if "master_param" in opt.state[p]:
                assert torch.equal(opt.state[p]["master_param"], p.detach().float())
        after = {k: after[k] for k in before}
    assert_snapshot_equal(before, after)
    assert opt.last_found_inf.item() == 1.0
    # The skipped step left no trace: the next steps equal a twin that never skipped.
    for _ in range(3):
        both_step()
    assert_snapshot_equal(snapshot(twin, twin_emas), snapshot(opt, emas))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("grad_dtype,scale,exact", [
    (torch.float32, 1024.0, True),
    (torch.float16, 256.0, True),
    (torch.bfloat16, 65536.0, True),
    (torch.float32, 1000.0, False),
], ids=["g32-pow2", "g16-pow2", "gbf16-pow2", "g32-1000"])
def test_unscale_equals_plain_step(device, grad_dtype, scale, exact):
    params = make_params(device)
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    hp = dict(lr=1e-3, weight_decay=0.1)
    opt, topt = Lion(params, **hp), Lion(twin, **hp)
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
        for a, b in ((p.detach(), q.detach()), (opt.state[p]["exp_avg"], topt.state[q]["exp_avg"])):
            if exact:  # scaling by a power of two and back is exact
                assert torch.equal(a, b)
            else:
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan], ids=["inf", "-inf", "nan"])
def test_nonfinite_grad_with_clipping_skips(device, value):
    params = make_params(device, (torch.float32, torch.float16))
    opt = Lion(params, lr=1e-2, max_grad_norm=1.0, master_weights=True)
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
    assign(params, [None] * len(params), new_grads(params))
    opt.step()
    assert opt.last_found_inf.item() == 0.0
    assert all(opt.state[p]["step"].item() == 3.0 for p in params)
    assert not torch.equal(before["param 0.3"], params[3].detach())


# ---- EMA ---------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,master", [(torch.float32, False), (torch.bfloat16, True), (torch.bfloat16, False),
                                          (torch.float16, True)], ids=["fp32", "bf16-master", "bf16", "fp16-master"])
def test_ema_rides_the_step(device, dtype, master):
    params = make_params(device, (dtype,))
    ref = ref_copies(params)
    hp = dict(lr=2e-2, weight_decay=0.1)
    opt = Lion(params, master_weights=master, **hp)
    ropt = RefLion(ref, **hp)
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
        assign(params, ref, new_grads(params))
        opt.step()
        ropt.step()
        if dtype != torch.float32 and not master:
            round_to(ref, dtype)
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


# ---- the op on lists ---------------------------------------------------------------------


def run_op_vs_reference(device, param_dtypes, grad_dtypes, shapes, hp, with_master=False):
    """One fused_step_ call (kind "lion") on random lists vs one reference step from the same state."""
    lr = 1e-2
    n = len(shapes)
    params = [torch.randn(s, device=device).to(param_dtypes[i % len(param_dtypes)]) for i, s in enumerate(shapes)]
    grads = [torch.randn(s, device=device).to(grad_dtypes[i % len(grad_dtypes)]) for i, s in enumerate(shapes)]
    steps0 = [int(k) for k in torch.randint(1, 40, (n,))]
    moms0 = [torch.randn(s) * 0.1 for s in shapes]
    mast = {i: p.float() + 1e-3 * torch.randn_like(p.float()) for i, p in enumerate(params)
            if with_master and p.dtype in LOW}  # masters are for float16/bfloat16 params
    masters = [mast[i] for i in sorted(mast)]
    ref = [torch.nn.Parameter(mast.get(i, p).detach().to("cpu", torch.float32).clone()) for i, p in enumerate(params)]
    ropt = RefLion(ref, lr=lr, **hp)
    for i, (r, g) in enumerate(zip(ref, grads)):
        r.grad = g.to("cpu", torch.float32)
        ropt.state[r] = {"step": torch.tensor(float(steps0[i])), "exp_avg": moms0[i].clone()}
    ropt.step()

    moms = [m.clone().to(device) for m in moms0]
    steps = [torch.tensor(float(s), device=device) for s in steps0]
    kind_step("lion", params, grads, steps, (moms,), masters, lr=torch.tensor(lr, device=device), **hp)

    for i, r in enumerate(ref):
        assert steps[i].item() == steps0[i] + 1
        torch.testing.assert_close(cpu32(moms[i]), ropt.state[r]["exp_avg"], **F32)
        if i in mast:
            torch.testing.assert_close(cpu32(mast[i]), r.detach(), **F32)
            assert torch.equal(params[i], mast[i].to(params[i].dtype))
    plain = [i for i in range(n) if i not in mast]
    fp32 = [i for i in plain if params[i].dtype == torch.float32]
    assert_params_close([params[i] for i in fp32], [ref[i] for i in fp32], **F32)
    for dt in LOW:
        idx = [i for i in plain if params[i].dtype == dt]
        if idx:
            assert_low_precision_equal([params[i] for i in idx], [ref[i].detach().to(dt) for i in idx], dt)


OP_HP = [
    dict(betas=(0.9, 0.99), weight_decay=0.0, maximize=False),
    dict(betas=(0.95, 0.98), weight_decay=0.1, maximize=True),
]
OP_IDS = ["plain", "wd-max"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32] + LOW, ids=str)
@pytest.mark.parametrize("n", [1, 7, 1031, 65537])
@pytest.mark.parametrize("hp", OP_HP, ids=OP_IDS)
def test_op_odd_sizes(device, dtype, n, hp):
    run_op_vs_reference(device, [dtype], [dtype], [(n,)], hp)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_master", [False, True])
@pytest.mark.parametrize("hp", OP_HP, ids=OP_IDS)
def test_op_300_tensors_mixed_dtypes(device, with_master, hp):
    sizes = [int(k) for k in torch.randint(1, 200, (300,))]
    sizes[17], sizes[150] = 0, 4099  # an empty tensor and one larger than a block
    shapes = [(s,) if i % 4 else (1, s) for i, s in enumerate(sizes)]
    run_op_vs_reference(device, [torch.float32, torch.float16, torch.bfloat16],
                        [torch.bfloat16, torch.float32, torch.float16, torch.float32], shapes, hp,
                        with_master=with_master)


@pytest.mark.parametrize("device", DEVICES)
def test_op_empty_lists(device):
    lr = torch.tensor(1e-3, device=device)
    kind_step("lion", [], [], [], lr=lr, betas=(0.9, 0.99), weight_decay=0.1,
              inv_scale=torch.tensor(0.5, device=device), found_inf=torch.zeros((), device=device),
              grad_norm=torch.tensor(3.0, device=device), max_grad_norm=1.0, ema_decay=torch.tensor(0.9, device=device))
    assert lr.item() == pytest.approx(1e-3)


@pytest.mark.parametrize("device", DEVICES)
def test_params_without_grad_are_skipped(device):
    params = make_params(device, (torch.float32, torch.bfloat16))
    ref = ref_copies(params)
    frozen = params[1].detach().clone()
    opt = Lion(params, lr=1e-3, master_weights=True)
    ropt = RefLion(ref, lr=1e-3)
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
        if i == 1:
            continue
        value = opt.state[p]["master_param"] if p.dtype != torch.float32 else p
        torch.testing.assert_close(cpu32(value), r.detach(), **F32)


@pytest.mark.parametrize("device", DEVICES)
def test_op_rejects_bad_arguments(device):
    lr = torch.tensor(1e-3, device=device)
    kw = dict(lr=lr, betas=(0.9, 0.99), weight_decay=0.0)
    step = [torch.zeros((), device=device)]
    p = torch.randn(5, device=device)
    m = [torch.zeros(5, device=device)]
    with pytest.raises(RuntimeError, match=r"params\[0\].*(Double|float64)"):
        kind_step("lion", [p.double()], [torch.randn(5, device=device)], step, (m,), **kw)
    with pytest.raises(RuntimeError, match=r"grads\[0\] has shape"):
        kind_step("lion", [p], [torch.randn(6, device=device)], step, (m,), **kw)
    with pytest.raises(ValueError, match="state1 has 0 tensors, fewer than the group records need"):
        kind_step("lion", [p], [torch.randn(5, device=device)], step, **kw)
    with pytest.raises(ValueError, match=r"beta1 must be in \[0, 1\), got 1"):
        kind_step("lion", [p], [torch.randn(5, device=device)], step, (m,), **dict(kw, betas=(1.0, 0.99)))


@CUDA
def test_op_rejects_mismatched_devices():
    p = torch.randn(5, device="cuda")
    with pytest.raises(RuntimeError, match=r"grads\[0\] is on"):
        kind_step("lion", [p], [torch.randn(5)], [torch.zeros((), device="cuda")], ([torch.zeros_like(p)],),
                  lr=torch.tensor(1e-3, device="cuda"), betas=(0.9, 0.99), weight_decay=0.0)


# ---- registration ----------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    op = torch.ops.fusetrain.fused_step_

    def case(param_dtypes, grad_dtype, master, ema, tail):
        shapes = [(3, 4), (7,), (1,)]
        ps = [torch.randn(s, device=device).to(param_dtypes[i % len(param_dtypes)]) for i, s in enumerate(shapes)]
        gs = [torch.randn(s, device=device).to(grad_dtype) for s in shapes]
        moms = [torch.randn(s, device=device) * 0.1 for s in shapes]
        steps = [torch.tensor(3.0, device=device) for _ in shapes]
        masters = [p.float() for p in ps] if master else []
        emas = [p.clone() for p in ps] if ema else []
        if ema:
            tail = dict(tail, ema_decay=torch.tensor(0.99, device=device))
        return kind_step_args("lion", ps, gs, steps, (moms,), masters, emas, lr=torch.tensor(1e-3, device=device),
                              betas=(0.9, 0.99), weight_decay=0.01, **tail)

    full_tail = dict(inv_scale=torch.tensor(0.5, device=device), found_inf=torch.zeros((), device=device),
                     grad_norm=torch.tensor(4.0, device=device), max_grad_norm=1.0)
    cases = [
        case([torch.float32], torch.float32, False, False, {}),
        case([torch.bfloat16, torch.float16], torch.float32, True, True, full_tail),
        case([torch.float32], torch.bfloat16, False, True, dict(found_inf=torch.ones((), device=device))),
        kind_step_args("lion", [], [], [], lr=torch.tensor(1e-3, device=device), betas=(0.9, 0.99), weight_decay=0.0),
    ]
    for args, kwargs in cases:
        torch.library.opcheck(op, args, kwargs)
