"""The Trainer end to end on the CPU: small digits runs (a few batches per epoch)
checking that every training_params group does what docs/training_params.md
says, that resume continues a run bit-identically, that a non-finite fp16
step is skipped, that checkpoints are written atomically, that bad params fail
before anything is written, and the files an experiment leaves behind."""

import copy
import json
import math
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fusetrain.optim import SGD, Adadelta, Adam, AdamP, AdamW, Lamb, Lion, NAdam, RAdam, RMSprop
from fusetrain.training import TrainingParamsError, resolve_training_params
from fusetrain.training.checkpoint import files as ckpt_module
from fusetrain.training import build
from fusetrain.training.logging.progress_bar import Progress
from fusetrain.training.checkpoint.files import atomic_save, load_checkpoint
from fusetrain.training.logging.experiment_log import wait_for_plots
from fusetrain.training.data import build_dataloaders
from fusetrain.models import build_model
from fusetrain.training.schedules.lr import LRSchedule
from fusetrain.training.trainer import Trainer

from _test_helpers import DEVICES, run_path
from _train_helpers import (InterruptingLoader, assert_tree_equal, ckpt, cnn, loaders, mlp,  # noqa: F401
                            one_thread, rows_of, train)

# Small, fast runs: 12x12 digits, a narrow digits_cnn, a few batches per epoch.
FAST = dict(max_epochs=2, max_train_batches=4, max_valid_batches=2, progress_bar=False, device="cpu")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"




def run(tmp_path, name="exp", model=None, data=None, **params):
    return train(tmp_path, name, model, data, **{**FAST, **params})


