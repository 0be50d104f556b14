"""A step compiled by the user (``torch.compile`` of a function that calls ``opt.step()``) under schedules of
lr, betas / momentum and weight decay (NOTE [compiled settings] in python/fusetrain/optim/_group_values.py),
against torch.optim on a 16-32-4 MLP:

* the documented path, ``with opt.compiled_view():`` around the compiled call: no recompile after the first
  compile, torch's weights;
* the plain path (nothing around the call): torch's weights, with at most one recompile when the settings
  first change (dynamo's automatic dynamic of the floats);
* a setting changed inside a compiled step under compiled_view is not lost (the trace refuses it);
* docs/optimizers.md's example runs.
"""

import pathlib
import re
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounter, CompileCounterWithBackend

from fusetrain.optim import SGD, AdamW

from _test_helpers import CUDA, REPO

pytestmark = pytest.mark.slow
STEPS = 12
TOL = dict(rtol=1e-5, atol=1e-5)


def _mlp(device):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)).to(device)


def _optimizers(kind, ours_model, ref_model, device):
    lr = 0.01
    if kind == "adamw":
        ours = AdamW(ours_model.parameters(), lr=torch.tensor(lr, device=device), weight_decay=0.05)
        ref = torch.optim.AdamW(ref_model.parameters(), lr=lr, weight_decay=0.05, foreach=False)
    else:
        ours = SGD(ours_model.parameters(), lr=torch.tensor(lr, device=device), momentum=0.9, weight_decay=0.05)
        ref = torch.optim.SGD(ref_model.parameters(), lr=lr, momentum=0.9, weight_decay=0.05, foreach=False)
    return ours, ref


def _schedule(opt):
    return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=STEPS, cycle_momentum=True,
                                               base_momentum=0.8, max_momentum=0.95)


def _run(kind, device, view, backend=None):
    """STEPS steps of the compiled step and of torch's eager one on the same batches, with OneCycleLR cycling
    the lr and betas/momentum and a weight decay changed every step; returns both models, the compile counts
    after each step and the settings seen."""
    torch._dynamo.reset()
    model, ref_model = _mlp(device), _mlp("cpu")
    opt, ref_opt = _optimizers(kind, model, ref_model, device)
    scheds = [_schedule(opt), _schedule(ref_opt)]
    cnt = CompileCounter() if backend is None else CompileCounterWithBackend(backend)

    @torch.compile(backend=cnt)
    def train_step(x, y):
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    g = torch.Generator().manual_seed(1)
    frames, settings = [], []
    for i in range(STEPS):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        for o in (opt, ref_opt):
            for group in o.param_groups:
                group["weight_decay"] = 0.01 * (i + 1)
        if view:
            with opt.compiled_view():
                train_step(x.to(device), y.to(device))
        else:
            train_step(x.to(device), y.to(device))
        nn.functional.mse_loss(ref_model(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        for s in scheds:
            s.step()
        frames.append(cnt.frame_count)
        group = opt.param_groups[0]
        settings.append((group["betas"] if kind == "adamw" else group["momentum"], group["weight_decay"]))
    torch._dynamo.reset()
    return model, ref_model, frames, settings


def _check(model, ref_model, frames, settings, recompiles):
    assert len(set(settings)) == STEPS  # the schedules changed the settings every step
    assert frames[-1] - frames[0] <= recompiles, frames
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), **TOL)


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_compiled_view_follows_the_schedule_without_recompiling(kind):
    model, ref_model, frames, settings = _run(kind, "cpu", view=True)
    _check(model, ref_model, frames, settings, recompiles=0)


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_a_plain_compiled_step_follows_the_schedule(kind):
    # One recompile when the floats first change (then they are inputs of the graph), none after.
    model, ref_model, frames, settings = _run(kind, "cpu", view=False)
    _check(model, ref_model, frames, settings, recompiles=1)
    assert frames[-1] == frames[1], frames


@pytest.mark.parametrize("view", [True, False], ids=["compiled_view", "plain"])
def test_inductor_follows_the_schedule(view):
    # Inductor turns a tensor made from the settings into constants: the values tensor is built by arithmetic.
    model, ref_model, frames, settings = _run("adamw", "cpu", view=view, backend="inductor")
    _check(model, ref_model, frames, settings, recompiles=0 if view else 1)


@CUDA
@pytest.mark.parametrize("view", [True, False], ids=["compiled_view", "plain"])
@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_compiled_step_follows_the_schedule_on_cuda(kind, view):
    model, ref_model, frames, settings = _run(kind, "cuda", view=view, backend="inductor")
    _check(model, ref_model, frames, settings, recompiles=0 if view else 1)


def test_a_setting_changed_inside_a_compiled_view_step_is_not_lost():
    """Set inside the compiled function, a weight decay differs from the values synced before the call: the
    trace refuses it (dynamo then runs the step eagerly), so the step uses it, as torch's does."""
    torch._dynamo.reset()
    model, ref_model = _mlp("cpu"), _mlp("cpu")
    opt = AdamW(model.parameters(), lr=torch.tensor(0.01), weight_decay=0.05)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=0.01, weight_decay=0.05, foreach=False)

    @torch.compile(backend="eager")
    def train_step(x, y, wd):
        nn.functional.mse_loss(model(x), y).backward()
        opt.param_groups[0]["weight_decay"] = wd
        opt.step()
        opt.zero_grad()

    g = torch.Generator().manual_seed(2)
    try:
        for i in range(3):
            x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
            with opt.compiled_view():
                train_step(x, y, 0.1 * (i + 1))
            nn.functional.mse_loss(ref_model(x), y).backward()
            ref.param_groups[0]["weight_decay"] = 0.1 * (i + 1)
            ref.step()
            ref.zero_grad()
    finally:
        torch._dynamo.reset()
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), **TOL)


def test_the_docs_example_runs(tmp_path):
    text = pathlib.Path(REPO, "docs", "optimizers.md").read_text()
    section = text[text.index("## Schedules of betas, momentum and weight decay"):]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert blocks, "docs/optimizers.md's schedules section has no python example"
    script = tmp_path / "example.py"
    script.write_text("import torch\ntorch.set_num_threads(1)\n" + blocks[0])
    proc = subprocess.run([sys.executable, str(script)], cwd=str(tmp_path), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "recompiles after the first: 0" in proc.stdout, proc.stdout
