"""torch.compile of a mixed-precision training step: autocast forward, loss
scaling (LossScaler), a fused AdamW with global-norm clipping and a ModelEMA
riding in the optimizer's update pass.

* The whole step compiled with inductor (modes default, reduce-overhead,
  max-autotune) follows the eager step, including a step with non-finite
  gradients that both skip.
* The tail (``scaler.step(opt); scaler.update()``, or ``opt.step()`` under bf16)
  traces as one graph with no break.
* lr (a tensor), the EMA decay (a device tensor recomputed every step) and the
  loss scale (device memory) change without recompiling the tail.
* On CUDA: no host synchronisation in a step, and the tail captured in a CUDA
  graph replays like eager execution.

Compiling is slow on a small CPU machine (the first inductor compile of a
session takes tens of seconds), so the models are tiny and the cases few.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounter

import fusetrain
from fusetrain.optim import AdamW

from _test_helpers import CUDA

PRECISIONS = ["fp16", "bf16"]
MODES = ["default", "reduce-overhead", "max-autotune"]
LR = 1e-2


SEED = 1234  # conftest.py seeds torch with it before each test
pytestmark = pytest.mark.usefixtures("fresh_dynamo")


class Run:
    """A model with its AdamW (tensor lr, clipping), attached EMA and scaler.
    The scaler is disabled (all its methods pass through) for bf16."""

    def __init__(self, model, precision, *, total_steps, init_scale=2.0**8, growth_interval=2, device="cpu"):
        self.model = model
        self.precision = precision
        # A tensor lr: a new value is read on the device, dynamo never guards on it.
        self.lr = torch.tensor(LR, device=device)
        self.opt = AdamW(model.parameters(), lr=self.lr, weight_decay=0.05, max_grad_norm=1.0)
        self.ema = fusetrain.ModelEMA(model, decay=0.99, decay_type="exp", total_steps=total_steps,
                                      warmup=True).attach(self.opt)
        self.scaler = precision.make_scaler(init_scale=init_scale, growth_interval=growth_interval)

    def tail(self):
        if self.precision.uses_scaler:
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            self.opt.step()

    def step_counts(self):
        return [self.opt.state[p]["step"].item() for p in self.model.parameters()]


def twins(model, precision, **kwargs):
    return Run(copy.deepcopy(model), precision, **kwargs), Run(copy.deepcopy(model), precision, **kwargs)


def mlp(device="cpu"):
    # No Linear directly followed by BatchNorm (its bias gradient is noise).
    return torch.nn.Sequential(torch.nn.Linear(8, 24), torch.nn.ReLU(), torch.nn.Linear(24, 4)).to(device)


def mlp_with_buffers(device="cpu"):
    # BatchNorm gives the EMA float buffers to average and an int64 buffer
    # (num_batches_tracked) to copy; in the tail tests grads are synthetic, so
    # the Linear->BatchNorm caveat does not apply here.
    net = torch.nn.Sequential(torch.nn.Linear(6, 7), torch.nn.ReLU(), torch.nn.BatchNorm1d(7),
                              torch.nn.Linear(7, 3)).to(device)
    with torch.no_grad():
        net(torch.randn(9, 6, device=device))  # non-trivial running stats
    return net


def assert_same_ema(ea, eb, **tol):
    for (name, a), b in zip(ea.module.state_dict().items(), eb.module.state_dict().values()):
        if tol and a.is_floating_point():
            torch.testing.assert_close(b, a, **tol, msg=lambda s: f"EMA {name}: {s}")
        else:
            assert torch.equal(a, b), f"EMA {name}: max |diff| {(a.double() - b.double()).abs().max().item()}"


# ---- the whole step, compiled with inductor ------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", PRECISIONS)
def test_compiled_amp_step_matches_eager(name, mode):
    precision = fusetrain.resolve_precision(name, "cpu")
    steps, inf_step = 4, 2
    xs = [torch.randn(6, 8) for _ in range(steps)]
    ys = [torch.randn(6, 4) for _ in range(steps)]
    eager, comp = twins(mlp(), precision, total_steps=steps)

    # Non-finite gradients on one step: a hook on a weight replaces its
    # gradient by inf when a Python flag, set by the loop, is on. The hook
    # fires during backward, which dynamo leaves to the autograd engine (it
    # breaks the graph at Tensor.backward()), so the same flag drives the eager
    # and the compiled step. Unlike an input that overflows only in fp16, this
    # works for bf16 too, where max_grad_norm's non-finite check skips the step.
    inject = {"on": False}
    for run in (eager, comp):
        run.model[0].weight.register_hook(lambda g: torch.full_like(g, float("inf")) if inject["on"] else None)

    def make_step(run):
        model, opt, scaler = run.model, run.opt, run.scaler

        def step_fn(x, y):
            with precision.autocast():
                loss = F.mse_loss(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            return loss.detach()

        return step_fn

    eager_step = make_step(eager)
    compiled_step = torch.compile(make_step(comp), mode=None if mode == "default" else mode)
    # The forward/backward of the compiled step is inductor code: it reorders
    # float math and, under autocast, skips some intermediate roundings to
    # fp16/bf16 (e.g. the bias gradient, a batch reduction, goes to fp32
    # without eager's fp16 rounding). Gradients then differ by up to about one
    # ulp of the autocast dtype (eps) and Adam's normalised update turns a
    # relative gradient change d into about lr * d per step: hence the atol
    # below, still >= 25x smaller than what one step moves a param (~lr). fp32
    # roundings of the fused update (rtol 1e-5, atol 1e-6) come on top.
    eps = torch.finfo(precision.dtype).eps
    tol = dict(rtol=1e-5, atol=1e-6 + steps * LR * eps)
    start = [p.detach().clone() for p in comp.model.parameters()]
    scales = []
    for i in range(steps):
        inject["on"] = i == inf_step
        before = [p.detach().clone() for p in comp.model.parameters()]
        le = eager_step(xs[i], ys[i])
        lc = compiled_step(xs[i], ys[i])
        torch.testing.assert_close(lc, le, rtol=eps, atol=0)
        # Non-finite grads on the injected step only, seen alike by both.
        for run in (eager, comp):
            assert run.opt.last_found_inf.item() == float(i == inf_step), f"step {i}"
        if i == inf_step:
            for b, p in zip(before, comp.model.parameters()):
                assert torch.equal(b, p), "the compiled step changed a param on a non-finite step"
        # The scale lives in device memory; both sides update it with the same op.
        assert comp.scaler.get_scale() == eager.scaler.get_scale()
        scales.append(comp.scaler.get_scale())
        for run in (eager, comp):
            assert all(p.grad is None for p in run.model.parameters()), "zero_grad(set_to_none=True) missed"

    for (pname, a), b, s in zip(eager.model.named_parameters(), comp.model.parameters(), start):
        torch.testing.assert_close(b, a, **tol, msg=lambda m: f"param {pname}: {m}")
        assert (b - s).abs().max() > LR, f"param {pname} barely moved: the test would not see a missed step"
    assert_same_ema(eager.ema, comp.ema, **tol)
    assert not torch.equal(next(comp.ema.module.parameters()), start[0]), "the EMA did not move"
    # Counters: the inf step advanced neither the optimizer nor the EMA.
    assert comp.step_counts() == eager.step_counts() == [steps - 1] * 4
    assert comp.ema.step_tensor.item() == eager.ema.step_tensor.item() == steps - 1
    # The EMA decay is computed by inductor code in the compiled step (exp).
    torch.testing.assert_close(comp.ema.decay_tensor, eager.ema.decay_tensor, rtol=1e-6, atol=0)
    if precision.uses_scaler:
        # init 256, growth every 2 finite steps, backoff on the inf step.
        assert scales == [256.0, 512.0, 256.0, 256.0]
        assert comp.scaler.state_dict() == eager.scaler.state_dict()
        assert comp.scaler.skipped_steps.item() == eager.scaler.skipped_steps.item() == 1.0
    else:
        assert scales == [1.0] * steps  # disabled scaler under bf16


# ---- the tail traces as one graph ----------------------------------------------------


@pytest.mark.parametrize("name", PRECISIONS)
def test_tail_is_one_graph_and_runs_fullgraph(name):
    precision = fusetrain.resolve_precision(name, "cpu")
    net = mlp_with_buffers()
    probe = Run(copy.deepcopy(net), precision, total_steps=10)
    eager, comp = twins(net, precision, total_steps=10)

    def set_grads(runs, grads):
        for run in runs:
            if precision.uses_scaler:
                run.scaler.scale(torch.ones(()))  # creates the scale, as scale(loss) does
                scale = run.scaler.get_scale_tensor()
            else:
                scale = 1.0
            for p, g in zip(run.model.parameters(), grads):
                p.grad = g * scale

    set_grads([probe], [torch.randn_like(p) for p in net.parameters()])
    explanation = torch._dynamo.explain(probe.tail)()
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1
    code = explanation.graphs[0].code
    # The whole tail: decay schedule, stats + update pass, buffers' EMA, scale update.
    expected = ["ema_decay_", "fused_step_", "ema_step_"] + (["update_scale_"] if precision.uses_scaler else [])
    for op in expected:
        assert f"torch.ops.fusetrain.{op}" in code, f"{op} is not in the traced graph"
    assert probe.step_counts() == [1] * 6 and probe.ema.step_tensor.item() == 1
    torch._dynamo.reset()

    # fullgraph=True compiles (an error would be raised otherwise) and matches
    # eager: params, optimizer state, scale, EMA and its decay come from the
    # same native ops on the same inputs, so they are bit-identical.
    compiled_tail = torch.compile(comp.tail, fullgraph=True, backend="inductor")
    for i in range(3):
        grads = [torch.randn_like(p) for p in net.parameters()]
        if i == 1:
            grads[2][3] = float("inf")
        set_grads((eager, comp), grads)
        for run in (eager, comp):
            with torch.no_grad():
                run.model[2].running_mean.add_(0.25 * (i + 1))  # as a train-mode forward would
                run.model[2].num_batches_tracked.add_(1)
        eager.tail()
        compiled_tail()
        for a, b in zip(eager.model.parameters(), comp.model.parameters()):
            assert torch.equal(a, b)
            for k in eager.opt.state[a]:
                assert torch.equal(eager.opt.state[a][k], comp.opt.state[b][k]), k
        assert torch.equal(comp.ema.decay_tensor, eager.ema.decay_tensor)
        assert_same_ema(eager.ema, comp.ema, rtol=0, atol=0)
        assert comp.ema.step_tensor.item() == eager.ema.step_tensor.item() == [1, 1, 2][i]
        assert comp.scaler.state_dict() == eager.scaler.state_dict()
    # The inf step kept num_batches_tracked of the EMA copy; the others copied it.
    assert comp.ema.module[2].num_batches_tracked.item() == comp.model[2].num_batches_tracked.item()


# ---- no recompilation when lr, EMA decay or the loss scale change --------------------


@pytest.mark.parametrize("name", PRECISIONS)
def test_changing_lr_decay_and_scale_does_not_recompile(name):
    precision = fusetrain.resolve_precision(name, "cpu")
    net = mlp_with_buffers()
    steps, inf_step = 8, 4
    eager, comp = twins(net, precision, total_steps=steps, init_scale=2.0**10, growth_interval=2)
    cnt = CompileCounter()
    compiled_tail = torch.compile(comp.tail, backend=cnt, fullgraph=True)

    seen = {"lr": [], "decay": [], "scale": []}
    for i in range(steps):
        grads = [torch.randn_like(p) for p in net.parameters()]
        if i == inf_step:
            grads[0][1, 2] = float("nan")
        for run, tail in ((eager, eager.tail), (comp, compiled_tail)):
            if precision.uses_scaler:
                run.scaler.scale(torch.ones(()))
            scale = run.scaler.get_scale_tensor() if precision.uses_scaler else 1.0
            for p, g in zip(run.model.parameters(), grads):
                p.grad = g * scale
            tail()
            # A schedule filling the lr tensor in place (what torch's LR
            # schedulers do with a tensor lr), plus a one-off in-place change.
            run.lr.fill_(LR * 0.8 ** (i + 1))
            if i == 5:
                run.lr.mul_(3.0)
        assert cnt.frame_count == 1, f"recompiled at step {i}"
        seen["lr"].append(comp.lr.item())
        seen["decay"].append(comp.ema.decay_tensor.item())
        seen["scale"].append(comp.scaler.get_scale())
        # The CompileCounter backend runs the captured graph as is: bit-identical to eager.
        for a, b in zip(eager.model.parameters(), comp.model.parameters()):
            assert torch.equal(a, b), f"step {i}"
        assert_same_ema(eager.ema, comp.ema)
        assert comp.scaler.state_dict() == eager.scaler.state_dict()
        assert torch.equal(comp.ema.step_tensor, eager.ema.step_tensor)

    # The values really changed under the one compiled graph.
    assert len(set(seen["lr"])) == steps
    # The decay grows with the EMA's update count. It is evaluated before each
    # step; the skipped step did not advance the count, so the next step
    # evaluates it for the same update number again.
    assert len(set(seen["decay"])) == steps - 1 and seen["decay"][inf_step + 1] == seen["decay"][inf_step]
    assert comp.ema.step_tensor.item() == steps - 1
    assert comp.step_counts() == [steps - 1] * 6
    if precision.uses_scaler:
        # growth_interval 2 doubles the scale every second finite step; the nan step halves it.
        assert seen["scale"] == [1024.0, 2048.0, 2048.0, 4096.0, 2048.0, 2048.0, 4096.0, 4096.0]


def test_torch_lr_scheduler_does_not_recompile():
    # A torch LR scheduler fills a tensor lr in place. It also wraps
    # optimizer.step in a function from torch/optim/lr_scheduler.py, a file
    # dynamo never traces (torch.optim optimizers break the graph there too),
    # so the tail is compiled without fullgraph; the point here is that the
    # lr changes recompile nothing.
    precision = fusetrain.resolve_precision("fp16", "cpu")
    net = mlp()
    eager, comp = twins(net, precision, total_steps=8)
    scheds = [torch.optim.lr_scheduler.CosineAnnealingLR(run.opt, T_max=8, eta_min=1e-4) for run in (eager, comp)]
    cnt = CompileCounter()
    compiled_tail = torch.compile(comp.tail, backend=cnt)
    frames, lrs = [], []
    for i in range(8):
        grads = [torch.randn_like(p) for p in net.parameters()]
        for run, tail, sched in ((eager, eager.tail, scheds[0]), (comp, compiled_tail, scheds[1])):
            run.scaler.scale(torch.ones(()))
            for p, g in zip(run.model.parameters(), grads):
                p.grad = g * run.scaler.get_scale_tensor()
            tail()
            sched.step()
        frames.append(cnt.frame_count)
        lrs.append(comp.lr.item())
        assert comp.opt.param_groups[0]["lr"] is comp.lr, "the scheduler replaced the lr tensor"
        for a, b in zip(eager.model.parameters(), comp.model.parameters()):
            assert torch.equal(a, b), f"step {i}"
        assert_same_ema(eager.ema, comp.ema)
    assert frames[0] > 0 and frames == frames[:1] * 8, f"frames compiled after each step: {frames}"
    assert len(set(lrs)) == 8


# ---- CUDA: no host sync, and CUDA graph capture of the tail --------------------------


@CUDA
@pytest.mark.parametrize("name", PRECISIONS)
def test_cuda_step_has_no_host_sync(name):
    precision = fusetrain.resolve_precision(name, "cuda")
    run = Run(mlp("cuda"), precision, total_steps=4, device="cuda")
    xs = [torch.randn(6, 8, device="cuda") for _ in range(4)]
    ys = [torch.randn(6, 4, device="cuda") for _ in range(4)]
    # torch's own lazy initialisation (cuBLAS handles and workspaces) is not
    # under test: one throwaway forward/backward of a copy of the model first.
    spare = copy.deepcopy(run.model)
    with precision.autocast():
        F.mse_loss(spare(xs[0]), ys[0]).backward()
    inject = {"on": False}
    run.model[0].weight.register_hook(lambda g: torch.full_like(g, float("inf")) if inject["on"] else None)
    start = [p.detach().clone() for p in run.model.parameters()]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i in range(4):  # from the first step: lazy state and scale creation included
            inject["on"] = i == 2
            with precision.autocast():
                loss = F.mse_loss(run.model(xs[i]), ys[i])
            run.scaler.scale(loss).backward()
            run.scaler.step(run.opt)
            run.scaler.update()
            run.opt.zero_grad(set_to_none=True)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert run.step_counts() == [3] * 4
    assert run.ema.step_tensor.item() == 3
    assert all((p - s).abs().max() > 0 for p, s in zip(run.model.parameters(), start))
    if precision.uses_scaler:
        assert run.scaler.skipped_steps.item() == 1


@CUDA
@pytest.mark.parametrize("name", PRECISIONS)
def test_cuda_graph_of_tail_replays_like_eager(name):
    precision = fusetrain.resolve_precision(name, "cuda")
    net = mlp_with_buffers("cuda")
    eager, graphed = twins(net, precision, total_steps=10, device="cuda")
    # Static gradient tensors: the graph reads them at fixed addresses.
    for run in (eager, graphed):
        for p in run.model.parameters():
            p.grad = torch.zeros_like(p)
        if precision.uses_scaler:
            run.scaler.scale(torch.ones((), device="cuda"))  # creates the scale before capture

    def load(run, grads):
        for p, g in zip(run.model.parameters(), grads):
            p.grad.copy_(g)

    def new_grads(with_inf=False):
        grads = [torch.randn_like(p) for p in net.parameters()]
        if with_inf:
            grads[0][0, 0] = float("inf")
        return grads

    # Warm-up (creates the optimizer state) on a side stream, as capture requires.
    warm = [new_grads() for _ in range(2)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for grads in warm:
            load(graphed, grads)
            graphed.tail()
    torch.cuda.current_stream().wait_stream(side)
    for grads in warm:
        load(eager, grads)
        eager.tail()

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed.tail()
    # Capture records kernels without running them: nothing moved.
    torch.cuda.synchronize()
    for a, b in zip(eager.model.parameters(), graphed.model.parameters()):
        assert torch.equal(a, b)

    for i in range(3):
        grads = new_grads(with_inf=i == 1)
        load(graphed, grads)
        graph.replay()
        load(eager, grads)
        eager.tail()
        torch.cuda.synchronize()
        for a, b in zip(eager.model.parameters(), graphed.model.parameters()):
            assert torch.equal(a, b), f"replay {i}: max |diff| {(a - b).abs().max().item()}"
            for k in eager.opt.state[a]:
                assert torch.equal(eager.opt.state[a][k], graphed.opt.state[b][k]), f"replay {i}: state {k}"
        assert_same_ema(eager.ema, graphed.ema)
        assert torch.equal(graphed.ema.step_tensor, eager.ema.step_tensor)
        assert graphed.scaler.state_dict() == eager.scaler.state_dict()
    # 2 warm-up steps + 3 replays, one of them non-finite.
    assert graphed.step_counts() == [4] * 6
    assert graphed.ema.step_tensor.item() == 4