def snapshot(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


class _Built(list):
    def __init__(self):
        super().__init__()
        self.on_build = []


@pytest.fixture
def built_optimizers(monkeypatch):
    """Records every optimizer the Trainer builds; ``on_build`` callbacks run on
    each (e.g. to register step hooks before training starts)."""
    built = _Built()
    original = build.build_optimizer

    def spy(*args, **kwargs):
        opt, fused = original(*args, **kwargs)
        built.append(opt)
        for cb in built.on_build:
            cb(opt)
        return opt, fused

    monkeypatch.setattr(build, "build_optimizer", spy)
    return built


class ForwardLog(nn.Module):
    """Wraps a model: counts training/eval forwards, snapshots the weights before
    each training forward, and turns the output of chosen (1-based) training
    forwards into inf/NaN."""

    def __init__(self, inner, bad_calls=()):
        super().__init__()
        self.inner = inner
        self.bad_calls = set(bad_calls)
        self.train_calls = 0
        self.eval_calls = 0
        self.snapshots = []

    def forward(self, x):
        if self.training:
            self.train_calls += 1
            self.snapshots.append([p.detach().clone() for p in self.inner.parameters()])
        else:
            self.eval_calls += 1
        out = self.inner(x)
        if self.training and self.train_calls in self.bad_calls:
            out = out * float("inf")
        return out


def changed(a, b):
    return any(not torch.equal(x, y) for x, y in zip(a, b))


# ---- a default-style run learns ------------------------------------------------------------------------

def test_default_style_run_learns(tmp_path):
    result, model = run(tmp_path, model=cnn(width=16), data=loaders(image_size=16), optimizer="AdamW",
                        lr_mode="cosine", initial_lr=3e-3, max_epochs=3, max_train_batches=None,
                        max_valid_batches=None)
    rows = rows_of(result["run_dir"])
    assert [r["epoch"] for r in rows] == [1, 2, 3]
    losses = [r["train_loss"] for r in rows]
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert losses[-1] < 0.5 * losses[0]
    assert rows[-1]["valid_loss"] < rows[0]["valid_loss"]
    assert rows[-1]["valid_accuracy"] >= rows[0]["valid_accuracy"]
    assert result["final"]["valid_accuracy"] > 0.9
    assert result["final"]["train_accuracy"] > 0.8
    assert result["best"]["metric"] == "accuracy"
    assert result["best"]["value"] == max(r["valid_accuracy"] for r in rows)
    # The final lr is the cosine schedule's last value.
    assert rows[-1]["lr"] == pytest.approx(3e-3 * 0.01)


# ---- optimizer --------------------------------------------------------------------------------------------

OPTIMIZER_CASES = [
    ("AdamW", AdamW, 3e-3, {}, {"step", "exp_avg", "exp_avg_sq"}),
    ("adam", Adam, 3e-3, {}, {"step", "exp_avg", "exp_avg_sq"}),
    ("SGD", SGD, 0.05, {"momentum": 0.9}, {"step", "momentum_buffer"}),
    ("Lion", Lion, 3e-4, {"weight_decay": 0.1}, {"step", "exp_avg"}),
    ("rmsprop", RMSprop, 1e-3, {"momentum": 0.9, "centered": True},
     {"step", "square_avg", "momentum_buffer", "grad_avg"}),
    ("Adadelta", Adadelta, 1.0, {}, {"step", "square_avg", "acc_delta"}),
    ("RAdam", RAdam, 3e-3, {"decoupled_weight_decay": True}, {"step", "exp_avg", "exp_avg_sq"}),
    ("NAdam", NAdam, 3e-3, {}, {"step", "mu_product", "exp_avg", "exp_avg_sq"}),
    ("lamb", Lamb, 3e-3, {"trust_clip": True}, {"step", "exp_avg", "exp_avg_sq"}),
    ("AdamP", AdamP, 3e-3, {"weight_decay": 0.01}, {"step", "exp_avg", "exp_avg_sq"}),
    (torch.optim.SGD, torch.optim.SGD, 0.05, {"momentum": 0.9}, {"momentum_buffer"}),
    (torch.optim.AdamW, torch.optim.AdamW, 3e-3, {}, {"step", "exp_avg", "exp_avg_sq"}),
]


@pytest.mark.parametrize("name,cls,lr,opt_params,state_keys", OPTIMIZER_CASES,
                         ids=[str(c[0]) if isinstance(c[0], str) else c[0].__name__ + "(torch)"
                              for c in OPTIMIZER_CASES])
def test_optimizer_choice(tmp_path, built_optimizers, name, cls, lr, opt_params, state_keys):
    init = snapshot(cnn())
    result, model = run(tmp_path, optimizer=name, optimizer_params=opt_params, initial_lr=lr, max_epochs=3)
    assert len(built_optimizers) == 1 and type(built_optimizers[0]) is cls
    ck = ckpt(result["run_dir"])
    states = ck["optimizer"]["state"]
    assert len(states) == len(list(model.parameters()))
    for st in states.values():
        assert set(st) == state_keys
    for k, v in opt_params.items():
        assert ck["optimizer"]["param_groups"][0][k] == v
    # A working run: finite weights that moved, and the training loss falls.
    final = model.state_dict()
    assert all(torch.isfinite(v.float()).all() for v in final.values())
    assert any(not torch.equal(init[k], final[k]) for k in init)
    rows = rows_of(result["run_dir"])
    assert rows[-1]["train_loss"] < rows[0]["train_loss"]


# ---- lr_mode ------------------------------------------------------------------------------------------------

LR_CASES = {
    "constant": {},
    "step": {"lr_updates": [1, 2], "lr_decay_factor": 0.5},
    "cosine": {"cosine_final_lr_ratio": 0.1, "lr_warmup_steps": 2},
    "onecycle": {},
    "cyclic": {"cyclic_period_epochs": 1.0, "cyclic_min_lr_ratio": 0.2},
    "linear": {"linear_final_lr_ratio": 0.25, "lr_warmup_epochs": 1},
    "poly": {"lr_warmup_steps": 2, "lr_warmup_mode": "exponential"},
    "exponential": {"lr_decay_factor": 0.5},
    "cosine_restarts": {"cosine_restart_epochs": 1.0, "cosine_restart_mult": 2, "lr_warmup_mode": "constant",
                        "lr_warmup_steps": 1},
    "function": {},
}


def _halving(step):
    return 0.01 * 0.5 ** step


@pytest.mark.parametrize("mode,optimizer", [(m, "AdamW") for m in LR_CASES] +
                         [("cosine", torch.optim.SGD), ("step", torch.optim.SGD)],
                         ids=[f"{m}-fused" for m in LR_CASES] + ["cosine-torch", "step-torch"])
def test_lr_mode_follows_the_schedule(tmp_path, built_optimizers, mode, optimizer):
    applied = []
    built_optimizers.on_build.append(lambda opt: opt.register_step_pre_hook(
        lambda o, args, kwargs: applied.append(float(o.param_groups[-1]["lr"]))))
    params = dict(lr_mode=_halving if mode == "function" else mode, initial_lr=0.01, max_epochs=3,
                  max_train_batches=3, optimizer=optimizer, zero_weight_decay_on_bias_and_bn=True, **LR_CASES[mode])
    result, _ = run(tmp_path, **params)
    expected = LRSchedule(resolve_training_params({**FAST, **params}), 3).sample(range(9))
    # The lr of every optimizer step (float32 tensor for fused optimizers).
    assert applied == pytest.approx(expected, rel=1e-6)
    for g in built_optimizers[0].param_groups:  # every group gets it
        assert float(g["lr"]) == pytest.approx(expected[-1], rel=1e-6)
    # metrics.jsonl records the lr of each epoch's last step.
    rows = rows_of(result["run_dir"])
    assert [r["lr"] for r in rows] == pytest.approx([expected[2], expected[5], expected[8]], rel=1e-12)
    if mode == "cosine":  # hand-computed: warmup 2 steps, then cosine from 0.01 to 0.001 over steps 2..8
        assert applied[:2] == pytest.approx([1e-4 + (0.01 - 1e-4) * 0.5, 0.01], rel=1e-6)
        assert applied[2] == pytest.approx(0.01, rel=1e-6)
        assert applied[5] == pytest.approx(0.001 + 0.0045 * (1 + math.cos(math.pi * 3 / 6)), rel=1e-6)
        assert applied[8] == pytest.approx(0.001, rel=1e-6)
    if mode == "step":
        assert applied == pytest.approx([0.01] * 3 + [0.005] * 3 + [0.0025] * 3, rel=1e-6)
    if mode == "function":
        assert applied == pytest.approx([0.01 * 0.5 ** k for k in range(9)], rel=1e-6)


# ---- zero_weight_decay_on_bias_and_bn --------------------------------------------------------------------

@pytest.mark.parametrize("flag", [True, False])
def test_zero_weight_decay_on_bias_and_bn(tmp_path, built_optimizers, flag):
    result, model = run(tmp_path, max_epochs=1, max_train_batches=2, optimizer_params={"weight_decay": 0.05},
                        zero_weight_decay_on_bias_and_bn=flag)
    groups = ckpt(result["run_dir"])["optimizer"]["param_groups"]
    params = list(model.parameters())
    multi = [p for p in params if p.dim() > 1]
    one_d = [p for p in params if p.dim() == 1]
    assert one_d and multi  # conv/linear weights; BN weights and biases, the linear bias
    opt_groups = built_optimizers[0].param_groups
    if flag:
        assert [g["weight_decay"] for g in groups] == [0.05, 0.0]
        assert [len(g["params"]) for g in groups] == [len(multi), len(one_d)]
        assert {id(p) for p in opt_groups[0]["params"]} == {id(p) for p in multi}
        assert {id(p) for p in opt_groups[1]["params"]} == {id(p) for p in one_d}
    else:
        assert [g["weight_decay"] for g in groups] == [0.05]
        assert len(groups[0]["params"]) == len(params)


# ---- mixed_precision -------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mp,dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16), ("fp32", torch.float32),
                                      (False, torch.float32), (True, torch.bfloat16)])
