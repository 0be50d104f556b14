"""Every numeric setting of the optimizers, ModelEMA, LossScaler and TrainStep refuses NaN, infinities, values out
of its range and values of the wrong type with an error naming it (fusetrain/_checks.py), before anything is
created or changed: at construction, in an added param group, through a setter or an assignment, and in
load_state_dict. Valid values at the edges of each range are taken."""

import copy
import math

import pytest
import torch
from torch import nn

import fusetrain.optim as fo
from _test_helpers import outcome
from fusetrain import LossScaler, ModelEMA
from fusetrain.optim._table import CLASSES
from fusetrain.training.step import TrainStep

NAN, INF = math.nan, math.inf
SEED = 0


def _bad_values(low, high, high_closed=False, low_open=False, integer=False):
    """(id, value) of each bad value for a setting of this range: non-finite, out of range, of the wrong type."""
    out = [("nan", NAN), ("inf", INF), ("-inf", -INF), ("str", "0.5"), ("bool", True), ("none", None)]
    if low is not None:
        out.append(("below", low - 1.0 if integer else (low if low_open else low - abs(low) * 1e-3 - 1e-6)))
    if high is not None:
        out.append(("above", high + 1 if integer else (high * 1.5 + 1.0 if high_closed else high)))
    if integer:
        out.append(("float", 2.5))
    return out


def _raises_naming(fn, name):
    with pytest.raises((TypeError, ValueError)) as info:
        fn()
    assert name in str(info.value), f"the error does not name {name!r}: {info.value}"


def _mlp():
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))


# ---- optimizers: every real option of every class of the optimizer table ------------------------------------


def _real_options():
    for cls_name, (kind, decl) in CLASSES.items():
        yield cls_name, "lr", None, (0.0, None, False)
        yield cls_name, "max_grad_norm", None, (0.0, None, False)
        for name, fields in kind.options_of(decl):
            for part, f in enumerate(fields):
                if f.type in ("real", "int"):
                    high = None if math.isinf(f.high) else f.high
                    yield cls_name, name, (part if len(fields) > 1 or f.part is not None else None), \
                        (f.low, high, f.high_closed)


OPTION_CASES = [pytest.param(c, n, part, lo_hi, bid, bad, id=f"{c}-{n}{'' if part is None else f'[{part}]'}-{bid}")
                for c, n, part, lo_hi in _real_options()
                for bid, bad in _bad_values(*lo_hi[:3], low_open=n == "max_grad_norm",
                                            integer=n == "ns_steps")
                if not (bid == "none" and n == "max_grad_norm")]


def _option_value(cls_name, name, part, value):
    """The constructor keyword setting option ``name`` (its part ``part`` of a tuple) to ``value``."""
    kind, decl = CLASSES[cls_name]
    if part is None:
        return {name: value}
    default = list(kind.option_default(decl, name))
    default[part] = value
    return {name: tuple(default)}


def _params():
    return [nn.Parameter(torch.randn(4, 3)), nn.Parameter(torch.randn(3))]


