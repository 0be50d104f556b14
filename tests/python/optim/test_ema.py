"""fusetrain.ModelEMA against a float64 reference.

The reference keeps a float64 copy of the EMA and evaluates the decay schedule
in float64 from the 1-based update number t (skipped updates not counted):
``e = d(t) * e + (1 - d(t)) * w``. ModelEMA evaluates the schedule with float32
device tensor ops, so its decay is within a few float32 ulps (~2e-7) of the
reference; that error times |w - e| plus the float32 rounding of each update
bounds the EMA error, a few 1e-7 per update and contracting, hence the
EMA_TOL below for 50 updates of O(1) weights.
"""

import contextlib
import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fusetrain
from fusetrain import LossScaler, ModelEMA, unwrap_model
from fusetrain.optim import SGD, AdamW

from _optim_helpers import decay_reference

from _test_helpers import CUDA, DEVICES

DECAY_TOL = 1e-6
EMA_TOL = dict(rtol=1e-5, atol=1e-5)
UPDATES = 50


SEED = 20240614  # conftest.py seeds torch with it before each test


# ---- helpers ---------------------------------------------------------------------------


def mlp(device="cpu"):
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(device)


def bn_model(device="cpu"):
    # ReLU between Linear and BatchNorm: no noise-level bias gradient.
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.BatchNorm1d(16), nn.Linear(16, 4)).to(device)


def ref_decay(t, decay, decay_type, beta=15.0, total_steps=None, warmup=False, warmup_gamma=1.0,
              warmup_power=2.0 / 3.0):
    """ModelEMA's decay at update count ``t`` (the one after ``t - 1`` done)."""
    return decay_reference(t - 1.0, decay_type, decay, beta, total_steps, warmup, warmup_gamma, warmup_power)


def f64_state(module):
    return {k: v.detach().cpu().double().clone() for k, v in module.state_dict().items() if v.is_floating_point()}


@torch.no_grad()
def perturb(model, scale=0.1):
    for p in model.parameters():
        p.add_(torch.randn_like(p) * scale)


def assert_ema_close(ema, ref, **tol):
    sd = ema.module.state_dict()
    for k, r in ref.items():
        torch.testing.assert_close(sd[k].cpu().double(), r, **(tol or EMA_TOL), msg=lambda m: f"{k}: {m}")


def assert_same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), f"{k} differs"


# ---- schedules -------------------------------------------------------------------------


SCHEDULES = {
    "constant": dict(decay=0.9, decay_type="constant"),
    # (1 + t) / (10 + t) passes 0.8 at t = 36: both branches are used.
    "threshold": dict(decay=0.8, decay_type="threshold"),
    "exp": dict(decay=0.999, decay_type="exp", beta=15.0, total_steps=UPDATES),
    "exp-beta5": dict(decay=0.99, decay_type="exp", beta=5.0, total_steps=2 * UPDATES),
    "constant-warmup": dict(decay=0.999, decay_type="constant", warmup=True),
    "exp-warmup": dict(decay=0.9999, decay_type="exp", total_steps=UPDATES, warmup=True, warmup_gamma=3.0,
                       warmup_power=0.75),
    "threshold-warmup": dict(decay=0.95, decay_type="threshold", warmup=True, warmup_gamma=0.5, warmup_power=1.0),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(SCHEDULES))
@pytest.mark.parametrize("skips", [(), (0, 5, 6, 31)])
def test_schedule_matches_float64_reference(device, name, skips):
    cfg = SCHEDULES[name]
    model = mlp(device)
    ema = ModelEMA(model, **cfg)
    ref = f64_state(model)
    t = 0
    decays = []
    for i in range(UPDATES):
        perturb(model)
        skip = i in skips
        before = {k: v.clone() for k, v in ema.module.state_dict().items()}
        found_inf = torch.tensor(1.0 if skip else 0.0, device=device) if skips else None
        ema.update(model, found_inf)
        if skip:
            # Nothing moves, the counter included.
            for k, v in ema.module.state_dict().items():
                assert torch.equal(v, before[k]), f"update {i}: {k} changed on a skipped update"
            assert ema.step_tensor.item() == t
            continue
        t += 1
        d = ref_decay(t, **cfg)
        decays.append(d)
        assert ema.decay_tensor.item() == pytest.approx(d, abs=DECAY_TOL), f"update {i} (t={t})"
        assert ema.step_tensor.item() == t
        cur = f64_state(model)
        ref = {k: d * ref[k] + (1.0 - d) * cur[k] for k in ref}
        assert_ema_close(ema, ref)
    assert t == UPDATES - len(skips)
    assert len(set(round(d, 6) for d in decays)) > 1 or cfg["decay_type"] == "constant" and not cfg.get("warmup")
    for k, v in ema.module.state_dict().items():
        assert v.device.type == device and v.dtype == torch.float32