def test_mixed_precision(tmp_path, mp, dtype, device):
    if mp is True and device == "cuda" and not torch.cuda.is_bf16_supported():
        dtype = torch.float16  # True picks fp16 on GPUs without bf16
    model = cnn()
    seen = []
    model.classifier.register_forward_hook(lambda m, i, o: seen.append((m.training, o.dtype)))
    result, model = run(tmp_path, model=model, mixed_precision=mp, device=device)
    assert all(p.device.type == device for p in model.parameters())
    assert {d for training, d in seen if training} == {dtype}
    assert {d for training, d in seen if not training} == {dtype}  # validation uses the training precision
    assert all(p.dtype == torch.float32 for p in model.parameters())  # weights stay fp32
    rows = rows_of(result["run_dir"])
    for r in rows:
        assert math.isfinite(r["train_loss"]) and math.isfinite(r["valid_loss"])
        if dtype == torch.float16:
            assert r["skipped_steps"] == 0.0
            assert r["loss_scale"] == 2.0**16
        else:
            assert "skipped_steps" not in r and "loss_scale" not in r
    assert rows[-1]["train_loss"] < rows[0]["train_loss"] + 0.05


@pytest.mark.parametrize("device", DEVICES)
def test_fp16_inf_skips_the_step_and_backs_off_the_scale(tmp_path, device):
    model = ForwardLog(cnn(), bad_calls={3})
    result, _ = run(tmp_path, model=model, mixed_precision="fp16", ema=True, device=device,
                    scaler_params={"init_scale": 1024.0, "growth_interval": 100})
    snaps = model.snapshots
    assert len(snaps) == 8
    # The step of the 3rd batch changed nothing; every other step did.
    assert not changed(snaps[2], snaps[3])
    assert all(changed(snaps[i], snaps[i + 1]) for i in range(7) if i != 2)
    rows = rows_of(result["run_dir"])
    assert [r["skipped_steps"] for r in rows] == [1.0, 1.0]
    assert [r["loss_scale"] for r in rows] == [512.0, 512.0]
    ck = ckpt(result["run_dir"])
    # optimizer step counters and the EMA count only the 7 steps taken
    assert all(float(s["step"]) == 7.0 for s in ck["optimizer"]["state"].values())
    assert float(ck["ema"]["step"]) == 7.0
    assert ck["scaler"]["scale"] == 512.0
    assert all(torch.isfinite(v.float()).all() for v in ck["model"].values())
    assert all(torch.isfinite(v.float()).all() for v in ck["ema"]["module"].values())


# ---- clip_grad_norm ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("optimizer", ["SGD", torch.optim.SGD], ids=["fused", "torch"])
def test_clip_grad_norm_clips_the_update(tmp_path, optimizer):
    # Plain SGD: the first update is lr * clip_coef * grad, of norm lr * max_norm
    # when the gradient norm is above max_norm.
    model = ForwardLog(cnn())
    run(tmp_path, model=model, optimizer=optimizer, initial_lr=0.1, clip_grad_norm=1e-3, max_epochs=1,
        max_train_batches=2)
    a, b = model.snapshots
    delta = torch.sqrt(sum(((y - x) ** 2).sum() for x, y in zip(a, b)))
    assert delta.item() == pytest.approx(0.1 * 1e-3, rel=1e-3)

    # Without clipping the update is much larger.
    model2 = ForwardLog(cnn())
    run(tmp_path, "noclip", model=model2, optimizer=optimizer, initial_lr=0.1, max_epochs=1, max_train_batches=2)
    a2, b2 = model2.snapshots
    assert torch.sqrt(sum(((y - x) ** 2).sum() for x, y in zip(a2, b2))).item() > 1e-2


@pytest.mark.parametrize("mp", [False, "fp16"])
@pytest.mark.parametrize("optimizer", ["AdamW", torch.optim.AdamW], ids=["fused", "torch"])
def test_clip_grad_norm_skips_a_non_finite_step(tmp_path, optimizer, mp):
    model = ForwardLog(cnn(), bad_calls={2})
    result, _ = run(tmp_path, model=model, optimizer=optimizer, clip_grad_norm=1.0, max_epochs=1, mixed_precision=mp)
    snaps = model.snapshots
    assert not changed(snaps[1], snaps[2]), "the non-finite step changed the weights"
    assert changed(snaps[0], snaps[1]) and changed(snaps[2], snaps[3])
    ck = ckpt(result["run_dir"])
    assert all(torch.isfinite(v.float()).all() for v in ck["model"].values())
    for st in ck["optimizer"]["state"].values():
        assert all(torch.isfinite(v).all() for v in st.values())
        assert float(st["step"]) == 3.0
    if mp == "fp16":
        row = rows_of(result["run_dir"])[0]
        assert row["skipped_steps"] == 1.0 and row["loss_scale"] == 2.0**15


# ---- batch_accumulate --------------------------------------------------------------------------------------

