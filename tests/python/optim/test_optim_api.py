"""fusetrain.optim as a drop-in torch.optim.Optimizer.

Covers what code written for torch.optim relies on: constructor defaults,
param groups (per-group hyperparameters, add_param_group), zero_grad, closures,
params without gradients, the lr schedulers of torch.optim.lr_scheduler (float
and tensor lr, OneCycleLR cycling betas / momentum), state dicts (layout, loading
torch.optim's state dicts and the reverse, master weights, torch.save round
trip), argument validation, and the absence of host synchronisation in step()
on CUDA.

References are torch.optim with foreach=False on the same fp32 params and
gradients. The fused kernels perform torch's single-tensor element operations in
the same order, so fp32 trajectories agree to a few ulps (RTOL below).
"""

import copy
import inspect

import pytest
import torch

import fusetrain  # noqa: F401
from fusetrain.optim import SGD, Adam, AdamW, Lion

from _test_helpers import CUDA, DEVICES

SHAPES = [(7,), (3, 5), (1,), (1031,)]
OURS = {"Adam": Adam, "AdamW": AdamW, "SGD": SGD, "Lion": Lion}
TORCH = {"Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW, "SGD": torch.optim.SGD}
# fp32 trajectories of <= 30 steps on O(1) params: a few ulps apart at most.
RTOL = dict(rtol=1e-6, atol=1e-7)


SEED = 20240611  # conftest.py seeds torch with it before each test


# ---- helpers ---------------------------------------------------------------------------


def leaves(shapes=SHAPES, dtype=torch.float32, device="cpu"):
    return [torch.randn(s, device=device).to(dtype).requires_grad_() for s in shapes]


def twin(params):
    return [p.detach().clone().requires_grad_() for p in params]


def grad_seq(params, steps):
    """Fresh random gradients (never zeros) for ``steps`` steps."""
    return [[torch.randn(p.shape, device=p.device).to(p.dtype) for p in params] for _ in range(steps)]


def run(opt, params, grads, scheduler=None, per_step=None):
    for i, gs in enumerate(grads):
        for p, g in zip(params, gs):
            p.grad = None if g is None else g.clone()
        opt.step()
        if scheduler is not None:
            scheduler.step()
        if per_step is not None:
            per_step(i)


def assert_params_close(a, b, **tol):
    tol = tol or RTOL
    for i, (x, y) in enumerate(zip(a, b)):
        torch.testing.assert_close(x.detach(), y.detach(), **tol, msg=lambda m: f"param {i}: {m}")


def assert_params_equal(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.dtype == y.dtype
        assert torch.equal(x.detach(), y.detach()), f"param {i} differs: max |diff| {(x - y).abs().max().item()}"


def ours_and_torch(name, params, **kw):
    """The fusetrain optimizer and its torch.optim reference (foreach=False) on twins."""
    ref_params = twin(params)
    return OURS[name](params, **kw), TORCH[name](ref_params, foreach=False, **kw), ref_params


@torch.no_grad()
def lion_reference(params, grads_seq, lr, betas, weight_decay):
    """Lion in plain torch ops, fp32: u = b1 m + (1-b1) g; p *= 1 - lr wd;
    p -= lr sign(u); m = b2 m + (1-b2) g."""
    b1, b2 = betas
    ps = [p.detach().clone() for p in params]
    ms = [torch.zeros_like(p) for p in ps]
    for gs in grads_seq:
        for p, m, g in zip(ps, ms, gs):
            u = m * b1 + g * (1 - b1)
            p.mul_(1 - lr * weight_decay)
            p.add_(torch.sign(u), alpha=-lr)
            m.mul_(b2).add_(g, alpha=1 - b2)
    return ps


# ---- constructor defaults ----------------------------------------------------------------


@pytest.mark.parametrize("name", ["Adam", "AdamW", "SGD"])
def test_defaults_match_torch(name):
    p = leaves([(3,)])
    ours = OURS[name](p).defaults
    ref = TORCH[name](twin(p)).defaults
    missing = set(ref) - set(ours)
    assert not missing, f"torch.optim.{name} defaults not in ours: {missing}"
    for k, v in ref.items():
        assert ours[k] == v, f"default {k}: ours {ours[k]!r}, torch {v!r}"
    extra = {"max_grad_norm", "master_weights", "state_dtype", "state_block_size"} | (
        {"bias_correction"} if name in ("Adam", "AdamW") else set())
    assert set(ours) - set(ref) == extra
    assert ours["max_grad_norm"] is None and ours["master_weights"] is False and ours["state_dtype"] == "float32"
    assert ours["state_block_size"] == 256
    assert ours.get("bias_correction", True) is True


@pytest.mark.parametrize("name", ["Adam", "AdamW", "SGD"])
def test_signature_matches_torch(name):
    # Positional order, keyword-only-ness and defaults of torch's arguments are
    # kept, so calls written for torch.optim bind the same way. A default of None
    # is accepted where it resolves to torch's default in ``defaults``.
    ours = inspect.signature(OURS[name].__init__).parameters
    ref = inspect.signature(TORCH[name].__init__).parameters
    positional = [k for k, v in ref.items() if v.kind == v.POSITIONAL_OR_KEYWORD]
    assert [k for k, v in ours.items() if v.kind == v.POSITIONAL_OR_KEYWORD] == positional
    resolved = OURS[name](leaves([(3,)])).defaults
    for k, v in ref.items():
        if k in ("self", "params"):
            continue
        assert k in ours, f"{name} lacks torch's argument {k}"
        assert ours[k].kind == v.kind, k
        if ours[k].default is None and v.default is not None:
            assert resolved[k] == v.default, k
        else:
            assert ours[k].default == v.default, f"{name}({k}=...) default {ours[k].default!r} != torch {v.default!r}"


def test_lion_defaults():
    d = Lion(leaves([(3,)])).defaults
    assert d["lr"] == 1e-4
    assert tuple(d["betas"]) == (0.9, 0.99)
    assert d["weight_decay"] == 0.0
    assert d["maximize"] is False
    assert d["max_grad_norm"] is None and d["master_weights"] is False


# ---- param groups ------------------------------------------------------------------------


@pytest.mark.parametrize("name,g0,g1", [
    ("AdamW", dict(lr=0.01, weight_decay=0.1, betas=(0.8, 0.99)), dict(lr=0.003, weight_decay=0.0, eps=1e-6)),
    ("Adam", dict(lr=0.02, weight_decay=0.05, amsgrad=True), dict(lr=0.001, betas=(0.5, 0.9))),
    ("SGD", dict(lr=0.05, momentum=0.9, nesterov=True), dict(lr=0.01, momentum=0.5, dampening=0.3, weight_decay=0.1)),
])
def test_per_group_hyperparameters_match_torch(name, g0, g1):
    a, b = leaves(SHAPES[:2]), leaves(SHAPES[2:])
    ra, rb = twin(a), twin(b)
    ours = OURS[name]([dict(params=a, **g0), dict(params=b, **g1)], lr=0.5)
    ref = TORCH[name]([dict(params=ra, **g0), dict(params=rb, **g1)], lr=0.5, foreach=False)
    for k, v in g1.items():
        assert ours.param_groups[1][k] == v
    grads = grad_seq(a + b, 10)
    run(ours, a + b, grads)
    run(ref, ra + rb, grads)
    assert_params_close(a + b, ra + rb)


def test_lion_per_group_hyperparameters():
    a, b = leaves(SHAPES[:2]), leaves(SHAPES[2:])
    start_a, start_b = twin(a), twin(b)
    opt = Lion([dict(params=a, lr=0.01, betas=(0.8, 0.95), weight_decay=0.1),
                dict(params=b, lr=0.003)])
    grads = grad_seq(a + b, 8)
    run(opt, a + b, grads)
    exp_a = lion_reference(start_a, [g[:2] for g in grads], 0.01, (0.8, 0.95), 0.1)
    exp_b = lion_reference(start_b, [g[2:] for g in grads], 0.003, (0.9, 0.99), 0.0)
    assert_params_close(a + b, exp_a + exp_b)


@pytest.mark.parametrize("name,kw", [("AdamW", dict(lr=0.01)), ("SGD", dict(lr=0.05, momentum=0.9))])
def test_add_param_group_after_construction_matches_torch(name, kw):
    a, b = leaves(SHAPES[:2]), leaves(SHAPES[2:])
    ra, rb = twin(a), twin(b)
    ours, ref = OURS[name](a, **kw), TORCH[name](ra, foreach=False, **kw)
    first = grad_seq(a, 3)
    run(ours, a, first)
    run(ref, ra, first)
    ours.add_param_group(dict(params=b, lr=0.002, weight_decay=0.1))
    ref.add_param_group(dict(params=rb, lr=0.002, weight_decay=0.1))
    assert ours.param_groups[1]["max_grad_norm"] is None and ours.param_groups[1]["master_weights"] is False
    assert all(p not in ours.state for p in b)
    second = grad_seq(a + b, 5)
    run(ours, a + b, second)
    run(ref, ra + rb, second)
    assert_params_close(a + b, ra + rb)
    for p in a:
        assert ours.state[p]["step"].item() == 8
    for p in b:
        st = ours.state[p]
        assert st["step"].item() == 5 and st["step"].dtype == torch.float32 and st["step"].dim() == 0
        if name == "AdamW":
            assert st["exp_avg"].shape == p.shape and st["exp_avg_sq"].dtype == torch.float32


def test_add_param_group_lion_and_max_grad_norm_spans_groups():
    # The global clipping norm covers every group, including one added later.
    a, b = leaves(SHAPES[:2]), leaves(SHAPES[2:])
    opt = Lion(a, lr=0.01, max_grad_norm=0.5)
    opt.add_param_group(dict(params=b, lr=0.02))
    gs = grad_seq(a + b, 1)
    run(opt, a + b, gs)
    total = torch.sqrt(sum(g.double().square().sum() for g in gs[0]))
    assert opt.last_grad_norm.item() == pytest.approx(total.item(), rel=1e-5)
    for p in a + b:
        assert opt.state[p]["step"].item() == 1


@pytest.mark.parametrize("name", list(OURS))
def test_add_param_group_rejects_duplicate_params(name):
    a = leaves(SHAPES[:2])
    opt = OURS[name](a, lr=0.01)
    with pytest.raises(ValueError, match="more than one parameter group"):
        opt.add_param_group(dict(params=[a[0]]))


# ---- zero_grad, closure, params without grads -------------------------------------------


@pytest.mark.parametrize("name", list(OURS))
def test_zero_grad(name):
    ps = leaves()
    opt = OURS[name](ps, lr=0.01)
    for p in ps:
        p.grad = torch.randn_like(p)
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and torch.count_nonzero(p.grad) == 0 for p in ps)
    opt.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in ps)
    for p in ps:
        p.grad = torch.randn_like(p)
    opt.zero_grad()  # torch's default is set_to_none=True
    assert all(p.grad is None for p in ps)


