"""Property-based tests (NOTE [hypothesis profiles] in conftest.py) of the ops' refusals: a valid call of
fused_step_, ema_step_ / ema_update_, gated_copy_ or grad_stats on generated lists with one argument made bad (a
dtype, a shape, an expanded view where the op writes, a list of the wrong length, a non-finite or out-of-range
setting) is a clear error naming that argument, and no tensor of the call changed (snapshots before and after)."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fusetrain  # noqa: F401
from fusetrain import _ops

from _property_helpers import NONFINITE, assert_unchanged, examples, sizes, snapshot
from _test_helpers import DEVICES, kind_step_args

ERRORS = (RuntimeError, ValueError, TypeError, IndexError)


def _refused(fn, names, before, *tensors):
    with pytest.raises(ERRORS) as info:
        fn()
    msg = str(info.value)
    assert any(n in msg for n in names), f"the error names none of {names}: {msg}"
    assert_unchanged(before, *tensors)


def _lists(draw, device, min_count=1):
    ns = draw(st.lists(sizes(large=False), min_size=min_count, max_size=30))
    return ns, [torch.randn(n, device=device) for n in ns]


#: fused_step_ (adam): how one argument is made bad, and the names its error may use.
ADAM_BREAKS = {
    "grad dtype float64": ("grads", ["grads[", "float64"]),
    "grad shape": ("grads", ["grads[", "shape"]),
    "expanded param": ("params", ["params[", "share memory", "expanded"]),
    "short state list": ("state1", ["state1", "exp_avg"]),
    "state dtype": ("state2", ["exp_avg_sq[", "state2", "dtype"]),
    "nan eps": ("eps", ["eps"]),
    "inf beta2": ("beta2", ["beta2"]),
    "negative weight_decay": ("weight_decay", ["weight_decay"]),
    "lr list length": ("lrs", ["lrs", "lr"]),
    "group size": ("group_sizes", ["group_sizes", "group"]),
}


@pytest.mark.parametrize("device", DEVICES)
@examples(1.0)
@given(data=st.data(), brk=st.sampled_from(sorted(ADAM_BREAKS)))
def test_fused_step_refuses_one_bad_argument_and_writes_nothing(device, data, brk):
    ns, params = _lists(data.draw, device)
    n = len(ns)
    grads = [torch.randn_like(p) for p in params]
    state = [[torch.rand_like(p) for p in params] for _ in range(2)]
    steps = [torch.tensor(3.0, device=device) for _ in params]
    fields = dict(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    i = data.draw(st.integers(0, n - 1))
    if brk == "grad dtype float64":
        grads[i] = grads[i].double()
    elif brk == "grad shape":
        grads[i] = torch.randn(ns[i] + 1, device=device)
    elif brk == "expanded param":
        params[i] = torch.randn(1, device=device).expand(max(ns[i], 2))
        grads[i] = torch.randn(max(ns[i], 2), device=device)
        state = [[s if k != i else torch.rand(max(ns[i], 2), device=device) for k, s in enumerate(lst)]
                 for lst in state]
    elif brk == "short state list":
        state[0] = state[0][:-1]
    elif brk == "state dtype":
        state[1][i] = state[1][i].half()
    elif brk == "nan eps":
        fields["eps"] = float("nan")
    elif brk == "inf beta2":
        fields["betas"] = (0.9, float("inf"))
    elif brk == "negative weight_decay":
        fields["weight_decay"] = -data.draw(st.sampled_from([1e-30, 1.0, float("inf")]))
    args, kw = kind_step_args("adam", params, grads, steps, state, lr=torch.tensor(1e-3, device=device),
                              max_grad_norm=data.draw(st.sampled_from([0.0, 1.0])), **fields)
    args = list(args)
    if brk == "lr list length":
        args[10] = args[10] * 2
    elif brk == "group size":
        args[9] = [n + 1]
    before = snapshot(params, grads, *state, steps)
    _refused(lambda: torch.ops.fusetrain.fused_step_(*args, **kw), ADAM_BREAKS[brk][1], before, params, grads,
             *state, steps)


EMA_BREAKS = {"src dtype": ["src[", "dtype"], "src shape": ["src[", "shape"], "expanded ema": ["ema[", "dense"],
              "src list length": ["src", "ema"], "decay dtype": ["decay"], "decay shape": ["decay"],
              "found_inf shape": ["found_inf"], "remainder dtype": ["remainder"], "integer ema": ["ema[", "dtype"]}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", ["ema_update_", "ema_step_"])
@examples(0.5)
@given(data=st.data(), brk=st.sampled_from(sorted(EMA_BREAKS)))
def test_ema_ops_refuse_one_bad_argument_and_write_nothing(device, op, data, brk):
    ns, ema = _lists(data.draw, device)
    ema = [e.bfloat16() for e in ema]
    src = [torch.randn_like(e) for e in ema]
    rems = [torch.zeros_like(e, dtype=torch.int16) for e in ema]
    decay, found, step = torch.tensor(0.9, device=device), torch.tensor(0.0, device=device), \
        torch.tensor(1.0, device=device)
    i = data.draw(st.integers(0, len(ns) - 1))
    if brk == "src dtype":
        src[i] = src[i].float()
    elif brk == "src shape":
        src[i] = torch.randn(ns[i] + 1, device=device).bfloat16()
    elif brk == "expanded ema":
        ema[i] = torch.randn(1, device=device).bfloat16().expand(max(ns[i], 2))
        src[i] = torch.randn(max(ns[i], 2), device=device).bfloat16()
        rems[i] = torch.zeros(max(ns[i], 2), dtype=torch.int16, device=device)
    elif brk == "src list length":
        src = src[:-1]
    elif brk == "decay dtype":
        decay = decay.double()
    elif brk == "decay shape":
        decay = torch.full((2,), 0.9, device=device)
    elif brk == "found_inf shape":
        found = torch.zeros(3, device=device)
    elif brk == "remainder dtype":
        rems[i] = rems[i].int()
    elif brk == "integer ema":
        ema[i] = torch.zeros(ns[i], dtype=torch.int64, device=device)
        src[i] = torch.ones(ns[i], dtype=torch.int64, device=device)
        rems.pop(i)  # one remainder per bfloat16 tensor
    before = snapshot(ema, rems, step)
    if op == "ema_update_":
        call = lambda: _ops.ema_update_(ema, src, decay, found, rems)  # noqa: E731
    else:
        call = lambda: _ops.ema_step_(ema, src, [], [], decay, step, found, rems)  # noqa: E731
    _refused(call, EMA_BREAKS[brk], before, ema, rems, step)


@pytest.mark.parametrize("device", DEVICES)
@examples(0.5)
@given(data=st.data(), brk=st.sampled_from(["dtype", "shape", "strides", "length", "flag dtype", "expanded dst"]))
def test_gated_copy_refuses_one_bad_argument_and_writes_nothing(device, data, brk):
    ns, dst = _lists(data.draw, device)
    src = [torch.randn_like(d) for d in dst]
    flag = torch.tensor(0.0, device=device)
    i = data.draw(st.integers(0, len(ns) - 1))
    if brk == "dtype":
        src[i] = src[i].double()
    elif brk == "shape":
        src[i] = torch.randn(ns[i] + 1, device=device)
    elif brk == "strides":
        dst[i], src[i] = torch.randn(2, 3, device=device), torch.randn(3, 2, device=device).t()
    elif brk == "length":
        src = src + [torch.randn(1, device=device)]
    elif brk == "flag dtype":
        flag = torch.tensor(0, device=device)
    else:
        dst[i] = torch.randn(1, device=device).expand(max(ns[i], 2))
        src[i] = torch.randn(max(ns[i], 2), device=device)
    before = snapshot(dst)
    _refused(lambda: _ops.gated_copy_(dst, src, flag), ["dst", "src", "found_inf"], before, dst)


@pytest.mark.parametrize("device", DEVICES)
@examples(0.5)
@given(bad=st.sampled_from([*NONFINITE, 0.0, -1.0, 1.0 + 1e-9]), which=st.sampled_from(["decay", "beta",
                                                                                      "warmup_gamma",
                                                                                      "warmup_power"]))
def test_ema_decay_refuses_bad_settings_and_writes_nothing(device, bad, which):
    if which != "decay" and bad == 1.0 + 1e-9:
        bad = float("nan")
    kw = dict(decay=0.99, beta=15.0, warmup_gamma=1.0, warmup_power=0.75)
    kw[which] = bad if which != "decay" or bad not in (0.0,) else -1e-9
    out, step = torch.full((), 0.25, device=device), torch.tensor(2.0, device=device)
    before = snapshot(out, step)
    _refused(lambda: _ops.ema_decay_(out, step, torch.tensor(10.0, device=device), "exp", kw["decay"], kw["beta"],
                                     True, kw["warmup_gamma"], kw["warmup_power"]), [which], before, out, step)