def test_batch_accumulate_equals_one_step_on_the_concatenated_batch(tmp_path):
    data = loaders(batch_size=16, image_size=8, shuffle=False)
    model = mlp()
    ref = copy.deepcopy(model)
    result, model = run(tmp_path, model=model, data=data, optimizer="SGD", optimizer_params={"momentum": 0.9},
                        initial_lr=0.1, batch_accumulate=2, max_epochs=1, max_train_batches=4)
    assert ckpt(result["run_dir"])["global_step"] == 2

    # Reference: 2 steps, each on two 16-sample batches concatenated (the mean
    # loss over 32 samples), with torch's single-tensor SGD.
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, foreach=False)
    it = iter(loaders(batch_size=16, image_size=8, shuffle=False)[0])
    for _ in range(2):
        (x1, y1), (x2, y2) = next(it), next(it)
        opt.zero_grad()
        F.cross_entropy(ref(torch.cat([x1, x2])), torch.cat([y1, y2])).backward()
        opt.step()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=n)

    # Without dividing the loss (or without accumulating) the weights differ a lot.
    naive = mlp()
    opt = torch.optim.SGD(naive.parameters(), lr=0.1, momentum=0.9, foreach=False)
    it = iter(loaders(batch_size=16, image_size=8, shuffle=False)[0])
    for _ in range(2):
        opt.zero_grad()
        for _ in range(2):
            x, y = next(it)
            F.cross_entropy(naive(x), y).backward()
        opt.step()
    assert max((p - q).abs().max().item() for p, q in zip(model.parameters(), naive.parameters())) > 1e-4


def test_batch_accumulate_steps_on_a_partial_group(tmp_path):
    result, _ = run(tmp_path, model=mlp(), data=loaders(image_size=8), batch_accumulate=2, max_epochs=2,
                    max_train_batches=3, lr_mode="linear")
    ck = ckpt(result["run_dir"])
    assert ck["global_step"] == 4  # 2 steps per epoch: one of 2 batches, one of 1
    assert all(float(s["step"]) == 4.0 for s in ck["optimizer"]["state"].values())
    assert rows_of(result["run_dir"])[-1]["lr"] == pytest.approx(0.0)  # the schedule counts 4 steps


# ---- channels_last -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("flag", [True, False])
def test_channels_last(tmp_path, flag):
    # 3-channel inputs (with one channel both memory formats describe the same strides)
    x, y = loaders()[0].dataset.tensors
    ds = torch.utils.data.TensorDataset(x.repeat(1, 3, 1, 1), y)
    data = (torch.utils.data.DataLoader(ds, batch_size=32), torch.utils.data.DataLoader(ds, batch_size=32))
    model = cnn(in_channels=3)
    inputs = []
    model.features[0].register_forward_pre_hook(
        lambda m, args: inputs.append((m.training, args[0].is_contiguous(memory_format=torch.channels_last)
                                       and not args[0].is_contiguous())))
    result, model = run(tmp_path, model=model, data=data, channels_last=flag, ema=True)
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    assert len(convs) == 3
    for m in convs:
        w = m.weight
        assert w.is_contiguous(memory_format=torch.channels_last) == flag
        assert w.is_contiguous() == (not flag)
    # 8 training batches, then 2 validations of 2 batches on the EMA copy (which
    # carries the hook along)
    assert [t for t, _ in inputs] == [True] * 4 + [False] * 2 + [True] * 4 + [False] * 2
    assert all(cl == flag for _, cl in inputs)
    ema = ckpt(result["run_dir"])["ema"]["module"]
    assert ema["features.2.0.weight"].is_contiguous(memory_format=torch.channels_last) == flag
    assert math.isfinite(result["final"]["train_loss"]) and math.isfinite(result["final"]["valid_loss"])


# ---- ema ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("optimizer", ["AdamW", torch.optim.AdamW], ids=["fused", "torch"])
def test_ema_validates_on_the_ema_weights(tmp_path, optimizer):
    result, model = run(tmp_path, optimizer=optimizer, ema=True, max_valid_batches=None)
    ck = ckpt(result["run_dir"])
    assert ck["ema"] is not None
    assert float(ck["ema"]["step"]) == 8.0
    ema_sd = ck["ema"]["module"]
    assert set(ema_sd) == set(model.state_dict())
    assert any(not torch.equal(ema_sd[k], v) for k, v in model.state_dict().items() if v.is_floating_point())
    ema_model = cnn()
    ema_model.load_state_dict(ema_sd)
    _, vl = loaders()
    trainer = Trainer("eval", ckpt_root_dir=str(tmp_path))
    on_ema = trainer.test(ema_model, vl, metrics=["accuracy"])
    on_model = trainer.test(model, vl, metrics=["accuracy"])
    final = result["final"]
    assert final["valid_loss"] == pytest.approx(on_ema["loss"], rel=1e-9)
    assert final["valid_accuracy"] == on_ema["accuracy"]
    assert final["valid_loss"] != pytest.approx(on_model["loss"], rel=1e-6)


def test_without_ema_validates_the_model_and_has_no_ema(tmp_path):
    result, model = run(tmp_path, max_valid_batches=None)
    assert ckpt(result["run_dir"]).get("ema") is None
    on_model = Trainer("eval", ckpt_root_dir=str(tmp_path)).test(model, loaders()[1], metrics=["accuracy"])
    assert result["final"]["valid_loss"] == pytest.approx(on_model["loss"], rel=1e-9)


# ---- torch_compile -----------------------------------------------------------------------------------------