def test_schedule_branches_are_exercised():
    # The threshold case switches branch inside the run, warmup caps early.
    assert ref_decay(1, **SCHEDULES["threshold"]) == pytest.approx(2 / 11)
    assert ref_decay(UPDATES, **SCHEDULES["threshold"]) == 0.8
    assert ref_decay(1, **SCHEDULES["constant-warmup"]) < 0.5 < ref_decay(UPDATES, **SCHEDULES["constant-warmup"])
    assert ref_decay(UPDATES, **SCHEDULES["constant-warmup"]) < 0.999


@pytest.mark.parametrize("device", DEVICES)
def test_skipped_updates_continue_from_right_t(device):
    # Updates 1-3 normal, then 4 skipped ones, then the next update uses t = 4.
    model = mlp(device)
    ema = ModelEMA(model, decay=0.99, decay_type="threshold")
    one, zero = torch.ones((), device=device), torch.zeros((), device=device)
    for _ in range(3):
        perturb(model)
        ema.update(model, zero)
    frozen = copy.deepcopy(ema.module.state_dict())
    for _ in range(4):
        perturb(model)
        ema.update(model, one)
        assert ema.step_tensor.item() == 3.0
        for k, v in ema.module.state_dict().items():
            assert torch.equal(v, frozen[k])
    perturb(model)
    ema.update(model)
    assert ema.step_tensor.item() == 4.0
    assert ema.decay_tensor.item() == pytest.approx(5 / 14, abs=DECAY_TOL)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_model(device, dtype):
    # The EMA keeps the model's dtype; without remainders (test_ema_remainder.py)
    # each update is the float64 update of the current EMA rounded to the dtype (one ulp).
    model = mlp(device).to(dtype)
    ema = ModelEMA(model, decay=0.7, decay_type="constant", remainder=False)
    for _ in range(5):
        perturb(model)
        prev, cur = f64_state(ema.module), f64_state(model)
        ema.update(model)
        w = float(torch.tensor(1.0) - torch.tensor(0.7))
        for k, v in ema.module.state_dict().items():
            assert v.dtype == dtype
            expected = (prev[k] + w * (cur[k] - prev[k])).to(dtype).double()
            torch.testing.assert_close(v.cpu().double(), expected, rtol=torch.finfo(dtype).eps, atol=1e-5)


def test_changing_decay_takes_effect():
    model = mlp()
    ema = ModelEMA(model, decay=0.9, decay_type="constant")
    ref = f64_state(model)
    for i in range(10):
        if i == 5:
            ema.decay = 0.5
        d = 0.9 if i < 5 else 0.5
        perturb(model)
        ema.update(model)
        assert ema.decay_tensor.item() == pytest.approx(d, abs=DECAY_TOL)
        cur = f64_state(model)
        ref = {k: d * ref[k] + (1.0 - d) * cur[k] for k in ref}
        assert_ema_close(ema, ref)
    # A constant decay is written once; a new schedule type is evaluated again.
    ema.decay, ema.decay_type = 0.9, "threshold"
    ema.update(model)
    assert ema.decay_tensor.item() == pytest.approx(12 / 21, abs=DECAY_TOL)  # update 11: (1 + 11) / (10 + 11)
    ema.decay_type = "constant"
    ema.update(model)
    assert ema.decay_tensor.item() == pytest.approx(0.9, abs=DECAY_TOL)
    # A threshold schedule picks up a new cap the same way.
    ema = ModelEMA(model, decay=0.999, decay_type="threshold")
    for _ in range(3):
        ema.update(model)
    ema.decay = 0.3
    ema.update(model)
    assert ema.decay_tensor.item() == pytest.approx(0.3, abs=DECAY_TOL)


