"""Helpers of the optimizer test modules (test_optim_suite.py, test_optim_family.py, test_lamb_adamp.py,
test_rmsprop_tf.py, test_muon.py, test_optim_op_suite.py; test_device_values.py uses a comparison): the
optimizer case table (one row per optimizer of the optimizer table: fusetrain's class, its reference, the
hyper-parameters the behaviour tests start from and the configurations compared over many steps), the Lion
and RMSpropTF references, ModelEMA's decay schedule (decay_reference), parameter and gradient makers, the
float32 CPU reference copies, and comparisons of params, state and snapshots. ``from _optim_helpers import ...`` (pytest puts tests/python on sys.path)."""

import importlib
import inspect
import math
from typing import Any, NamedTuple, Tuple

import torch

import fusetrain.optim as fo
from fusetrain.optim._table import CLASSES

LOW = [torch.float16, torch.bfloat16]
SHAPES = [(1,), (7,), (13, 17), (1031,), (3, 5, 7)]
STEPS = 100

# fp32 after 100 steps on O(1) params: measured max |diff| about 2.4e-7 (a few ulps
# where the kernels round otherwise than the op-by-op reference); 1e-6 leaves room
# for the CUDA kernels.
F32 = dict(rtol=1e-6, atol=1e-6)


def f32(x: float) -> float:
    """``x`` rounded to float32, as the fused ops see a float32 lr tensor."""
    return float(torch.tensor(x, dtype=torch.float32))


def make_params(device, dtypes=(torch.float32,), shapes=SHAPES):
    return [torch.nn.Parameter(torch.randn(s, device=device).to(dtypes[i % len(dtypes)]))
            for i, s in enumerate(shapes)]


def ref_copies(params):
    """fp32 CPU copies for the torch reference."""
    return [torch.nn.Parameter(p.detach().to("cpu", torch.float32).clone()) for p in params]


def new_grads(params, grad_dtype=None, scale=1.0):
    return [(torch.randn(p.shape, device=p.device) * scale).to(grad_dtype or p.dtype) for p in params]


def assign(params, ref_params, grads):
    for p, r, g in zip(params, ref_params, grads):
        if g is not None and g.dtype != p.dtype:
            p.grad_dtype = None  # allow a gradient dtype different from the param's
        p.grad = g
        if r is not None:
            r.grad = None if g is None else g.to("cpu", torch.float32)  # the reference uses grad.float()


@torch.no_grad()
def round_to(ref_params, dtypes):
    """Rounds each reference param to its dtype (``dtypes``: one per param, or one for all)."""
    if isinstance(dtypes, torch.dtype):
        dtypes = [dtypes] * len(ref_params)
    for r, dt in zip(ref_params, dtypes):
        r.copy_(r.to(dt).float())


def cpu32(t):
    return t.detach().to("cpu", torch.float32)


def assert_params_close(params, ref_params, **tol):
    for i, (p, r) in enumerate(zip(params, ref_params)):
        torch.testing.assert_close(cpu32(p), cpu32(r), **tol, msg=lambda m: f"param {i}: {m}")


def assert_low_precision_equal(actual, expected, dtype):
    """``expected`` holds the reference's values already rounded to ``dtype``."""
    a = torch.cat([cpu32(x).reshape(-1) for x in actual])
    e = torch.cat([cpu32(x).reshape(-1) for x in expected])
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(a, e, rtol=2 * eps, atol=1e-5)
    frac = (a == e).float().mean().item()
    assert frac >= 0.99, f"only {frac:.4f} of the elements are bit-equal to the rounded reference"


def snapshot(opt, extra=()):
    out = {}
    for gi, group in enumerate(opt.param_groups):
        for pi, p in enumerate(group["params"]):
            out[f"param {gi}.{pi}"] = p.detach().clone()
            for k, v in opt.state[p].items():
                if isinstance(v, torch.Tensor):
                    out[f"state {gi}.{pi}.{k}"] = v.clone()
    for i, t in enumerate(extra):
        out[f"extra {i}"] = t.clone()
    return out


def assert_snapshot_equal(before, after):
    assert before.keys() == after.keys()
    for k in before:
        assert before[k].dtype == after[k].dtype, k
        assert torch.equal(before[k], after[k]), f"{k} changed"


class RefLion(torch.optim.Optimizer):
    """Reference Lion (torch has none): plain torch ops, one tensor at a time, in the order the fused kernel
    uses (state 'step', 'exp_avg'; float32, or float64 for a float64 param)::

        u = beta1 * m + (1 - beta1) * g;  p *= 1 - lr * weight_decay;  p -= lr * sign(u)
        m = beta2 * m + (1 - beta2) * g
    """

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
                work = torch.float64 if p.dtype == torch.float64 else torch.float32
                g = -p.grad.to(work) if group["maximize"] else p.grad.to(work)
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, dtype=work)
                state["step"] += 1
                m = state["exp_avg"]
                u = m * beta1 + g * (1 - beta1)
                if wd != 0:
                    p.mul_(1 - lr * wd)
                p.add_(torch.sign(u), alpha=-lr)
                m.mul_(beta2).add_(g, alpha=1 - beta2)