@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_torch_compile_trains_close_to_eager(tmp_path, fresh_dynamo):
    params = dict(max_epochs=2, max_train_batches=3, max_valid_batches=2, lr_mode="cosine")
    eager, eager_model = run(tmp_path, "eager", **params)
    comp, comp_model = run(tmp_path, "compiled", torch_compile=True, torch_compile_mode="default", **params)
    assert comp["final"]["train_loss"] == pytest.approx(eager["final"]["train_loss"], rel=1e-3)
    assert comp["final"]["valid_loss"] == pytest.approx(eager["final"]["valid_loss"], rel=1e-3)
    for (n, p), q in zip(comp_model.named_parameters(), eager_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-3, atol=1e-4, msg=n)
    # the checkpoint holds the plain model's keys (no _orig_mod prefix)
    assert set(ckpt(comp["run_dir"])["model"]) == set(eager_model.state_dict())


def test_compile_ema_bf16_together_train(tmp_path, fresh_dynamo):
    params = dict(max_epochs=2, max_train_batches=3, max_valid_batches=2, ema=True, mixed_precision="bf16")
    eager, _ = run(tmp_path, "eager", **params)
    comp, comp_model = run(tmp_path, "compiled", torch_compile=True, **params)
    rows = rows_of(comp["run_dir"])
    assert all(math.isfinite(r["train_loss"]) and math.isfinite(r["valid_loss"]) for r in rows)
    assert comp["final"]["train_loss"] == pytest.approx(eager["final"]["train_loss"], rel=2e-2)
    assert comp["final"]["valid_loss"] == pytest.approx(eager["final"]["valid_loss"], rel=2e-2)
    ck = ckpt(comp["run_dir"])
    assert float(ck["ema"]["step"]) == 6.0
    assert set(ck["ema"]["module"]) == set(comp_model.state_dict())


# ---- run_validation_freq, max_*_batches, checkpoints -----------------------------------------------------------

def test_run_validation_freq(tmp_path):
    result, _ = run(tmp_path, max_epochs=5, max_train_batches=2, run_validation_freq=2)
    rows = rows_of(result["run_dir"])
    assert [r["epoch"] for r in rows] == [1, 2, 3, 4, 5]
    assert [r["epoch"] for r in rows if "valid_accuracy" in r] == [2, 4, 5]  # and always the last
    assert [r["epoch"] for r in rows if "valid_loss" in r] == [2, 4, 5]


@pytest.mark.parametrize("mtb,mvb", [(3, 2), (None, None)])
def test_max_train_and_valid_batches(tmp_path, mtb, mvb):
    model = ForwardLog(cnn(width=4))
    tl, vl = loaders(batch_size=64, image_size=8)
    result, _ = run(tmp_path, model=model, data=(tl, vl), max_epochs=2, max_train_batches=mtb,
                    max_valid_batches=mvb)
    n_train = mtb or len(tl)
    n_valid = mvb or len(vl)
    assert model.train_calls == 2 * n_train
    assert model.eval_calls == 2 * n_valid
    assert ckpt(result["run_dir"])["global_step"] == 2 * n_train


def test_save_ckpt_epoch_list(tmp_path):
    result, model = run(tmp_path, max_epochs=3, max_train_batches=2, save_ckpt_epoch_list=[1, 3])
    d = result["run_dir"]
    files = sorted(f for f in os.listdir(d) if f.endswith(".pth"))
    assert "ckpt_epoch_1.pth" in files and "ckpt_epoch_3.pth" in files and "ckpt_epoch_2.pth" not in files
    assert "ckpt_latest.pth" in files and "ckpt_best.pth" in files
    assert ckpt(d, "ckpt_epoch_1.pth")["epoch"] == 1
    e3 = ckpt(d, "ckpt_epoch_3.pth")
    assert e3["epoch"] == 3
    assert_tree_equal(e3["model"], ckpt(d)["model"])
    assert_tree_equal(e3["model"], model.state_dict())


@pytest.mark.parametrize("watch,greater", [("loss", False), ("loss", True), ("accuracy", True), ("top5", False)])
def test_metric_to_watch_selects_the_best_checkpoint(tmp_path, watch, greater):
    result, _ = run(tmp_path, max_epochs=4, max_train_batches=3, initial_lr=3e-3, valid_metrics=["accuracy", "top5"],
                    metric_to_watch=watch, greater_metric_to_watch_is_better=greater,
                    save_ckpt_epoch_list=[1, 2, 3, 4])
    d = result["run_dir"]
    values = [r[f"valid_{watch}"] for r in rows_of(d)]
    target = max(values) if greater else min(values)
    best_epoch = values.index(target) + 1  # the first epoch reaching it (later ties are not improvements)
    assert result["best"] == {"metric": watch, "value": target, "epoch": best_epoch}
    best = ckpt(d, "ckpt_best.pth")
    assert best["epoch"] == best_epoch
    assert_tree_equal(best["model"], ckpt(d, f"ckpt_epoch_{best_epoch}.pth")["model"])
    if watch == "loss":  # the loss falls over this run, so the flag picks opposite ends
        assert values[-1] < values[0]
        assert best_epoch == (1 if greater else values.index(min(values)) + 1)


def test_early_stopping(tmp_path, capsys):
    # min_delta larger than any change: only the first validation improves.
    result, _ = run(tmp_path, max_epochs=6, max_train_batches=2, early_stopping={"patience": 2, "min_delta": 10.0})
    rows = rows_of(result["run_dir"])
    assert [r["epoch"] for r in rows] == [1, 2, 3]
    assert result["final"]["epoch"] == 3
    assert ckpt(result["run_dir"])["epoch"] == 3
    assert result["best"]["epoch"] == 1
    assert "Early stopping after epoch 3" in capsys.readouterr().out


