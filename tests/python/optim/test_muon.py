"""Muon against torch.optim.Muon (2-D params) and a torch reference for
convolution filters (the filter as out_channels x the rest), AdamW for the
other params against torch.optim.AdamW, all in one optimizer: many steps on
random problems, batched shapes, bf16 params with master weights, state dicts
both ways, an LR scheduler, global clipping over both kinds, a skipped
non-finite step, argument checks, opcheck and the Trainer's name."""

import copy

import pytest
import torch

import fusetrain  # noqa: F401  (registers the ops)
from fusetrain.optim import Muon

from _optim_helpers import OPTIMS
from _test_helpers import DEVICES, bf16_master_twins, check_bf16_master_follows_float32, kind_step, kind_step_args

LR = OPTIMS["Muon"].lr  # exact in the float32 device lr (the row of the optimizer case table)
# The Newton-Schulz iterations run in bfloat16 with torch's operations: on the CPU (one matrix at a time) the
# results are torch's exactly; on CUDA the batched matmuls may round an element of an update (about lr in size)
# differently by a bf16 step (with batched matmuls on the CPU the params differed by ~2.5e-6 after 15 steps).
TOL = dict(rtol=0, atol=2e-5)


def mats(device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    # Two shapes shared by several params (batched), a tall one, a wide one, a single one.
    shapes = [(16, 8), (16, 8), (8, 16), (24, 8), (16, 8), (5, 3), (3, 5), (8, 16)]
    return [torch.randn(s, generator=g).to(device) for s in shapes]


def leaves(base):
    return [b.clone().requires_grad_() for b in base]


def set_grads(groups, step, scale=1.0):
    g = torch.Generator().manual_seed(100 + step)
    grads = None
    for params in groups:
        if grads is None:
            grads = [torch.randn(p.shape, generator=g) * scale for p in params]
        for p, gr in zip(params, grads):
            p.grad = gr.to(p.dtype).to(p.device).reshape(p.shape).clone()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kw", OPTIMS["Muon"].configs, ids=["defaults", "heavy-ball", "match_rms_adamw"])
def test_matrices_match_torch_muon_over_many_steps(kw, device):
    base = mats(device)
    a, b = leaves(base), leaves(base)
    theirs, ours = OPTIMS["Muon"].reference(a, lr=LR, **kw), Muon(b, lr=LR, **kw)
    for step in range(OPTIMS["Muon"].steps):
        set_grads([a, b], step)
        theirs.step()
        ours.step()
    for p, q in zip(a, b):
        torch.testing.assert_close(q, p, **TOL)
        torch.testing.assert_close(ours.state[q]["momentum_buffer"], theirs.state[p]["momentum_buffer"], **TOL)
        if device == "cpu":
            assert torch.equal(q, p)
    assert len(ours.param_groups) == 1 and ours.param_groups[0]["use_muon"] is True


def reference_step(conv_shadow, vec_opt, mat_opt, conv, vec):
    conv_shadow.grad = conv.grad.reshape(conv_shadow.shape)
    mat_opt.step()
    vec_opt.step()


def test_conv_filters_and_vectors_in_one_optimizer():
    # ours: a conv filter (4-D), a matrix and vectors in one group; reference: torch Muon on the filter's
    # 2-D view and the matrix, torch AdamW (betas 0.9, 0.95) on the vectors.
    torch.manual_seed(1)
    conv, mat, bias, scale = torch.randn(8, 3, 3, 3), torch.randn(8, 27), torch.randn(8), torch.randn(1)
    ours_p = leaves([conv, mat, bias, scale])
    ref_conv, ref_mat, ref_bias, ref_scale = leaves([conv.reshape(8, 27), mat, bias, scale])
    ours = Muon(ours_p, lr=LR, weight_decay=0.1)
    assert [g["use_muon"] for g in ours.param_groups] == [True, False]
    muon = torch.optim.Muon([ref_conv, ref_mat], lr=LR, weight_decay=0.1)
    adamw = torch.optim.AdamW([ref_bias, ref_scale], lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                              foreach=False)
    for step in range(12):
        set_grads([ours_p, [ref_conv, ref_mat, ref_bias, ref_scale]], step)
        ours.step()
        muon.step()
        adamw.step()
    torch.testing.assert_close(ours_p[0].reshape(8, 27), ref_conv, **TOL)
    torch.testing.assert_close(ours_p[1], ref_mat, **TOL)
    torch.testing.assert_close(ours_p[2], ref_bias, rtol=2e-5, atol=2e-6)
    torch.testing.assert_close(ours_p[3], ref_scale, rtol=2e-5, atol=2e-6)
    assert set(ours.state[ours_p[2]]) == {"step", "exp_avg", "exp_avg_sq"}


def test_bf16_params_with_master_weights_follow_float32():
    base = mats()
    ref, ours_p = bf16_master_twins(base)
    theirs, ours = torch.optim.Muon(ref, lr=LR), Muon(ours_p, lr=LR, master_weights=True)
    check_bf16_master_follows_float32(theirs, ours, ref, ours_p, 10, **TOL)


def test_state_dicts_load_both_ways():
    base = mats()
    a, b = leaves(base), leaves(base)
    theirs, ours = torch.optim.Muon(a, lr=LR), Muon(b, lr=LR)
    for step in range(3):
        set_grads([a, b], step)
        theirs.step()
        ours.step()
    a2, b2 = leaves([q.detach() for q in b]), leaves([p.detach() for p in a])
    theirs2, ours2 = torch.optim.Muon(a2, lr=LR), Muon(b2, lr=LR)
    theirs2.load_state_dict(copy.deepcopy(ours.state_dict()))
    ours2.load_state_dict(copy.deepcopy(theirs.state_dict()))
    assert ours2._uses_muon(ours2.param_groups[0])
    for step in range(3, 8):
        set_grads([a, b, a2, b2], step)
        for o in (theirs, ours, theirs2, ours2):
            o.step()
    for p, q, p2, q2 in zip(a, b, a2, b2):
        torch.testing.assert_close(q2, p, **TOL)
        torch.testing.assert_close(p2, q, **TOL)


def test_global_clipping_scheduler_and_a_skipped_step():
    torch.manual_seed(2)
    mat, vec = torch.randn(16, 8), torch.randn(16)
    ours_p = leaves([mat, vec])
    ref_mat, ref_vec = leaves([mat, vec])
    ours = Muon(ours_p, lr=LR, max_grad_norm=0.5)
    muon = torch.optim.Muon([ref_mat], lr=LR)
    adamw = torch.optim.AdamW([ref_vec], lr=LR, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in (ours, muon, adamw)]
    for step in range(7):
        set_grads([ours_p, [ref_mat, ref_vec]], step, scale=3.0)
        if step == 3:  # a NaN in the vector's gradient skips the whole step, the matrix's included
            ours_p[1].grad[2] = float("nan")
            before = [p.detach().clone() for p in ours_p]
            buf = ours.state[ours_p[0]]["momentum_buffer"].clone()
            ours.step()
            assert ours.last_found_inf.item() == 1.0
            assert all(torch.equal(p, c) for p, c in zip(ours_p, before))
            assert torch.equal(ours.state[ours_p[0]]["momentum_buffer"], buf)
        else:
            norm = torch.nn.utils.clip_grad_norm_([ref_mat, ref_vec], 0.5)  # one norm over both kinds
            muon.step()
            adamw.step()
            ours.step()
            torch.testing.assert_close(ours.last_grad_norm, norm)
        for s in scheds:
            s.step()
    torch.testing.assert_close(ours_p[0], ref_mat, **TOL)
    torch.testing.assert_close(ours_p[1], ref_vec, rtol=1e-5, atol=1e-6)


def test_a_group_may_choose_with_use_muon():
    torch.manual_seed(3)
    emb, head = torch.randn(10, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)
    opt = Muon([{"params": [emb], "use_muon": False}, {"params": [head]}], lr=LR)
    assert [(g["use_muon"], len(g["params"])) for g in opt.param_groups] == [(False, 1), (True, 1)]
    emb.grad, head.grad = torch.randn(10, 4), torch.randn(4, 4)
    opt.step()
    assert set(opt.state[emb]) == {"step", "exp_avg", "exp_avg_sq"} and "momentum_buffer" in opt.state[head]


@pytest.mark.parametrize("kw,match", [
    # torch.optim.Muon's own checks first, in its words (torch's test_errors expects them) ...
    (dict(lr=-1.0), "Learning rate should be >= 0 but is: -1.0"),
    (dict(lr=torch.tensor([0.1, 0.1])), "Tensor lr must be 1-element"),
    (dict(adjust_lr_fn="rms"), "Adjust learning rate function rms is not supported"),
    # ... then the optimizer table's, naming the argument.
    (dict(momentum=1.0), r"Muon: momentum must be in \[0, 1\), got 1.0"),
    (dict(ns_steps=100), r"Muon: ns_steps must be an int in \[0, 100\), got 100"),
    (dict(ns_coefficients=(1.0, 2.0)), "Muon: ns_coefficients must be 3 numbers"),
    (dict(ns_coefficients=(3.0, float("nan"), 2.0)), r"Muon: ns_coefficients\[1\] must be a finite number, got nan"),
    (dict(adamw_betas=(0.9, 1.0)), r"Muon: adamw_betas\[1\] must be in")])
def test_argument_checks_name_the_argument(kw, match):
    with pytest.raises(ValueError, match=match):
        Muon([torch.zeros(2, 2, requires_grad=True)], **kw)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    params = [torch.randn(s, device=device) for s in ((4, 3), (4, 3), (2, 3, 3))]
    grads = [torch.randn_like(p) for p in params]
    bufs = [torch.randn_like(p) for p in params]
    steps = [torch.zeros((), device=device) for _ in params]
    torch.library.opcheck(torch.ops.fusetrain.fused_step_.default,
                          *kind_step_args("muon", params, grads, steps, (bufs,), lr=torch.tensor(0.01, device=device),
                                          momentum=0.95, nesterov=True, weight_decay=0.1, ns_a=3.4445, ns_b=-4.775,
                                          ns_c=2.0315, eps=1e-7, ns_steps=5, max_grad_norm=1.0,
                                          grad_norm=torch.tensor(2.0, device=device),
                                          found_inf=torch.zeros((), device=device)))


def test_the_kind_refuses_vectors_with_a_clear_error():
    with pytest.raises(ValueError, match=r"params\[0\] has shape \[3\]; .*put params of fewer than 2 dims in a group"):
        kind_step("muon", [torch.randn(3)], [torch.randn(3)], [torch.zeros(())], ([torch.zeros(3)],),
                  lr=torch.tensor(0.1), momentum=0.9, nesterov=True, weight_decay=0.0, ns_a=3.4445, ns_b=-4.775,
                  ns_c=2.0315, eps=1e-7, ns_steps=5)


def test_selectable_by_name_in_training_params():
    from fusetrain.training import resolve_training_params
    from fusetrain.training.params import optimizer_class

    p = resolve_training_params({"optimizer": "muon", "optimizer_params": {"adjust_lr_fn": "match_rms_adamw"}})
    assert optimizer_class(p.optimizer) is Muon