def _quadratic_closure(opt, params, x):
    calls = []

    def closure():
        opt.zero_grad()
        loss = sum(((p * xi).sum() - 0.5) ** 2 for p, xi in zip(params, x))
        loss.backward()
        calls.append(loss)
        return loss

    return closure, calls


@pytest.mark.parametrize("name", list(OURS))
def test_step_closure_returns_loss_and_uses_its_gradients(name):
    kw = dict(lr=0.01, momentum=0.9) if name == "SGD" else dict(lr=0.01)
    ps = leaves()
    manual = twin(ps)
    x = [torch.randn_like(p) for p in ps]
    opt = OURS[name](ps, **kw)
    closure, calls = _quadratic_closure(opt, ps, x)
    for p in ps:  # stale gradients the closure must replace
        p.grad = torch.randn_like(p) * 100
    with torch.no_grad():  # the closure runs with grad enabled regardless
        loss = opt.step(closure)
    assert len(calls) == 1 and loss is calls[0]
    # Same optimizer, gradients of the same loss set by hand.
    loss2 = sum(((p * xi).sum() - 0.5) ** 2 for p, xi in zip(manual, x))
    loss2.backward()
    assert loss.item() == loss2.item()
    opt2 = OURS[name](manual, **kw)
    assert opt2.step() is None
    assert_params_equal(ps, manual)
    if name in TORCH:  # several closure steps against torch.optim
        start = leaves()
        mine, theirs = twin(start), twin(start)
        o1 = OURS[name](mine, **kw)
        o2 = TORCH[name](theirs, foreach=False, **kw)
        c1, _ = _quadratic_closure(o1, mine, x)
        c2, _ = _quadratic_closure(o2, theirs, x)
        for _ in range(5):
            l1, l2 = o1.step(c1), o2.step(c2)
            assert l1.item() == pytest.approx(l2.item(), rel=1e-6)
        assert_params_close(mine, theirs)