def test_set_total_steps_later():
    model = mlp()
    ema = ModelEMA(model, decay=0.99, decay_type="exp")
    with pytest.raises(ValueError, match="total_steps"):
        ema.update(model)
    assert ema.step_tensor.item() == 0.0
    ema.set_total_steps(20)
    for t in range(1, 4):
        perturb(model)
        ema.update(model)
        assert ema.decay_tensor.item() == pytest.approx(ref_decay(t, 0.99, "exp", total_steps=20), abs=DECAY_TOL)
    ema.set_total_steps(200)
    ema.update(model)
    assert ema.decay_tensor.item() == pytest.approx(ref_decay(4, 0.99, "exp", total_steps=200), abs=DECAY_TOL)


# ---- buffers and non-float tensors -----------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("include_buffers", [True, False])
def test_batchnorm_buffers(device, include_buffers):
    model = bn_model(device).train()
    ema = ModelEMA(model, decay=0.8, decay_type="constant", include_buffers=include_buffers)
    ref = f64_state(model)
    for i in range(10):
        model(torch.randn(32, 8, device=device))  # moves the running stats
        perturb(model)
        ema.update(model)
        cur = f64_state(model)
        ref = {k: 0.8 * ref[k] + 0.2 * cur[k] for k in ref}
        esd, msd = ema.module.state_dict(), model.state_dict()
        assert torch.equal(esd["2.num_batches_tracked"], msd["2.num_batches_tracked"])
        assert esd["2.num_batches_tracked"].item() == i + 1
        for k in ("2.running_mean", "2.running_var"):
            if include_buffers:
                torch.testing.assert_close(esd[k].cpu().double(), ref[k], **EMA_TOL)
                assert not torch.equal(esd[k], msd[k])
            else:
                assert torch.equal(esd[k], msd[k]), f"{k} must be copied"
        for k in ("0.weight", "2.weight", "3.bias"):
            torch.testing.assert_close(esd[k].cpu().double(), ref[k], **EMA_TOL)


def test_attached_ema_reads_replaced_buffers_and_a_replaced_module_after_attaching_again():
    # NOTE [ema locators]: the buffers are found once, when attaching, and read from
    # their module's table at each step.
    model = bn_model("cpu").train()
    opt = AdamW(model.parameters(), lr=1e-2)
    ema = ModelEMA(model, decay=0.8, decay_type="constant", include_buffers=False).attach(opt)

    def step():
        model(torch.randn(32, 8)).sum().backward()
        opt.step()
        opt.zero_grad()

    step()
    model[2].running_mean = torch.full((model[2].num_features,), 7.0)  # a new tensor in the same module
    step()
    assert torch.equal(ema.module[2].running_mean, model[2].running_mean)
    assert model[2].running_mean.ne(7.0).all()  # the forward moved the new tensor, the EMA copied it after
    fresh = nn.BatchNorm1d(model[2].num_features)  # another module object holding the same params
    fresh.weight, fresh.bias = model[2].weight, model[2].bias
    fresh.running_var.fill_(3.0)
    model[2] = fresh
    ema.attach(opt)
    step()
    assert torch.equal(ema.module[2].running_var, fresh.running_var)
    assert ema.module[2].num_batches_tracked.item() == fresh.num_batches_tracked.item() == 1


