"""fusetrain.LossScaler against torch.amp.GradScaler, and the precision policy.

Each comparison trains two copies of a small ReLU MLP step by step: one with
``LossScaler`` and a fusetrain optimizer (fused path: the optimizer unscales,
checks and skips on the device) or a torch optimizer (unfused path), the other
with ``GradScaler`` and the matching ``torch.optim`` optimizer
(``foreach=False``). Inf/NaN gradients are injected at chosen iterations. After
every iteration the scale, the growth tracker and the skipped steps must be
identical (the scale is a power of two, so unscaling is exact) and the params
equal to rounding: the fused kernels follow torch's single-tensor element
order, and the only differences are ulps that the next backward passes on
(RTOL below). Where both sides run the same arithmetic the params must be
bit-identical.
"""

import copy
import math
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fusetrain
from fusetrain import LossScaler, Precision, resolve_precision
from fusetrain.amp import SCALE_FLOOR
from fusetrain.optim import SGD, Adam, AdamW, Lion

from _test_helpers import CUDA, DEVICES

# fp32 params after <= 30 coupled steps (the params feed the next backward): a
# few ulps of O(1) values, measured ~5e-8 absolute.
RTOL = dict(rtol=1e-5, atol=1e-6)
ITERS = 30
# Iteration -> injected value; two consecutive bad steps back off twice.
INJECT = {3: "inf", 4: "nan", 11: "-inf", 20: "nan", 27: "inf"}
GROWTH_INTERVAL = 4


SEED = 20240613  # conftest.py seeds torch with it before each test


# ---- helpers ---------------------------------------------------------------------------


def make_model(device="cpu"):
    # No Linear -> BatchNorm (a noise-level bias gradient could diverge).
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 12), nn.Tanh(), nn.Linear(12, 4)).to(device)


def make_data(device="cpu", n=ITERS, target_scale=1.0):
    return [(torch.randn(32, 8, device=device), torch.randn(32, 4, device=device) * target_scale) for _ in range(n)]


def poison(model, value):
    """Put one non-finite value in the first layer's weight gradient."""
    model[0].weight.grad[1, 2] = float(value)


def params_of(model):
    return [p.detach().clone() for p in model.parameters()]


def assert_params_close(m1, m2, exact=False, what=""):
    for (n, a), b in zip(m1.named_parameters(), m2.parameters()):
        if exact:
            assert torch.equal(a, b), f"{what}: {n} differs by {(a - b).abs().max().item()}"
        else:
            torch.testing.assert_close(a, b, **RTOL, msg=lambda m: f"{what}: {n}: {m}")


def backward(model, scaler, x, y, inject=None):
    loss = F.mse_loss(model(x), y)
    (loss if scaler is None else scaler.scale(loss)).backward()
    if inject is not None:
        poison(model, inject)
    return loss


def expected_trajectory(init_scale, growth_interval, bad_steps, iters):
    """GradScaler's rules in plain Python: (scale, tracker) after each update."""
    scale, tracker, out = init_scale, 0, []
    for i in range(iters):
        if i in bad_steps:
            scale, tracker = scale * 0.5, 0
        else:
            tracker += 1
            if tracker == growth_interval:
                scale, tracker = scale * 2.0, 0
        out.append((scale, tracker))
    return out


def run_against_grad_scaler(make_ours, make_ref, device, pre_step=None, post_step=None, data=None, inject=INJECT,
                            exact=False, init_scale=2.0**16):
    """Train (LossScaler, fusetrain/torch opt) and (GradScaler, torch opt) in
    lockstep and check the per-iteration invariants. ``pre_step(model, opt,
    scaler)`` runs between backward and step on both sides, ``post_step``
    between step and update."""
    model = make_model(device)
    ref_model = copy.deepcopy(model)
    opt, ref_opt = make_ours(model.parameters()), make_ref(ref_model.parameters())
    ls = LossScaler(init_scale=init_scale, growth_interval=GROWTH_INTERVAL)
    gs = torch.amp.GradScaler(device, init_scale=init_scale, growth_interval=GROWTH_INTERVAL)
    data = make_data(device) if data is None else data
    skipped = 0
    expected = expected_trajectory(init_scale, GROWTH_INTERVAL, inject, len(data))
    for i, (x, y) in enumerate(data):
        before = params_of(model), params_of(ref_model)
        for m, o, s in ((model, opt, ls), (ref_model, ref_opt, gs)):
            o.zero_grad(set_to_none=True)
            backward(m, s, x, y, inject.get(i))
            if pre_step is not None:
                pre_step(m, o, s)
            s.step(o)
            if post_step is not None:
                post_step(m, o, s)
            s.update()
        bad = i in inject
        skipped += bad
        assert ls.get_scale() == gs.get_scale() == expected[i][0], f"iteration {i}"
        assert ls._get_growth_tracker() == gs._get_growth_tracker() == expected[i][1], f"iteration {i}"
        assert ls.last_step_skipped.item() == float(bad), f"iteration {i}"
        assert ls.skipped_steps.item() == float(skipped), f"iteration {i}"
        for m, old in ((model, before[0]), (ref_model, before[1])):
            same = [torch.equal(p, q) for p, q in zip(m.parameters(), old)]
            assert all(same) if bad else not any(same), f"iteration {i}: skipped={bad}, unchanged={same}"
        assert_params_close(model, ref_model, exact=exact, what=f"iteration {i}")
    assert skipped == len(inject)
    return model, ref_model, opt, ref_opt, ls, gs


