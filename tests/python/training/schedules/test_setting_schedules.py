"""momentum_schedule / weight_decay_schedule: the momentum and weight decay of
each optimizer step against hand-computed values and torch's
OneCycleLR(cycle_momentum=True), the refusals, and a Trainer run that writes
them into a fusetrain optimizer."""

import math

import pytest
import torch
from torch import nn

from fusetrain.optim import SGD, AdamW, Adadelta
from fusetrain.training.params import TrainingParamsError, resolve_training_params
from fusetrain.training.schedules.lr import LRSchedule
from fusetrain.training.schedules.settings import SettingSchedule


def schedule(opt, steps_per_epoch=4, **params):
    p = resolve_training_params(params)
    return SettingSchedule(p, LRSchedule(p, steps_per_epoch), opt)


def sgd(momentum=0.9, weight_decay=0.1):
    w, b = nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(1))
    return SGD([{"params": [w]}, {"params": [b], "weight_decay": 0.0}], lr=0.1, momentum=momentum,
               weight_decay=weight_decay)


def test_linear_momentum_and_cosine_weight_decay_after_the_warmup():
    opt = sgd()
    s = schedule(opt, max_epochs=3, lr_warmup_steps=2, momentum_schedule="linear", momentum_final=0.5,
                 weight_decay_schedule="cosine", weight_decay_final=0.02)
    # 12 steps: 2 warmup steps held at the start, then steps 2..11 span the progress 0..1.
    moms, decays = [], []
    for k in range(12):
        s.apply(opt, k)
        moms.append(opt.param_groups[0]["momentum"])
        decays.append((opt.param_groups[0]["weight_decay"], opt.param_groups[1]["weight_decay"]))
    assert moms[:3] == pytest.approx([0.9, 0.9, 0.9])
    assert moms[2:] == pytest.approx([0.9 - 0.4 * k / 9 for k in range(10)])
    wd = [0.02 + 0.08 * 0.5 * (1 + math.cos(math.pi * k / 9)) for k in range(10)]
    assert [d[0] for d in decays[2:]] == pytest.approx(wd)
    assert all(d[1] == 0.0 for d in decays)  # a group without decay keeps none


def test_betas_keep_their_second_entry():
    p = nn.Parameter(torch.zeros(2))
    opt = AdamW([p], betas=(0.95, 0.98))
    s = schedule(opt, max_epochs=1, momentum_schedule="cosine", momentum_final=0.85)
    s.apply(opt, 3)
    assert opt.param_groups[0]["betas"] == pytest.approx((0.85, 0.98))


def test_onecycle_momentum_matches_torch():
    """lr_mode onecycle with momentum_schedule onecycle follows torch's OneCycleLR(cycle_momentum=True)
    (both phases cosine), lr and momentum alike, over fusetrain's step indexing: a phase split at
    onecycle_pct_start of the steps after the first."""
    total, pct = 21, 0.25
    opt = sgd(momentum=0.95)
    s = schedule(opt, steps_per_epoch=total, max_epochs=1, lr_mode="onecycle", initial_lr=1.0, onecycle_pct_start=pct,
                 momentum_schedule="onecycle", momentum_final=0.85)
    ref_p = nn.Parameter(torch.zeros(1))
    ref = torch.optim.SGD([ref_p], lr=1.0, momentum=0.95)
    # fusetrain's rise ends at step pct * (total - 1), torch's at pct_start * total - 1: torch's pct_start is set
    # so that both end at step 5.
    sched = torch.optim.lr_scheduler.OneCycleLR(ref, max_lr=1.0, total_steps=total, pct_start=pct * (total - 1) / total
                                                + 1.0 / total, cycle_momentum=True, base_momentum=0.85,
                                                max_momentum=0.95, three_phase=False)
    got, want = [], []
    for k in range(total):
        s.apply(opt, k)
        got.append(opt.param_groups[0]["momentum"])
        want.append(ref.param_groups[0]["momentum"])
        ref.step()
        sched.step()
    assert got[0] == pytest.approx(0.95) and got[-1] == pytest.approx(0.95)
    assert min(got) == pytest.approx(0.85)
    assert got == pytest.approx(want, abs=1e-12)


def test_refusals_name_the_setting():
    with pytest.raises(TrainingParamsError, match="momentum_schedule: got 'onecycle' with lr_mode 'cosine'"):
        resolve_training_params({"lr_mode": "cosine", "momentum_schedule": "onecycle"})
    with pytest.raises(TrainingParamsError, match="momentum_final"):
        resolve_training_params({"momentum_schedule": "linear", "momentum_final": 1.0})
    with pytest.raises(ValueError, match="momentum is 0"):
        schedule(sgd(momentum=0.0), momentum_schedule="cosine")
    with pytest.raises(ValueError, match="has neither 'momentum' nor 'betas'"):
        schedule(Adadelta([nn.Parameter(torch.zeros(1))]), momentum_schedule="cosine")
    with pytest.raises(ValueError, match="weight_decay is 0"):
        schedule(sgd(weight_decay=0.0), weight_decay_schedule="linear")


class _Record:
    """A callback keeping the optimizer's momentum and weight decay after each step."""

    def __init__(self):
        self.seen = []

    def on_step_end(self, state):
        g = state.optimizer.param_groups[0]
        self.seen.append((g["momentum"], g["weight_decay"]))


@pytest.mark.parametrize("compile_step", ["off", "compile"])
def test_trainer_writes_the_schedules_into_the_optimizer(tmp_path, compile_step):
    from torch.utils.data import DataLoader, TensorDataset

    from fusetrain import Callback, Trainer

    class Record(_Record, Callback):
        pass

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 6, generator=g), torch.randint(0, 3, (32,), generator=g)
    train = DataLoader(TensorDataset(x, y), batch_size=8)
    rec = Record()
    torch.manual_seed(0)
    torch._dynamo.reset()
    try:
        result = Trainer("settings", ckpt_root_dir=str(tmp_path)).train(
            nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)),
            dict(max_epochs=2, progress_bar=False, device="cpu", optimizer="SGD", initial_lr=0.1,
                 optimizer_params={"momentum": 0.9, "weight_decay": 1e-3}, momentum_schedule="linear",
                 momentum_final=0.5, weight_decay_schedule="linear", weight_decay_final=1e-4, lr_mode="constant",
                 compile_step=compile_step, valid_metrics=["accuracy"], callbacks=[rec]),
            train, DataLoader(TensorDataset(x, y), batch_size=16))
    finally:
        torch._dynamo.reset()
    assert math.isfinite(result["final"]["train_loss"])
    # 8 steps: progress k / 7.
    assert [m for m, _ in rec.seen] == pytest.approx([0.9 - 0.4 * k / 7 for k in range(8)])
    assert [w for _, w in rec.seen] == pytest.approx([1e-3 - 9e-4 * k / 7 for k in range(8)])