@pytest.mark.parametrize("name", list(OURS))
def test_params_without_grad_are_skipped(name):
    ps = leaves()
    before = twin(ps)
    opt = OURS[name](ps, lr=0.01)
    skip = {1, 3}
    for step in range(3):
        for i, p in enumerate(ps):
            p.grad = None if i in skip else torch.randn_like(p)
        opt.step()
    for i, (p, b) in enumerate(zip(ps, before)):
        if i in skip:
            assert torch.equal(p, b), f"param {i} without grad changed"
            assert p not in opt.state, f"state created for param {i} without grad"
        else:
            assert not torch.equal(p, b)
            assert opt.state[p]["step"].item() == 3


@pytest.mark.parametrize("name", list(OURS))
def test_group_without_any_grad_is_a_no_op(name):
    ps = leaves()
    before = twin(ps)
    opt = OURS[name](ps, lr=0.01, max_grad_norm=1.0)
    opt.step()
    assert_params_equal(ps, before)
    assert len(opt.state) == 0


@pytest.mark.parametrize("name", list(OURS))
def test_group_without_grads_after_one_with_grads(name):
    # A frozen group (no gradients) after a trained one: it changes nothing, and the trained group steps as
    # it would alone.
    mine = leaves()
    theirs, frozen = twin(mine), twin(mine[2:])
    opt = OURS[name]([{"params": mine[:2]}, {"params": mine[2:], "lr": 0.5}], lr=0.01)
    ref = OURS[name](theirs[:2], lr=0.01)
    for _ in range(3):
        for p, q in zip(mine[:2], theirs[:2]):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        opt.step()
        ref.step()
    assert_params_equal(mine[2:], frozen)
    assert_params_close(mine[:2], theirs[:2])


@pytest.mark.parametrize("name", list(OURS))
def test_kept_step_lists_follow_every_state_change(name):
    # NOTE [step plan]: a step through the plan gives the numbers of a step that collects its lists
    # afresh, through a param without a gradient, a state tensor replaced or a param's state deleted
    # by hand, a param's data replaced, a state load and an EMA attach and detach.
    kw = dict(lr=0.01, momentum=0.9) if name == "SGD" else dict(lr=0.01)
    runs = []
    for keep in (True, False):
        torch.manual_seed(3)
        ps = leaves()
        opt = OURS[name]([{"params": ps[:2]}, {"params": ps[2:], "lr": 0.02}], max_grad_norm=1.0, **kw)
        if not keep:
            opt._keep_lists = False
        saved, kept_seen = None, []
        for step in range(10):
            for p in ps:
                p.grad = torch.randn_like(p)
            if step == 2:
                ps[1].grad = None
            if step == 4:  # after a step with every gradient again: the kept lists would be used
                st = opt.state[ps[0]]
                name0 = next(k for k, v in st.items() if k != "step" and isinstance(v, torch.Tensor))
                st[name0] = st[name0] * 0.5  # replaced, not changed in place
            if step == 5:
                opt.state[ps[3]] = dict(opt.state[ps[3]])  # the same tensors in another dict
            if step == 6:
                del opt.state[ps[2]]
                saved = copy.deepcopy(opt.state_dict())
            if step == 7:
                ps[3].data = ps[3].data.clone()
                opt.attach_ema({p: p.detach().clone() for p in ps}, torch.tensor(0.9))
            if step == 8:
                opt.load_state_dict(saved)
            if step == 9:
                opt.detach_ema()
            opt.step()
            kept_seen.append("plan" in opt._kept)
        runs.append((ps, opt))
        if keep:
            assert kept_seen[1] and kept_seen[-1], kept_seen
    (a, opt_a), (b, opt_b) = runs
    assert_params_equal(a, b)
    for p, q in zip(a, b):
        for k, v in opt_a.state[p].items():
            assert torch.equal(v, opt_b.state[q][k]), k


def test_steady_steps_collect_no_lists_in_python():
    # NOTE [step plan]: once a step has made the plan, steps re-check it in C++ and collect nothing in Python.
    ps = leaves()
    opt = AdamW([{"params": ps[:2]}, {"params": ps[2:]}], lr=0.01, max_grad_norm=1.0)
    calls = []
    collect = opt._collect_group
    opt._collect_group = lambda *args: calls.append(1) or collect(*args)
    for _ in range(5):
        for p in ps:
            p.grad = torch.randn_like(p)
        opt.step()
    assert len(calls) == 2, calls  # the first step, once per group
    ps[0].grad = None  # another set of gradients: collected again, then planned again
    opt.step()
    opt.step()
    assert len(calls) == 4, calls