def test_attached_ema_in_a_compiled_step_reads_a_replaced_buffer():
    # NOTE [ema post-step lists]: the lists kept between steps give way to a buffer the module replaced.
    model = bn_model("cpu").train()
    opt = AdamW(model.parameters(), lr=torch.tensor(1e-2))
    ema = ModelEMA(model, decay=0.8, decay_type="constant", include_buffers=False).attach(opt)
    tail = torch.compile(opt.step, backend="eager", fullgraph=True)

    def step():
        model(torch.randn(32, 8)).sum().backward()
        tail()
        opt.zero_grad()

    step()
    step()
    model[2].running_mean = torch.full((model[2].num_features,), 7.0)
    step()
    assert torch.equal(ema.module[2].running_mean, model[2].running_mean)
    assert ema.module[2].running_mean.gt(5.0).all()  # the forward moved 7.0 towards the batch means
    assert ema.step_tensor.item() == 3


class WithIntTensors(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.table = nn.Parameter(torch.arange(6), requires_grad=False)
        self.register_buffer("counter", torch.zeros((), dtype=torch.int64))
        self.register_buffer("scale", torch.ones(4))

    def forward(self, x):
        return self.lin(x) * self.scale


def test_non_float_tensors_are_copied_and_skips_keep_them():
    model = WithIntTensors()
    ema = ModelEMA(model, decay=0.5, decay_type="constant")
    assert ema.module.table.requires_grad is False
    with torch.no_grad():
        model.table.add_(10)
        model.counter.fill_(7)
        model.scale.fill_(3.0)
    ema.update(model, torch.ones(()))
    assert ema.module.table.tolist() == list(range(6)) and ema.module.counter.item() == 0
    assert torch.equal(ema.module.scale, torch.ones(4))
    ema.update(model, torch.zeros(()))
    assert torch.equal(ema.module.table, model.table) and ema.module.counter.item() == 7
    assert torch.equal(ema.module.scale, torch.full((4,), 2.0)), "float buffers are averaged"


# ---- attach ------------------------------------------------------------------------------


def _train_pair(model_a, model_b, opt_a, opt_b, ema_b, data, scalers=None, inject=()):
    """Step model_a (EMA attached to opt_a) and model_b (ema_b.update after
    each step) on the same data."""
    for i, (x, y) in enumerate(data):
        for k, (m, o) in enumerate(((model_a, opt_a), (model_b, opt_b))):
            o.zero_grad()
            loss = F.mse_loss(m(x), y)
            if scalers is None:
                loss.backward()
                o.step()
            else:
                scalers[k].scale(loss).backward()
                if i in inject:
                    next(m.parameters()).grad.view(-1)[0] = float("inf")
                scalers[k].step(o)
                scalers[k].update()
        ema_b.update(model_b, None if scalers is None else opt_b.last_found_inf)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("opt_name", ["AdamW", "SGD"])
def test_attach_equals_update_after_step(device, opt_name):
    make = {"AdamW": lambda ps: AdamW(ps, lr=1e-2, weight_decay=0.01),
            "SGD": lambda ps: SGD(ps, lr=0.05, momentum=0.9)}[opt_name]
    model_a = bn_model(device)
    model_b = copy.deepcopy(model_a)
    ema_a = ModelEMA(model_a, decay=0.95, decay_type="threshold")
    ema_b = ModelEMA(model_b, decay=0.95, decay_type="threshold")
    opt_a, opt_b = make(model_a.parameters()), make(model_b.parameters())
    assert ema_a.attach(opt_a) is ema_a
    data = [(torch.randn(16, 8, device=device), torch.randn(16, 4, device=device)) for _ in range(20)]
    _train_pair(model_a, model_b, opt_a, opt_b, ema_b, data)
    assert_same_state(model_a, model_b)
    assert ema_a.step_tensor.item() == ema_b.step_tensor.item() == 20
    assert ema_a.decay_tensor.item() == ema_b.decay_tensor.item()
    sa, sb = ema_a.module.state_dict(), ema_b.module.state_dict()
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], rtol=1e-6, atol=1e-7, msg=lambda m: f"{k}: {m}")
    # The EMA really moved away from the initial and the current weights.
    assert not torch.equal(sa["0.weight"], model_a[0].weight)