FUSED_VS_TORCH = {
    "AdamW": (lambda ps: AdamW(ps, lr=1e-2, weight_decay=0.1),
              lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=False)),
    "Adam-amsgrad": (lambda ps: Adam(ps, lr=1e-2, amsgrad=True, weight_decay=1e-3),
                     lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True, weight_decay=1e-3, foreach=False)),
    "SGD-momentum": (lambda ps: SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-3),
                     lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-3, foreach=False)),
    "SGD-nesterov": (lambda ps: SGD(ps, lr=0.05, momentum=0.9, nesterov=True),
                     lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, foreach=False)),
}


# ---- trajectories against GradScaler -------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(FUSED_VS_TORCH))
def test_fused_optimizer_matches_grad_scaler(device, name):
    make_ours, make_ref = FUSED_VS_TORCH[name]
    _, _, opt, _, ls, _ = run_against_grad_scaler(make_ours, make_ref, device)
    # The fused path takes its non-finite flag from the optimizer's own check.
    assert opt.last_found_inf is not None and opt.last_found_inf.item() == 0.0
    assert ls.get_scale_tensor().device.type == device


@pytest.mark.parametrize("device", DEVICES)
def test_torch_optimizer_through_loss_scaler_is_bit_identical(device):
    # Unfused path: the same unscale op and the same optimizer as GradScaler.
    make = lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, foreach=False)  # noqa: E731
    run_against_grad_scaler(make, make, device, exact=True)


@pytest.mark.parametrize("device", DEVICES)
def test_torch_adamw_through_loss_scaler_is_bit_identical(device):
    make = lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=False)  # noqa: E731
    run_against_grad_scaler(make, make, device, exact=True)


@pytest.mark.parametrize("device", DEVICES)
def test_lion_fused_matches_manual_unscaled_steps(device):
    # torch has no Lion: compare with the same fusetrain optimizer stepped on
    # the unscaled loss, skipping the injected iterations by hand. The scale is
    # a power of two, so the scaled gradients times 1/scale are exactly the
    # unscaled ones and the params must be bit-identical.
    model = make_model(device)
    ref_model = copy.deepcopy(model)
    opt = Lion(model.parameters(), lr=1e-3, weight_decay=0.1)
    ref_opt = Lion(ref_model.parameters(), lr=1e-3, weight_decay=0.1)
    ls = LossScaler(growth_interval=GROWTH_INTERVAL)
    expected = expected_trajectory(2.0**16, GROWTH_INTERVAL, INJECT, ITERS)
    for i, (x, y) in enumerate(make_data(device)):
        opt.zero_grad()
        before = params_of(model)
        backward(model, ls, x, y, INJECT.get(i))
        ls.step(opt)
        ls.update()
        ref_opt.zero_grad()
        backward(ref_model, None, x, y)
        if i not in INJECT:
            ref_opt.step()
        assert (ls.get_scale(), ls._get_growth_tracker()) == expected[i]
        assert ls.last_step_skipped.item() == float(i in INJECT)
        if i in INJECT:
            assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
        assert_params_close(model, ref_model, exact=True, what=f"iteration {i}")
    for p, q in zip(opt.state.values(), ref_opt.state.values()):
        assert torch.equal(p["exp_avg"], q["exp_avg"]) and torch.equal(p["step"], q["step"])
    assert opt.state[next(model.parameters())]["step"].item() == ITERS - len(INJECT)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["AdamW", "SGD-momentum"])
