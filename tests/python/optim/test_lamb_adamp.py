"""Lamb and AdamP against timm's classes (the reference for their semantics):
many steps on random problems in float32 (tight) and float64 (to rounding),
every option, AdamP's channel and layer projections actually taken, bf16
params with master weights, state dicts both ways, an LR scheduler with
clipping and a skipped non-finite step, argument checks, opcheck, the C++
front end through fused_step_, and the Trainer's names."""

import copy

import pytest
import torch

import fusetrain  # noqa: F401  (registers the ops)
from fusetrain.optim import AdamP, Lamb

from _optim_helpers import OPTIMS
from _test_helpers import (DEVICES, bf16_master_twins, check_bf16_master_follows_float32, kind_step, kind_step_args,
                           step_with_schedule_clip_and_skip)

timm_optim = pytest.importorskip("timm.optim")

# The rows of the optimizer case table (NOTE [optimizer case table] in _optim_helpers.py): timm's classes are
# the references.
NAMES = ["Lamb", "AdamP"]
LR = OPTIMS["Lamb"].lr  # exact in the float32 device lr
OURS = {n: OPTIMS[n].ours for n in NAMES}
TIMM = {n: OPTIMS[n].reference for n in NAMES}
CONFIGS = [(n, kw) for n in NAMES for kw in OPTIMS[n].configs]
IDS = [f"{n}-{kw}" for n, kw in CONFIGS]


def shapes():
    return [(5, 3), (7,), (1,), (130, 9), (4, 3, 3, 3)]


def twins(dtype=torch.float32, device="cpu"):
    torch.manual_seed(5)
    base = [torch.randn(s, dtype=dtype) for s in shapes()]
    return ([b.clone().requires_grad_() for b in base], [b.clone().to(device).requires_grad_() for b in base])


def run(pairs, n, start=0, grad_fn=None):
    for i in range(n):
        g = torch.Generator().manual_seed(300 + start + i)
        grads = None
        for opt, params in pairs:
            if grads is None:
                grads = [torch.randn(p.shape, dtype=torch.float64, generator=g) for p in params]
                if grad_fn is not None:
                    grads = [grad_fn(p.detach().double(), gr) for p, gr in zip(params, grads)]
            for p, gr in zip(params, grads):
                p.grad = gr.to(p.dtype).to(p.device)
            opt.step()


def assert_close_all(ours, theirs, a, b, **tol):
    for p, q in zip(a, b):
        torch.testing.assert_close(q.detach().cpu(), p.detach(), **tol)
        for k in ("exp_avg", "exp_avg_sq"):
            v = theirs.state[p][k]
            torch.testing.assert_close(ours.state[q][k].cpu().to(v.dtype), v, **tol, msg=lambda m: f"{k}: {m}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name,kw", CONFIGS, ids=IDS)