def test_step_plan_follows_group_changes():
    # NOTE [step plan]: a change of a group's settings that changes its lists (amsgrad adds a state
    # tensor), a group's params list replaced (reordered), the state dict replaced by a copy and a param
    # group added give the numbers of steps that collect their lists every time.
    runs = []
    for keep in (True, False):
        torch.manual_seed(5)
        ps = leaves()
        extra = leaves([(4,)])
        opt = Adam([{"params": ps[:2]}, {"params": ps[2:], "lr": 0.02}], lr=0.01, max_grad_norm=1.0)
        opt._keep_lists = keep
        for step in range(8):
            for p in ps + extra:
                p.grad = torch.randn_like(p)
            if step == 2:
                opt.param_groups[1]["amsgrad"] = True
            if step == 3:
                opt.param_groups[0]["params"] = opt.param_groups[0]["params"][::-1]
            if step == 4:
                opt.state = type(opt.state)(dict, opt.state)
            if step == 5:
                opt.add_param_group({"params": extra})
            opt.step()
        assert ("plan" in opt._kept) == keep
        runs.append((ps + extra, opt))
    (a, opt_a), (b, opt_b) = runs
    assert_params_equal(a, b)
    for p, q in zip(a, b):
        assert opt_a.state[p].keys() == opt_b.state[q].keys()
        for k, v in opt_a.state[p].items():
            assert torch.equal(v, opt_b.state[q][k]), k


def test_step_plan_refuses_inconsistent_lists():
    from fusetrain import _C

    ps = leaves()
    for p in ps:
        p.grad = torch.randn_like(p)
    opt = AdamW(ps, lr=0.01)
    opt.step()
    steps = [opt.state[p]["step"] for p in ps]
    sds = [opt.state[p] for p in ps]
    with pytest.raises((ValueError, RuntimeError), match="StepPlan: 3 params in the lists, 4 with a gradient"):
        _C.StepPlan("adam", opt.param_groups, opt.state, None, ps[:3], steps[:3], [], [], [], [], [], [3], ps[:3],
                    sds[:3], [], [], [], [None] * 3)
    plan = _C.StepPlan("adam", opt.param_groups, opt.state, None, ps, steps, [], [], [], [], [], [4], ps, sds, [],
                       [], [], [None] * 4)
    with pytest.raises((ValueError, RuntimeError), match="call collect"):
        plan.run([torch.tensor(0.01)], [0.0] * 11)
    before = twin(ps)
    ps[1].grad = None
    assert not plan.collect(opt.param_groups, opt.state)  # a param lost its gradient
    assert_params_equal(ps, before)


# ---- lr schedulers ---------------------------------------------------------------------


def _step_lr(opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.5)


def _cosine(opt):
    return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=30, eta_min=1e-4)


@pytest.mark.parametrize("make_sched", [_step_lr, _cosine], ids=["StepLR", "CosineAnnealingLR"])
@pytest.mark.parametrize("name,kw", [
    ("AdamW", dict(lr=0.02, weight_decay=0.05)),
    ("SGD", dict(lr=0.05, momentum=0.9)),
])
def test_scheduler_trajectory_matches_torch(make_sched, name, kw):
    ps = leaves()
    plain = twin(ps)
    ours, ref, rps = ours_and_torch(name, ps, **kw)
    s1, s2 = make_sched(ours), make_sched(ref)
    lrs = []
    grads = grad_seq(ps, 30)
    run(ours, ps, grads, s1, per_step=lambda i: lrs.append(ours.param_groups[0]["lr"]))
    run(ref, rps, grads, s2)
    assert len(set(lrs)) > 2, "the scheduler did not change the lr"
    assert ours.param_groups[0]["lr"] == ref.param_groups[0]["lr"]
    assert_params_close(ps, rps)
    # The changed lr is what the step used: without the scheduler the params differ.
    flat = OURS[name](plain, **kw)
    run(flat, plain, grads)
    assert not torch.allclose(plain[3], ps[3], rtol=1e-3, atol=1e-3)


def _one_cycle(opt):
    return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.02, total_steps=30, cycle_momentum=True,
                                               base_momentum=0.8, max_momentum=0.95)


@pytest.mark.parametrize("name,kw", [
    ("Adam", dict(lr=0.01, weight_decay=0.01)),
    ("AdamW", dict(lr=0.01)),
    ("SGD", dict(lr=0.01, momentum=0.9)),
])
def test_one_cycle_cycles_momentum_like_torch(name, kw):
    ps = leaves()
    ours, ref, rps = ours_and_torch(name, ps, **kw)
    s1, s2 = _one_cycle(ours), _one_cycle(ref)
    key = "momentum" if name == "SGD" else "betas"
    seen = []
    grads = grad_seq(ps, 29)
    run(ours, ps, grads, s1, per_step=lambda i: seen.append(ours.param_groups[0][key]))
    run(ref, rps, grads, s2)
    assert len(set(seen)) > 5, f"OneCycleLR did not cycle {key}"
    assert ours.param_groups[0][key] == ref.param_groups[0][key]
    if key == "betas":
        assert ours.param_groups[0]["betas"][1] == 0.999
    assert_params_close(ps, rps)


def test_one_cycle_with_lion_cycles_beta1():
    ps = leaves()
    opt = Lion(ps, lr=0.01)
    sched = _one_cycle(opt)
    expected_b1, expected_lr = [], []
    start = twin(ps)
    grads = grad_seq(ps, 10)
    for gs in grads:
        expected_b1.append(opt.param_groups[0]["betas"][0])
        expected_lr.append(opt.param_groups[0]["lr"])
        run(opt, ps, [gs])
        sched.step()
    assert len(set(expected_b1)) > 3
    # Reference: Lion with the scheduled (lr, beta1) of every step.
    with torch.no_grad():
        cur = [p.detach().clone() for p in start]
        ms = [torch.zeros_like(p) for p in cur]
        for gs, lr, b1 in zip(grads, expected_lr, expected_b1):
            for p, m, g in zip(cur, ms, gs):
                u = m * b1 + g * (1 - b1)
                p.add_(torch.sign(u), alpha=-lr)
                m.mul_(0.99).add_(g, alpha=1 - 0.99)
    assert_params_close(ps, cur)


