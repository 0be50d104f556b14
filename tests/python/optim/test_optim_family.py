"""RMSprop, Adadelta, RAdam and NAdam against torch.optim: many steps on random
problems in float32 (tight) and float64 (to rounding), bf16 params with
master weights, state dicts both ways, LR schedulers, clipping, skipped
non-finite steps, torch's argument checks, and opcheck of their ops."""

import copy

import pytest
import torch

import fusetrain  # noqa: F401  (registers the ops)
from fusetrain.optim import Adadelta, NAdam, RAdam, RMSprop

from _optim_helpers import OPTIMS
from _test_helpers import (DEVICES, bf16_master_twins, check_bf16_master_follows_float32, kind_step, kind_step_args,
                           outcome, step_with_schedule_clip_and_skip)

SEED = 31
FAMILY = ["RMSprop", "Adadelta", "RAdam", "NAdam"]
# The rows of the optimizer case table (NOTE [optimizer case table] in _optim_helpers.py): each row's class,
# reference, configurations and an lr exact in the float32 device lr.
OURS = {n: OPTIMS[n].ours for n in FAMILY}
TORCH = {n: OPTIMS[n].reference for n in FAMILY}
CONFIGS = [(n, kw) for n in FAMILY for kw in OPTIMS[n].configs]
IDS = [f"{n}-{kw}" for n, kw in CONFIGS]
LR = {n: OPTIMS[n].lr for n in FAMILY}


def shapes():
    return [(5, 3), (7,), (1,), (130, 9)]


def twins(dtype=torch.float32, device="cpu"):
    base = [torch.randn(s, dtype=dtype, device=device) for s in shapes()]
    return ([b.clone().requires_grad_() for b in base], [b.clone().requires_grad_() for b in base])


def run(pairs, n, start=0, scale=1.0):
    for i in range(n):
        g = torch.Generator().manual_seed(500 + start + i)
        grads = None
        for opt, params in pairs:
            if grads is None:
                grads = [torch.randn(p.shape, dtype=torch.float64, generator=g) * scale for p in params]
            for p, gr in zip(params, grads):
                p.grad = gr.to(p.dtype).to(p.device)
            opt.step()


def assert_state_close(ours, theirs, a, b, **tol):
    for p, q in zip(a, b):
        for k, v in theirs.state[p].items():
            # (torch's for-loop step keeps `step` on the CPU; fusetrain's lives on the param's device)
            torch.testing.assert_close(ours.state[q][k].to(v.device, v.dtype), v, **tol, msg=lambda m: f"{k}: {m}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name,kw", CONFIGS, ids=IDS)
def test_float32_matches_torch_over_many_steps(name, kw, device):
    a, b = twins(device=device)
    theirs = TORCH[name](a, lr=LR[name], foreach=False, **kw)
    ours = OURS[name](b, lr=LR[name], **kw)
    run([(theirs, a), (ours, b)], 30)
    for p, q in zip(a, b):
        torch.testing.assert_close(q, p, rtol=2e-5, atol=2e-6)
    assert_state_close(ours, theirs, a, b, rtol=2e-5, atol=2e-6)
    assert set(ours.state[b[0]]) == set(theirs.state[a[0]])  # torch's state keys


@pytest.mark.parametrize("device", DEVICES)
def test_nadam_many_tensors_odd_and_empty_sizes(device):
    # More tensors than one CUDA launch holds, empty and odd sizes: each keeps its own step and mu_product.
    gen = torch.Generator().manual_seed(9)
    sizes = [(int(n),) for n in torch.randint(0, 70, (1100,), generator=gen)] + [(0, 3), (3, 5, 7)]
    base = [torch.randn(s, dtype=torch.float64, generator=gen).float() for s in sizes]
    a = [b.clone().requires_grad_() for b in base]
    b = [x.clone().to(device).requires_grad_() for x in base]
    theirs = torch.optim.NAdam(a, lr=LR["NAdam"], weight_decay=0.01, foreach=False)
    ours = NAdam(b, lr=LR["NAdam"], weight_decay=0.01)
    for i in range(4):
        for j, (p, q) in enumerate(zip(a, b)):
            if (i + j) % 3 == 0 and i > 0:  # some params miss a step: their counters fall behind
                p.grad = q.grad = None
                continue
            g = torch.randn(p.shape, generator=gen)
            p.grad, q.grad = g, g.to(device)
        theirs.step()
        ours.step()
    for p, q in zip(a, b):
        torch.testing.assert_close(q.detach().cpu(), p.detach(), rtol=2e-5, atol=2e-6)
        torch.testing.assert_close(ours.state[q]["mu_product"].cpu(), theirs.state[p]["mu_product"])
        assert float(ours.state[q]["step"]) == float(theirs.state[p]["step"])