def test_early_stopping_counts_validations_only(tmp_path):
    result, _ = run(tmp_path, "freq", max_epochs=10, max_train_batches=1, run_validation_freq=2,
                    early_stopping={"patience": 2, "min_delta": 10.0})
    # validations after epochs 2 (improves), 4 and 6 (stale): stops after epoch 6
    assert [r["epoch"] for r in rows_of(result["run_dir"])] == [1, 2, 3, 4, 5, 6]


def test_no_early_stopping_runs_all_epochs(tmp_path):
    result, _ = run(tmp_path, max_epochs=3, max_train_batches=1, metric_to_watch="loss",
                    greater_metric_to_watch_is_better=True)  # would never improve after epoch 1
    assert len(rows_of(result["run_dir"])) == 3


# ---- seed, log_interval, device ---------------------------------------------------------------------------------

def test_seed(tmp_path):
    def weights(name, seed):
        _, model = run(tmp_path, name, model=cnn(dropout=0.5), seed=seed, max_train_batches=3)
        return snapshot(model)

    a, b, c = weights("a", 1), weights("b", 1), weights("c", 2)
    assert_tree_equal(a, b)
    assert any(not torch.equal(a[k], c[k]) for k in a)


def test_seed_drives_a_loader_without_its_own_generator(tmp_path):
    ds = loaders()[0].dataset

    def weights(name, seed):
        tl = torch.utils.data.DataLoader(ds, batch_size=32, shuffle=True)  # shuffles with torch's global RNG
        _, model = run(tmp_path, name, data=(tl, None), seed=seed, max_train_batches=3)
        return snapshot(model)

    a, b, c = weights("a", 3), weights("b", 3), weights("c", 4)
    assert_tree_equal(a, b)
    assert any(not torch.equal(a[k], c[k]) for k in a)


@pytest.mark.parametrize("interval,reads_per_epoch", [(0, 0), (1, 3), (2, 2)])
def test_log_interval(tmp_path, monkeypatch, interval, reads_per_epoch):
    # The running loss is read (and shown in the progress bar) every
    # `log_interval` batches after the first; 0 reads it only at the epoch's end.
    shown = []
    original = Progress.update

    def update(self, **postfix):
        if postfix:
            shown.append(postfix["loss"])
        return original(self, **postfix)

    monkeypatch.setattr(Progress, "update", update)
    _, quiet = run(tmp_path, "quiet")
    assert shown == []
    result, logged = run(tmp_path, "logged", log_interval=interval, progress_bar=True)
    assert len(shown) == 2 * reads_per_epoch
    if interval:  # the last read of an epoch covers all its 4 batches
        rows = rows_of(result["run_dir"])
        assert shown[reads_per_epoch - 1] == f"{rows[0]['train_loss']:.4f}"
        assert shown[-1] == f"{rows[1]['train_loss']:.4f}"
    assert_tree_equal(snapshot(quiet), snapshot(logged))  # host reads do not change training


def test_device_cpu_and_bad_device(tmp_path):
    result, model = run(tmp_path, device="cpu", max_epochs=1, max_train_batches=1)
    assert all(p.device.type == "cpu" for p in model.parameters())
    with pytest.raises(TrainingParamsError, match="device"):
        run(tmp_path, "bad", device="gpu")
    assert not os.path.exists(tmp_path / "bad")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="cuda:0"):
            run(tmp_path, "nocuda", device="cuda:0")
        assert not os.path.exists(tmp_path / "nocuda")


# ---- resume ------------------------------------------------------------------------------------------------

RESUME_PARAMS = dict(max_epochs=4, max_train_batches=4, max_valid_batches=2, lr_mode="cosine", ema=True,
                     ema_params={"decay_type": "exp", "decay": 0.999, "beta": 10.0}, mixed_precision="fp16",
                     scaler_params={"init_scale": 2.0**18, "growth_interval": 2})


@pytest.mark.parametrize("optimizer,opt_params", [("SGD", {"momentum": 0.9, "nesterov": True}),
                                                  ("AdamW", {"weight_decay": 0.01})], ids=["SGD", "AdamW"])
def test_resume_is_bit_identical(tmp_path, optimizer, opt_params):
    params = dict(RESUME_PARAMS, optimizer=optimizer, optimizer_params=opt_params,
                  initial_lr=0.05 if optimizer == "SGD" else 3e-3)

    tl, vl = loaders()
    straight, straight_model = run(tmp_path, "straight", model=cnn(), data=(InterruptingLoader(tl), vl), **params)

    tl, vl = loaders()
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path, "resumed", model=cnn(), data=(InterruptingLoader(tl, epoch=3, after=2), vl), **params)
    d = os.path.join(str(tmp_path), "resumed")
    assert ckpt(d)["epoch"] == 2 and len(rows_of(d)) == 2
    tl, vl = loaders()
    resumed, resumed_model = run(tmp_path, "resumed", model=cnn(seed=123), data=(InterruptingLoader(tl), vl),
                                 resume=True, **params)

    a, b = ckpt(straight["run_dir"]), ckpt(resumed["run_dir"])
    assert a["epoch"] == b["epoch"] == 4 and a["global_step"] == b["global_step"] == 16
    assert_tree_equal(snapshot(straight_model), snapshot(resumed_model))
    assert_tree_equal(a["model"], b["model"])
    assert_tree_equal(a["ema"], b["ema"])
    assert_tree_equal(a["optimizer"], b["optimizer"])
    assert_tree_equal(a["scaler"], b["scaler"])
    assert_tree_equal(a["progress"]["best"], b["progress"]["best"])
    # The logged metrics agree too (timings and memory aside).
    ra, rb = rows_of(straight["run_dir"]), rows_of(resumed["run_dir"])
    assert [r["epoch"] for r in rb] == [1, 2, 3, 4]
    keys = [k for k in ra[0] if k.startswith(("train_", "valid_")) or k in ("lr", "loss_scale", "skipped_steps")]
    for x, y in zip(ra, rb):
        assert {k: x[k] for k in keys} == {k: y[k] for k in keys}
    # The scaler really worked across the interruption: it grew, and skipped
    # overflowing steps both before and after it (the count carries over).
    assert len({r["loss_scale"] for r in ra}) > 1
    assert 0 < ra[1]["skipped_steps"] < ra[3]["skipped_steps"]
    assert b["progress"]["skipped_steps"] == ra[3]["skipped_steps"]


