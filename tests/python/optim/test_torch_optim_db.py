"""PyTorch's own optimizer test data (``optim_db`` of torch.testing._internal.common_optimizers, what torch's
test_optim.py runs) against every fusetrain optimizer with a torch counterpart in the optimizer table:

* each error input of torch's ``test_errors``: the same exception type and message (or warning) at
  construction or at the step, for the same arguments;
* each of torch's input configurations on the CPU: fusetrain's optimizer steps beside torch's for-loop
  implementation on a small problem and ends at torch's weights.

The one error input fusetrain answers otherwise on purpose is listed in DIFFERENT, with the reason."""

import re
import warnings

import pytest
import torch

import fusetrain.optim as fo
from fusetrain.optim._table import CLASSES

common_optimizers = pytest.importorskip("torch.testing._internal.common_optimizers")
# Importing torch's internal test utilities freezes torch.backends' flags for the whole process
# (common_utils calls torch.backends.disable_global_flags()); the Trainer sets cudnn.benchmark, so every
# Trainer test collected into the same pytest worker would fail. The flags are unfrozen again.
torch.backends.flags_frozen.__globals__["__allow_nonbracketed_mutation_flag"] = True  # what disable_global_flags set
assert not torch.backends.flags_frozen()

#: (optimizer, description of torch's error input) -> why fusetrain answers otherwise.
DIFFERENT = {
    ("Muon", "only support 2D parameters"): "fusetrain's Muon takes convolution filters (the matrix out_channels x "
                                            "the rest) and gives params of fewer dims an AdamW group",
}


def _infos():
    """torch's OptimizerInfo of each optimizer with a fusetrain counterpart, by fusetrain's name."""
    out = {}
    for name, (_, decl) in CLASSES.items():
        if decl.torch is None:
            continue
        info = next((i for i in common_optimizers.optim_db if i.optim_cls.__name__ == decl.torch), None)
        if info is not None:
            out[name] = info
    return out


INFOS = _infos()


def test_every_torch_counterpart_has_torchs_data():
    assert set(INFOS) == {n for n, (_, d) in CLASSES.items() if d.torch is not None}


def _error_cases():
    cases = []
    for name, info in INFOS.items():
        for ei in info.optim_error_inputs_func(device="cpu", dtype=torch.float32):
            reason = DIFFERENT.get((name, ei.optimizer_error_input.desc))
            marks = [pytest.mark.skip(reason=reason)] if reason else []
            cases.append(pytest.param(name, ei, id=f"{name}-{ei.optimizer_error_input.desc}", marks=marks))
    return cases


@pytest.mark.parametrize("name,error_input", _error_cases())
def test_errors_are_torchs(name, error_input):
    oi = error_input.optimizer_error_input
    params = oi.params if oi.params is not None else [torch.nn.Parameter(torch.randn(2, 2))]
    cls = getattr(fo, name)
    if issubclass(error_input.error_type, Warning):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cls(params, **oi.kwargs)
        assert any(issubclass(w.category, error_input.error_type) and re.search(error_input.error_regex,
                                                                                  str(w.message)) for w in caught)
        return
    if error_input.error_on == common_optimizers.OptimizerErrorEnum.CONSTRUCTION_ERROR:
        with pytest.raises(error_input.error_type, match=error_input.error_regex):
            cls(params, **oi.kwargs)
        return
    opt = cls(params, **oi.kwargs)
    with pytest.raises(error_input.error_type, match=error_input.error_regex):
        opt.step()


def _config_cases():
    cases = []
    for name, info in INFOS.items():
        for oi in info.optim_inputs_func(device="cpu"):
            if oi.kwargs.get("differentiable"):
                continue  # refused: the fused step runs outside autograd
            cases.append(pytest.param(name, oi, id=f"{name}-{oi.desc}"))
    return cases


def _problem(name, seed):
    g = torch.Generator().manual_seed(seed)
    shapes = [(10, 5), (6, 5)] if name == "Muon" else [(10, 5), (10,)]  # torch's Muon takes matrices only
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]


def _with_params(oi, params):
    """torch's input's params (param groups) over ``params``, or ``params``."""
    if oi.params is None:
        return params
    groups = oi.params if isinstance(oi.params, list) else [oi.params]
    if not groups or not isinstance(groups[0], dict):
        return params
    out = []
    for i, group in enumerate(groups):
        out.append({**{k: v for k, v in group.items() if k != "params"}, "params": [params[i % len(params)]]})
    return out if len(out) == len(params) else params


@pytest.mark.parametrize("name,optim_input", _config_cases())
def test_torchs_configurations_end_at_torchs_weights(name, optim_input):
    ours_p, ref_p = _problem(name, 0), _problem(name, 0)
    kwargs = dict(optim_input.kwargs)
    ours = getattr(fo, name)(_with_params(optim_input, ours_p), **kwargs)
    ref_kwargs = dict(kwargs, foreach=False) if "foreach" in kwargs or name != "Muon" else kwargs
    ref_kwargs.pop("fused", None)
    ref = INFOS[name].optim_cls(_with_params(optim_input, ref_p), **ref_kwargs)
    for step in range(5):
        g = torch.Generator().manual_seed(10 + step)
        for p, q in zip(ours_p, ref_p):
            grad = torch.randn(p.shape, generator=g)
            p.grad, q.grad = grad.clone(), grad.clone()
        ours.step()
        ref.step()
    for p, q in zip(ours_p, ref_p):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)
