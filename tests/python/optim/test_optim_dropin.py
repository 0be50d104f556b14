"""fusetrain.optim as a drop-in for torch.optim: what a user switching one
import meets, each case run against torch.optim itself.

Argument checks are torch's own (same exception type and message), a loaded
state dict whose ``step`` is a Python number steps, AdamW keeps decoupled
weight decay whatever it loads, float64 params keep float64 state, complex
params are updated as real views and strided views as whole tensors, SGD takes sparse gradients, and
``foreach``/``fused``/``capturable`` only name an implementation."""

import copy

import pytest
import torch

import fusetrain  # noqa: F401
from fusetrain.optim import SGD, Adam, AdamW

from _test_helpers import outcome

SEED = 77
OURS = {"Adam": Adam, "AdamW": AdamW, "SGD": SGD}
TORCH = {"Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW, "SGD": torch.optim.SGD}
ADAM_CONFIGS = [
    dict(lr=-1e-3), dict(lr="fast"), dict(eps=-1e-8), dict(weight_decay=-0.1),
    dict(betas=(1.0, 0.999)), dict(betas=(0.9, -0.5)), dict(betas=(0.9,)), dict(betas=0.9), dict(betas=(0, 0.99)),
    dict(betas=(torch.tensor(0.9), 0.99)), dict(betas=(torch.tensor(0.9), torch.tensor(0.99)), foreach=True),
    dict(betas=(torch.tensor([0.9, 0.8]), torch.tensor(0.99))),
    dict(lr=torch.tensor(0.01), foreach=True), dict(lr=torch.tensor([0.01, 0.02])),
    dict(fused=True, foreach=True),
    # accepted by torch: accepted here (they only name an implementation)
    dict(fused=False), dict(fused=True), dict(foreach=True), dict(foreach=False), dict(capturable=True),
    dict(lr=torch.tensor(0.01), foreach=True, capturable=True), dict(betas=(torch.tensor(0.9), torch.tensor(0.99))),
]
SGD_CONFIGS = [
    dict(lr=-0.1), dict(lr="fast"), dict(momentum=-0.9), dict(weight_decay=-0.1), dict(nesterov=True),
    dict(nesterov=True, momentum=0.9, dampening=0.1), dict(lr=torch.tensor([0.1, 0.2])),
    dict(dampening=-0.1), dict(fused=False), dict(foreach=True), dict(fused=True), dict(weight_decay=torch.tensor(0.1)),
]
CASES = [(n, kw) for n in ("Adam", "AdamW") for kw in ADAM_CONFIGS] + [("SGD", kw) for kw in SGD_CONFIGS]


@pytest.mark.parametrize("name,kw", CASES, ids=[f"{n}-{kw}" for n, kw in CASES])
def test_argument_checks_match_torch(name, kw):
    theirs = outcome(lambda: TORCH[name]([torch.zeros(3, requires_grad=True)], **kw))
    ours = outcome(lambda: OURS[name]([torch.zeros(3, requires_grad=True)], **kw))
    assert ours == theirs


@pytest.mark.parametrize("name", list(OURS))
def test_differentiable_is_a_clear_error(name):
    with pytest.raises(ValueError, match=rf"{name}: differentiable=True is not supported.*torch.optim.{name}"):
        OURS[name]([torch.zeros(3, requires_grad=True)], differentiable=True)


def _params(shapes=((5, 3), (7,)), dtype=torch.float32):
    return [torch.randn(s, dtype=dtype, requires_grad=True) for s in shapes]


def _twins(params):
    return [p.detach().clone().requires_grad_() for p in params], [p.detach().clone().requires_grad_() for p in params]


def _steps(pairs, n, start=0):
    """Same gradients for each (optimizer, params) pair, n steps."""
    for i in range(n):
        g = torch.Generator().manual_seed(1000 + start + i)
        grads = None
        for opt, params in pairs:
            if grads is None:
                grads = [torch.randn(p.shape, dtype=p.dtype, generator=g) for p in params]
            for p, gr in zip(params, grads):
                p.grad = gr.clone()
            opt.step()


@pytest.mark.parametrize("name", ["Adam", "AdamW"])
def test_state_dict_with_python_number_step_loads_and_steps(name):
    a, b = _twins(_params())
    theirs = TORCH[name](a, lr=0.01, weight_decay=0.1)
    _steps([(theirs, a)], 3)
    sd = copy.deepcopy(theirs.state_dict())
    for st in sd["state"].values():
        st["step"] = float(st["step"])  # as older torch versions saved it
    b_params = [p.detach().clone().requires_grad_() for p in a]
    ours = OURS[name](b_params, lr=0.01, weight_decay=0.1)
    ours.load_state_dict(sd)
    assert all(isinstance(ours.state[p]["step"], torch.Tensor) for p in b_params)
    _steps([(theirs, a), (ours, b_params)], 3, start=10)
    for p, q in zip(a, b_params):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-6)
    assert [ours.state[p]["step"].item() for p in b_params] == [6.0, 6.0]