class RefRMSpropTF(torch.optim.Optimizer):
    """timm's RMSpropTF semantics in plain PyTorch ops, one tensor at a time."""

    def __init__(self, params, lr=1e-2, alpha=0.9, eps=1e-10, weight_decay=0.0, momentum=0.0, centered=False,
                 decoupled_decay=False, lr_in_momentum=True, maximize=False):
        super().__init__(params, dict(lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay, momentum=momentum,
                                      centered=centered, decoupled_decay=decoupled_decay,
                                      lr_in_momentum=lr_in_momentum, maximize=maximize))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            lr, alpha, wd, mom = group["lr"], group["alpha"], group["weight_decay"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = -p.grad if group["maximize"] else p.grad
                st = self.state[p]
                if not st:
                    st["step"] = torch.tensor(0.0)
                    st["square_avg"] = torch.ones_like(p)
                    if mom > 0:
                        st["momentum_buffer"] = torch.zeros_like(p)
                    if group["centered"]:
                        st["grad_avg"] = torch.zeros_like(p)
                st["step"] += 1
                if wd != 0:
                    if group["decoupled_decay"]:
                        p.mul_(1.0 - lr * wd)
                    else:
                        g = g.add(p, alpha=wd)
                sq = st["square_avg"]
                sq.add_(g.pow(2) - sq, alpha=1.0 - alpha)
                if group["centered"]:
                    ga = st["grad_avg"]
                    ga.add_(g - ga, alpha=1.0 - alpha)
                    avg = sq.addcmul(ga, ga, value=-1).add(group["eps"]).sqrt_()
                else:
                    avg = sq.add(group["eps"]).sqrt_()
                if mom > 0:
                    buf = st["momentum_buffer"]
                    if group["lr_in_momentum"]:
                        buf.mul_(mom).addcdiv_(g, avg, value=lr)
                        p.add_(-buf)
                    else:
                        buf.mul_(mom).addcdiv_(g, avg)
                        p.add_(buf, alpha=-lr)
                else:
                    p.addcdiv_(g, avg, value=-lr)


class Optim(NamedTuple):
    ours: type
    #: what it is compared with: torch.optim's counterpart in the optimizer table, else a reference class or
    #: "module:name" of one imported when first used (timm's)
    ref: Any
    #: the hyper-parameters a behaviour test starts from (a case's overrides replace some)
    hp: dict
    #: how many steps the long comparisons run
    steps: int
    #: an lr exact in float32 (the device lr) for the configuration comparisons
    lr: float
    #: configurations compared with the reference over many steps, in float32 and float64
    configs: Tuple[dict, ...]

    @property
    def reference(self) -> Any:
        if isinstance(self.ref, str):
            module, _, name = self.ref.partition(":")
            return getattr(importlib.import_module(module), name)
        return self.ref


def row(name: str, hp: dict, steps: int = STEPS, lr: float = 2.0**-7, configs: Tuple[dict, ...] = (),
        reference: Any = None) -> Optim:
    """The row of optimizer ``name`` of the optimizer table: fusetrain's class and, unless given, torch's
    counterpart are the table's."""
    _, decl = CLASSES[name]
    if reference is None and decl.torch is not None:
        reference = getattr(torch.optim, decl.torch)
    return Optim(getattr(fo, name), reference, hp, steps, lr, tuple(configs))


#: NOTE [optimizer case table]: one row per optimizer of the optimizer table (tests/python/ops/test_kind_table.py
#: checks that every one has a row); a test names the rows (and per-row overrides) it applies to. The rows
#: whose configurations test_optim_family.py compares run the long comparisons for 30 steps, the length of
#: that module's own.
OPTIMS = {
    "Adam": row("Adam", dict(lr=1e-2, weight_decay=0.1, amsgrad=True)),
    "AdamW": row("AdamW", dict(lr=1e-2, weight_decay=0.1, amsgrad=True)),
    "SGD": row("SGD", dict(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.1)),
    "Lion": row("Lion", dict(lr=1e-2, weight_decay=0.1), reference=RefLion),
    "RMSprop": row("RMSprop", dict(lr=2.0**-8, centered=True, momentum=0.5, weight_decay=0.01, alpha=0.9), 30,
                   lr=2.0**-8, configs=({}, dict(momentum=0.9), dict(centered=True),
                                        dict(centered=True, momentum=0.5, weight_decay=0.01, alpha=0.9),
                                        dict(maximize=True))),
    "RMSpropTF": row("RMSpropTF", dict(lr=2.0**-8, momentum=0.9), 30, lr=2.0**-8, reference=RefRMSpropTF,
                     configs=({}, dict(momentum=0.9), dict(momentum=0.9, lr_in_momentum=False), dict(centered=True),
                              dict(centered=True, momentum=0.5, weight_decay=0.01, alpha=0.8),
                              dict(weight_decay=0.1, decoupled_decay=True),
                              dict(momentum=0.9, weight_decay=0.05, decoupled_decay=True, eps=1e-3),
                              dict(maximize=True, momentum=0.9))),
    "Adadelta": row("Adadelta", dict(lr=0.5, rho=0.5, weight_decay=0.1, eps=1e-4), 30, lr=0.5,
                    configs=({}, dict(rho=0.5, weight_decay=0.1, eps=1e-4), dict(maximize=True))),
    "RAdam": row("RAdam", dict(lr=2.0**-7, weight_decay=0.1, decoupled_weight_decay=True), 30,
                 configs=({}, dict(weight_decay=0.1), dict(weight_decay=0.1, decoupled_weight_decay=True),
                          dict(betas=(0.8, 0.9), maximize=True))),
    "NAdam": row("NAdam", dict(lr=2.0**-7, weight_decay=0.1, momentum_decay=0.01), 30,
                 configs=({}, dict(weight_decay=0.1),
                          dict(weight_decay=0.1, decoupled_weight_decay=True, momentum_decay=0.01),
                          dict(betas=(0.8, 0.9), maximize=True))),
    "Lamb": row("Lamb", {}, reference="timm.optim:Lamb",
                configs=({}, dict(weight_decay=0.0), dict(weight_decay=0.0, always_adapt=True),
                         dict(trust_clip=True, weight_decay=0.1), dict(decoupled_decay=True, weight_decay=0.1),
                         dict(decoupled_decay=True, corrected_weight_decay=True, weight_decay=0.1),
                         dict(caution=True), dict(max_grad_norm=None),
                         dict(bias_correction=False, grad_averaging=False, betas=(0.8, 0.9)))),
    "AdamP": row("AdamP", {}, reference="timm.optim:AdamP",
                 configs=({}, dict(weight_decay=0.1), dict(nesterov=True, weight_decay=0.1),
                          dict(delta=1.0, wd_ratio=0.5, weight_decay=0.1), dict(betas=(0.8, 0.9), eps=1e-4))),
    "Muon": row("Muon", {}, 15, lr=2.0**-6,
                configs=({}, dict(nesterov=False, momentum=0.9, weight_decay=0.0),
                         dict(adjust_lr_fn="match_rms_adamw", weight_decay=0.05, ns_steps=3))),
}


def decay_reference(t, decay_type, decay, beta, total, warmup, gamma, power):
    """ModelEMA's decay for the update after ``t`` done (fusetrain::ema_decay_'s schedules), in float64."""
    t = t + 1.0
    if decay_type == "constant":
        d = decay
    elif decay_type == "threshold":
        d = min(decay, (1.0 + t) / (10.0 + t))
    else:
        d = decay * (1.0 - math.exp(-beta * t / total))
    if warmup:
        d = min(d, 1.0 - (1.0 + t / gamma) ** -power)
    return d


def reference(name, params, **hp):
    """The reference optimizer of row ``name`` (torch's for-loop implementation where torch has one)."""
    cls = OPTIMS[name].reference
    if "foreach" in inspect.signature(cls).parameters:
        hp = dict(hp, foreach=False)
    return cls(params, **hp)


def fused(name, params, hp=None, **ours_only):
    """fusetrain's optimizer of row ``name`` with the row's hyper-parameters updated by ``hp``."""
    return OPTIMS[name].ours(params, **dict(OPTIMS[name].hp, **(hp or {})), **ours_only)


def optimizers(name, params, ref_params, hp=None, *, base=True, **ours_only):
    """fusetrain's optimizer of row ``name`` on ``params`` and the reference on ``ref_params``, both with the
    row's hyper-parameters updated by ``hp`` (only ``hp`` when ``base`` is False); ``ours_only``
    (master_weights, max_grad_norm) goes to fusetrain's alone."""
    kw = dict(OPTIMS[name].hp if base else {}, **(hp or {}))
    return OPTIMS[name].ours(params, **kw, **ours_only), reference(name, ref_params, **kw)


def case_id(name, hp=None):
    return "-".join([name] + [f"{k}={v}" for k, v in (hp or {}).items()])


def assert_state_close(opt, params, ropt, ref_params, steps, **tol):
    """The state of each param holds the reference's keys (with ``step``, and ``master_param`` for a master),
    in float32 (float64 for a float64 param) on the param's device, close to the reference's values;
    ``step`` is a 0-dim float32 tensor equal to ``steps``."""
    for i, (p, r) in enumerate(zip(params, ref_params)):
        st = opt.state[p]
        theirs = {k: v for k, v in ropt.state[r].items() if k != "step" and v is not None}
        assert set(st) - {"step", "master_param"} == set(theirs), (i, sorted(st), sorted(theirs))
        assert st["step"].dtype == torch.float32 and st["step"].device == p.device and st["step"].dim() == 0
        assert st["step"].item() == steps
        want = torch.float64 if p.dtype == torch.float64 else torch.float32
        for k, v in theirs.items():
            assert st[k].dtype == want and st[k].device == p.device, (k, st[k].dtype, st[k].device)
            torch.testing.assert_close(st[k].detach().to("cpu", v.dtype), v, **tol,
                                       msg=lambda m: f"{k} of param {i}: {m}")