def test_user_unscale_and_clip_grad_norm(device, name):
    # unscale_ + clip_grad_norm_ by the user, then step: the fused step only
    # receives the non-finite flag found by unscale_.
    make_ours, make_ref = FUSED_VS_TORCH[name]
    norms = []

    def pre_step(model, opt, scaler):
        scaler.unscale_(opt)
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5))

    run_against_grad_scaler(make_ours, make_ref, device, pre_step=pre_step, data=make_data(device, target_scale=4.0))
    ours, ref = norms[0::2], norms[1::2]
    clipped = 0
    for i, (a, b) in enumerate(zip(ours, ref)):
        if i not in INJECT:
            assert a.item() == pytest.approx(b.item(), rel=1e-5), f"iteration {i}"
            clipped += b.item() > 0.5
    assert clipped >= ITERS // 2, "clipping must be active in most iterations"


@pytest.mark.parametrize("device", DEVICES)
def test_user_unscale_leaves_gradients_as_grad_scaler(device):
    model = make_model(device)
    ref_model = copy.deepcopy(model)
    opt, ref_opt = AdamW(model.parameters()), torch.optim.AdamW(ref_model.parameters(), foreach=False)
    ls, gs = LossScaler(init_scale=1024.0), torch.amp.GradScaler(device, init_scale=1024.0)
    x, y = make_data(device, n=1)[0]
    backward(model, ls, x, y)
    backward(ref_model, gs, x, y)
    ls.unscale_(opt)
    gs.unscale_(ref_opt)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p.grad, q.grad)
    ls.step(opt)
    gs.step(ref_opt)
    ls.update()
    gs.update()
    assert ls.get_scale() == gs.get_scale() == 1024.0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["AdamW", "SGD-momentum"])
def test_max_grad_norm_equals_unscale_and_clip(device, name):
    # The optimizer's max_grad_norm with LossScaler.step == GradScaler +
    # unscale_ + clip_grad_norm_ + step.
    kw = {"AdamW": dict(lr=1e-2, weight_decay=0.1), "SGD-momentum": dict(lr=0.05, momentum=0.9)}[name]
    ours_cls = {"AdamW": AdamW, "SGD-momentum": SGD}[name]
    torch_cls = {"AdamW": torch.optim.AdamW, "SGD-momentum": torch.optim.SGD}[name]
    ref_norms = []

    def pre_step(model, opt, scaler):
        if isinstance(scaler, torch.amp.GradScaler):
            scaler.unscale_(opt)
            ref_norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5))

    our_norms = []

    def post_step(model, opt, scaler):
        if isinstance(scaler, LossScaler):
            # The fused step's own norm of the unscaled grads (a device tensor).
            assert opt.last_grad_norm.dim() == 0 and opt.last_grad_norm.device.type == device
            our_norms.append(opt.last_grad_norm.clone())

    run_against_grad_scaler(lambda ps: ours_cls(ps, max_grad_norm=0.5, **kw),
                            lambda ps: torch_cls(ps, foreach=False, **kw), device, pre_step=pre_step,
                            post_step=post_step, data=make_data(device, target_scale=4.0))
    assert len(our_norms) == len(ref_norms) == ITERS
    clipped = 0
    for i, (a, b) in enumerate(zip(our_norms, ref_norms)):
        if i in INJECT:
            assert not math.isfinite(a.item()), f"iteration {i}: the norm of non-finite grads must not be finite"
        else:
            assert a.item() == pytest.approx(b.item(), rel=1e-5), f"iteration {i}"
            clipped += b.item() > 0.5
    assert clipped >= ITERS // 2, "clipping must be active in most iterations"


@pytest.mark.parametrize("device", DEVICES)
def test_multiple_optimizers_one_scaler(device):
    # Three optimizers on three parts of the model (fused AdamW, fused SGD,
    # torch SGD): an optimizer skips only when its own grads are not finite
    # (as GradScaler), and the scale backs off when any of them saw inf/NaN.
    inject_part = {3: 0, 8: 1, 9: 2, 15: 0, 16: 1, 22: 2}
    model = make_model(device)
    ref_model = copy.deepcopy(model)

    def parts(m):
        return [list(m[0].parameters()), list(m[2].parameters()), list(m[4].parameters())]

    opts = [AdamW(parts(model)[0], lr=1e-2), SGD(parts(model)[1], lr=0.05, momentum=0.9),
            torch.optim.SGD(parts(model)[2], lr=0.05, foreach=False)]
    ref_opts = [torch.optim.AdamW(parts(ref_model)[0], lr=1e-2, foreach=False),
                torch.optim.SGD(parts(ref_model)[1], lr=0.05, momentum=0.9, foreach=False),
                torch.optim.SGD(parts(ref_model)[2], lr=0.05, foreach=False)]
    ls = LossScaler(growth_interval=GROWTH_INTERVAL)
    gs = torch.amp.GradScaler(device, growth_interval=GROWTH_INTERVAL)
    expected = expected_trajectory(2.0**16, GROWTH_INTERVAL, inject_part, ITERS)
    for i, (x, y) in enumerate(make_data(device)):
        before = [[p.clone() for p in part] for part in parts(model)]
        for m, os_, s in ((model, opts, ls), (ref_model, ref_opts, gs)):
            for o in os_:
                o.zero_grad()
            s.scale(F.mse_loss(m(x), y)).backward()
            if i in inject_part:
                parts(m)[inject_part[i]][0].grad.view(-1)[0] = float("nan")
            for o in os_:
                s.step(o)
            s.update()
        assert ls.get_scale() == gs.get_scale() == expected[i][0], f"iteration {i}"
        assert ls._get_growth_tracker() == gs._get_growth_tracker() == expected[i][1]
        assert ls.last_step_skipped.item() == float(i in inject_part)
        for k, (part, old) in enumerate(zip(parts(model), before)):
            unchanged = all(torch.equal(p, q) for p, q in zip(part, old))
            assert unchanged == (inject_part.get(i) == k), f"iteration {i}, part {k}"
        assert_params_close(model, ref_model, what=f"iteration {i}")
    assert ls.skipped_steps.item() == len(inject_part)