@pytest.mark.parametrize("name,kw", CONFIGS, ids=IDS)
def test_float64_matches_torch_to_rounding(name, kw):
    a, b = twins(torch.float64)
    theirs = TORCH[name](a, lr=LR[name], foreach=False, **kw)
    ours = OURS[name](b, lr=LR[name], **kw)
    run([(theirs, a), (ours, b)], 25)
    for p, q in zip(a, b):
        torch.testing.assert_close(q, p, rtol=1e-11, atol=1e-12)
    assert_state_close(ours, theirs, a, b, rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("name,kw", [CONFIGS[i] for i in (3, 6, 10, 14)], ids=[IDS[i] for i in (3, 6, 10, 14)])
def test_bf16_params_with_master_weights_follow_float32_torch(name, kw):
    base = [torch.randn(s) for s in shapes()]
    ref, ours_p = bf16_master_twins(base)
    theirs = TORCH[name](ref, lr=LR[name], foreach=False, **kw)
    ours = OURS[name](ours_p, lr=LR[name], master_weights=True, **kw)
    check_bf16_master_follows_float32(theirs, ours, ref, ours_p, 12, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("name,kw", CONFIGS, ids=IDS)
def test_state_dicts_load_both_ways_and_steps_continue_alike(name, kw):
    a, b = twins()
    theirs = TORCH[name](a, lr=LR[name], foreach=False, **kw)
    ours = OURS[name](b, lr=LR[name], **kw)
    run([(theirs, a), (ours, b)], 4)
    own = {"max_grad_norm", "master_weights", "state_dtype", "state_block_size"}
    assert ours.state_dict()["param_groups"][0].keys() - own == theirs.state_dict()["param_groups"][0].keys()
    # Cross-load: torch continues from ours, ours from torch's.
    a2 = [q.detach().clone().requires_grad_() for q in b]
    b2 = [p.detach().clone().requires_grad_() for p in a]
    theirs2 = TORCH[name](a2, lr=LR[name], foreach=False, **kw)
    theirs2.load_state_dict(copy.deepcopy(ours.state_dict()))  # torch's loader may alias the tensors
    ours2 = OURS[name](b2, lr=LR[name], **kw)
    ours2.load_state_dict(copy.deepcopy(theirs.state_dict()))
    run([(theirs2, a2), (ours2, b2), (theirs, a), (ours, b)], 5, start=50)
    for p, q, p2, q2 in zip(a, b, a2, b2):
        torch.testing.assert_close(q2, p, rtol=2e-5, atol=2e-6)
        torch.testing.assert_close(p2, q, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("name", list(OURS))
def test_lr_scheduler_clipping_and_a_skipped_step(name):
    kw = dict(CONFIGS[3][1]) if name == "RMSprop" else {}
    a, b = twins()
    theirs = TORCH[name](a, lr=LR[name], foreach=False, **kw)
    ours = OURS[name](b, lr=LR[name], max_grad_norm=0.5, **kw)
    step_with_schedule_clip_and_skip(theirs, ours, a, b)
    for p, q in zip(a, b):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)


ADADELTA_ARGS = [dict(lr=-1.0), dict(rho=1.5), dict(eps=-1e-6), dict(weight_decay=-0.1), dict(foreach=True)]
RMSPROP_ARGS = [dict(lr=-1.0), dict(alpha=-0.5), dict(momentum=-0.1), dict(eps=-1.0), dict(centered=True)]
RADAM_ARGS = [dict(lr=-1.0), dict(betas=(1.0, 0.9)), dict(eps=-1.0), dict(weight_decay=-1.0), dict(foreach=True)]
NADAM_ARGS = [dict(lr=-1.0), dict(betas=(0.9, 1.0)), dict(eps=-1.0), dict(momentum_decay=-0.1), dict(foreach=True)]
ARG_CASES = ([("Adadelta", kw) for kw in ADADELTA_ARGS] + [("RMSprop", kw) for kw in RMSPROP_ARGS]
             + [("RAdam", kw) for kw in RADAM_ARGS] + [("NAdam", kw) for kw in NADAM_ARGS])


@pytest.mark.parametrize("name,kw", ARG_CASES, ids=[f"{n}-{kw}" for n, kw in ARG_CASES])
def test_argument_checks_are_torchs(name, kw):
    p = [torch.zeros(2, requires_grad=True)]
    assert outcome(lambda: OURS[name](p, **kw)) == outcome(lambda: TORCH[name](p, **kw))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    def lists(*names):
        return [[torch.randn(s, device=device).abs() for s in ((3, 4), (5,))] for _ in names]

    params, grads, s1, s2, s3 = lists("p", "g", "s1", "s2", "s3")
    steps = [torch.zeros((), device=device) for _ in params]
    lr = torch.tensor(0.01, device=device)
    tail = dict(inv_scale=torch.tensor(0.5, device=device), max_grad_norm=1.0,
                grad_norm=torch.tensor(2.0, device=device))
    cases = [
        kind_step_args("rmsprop", params, grads, steps, (s1, s2, s3), lr=lr, alpha=0.9, eps=1e-8, weight_decay=0.01,
                       momentum=0.9, centered=True, **tail),
        kind_step_args("adadelta", params, grads, steps, (s1, s2), lr=lr, rho=0.9, eps=1e-6, weight_decay=0.0,
                       maximize=True, **tail),
        kind_step_args("radam", params, grads, steps, (s1, s2), lr=lr, betas=(0.9, 0.999), eps=1e-8,
                       weight_decay=0.1, decoupled_weight_decay=True, **tail),
        kind_step_args("nadam", params, grads, steps, (s1, s2, [torch.rand((), device=device) for _ in params]),
                       lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, **tail),
    ]
    for args, kwargs in cases:
        torch.library.opcheck(torch.ops.fusetrain.fused_step_.default, args, kwargs)


def test_the_kind_step_is_torchs_step():
    p = [torch.randn(4)]
    g = [torch.randn(4)]
    sq, acc = [torch.zeros(4)], [torch.zeros(4)]
    steps = [torch.zeros(())]
    before = p[0].clone()
    kind_step("adadelta", p, g, steps, (sq, acc), lr=torch.tensor(1.0), rho=0.9, eps=1e-6, weight_decay=0.0)
    ref = torch.optim.Adadelta([before.requires_grad_()], lr=1.0)
    before.grad = g[0].clone()
    ref.step()
    torch.testing.assert_close(p[0], before.detach())
    assert steps[0].item() == 1.0


@pytest.mark.parametrize("cls", [fusetrain.optim.Adam, fusetrain.optim.AdamW])
def test_adam_without_bias_correction_is_the_bertadam_form(cls):
    # p -= lr * m / (sqrt(v) + eps) with no 1 - beta^t corrections, the rest as Adam/AdamW (float64 reference).
    base = [torch.randn(s, dtype=torch.float64) for s in shapes()]
    ours_p = [b.clone().requires_grad_() for b in base]
    ref_p = [b.clone() for b in base]
    lr, b1, b2, eps, wd = 2.0**-7, 0.9, 0.999, 1e-6, 0.01
    ours = cls(ours_p, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, bias_correction=False)
    m = [torch.zeros_like(b) for b in base]
    v = [torch.zeros_like(b) for b in base]
    for i in range(10):
        g = torch.Generator().manual_seed(40 + i)
        for j, p in enumerate(ours_p):
            gr = torch.randn(p.shape, dtype=torch.float64, generator=g)
            p.grad = gr.clone()
            q = ref_p[j]
            if cls is fusetrain.optim.AdamW:
                q.mul_(1 - lr * wd)
            else:
                gr = gr + wd * q
            m[j].mul_(b1).add_(gr, alpha=1 - b1)
            v[j].mul_(b2).addcmul_(gr, gr, value=1 - b2)
            q.sub_(lr * m[j] / (v[j].sqrt() + eps))
        ours.step()
    for p, q in zip(ours_p, ref_p):
        torch.testing.assert_close(p.detach(), q, rtol=1e-10, atol=1e-12)
    with pytest.raises(TypeError, match="bias_correction must be a bool"):
        cls(ours_p, bias_correction="no")


@pytest.mark.parametrize("cls", [NAdam, RAdam, RMSprop, Adadelta, fusetrain.optim.AdamW, fusetrain.optim.SGD])
def test_init_state_is_what_the_first_step_makes_and_changes_no_step(cls):
    torch.manual_seed(0)
    kw = {"momentum": 0.9} if cls in (fusetrain.optim.SGD, RMSprop) else {}
    params = [torch.randn(5, 3), torch.randn(7), torch.randn(0)]
    frozen = torch.randn(2, requires_grad=False)
    a = [p.clone().requires_grad_() for p in params]
    b = [p.clone().requires_grad_() for p in params]
    grads = [torch.randn_like(p) for p in params]
    opt_a, opt_b = cls(a + [frozen], lr=1e-2, **kw), cls(b, lr=1e-2, **kw)
    opt_a.init_state()  # before any step: the state a DCP load reads into
    assert set(opt_a.state) == set(a)
    first = {k: v.clone() for k, v in opt_a.state[a[0]].items()}
    for _ in range(3):
        for ps, opt in ((a, opt_a), (b, opt_b)):
            for p, g in zip(ps, grads):
                p.grad = g.clone()
            opt.step()
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    assert all(float(v) == 0 for k, v in first.items() if k == "step")
    opt_a.init_state()  # existing state is kept
    torch.testing.assert_close(opt_a.state[a[0]]["step"], opt_b.state[b[0]]["step"])