@pytest.mark.parametrize("device", DEVICES)
def test_attach_with_loss_scaler_skipped_steps(device):
    model_a = bn_model(device)
    model_b = copy.deepcopy(model_a)
    ema_a = ModelEMA(model_a, decay=0.9, decay_type="exp", total_steps=20, warmup=True)
    ema_b = ModelEMA(model_b, decay=0.9, decay_type="exp", total_steps=20, warmup=True)
    opt_a, opt_b = AdamW(model_a.parameters(), lr=1e-2), AdamW(model_b.parameters(), lr=1e-2)
    ema_a.attach(opt_a)
    scalers = [LossScaler(growth_interval=3), LossScaler(growth_interval=3)]
    inject = {2, 3, 9, 15}
    data = [(torch.randn(16, 8, device=device), torch.randn(16, 4, device=device)) for _ in range(20)]
    _train_pair(model_a, model_b, opt_a, opt_b, ema_b, data, scalers=scalers, inject=inject)
    assert scalers[0].skipped_steps.item() == scalers[1].skipped_steps.item() == len(inject)
    assert ema_a.step_tensor.item() == ema_b.step_tensor.item() == 20 - len(inject)
    assert_same_state(model_a, model_b)
    sa, sb = ema_a.module.state_dict(), ema_b.module.state_dict()
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], rtol=1e-6, atol=1e-7, msg=lambda m: f"{k}: {m}")


def test_attached_skip_leaves_ema_bit_identical():
    model = bn_model()
    ema = ModelEMA(model, decay=0.5, decay_type="constant")
    opt = SGD(model.parameters(), lr=0.1)
    ema.attach(opt)
    ls = LossScaler()
    x, y = torch.randn(16, 8), torch.randn(16, 4)
    ls.scale(F.mse_loss(model(x), y)).backward()
    ls.step(opt)
    ls.update()
    before = copy.deepcopy(ema.module.state_dict())
    opt.zero_grad()
    ls.scale(F.mse_loss(model(x), y)).backward()  # the forward moves the running stats
    model[0].bias.grad[0] = float("nan")
    ls.step(opt)
    ls.update()
    assert ls.last_step_skipped.item() == 1.0
    for k, v in ema.module.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert ema.step_tensor.item() == 1.0


def test_detach_stops_updates():
    model = mlp()
    ema = ModelEMA(model, decay=0.5, decay_type="constant")
    opt = AdamW(model.parameters(), lr=1e-2)
    ema.attach(opt)
    x, y = torch.randn(16, 8), torch.randn(16, 4)
    F.mse_loss(model(x), y).backward()
    opt.step()
    assert ema.step_tensor.item() == 1.0
    ema.detach()
    frozen = copy.deepcopy(ema.module.state_dict())
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    opt.step()
    assert ema.step_tensor.item() == 1.0
    for k, v in ema.module.state_dict().items():
        assert torch.equal(v, frozen[k])
    # update() still works after detach.
    ema.update(model)
    assert ema.step_tensor.item() == 2.0


# ---- wrapped models ------------------------------------------------------------------


def test_torch_compile_wrapped_model():
    model = bn_model()
    compiled = torch.compile(model, backend="eager")
    ema = ModelEMA(compiled, decay=0.9, decay_type="constant")
    twin = ModelEMA(model, decay=0.9, decay_type="constant")
    assert unwrap_model(compiled) is model
    assert not isinstance(ema.module, torch._dynamo.eval_frame.OptimizedModule)
    keys = list(ema.state_dict()["module"].keys())
    assert keys == list(model.state_dict().keys())
    assert not any("_orig_mod" in k for k in keys)
    opt = AdamW(compiled.parameters(), lr=1e-2)
    for _ in range(3):
        opt.zero_grad()
        F.mse_loss(compiled(torch.randn(16, 8)), torch.randn(16, 4)).backward()
        opt.step()
        ema.update(compiled)
        twin.update(model)
    assert_same_state(ema.module, twin.module)
    # attach() with a compiled model's optimizer too.
    attached = ModelEMA(compiled, decay=0.9, decay_type="constant").attach(opt)
    opt.zero_grad()
    F.mse_loss(compiled(torch.randn(16, 8)), torch.randn(16, 4)).backward()
    opt.step()
    assert attached.step_tensor.item() == 1.0
    assert not torch.equal(attached.module[0].weight, model[0].weight)
    attached.detach()


