"""The kinds of fusetrain::fused_step_ called directly on lists, against one step of their reference
(torch.optim's for-loop step; the hand-written Lion of _optim_helpers) from the same random state: odd sizes
in every param dtype, hundreds of tensors of mixed param and gradient dtypes with and without master weights,
empty lists, the op's argument checks, and opcheck of its registration. One table (OP_CASES) names the kinds
and hyper-parameters each test runs for; the state lists are built from the kind table (state_rules)."""

import pytest
import torch

import fusetrain  # noqa: F401
from fusetrain.optim._kinds import KINDS

from _optim_helpers import F32, LOW, RefLion, assert_low_precision_equal, assert_params_close, case_id, cpu32, f32
from _test_helpers import CUDA, DEVICES, kind_step, kind_step_args

SEED = 2718  # conftest.py seeds torch with it before each test

REFERENCE = {"adam": torch.optim.Adam, "sgd": torch.optim.SGD, "lion": RefLion, "rmsprop": torch.optim.RMSprop,
             "adadelta": torch.optim.Adadelta, "radam": torch.optim.RAdam, "nadam": torch.optim.NAdam}
LR = {"adam": 3e-3, "sgd": 3e-2, "lion": 1e-2, "rmsprop": 2.0**-8, "adadelta": 0.5, "radam": 2.0**-7,
      "nadam": 2.0**-7}

#: (kind, hyper-parameters as torch names them, first): ``first`` steps from fresh state (step 0) with junk in
#: the state lists, which the first step must ignore (SGD's first momentum step sets the buffer to the grad).
OP_CASES = [
    ("adam", dict(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, maximize=False,
                  decoupled_weight_decay=False), False),
    ("adam", dict(betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1, amsgrad=True, maximize=True,
                  decoupled_weight_decay=False), False),
    ("adam", dict(betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, amsgrad=False, maximize=False,
                  decoupled_weight_decay=True), False),
] + [
    ("sgd", hp, first) for first in (False, True) for hp in (
        dict(momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False),
        dict(momentum=0.9, dampening=0.0, weight_decay=0.1, nesterov=True, maximize=True),
        dict(momentum=0.8, dampening=0.25, weight_decay=0.05, nesterov=False, maximize=False))
] + [
    ("lion", dict(betas=(0.9, 0.99), weight_decay=0.0, maximize=False), False),
    ("lion", dict(betas=(0.95, 0.98), weight_decay=0.1, maximize=True), False),
    ("rmsprop", dict(alpha=0.9, eps=1e-8, weight_decay=0.01, momentum=0.5, centered=True, maximize=False), False),
    ("adadelta", dict(rho=0.5, eps=1e-4, weight_decay=0.1, maximize=True), False),
    ("radam", dict(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, decoupled_weight_decay=True, maximize=False),
     False),
    ("nadam", dict(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, momentum_decay=0.01, decoupled_weight_decay=False,
                   maximize=False), False),
]
OP_IDS = [case_id(k, hp) + ("-first" if first else "") for k, hp, first in OP_CASES]
# The many-tensor test (sizes 0 to 4099) runs every kind but SGD's fresh-state cases, the odd sizes (up to
# 65537) CORE_KINDS.
CORE_KINDS = ("adam", "sgd", "lion")
MANY_CASES = [c for c in OP_CASES if not c[2]]
MANY_IDS = [i for i, c in zip(OP_IDS, OP_CASES) if not c[2]]
# Without masters the many-tensor test runs CORE_KINDS (the optimizer suite steps the other
# kinds' float16/bfloat16 params without masters).
MANY_WITH_MASTERS = [(*c, m) for c in MANY_CASES for m in (False, True) if m or c[0] in CORE_KINDS]
MANY_WITH_MASTERS_IDS = [f"{case_id(c[0], c[1])}-{'master' if c[3] else 'plain'}" for c in MANY_WITH_MASTERS]
ODD_CASES = [c for c in OP_CASES if c[0] in CORE_KINDS]
ODD_IDS = [i for i, c in zip(OP_IDS, OP_CASES) if c[0] in CORE_KINDS]


def state_names(kind, hp):
    """The kind's state lists (slot, torch's state name) a group with ``hp`` uses."""
    return [(slot, name) for slot, name, when, when_set in KINDS[kind]["state_rules"]
            if when is None or bool(hp.get(when)) == when_set]


def random_state(name, shape):
    """A random value of torch's state ``name`` for a param of ``shape`` (second moments positive and larger
    than the squared first moments, NAdam's mu_product a scalar in (0.5, 1))."""
    if name == "mu_product":
        return torch.rand(()) * 0.5 + 0.5
    if name in ("exp_avg_sq", "square_avg", "acc_delta", "max_exp_avg_sq"):
        return torch.rand(shape) * 0.01 + (2e-2 if name == "max_exp_avg_sq" else 1e-4)
    return torch.randn(shape) * (1e-3 if name == "grad_avg" else 0.1)