@pytest.mark.parametrize("cls_name,name,part,lo_hi,bid,bad", OPTION_CASES)
def test_optimizer_options_refuse_bad_values(cls_name, name, part, lo_hi, bid, bad):
    kw = _option_value(cls_name, name, part, bad)
    cls = getattr(fo, cls_name)
    torch_name = CLASSES[cls_name][1].torch
    theirs = outcome(lambda: getattr(torch.optim, torch_name)(_params(), **kw)) if torch_name else None
    with pytest.raises((TypeError, ValueError)) as info:
        cls(_params(), **kw)
    if theirs is None or theirs[1] != str(info.value):  # else torch's own check and message, as the drop-in promises
        assert name in str(info.value), info.value
    # An added group is checked as the constructor's arguments (torch checks none); a refused one leaves the
    # optimizer as it was.
    opt = cls(_params())
    groups = copy.deepcopy([{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups])
    _raises_naming(lambda: opt.add_param_group(dict(kw, params=[nn.Parameter(torch.randn(2, 2))])), name)
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == groups


@pytest.mark.parametrize("cls_name", list(CLASSES))
def test_optimizer_edges_are_taken(cls_name):
    """lr 0, every option at its low end and just under an open high end (a tuple option one part at a time)."""
    kind, decl = CLASSES[cls_name]
    cls = getattr(fo, cls_name)
    cls(_params(), lr=0.0)
    cls(_params(), max_grad_norm=1e-30)
    for name, fields in kind.options_of(decl):
        for part, f in enumerate(fields):
            if f.type != "real" or f.low is None:
                continue
            high = 1e30 if math.isinf(f.high) else (f.high if f.high_closed else math.nextafter(f.high, 0.0))
            for v in (f.low, high):
                cls(_params(), **_option_value(cls_name, name, part if len(fields) > 1 or f.part is not None else None,
                                               v))


@pytest.mark.parametrize("bad", [NAN, INF, -1.0, "0.1"], ids=["nan", "inf", "neg", "str"])
def test_group_lr_changed_to_a_bad_number_is_refused_before_the_step_writes(bad):
    params = _params()
    opt = fo.AdamW(params, lr=1e-2)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    before = [p.detach().clone() for p in params] + [v.clone() for p in params for v in opt.state[p].values()]
    opt.param_groups[0]["lr"] = bad
    _raises_naming(opt.step, "lr")
    after = [p.detach().clone() for p in params] + [v.clone() for p in params for v in opt.state[p].values()]
    assert all(torch.equal(a, b) for a, b in zip(before, after))


@pytest.mark.parametrize("name,bad", [("betas", (0.9, INF)), ("weight_decay", INF), ("eps", INF), ("eps", NAN)])
def test_group_option_changed_to_a_non_finite_value_is_refused_before_the_step_writes(name, bad):
    params = _params()
    opt = fo.AdamW(params, lr=1e-2)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    before = [p.detach().clone() for p in params]
    opt.param_groups[0][name] = bad
    _raises_naming(opt.step, "beta2" if name == "betas" else name)
    assert all(torch.equal(a, b.detach()) for a, b in zip(before, params))


# ---- ModelEMA ----------------------------------------------------------------------------------------------

EMA_RANGES = {"decay": (0.0, 1.0, False, True, False), "beta": (0.0, None, False, True, False),
              "warmup_gamma": (0.0, None, False, True, False), "warmup_power": (0.0, None, False, True, False),
              "total_steps": (1, None, False, False, True)}
EMA_CASES = [pytest.param(n, bad, id=f"{n}-{bid}") for n, r in EMA_RANGES.items()
             for bid, bad in _bad_values(*r[:3], low_open=r[3], integer=r[4])
             if not (n == "total_steps" and bad is None)]  # None: no run length


@pytest.mark.parametrize("name,bad", EMA_CASES)
def test_ema_settings_refuse_bad_values(name, bad):
    _raises_naming(lambda: ModelEMA(_mlp(), **{name: bad}), name)


def test_ema_warmup_gamma_nan_is_refused():
    """The case of issue 65: a NaN warmup setting was taken and the decay became NaN."""
    with pytest.raises(ValueError, match=r"ModelEMA: warmup_gamma must be a finite number > 0, got nan"):
        ModelEMA(_mlp(), warmup=True, warmup_gamma=NAN)


@pytest.mark.parametrize("name,bad", [("decay_type", "linear"), ("decay_type", 1), ("warmup", "yes"),
                                      ("include_buffers", 1), ("remainder", "no")])
def test_ema_choices_and_flags_refuse_bad_values(name, bad):
    _raises_naming(lambda: ModelEMA(_mlp(), **{name: bad}), name)


@pytest.mark.parametrize("kw", [dict(decay=1e-12), dict(decay=math.nextafter(1.0, 0.0)), dict(beta=1e-30),
                                dict(warmup_gamma=1e-30, warmup=True), dict(warmup_power=1e-30), dict(total_steps=1),
                                dict(total_steps=None, decay_type="threshold")])
def test_ema_edges_are_taken(kw):
    model = _mlp()
    ema = ModelEMA(model, **dict(dict(total_steps=10), **kw))
    ema.update(model)
    assert math.isfinite(ema.decay_tensor.item())


@pytest.mark.parametrize("name,bad", EMA_CASES)
def test_ema_assignment_and_load_state_dict_refuse_bad_values(name, bad):
    model = _mlp()
    ema = ModelEMA(model, total_steps=10)
    ema.update(model)
    state = ema.state_dict()
    before = {k: v.clone() for k, v in ema.module.state_dict().items()}
    settings = {k: getattr(ema, k) for k in EMA_RANGES}
    if name == "total_steps":
        _raises_naming(lambda: ema.set_total_steps(bad), name)
    else:
        _raises_naming(lambda: setattr(ema, name, bad), name)
    # Saved by another version or edited: loading it changes nothing.
    bad_state = dict(state, **{name: bad})
    bad_state["module"] = {k: torch.full_like(v, 7) if v.is_floating_point() else v for k, v in state["module"].items()}
    bad_state["step"] = torch.tensor(99.0)
    _raises_naming(lambda: ema.load_state_dict(bad_state), name)
    assert {k: getattr(ema, k) for k in EMA_RANGES} == settings
    assert ema.step_tensor.item() == 1.0
    assert all(torch.equal(before[k], v) for k, v in ema.module.state_dict().items())


@pytest.mark.parametrize("bad", [torch.tensor(NAN), torch.tensor(-1.0), torch.tensor(INF)], ids=["nan", "neg", "inf"])
def test_ema_load_state_dict_refuses_a_bad_step(bad):
    model = _mlp()
    ema = ModelEMA(model, total_steps=10)
    _raises_naming(lambda: ema.load_state_dict(dict(ema.state_dict(), step=bad)), "step")
    assert ema.step_tensor.item() == 0.0


# ---- LossScaler --------------------------------------------------------------------------------------------

SCALER_RANGES = {"init_scale": (2.0**-126, None, False, False, False), "growth_factor": (1.0, None, False, True, False),
                 "backoff_factor": (0.0, 1.0, False, True, False), "growth_interval": (1, None, False, False, True)}
SCALER_CASES = [pytest.param(n, bad, id=f"{n}-{bid}") for n, r in SCALER_RANGES.items()
                for bid, bad in _bad_values(*r[:3], low_open=r[3], integer=r[4])]


@pytest.mark.parametrize("name,bad", SCALER_CASES)
def test_scaler_settings_refuse_bad_values(name, bad):
    _raises_naming(lambda: LossScaler(**{name: bad}), name)
    ls = LossScaler(init_scale=4.0)
    ls.scale(torch.ones(()))
    state = ls.state_dict()
    setter = {"growth_factor": ls.set_growth_factor, "backoff_factor": ls.set_backoff_factor,
              "growth_interval": ls.set_growth_interval}.get(name)
    if setter is not None:
        _raises_naming(lambda: setter(bad), name)
    key = "scale" if name == "init_scale" else name
    _raises_naming(lambda: ls.load_state_dict(dict(state, **{key: bad})), key)
    if name == "init_scale" and bad is not None:  # update(None) updates from the steps' flags
        _raises_naming(lambda: ls.update(bad), "new_scale")
    assert ls.state_dict() == state


@pytest.mark.parametrize("kw", [dict(init_scale=2.0**-126), dict(growth_factor=math.nextafter(1.0, 2.0)),
                                dict(backoff_factor=1e-30), dict(backoff_factor=math.nextafter(1.0, 0.0)),
                                dict(growth_interval=1), dict(init_scale=3e38)])
def test_scaler_edges_are_taken(kw):
    ls = LossScaler(**kw)
    ls.scale(torch.ones(()))
    assert ls.state_dict()["scale"] == pytest.approx(kw.get("init_scale", 2.0**16))


# ---- TrainStep ---------------------------------------------------------------------------------------------

STEP_CASES = ([pytest.param(n, bad, id=f"{n}-{bid}") for n in ("accumulate", "warmup_steps")
               for bid, bad in _bad_values(1, None, integer=True)]
              + [pytest.param("clip_grad_norm", bad, id=f"clip_grad_norm-{bid}")
                 for bid, bad in _bad_values(0.0, None, low_open=True) if bad is not None]
              + [pytest.param("channels_last", bad, id=f"channels_last-{bad}") for bad in ("yes", 1, None)])


@pytest.mark.parametrize("name,bad", STEP_CASES)
def test_train_step_settings_refuse_bad_values(name, bad):
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # clip_grad_norm is for torch.optim optimizers
    _raises_naming(lambda: TrainStep(model, nn.functional.mse_loss, opt, **{name: bad}), name)


def test_train_step_edges_are_taken():
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = TrainStep(model, nn.functional.mse_loss, opt, accumulate=1, warmup_steps=1, clip_grad_norm=1e-30,
                     channels_last=False)
    step(torch.randn(4, 3), torch.randn(4, 2))
    assert all(torch.isfinite(p).all() for p in model.parameters())