@pytest.mark.parametrize("name", ["Adam", "AdamW"])
def test_tensor_lr_matches_torch(name):
    ps = leaves()
    rps = twin(ps)
    ours = OURS[name](ps, lr=torch.tensor(0.01))
    ref = TORCH[name](rps, lr=torch.tensor(0.01), foreach=False)
    grads = grad_seq(ps, 10)
    run(ours, ps, grads)
    run(ref, rps, grads)
    assert_params_close(ps, rps)


@pytest.mark.parametrize("name,kw", [
    ("Adam", {}), ("AdamW", {}), ("SGD", dict(momentum=0.9)), ("Lion", dict(weight_decay=0.1)),
])
def test_tensor_lr_equals_float_lr_and_is_read_every_step(name, kw):
    ps = leaves()
    q = twin(ps)
    lr = torch.tensor(0.01)
    a = OURS[name](ps, lr=lr, **kw)
    b = OURS[name](q, lr=0.01, **kw)
    grads = grad_seq(ps, 5)
    run(a, ps, grads)
    run(b, q, grads)
    assert_params_equal(ps, q)
    assert a.param_groups[0]["lr"] is lr
    # Editing the tensor in place changes the next step: lr 0 leaves params unchanged.
    lr.fill_(0.0)
    frozen = twin(ps)
    run(a, ps, grad_seq(ps, 1))
    assert_params_equal(ps, frozen)
    assert all(a.state[p]["step"].item() == 6 for p in ps)


@pytest.mark.parametrize("make_sched", [_step_lr, _cosine], ids=["StepLR", "CosineAnnealingLR"])
def test_scheduler_updates_tensor_lr(make_sched):
    ps = leaves()
    rps = twin(ps)
    lr = torch.tensor(0.02)
    ours = AdamW(ps, lr=lr)
    ref = torch.optim.AdamW(rps, lr=torch.tensor(0.02), foreach=False)
    s1, s2 = make_sched(ours), make_sched(ref)
    values = []
    grads = grad_seq(ps, 30)
    run(ours, ps, grads, s1, per_step=lambda i: values.append(float(ours.param_groups[0]["lr"])))
    run(ref, rps, grads, s2)
    assert ours.param_groups[0]["lr"] is lr, "the scheduler should update the tensor lr in place"
    assert len(set(values)) > 2
    torch.testing.assert_close(ours.param_groups[0]["lr"], ref.param_groups[0]["lr"])
    assert_params_close(ps, rps)


def test_lr_changed_by_hand_between_steps_is_used():
    ps = leaves()
    q = twin(ps)
    a = SGD(ps, lr=0.1)
    grads = grad_seq(ps, 3)
    lrs = [0.1, 0.01, 0.3]
    for gs, lr in zip(grads, lrs):
        a.param_groups[0]["lr"] = lr
        run(a, ps, [gs])
    with torch.no_grad():
        for gs, lr in zip(grads, lrs):
            for p, g in zip(q, gs):
                p.add_(g, alpha=-lr)
    assert_params_close(ps, q)


# ---- state dicts ------------------------------------------------------------------------


@pytest.mark.parametrize("name,kw", [
    ("Adam", {}), ("Adam", dict(amsgrad=True)), ("AdamW", {}), ("AdamW", dict(amsgrad=True)),
    ("SGD", dict(momentum=0.9)),
])
def test_state_dict_layout_matches_torch(name, kw):
    ps = leaves()
    ours, ref, rps = ours_and_torch(name, ps, lr=0.01, **kw)
    grads = grad_seq(ps, 2)
    run(ours, ps, grads)
    run(ref, rps, grads)
    a, b = ours.state_dict(), ref.state_dict()
    assert set(a) == set(b) == {"state", "param_groups"}
    assert sorted(a["state"]) == sorted(b["state"]) == list(range(len(ps)))
    extra = {"step"} if name == "SGD" else set()  # SGD also keeps a step counter
    for i, p in enumerate(ps):
        sa, sb = a["state"][i], b["state"][i]
        assert set(sa) == set(sb) | extra, f"param {i}: {sorted(sa)} vs torch {sorted(sb)}"
        for k, v in sa.items():
            if k == "step":
                assert v.dim() == 0 and v.dtype == torch.float32 and v.item() == 2
            else:
                assert v.shape == p.shape and v.dtype == torch.float32
                torch.testing.assert_close(v, sb[k], **RTOL)
    assert len(a["param_groups"]) == len(b["param_groups"]) == 1
    ga, gb = a["param_groups"][0], b["param_groups"][0]
    assert set(gb) <= set(ga), f"missing group keys {set(gb) - set(ga)}"
    assert ga["params"] == gb["params"]
    for k in gb:
        if k not in ("params", "foreach"):
            assert ga[k] == gb[k], f"group key {k}: {ga[k]!r} vs torch {gb[k]!r}"


def test_lion_state_dict_layout():
    ps = leaves()
    opt = Lion(ps, lr=0.01)
    run(opt, ps, grad_seq(ps, 2))
    sd = opt.state_dict()
    for i, p in enumerate(ps):
        assert set(sd["state"][i]) == {"step", "exp_avg"}
        assert sd["state"][i]["exp_avg"].shape == p.shape
        assert sd["state"][i]["step"].item() == 2
    assert {"lr", "betas", "weight_decay", "maximize", "max_grad_norm", "master_weights", "params"} <= set(
        sd["param_groups"][0])


CROSS = [
    ("AdamW", dict(lr=0.01, weight_decay=0.05)),
    ("Adam", dict(lr=0.01, amsgrad=True, weight_decay=0.1)),
    ("SGD", dict(lr=0.05, momentum=0.9, nesterov=True)),
    ("SGD", dict(lr=0.05, momentum=0.9, dampening=0.2)),
]