def test_ddp_wrapped_model(gloo_group):
    model = bn_model()
    ddp = nn.parallel.DistributedDataParallel(model)
    ema = ModelEMA(ddp, decay=0.8, decay_type="constant")
    attached = ModelEMA(ddp, decay=0.8, decay_type="constant")
    keys = list(ema.state_dict()["module"].keys())
    assert keys == list(model.state_dict().keys())
    assert not any(k.startswith("module.") for k in keys)
    opt = SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    attached.attach(opt)
    ref = f64_state(model)
    for _ in range(4):
        opt.zero_grad()
        F.mse_loss(ddp(torch.randn(16, 8)), torch.randn(16, 4)).backward()
        opt.step()
        ema.update(ddp)
        cur = f64_state(model)
        ref = {k: 0.8 * ref[k] + 0.2 * cur[k] for k in ref}
    assert_ema_close(ema, ref)
    sa, sb = ema.module.state_dict(), attached.module.state_dict()
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], rtol=1e-6, atol=1e-7)
    attached.detach()


# ---- the EMA module ------------------------------------------------------------------


def test_ema_module_for_eval_and_compile():
    model = bn_model().train()
    ema = ModelEMA(model, decay=0.5, decay_type="constant")
    for _ in range(3):
        model(torch.randn(32, 8))
        perturb(model)
        ema.update(model)
    m = ema.module
    assert not m.training and model.training, "the EMA copy is in eval mode, the model is untouched"
    assert all(not p.requires_grad for p in m.parameters())
    assert m is not model and m[0].weight.data_ptr() != model[0].weight.data_ptr()
    x = torch.randn(5, 8)
    with torch.no_grad():
        eager = m(x)
        # eval-mode BatchNorm uses the averaged running stats.
        manual = m[3](m[2](m[1](m[0](x))))
        assert torch.equal(eager, manual)
        compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
        torch.testing.assert_close(compiled(x), eager, rtol=1e-6, atol=1e-7)
    # Updating after compiling: the compiled module reads the new EMA weights.
    perturb(model)
    ema.update(model)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), m(x), rtol=1e-6, atol=1e-7)


