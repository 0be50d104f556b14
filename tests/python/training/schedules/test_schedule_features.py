"""lr_cooldown_epochs, step_lr_update_freq, per-prefix initial_lr, the
linear_epoch and linspace warmups, batch_accumulate_reduction and the
task-fitting default train_metrics, each against hand-computed values."""

import pickle

import pytest
import torch
from torch import nn

from fusetrain.training.params import TrainingParamsError, resolve_training_params
from fusetrain.training.schedules.lr import LRSchedule
from fusetrain.training.step.train_step import TrainStep
from fusetrain.training import finetune


def lrs(steps_per_epoch, n=None, **params):
    p = resolve_training_params(params)
    s = LRSchedule(p, steps_per_epoch)
    return [s(k) for k in range(n if n is not None else s.total_steps)]


# ---- lr_cooldown_epochs -----------------------------------------------------------------------------------------

def test_cooldown_holds_the_last_scheduled_rate():
    # 5 epochs of 2 steps; the last 2 epochs (4 steps) are the cooldown: linear decay over steps 0..5.
    got = lrs(2, max_epochs=5, initial_lr=1.0, lr_mode="linear", linear_final_lr_ratio=0.0, lr_cooldown_epochs=2)
    assert got == pytest.approx([1.0, 0.8, 0.6, 0.4, 0.2, 0.0, 0.0, 0.0, 0.0, 0.0])


def test_cooldown_with_warmup_and_cosine():
    # warmup 1 epoch (2 steps), cooldown 1 epoch: cosine over steps 2..5, then step 5's rate.
    got = lrs(2, max_epochs=4, initial_lr=1.0, lr_mode="cosine", cosine_final_lr_ratio=0.0, lr_warmup_epochs=1,
              warmup_initial_lr=0.0, lr_cooldown_epochs=1)
    assert got == pytest.approx([0.5, 1.0, 1.0, 0.75, 0.25, 0.0, 0.0, 0.0], abs=1e-12)


def test_cooldown_must_leave_scheduled_epochs():
    with pytest.raises(TrainingParamsError, match="lr_warmup_epochs \\+ lr_cooldown_epochs < max_epochs"):
        resolve_training_params({"max_epochs": 4, "lr_warmup_epochs": 2, "lr_cooldown_epochs": 2})


# ---- step_lr_update_freq ----------------------------------------------------------------------------------------

def test_step_every_one_and_a_half_epochs():
    got = lrs(4, max_epochs=6, initial_lr=1.0, lr_mode="step", step_lr_update_freq=1.5, lr_decay_factor=0.5)
    assert got == pytest.approx([1.0] * 6 + [0.5] * 6 + [0.25] * 6 + [0.125] * 6)


def test_step_at_fractional_points_rounds_up_to_a_step():
    # 0.3 epochs of 5 steps = every 1.5 steps: decays at steps 2, 3, 5, 6, 8, 9.
    got = lrs(5, max_epochs=2, initial_lr=1.0, lr_mode="step", step_lr_update_freq=0.3, lr_decay_factor=0.5)
    assert got == pytest.approx([1.0, 1.0, 0.5, 0.25, 0.25, 0.125, 0.0625, 0.0625, 0.03125, 0.015625])


def test_step_decays_within_warmup_are_left_out_and_cooldown_stops_them():
    # 4 steps per epoch, warmup 1 epoch (steps 0-3), decays every 2 steps: the one at step 4 is the first.
    got = lrs(4, 8, max_epochs=4, initial_lr=1.0, lr_mode="step", step_lr_update_freq=0.5, lr_decay_factor=0.5,
              lr_warmup_epochs=1, warmup_initial_lr=0.0)
    assert got == pytest.approx([0.25, 0.5, 0.75, 1.0, 0.5, 0.5, 0.25, 0.25])
    # cooldown: 6 epochs of 2 steps, decays every epoch, the last 2 epochs hold step 7's rate (3 decays).
    got = lrs(2, max_epochs=6, initial_lr=1.0, lr_mode="step", step_lr_update_freq=1.0, lr_decay_factor=0.5,
              lr_cooldown_epochs=2)
    assert got == pytest.approx([1, 1, 0.5, 0.5, 0.25, 0.25, 0.125, 0.125, 0.125, 0.125, 0.125, 0.125])


def test_step_freq_and_lr_updates_exclude_each_other():
    with pytest.raises(TrainingParamsError, match="at most one of them"):
        resolve_training_params({"lr_mode": "step", "lr_updates": [2], "step_lr_update_freq": 1.0})
    resolve_training_params({"lr_mode": "step", "step_lr_update_freq": 2.0})  # no lr_updates needed