@pytest.mark.parametrize("device", DEVICES)
def test_fp16_autocast_overflow_backs_off(device):
    # Real overflow: a 2**40 scale overflows the fp16 activation gradients of
    # autocast until the scale has backed off; both scalers skip the same
    # iterations, then train alike (fp16 activations: tolerance of fp16).
    if device == "cpu" and not torch.amp.autocast_mode.is_autocast_available("cpu"):
        pytest.skip("no CPU autocast")
    model = make_model(device)
    ref_model = copy.deepcopy(model)
    opt = AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-3, foreach=False)
    prec = Precision("fp16", device)
    ls = prec.make_scaler(init_scale=2.0**40, growth_interval=1000)
    gs = torch.amp.GradScaler(device, init_scale=2.0**40, growth_interval=1000)
    skipped = []
    for i, (x, y) in enumerate(make_data(device, n=40)):
        for m, o, s in ((model, opt, ls), (ref_model, ref_opt, gs)):
            o.zero_grad()
            with prec.autocast():
                out = m(x)
                assert out.dtype == torch.float16
                loss = F.mse_loss(out.float(), y)
            s.scale(loss).backward()
            s.step(o)
            s.update()
        assert ls.get_scale() == gs.get_scale(), f"iteration {i}"
        skipped.append(ls.last_step_skipped.item())
    first_clean = skipped.index(0.0)
    assert first_clean >= 10, "the initial scale must overflow fp16 for a while"
    assert skipped[first_clean:].count(0.0) >= 10, "then the run must train"
    n_skipped = int(sum(skipped))
    assert ls.skipped_steps.item() == n_skipped
    assert ls.get_scale() == 2.0 ** (40 - n_skipped)
    torch.testing.assert_close(list(model.parameters()), list(ref_model.parameters()), rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_master_weights_fp16_params_skip_on_overflow(device):
    # fp16 params with fp32 master weights: a skipped step leaves params,
    # masters and state bit-identical; a clean step moves them.
    ps = [torch.randn(s, device=device).half().requires_grad_() for s in [(7,), (3, 5), (1031,)]]
    opt = AdamW(ps, lr=1e-2, master_weights=True)
    ls = LossScaler(init_scale=2.0**10)
    for i in range(6):
        opt.zero_grad()
        loss = sum((p.float() * torch.randn(p.shape, device=device)).sum() for p in ps)
        ls.scale(loss).backward()
        if i in (2, 3):
            ps[1].grad[0, 0] = float("inf")
        before = [p.clone() for p in ps], [opt.state[p].get("master_param") for p in ps]
        before_masters = [None if t is None else t.clone() for t in before[1]]
        ls.step(opt)
        ls.update()
        changed = [not torch.equal(p, q) for p, q in zip(ps, before[0])]
        if i in (2, 3):
            assert not any(changed)
            assert all(torch.equal(opt.state[p]["master_param"], m) for p, m in zip(ps, before_masters))
        else:
            assert all(changed)
        for p in ps:
            assert opt.state[p]["master_param"].dtype == torch.float32
            assert torch.equal(opt.state[p]["master_param"].half(), p)
    assert ls.skipped_steps.item() == 2.0
    assert opt.state[ps[0]]["step"].item() == 4.0


# ---- state dicts -----------------------------------------------------------------------


def _continue(scaler, opt, model, data, inject):
    traj = []
    for i, (x, y) in enumerate(data):
        opt.zero_grad()
        backward(model, scaler, x, y, inject.get(i))
        scaler.step(opt)
        scaler.update()
        traj.append((scaler.get_scale(), scaler._get_growth_tracker()))
    return traj


@pytest.mark.parametrize("direction", ["grad_scaler_to_loss_scaler", "loss_scaler_to_grad_scaler"])
@pytest.mark.parametrize("load_before_first_scale", [True, False])
def test_state_dict_interchange(direction, load_before_first_scale):
    # Save after 6 iterations (tracker 2 of 4, scale backed off once), load
    # into the other class and continue both: identical trajectories.
    data = make_data()
    first, rest = data[:6], data[6:]
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, foreach=False)
    if direction == "grad_scaler_to_loss_scaler":
        src = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=GROWTH_INTERVAL, growth_factor=4.0,
                                   backoff_factor=0.25)
        dst = LossScaler(init_scale=3.0, growth_interval=99)
    else:
        src = LossScaler(init_scale=2.0**12, growth_interval=GROWTH_INTERVAL, growth_factor=4.0, backoff_factor=0.25)
        dst = torch.amp.GradScaler("cpu", init_scale=3.0, growth_interval=99)
    _continue(src, opt, model, first, {3: "inf"})
    sd = src.state_dict()
    assert sd == {"scale": 2.0**12 * 0.25, "growth_factor": 4.0, "backoff_factor": 0.25,
                  "growth_interval": GROWTH_INTERVAL, "_growth_tracker": 2}
    if not load_before_first_scale:
        # A scaler that already has a device scale takes the loaded values too.
        x, y = data[0]
        dst.scale(F.mse_loss(model(x), y))
    dst.load_state_dict(copy.deepcopy(sd))
    assert dst.state_dict() == sd
    model2 = copy.deepcopy(model)
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.01, foreach=False)
    opt2.load_state_dict(opt.state_dict())
    inject = {2: "nan", 8: "inf"}
    t_src = _continue(src, opt, model, rest, inject)
    t_dst = _continue(dst, opt2, model2, rest, inject)
    assert t_src == t_dst
    # The loaded tracker (2 of 4) carries on: the scale grows after two more clean steps.
    assert t_src[:3] == [(2.0**10, 3), (2.0**12, 0), (2.0**10, 0)]
    assert_params_close(model, model2, exact=True)