@pytest.mark.parametrize("name,kw", CROSS)
def test_load_torch_state_dict_and_continue(name, kw):
    ps = leaves()
    ref = TORCH[name](ps, foreach=False, **kw)
    run(ref, ps, grad_seq(ps, 5))
    mine = twin(ps)
    ours = OURS[name](mine, lr=0.7)  # hyperparameters come from the state dict
    ours.load_state_dict(ref.state_dict())
    assert ours.param_groups[0]["lr"] == kw["lr"]
    assert ours.param_groups[0]["max_grad_norm"] is None and ours.param_groups[0]["master_weights"] is False
    for p in mine:
        for k, v in ours.state[p].items():
            assert v.dtype == torch.float32 and v.device == p.device, k
    grads = grad_seq(ps, 20)
    run(ref, ps, grads)
    run(ours, mine, grads)
    assert_params_close(mine, ps)


@pytest.mark.parametrize("name,kw", CROSS)
def test_torch_loads_our_state_dict_and_continues(name, kw):
    ps = leaves()
    ours = OURS[name](ps, **kw)
    run(ours, ps, grad_seq(ps, 5))
    theirs = twin(ps)
    ref = TORCH[name](theirs, lr=0.7, foreach=False)
    # torch.optim keeps the loaded (CPU) step tensors without copying them, so
    # hand it a copy: both optimizers keep stepping afterwards.
    ref.load_state_dict(copy.deepcopy(ours.state_dict()))
    assert ref.param_groups[0]["lr"] == kw["lr"]
    grads = grad_seq(ps, 20)
    run(ours, ps, grads)
    run(ref, theirs, grads)
    assert_params_close(theirs, ps)


def test_state_dict_is_a_snapshot():
    # As in torch, state_dict() references the live state; a deepcopy is a snapshot.
    ps = leaves()
    opt = AdamW(ps, lr=0.01)
    run(opt, ps, grad_seq(ps, 2))
    snap = copy.deepcopy(opt.state_dict())
    run(opt, ps, grad_seq(ps, 1))
    assert snap["state"][0]["step"].item() == 2
    assert not torch.equal(snap["state"][0]["exp_avg"], opt.state[ps[0]]["exp_avg"])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", ["AdamW", "SGD", "Lion"])
def test_master_weights_saved_and_restored(name, dtype):
    kw = dict(lr=0.01, master_weights=True)
    if name == "SGD":
        kw["momentum"] = 0.9
    ps = leaves(dtype=dtype)
    opt = OURS[name](ps, **kw)
    run(opt, ps, grad_seq(ps, 4))
    sd = copy.deepcopy(opt.state_dict())
    for i, p in enumerate(ps):
        m = sd["state"][i]["master_param"]
        assert m.dtype == torch.float32 and m.shape == p.shape
        assert torch.equal(m.to(dtype), p.detach()), "the param is the rounded master"
    assert any(not torch.equal(sd["state"][i]["master_param"], p.detach().float()) for i, p in enumerate(ps)), \
        "master weights carry no extra precision"
    restored = twin(ps)
    fresh = twin(ps)
    opt2 = OURS[name](restored, lr=0.5)
    opt2.load_state_dict(sd)
    for i, p in enumerate(restored):
        m = opt2.state[p]["master_param"]
        assert m.dtype == torch.float32 and torch.equal(m, sd["state"][i]["master_param"])
        for k, v in opt2.state[p].items():
            assert v.dtype == torch.float32, k
    opt3 = OURS[name](fresh, **kw)  # control: no saved state
    grads = grad_seq(ps, 6)
    run(opt, ps, grads)
    run(opt2, restored, grads)
    run(opt3, fresh, grads)
    assert_params_equal(restored, ps)
    for p, q in zip(ps, restored):
        assert torch.equal(opt.state[p]["master_param"], opt2.state[q]["master_param"])
    assert any(not torch.equal(opt.state[p]["master_param"], opt3.state[q]["master_param"])
               for p, q in zip(ps, fresh))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("master_weights", [False, True])
def test_torch_state_dict_into_low_precision_params_stays_float32(dtype, master_weights):
    src = leaves()
    ref = torch.optim.AdamW(src, lr=0.01, foreach=False)
    run(ref, src, grad_seq(src, 3))
    sd = ref.state_dict()
    ps = [p.detach().to(dtype).requires_grad_() for p in src]
    ours = AdamW(ps, lr=0.01, master_weights=master_weights)
    ours.load_state_dict(sd)
    for i, p in enumerate(ps):
        st = ours.state[p]
        for k in ("exp_avg", "exp_avg_sq"):
            assert st[k].dtype == torch.float32
            # Bit-equal to the saved fp32 values: not rounded through the param dtype.
            assert torch.equal(st[k], sd["state"][i][k]), k
        assert st["step"].dtype == torch.float32 and st["step"].device == p.device and st["step"].item() == 3
    run(ours, ps, grad_seq(ps, 2))
    for p in ps:
        st = ours.state[p]
        assert p.dtype == dtype
        assert st["exp_avg"].dtype == torch.float32 and st["exp_avg_sq"].dtype == torch.float32
        assert st["step"].item() == 5
        assert ("master_param" in st) == master_weights
        if master_weights:
            assert st["master_param"].dtype == torch.float32


SAVE_CASES = [
    ("AdamW", dict(lr=0.01, max_grad_norm=1.0), torch.float32),
    ("Adam", dict(lr=0.01, amsgrad=True, master_weights=True), torch.bfloat16),
    ("SGD", dict(lr=0.05, momentum=0.9, dampening=0.1), torch.float32),
    ("SGD", dict(lr=0.05, momentum=0.9, nesterov=True, master_weights=True), torch.float16),
    ("Lion", dict(lr=0.01, weight_decay=0.1), torch.float32),
]