def test_resume_without_a_checkpoint_names_the_path(tmp_path):
    expected = f"no run of {os.path.join(str(tmp_path), 'none')} has a checkpoint"
    with pytest.raises(FileNotFoundError, match=expected.replace("\\", "\\\\")):
        run(tmp_path, "none", resume=True)
    assert not os.path.exists(tmp_path / "none")
    missing = str(tmp_path / "elsewhere" / "x.pth")
    with pytest.raises(FileNotFoundError, match="x.pth"):
        run(tmp_path, "none2", resume_path=missing)


def test_resume_path_continues_from_a_given_checkpoint(tmp_path):
    params = dict(max_epochs=3, max_train_batches=3, save_ckpt_epoch_list=[1], lr_mode="linear")
    straight, straight_model = run(tmp_path, "straight", **params)
    path = os.path.join(straight["run_dir"], "ckpt_epoch_1.pth")
    cont, cont_model = run(tmp_path, "continued", model=cnn(seed=5), resume_path=path, **params)
    assert [r["epoch"] for r in rows_of(cont["run_dir"])] == [2, 3]
    assert_tree_equal(snapshot(straight_model), snapshot(cont_model))
    assert_tree_equal(ckpt(straight["run_dir"])["optimizer"], ckpt(cont["run_dir"])["optimizer"])


# ---- atomic checkpoints ---------------------------------------------------------------------------------------

def failing_save(written):
    def save(obj, f, *args, **kwargs):
        f.write(b"PK\x03\x04 partial checkpoint bytes")
        written.append(True)
        raise OSError("No space left on device")
    return save


def test_checkpoint_write_failure_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    result, _ = run(tmp_path, max_epochs=1, max_train_batches=2)
    d = result["run_dir"]
    latest = os.path.join(d, "ckpt_latest.pth")
    before = open(latest, "rb").read()

    written = []
    monkeypatch.setattr(ckpt_module.torch, "save", failing_save(written))
    with pytest.raises(OSError, match="No space left"):
        run(tmp_path, max_epochs=2, max_train_batches=2, resume=True)
    monkeypatch.undo()
    assert written
    assert open(latest, "rb").read() == before
    ck = load_checkpoint(latest)
    assert ck["epoch"] == 1
    wait_for_plots(d)  # the metrics plot is written after the call returns (NOTE [metrics plot])
    assert not [f for f in os.listdir(d) if f.startswith(".tmp") or f.endswith(".tmp")]
    # and the run can go on from it
    result, _ = run(tmp_path, max_epochs=2, max_train_batches=2, resume=True)
    assert ckpt(d)["epoch"] == 2


def test_atomic_save_directly(tmp_path, monkeypatch):
    path = str(tmp_path / "sub" / "c.pth")
    atomic_save({"x": torch.arange(3)}, path)
    before = open(path, "rb").read()
    monkeypatch.setattr(ckpt_module.torch, "save", failing_save([]))
    with pytest.raises(OSError):
        atomic_save({"x": torch.arange(5)}, path)
    with pytest.raises(OSError):
        atomic_save({"x": torch.arange(5)}, str(tmp_path / "sub" / "new.pth"))
    monkeypatch.undo()
    assert open(path, "rb").read() == before
    assert os.listdir(tmp_path / "sub") == ["c.pth"]
    assert torch.equal(load_checkpoint(path)["x"], torch.arange(3))


# ---- bad params fail before anything is written --------------------------------------------------------------

@pytest.mark.parametrize("bad,match", [
    ({"max_epoch": 3}, "did you mean 'max_epochs'"),
    ({"initial_lr": -1}, "initial_lr"),
    ({"optimizer": "adamx"}, "optimizer"),
    ({"lr_mode": "cosin"}, "lr_mode"),
    ({"optimizer": "SGD", "optimizer_params": {"momentom": 0.9}}, "momentom"),
    ({"ema_params": {"decy": 0.9}}, "decy"),
    ({"early_stopping": {"patience": 0}}, "patience"),
    ({"mixed_precision": "fp8"}, "mixed_precision"),
    ({"metric_to_watch": "top5"}, "metric_to_watch"),
    ({"batch_accumulate": 0}, "batch_accumulate"),
])
def test_bad_params_raise_before_anything_is_written(tmp_path, bad, match):
    with pytest.raises(TrainingParamsError, match=match):
        run(tmp_path, "bad", **bad)
    assert not os.path.exists(tmp_path / "bad")
    assert os.listdir(tmp_path) == []


# ---- outputs ------------------------------------------------------------------------------------------------------

