"""Schedulable optimizer settings read on the device (NOTE [device values] in
csrc/common/update_launch.h): the kernels read each group's betas, momentum,
weight decay, eps ... from its float64 values tensor; a schedule of them
through ``param_groups`` matches torch.optim, and a compiled step follows it
without recompiling."""

import copy

import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounter

import fusetrain
from _optim_helpers import assert_params_close
from _test_helpers import CUDA, DEVICES, kind_step_args
from fusetrain import TrainStep, _ops
from fusetrain.optim import SGD, Adam, AdamW, NAdam, RMSprop
from fusetrain.optim._kinds import KINDS

#: Per schedulable kind, two valid settings of its schedulable fields with the same zero/non-zero pattern
#: (the kind's flags from ``extra``): the record says A, the values tensor B.
VARIANTS = {
    "adam": (dict(betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2), dict(betas=(0.8, 0.99), eps=1e-6,
                                                                        weight_decay=0.1), {}),
    "sgd": (dict(momentum=0.9, dampening=0.1, weight_decay=1e-2), dict(momentum=0.5, dampening=0.3,
                                                                       weight_decay=0.1), {}),
    "lion": (dict(betas=(0.9, 0.99), weight_decay=1e-2), dict(betas=(0.8, 0.9), weight_decay=0.1), {}),
    "rmsprop": (dict(alpha=0.99, eps=1e-8, weight_decay=1e-2, momentum=0.9),
                dict(alpha=0.9, eps=1e-6, weight_decay=0.1, momentum=0.5), dict(centered=True)),
    "adadelta": (dict(rho=0.9, eps=1e-6, weight_decay=1e-2), dict(rho=0.8, eps=1e-4, weight_decay=0.1), {}),
    "radam": (dict(betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2), dict(betas=(0.8, 0.99), eps=1e-6,
                                                                         weight_decay=0.1), {}),
    "nadam": (dict(betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, momentum_decay=4e-3),
              dict(betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1, momentum_decay=1e-2), {}),
}


def _fields(kind, settings):
    out = dict(settings)
    if "betas" in out:
        out["beta1"], out["beta2"] = out.pop("betas")
    return out


def _group(kind, device, settings, extra):
    """One group of ``kind``: params, grads, steps and its states (from the kind table), all seeded alike."""
    torch.manual_seed(11)
    shapes = [(5,), (7, 3), (1031,)]
    params = [torch.randn(s, device=device) for s in shapes]
    fields = dict(_fields(kind, settings), **extra)
    states = [[], [], []]
    for st in KINDS[kind]["states"]:
        when = st["when"]
        if when is not None and (float(fields.get(when, 0.0)) != 0.0) != st["when_set"]:
            continue
        start = st["initial"] if st["initial_when"] is None or fields.get(st["initial_when"]) else 0.0
        shape = (lambda p: ()) if st["scalar"] else (lambda p: p.shape)
        states[st["slot"]] = [torch.full(shape(p), start, device=device) for p in params]
    while states and not states[-1]:
        states.pop()
    return params, [torch.full((), 0.0, device=device) for _ in params], states, fields


def test_every_schedulable_kind_has_a_case():
    assert set(VARIANTS) == {k for k, v in KINDS.items() if v["value_fields"]}
    for kind, (a, b, _) in VARIANTS.items():
        assert set(_fields(kind, a)) == set(_fields(kind, b)) == set(KINDS[kind]["value_fields"]), kind


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", sorted(VARIANTS))
def test_kernels_read_the_values_tensor(kind, device):
    """A step whose record says A and whose values tensor says B equals a step whose record says B."""
    a, b, extra = VARIANTS[kind]
    lr = torch.tensor(0.01, device=device)
    runs = []
    for record, values in ((b, None), (a, b)):
        params, steps, states, fields = _group(kind, device, record, extra)
        for i in range(3):
            g = torch.Generator().manual_seed(i)
            grads = [torch.randn(p.shape, generator=g).to(device) for p in params]
            args, kw = kind_step_args(kind, params, grads, steps, states, lr=lr, **fields)
            if values is not None:
                vf = _fields(kind, values)
                kw["group_values"] = [torch.tensor([float(vf[n]) for n in KINDS[kind]["value_fields"]],
                                                   dtype=torch.float64, device=device)]
            torch.ops.fusetrain.fused_step_(*args, **kw)
        runs.append([t.cpu() for t in params] + [t.cpu() for s in states for t in s])
    for x, y in zip(*runs):
        assert torch.equal(x, y), kind


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_with_group_values(device):
    a, _, extra = VARIANTS["adam"]
    params, steps, states, fields = _group("adam", device, a, extra)
    grads = [torch.randn_like(p) for p in params]
    args, kw = kind_step_args("adam", params, grads, steps, states, lr=torch.tensor(0.01, device=device), **fields)
    kw["group_values"] = [torch.tensor([0.8, 0.99, 0.1, 1e-6], dtype=torch.float64, device=device)]
    torch.library.opcheck(torch.ops.fusetrain.fused_step_, args, kw)