# ---- warmups ----------------------------------------------------------------------------------------------------

def test_linear_epoch_warmup_is_a_staircase_from_initial_lr_over_w_plus_one():
    got = lrs(3, max_epochs=4, initial_lr=0.9, lr_warmup_epochs=2, lr_warmup_mode="linear_epoch")
    assert got == pytest.approx([0.3] * 3 + [0.6] * 3 + [0.9] * 6)
    got = lrs(2, max_epochs=3, initial_lr=1.0, lr_warmup_epochs=2, lr_warmup_mode="linear_epoch",
              warmup_initial_lr=0.2)
    assert got == pytest.approx([0.2, 0.2, 0.6, 0.6, 1.0, 1.0])


def test_linear_epoch_warmup_needs_epochs():
    with pytest.raises(TrainingParamsError, match="linear_epoch"):
        resolve_training_params({"lr_warmup_steps": 5, "lr_warmup_mode": "linear_epoch"})


def test_linspace_warmup_ends_at_initial_lr_and_is_capped_at_one_epoch():
    got = lrs(5, 4, max_epochs=2, initial_lr=1.0, lr_warmup_steps=3, lr_warmup_mode="linspace",
              warmup_initial_lr=0.1)
    assert got == pytest.approx([0.1, 0.55, 1.0, 1.0])
    # 8 warmup steps, 4 per epoch: the rise takes 4 steps, the next 4 run at initial_lr, then cosine starts.
    got = lrs(4, max_epochs=4, initial_lr=1.0, lr_warmup_steps=8, lr_warmup_mode="linspace", warmup_initial_lr=0.0,
              lr_mode="cosine", cosine_final_lr_ratio=0.0)
    assert got[:9] == pytest.approx([0.0, 1 / 3, 2 / 3, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    assert got[-1] == pytest.approx(0.0, abs=1e-12)


# ---- per-prefix initial_lr --------------------------------------------------------------------------------------

class EncoderHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Module()
        self.encoder.backbone = nn.Linear(3, 3)
        self.encoder.backbone2 = nn.Linear(3, 3)
        self.encoder.neck = nn.Linear(3, 3)
        self.head = nn.Linear(3, 2)


def test_prefix_learning_rates_through_warmup_and_schedule():
    model = EncoderHead()
    p = resolve_training_params({"optimizer": "SGD", "max_epochs": 3, "initial_lr": {"default": 0.1,
                                 "encoder.backbone": 0.01, "encoder.neck": 0.05}, "lr_warmup_epochs": 2,
                                 "lr_warmup_mode": "linear_epoch"})
    groups = finetune.param_groups(model, False, {}, None, p.initial_lr)
    scale = {id(q): g["lr_scale"] for g in groups for q in g["params"]}
    schedule = LRSchedule(p, 1)
    expect = {"encoder.backbone": 0.01, "encoder.neck": 0.05, "head": 0.1}  # the longest prefix that fits
    for step, factor in enumerate([1 / 3, 2 / 3, 1.0]):  # SG's staircase: (e + 1) / (W + 1)
        for name, q in model.named_parameters():
            lr = schedule(step) * scale[id(q)]
            prefix = next(k for k in expect if name.startswith(k))
            assert lr == pytest.approx(expect[prefix] * factor, rel=1e-9), (name, step)


def test_prefix_learning_rates_are_checked():
    with pytest.raises(TrainingParamsError, match="'default'"):
        resolve_training_params({"initial_lr": {"backbone": 0.01}})
    with pytest.raises(TrainingParamsError, match="initial_lr"):
        resolve_training_params({"initial_lr": {"default": 0.1, "backbone": 0.0}})
    p = resolve_training_params({"initial_lr": {"default": 0.1, "decoder": 0.01}})
    with pytest.raises(ValueError, match="decoder"):
        finetune.param_groups(EncoderHead(), False, {}, None, p.initial_lr)


def test_an_unmatched_prefix_names_the_closest_and_writes_nothing(tmp_path):
    from torch.utils.data import DataLoader, TensorDataset

    from fusetrain.training.trainer import Trainer

    class Net(EncoderHead):
        def forward(self, x):
            return self.head(self.encoder.neck(self.encoder.backbone(x)))

    data = DataLoader(TensorDataset(torch.randn(4, 3), torch.tensor([0, 1, 0, 1])), batch_size=2)
    run = tmp_path / "exp"
    run.mkdir()
    (run / "ckpt_best.pth").write_bytes(b"an earlier run's weights")
    params = {"max_epochs": 1, "device": "cpu", "overwrite_experiment": True, "progress_bar": False,
              "initial_lr": {"default": 0.1, "encoder.backbone3": 0.01, "encoder.neck": 0.05}}
    with pytest.raises(TrainingParamsError) as info:
        Trainer("exp", ckpt_root_dir=str(tmp_path)).train(Net(), params, data, data)
    assert info.value.errors == [
        "training_params.initial_lr: prefix 'encoder.backbone3' matches no trainable parameter of the model; its "
        "closest parameter-name prefixes: 'encoder.backbone', 'encoder.backbone2', 'encoder.neck'; allowed: a "
        "prefix of trainable parameter names, or 'default'"]
    # Refused before the folder was taken: the earlier run's file is still there, nothing was added.
    assert sorted(p.name for p in run.iterdir()) == ["ckpt_best.pth"]
    assert (run / "ckpt_best.pth").read_bytes() == b"an earlier run's weights"


def test_closest_prefixes_prefer_the_shared_path_and_depth():
    names = [n for n, _ in EncoderHead().named_parameters()]
    # Those under encoder.backbone as deep as the prefix first, then the module itself.
    got = finetune.closest_prefixes("encoder.backbone.conv", names)
    assert set(got[:2]) == {"encoder.backbone.weight", "encoder.backbone.bias"} and got[2] == "encoder.backbone"
    assert finetune.closest_prefixes("heads", names, n=2) == ["head", "encoder"]


# ---- batch_accumulate_reduction ---------------------------------------------------------------------------------

@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_accumulated_gradient(reduction):
    torch.manual_seed(0)
    model = nn.Linear(3, 1, bias=False)
    w0 = model.weight.detach().clone()
    batches = [(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(2)]
    grads = []
    for x, y in batches:  # the reference: each batch's gradient on its own
        ref = nn.Linear(3, 1, bias=False)
        ref.weight.data.copy_(w0)
        nn.functional.mse_loss(ref(x), y).backward()
        grads.append(ref.weight.grad.clone())
    expected_grad = grads[0] + grads[1] if reduction == "sum" else (grads[0] + grads[1]) / 2
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = TrainStep(model, nn.functional.mse_loss, opt, accumulate=2, accumulate_reduction=reduction)
    for x, y in batches:
        step(x, y)
    torch.testing.assert_close(model.weight.detach(), w0 - 0.1 * expected_grad)


def test_accumulate_reduction_is_checked():
    with pytest.raises(TrainingParamsError, match="batch_accumulate_reduction"):
        resolve_training_params({"batch_accumulate_reduction": "avg"})


# ---- the default train_metrics ----------------------------------------------------------------------------------

@pytest.mark.parametrize("loss, expected", [
    ("cross_entropy", ["accuracy"]), ("CrossEntropyLoss", ["accuracy"]), ("nll", ["accuracy"]), ("model", []),
    ("mse", []), ("fusetrain.models.DenseDetectionLoss", []),
])
def test_default_train_metrics_fit_the_loss(loss, expected):
    extra = {"valid_metrics": ["loss"], "metric_to_watch": "loss"} if loss != "model" else {
        "valid_metrics": ["map"], "metric_to_watch": "map"}
    assert resolve_training_params({"loss": loss, **extra}).train_metrics == expected
    assert resolve_training_params({"loss": loss, "train_metrics": ["loss"], **extra}).train_metrics == ["loss"]


def test_default_train_metrics_follow_the_final_loss():
    regression = {"valid_metrics": ["loss"], "metric_to_watch": "loss"}
    p = resolve_training_params({})
    assert p.train_metrics == ["accuracy"]
    q = p.replace(loss="mse", **regression)
    assert q.train_metrics == []
    assert q.replace(loss="cross_entropy").train_metrics == ["accuracy"]
    assert pickle.loads(pickle.dumps(p)).replace(loss="mse").train_metrics == []
    # A value given explicitly stays.
    given = resolve_training_params({"train_metrics": ["top5"]})
    assert given.replace(loss="mse", **regression).train_metrics == ["top5"]
    assert p.replace(train_metrics=["loss"]).replace(loss="mse").train_metrics == ["loss"]


def test_linear_epoch_warmup_longer_than_the_run_keeps_its_steps():
    # 5 warmup epochs in a 2-epoch run: the staircase of 5 epochs is cut, not squeezed.
    got = lrs(2, max_epochs=2, initial_lr=0.6, lr_warmup_epochs=5, lr_warmup_mode="linear_epoch")
    assert got == pytest.approx([0.1, 0.1, 0.2, 0.2])