def test_outputs_and_returned_metrics(tmp_path):
    result, model = run(tmp_path, max_valid_batches=None, train_metrics=["accuracy", "top5"],
                        valid_metrics=["accuracy", "top5", "loss"])
    d = result["run_dir"]
    assert result["experiment_dir"] == os.path.join(str(tmp_path), "exp")
    assert os.path.dirname(d) == result["experiment_dir"] and os.path.basename(d).startswith("RUN_")
    rows = rows_of(d)
    assert len(rows) == 2 and result["final"] == rows[-1]
    final = result["final"]
    for k in ("epoch", "train_loss", "train_accuracy", "train_top5", "valid_loss", "valid_accuracy", "valid_top5",
              "lr", "epoch_time_s", "samples_per_s", "peak_memory_mb"):
        assert k in final, k
    assert final["valid_top5"] >= final["valid_accuracy"]
    assert result["best"]["metric"] == "accuracy" and result["best"]["epoch"] in (1, 2)

    with open(os.path.join(d, "metrics.csv")) as f:
        lines = f.read().splitlines()
    header = lines[0].split(",")
    assert {"epoch", "train_loss", "valid_accuracy"} <= set(header) and len(lines) == 3
    assert float(lines[2].split(",")[header.index("train_loss")]) == pytest.approx(final["train_loss"])
    wait_for_plots(d)  # drawn after the call returns (NOTE [metrics plot])
    with open(os.path.join(d, "metrics.png"), "rb") as f:
        assert f.read(8) == PNG_SIGNATURE
    tb = os.path.join(d, "tensorboard")
    assert os.path.isdir(tb) and any(f.startswith("events.out.tfevents") for f in os.listdir(tb))
    for f in ("ckpt_latest.pth", "ckpt_best.pth"):
        assert os.path.isfile(os.path.join(d, f))
    ck = ckpt(d)
    assert ck["training_params"]["max_epochs"] == 2 and ck["training_params"]["device"] == "cpu"

    # Trainer.test evaluates the given model on a loader with the given metrics.
    trainer = Trainer("t", ckpt_root_dir=str(tmp_path))
    res = trainer.test(model, loaders()[1], metrics=["accuracy"])
    assert set(res) == {"loss", "accuracy"}
    assert res["accuracy"] == final["valid_accuracy"]
    assert res["loss"] == pytest.approx(final["valid_loss"], rel=1e-9)
    res5 = trainer.test(model, loaders()[1], metrics=["top5"])
    assert res5["top5"] == final["valid_top5"]
    assert not os.path.exists(os.path.join(str(tmp_path), "t"))  # test() writes nothing


# ---- max_steps ----------------------------------------------------------------------------------------------


def test_max_steps_ends_mid_epoch_and_resume_extends_it(tmp_path, built_optimizers):
    applied = []
    built_optimizers.on_build.append(lambda opt: opt.register_step_pre_hook(
        lambda o, args, kwargs: applied.append(float(o.param_groups[0]["lr"]))))
    params = dict(max_steps=7, max_train_batches=4, lr_mode="linear", initial_lr=0.01, ema=True)
    result, model = run(tmp_path, **params)  # 4 steps per epoch: 4 + 3
    rows = rows_of(result["run_dir"])
    assert [r["epoch"] for r in rows] == [1, 2] and "valid_accuracy" in rows[-1]
    assert len(applied) == 7
    expected = LRSchedule(resolve_training_params({**FAST, **params}), 4).sample(range(7))
    assert applied == pytest.approx(expected, rel=1e-6) and applied[-1] == pytest.approx(0.0, abs=1e-9)
    ck = ckpt(result["run_dir"])
    assert ck["global_step"] == 7 and ck["epoch"] == 2
    assert ck["ema"]["step"].item() == 7
    # Resuming with a larger max_steps runs the remaining steps only.
    applied.clear()
    with pytest.warns(UserWarning, match=r"max_steps: 7 -> 10"):
        result2, _ = run(tmp_path, model=model, **dict(params, max_steps=10, resume=True))
    assert len(applied) == 3 and ckpt(result2["run_dir"])["global_step"] == 10
    assert [r["epoch"] for r in rows_of(result2["run_dir"])] == [1, 2, 3]
    # A resume with nothing left to do trains nothing and reports the last epoch.
    applied.clear()
    result3, _ = run(tmp_path, model=model, **dict(params, max_steps=10, resume=True))
    assert applied == [] and result3["final"]["epoch"] == 3


# ---- lr_mode plateau ---------------------------------------------------------------------------------------


def test_plateau_reduces_after_stale_validations_and_resume_keeps_the_reductions(tmp_path, built_optimizers):
    applied = []
    built_optimizers.on_build.append(lambda opt: opt.register_step_pre_hook(
        lambda o, args, kwargs: applied.append(float(o.param_groups[0]["lr"]))))
    # min_delta so large that only the first validation counts as an improvement; patience 0: every later
    # validation reduces the rate.
    params = dict(lr_mode="plateau", initial_lr=0.01, lr_decay_factor=0.5, plateau_patience=0,
                  plateau_min_delta=1e9, max_epochs=2, max_train_batches=2)
    result, model = run(tmp_path, **params)
    assert applied == pytest.approx([0.01] * 4, rel=1e-6)
    assert ckpt(result["run_dir"])["schedule"]["reductions"] == 1
    applied.clear()
    with pytest.warns(UserWarning, match="max_epochs: 2 -> 3"):
        result, _ = run(tmp_path, model=model, **dict(params, max_epochs=3, resume=True))
    assert applied == pytest.approx([0.005] * 2, rel=1e-6)
    assert ckpt(result["run_dir"])["schedule"]["reductions"] == 2


def test_plateau_needs_a_validation_loader(tmp_path):
    from fusetrain.training.params import TrainingParamsError

    tl, _ = loaders()
    with pytest.raises(TrainingParamsError, match="lr_mode: got 'plateau' without a valid_loader"):
        Trainer("exp", ckpt_root_dir=str(tmp_path)).train(cnn(), {**FAST, "lr_mode": "plateau"}, tl)
    assert os.listdir(tmp_path) == []
