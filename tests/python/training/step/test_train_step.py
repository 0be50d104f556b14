"""fusetrain.TrainStep: the whole training step run eagerly ("off"), under
torch.compile ("compile") or captured as CUDA graphs ("cuda_graph").

CPU: "off" is the Trainer's eager loop statement for statement; "compile"
follows it (BatchNorm + attached EMA + AdamW with clipping, gradient
accumulation, a smaller last batch), lr changes recompile nothing, shape changes
run eagerly (with a warning unless it is a smaller last batch), bad arguments
fail clearly, and the Trainer with compile_step trains and resumes like eager.
GPU (skipped without one): captured steps replay like eager ones, including a
skipped fp16 step, accumulation with two graphs, an LR schedule without
recapture, no host sync during replay, shape changes and a model that cannot
be captured.

Compiling is slow on a small CPU machine: most compiled cases use the
``aot_eager`` backend (dynamo + AOTAutograd, no code generation), which
exercises the same graph split and tail tracing; one case uses inductor.
"""

import copy
import os
import warnings

import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounter

import fusetrain
from fusetrain import TrainStep
from fusetrain.optim import SGD, AdamW
from fusetrain.training import TrainingParamsError
from fusetrain.training.checkpoint.files import load_checkpoint
from fusetrain.training.data import build_dataloaders
from fusetrain.models import build_model
from fusetrain.training.trainer import Trainer

from _test_helpers import CUDA
from _train_helpers import InterruptingLoader
from _test_helpers import run_path

LR = 1e-2
LOSS = nn.CrossEntropyLoss()


@pytest.fixture(autouse=True)
def _fresh():
    torch._dynamo.reset()
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: steadier on a busy 2-core machine
    torch.manual_seed(1234)
    yield
    torch.set_num_threads(n)
    torch._dynamo.reset()


def cnn(device="cpu", seed=0):
    # No bias before BatchNorm: its gradient is zero up to rounding noise, which
    # Adam's normalised update would turn into lr-sized steps of either sign.
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(1, 6, 3, padding=1, bias=False), nn.BatchNorm2d(6), nn.ReLU(),
                         nn.Conv2d(6, 8, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10)).to(device)


def mlp(device="cpu", seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Flatten(), nn.Linear(100, 16, bias=False), nn.BatchNorm1d(16), nn.ReLU(),
                         nn.Linear(16, 10)).to(device)


def batches(sizes, image=10, device="cpu", seed=7):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, 1, image, image, generator=g).to(device),
             torch.randint(0, 10, (n,), generator=g).to(device)) for n in sizes]


class Run:
    """A model with its optimizer (tensor lr; fused AdamW clips inside its step,
    torch's AdamW through TrainStep's clip_grad_norm), an EMA and a scaler."""

    def __init__(self, net, precision="fp32", *, fused=True, device="cpu", init_scale=2.0**8):
        self.model = copy.deepcopy(net)
        self.precision = fusetrain.resolve_precision(precision, device)
        self.lr = torch.tensor(LR, device=device)
        if fused:
            self.opt = AdamW(self.model.parameters(), lr=self.lr, weight_decay=0.05, max_grad_norm=1.0)
            self.clip = None
        else:
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR, weight_decay=0.05)
            self.clip = 1.0
        self.fused = fused
        self.ema = fusetrain.ModelEMA(self.model, decay=0.9, decay_type="threshold")
        self.scaler = self.precision.make_scaler(init_scale=init_scale, growth_interval=2)

    def step(self, mode, accumulate=1, **kw):
        return TrainStep(self.model, LOSS, self.opt, self.scaler, self.precision, mode=mode, accumulate=accumulate,
                         ema=self.ema, clip_grad_norm=self.clip, **kw)

    def set_lr(self, value):
        if self.fused:
            self.lr.fill_(value)
        else:
            for g in self.opt.param_groups:
                g["lr"] = value

    def train(self, step, data, lrs):
        """The Trainer's loop: lr set before each call that steps; the last batch forces the tail."""
        outs, n = [], 0
        for i, (x, y) in enumerate(data):
            last = i + 1 == len(data)
            if step.will_step(last):
                self.set_lr(lrs[n])
                n += 1
            out, loss = step(x, y, last=last)
            outs.append((out.clone(), loss.clone()))
        return outs, n