def run_op_vs_reference(device, kind, hp, first, param_dtypes, grad_dtypes, shapes, with_master=False):
    """One fused_step_ call of ``kind`` on random lists vs one reference step from the same state."""
    lr, n = LR[kind], len(shapes)
    params = [torch.randn(s, device=device).to(param_dtypes[i % len(param_dtypes)]) for i, s in enumerate(shapes)]
    grads = [torch.randn(s, device=device).to(grad_dtypes[i % len(grad_dtypes)]) for i, s in enumerate(shapes)]
    steps0 = [0] * n if first else [int(k) for k in torch.randint(1, 40, (n,))]
    names = state_names(kind, hp)
    state0 = [{name: random_state(name, s) for _, name in names} for s in shapes]
    mast = {i: p.float() + 1e-3 * torch.randn_like(p.float()) for i, p in enumerate(params)
            if with_master and p.dtype in LOW}  # masters are for float16/bfloat16 params
    masters = [mast[i] for i in sorted(mast)]
    ref = [torch.nn.Parameter(mast.get(i, p).detach().to("cpu", torch.float32).clone()) for i, p in enumerate(params)]
    cls = REFERENCE[kind]
    ropt = cls(ref, lr=f32(lr), **hp) if cls is RefLion else cls(ref, lr=f32(lr), foreach=False, **hp)
    for r, g, st, s0 in zip(ref, grads, state0, steps0):
        r.grad = g.to("cpu", torch.float32)
        if not first:
            ropt.state[r] = dict({k: v.clone() for k, v in st.items()}, step=torch.tensor(float(s0)))
    ropt.step()

    lists = [[] for _ in range(3)]
    for slot, name in names:
        lists[slot] = [st[name].clone().to(device) for st in state0]
    steps = [torch.tensor(float(s), device=device) for s in steps0]
    fields = {k: v for k, v in hp.items() if k != "maximize"}
    kind_step(kind, params, grads, steps, lists, masters, lr=torch.tensor(lr, device=device),
              maximize=hp.get("maximize", False), **fields)

    for i, r in enumerate(ref):
        assert steps[i].item() == steps0[i] + 1
        for slot, name in names:
            torch.testing.assert_close(cpu32(lists[slot][i]), ropt.state[r][name].float(), **F32,
                                       msg=lambda m: f"{name} of tensor {i}: {m}")
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


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32] + LOW, ids=str)
@pytest.mark.parametrize("n", [1, 7, 1031, 65537])
@pytest.mark.parametrize("kind,hp,first", ODD_CASES, ids=ODD_IDS)
def test_op_odd_sizes(device, dtype, n, kind, hp, first):
    run_op_vs_reference(device, kind, hp, first, [dtype], [dtype], [(n,)])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind,hp,first,with_master", MANY_WITH_MASTERS, ids=MANY_WITH_MASTERS_IDS)
def test_op_300_tensors_mixed_dtypes(device, kind, hp, first, with_master):
    sizes = [int(k) for k in torch.randint(1, 200, (300,))]
    sizes[17], sizes[150] = 0, 4099  # an empty tensor and one larger than a block
    shapes = [(s,) if i % 4 else (1, s) for i, s in enumerate(sizes)]
    run_op_vs_reference(device, kind, hp, first, [torch.float32, torch.float16, torch.bfloat16],
                        [torch.bfloat16, torch.float32, torch.float16, torch.float32], shapes, with_master)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind,hp,first", MANY_CASES, ids=MANY_IDS)
def test_op_empty_lists(device, kind, hp, first):
    lr = torch.tensor(1e-3, device=device)
    kind_step(kind, [], [], [], lr=lr, inv_scale=torch.tensor(0.5, device=device),
              found_inf=torch.zeros((), device=device), grad_norm=torch.tensor(3.0, device=device),
              max_grad_norm=1.0, ema_decay=torch.tensor(0.9, device=device),
              **{k: v for k, v in hp.items() if k != "maximize"})
    assert lr.item() == pytest.approx(1e-3)


# ---- argument checks ---------------------------------------------------------------------

GOOD = {"adam": dict(betas=(0.9, 0.999), weight_decay=0.0, eps=1e-8), "sgd": dict(momentum=0.9, weight_decay=0.0),
        "lion": dict(betas=(0.9, 0.99), weight_decay=0.0)}


def one_tensor_step(kind, device, param=None, grad=None, states=None, masters=(), **fields):
    """``kind_step`` on one float32 param of 5 elements with zero state, one argument replaced."""
    p = torch.randn(5, device=device) if param is None else param
    g = torch.randn(5, device=device) if grad is None else grad
    if states is None:
        states = tuple([torch.zeros(5, device=device)] for _ in state_names(kind, GOOD[kind]))
    kind_step(kind, [p], [g], [torch.zeros((), device=device)], states, masters, lr=torch.tensor(1e-3, device=device),
              **dict(GOOD[kind], **fields))


def _f64(device):
    return torch.randn(5, device=device, dtype=torch.float64)