def test_state_dict_torch_save_round_trip(tmp_path):
    ls = LossScaler(init_scale=256.0, growth_interval=3)
    model = make_model()
    opt = AdamW(model.parameters())
    _continue(ls, opt, model, make_data(n=5), {1: "inf"})
    torch.save(ls.state_dict(), tmp_path / "scaler.pt")
    sd = torch.load(tmp_path / "scaler.pt")
    assert all(not isinstance(v, torch.Tensor) for v in sd.values()), "plain Python values, like GradScaler"
    other = LossScaler()
    other.load_state_dict(sd)
    assert other.get_scale() == ls.get_scale() == 256.0 and other._get_growth_tracker() == ls._get_growth_tracker()
    assert other.get_growth_interval() == 3


def test_load_state_dict_errors():
    with pytest.raises(RuntimeError, match="empty"):
        LossScaler().load_state_dict({})
    with pytest.raises(KeyError, match="_growth_tracker"):
        LossScaler().load_state_dict({"scale": 2.0, "growth_factor": 2.0, "backoff_factor": 0.5,
                                      "growth_interval": 10})


GOOD_STATE = {"scale": 1024.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 10,
              "_growth_tracker": 3}


@pytest.mark.parametrize("key,value", [
    ("scale", 0.0), ("scale", -1.0), ("scale", float("inf")), ("scale", float("nan")), ("scale", 2.0**-127),
    ("scale", "1024"), ("growth_factor", 1.0), ("growth_factor", 0.5), ("growth_factor", float("inf")),
    ("backoff_factor", 1.5), ("backoff_factor", 1.0), ("backoff_factor", 0.0), ("growth_interval", 0),
    ("growth_interval", 2.5), ("growth_interval", True), ("_growth_tracker", -1), ("_growth_tracker", 1.5),
])
@pytest.mark.parametrize("after_first_scale", [False, True])
def test_load_state_dict_checks_like_the_constructor(key, value, after_first_scale):
    # A bad value names the key and the allowed values, and changes nothing:
    # the scaler steps on as before (a scale of 0 would write NaN into the weights).
    ls = LossScaler(init_scale=256.0, growth_interval=4)
    model = make_model()
    opt = AdamW(model.parameters())
    if after_first_scale:
        _continue(ls, opt, model, make_data(n=2), {})
    before = ls.state_dict()
    # A value of the wrong type is a TypeError (fusetrain/_checks.py), the others ValueErrors.
    with pytest.raises((TypeError, ValueError), match=rf"state_dict\['{key}'\] must be .*got .*{re.escape(repr(value))}"):
        ls.load_state_dict({**GOOD_STATE, key: value})
    assert ls.state_dict() == before
    _continue(ls, opt, model, make_data(n=2), {})
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_load_state_dict_takes_the_floor_and_one_element_tensors():
    ls = LossScaler()
    ls.load_state_dict({**GOOD_STATE, "scale": torch.tensor(2.0**-126), "_growth_tracker": torch.tensor(2)})
    assert ls.get_scale() == SCALE_FLOOR and ls._get_growth_tracker() == 2