def lr_schedule(n):
    return [LR * (0.7 ** i) for i in range(n)]


def assert_runs_close(a, b, **tol):
    for (name, pa), pb in zip(a.model.state_dict().items(), b.model.state_dict().values()):
        if tol and pa.is_floating_point():
            torch.testing.assert_close(pb, pa, **tol, msg=lambda m: f"{name}: {m}")
        else:
            assert torch.equal(pa, pb), f"{name}: max |diff| {(pa.double() - pb.double()).abs().max().item()}"
    for (name, ea), eb in zip(a.ema.module.state_dict().items(), b.ema.module.state_dict().values()):
        if tol and ea.is_floating_point():
            torch.testing.assert_close(eb, ea, **tol, msg=lambda m: f"EMA {name}: {m}")
        else:
            assert torch.equal(ea, eb), f"EMA {name}"
    assert torch.equal(a.ema.step_tensor, b.ema.step_tensor)
    for pa, pb in zip(a.model.parameters(), b.model.parameters()):
        for k, va in a.opt.state[pa].items():
            vb = b.opt.state[pb][k]
            if tol and k != "step":
                torch.testing.assert_close(vb, va, **tol, msg=lambda m: f"state {k}: {m}")
            else:
                assert torch.equal(va, vb), f"state {k}"


def hand_loop(run, data, accumulate, lrs):
    """The Trainer's eager loop before TrainStep, statement for statement."""
    if run.fused:
        run.ema.attach(run.opt)  # as the Trainer does
    micro, n = 0, 0
    for i, (x, y) in enumerate(data):
        with run.precision.autocast():
            out = run.model(x)
            loss = LOSS(out, y)
        micro += 1
        do_step = micro % accumulate == 0 or i + 1 == len(data)
        run.scaler.scale(loss / accumulate if accumulate > 1 else loss).backward()
        if do_step:
            run.set_lr(lrs[n])
            n += 1
            skip = False
            if not run.fused:
                run.scaler.unscale_(run.opt)
                norm = torch.nn.utils.clip_grad_norm_(run.model.parameters(), run.clip)
                skip = not run.scaler.is_enabled() and not bool(torch.isfinite(norm))
            if not skip:
                run.scaler.step(run.opt)
                run.scaler.update()
                if not run.fused:
                    run.ema.update(run.model, found_inf=run.scaler.last_step_skipped
                                   if run.scaler.is_enabled() else None)
            run.opt.zero_grad(set_to_none=True)
            micro = 0
    return n


# ---- arguments ------------------------------------------------------------------------


def test_bad_mode_lists_the_modes():
    run = Run(cnn())
    with pytest.raises(ValueError, match=r"mode must be one of 'off', 'compile', 'cuda_graph', got 'graph'"):
        run.step("graph")


@pytest.mark.parametrize("kw,match", [
    (dict(accumulate=0), "accumulate must be an int >= 1, got 0"),
    (dict(warmup_steps=0), "warmup_steps must be an int >= 1, got 0"),
    (dict(compile_options={"modes": "x"}), r"unknown key\(s\) \['modes'\]"),
])
def test_bad_arguments(kw, match):
    run = Run(cnn())
    with pytest.raises(ValueError, match=match):
        run.step("off", **kw)