@pytest.mark.parametrize("name,kw,dtype", SAVE_CASES)
def test_torch_save_load_round_trip_is_exact(tmp_path, name, kw, dtype):
    ps = leaves(dtype=dtype)
    full = twin(ps)
    grads = grad_seq(ps, 10)
    uninterrupted = OURS[name](full, **kw)
    run(uninterrupted, full, grads)

    opt = OURS[name](ps, **kw)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=100)  # saved alongside, as in training loops
    run(opt, ps, grads[:5])
    path = tmp_path / "ckpt.pt"
    torch.save({"params": [p.detach() for p in ps], "optim": opt.state_dict(), "sched": sched.state_dict()}, path)
    del opt, sched
    ckpt = torch.load(path, weights_only=True)
    resumed = [p.clone().requires_grad_() for p in ckpt["params"]]
    opt = OURS[name](resumed)  # defaults: everything comes from the checkpoint
    opt.load_state_dict(ckpt["optim"])
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=100)
    sched.load_state_dict(ckpt["sched"])
    for k, v in kw.items():
        assert opt.param_groups[0][k] == v, k
    run(opt, resumed, grads[5:], sched)
    assert_params_equal(resumed, full)
    for p, q in zip(resumed, full):
        a, b = opt.state[p], uninterrupted.state[q]
        assert set(a) == set(b)
        for k in a:
            assert torch.equal(a[k], b[k]), k


def test_deepcopy_of_optimizer_can_step():
    # copy.deepcopy goes through Optimizer.__getstate__/__setstate__, which keep
    # only defaults, state and param_groups.
    ps = leaves()
    opt = AdamW(ps, lr=0.01)
    run(opt, ps, grad_seq(ps, 1))
    clone = copy.deepcopy(opt)
    cps = clone.param_groups[0]["params"]
    gs = grad_seq(ps, 1)
    run(opt, ps, gs)
    run(clone, cps, gs)
    assert_params_equal(cps, ps)


# ---- bad input ----------------------------------------------------------------------------


def _p():
    return [torch.randn(3, requires_grad=True)]


BAD_ARGS = [
    # fusetrain's own arguments, and Lion (which torch.optim lacks); the
    # arguments of torch.optim's optimizers get torch's own errors
    # (tests/python/optim/test_optim_dropin.py).
    # (optimizer, kwargs, exception, match)
    *[(n, dict(max_grad_norm=0.0), ValueError, "max_grad_norm") for n in OURS],
    *[(n, dict(max_grad_norm=-1.0), ValueError, "max_grad_norm") for n in OURS],
    *[(n, dict(master_weights=1), TypeError, "master_weights") for n in OURS],
    *[(n, dict(master_weights="yes"), ValueError, "master_weights") for n in OURS],
    ("Lion", dict(lr=-1e-3), ValueError, "lr"),
    ("Lion", dict(lr="fast"), TypeError, "lr"),
    ("Lion", dict(weight_decay=-0.1), ValueError, "weight_decay"),
    *[("Lion", dict(betas=b), ValueError, m)
      for b, m in [((1.0, 0.999), r"betas\[0\]"), ((-0.1, 0.999), r"betas\[0\]"), ((0.9, 1.0), r"betas\[1\]"),
                   ((0.9, -0.5), r"betas\[1\]"), ((0.9,), "betas"), ((0.9, 0.99, 0.999), "betas"), (0.9, "betas")]],
    # NaN and the infinities are in no range, bounded or not (the table's fields with low=None included).
    ("Lion", dict(lr=float("nan")), ValueError, "lr must be a finite number >= 0, got nan"),
    ("Lion", dict(betas=(float("nan"), 0.99)), ValueError, r"betas\[0\] must be a finite number in \[0, 1\), got nan"),
    ("SGD", dict(momentum=0.9, dampening=float("nan")), ValueError, "dampening must be a finite number, got nan"),
]


@pytest.mark.parametrize("name,kw,exc,match", BAD_ARGS,
                         ids=[f"{n}-{'-'.join(f'{k}={v}' for k, v in kw.items())}" for n, kw, _, _ in BAD_ARGS])
def test_bad_arguments_raise_naming_the_argument(name, kw, exc, match):
    with pytest.raises(exc, match=match):
        OURS[name](_p(), **kw)


@pytest.mark.parametrize("dtype", [torch.int64, torch.uint8, torch.bool])
@pytest.mark.parametrize("name", list(OURS))
def test_unsupported_param_dtype_rejected(name, dtype):
    p = torch.zeros(3, dtype=dtype)
    if dtype.is_floating_point:
        p.requires_grad_()
    with pytest.raises(TypeError, match=str(dtype).replace("torch.", "")):
        OURS[name](_p() + [p])


@pytest.mark.parametrize("name", list(OURS))
def test_unsupported_dtype_in_added_group_rejected(name):
    opt = OURS[name](_p())
    with pytest.raises(TypeError, match="int32"):
        opt.add_param_group(dict(params=[torch.zeros(3, dtype=torch.int32)]))


@pytest.mark.parametrize("name", list(OURS))
def test_meta_device_params_rejected(name):
    p = torch.empty(3, device="meta", requires_grad=True)
    with pytest.raises(ValueError, match="meta"):
        OURS[name]([p])
    with pytest.raises(ValueError, match="meta"):
        OURS[name](_p() + [p])


@CUDA
@pytest.mark.parametrize("name", list(OURS))
def test_params_of_one_group_on_different_devices_rejected(name):
    ps = [torch.randn(3, requires_grad=True), torch.randn(3, device="cuda", requires_grad=True)]
    with pytest.raises(ValueError, match="different devices"):
        OURS[name](ps)
    # One group per device is fine, and each steps on its own device.
    opt = OURS[name]([dict(params=ps[:1]), dict(params=ps[1:])], lr=0.01, max_grad_norm=1.0)
    before = twin(ps)
    for p in ps:
        p.grad = torch.randn_like(p)
    opt.step()
    for p, b in zip(ps, before):
        assert not torch.equal(p, b)
        assert opt.state[p]["step"].device == p.device