def test_adamw_loading_an_adam_state_dict_keeps_decoupled_weight_decay():
    a, b = _twins(_params())
    src = torch.optim.Adam([p.detach().clone().requires_grad_() for p in a], lr=0.01, weight_decay=0.1)
    sd = src.state_dict()
    theirs, ours = torch.optim.AdamW(a, lr=0.01, weight_decay=0.1), AdamW(b, lr=0.01, weight_decay=0.1)
    theirs.load_state_dict(sd)
    ours.load_state_dict(sd)
    assert ours.param_groups[0]["decoupled_weight_decay"] is True
    assert theirs.param_groups[0]["decoupled_weight_decay"] is True
    _steps([(theirs, a), (ours, b)], 4)
    for p, q in zip(a, b):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name,kw", [("Adam", dict(weight_decay=0.1, amsgrad=True)), ("AdamW", {}),
                                     ("SGD", dict(momentum=0.9, weight_decay=0.01))])
def test_complex64_params_match_torch(name, kw):
    a, b = _twins(_params(dtype=torch.complex64))
    theirs = TORCH[name](a, lr=0.01, foreach=False, **kw)
    ours = OURS[name](b, lr=0.01, **kw)
    _steps([(theirs, a), (ours, b)], 5)
    for p, q in zip(a, b):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)
        for k, v in theirs.state[p].items():
            if k != "step":
                assert ours.state[q][k].dtype == torch.complex64
                torch.testing.assert_close(ours.state[q][k], v, rtol=1e-5, atol=1e-6)
    # A state dict round trip keeps complex state.
    again = OURS[name]([q.detach().clone().requires_grad_() for q in b], lr=0.01, **kw)
    again.load_state_dict(ours.state_dict())
    assert all(v.dtype == torch.complex64 for st in again.state.values() for k, v in st.items() if k != "step")


WIDE_CASES = [("Adam", dict(weight_decay=0.1, amsgrad=True)), ("AdamW", {}), ("AdamW", dict(maximize=True)),
              ("SGD", dict(momentum=0.9, nesterov=True, weight_decay=0.01)), ("SGD", {})]


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128])
@pytest.mark.parametrize("name,kw", WIDE_CASES, ids=[f"{n}-{kw}" for n, kw in WIDE_CASES])
def test_float64_and_complex128_params_match_torch(name, kw, dtype):
    # NOTE [float64 params] in csrc/ops/fused_update.cpp: double-precision
    # update and state. The lr is a power of two so that its float32 device
    # copy is exact and the comparison can be at float64 rounding.
    a, b = _twins(_params(shapes=((5, 3), (7,), (33,)), dtype=dtype))
    theirs = TORCH[name](a, lr=2.0**-7, foreach=False, **kw)
    ours = OURS[name](b, lr=2.0**-7, **kw)
    _steps([(theirs, a), (ours, b)], 12)
    for p, q in zip(a, b):
        torch.testing.assert_close(q, p, rtol=1e-12, atol=1e-13)
        for k, v in theirs.state[p].items():
            if k != "step":
                assert ours.state[q][k].dtype == dtype
                torch.testing.assert_close(ours.state[q][k], v, rtol=1e-12, atol=1e-13)
    # A state dict round trip keeps the wide state, both ways.
    again = OURS[name]([q.detach().clone().requires_grad_() for q in b], lr=2.0**-7, **kw)
    again.load_state_dict(theirs.state_dict())
    assert all(v.dtype == dtype for st in again.state.values() for k, v in st.items() if k != "step")
    back = TORCH[name]([q.detach().clone().requires_grad_() for q in b], lr=2.0**-7, foreach=False, **kw)
    back.load_state_dict(ours.state_dict())
    assert all(v.dtype == dtype for st in back.state.values() for k, v in st.items() if k != "step")


def test_float64_params_with_clipping_master_weights_and_ema_match_the_reference():
    # The whole tail at float64: global-norm clipping (torch's clip_grad_norm_
    # then torch's AdamW), master_weights set (a float64 param needs no master:
    # it is updated in place) and the EMA riding in the pass.
    a, b = _twins(_params(shapes=((9, 4), (5,)), dtype=torch.float64))
    theirs = torch.optim.AdamW(a, lr=2.0**-6, foreach=False)
    ours = AdamW(b, lr=2.0**-6, max_grad_norm=0.5, master_weights=True)
    ema_ref = [p.detach().clone() for p in a]
    ema = [q.detach().clone() for q in b]
    decay = torch.tensor(0.75)
    ours.attach_ema(dict(zip(b, ema)), decay)
    for i in range(8):
        g = torch.Generator().manual_seed(50 + i)
        grads = [torch.randn(p.shape, dtype=torch.float64, generator=g) * 3 for p in a]
        for p, q, gr in zip(a, b, grads):
            p.grad, q.grad = gr.clone(), gr.clone()
        torch.nn.utils.clip_grad_norm_(a, 0.5)
        theirs.step()
        ours.step()
        for e, p in zip(ema_ref, a):
            e.lerp_(p.detach(), 0.25)
    assert "master_param" not in ours.state[b[0]]
    # The clip coefficient is computed in float32 (the device norm is float32).
    for p, q, e, f in zip(a, b, ema_ref, ema):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(f, e, rtol=1e-6, atol=1e-7)


