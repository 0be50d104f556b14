"""torch.compile (inductor, CPU) of code that calls fusetrain optimizers.

Dynamo runs the optimizer's ``_init_group`` eagerly (lazy state creation never
lands in a graph) and traces the rest of ``step()``: the device-side
``fusetrain::fused_step_`` op (stats pass and fused update), which has a fake
kernel. A compiled step must trace as one graph with no break and give exactly
what the eager step gives: both run the same native kernels on the same inputs.

Compiling is slow on a 2-core machine (the first inductor compile of the session
takes tens of seconds), so there are few, broad cases here.
"""

import copy
import os

import pytest
import torch

import fusetrain
from fusetrain.optim import SGD, AdamP, AdamW, Lamb, Lion, NAdam

SHAPES = [(7,), (3, 5), (1,), (1031,)]
FUSETRAIN_DIR = os.path.dirname(fusetrain.__file__)


SEED = 777  # conftest.py seeds torch with it before each test
pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def leaves(dtype):
    return [torch.randn(s).to(dtype).requires_grad_() for s in SHAPES]


def twin(params):
    return [p.detach().clone().requires_grad_() for p in params]


def set_grads(params, grads):
    for p, g in zip(params, grads):
        p.grad = g.clone()


def assert_same_params_and_state(opt_a, pa, opt_b, pb):
    for i, (x, y) in enumerate(zip(pa, pb)):
        assert torch.equal(x, y), f"param {i}: max |diff| {(x.float() - y.float()).abs().max().item()}"
        sa, sb = opt_a.state[x], opt_b.state[y]
        assert set(sa) == set(sb)
        for k in sa:
            assert torch.equal(sa[k], sb[k]), f"state {k} of param {i}"


CASES = {
    "AdamW": (lambda ps: AdamW(ps, lr=0.01, weight_decay=0.05), torch.float32, "adam"),
    "SGD-momentum": (lambda ps: SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01), torch.float32,
                     "sgd"),
    "Lion": (lambda ps: Lion(ps, lr=0.01, weight_decay=0.1), torch.float32, "lion"),
    "AdamW-max_grad_norm": (lambda ps: AdamW(ps, lr=0.01, max_grad_norm=0.5), torch.float32, "adam"),
    "AdamW-master-bf16": (lambda ps: AdamW(ps, lr=0.01, master_weights=True), torch.bfloat16, "adam"),
    "NAdam": (lambda ps: NAdam(ps, lr=0.01, weight_decay=0.05), torch.float32, "nadam"),
    "Lamb": (lambda ps: Lamb(ps, lr=0.01, caution=True), torch.float32, "lamb"),
    "AdamP-master-bf16": (lambda ps: AdamP(ps, lr=0.01, weight_decay=0.05, delta=1.0, master_weights=True),
                          torch.bfloat16, "adamp"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_compiled_step_has_no_graph_break_and_matches_eager(case):
    make, dtype, op_name = CASES[case]
    start = leaves(dtype)
    steps = 4
    grads = [[torch.randn(p.shape).to(dtype) for p in start] for _ in range(steps)]
    if case == "AdamW-max_grad_norm":
        grads[2][3][5] = float("inf")  # a non-finite step: skipped on both sides

    # Graph breaks, on a throwaway optimizer (explain runs the function).
    probe = twin(start)
    probe_opt = make(probe)
    set_grads(probe, grads[0])

    def probe_step():
        probe_opt.step()

    explanation = torch._dynamo.explain(probe_step)()
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1
    assert f"torch.ops.fusetrain.fused_step_('{op_name}'" in explanation.graphs[0].code
    assert probe_opt.state[probe[0]]["step"].item() == 1
    torch._dynamo.reset()

    eager, compiled = twin(start), twin(start)
    eager_opt, compiled_opt = make(eager), make(compiled)

    def step():
        compiled_opt.step()

    compiled_step = torch.compile(step, fullgraph=True, backend="inductor")
    for i, gs in enumerate(grads):
        if i == 3 and case == "AdamW":
            # A new float lr: dynamo guards on it and recompiles.
            eager_opt.param_groups[0]["lr"] = compiled_opt.param_groups[0]["lr"] = 0.003
        set_grads(eager, gs)
        set_grads(compiled, gs)
        eager_opt.step()
        compiled_step()
        assert_same_params_and_state(eager_opt, eager, compiled_opt, compiled)
        # The norm is NaN when the step measured none (no clipping).
        torch.testing.assert_close(compiled_opt.last_grad_norm, eager_opt.last_grad_norm, rtol=0, atol=0,
                                   equal_nan=True)
        assert torch.equal(eager_opt.last_found_inf, compiled_opt.last_found_inf)
    assert all(not torch.equal(p, q) for p, q in zip(compiled, start)), "the compiled step did not update params"
    expected_steps = 3 if case == "AdamW-max_grad_norm" else 4
    assert compiled_opt.state[compiled[0]]["step"].item() == expected_steps
    if case == "AdamW-master-bf16":
        for p in compiled:
            m = compiled_opt.state[p]["master_param"]
            assert m.dtype == torch.float32 and torch.equal(m.to(torch.bfloat16), p.detach())


def test_compiled_train_step_with_mlp_matches_eager():
    # forward + backward + step + zero_grad in one compiled function. Dynamo
    # itself breaks the graph at Tensor.backward() and Optimizer.zero_grad (both
    # by design); none of the breaks may come from fusetrain.
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    xs = [torch.randn(5, 6) for _ in range(3)]
    ys = [torch.randn(5, 3) for _ in range(3)]

    def train_step(net, opt, x, y):
        loss = torch.nn.functional.mse_loss(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    probe = copy.deepcopy(model)
    explanation = torch._dynamo.explain(train_step)(probe, AdamW(probe.parameters(), lr=0.01), xs[0], ys[0])
    for reason in explanation.break_reasons:
        frames = [f.filename for f in reason.user_stack]
        assert not any(f.startswith(FUSETRAIN_DIR) for f in frames), reason.reason
    torch._dynamo.reset()

    eager_net, compiled_net = copy.deepcopy(model), copy.deepcopy(model)
    eager_opt = AdamW(eager_net.parameters(), lr=0.01, max_grad_norm=1.0)
    compiled_opt = AdamW(compiled_net.parameters(), lr=0.01, max_grad_norm=1.0)
    compiled_step = torch.compile(train_step, backend="inductor")
    for x, y in zip(xs, ys):
        le = train_step(eager_net, eager_opt, x, y)
        lc = compiled_step(compiled_net, compiled_opt, x, y)
        torch.testing.assert_close(lc, le, rtol=1e-5, atol=1e-6)
    # Inductor fuses the forward/backward kernels, so gradients differ from eager
    # by a few ulps; Adam's normalised update passes that on to the params. Each
    # step moves a param by about lr = 1e-2, far outside this tolerance.
    for (name, a), b, m in zip(eager_net.named_parameters(), compiled_net.parameters(), model.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=2e-5, msg=lambda s: f"{name}: {s}")
        assert (b - m).abs().max() > 1e-3, f"{name} was not updated"
        assert b.grad is None, "zero_grad() in the compiled function did not clear the gradient"
        assert compiled_opt.state[b]["step"].item() == 3
    torch.testing.assert_close(compiled_opt.last_grad_norm, eager_opt.last_grad_norm, rtol=1e-5, atol=0)