@pytest.mark.parametrize("name", ["Adam", "AdamW", "Lion"])  # SGD takes them (test_optim_dropin.py)
def test_sparse_gradient_rejected_at_step(name):
    ps = leaves()
    before = twin(ps)
    opt = OURS[name](ps, lr=0.01)
    for p in ps:
        p.grad = torch.randn_like(p)
    ps[2].grad = torch.randn_like(ps[2]).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    assert_params_equal(ps, before)
    # Also after steps that kept their lists (NOTE [step plan]): refused, nothing changes.
    ps[2].grad = torch.randn_like(ps[2])
    opt.step()
    opt.step()
    after = twin(ps)
    steps = [opt.state[p]["step"].clone() for p in ps]
    ps[2].grad = torch.randn_like(ps[2]).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    assert_params_equal(ps, after)
    assert all(torch.equal(opt.state[p]["step"], s) for p, s in zip(ps, steps))


# ---- attach_ema validation ------------------------------------------------------------------


def _ema_setup():
    a, b = leaves(SHAPES[:2]), leaves(SHAPES[2:])
    opt = AdamW([dict(params=a), dict(params=b)], lr=0.01)
    return opt, a, b


def test_attach_ema_works_for_a_valid_mapping():
    opt, a, b = _ema_setup()
    emas = {p: p.detach().clone() for p in a}  # group 1 has no EMA: allowed
    decay = torch.tensor(0.9)
    opt.attach_ema(emas, decay)
    old = {p: e.clone() for p, e in emas.items()}
    untouched_b = twin(b)
    run(opt, a + b, grad_seq(a + b, 1))
    for p in a:
        expected = old[p] + (1 - 0.9) * (p.detach() - old[p])
        torch.testing.assert_close(emas[p], expected, **RTOL)
    assert not any(torch.equal(x, y) for x, y in zip(b, untouched_b))


def test_attach_ema_rejects_shape_mismatch():
    opt, a, b = _ema_setup()
    emas = {a[0]: torch.zeros(8), a[1]: a[1].detach().clone()}
    with pytest.raises(ValueError, match="shape"):
        opt.attach_ema(emas, torch.tensor(0.9))


def test_attach_ema_rejects_dtype_mismatch():
    opt, a, b = _ema_setup()
    emas = {a[0]: a[0].detach().to(torch.bfloat16), a[1]: a[1].detach().clone()}
    with pytest.raises(ValueError, match="dtype"):
        opt.attach_ema(emas, torch.tensor(0.9))


def test_attach_ema_rejects_unknown_params():
    opt, a, b = _ema_setup()
    stranger = torch.randn(7, requires_grad=True)
    emas = {p: p.detach().clone() for p in a + b}
    emas[stranger] = stranger.detach().clone()
    with pytest.raises(ValueError, match="not params of this optimizer"):
        opt.attach_ema(emas, torch.tensor(0.9))


def test_attach_ema_rejects_partial_group():
    opt, a, b = _ema_setup()
    emas = {a[0]: a[0].detach().clone()}
    with pytest.raises(ValueError, match="group 0"):
        opt.attach_ema(emas, torch.tensor(0.9))


@pytest.mark.parametrize("decay", [0.99, torch.tensor(0.99, dtype=torch.float64), torch.tensor([0.9, 0.9]),
                                   torch.tensor(0.99, dtype=torch.float16)],
                         ids=["python-float", "float64", "two-elements", "float16"])
def test_attach_ema_rejects_bad_decay(decay):
    opt, a, b = _ema_setup()
    with pytest.raises(TypeError, match="decay"):
        opt.attach_ema({p: p.detach().clone() for p in a}, decay)


def test_failed_attach_ema_keeps_previous_ema():
    opt, a, b = _ema_setup()
    emas = {p: p.detach().clone() for p in a}
    opt.attach_ema(emas, torch.tensor(0.5))
    with pytest.raises(ValueError):
        opt.attach_ema({a[0]: torch.zeros(8), a[1]: a[1].detach().clone()}, torch.tensor(0.9))
    old = {p: e.clone() for p, e in emas.items()}
    run(opt, a + b, grad_seq(a + b, 1))
    for p in a:
        torch.testing.assert_close(emas[p], old[p] + 0.5 * (p.detach() - old[p]), **RTOL)


# ---- no host synchronisation in step() ------------------------------------------------------


SYNC_CASES = [
    ("Adam", dict(lr=0.01, max_grad_norm=1.0, amsgrad=True)),
    ("AdamW", dict(lr=0.01, max_grad_norm=1.0, master_weights=True)),
    # SGD's step is lr times the clipped gradient (~0.03 per element here): a larger lr than the
    # others' so that every param, the 1-element float16 one too, visibly changes.
    ("SGD", dict(lr=0.5, momentum=0.9, max_grad_norm=1.0)),
    ("Lion", dict(lr=0.01, max_grad_norm=1.0)),
]


@CUDA
@pytest.mark.parametrize("name,kw", SYNC_CASES)
def test_step_does_not_synchronize_with_host(name, kw):
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.float32]
    ps = [torch.randn(s, device="cuda").to(dt).requires_grad_() for s, dt in zip(SHAPES, dtypes)]
    opt = OURS[name](ps, **kw)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    grads = grad_seq(ps, 4)
    inv_scale = torch.full((), 1.0 / 1024, device="cuda")
    found_inf = torch.zeros((), device="cuda")
    scaled = [[g * 1024 for g in gs] for gs in grads]
    torch.cuda.synchronize()
    before = twin(ps)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for p, g in zip(ps, grads[0]):
            p.grad = g
        opt.step()  # first step: creates the state
        sched.step()  # a new float lr for the next step
        for p, g in zip(ps, grads[1]):
            p.grad = g
        opt.step()
        for p, g in zip(ps, scaled[2]):
            p.grad = g
        opt._fused_step(inv_scale=inv_scale, found_inf=None)
        for p, g in zip(ps, scaled[3]):
            p.grad = g
        opt._fused_step(inv_scale=inv_scale, found_inf=found_inf)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert all(opt.state[p]["step"].item() == 4 for p in ps)
    assert all(not torch.equal(p, b) for p, b in zip(ps, before))
    assert opt.last_found_inf.item() == 0.0