def test_bad_group_values_are_refused_before_anything_is_written():
    a, _, extra = VARIANTS["adam"]
    params, steps, states, fields = _group("adam", "cpu", a, extra)
    before = [p.clone() for p in params]
    grads = [torch.randn_like(p) for p in params]
    args, kw = kind_step_args("adam", params, grads, steps, states, lr=torch.tensor(0.01), **fields)
    for values, match in (([torch.zeros(4)], "float64 vector of 4 values"),
                          ([torch.zeros(3, dtype=torch.float64)], "float64 vector of 4 values"),
                          ([torch.zeros(4, dtype=torch.float64)] * 2, r"one tensor per group \(1\), got 2")):
        with pytest.raises(ValueError, match=match):
            torch.ops.fusetrain.fused_step_(*args, **kw, group_values=values)
    lp, ls, lst, lf = _group("lamb", "cpu", dict(betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01), {})
    largs, lkw = kind_step_args("lamb", lp, [torch.randn_like(p) for p in lp], ls, lst, lr=torch.tensor(0.01), **lf)
    with pytest.raises(ValueError, match="'lamb' has no schedulable fields, but got 1 group_values"):
        torch.ops.fusetrain.fused_step_(*largs, **lkw, group_values=[torch.zeros(4, dtype=torch.float64)])
    assert all(torch.equal(x, y) for x, y in zip(params, before))
    assert all(float(s) == 0.0 for s in steps)


def test_sync_checks_new_values_and_names_the_group():
    p = nn.Parameter(torch.randn(3))
    opt = AdamW([p], lr=0.1)
    opt.param_groups[0]["betas"] = (1.5, 0.999)
    with pytest.raises(ValueError, match=r"AdamW: param group 0: .*beta1 must be in \[0, 1\), got 1.5"):
        opt.sync_hyperparameters()
    opt.param_groups[0]["betas"] = (0.5, 0.999)
    assert opt.sync_hyperparameters()  # what a captured step still reads on the host


# ---- schedules through param_groups, against torch.optim ----------------------------------


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 4))


def _train(model, opt, sched, steps, wd=None):
    g = torch.Generator().manual_seed(5)
    dtype = next(model.parameters()).dtype
    for i in range(steps):
        x, y = torch.randn(8, 12, generator=g).to(dtype), torch.randn(8, 4, generator=g).to(dtype)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        if wd is not None:
            for group in opt.param_groups:
                group["weight_decay"] = wd(i)
        opt.step()
        sched.step()


def _wd(i):
    return 0.05 * (1.0 + i) / 8


@pytest.mark.parametrize("name", ["adamw", "adam", "sgd", "nadam", "rmsprop"])
def test_one_cycle_momentum_and_a_weight_decay_schedule_match_torch(name):
    ours_cls, ref_cls, kw = {
        "adamw": (AdamW, torch.optim.AdamW, {}),
        "adam": (Adam, torch.optim.Adam, {}),
        "sgd": (SGD, torch.optim.SGD, dict(momentum=0.9)),
        "nadam": (NAdam, torch.optim.NAdam, {}),
        "rmsprop": (RMSprop, torch.optim.RMSprop, dict(momentum=0.9)),
    }[name]
    # The reference runs in float64. RMSprop's first steps divide by the root
    # of a tiny square average, which magnifies rounding: torch's own float32
    # RMSprop ends about 1.4e-5 from the float64 run on these params (the
    # others about 1e-7), so its tolerance is wider; a schedule applied wrongly
    # moves the params by 1e-3 or more.
    ref, ours = _model().double(), _model()
    ref_opt, ours_opt = ref_cls(ref.parameters(), lr=0.01, **kw), ours_cls(ours.parameters(), lr=0.01, **kw)
    seen = []

    def wd(i):
        seen.append(i)
        return _wd(i)

    for model, opt in ((ref, ref_opt), (ours, ours_opt)):
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=10, cycle_momentum=True,
                                                    base_momentum=0.8, max_momentum=0.95)
        _train(model, opt, sched, 10, wd)
    key = "betas" if "betas" in ours_opt.defaults else "momentum"
    assert ours_opt.param_groups[0][key] == ref_opt.param_groups[0][key]
    tol = dict(rtol=1e-4, atol=5e-5) if name == "rmsprop" else dict(rtol=1e-5, atol=1e-6)
    assert_params_close(list(ours.parameters()), list(ref.parameters()), **tol)