def test_clip_grad_norm_is_for_torch_optimizers():
    run = Run(cnn())
    with pytest.raises(ValueError, match="max_grad_norm"):
        TrainStep(run.model, LOSS, run.opt, clip_grad_norm=1.0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU error")
def test_cuda_graph_on_cpu_raises_a_clear_error():
    run = Run(cnn())
    with pytest.raises(ValueError, match=r"compile_step='cuda_graph' needs the model on a CUDA device, found cpu.*"
                                         r"'compile' or 'off'"):
        run.step("cuda_graph")


def test_attaches_the_ema_to_a_fused_optimizer():
    run = Run(cnn())
    assert run.ema._optimizer is None
    step = run.step("off")
    assert run.ema._optimizer is run.opt and step.mode == "off" and not step.captured


# ---- mode "off" is the Trainer's loop ----------------------------------------------------


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "torch"])
@pytest.mark.parametrize("precision,accumulate", [("fp32", 1), ("fp32", 2), ("fp16", 2)])
def test_off_is_the_eager_loop(precision, accumulate, fused):
    if precision == "fp16" and not fused:
        pytest.skip("fp16 autocast on CPU with torch's optimizer adds nothing to the fused case")
    net = cnn()
    data = batches([8, 8, 8, 8, 5])  # a smaller last batch; with accumulate 2 the last group has one batch
    lrs = lr_schedule(5)
    a, b = Run(net, precision, fused=fused), Run(net, precision, fused=fused)
    n_hand = hand_loop(a, data, accumulate, lrs)
    _, n_step = b.train(b.step("off", accumulate), data, lrs)
    assert n_hand == n_step == -(-5 // accumulate)
    assert_runs_close(a, b)
    assert a.ema.step_tensor.item() == n_step


# ---- mode "compile" --------------------------------------------------------------------


def compile_case(precision, accumulate, backend, sizes, fused=True, net=None):
    net = cnn() if net is None else net
    data = batches(sizes)
    lrs = lr_schedule(len(sizes))
    eager, comp = Run(net, precision, fused=fused), Run(net, precision, fused=fused)
    eager_outs, _ = eager.train(eager.step("off", accumulate), data, lrs)
    step = comp.step("compile", accumulate, compile_options={"backend": backend})
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="TrainStep")  # a smaller last batch is not worth a warning
        comp_outs, _ = comp.train(step, data, lrs)
    assert step.captured
    return eager, comp, eager_outs, comp_outs, net