# ---- error paths -----------------------------------------------------------------------


def _scaled_backward(model, ls):
    x, y = make_data(n=1)[0]
    backward(model, ls, x, y)


@pytest.mark.parametrize("fused", [True, False])
def test_unscale_twice_raises(fused):
    model = make_model()
    opt = AdamW(model.parameters()) if fused else torch.optim.AdamW(model.parameters())
    ls = LossScaler()
    _scaled_backward(model, ls)
    ls.unscale_(opt)
    with pytest.raises(RuntimeError, match=r"unscale_\(\) has already been called"):
        ls.unscale_(opt)


@pytest.mark.parametrize("fused", [True, False])
def test_step_twice_and_unscale_after_step_raise(fused):
    model = make_model()
    opt = AdamW(model.parameters()) if fused else torch.optim.AdamW(model.parameters())
    ls = LossScaler()
    _scaled_backward(model, ls)
    ls.step(opt)
    after_one = params_of(model)
    with pytest.raises(RuntimeError, match=r"step\(\) has already been called"):
        ls.step(opt)
    with pytest.raises(RuntimeError, match=r"unscale_\(\) is being called after step\(\)"):
        ls.unscale_(opt)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), after_one)), "no second step"
    ls.update()
    # After update() the optimizer can be stepped again.
    opt.zero_grad()
    _scaled_backward(model, ls)
    ls.step(opt)
    ls.update()


def test_update_without_step_raises():
    model = make_model()
    ls = LossScaler()
    _scaled_backward(model, ls)
    with pytest.raises(RuntimeError, match="no inf checks were recorded"):
        ls.update()


def test_calls_before_scale_raise():
    model = make_model()
    opt = AdamW(model.parameters())
    ls = LossScaler()
    for fn in (lambda: ls.step(opt), lambda: ls.unscale_(opt), ls.update):
        with pytest.raises(RuntimeError, match=r"call scale\(loss\) first"):
            fn()
    assert ls.get_scale_tensor() is None and ls.last_step_skipped is None and ls.skipped_steps is None
    assert ls.get_scale() == 2.0**16


def test_step_with_closure_raises():
    model = make_model()
    opt = AdamW(model.parameters())
    ls = LossScaler()
    _scaled_backward(model, ls)
    with pytest.raises(RuntimeError, match="closure"):
        ls.step(opt, closure=lambda: 0.0)


@pytest.mark.parametrize("kwargs,name", [
    (dict(init_scale=0.0), "init_scale"), (dict(init_scale=-1.0), "init_scale"),
    (dict(init_scale=float("inf")), "init_scale"), (dict(init_scale=float("nan")), "init_scale"),
    (dict(init_scale="1024"), "init_scale"), (dict(init_scale=True), "init_scale"),
    (dict(growth_factor=1.0), "growth_factor"), (dict(growth_factor=0.5), "growth_factor"),
    (dict(growth_factor=float("inf")), "growth_factor"),
    (dict(backoff_factor=1.0), "backoff_factor"), (dict(backoff_factor=0.0), "backoff_factor"),
    (dict(backoff_factor=1.5), "backoff_factor"),
    (dict(growth_interval=0), "growth_interval"), (dict(growth_interval=-5), "growth_interval"),
    (dict(growth_interval=2.5), "growth_interval"), (dict(growth_interval=True), "growth_interval"),
])
def test_bad_constructor_args(kwargs, name):
    with pytest.raises((TypeError, ValueError), match=name):
        LossScaler(**kwargs)


def test_enabled_must_be_bool():
    with pytest.raises(TypeError, match="enabled"):
        LossScaler(enabled="yes")


def test_setters_validate():
    ls = LossScaler()
    ls.set_growth_factor(3.0)
    ls.set_backoff_factor(0.25)
    ls.set_growth_interval(7)
    assert (ls.get_growth_factor(), ls.get_backoff_factor(), ls.get_growth_interval()) == (3.0, 0.25, 7)
    with pytest.raises(ValueError, match="growth_factor"):
        ls.set_growth_factor(1.0)
    with pytest.raises(ValueError, match="backoff_factor"):
        ls.set_backoff_factor(2.0)
    with pytest.raises(ValueError, match="growth_interval"):
        ls.set_growth_interval(0)