#: (kind, the arguments one_tensor_step replaces (a function of the device), error, message)
REFUSALS = [(k, lambda d: dict(param=_f64(d)), RuntimeError, r"params\[0\].*(Double|float64)") for k in GOOD] + [
    (k, lambda d: dict(grad=torch.randn(6, device=d)), RuntimeError, r"grads\[0\] has shape") for k in GOOD] + [
    ("adam", lambda d: dict(grad=_f64(d)), RuntimeError, r"grads\[0\].*(Double|float64)"),
    ("adam", lambda d: dict(amsgrad=True), ValueError, "state3 has 0 tensors, fewer than the group records need"),
    ("sgd", lambda d: dict(states=()), ValueError, "state1 has 0 tensors, fewer than the group records need"),
    ("lion", lambda d: dict(states=()), ValueError, "state1 has 0 tensors, fewer than the group records need"),
    ("adam", lambda d: dict(betas=(1.0, 0.999)), ValueError, r"beta1 must be in \[0, 1\), got 1"),
    ("lion", lambda d: dict(betas=(1.0, 0.99)), ValueError, r"beta1 must be in \[0, 1\), got 1"),
    ("adam", lambda d: dict(eps=-1.0), ValueError, "eps must be >= 0, got -1"),
    ("sgd", lambda d: dict(nesterov=True, dampening=0.1), ValueError, "nesterov needs dampening == 0, got dampening=0.1"),
    ("sgd", lambda d: dict(momentum=-0.5), ValueError, "momentum must be >= 0, got -0.5"),
    # A float64 param keeps float64 state (NOTE [float64 params]) and has no master.
    ("adam", lambda d: dict(param=_f64(d), grad=_f64(d)), RuntimeError,
     r"exp_avg\[0\] has dtype float32 but must be float64"),
    ("adam", lambda d: dict(param=_f64(d), grad=_f64(d), states=([_f64(d)], [_f64(d)]),
                            masters=[torch.zeros(5, device=d)]), ValueError,
     "master_params has 1 tensors but the group records use 0"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind,change,error,match", REFUSALS, ids=[f"{c[0]}-{c[3][:40]}" for c in REFUSALS])
def test_op_rejects_bad_arguments(device, kind, change, error, match):
    with pytest.raises(error, match=match):
        one_tensor_step(kind, device, **change(device))


@CUDA
@pytest.mark.parametrize("kind", list(GOOD))
def test_op_rejects_mismatched_devices(kind):
    with pytest.raises(RuntimeError, match=r"grads\[0\] is on"):
        one_tensor_step(kind, "cuda", grad=torch.randn(5))


# ---- registration ----------------------------------------------------------------------

#: kind -> the hyper-parameters of its opcheck cases, without and with its optional state lists.
OPCHECK = {
    "adam": (dict(betas=(0.9, 0.999), weight_decay=0.01, eps=1e-8, decoupled_weight_decay=True),
             dict(betas=(0.9, 0.999), weight_decay=0.01, eps=1e-8, decoupled_weight_decay=True, amsgrad=True)),
    "sgd": (dict(momentum=0.0, weight_decay=0.01), dict(momentum=0.9, weight_decay=0.01, nesterov=True)),
    "lion": (dict(betas=(0.9, 0.99), weight_decay=0.01),) * 2,
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", list(OPCHECK))
def test_opcheck(device, kind):
    def case(param_dtypes, grad_dtype, hp, master, ema, tail):
        shapes = [(3, 4), (7,), (1,)]
        ps = [torch.randn(s, device=device).to(param_dtypes[i % len(param_dtypes)]) for i, s in enumerate(shapes)]
        gs = [torch.randn(s, device=device).to(grad_dtype) for s in shapes]
        lists = [[] for _ in range(3)]
        for slot, name in state_names(kind, hp):
            lists[slot] = [random_state(name, s).to(device) for s in shapes]
        steps = [torch.tensor(3.0, device=device) for _ in shapes]
        masters = [p.float() for p in ps] if master else []
        emas = [p.clone() for p in ps] if ema else []
        if ema:
            tail = dict(tail, ema_decay=torch.tensor(0.99, device=device))
        return kind_step_args(kind, ps, gs, steps, lists, masters, emas, lr=torch.tensor(1e-3, device=device),
                              **hp, **tail)

    plain, full = OPCHECK[kind]
    full_tail = dict(inv_scale=torch.tensor(0.5, device=device), found_inf=torch.zeros((), device=device),
                     grad_norm=torch.tensor(4.0, device=device), max_grad_norm=1.0)
    cases = [
        case([torch.float32], torch.float32, plain, False, False, {}),
        case([torch.bfloat16, torch.float16], torch.float32, full, True, True, full_tail),
        case([torch.float32], torch.bfloat16, full, False, True, dict(found_inf=torch.ones((), device=device))),
        kind_step_args(kind, [], [], [], lr=torch.tensor(1e-3, device=device), **plain),
    ]
    for args, kwargs in cases:
        torch.library.opcheck(torch.ops.fusetrain.fused_step_.default, args, kwargs)