@pytest.mark.parametrize("precision,accumulate", [("fp32", 1), ("fp32", 2), ("bf16", 2)])
def test_compile_matches_off(precision, accumulate):
    # aot_eager runs AOTAutograd's decomposed forward/backward graphs: a few
    # fp32 roundings differ from eager (e.g. BatchNorm's decomposition); under
    # bf16 autocast the graphs may keep some values in fp32 where eager rounds.
    tol = dict(rtol=1e-4, atol=1e-5) if precision == "fp32" else dict(rtol=2e-2, atol=2e-3)
    eager, comp, eo, co, net = compile_case(precision, accumulate, "aot_eager", [8, 8, 8, 8, 5])
    assert_runs_close(eager, comp, **tol)
    for (oe, le), (oc, lc) in zip(eo, co):
        torch.testing.assert_close(lc, le, **tol)
        torch.testing.assert_close(oc, oe, **tol)
    moved = max((p - q).abs().max().item() for p, q in zip(comp.model.parameters(), net.parameters()))
    assert moved > 10 * tol["atol"], "the weights barely moved: the comparison would not see a missed step"
    assert comp.ema.step_tensor.item() == -(-5 // accumulate)


def test_compile_with_inductor_matches_off():
    # An MLP with BatchNorm: inductor's C++ code generation for a CNN's
    # backward takes minutes on a small CPU machine.
    eager, comp, _, _, _ = compile_case("fp32", 1, "inductor", [8, 8, 8, 5], net=mlp())
    # Inductor's fused kernels reorder float sums: fp32 roundings only.
    assert_runs_close(eager, comp, rtol=1e-4, atol=1e-5)


def test_compile_with_a_torch_optimizer_compiles_forward_and_backward():
    eager, comp, _, _, _ = compile_case("fp32", 2, "aot_eager", [8, 8, 8, 5], fused=False)
    assert_runs_close(eager, comp, rtol=1e-4, atol=1e-5)


def test_lr_changes_take_effect_without_recompiling():
    net = cnn()
    data = batches([8] * 7)
    lrs = lr_schedule(7)
    eager, comp = Run(net), Run(net)
    eager.train(eager.step("off"), data, lrs)
    cnt = CompileCounter()
    step = comp.step("compile", compile_options={"backend": cnt})
    frames = []
    for i, (x, y) in enumerate(data):
        comp.set_lr(lrs[i])
        step(x, y)
        frames.append(cnt.frame_count)
    # One forward frame and one tail frame (dynamo splits at backward()), compiled once.
    assert frames == [2] * 7, frames
    # The CompileCounter backend runs the captured graphs as they are: bit-identical
    # to eager, so each step used the lr filled in before it.
    assert_runs_close(eager, comp)
    assert len(set(lrs)) == 7


def test_shape_changes_run_eagerly():
    net = cnn()
    full, big = batches([8, 8, 5, 8, 5, 4]), batches([8], image=12)[0]
    # Sizes 8, 8, 5, 8, 5, then a new image size (a warning), then 4: smaller
    # batches followed by full ones pass silently, and there is one warning in all.
    data = full[:5] + [big] + full[5:]
    lrs = lr_schedule(len(data))
    eager, comp = Run(net), Run(net)
    eager.train(eager.step("off"), data, lrs)
    cnt = CompileCounter()
    step = comp.step("compile", compile_options={"backend": cnt})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i, (x, y) in enumerate(data[:4]):
            comp.set_lr(lrs[i])
            step(x, y)
        assert not caught, [str(w.message) for w in caught]
        comp.set_lr(lrs[4])
        step(*data[4])
        assert not caught  # a smaller batch alone looks like the end of an epoch
        comp.set_lr(lrs[5])
        step(*data[5])  # the image size changed
        comp.set_lr(lrs[6])
        step(*data[6])
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1, messages
    assert "compiled for x (8, 1, 10, 10)" in messages[0] and "got x (8, 1, 12, 12)" in messages[0]
    assert cnt.frame_count == 2, "a shape change recompiled the step"
    assert_runs_close(eager, comp)


def test_two_smaller_batches_in_a_row_warn():
    run = Run(cnn())
    step = run.step("compile", compile_options={"backend": CompileCounter()})
    data = batches([8, 5, 5])
    step(*data[0])
    step(*data[1])
    with pytest.warns(UserWarning, match=r"compiled for x \(8, 1, 10, 10\).*got x \(5, 1, 10, 10\)"):
        step(*data[2])


def test_invalidate_rebuilds_the_compiled_step():
    run = Run(cnn())
    cnt = CompileCounter()
    step = run.step("compile", compile_options={"backend": cnt})
    data = batches([8, 8, 6, 6])
    step(*data[0])
    step(*data[1])
    assert cnt.frame_count == 2
    step.invalidate()
    assert not step.captured
    step(*data[2])  # a new shape: compiled afresh for it, no warning
    step(*data[3])
    assert step.captured and cnt.frame_count == 4


# ---- Trainer --------------------------------------------------------------------------


def digits(batch_size=256):
    # 1438 training images: five batches of 256 and a smaller last one of 158.
    return build_dataloaders({"name": "digits", "batch_size": batch_size, "image_size": 8})


def train(tmp_path, name, stop_at_epoch=None, **params):
    torch.manual_seed(0)
    model = build_model("digits_cnn", num_classes=10, width=8)
    base = dict(max_epochs=2, progress_bar=False, device="cpu", ema=True,
                ema_params={"decay": 0.9, "decay_type": "threshold"}, clip_grad_norm=1.0, initial_lr=3e-3,
                lr_mode="cosine", max_valid_batches=1)
    tl, vl = digits()
    # Raises at the start of epoch stop_at_epoch (None: never). Every run goes through the wrapper: a loader
    # that is not a DataLoader keeps its own order (NOTE [global order]), the same in each run.
    tl = InterruptingLoader(tl, epoch=stop_at_epoch)
    result = Trainer(name, ckpt_root_dir=str(tmp_path)).train(model, {**base, **params}, tl, vl)
    return result, model


def test_trainer_compile_step_matches_off(tmp_path):
    params = dict(batch_accumulate=2, torch_compile_options={"backend": "aot_eager"})
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="TrainStep")
        res_c, model_c = train(tmp_path, "compiled", compile_step="compile", **params)
    res_e, model_e = train(tmp_path, "eager", compile_step="off", **params)
    for (name, a), b in zip(model_e.state_dict().items(), model_c.state_dict().values()):
        if a.is_floating_point():
            torch.testing.assert_close(b, a, rtol=1e-3, atol=1e-4, msg=lambda m: f"{name}: {m}")
        else:
            assert torch.equal(a, b), name
    fe, fc = res_e["final"], res_c["final"]
    assert fc["train_loss"] == pytest.approx(fe["train_loss"], rel=1e-3)
    assert fc["valid_accuracy"] == pytest.approx(fe["valid_accuracy"], abs=0.02)
    assert fc["train_loss"] < 2.2  # it learned (chance is ln 10 = 2.30)
    ce = load_checkpoint(os.path.join(res_c["run_dir"], "ckpt_latest.pth"))
    assert ce["global_step"] == 2 * 3  # 6 batches per epoch, 3 steps of 2


