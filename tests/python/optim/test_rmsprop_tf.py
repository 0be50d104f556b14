"""RMSpropTF (the TensorFlow form of RMSprop, with the semantics of timm's
RMSpropTF) against a plain PyTorch reference written from those semantics,
and against timm's own class when timm is installed: many steps on random
problems in float32 (tight) and float64 (to rounding), bf16 params with
master weights, state dicts, an LR scheduler with clipping and a skipped
non-finite step, argument checks, opcheck, and the Trainer's name."""

import copy

import pytest
import torch

import fusetrain  # noqa: F401  (registers the ops)
from fusetrain.optim import RMSpropTF

from _optim_helpers import OPTIMS
from _test_helpers import (DEVICES, bf16_master_twins, check_bf16_master_follows_float32, kind_step, kind_step_args,
                           step_with_schedule_clip_and_skip)

# The row of the optimizer case table (NOTE [optimizer case table] in _optim_helpers.py).
LR = OPTIMS["RMSpropTF"].lr  # exact in the float32 device lr
CONFIGS = list(OPTIMS["RMSpropTF"].configs)
IDS = [str(kw) for kw in CONFIGS]
Reference = OPTIMS["RMSpropTF"].reference  # timm's RMSpropTF semantics in plain PyTorch ops


def shapes():
    return [(5, 3), (7,), (1,), (130, 9)]


def twins(dtype=torch.float32, device="cpu"):
    torch.manual_seed(3)
    base = [torch.randn(s, dtype=dtype) for s in shapes()]
    return ([b.clone().requires_grad_() for b in base], [b.clone().to(device).requires_grad_() for b in base])


def run(pairs, n, start=0):
    for i in range(n):
        g = torch.Generator().manual_seed(700 + start + i)
        grads = None
        for opt, params in pairs:
            if grads is None:
                grads = [torch.randn(p.shape, dtype=torch.float64, generator=g) for p in params]
            for p, gr in zip(params, grads):
                p.grad = gr.to(p.dtype).to(p.device)
            opt.step()


def assert_close_all(ours, ref, a, b, **tol):
    for p, q in zip(a, b):
        torch.testing.assert_close(q.detach().cpu(), p.detach(), **tol)
        for k, v in ref.state[p].items():
            torch.testing.assert_close(ours.state[q][k].cpu().to(v.dtype), v, **tol, msg=lambda m: f"{k}: {m}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kw", CONFIGS, ids=IDS)
def test_float32_matches_the_reference_over_many_steps(kw, device):
    a, b = twins(device=device)
    ref, ours = Reference(a, lr=LR, **kw), RMSpropTF(b, lr=LR, **kw)
    run([(ref, a), (ours, b)], 30)
    assert_close_all(ours, ref, a, b, rtol=2e-5, atol=2e-6)
    assert set(ours.state[b[0]]) == set(ref.state[a[0]])


@pytest.mark.parametrize("kw", CONFIGS, ids=IDS)
def test_float64_matches_the_reference_to_rounding(kw):
    a, b = twins(torch.float64)
    ref, ours = Reference(a, lr=LR, **kw), RMSpropTF(b, lr=LR, **kw)
    run([(ref, a), (ours, b)], 25)
    assert_close_all(ours, ref, a, b, rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("kw", [CONFIGS[4], CONFIGS[6]], ids=[IDS[4], IDS[6]])
def test_matches_timms_class(kw):
    timm_optim = pytest.importorskip("timm.optim")
    a, b = twins()
    theirs, ours = timm_optim.RMSpropTF(a, lr=LR, **kw), RMSpropTF(b, lr=LR, **kw)
    run([(theirs, a), (ours, b)], 20)
    for p, q in zip(a, b):
        torch.testing.assert_close(q, p, rtol=2e-5, atol=2e-6)


def test_bf16_params_with_master_weights_follow_float32():
    kw = CONFIGS[4]
    base = [torch.randn(s) for s in shapes()]
    ref_p, ours_p = bf16_master_twins(base)
    ref, ours = Reference(ref_p, lr=LR, **kw), RMSpropTF(ours_p, lr=LR, master_weights=True, **kw)
    check_bf16_master_follows_float32(ref, ours, ref_p, ours_p, 12, rtol=2e-5, atol=2e-6)


def test_state_dict_round_trip_continues_alike():
    kw = CONFIGS[4]
    a, b = twins()
    ref, ours = Reference(a, lr=LR, **kw), RMSpropTF(b, lr=LR, **kw)
    run([(ref, a), (ours, b)], 4)
    sd = ours.state_dict()
    assert set(sd["state"][0]) == {"step", "square_avg", "momentum_buffer", "grad_avg"}
    assert {"alpha", "eps", "decoupled_decay", "lr_in_momentum", "centered"} <= sd["param_groups"][0].keys()
    b2 = [q.detach().clone().requires_grad_() for q in b]
    ours2 = RMSpropTF(b2, lr=LR, **kw)
    ours2.load_state_dict(copy.deepcopy(sd))
    run([(ref, a), (ours2, b2)], 6, start=40)
    assert_close_all(ours2, ref, a, b2, rtol=2e-5, atol=2e-6)


def test_lr_scheduler_clipping_and_a_skipped_step():
    kw = CONFIGS[6]
    a, b = twins()
    ref, ours = Reference(a, lr=LR, **kw), RMSpropTF(b, lr=LR, max_grad_norm=0.5, **kw)
    step_with_schedule_clip_and_skip(ref, ours, a, b, bad=float("nan"))
    assert_close_all(ours, ref, a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kw,match", [(dict(lr=-1.0), "lr"), (dict(alpha=-0.5), "alpha"), (dict(eps=-1.0), "eps"),
                                      (dict(momentum=-0.1), "momentum"), (dict(weight_decay=-1.0), "weight_decay")])
def test_argument_checks_name_the_argument(kw, match):
    with pytest.raises(ValueError, match=f"RMSpropTF: {match} must be >= 0"):
        RMSpropTF([torch.zeros(2, requires_grad=True)], **kw)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_tf_style(device):
    def lists():
        return [torch.randn(s, device=device).abs() + 0.1 for s in ((3, 4), (5,))]

    params, grads, s1, s2, s3 = lists(), lists(), lists(), lists(), lists()
    steps = [torch.zeros((), device=device) for _ in params]
    torch.library.opcheck(torch.ops.fusetrain.fused_step_.default,
                          *kind_step_args("rmsprop", params, grads, steps, (s1, s2, s3),
                                          lr=torch.tensor(0.01, device=device), alpha=0.9, eps=1e-10,
                                          weight_decay=0.01, momentum=0.9, centered=True, tf_style=True,
                                          lr_in_momentum=True, decoupled_weight_decay=True, max_grad_norm=1.0,
                                          grad_norm=torch.tensor(2.0, device=device)))


def test_the_tf_flags_need_tf_style():
    p, g, sq = [torch.randn(3)], [torch.randn(3)], [torch.ones(3)]
    with pytest.raises(ValueError, match="lr_in_momentum needs tf_style != 0, got tf_style=0"):
        kind_step("rmsprop", p, g, [torch.zeros(())], (sq,), lr=torch.tensor(0.1), alpha=0.9, eps=1e-8,
                  weight_decay=0.0, momentum=0.0, centered=False, lr_in_momentum=True)


def test_selectable_by_name_in_training_params():
    from fusetrain.training import resolve_training_params
    from fusetrain.training.params import optimizer_class

    p = resolve_training_params({"optimizer": "rmsproptf", "optimizer_params": {"momentum": 0.9, "eps": 1e-3}})
    assert optimizer_class(p.optimizer) is RMSpropTF