def test_scale_rejects_non_tensors_and_maps_sequences():
    ls = LossScaler(init_scale=8.0)
    a, b = torch.tensor(1.5), torch.tensor([2.0, 3.0])
    out = ls.scale((a, [b, a]))
    assert isinstance(out, tuple) and isinstance(out[1], list)
    assert out[0].item() == 12.0 and out[1][0].tolist() == [16.0, 24.0] and out[1][1].item() == 12.0
    with pytest.raises(TypeError, match="outputs must be a tensor"):
        ls.scale(3.0)


def test_update_with_new_scale():
    model = make_model()
    opt = SGD(model.parameters(), lr=0.01)
    ls, gs = LossScaler(), torch.amp.GradScaler("cpu")
    ref_model = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.01)
    x, y = make_data(n=1)[0]
    for m, o, s, new in ((model, opt, ls, 512.0), (ref_model, ref_opt, gs, 512.0)):
        backward(m, s, x, y)
        s.step(o)
        s.update(new)
    assert ls.get_scale() == gs.get_scale() == 512.0
    ls.update(torch.tensor([128.0]))
    assert ls.get_scale() == 128.0
    for bad in (0.0, -2.0, float("inf")):
        with pytest.raises(ValueError, match="new_scale"):
            ls.update(bad)
    with pytest.raises(ValueError, match="one element"):
        ls.update(torch.tensor([1.0, 2.0]))


# ---- disabled scaler -------------------------------------------------------------------


@pytest.mark.parametrize("fused", [True, False])
def test_disabled_scaler_is_pass_through(fused):
    model = make_model()
    ref_model = copy.deepcopy(model)
    make = (lambda ps: AdamW(ps, lr=1e-2)) if fused else (lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=False))
    opt, ref_opt = make(model.parameters()), make(ref_model.parameters())
    ls = LossScaler(enabled=False)
    assert not ls.is_enabled()
    for i, (x, y) in enumerate(make_data(n=5)):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        assert ls.scale(loss) is loss
        ls.scale(loss).backward()
        ls.unscale_(opt)
        ls.step(opt)
        ls.update()
        ref_opt.zero_grad()
        F.mse_loss(ref_model(x), y).backward()
        ref_opt.step()
        assert_params_close(model, ref_model, exact=True, what=f"iteration {i}")
    # Closures pass through too.
    assert ls.step(opt, lambda: torch.tensor(7.0)).item() == 7.0
    assert ls.get_scale() == 1.0
    assert ls.get_scale_tensor() is None
    assert ls.state_dict() == {}
    ls.load_state_dict({})  # no-op, like GradScaler
    seq = [torch.tensor(1.0), torch.tensor(2.0)]
    assert ls.scale(seq) is seq


# ---- device flags ------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_skip_flags_are_device_tensors(device):
    model = make_model(device)
    opt = SGD(model.parameters(), lr=0.01)
    ls = LossScaler()
    bad = {1, 2, 5}
    seen = []
    for i, (x, y) in enumerate(make_data(device, n=8)):
        opt.zero_grad()
        backward(model, ls, x, y, "nan" if i in bad else None)
        ls.step(opt)
        ls.update()
        for t in (ls.last_step_skipped, ls.skipped_steps, ls.get_scale_tensor()):
            assert isinstance(t, torch.Tensor) and t.dim() == 0 and t.dtype == torch.float32
            assert t.device.type == device
        seen.append(ls.last_step_skipped.item())
        assert ls.skipped_steps.item() == sum(1 for j in bad if j <= i)
    assert seen == [float(i in bad) for i in range(8)]
    assert ls._growth_tracker.dtype == torch.int32 and ls._growth_tracker.device.type == device


def test_scale_lives_on_the_given_device():
    ls = LossScaler(device="cpu", init_scale=4.0)
    out = ls.scale(torch.tensor(2.0))
    assert out.item() == 8.0 and ls.get_scale_tensor().device == torch.device("cpu")


@CUDA
def test_step_does_not_synchronize_with_host():
    model = make_model("cuda")
    opt = AdamW(model.parameters(), lr=1e-2, max_grad_norm=1.0)
    ls = LossScaler()
    x, y = make_data("cuda", n=1)[0]
    backward(model, ls, x, y)
    ls.step(opt)
    ls.update()
    opt.zero_grad()
    backward(model, ls, x, y, "inf")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ls.step(opt)
        ls.update()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert ls.last_step_skipped.item() == 1.0