def test_trainer_resume_with_compile_step(tmp_path):
    params = dict(compile_step="compile", torch_compile_options={"backend": "eager"})
    full, model_full = train(tmp_path, "full", **params)
    with pytest.raises(KeyboardInterrupt):
        train(tmp_path, "split", stop_at_epoch=2, **params)
    assert load_checkpoint(run_path(tmp_path, "split", "ckpt_latest.pth"))["epoch"] == 1
    resumed, model_res = train(tmp_path, "split", **params, resume=True)
    # The same sequence of operations (the eager backend runs dynamo's graphs as
    # they are), with a fresh TrainStep built after the checkpoint was loaded.
    for (name, a), b in zip(model_full.state_dict().items(), model_res.state_dict().values()):
        assert torch.equal(a, b), name
    assert resumed["final"]["train_loss"] == full["final"]["train_loss"]


def test_trainer_compile_step_params(tmp_path):
    with pytest.raises(TrainingParamsError, match=r"compile_step: got 'graph' \(str\); allowed: one of 'off', "
                                                  r"'compile', 'cuda_graph'"):
        train(tmp_path, "bad", compile_step="graph")
    with pytest.raises(TrainingParamsError, match="compile_step: got 'cuda_graph' with device 'cpu'; CUDA graphs "
                                                  "need a GPU"):
        train(tmp_path, "cpu_graph", compile_step="cuda_graph")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="compile_step: got 'cuda_graph' but the device is cpu; CUDA graphs "
                                             "need a GPU"):
            train(tmp_path, "auto_graph", compile_step="cuda_graph", device="auto")
    assert not os.path.exists(os.path.join(tmp_path, "cpu_graph"))
    assert not os.path.exists(os.path.join(tmp_path, "auto_graph"))


# ---- CUDA graphs (GPU only) -------------------------------------------------------------


def graph_case(precision, accumulate, sizes, *, warmup_steps=2):
    net = cnn("cuda")
    data = batches(sizes, device="cuda")
    lrs = lr_schedule(len(sizes))
    eager, graphed = Run(net, precision, device="cuda"), Run(net, precision, device="cuda")
    eager_outs, _ = eager.train(eager.step("off", accumulate), data, lrs)
    step = graphed.step("cuda_graph", accumulate, warmup_steps=warmup_steps)
    graphed_outs, _ = graphed.train(step, data, lrs)
    torch.cuda.synchronize()
    return eager, graphed, step, eager_outs, graphed_outs


@CUDA
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_captured_step_matches_eager(precision):
    eager, graphed, step, eo, go = graph_case(precision, 1, [8] * 7)
    assert step.captured and list(step._graphs) == [True]
    # The same kernels on the same inputs, except that the eager step's grads are
    # allocated by the backward and the captured one accumulates into zeroed ones.
    tol = dict(rtol=1e-5, atol=1e-6) if precision == "fp32" else dict(rtol=1e-2, atol=1e-3)
    assert_runs_close(eager, graphed, **tol)
    for (oe, le), (og, lg) in zip(eo, go):
        torch.testing.assert_close(lg, le, **tol)
    assert graphed.ema.step_tensor.item() == 7
    assert graphed.scaler.state_dict() == eager.scaler.state_dict()


@CUDA
def test_captured_accumulation_uses_two_graphs_and_eager_last_batch():
    eager, graphed, step, _, _ = graph_case("fp32", 2, [8] * 9 + [5], warmup_steps=1)
    assert set(step._graphs) == {False, True}
    assert_runs_close(eager, graphed, rtol=1e-5, atol=1e-6)
    assert graphed.ema.step_tensor.item() == 5


@CUDA
def test_lr_schedule_takes_effect_without_recapture():
    eager, graphed, step, _, _ = graph_case("fp32", 1, [8] * 6, warmup_steps=1)
    graph = step._graphs[True]
    assert_runs_close(eager, graphed, rtol=1e-5, atol=1e-6)
    data = batches([8] * 3, device="cuda", seed=3)
    for run in (eager, graphed):
        s = step if run is graphed else run.step("off")
        for i, (x, y) in enumerate(data):
            run.set_lr(0.1 * (i + 1))  # large and different: the weights would differ if an lr were ignored
            s(x, y)
    assert step._graphs[True] is graph
    assert_runs_close(eager, graphed, rtol=1e-5, atol=1e-6)