def test_float32_matches_timm_over_many_steps(name, kw, device):
    a, b = twins(device=device)
    theirs, ours = TIMM[name](a, lr=LR, **kw), OURS[name](b, lr=LR, **kw)
    run([(theirs, a), (ours, b)], 30)
    assert_close_all(ours, theirs, a, b, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("name,kw", CONFIGS, ids=IDS)
def test_float64_matches_timm_to_rounding(name, kw):
    # The clipping coefficient is a float32 device scalar (and timm's has no 1e-6 in the denominator): Lamb's
    # built-in clipping is compared in the float32 test, turned off here.
    kw = dict(kw, max_grad_norm=None) if name == "Lamb" else kw
    a, b = twins(torch.float64)
    theirs, ours = TIMM[name](a, lr=LR, **kw), OURS[name](b, lr=LR, **kw)
    run([(theirs, a), (ours, b)], 25)
    # Lamb's decoupled decay enters the trust ratio through ||w * (1 - lr * wd)|| (one rounding apart).
    assert_close_all(ours, theirs, a, b, rtol=1e-10, atol=1e-12)


def orthogonal_per_row(w, g):
    """g with each row (dim 0) made orthogonal to w's row: AdamP's channel projection applies."""
    w2, g2 = w.reshape(w.shape[0], -1), g.reshape(g.shape[0], -1)
    coef = (w2 * g2).sum(1, keepdim=True) / (w2 * w2).sum(1, keepdim=True)
    return (g2 - coef * w2).reshape(g.shape) if w.dim() > 1 else g


def orthogonal_per_layer(w, g):
    """g made orthogonal to w as a whole but not per row: AdamP's layer projection applies."""
    if w.dim() < 2:
        return g
    g = g + w * torch.linspace(-1, 1, w.shape[0], dtype=w.dtype).reshape((-1,) + (1,) * (w.dim() - 1))
    return g - (w * g).sum() / (w * w).sum() * w


@pytest.mark.parametrize("view", [orthogonal_per_row, orthogonal_per_layer], ids=["channel", "layer"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_adamp_projections_are_taken_and_match_timm(view, dtype):
    a, b = twins(dtype)
    kw = dict(weight_decay=0.1, wd_ratio=0.3)
    theirs, ours = TIMM["AdamP"](a, lr=LR, **kw), AdamP(b, lr=LR, **kw)
    run([(theirs, a), (ours, b)], 15, grad_fn=view)
    tol = dict(rtol=2e-5, atol=2e-6) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-12)
    assert_close_all(ours, theirs, a, b, **tol)
    # The projection changed the result: without it the weights differ.
    a3, _ = twins(dtype)
    plain = TIMM["AdamP"](a3, lr=LR, weight_decay=0.1, wd_ratio=0.3, delta=0.0)
    run([(plain, a3)], 15, grad_fn=view)
    assert not torch.allclose(a3[3], a[3], rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("name,kw", [CONFIGS[0], CONFIGS[12]], ids=[IDS[0], IDS[12]])
def test_empty_params_are_steppable(name, kw):
    # timm's AdamP cannot reshape an empty matrix; ours steps it (nothing to change) beside the others.
    a, b = twins()
    empty = [torch.zeros(0, 4, requires_grad=True), torch.zeros(3, 0, requires_grad=True)]
    theirs, ours = TIMM[name](a, lr=LR, **kw), OURS[name](b + empty, lr=LR, **kw)
    for e in empty:
        e.grad = torch.zeros_like(e)
    run([(theirs, a), (ours, b)], 5)
    assert_close_all(ours, theirs, a, b, rtol=2e-5, atol=2e-6)
    assert all(float(ours.state[e]["step"]) == 5.0 for e in empty)


@pytest.mark.parametrize("name,kw", [CONFIGS[3], CONFIGS[4], CONFIGS[12]], ids=[IDS[3], IDS[4], IDS[12]])
def test_bf16_params_with_master_weights_follow_float32_timm(name, kw):
    base = [torch.randn(s) for s in shapes()]
    ref, ours_p = bf16_master_twins(base)
    theirs, ours = TIMM[name](ref, lr=LR, **kw), OURS[name](ours_p, lr=LR, master_weights=True, **kw)
    check_bf16_master_follows_float32(theirs, ours, ref, ours_p, 12, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("name,kw", [CONFIGS[0], CONFIGS[5], CONFIGS[11]], ids=[IDS[0], IDS[5], IDS[11]])
def test_state_dicts_load_both_ways_and_steps_continue_alike(name, kw):
    a, b = twins()
    theirs, ours = TIMM[name](a, lr=LR, **kw), OURS[name](b, lr=LR, **kw)
    run([(theirs, a), (ours, b)], 4)
    sd = ours.state_dict()
    assert {"exp_avg", "exp_avg_sq"} <= set(sd["state"][0])
    if name == "Lamb":  # timm counts Lamb's steps per group
        assert sd["param_groups"][0]["step"] == 4
    # Cross-load: timm continues from ours, ours from timm's.
    a2 = [q.detach().clone().requires_grad_() for q in b]
    b2 = [p.detach().clone().requires_grad_() for p in a]
    theirs2 = TIMM[name](a2, lr=LR, **kw)
    theirs2.load_state_dict(copy.deepcopy(sd))
    ours2 = OURS[name](b2, lr=LR, **kw)
    ours2.load_state_dict(copy.deepcopy(theirs.state_dict()))
    assert float(ours2.state[b2[0]]["step"]) == 4.0
    run([(theirs2, a2), (ours2, b2), (theirs, a), (ours, b)], 5, start=50)
    for p, q, p2, q2 in zip(a, b, a2, b2):
        torch.testing.assert_close(q2, p, rtol=2e-5, atol=2e-6)
        torch.testing.assert_close(p2, q, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("name", list(OURS))
def test_lr_scheduler_clipping_and_a_skipped_step(name):
    a, b = twins()
    # timm's Lamb clips inside its step (max_grad_norm); AdamP has no clipping of its own.
    kw = dict(max_grad_norm=0.5) if name == "Lamb" else {}
    theirs = TIMM[name](a, lr=LR, weight_decay=0.1, **kw)
    ours = OURS[name](b, lr=LR, weight_decay=0.1, max_grad_norm=0.5)
    step_with_schedule_clip_and_skip(theirs, ours, a, b, clip_ref=name == "AdamP")
    for p, q in zip(a, b):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("clip,inv_scale", [(1e-6, None), (None, 2.0**-16), (1e-6, 2.0**-16)])
def test_adamp_projects_on_the_gradient_the_update_takes(clip, inv_scale):
    """NOTE [adamp projection]: the cosine's eps clamps the gradient's norm, so the projection must see the
    unscaled, clipped gradient, as timm's AdamP does after clip_grad_norm_ (found by
    test_optim_properties.py: with max_grad_norm 1e-6 the projection read the raw gradient and decided
    otherwise, moving the weights by 0.05 where timm moved them by lr-sized steps)."""
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(2, 3, generator=gen)
    a, b = torch.nn.Parameter(base.clone()), torch.nn.Parameter(base.clone())
    theirs = TIMM["AdamP"]([a], lr=2.0**-7, betas=(0.8, 0.9), eps=1e-4, weight_decay=1.0)
    ours = OURS["AdamP"]([b], lr=2.0**-7, betas=(0.8, 0.9), eps=1e-4, weight_decay=1.0, max_grad_norm=clip)
    for _ in range(3):
        g = torch.randn(2, 3, generator=gen) * (1e-6 if clip is None else 1.0)  # a true gradient below eps
        a.grad, b.grad = g.clone(), g / (inv_scale or 1.0)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_([a], clip)
        theirs.step()
        if inv_scale is None:
            ours.step()
        else:
            ours._fused_step(inv_scale=torch.tensor(inv_scale))
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name,kw,match", [
    ("Lamb", dict(lr=-1.0), "lr must be >= 0"), ("Lamb", dict(betas=(1.0, 0.9)), r"betas\[0\] must be in"),
    ("Lamb", dict(eps=-1.0), "eps must be >= 0"), ("Lamb", dict(weight_decay=-0.1), "weight_decay must be >= 0"),
    ("Lamb", dict(max_grad_norm=0.0), "max_grad_norm must be > 0 or None"),
    ("AdamP", dict(delta=-1.0), "delta must be >= 0"), ("AdamP", dict(wd_ratio=-0.5), "wd_ratio must be >= 0"),
    ("AdamP", dict(betas=(0.9, 1.5)), r"betas\[1\] must be in"),
])
def test_argument_checks_name_the_argument(name, kw, match):
    with pytest.raises(ValueError, match=f"{name}: {match}"):
        OURS[name]([torch.zeros(2, requires_grad=True)], **kw)


@pytest.mark.parametrize("name,flag", [("Lamb", "trust_clip"), ("Lamb", "decoupled_decay"), ("AdamP", "nesterov")])
def test_flags_must_be_bools(name, flag):
    # A YAML or CLI string "false" would otherwise turn the option on.
    with pytest.raises(TypeError, match=f"{name}: {flag} must be a bool"):
        OURS[name]([torch.zeros(2, requires_grad=True)], **{flag: "false"})


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    def lists():
        return [torch.randn(s, device=device).abs() + 0.1 for s in ((3, 4), (5,), (2, 3, 2))]

    params, grads, s1, s2 = lists(), lists(), lists(), lists()
    steps = [torch.zeros((), device=device) for _ in params]
    tail = dict(lr=torch.tensor(0.01, device=device), betas=(0.9, 0.999), weight_decay=0.01,
                inv_scale=torch.tensor(0.5, device=device), found_inf=torch.zeros((), device=device),
                max_grad_norm=1.0, grad_norm=torch.tensor(2.0, device=device))
    torch.library.opcheck(torch.ops.fusetrain.fused_step_.default,
                          *kind_step_args("lamb", params, grads, steps, (s1, s2), eps=1e-6, trust_clip=True,
                                          caution=True, decoupled_weight_decay=True, corrected_weight_decay=True,
                                          max_lr=0.02, **tail))
    torch.library.opcheck(torch.ops.fusetrain.fused_step_.default,
                          *kind_step_args("adamp", params, grads, steps, (s1, s2), eps=1e-8, delta=1.0, nesterov=True,
                                          **tail))


def test_the_kinds_check_their_lists_and_fields():
    p, g = [torch.randn(3, 2)], [torch.randn(3, 2)]
    with pytest.raises(ValueError, match="state2 has 0 tensors, fewer than the group records need"):
        kind_step("lamb", p, g, [torch.zeros(())], ([torch.zeros(3, 2)],), lr=torch.tensor(0.1), betas=(0.9, 0.99),
                  eps=1e-6, weight_decay=0.0)
    with pytest.raises(RuntimeError, match=r"exp_avgs\[0\] must be a Float tensor of shape \[3, 2\]"):
        kind_step("adamp", p, g, [torch.zeros(())], ([torch.zeros(2, 3)], [torch.zeros(3, 2)]),
                  lr=torch.tensor(0.1), betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0)
    with pytest.raises(ValueError, match="max_lr must be >= 0, got -1"):
        kind_step("lamb", p, g, [torch.zeros(())], ([torch.zeros(3, 2)], [torch.zeros(3, 2)]), lr=torch.tensor(0.1),
                  betas=(0.9, 0.99), eps=1e-6, weight_decay=0.0, max_lr=-1.0)


@pytest.mark.parametrize("name", ["lamb", "adamp", "nadam"])
def test_selectable_by_name_in_training_params(name):
    from fusetrain.training import resolve_training_params
    from fusetrain.training.params import optimizer_class

    p = resolve_training_params({"optimizer": name})
    assert optimizer_class(p.optimizer) is getattr(fusetrain.optim, {"lamb": "Lamb", "adamp": "AdamP",
                                                                      "nadam": "NAdam"}[name])


def test_the_kind_step_matches_the_class():
    a, b = twins()
    lamb = Lamb(a, lr=LR, max_grad_norm=None)
    run([(lamb, a)], 1)
    m = [torch.zeros_like(p) for p in b]
    v = [torch.zeros_like(p) for p in b]
    steps = [torch.zeros(()) for _ in b]
    for p, q in zip(a, b):
        q.grad = p.grad.clone()
    with torch.no_grad():
        kind_step("lamb", b, [q.grad for q in b], steps, (m, v), lr=torch.tensor(LR), betas=(0.9, 0.999), eps=1e-6,
                  weight_decay=0.01)
    for p, q in zip(a, b):
        torch.testing.assert_close(q, p, rtol=0, atol=0)
    assert all(float(s) == 1.0 for s in steps)