def test_compiled_scaler_tail_with_attached_ema():
    # scaler.step(opt); scaler.update() in one full graph, with the EMA riding
    # in the update pass: equals the eager tail.
    torch._dynamo.reset()
    model_c = mlp()
    model_e = copy.deepcopy(model_c)
    runs = []
    for model in (model_c, model_e):
        opt = AdamW(model.parameters(), lr=torch.tensor(1e-2))
        ema = ModelEMA(model, decay=0.9, decay_type="threshold").attach(opt)
        runs.append((model, opt, ema, LossScaler(growth_interval=2)))

    def tail(opt, scaler):
        scaler.step(opt)
        scaler.update()

    compiled_tail = torch.compile(tail, fullgraph=True, backend="aot_eager")
    for i in range(6):
        x, y = torch.randn(16, 8), torch.randn(16, 4)
        for k, (model, opt, ema, scaler) in enumerate(runs):
            opt.zero_grad()
            scaler.scale(F.mse_loss(model(x), y)).backward()
            if i == 2:
                model[0].weight.grad[0, 0] = float("inf")
            (compiled_tail if k == 0 else tail)(opt, scaler)
    (mc, _, ema_c, sc), (me, _, ema_e, se) = runs
    assert sc.get_scale() == se.get_scale() and sc.skipped_steps.item() == se.skipped_steps.item() == 1.0
    assert ema_c.step_tensor.item() == ema_e.step_tensor.item() == 5.0
    for a, b in zip(mc.parameters(), me.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    for (k, a), b in zip(ema_c.module.state_dict().items(), ema_e.module.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=lambda m: f"{k}: {m}")
    torch._dynamo.reset()


# ---- state dicts -----------------------------------------------------------------------


@pytest.mark.parametrize("through_torch_save", [False, True])
def test_state_dict_round_trip_bit_exact(through_torch_save):
    cfg = dict(decay=0.99, decay_type="exp", beta=7.0, total_steps=40, warmup=True, warmup_gamma=2.0,
               warmup_power=0.7)
    model = bn_model().train()
    a = ModelEMA(model, **cfg)
    for _ in range(10):
        model(torch.randn(32, 8))
        perturb(model)
        a.update(model)
    sd = a.state_dict()
    assert sd["step"].item() == 10.0
    assert {k: sd[k] for k in cfg} == cfg
    if through_torch_save:
        buf = io.BytesIO()
        torch.save(sd, buf)
        buf.seek(0)
        sd = torch.load(buf)
    else:
        sd = copy.deepcopy(sd)
    b = ModelEMA(bn_model(), decay=0.5, decay_type="constant")  # another config, other weights
    b.load_state_dict(sd)
    assert (b.decay, b.decay_type, b.beta, b.total_steps, b.warmup, b.warmup_gamma, b.warmup_power) == \
        tuple(cfg.values())
    assert_same_state(a.module, b.module)
    assert torch.equal(a.step_tensor, b.step_tensor)
    for _ in range(10):
        model(torch.randn(32, 8))
        perturb(model)
        a.update(model)
        b.update(model)
        assert torch.equal(a.decay_tensor, b.decay_tensor)
    assert_same_state(a.module, b.module)
    assert b.step_tensor.item() == 20.0


def test_load_state_dict_restores_include_buffers():
    # A state dict saved with include_buffers=True makes an EMA built with
    # include_buffers=False average the buffers too, so both continue alike.
    model = bn_model().train()
    a = ModelEMA(model, decay=0.5, decay_type="constant", include_buffers=True)
    b = ModelEMA(model, decay=0.5, decay_type="constant", include_buffers=False)
    b.load_state_dict(copy.deepcopy(a.state_dict()))
    assert b.include_buffers is True
    for _ in range(3):
        model(torch.randn(32, 8))
        a.update(model)
        b.update(model)
    assert_same_state(a.module, b.module)
    # Also when the EMA is attached to an optimizer before loading.
    c = ModelEMA(model, decay=0.5, decay_type="constant", include_buffers=False)
    opt = SGD(model.parameters(), lr=0.05)
    c.attach(opt)
    c.load_state_dict(copy.deepcopy(a.state_dict()))
    for _ in range(3):
        opt.zero_grad()
        F.mse_loss(model(torch.randn(32, 8)), torch.randn(32, 4)).backward()
        opt.step()
        a.update(model)
    sa, sc = a.module.state_dict(), c.module.state_dict()
    for k in sa:
        torch.testing.assert_close(sc[k], sa[k], rtol=1e-6, atol=1e-7, msg=lambda m: f"{k}: {m}")
    assert not torch.equal(sc["2.running_mean"], model[2].running_mean), "running stats are averaged"
    c.detach()


def test_load_state_dict_missing_keys():
    ema = ModelEMA(mlp(), decay_type="constant")
    sd = ema.state_dict()
    for k in ("module", "step", "decay", "decay_type"):
        bad = {kk: v for kk, v in sd.items() if kk != k}
        with pytest.raises(KeyError, match=k):
            ema.load_state_dict(bad)


# ---- errors --------------------------------------------------------------------------


@pytest.mark.parametrize("decay", [0.0, 1.0, -0.1, 1.5, True, "0.9", None])
def test_decay_outside_open_interval(decay):
    with pytest.raises((TypeError, ValueError), match=r"decay must be (a finite number )?in \(0, 1\)"):
        ModelEMA(mlp(), decay=decay)


def test_unknown_decay_type_lists_allowed():
    with pytest.raises(ValueError, match=r"decay_type must be one of .*'constant'.*'threshold'.*'exp'.*'linear'"):
        ModelEMA(mlp(), decay_type="linear")


@pytest.mark.parametrize("kwargs,name", [
    (dict(beta=0.0), "beta"), (dict(beta=-1.0), "beta"), (dict(total_steps=0), "total_steps"),
    (dict(total_steps=-3), "total_steps"), (dict(total_steps=2.5), "total_steps"),
    (dict(total_steps=True), "total_steps"),
    (dict(warmup_gamma=0.0), "warmup_gamma"), (dict(warmup_power=-1.0), "warmup_power"),
])
def test_bad_schedule_args(kwargs, name):
    with pytest.raises((TypeError, ValueError), match=name):
        ModelEMA(mlp(), **kwargs)


def test_model_without_float_params():
    class IntOnly(nn.Module):
        def __init__(self):
            super().__init__()
            self.idx = nn.Parameter(torch.arange(4), requires_grad=False)

    for model in (nn.ReLU(), IntOnly(), nn.Sequential()):
        with pytest.raises(ValueError, match="no floating-point parameters"):
            ModelEMA(model)
    with pytest.raises(TypeError, match="nn.Module"):
        ModelEMA(torch.randn(3))


def test_exp_without_total_steps_at_first_update():
    model = mlp()
    ema = ModelEMA(model)  # the default schedule is exp
    before = copy.deepcopy(ema.module.state_dict())
    with pytest.raises(ValueError, match="total_steps"):
        ema.update(model)
    assert ema.step_tensor.item() == 0.0
    for k, v in ema.module.state_dict().items():
        assert torch.equal(v, before[k])
    # The same through attach: the optimizer step refuses before updating.
    opt = AdamW(model.parameters())
    ema.attach(opt)
    F.mse_loss(model(torch.randn(4, 8)), torch.randn(4, 4)).backward()
    with pytest.raises(ValueError, match="total_steps"):
        opt.step()
    ema.detach()


@pytest.mark.parametrize("opt_cls", [torch.optim.AdamW, torch.optim.SGD])
def test_attach_to_torch_optimizer_raises(opt_cls):
    model = mlp()
    with pytest.raises(TypeError, match="fusetrain optimizer"):
        ModelEMA(model, decay_type="constant").attach(opt_cls(model.parameters(), lr=0.1))


def test_update_with_another_model_raises():
    ema = ModelEMA(mlp(), decay_type="constant")
    with pytest.raises(ValueError, match="lacks"):
        ema.update(nn.Sequential(nn.Linear(8, 16)))


def test_exports():
    assert fusetrain.ModelEMA is ModelEMA and fusetrain.unwrap_model is unwrap_model


# ---- no host synchronisation -------------------------------------------------------------------


def _attached_ema_steps(device, steps, sync_guard=None):
    """Steps of a BatchNorm CNN with loss scaling, clipping and an attached EMA
    (exp schedule with warm-up, buffers averaged): the steps after the first
    run under ``sync_guard``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(4, 3)).to(device)
    opt = AdamW(model.parameters(), lr=1e-2, max_grad_norm=1.0)
    scaler = LossScaler(device=device)
    ema = ModelEMA(model, decay=0.99, decay_type="exp", total_steps=10, warmup=True).attach(opt)
    data = [(torch.randn(8, 1, 6, 6, device=device), torch.randint(0, 3, (8,), device=device)) for _ in range(steps)]

    def one(x, y):
        opt.zero_grad()
        scaler.scale(F.cross_entropy(model(x), y)).backward()
        scaler.step(opt)
        scaler.update()

    one(*data[0])
    with sync_guard() if sync_guard is not None else contextlib.nullcontext():
        for x, y in data[1:]:
            one(x, y)
    return model, ema


@pytest.mark.parametrize("device", DEVICES)
def test_attached_ema_steps_run_anywhere(device):
    # The flow of the GPU check below: the EMA moves and counts every step.
    model, ema = _attached_ema_steps(device, 4)
    assert ema.step_tensor.item() == 4
    assert not torch.equal(ema.module[0].weight, model[0].weight)


@contextlib.contextmanager
def _no_host_sync():
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


@CUDA
def test_attached_ema_step_does_not_synchronize_with_host():
    # The decay schedule, the EMA in the update pass, the buffers' average and the counter stay on the device.
    model, ema = _attached_ema_steps("cuda", 4, _no_host_sync)
    torch.cuda.synchronize()
    assert ema.step_tensor.item() == 4