@CUDA
def test_injected_inf_is_skipped_inside_the_graph():
    run = Run(cnn("cuda"), "fp16", device="cuda", init_scale=2.0**10)
    step = run.step("cuda_graph", warmup_steps=1)
    inject = torch.zeros((), device="cuda")  # read on the device: a captured hook sees new values
    run.model[0].weight.register_hook(lambda g: torch.where(inject > 0, torch.full_like(g, float("inf")), g))
    data = batches([8] * 4, device="cuda")
    step(*data[0])  # warm-up
    step(*data[1])  # capture + first replay
    before = [p.detach().clone() for p in run.model.parameters()]
    ema_before = run.ema.step_tensor.clone()
    scale = run.scaler.get_scale()
    inject.fill_(1.0)
    step(*data[2])
    torch.cuda.synchronize()
    for b, p in zip(before, run.model.parameters()):
        assert torch.equal(b, p), "a non-finite step changed the weights"
    assert run.scaler.get_scale() == scale / 2
    assert torch.equal(run.ema.step_tensor, ema_before)
    assert run.scaler.skipped_steps.item() == 1
    inject.fill_(0.0)
    step(*data[3])
    assert any(not torch.equal(b, p) for b, p in zip(before, run.model.parameters()))


@CUDA
def test_replay_has_no_host_sync():
    run = Run(cnn("cuda"), "fp16", device="cuda")
    step = run.step("cuda_graph", warmup_steps=1)
    data = batches([8] * 6, device="cuda")
    step(*data[0])
    step(*data[1])  # captured
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for x, y in data[2:]:
            run.lr.fill_(LR / 2)
            step(x, y)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert run.ema.step_tensor.item() + run.scaler.skipped_steps.item() == 6


@CUDA
def test_captured_step_shape_change_warns_and_runs_eagerly():
    eager, graphed = Run(cnn("cuda"), device="cuda"), Run(cnn("cuda"), device="cuda")
    step = graphed.step("cuda_graph", warmup_steps=1)
    ref = eager.step("off")
    data = batches([8, 8, 8], device="cuda") + [batches([8], image=12, device="cuda")[0]]
    for x, y in data[:3]:
        step(x, y)
        ref(x, y)
    with pytest.warns(UserWarning, match=r"captured for x \(8, 1, 10, 10\).*got x \(8, 1, 12, 12\)"):
        step(*data[3])
    ref(*data[3])
    torch.cuda.synchronize()
    assert_runs_close(eager, graphed, rtol=1e-5, atol=1e-6)


class ItemModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = cnn("cuda")

    def forward(self, x):
        out = self.net(x)
        if out.abs().max().item() > 1e6:  # data-dependent control flow: a host sync
            out = out / 2
        return out


@CUDA
def test_capture_of_a_host_sync_raises_a_clear_error():
    run = Run(ItemModel(), device="cuda")
    step = run.step("cuda_graph", warmup_steps=1)
    data = batches([8, 8, 8], device="cuda")
    step(*data[0])  # eager warm-up works
    torch.cuda.synchronize()
    before = {k: v.clone() for k, v in run.model.state_dict().items()}
    with pytest.raises(RuntimeError, match=r"could not be captured.*host synchronisation or data-dependent control "
                                           r"flow.*compile_step='compile' or 'off'.*set_sync_debug_mode"):
        step(*data[1])
    for k, v in run.model.state_dict().items():
        assert torch.equal(before[k], v), f"{k} changed by a failed capture"
    # The model, optimizer and scaler are still usable eagerly.
    eager = TrainStep(run.model, LOSS, run.opt, run.scaler, run.precision, ema=run.ema)
    eager(*data[2])
    torch.cuda.synchronize()
    assert any(not torch.equal(before[k], v) for k, v in run.model.state_dict().items())


@CUDA
def test_cuda_graph_needs_a_fused_optimizer_and_tensor_lr():
    model = cnn("cuda")
    with pytest.raises(ValueError, match="needs a fusetrain optimizer"):
        TrainStep(model, LOSS, torch.optim.SGD(model.parameters(), lr=0.1), mode="cuda_graph")
    with pytest.raises(ValueError, match="lr as a tensor"):
        TrainStep(model, LOSS, SGD(model.parameters(), lr=0.1), mode="cuda_graph")
