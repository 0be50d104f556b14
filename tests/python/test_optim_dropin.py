"""fusetrain.optim as a drop-in for torch.optim: what a user switching one
import meets, each case run against torch.optim itself.

Argument checks are torch's own (same exception type and message), a loaded
state dict whose ``step`` is a Python number steps, AdamW keeps decoupled
weight decay whatever it loads, complex64 params are updated as real views and
strided views as whole tensors, SGD takes sparse gradients, and
``foreach``/``fused``/``capturable`` only name an implementation."""

import copy

import pytest
import torch

import fusetrain  # noqa: F401
from fusetrain.optim import SGD, Adam, AdamW

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


def outcome(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the comparison is the point
        return type(e), str(e)
    return None


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