def _step_run(mode, sched_kind, **compile_options):
    model = _model()
    opt = AdamW(model.parameters(), lr=torch.tensor(0.01), weight_decay=0.05) if sched_kind == "betas" else \
        SGD(model.parameters(), lr=torch.tensor(0.01), momentum=0.9, weight_decay=0.05)
    step = TrainStep(model, nn.MSELoss(), opt, mode=mode, compile_options=compile_options or None)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=8, cycle_momentum=True,
                                                base_momentum=0.8, max_momentum=0.95)
    g = torch.Generator().manual_seed(9)
    frames, settings = [], []
    for i in range(8):
        x, y = torch.randn(8, 12, generator=g), torch.randn(8, 4, generator=g)
        opt.param_groups[0]["weight_decay"] = _wd(i)
        step(x, y)
        sched.step()
        settings.append(opt.param_groups[0][sched_kind])
        cnt = compile_options.get("backend")
        frames.append(cnt.frame_count if cnt is not None else None)
    return model, frames, settings


@pytest.mark.parametrize("sched_kind", ["betas", "momentum"])
def test_compiled_step_follows_the_schedule_without_recompiling(sched_kind):
    torch._dynamo.reset()
    try:
        eager, _, settings = _step_run("off", sched_kind)
        cnt = CompileCounter()
        comp, frames, _ = _step_run("compile", sched_kind, backend=cnt)
    finally:
        torch._dynamo.reset()
    assert len(set(map(str, settings))) >= 5  # the schedule changed the settings (and the weight decay every step)
    # One forward frame and one tail frame, compiled once.
    assert frames == [2] * 8, frames
    # The CompileCounter backend runs the traced graphs as they are: bit-identical to
    # eager, so each step read the settings written before it.
    for a, b in zip(eager.parameters(), comp.parameters()):
        assert torch.equal(a, b)


def test_a_structural_change_recompiles():
    """A schedulable value that turns zero (SGD's momentum decides its buffer) is structural."""
    torch._dynamo.reset()
    try:
        model = _model()
        opt = SGD(model.parameters(), lr=torch.tensor(0.01), momentum=0.9)
        cnt = CompileCounter()
        step = TrainStep(model, nn.MSELoss(), opt, mode="compile", compile_options={"backend": cnt})
        ref = copy.deepcopy(model)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.01, momentum=0.9)
        g = torch.Generator().manual_seed(3)
        for i in range(4):
            x, y = torch.randn(8, 12, generator=g), torch.randn(8, 4, generator=g)
            if i == 2:
                opt.param_groups[0]["nesterov"] = True
                ref_opt.param_groups[0]["nesterov"] = True
            step(x, y)
            ref_opt.zero_grad()
            nn.functional.mse_loss(ref(x), y).backward()
            ref_opt.step()
        assert cnt.frame_count == 3  # the forward, then the tail before and after the change
        assert_params_close(list(model.parameters()), list(ref.parameters()), rtol=1e-6, atol=1e-6)
    finally:
        torch._dynamo.reset()


@CUDA
def test_captured_step_follows_the_schedule():
    def run(mode):
        torch.manual_seed(0)
        model = _model().cuda()
        opt = AdamW(model.parameters(), lr=torch.tensor(0.01, device="cuda"), weight_decay=0.05)
        step = TrainStep(model, nn.MSELoss(), opt, mode=mode)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=10, cycle_momentum=True,
                                                    base_momentum=0.8, max_momentum=0.95)
        g = torch.Generator().manual_seed(9)
        for i in range(10):
            x, y = torch.randn(8, 12, generator=g).cuda(), torch.randn(8, 4, generator=g).cuda()
            opt.param_groups[0]["weight_decay"] = _wd(i)
            step(x, y)
            sched.step()
        return model, step

    eager, _ = run("off")
    graphed, step = run("cuda_graph")
    assert step.captured
    for a, b in zip(eager.parameters(), graphed.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