def test_one_group_mixing_float64_float32_and_bfloat16_params():
    # Each param is stepped at its own precision in one step: float64 in
    # double, float32 in place, bfloat16 through its float32 master.
    torch.manual_seed(SEED)
    init = [torch.randn(6, 5, dtype=torch.float64), torch.randn(11), torch.randn(9)]
    ours_p = [init[0].clone(), init[1].clone(), init[2].to(torch.bfloat16)]
    ref_p = [init[0].clone(), init[1].clone(), init[2].to(torch.bfloat16).float()]
    for t in ours_p + ref_p:
        t.requires_grad_()
    ours = AdamW(ours_p, lr=2.0**-7, master_weights=True)
    refs = [torch.optim.AdamW([p], lr=2.0**-7, foreach=False) for p in ref_p]
    for i in range(6):
        g = torch.Generator().manual_seed(300 + i)
        for p, r in zip(ours_p, ref_p):
            gr = torch.randn(p.shape, dtype=r.dtype, generator=g)
            p.grad, r.grad = gr.to(p.dtype), gr.to(p.dtype).to(r.dtype)
        ours.step()
        for o in refs:
            o.step()
    torch.testing.assert_close(ours_p[0], ref_p[0], rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(ours_p[1], ref_p[1], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours.state[ours_p[2]]["master_param"], ref_p[2], rtol=1e-6, atol=1e-6)
    assert ours_p[2].dtype == torch.bfloat16
    assert "master_param" not in ours.state[ours_p[0]] and "master_param" not in ours.state[ours_p[1]]
    assert ours.state[ours_p[0]]["exp_avg"].dtype == torch.float64
    assert ours.state[ours_p[2]]["exp_avg"].dtype == torch.float32


@pytest.mark.parametrize("name,kw", [("AdamW", dict(weight_decay=0.05)), ("SGD", dict(momentum=0.9))])
def test_strided_view_params_match_torch(name, kw):
    base_a = torch.randn(6, 8)
    base_b = base_a.clone()
    a = [base_a[:, ::2].requires_grad_()]  # leaves that view every other column of a larger tensor
    b = [base_b[:, ::2].requires_grad_()]
    assert not b[0].is_contiguous()
    theirs = TORCH[name](a, lr=0.01, foreach=False, **kw)
    ours = OURS[name](b, lr=0.01, **kw)
    _steps([(theirs, a), (ours, b)], 4)
    torch.testing.assert_close(b[0], a[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(base_b, base_a, rtol=1e-6, atol=1e-6)  # the other columns untouched alike
    assert torch.equal(base_b[:, 1::2], base_a[:, 1::2])


@pytest.mark.parametrize("kw", [dict(), dict(momentum=0.9), dict(momentum=0.9, nesterov=True),
                                dict(momentum=0.5, dampening=0.2, maximize=True)])
def test_sgd_sparse_gradients_match_torch(kw):
    """An embedding with sparse=True, as torch.optim.SGD trains it."""
    ref = torch.nn.Embedding(20, 4, sparse=True)
    ours_emb = copy.deepcopy(ref)
    theirs, ours = torch.optim.SGD(ref.parameters(), lr=0.1, **kw), SGD(ours_emb.parameters(), lr=0.1, **kw)
    for step in range(4):
        idx = torch.randint(0, 20, (6,))
        target = torch.randn(6, 4)
        for emb, opt in ((ref, theirs), (ours_emb, ours)):
            opt.zero_grad()
            ((emb(idx) - target) ** 2).sum().backward()
            assert emb.weight.grad.is_sparse
            opt.step()
        torch.testing.assert_close(ours_emb.weight, ref.weight, rtol=1e-6, atol=1e-6)
    # torch's sparse momentum buffer loads (densified) and training goes on alike.
    if kw.get("momentum"):
        again = SGD(copy.deepcopy(ref).parameters(), lr=0.1, **kw)
        again.load_state_dict(theirs.state_dict())
        assert not next(iter(again.state.values()))["momentum_buffer"].is_sparse


@pytest.mark.parametrize("name", ["Adam", "AdamW"])
def test_adam_sparse_gradient_error_is_torchs(name):
    emb = torch.nn.Embedding(5, 3, sparse=True)
    emb(torch.tensor([1, 2])).sum().backward()
    theirs = outcome(lambda: TORCH[name](emb.parameters()).step())
    ours = outcome(lambda: OURS[name](emb.parameters()).step())
    assert ours == theirs and ours[0] is RuntimeError