# ---- bf16 warning ------------------------------------------------------------------------


def test_warns_once_under_bf16_autocast():
    model = make_model()
    ls = LossScaler()
    x, y = make_data(n=1)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.mse_loss(model(x).float(), y)
        with pytest.warns(UserWarning, match="bfloat16 autocast"):
            ls.scale(loss)
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            ls.scale(loss)
            ls.scale(loss)
    assert not [w for w in rec if "bfloat16" in str(w.message)], "the warning is emitted once"


def test_no_warning_without_bf16_autocast():
    model = make_model()
    x, y = make_data(n=1)[0]
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        ls = LossScaler()
        ls.scale(F.mse_loss(model(x), y))
        with torch.autocast("cpu", dtype=torch.float16):
            ls.scale(F.mse_loss(model(x).float(), y))
    assert not [w for w in rec if "bfloat16" in str(w.message)]


# ---- precision policy ----------------------------------------------------------------------


@pytest.mark.parametrize("setting,name", [
    (False, "fp32"), (None, "fp32"), ("fp32", "fp32"), ("float32", "fp32"), ("no", "fp32"), ("none", "fp32"),
    (True, "bf16"), ("bf16", "bf16"), ("bfloat16", "bf16"), ("BF16", "bf16"),
    ("fp16", "fp16"), ("float16", "fp16"), ("half", "fp16"), ("FP16", "fp16"),
])
def test_resolve_precision_cpu(setting, name):
    prec = resolve_precision(setting, "cpu")
    assert prec == Precision(name, "cpu")
    assert prec.device_type == "cpu"
    assert prec.dtype == {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[name]
    assert prec.uses_scaler == (name == "fp16")
    assert resolve_precision(setting, torch.device("cpu")) == prec


@CUDA
def test_resolve_precision_true_on_cuda():
    expected = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    assert resolve_precision(True, "cuda") == Precision(expected, "cuda")
    assert resolve_precision("fp16", "cuda:0") == Precision("fp16", "cuda")


@pytest.mark.parametrize("setting", ["fp8", "", "mixed", 1, 0, 16, 2.0, torch.float16])
def test_resolve_precision_rejects(setting):
    with pytest.raises(ValueError, match=r"allowed: False, True .*'fp16', 'bf16' or 'fp32'"):
        resolve_precision(setting, "cpu")


def test_precision_rejects_unknown_name():
    with pytest.raises(ValueError, match="'fp32', 'fp16', 'bf16'"):
        Precision("int8", "cpu")


def test_precision_autocast_and_scaler():
    x = torch.randn(4, 8)
    w = torch.randn(8, 3)
    fp32, bf16, fp16 = Precision("fp32", "cpu"), Precision("bf16", "cpu"), Precision("fp16", "cpu")
    with fp32.autocast():
        assert not torch.is_autocast_enabled("cpu")
        assert (x @ w).dtype == torch.float32
    with bf16.autocast():
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
        assert (x @ w).dtype == torch.bfloat16
    with fp16.autocast():
        assert torch.get_autocast_dtype("cpu") == torch.float16
        assert (x @ w).dtype == torch.float16
    assert not torch.is_autocast_enabled("cpu")
    s16 = fp16.make_scaler(init_scale=128.0, growth_interval=10)
    assert isinstance(s16, LossScaler) and s16.is_enabled()
    assert s16.get_scale() == 128.0 and s16.get_growth_interval() == 10
    for prec in (fp32, bf16):
        s = prec.make_scaler()
        assert not s.is_enabled()
        loss = torch.tensor(3.0)
        assert s.scale(loss) is loss


def test_exports():
    assert fusetrain.LossScaler is LossScaler and fusetrain.Precision is Precision
    assert fusetrain.resolve_precision is resolve_precision


def test_optimizer_without_grads_does_not_reuse_previous_flag():
    a, b = nn.Parameter(torch.randn(3)), nn.Parameter(torch.randn(3))
    opt = SGD([a], lr=0.1)
    ls = LossScaler(growth_interval=100)
    ls.scale((a * 2).sum()).backward()
    a.grad[0] = float("inf")
    ls.step(opt)
    ls.update()
    assert ls.skipped_steps.item() == 1.0
    opt.zero_grad(set_to_none=True)
    ls.scale((b * 2).sum()).backward()  # this iteration's loss does not reach ``a``
    try:
        ls.step(opt)
        ls.update()
    except RuntimeError:
        pass  # GradScaler refuses too ("No inf checks were recorded for this optimizer")
    assert ls.skipped_steps.item() == 1.0 and ls.get_scale() == 2.0**15
