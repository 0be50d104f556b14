"""LRSchedule: the learning rate of every optimizer step for each ``lr_mode``,
with warmup in epochs or in steps, against values computed by hand from the
definitions in docs/training_params.md and against torch.optim.lr_scheduler
where torch has the same schedule."""

import math

import pytest
import torch

from fusetrain.training import resolve_training_params
from fusetrain.training.schedules.lr import LRSchedule


def schedule(steps_per_epoch, **params):
    return LRSchedule(resolve_training_params(params), steps_per_epoch)


def assert_lrs(sched, expected):
    got = sched.sample(range(len(expected)))
    assert got == pytest.approx(expected, rel=1e-12, abs=1e-15), f"got {got}"


def test_constant():
    s = schedule(3, lr_mode="constant", initial_lr=0.02, max_epochs=2)
    assert_lrs(s, [0.02] * 6)
    assert s(100) == 0.02  # past the end


def test_step_decays_when_the_listed_epochs_are_complete():
    # 2 steps per epoch; epochs 0,0,1,1,2,2,3,3; decays after 2 and 3 epochs.
    s = schedule(2, lr_mode="step", initial_lr=0.1, lr_updates=[2, 3], lr_decay_factor=0.5, max_epochs=4)
    assert_lrs(s, [0.1, 0.1, 0.1, 0.1, 0.05, 0.05, 0.025, 0.025])


def test_cosine_ends_at_the_final_ratio_on_the_last_step():
    # 5 steps; t = s / 4; lr = 0.1 + 0.45 * (1 + cos(pi * t)).
    s = schedule(5, lr_mode="cosine", initial_lr=1.0, cosine_final_lr_ratio=0.1, max_epochs=1)
    assert_lrs(s, [1.0, 0.8681980515339464, 0.55, 0.2318019484660536, 0.1])
    assert s(7) == pytest.approx(0.1)  # clamped after the end


def test_cosine_default_ratio():
    s = schedule(4, lr_mode="cosine", initial_lr=0.004, max_epochs=2)  # ratio 0.01, 8 steps
    final = 0.004 * 0.01
    expected = [final + 0.5 * (0.004 - final) * (1 + math.cos(math.pi * k / 7)) for k in range(8)]
    assert_lrs(s, expected)
    assert s(7) == pytest.approx(4e-5)


def test_linear():
    s = schedule(5, lr_mode="linear", initial_lr=1.0, linear_final_lr_ratio=0.2, max_epochs=1)
    assert_lrs(s, [1.0, 0.8, 0.6, 0.4, 0.2])
    s0 = schedule(2, lr_mode="linear", initial_lr=0.3, max_epochs=2)  # default ratio 0
    assert_lrs(s0, [0.3, 0.2, 0.1, 0.0])


def test_onecycle():
    # start = 1 / 10, end = start / 100; phases split at t = 0.5, both cosine.
    s = schedule(5, lr_mode="onecycle", initial_lr=1.0, onecycle_pct_start=0.5, onecycle_div_factor=10.0,
                 onecycle_final_div_factor=100.0, max_epochs=1)
    assert_lrs(s, [0.1, 0.55, 1.0, 0.5005, 0.001])


def test_onecycle_defaults_peak_and_end():
    s = schedule(10, lr_mode="onecycle", initial_lr=0.5, max_epochs=1)  # pct 0.3, div 25, final_div 1e4
    lrs = s.sample(range(10))
    assert lrs[0] == pytest.approx(0.5 / 25)
    assert max(lrs) <= 0.5 + 1e-12
    assert lrs[-1] == pytest.approx(0.5 / 25 / 1e4)
    # rises, then falls
    peak = lrs.index(max(lrs))
    assert all(a <= b for a, b in zip(lrs[:peak], lrs[1:peak + 1]))
    assert all(a >= b for a, b in zip(lrs[peak:], lrs[peak + 1:]))


def test_cyclic_triangle():
    # period = 2 epochs * 2 steps = 4 steps, between 0.2 and 1.
    s = schedule(2, lr_mode="cyclic", initial_lr=1.0, cyclic_min_lr_ratio=0.2, cyclic_period_epochs=2.0,
                 max_epochs=3)
    assert_lrs(s, [0.2, 0.6, 1.0, 0.6, 0.2, 0.6])


def test_cyclic_fractional_period():
    # 1.5 epochs of 2 steps = a period of 3 steps: phases 0, 1/3, 2/3.
    s = schedule(2, lr_mode="cyclic", initial_lr=1.0, cyclic_min_lr_ratio=0.5, cyclic_period_epochs=1.5,
                 max_epochs=3)
    tri = [0.0, 2 / 3, 2 / 3]
    assert_lrs(s, [0.5 + 0.5 * tri[k % 3] for k in range(6)])


def test_warmup_epochs_then_linear():
    # 4 warmup steps from 0.2 to 1 (reaching 1 on the last warmup step), then
    # linear to 0 over the remaining 4 steps (t = (s - 4) / 3).
    s = schedule(4, lr_mode="linear", initial_lr=1.0, lr_warmup_epochs=1, warmup_initial_lr=0.2, max_epochs=2)
    assert s.warmup_steps == 4
    assert_lrs(s, [0.4, 0.6, 0.8, 1.0, 1.0, 2 / 3, 1 / 3, 0.0])


def test_warmup_steps_default_initial_then_cosine():
    # warmup_initial_lr None -> 0.01 * initial_lr = 0.005; 2 warmup steps, then
    # cosine to 0 over 4 steps (t = (s - 2) / 3).
    s = schedule(3, lr_mode="cosine", initial_lr=0.5, lr_warmup_steps=2, cosine_final_lr_ratio=0.0, max_epochs=2)
    assert s.warmup_steps == 2
    assert_lrs(s, [0.2525, 0.5, 0.5, 0.375, 0.125, 0.0])


def test_warmup_then_constant_and_step():
    s = schedule(2, lr_mode="constant", initial_lr=0.1, lr_warmup_steps=3, warmup_initial_lr=0.0, max_epochs=3)
    assert_lrs(s, [0.1 / 3, 0.2 / 3, 0.1, 0.1, 0.1, 0.1])
    # step mode counts epochs from the start of the run, warmup included.
    st = schedule(2, lr_mode="step", initial_lr=0.1, lr_updates=[1], lr_decay_factor=0.1, lr_warmup_steps=1,
                  warmup_initial_lr=0.0, max_epochs=2)
    assert_lrs(st, [0.1, 0.1, 0.01, 0.01])


def test_warmup_then_cyclic_starts_a_cycle_after_warmup():
    s = schedule(2, lr_mode="cyclic", initial_lr=1.0, cyclic_min_lr_ratio=0.2, cyclic_period_epochs=1.0,
                 lr_warmup_steps=2, warmup_initial_lr=0.0, max_epochs=3)
    # warmup 0.5, 1.0; then period 2: 0.2, 1.0, 0.2, 1.0
    assert_lrs(s, [0.5, 1.0, 0.2, 1.0, 0.2, 1.0])


def test_warmup_longer_than_the_run_is_capped():
    s = schedule(2, lr_mode="cosine", initial_lr=1.0, lr_warmup_epochs=5, warmup_initial_lr=0.0, max_epochs=2)
    assert s.warmup_steps == 4
    assert_lrs(s, [0.25, 0.5, 0.75, 1.0])


@pytest.mark.parametrize("mode", ["constant", "step", "cosine", "onecycle", "cyclic", "linear", "poly",
                                  "exponential", "cosine_restarts"])
def test_values_are_floats_in_range_for_every_step(mode):
    extra = {"lr_updates": [1]} if mode == "step" else {}
    s = schedule(7, lr_mode=mode, initial_lr=0.01, max_epochs=3, lr_warmup_epochs=1, **extra)
    lrs = s.sample(range(21))
    assert all(isinstance(v, float) and 0.0 <= v <= 0.01 + 1e-15 for v in lrs)
    assert all(v > 0.0 for v in lrs[:-1])  # only linear's default final value is 0
    assert lrs[6] == pytest.approx(0.01)  # end of warmup reaches initial_lr


def test_steps_per_epoch_is_at_least_one():
    s = schedule(0, lr_mode="cosine", initial_lr=1.0, cosine_final_lr_ratio=0.0, max_epochs=3)
    assert s.steps_per_epoch == 1 and s.total_steps == 3
    assert_lrs(s, [1.0, 0.5, 0.0])


def torch_lrs(make_scheduler, n, lr0):
    """The lr torch's scheduler gives each of n steps (stepped once per step)."""
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr0)
    sched = make_scheduler(opt)
    out = []
    for _ in range(n):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


@pytest.mark.parametrize("first,mult", [(1, 1), (1.5, 1), (1, 2), (0.5, 3)])
def test_cosine_restarts_matches_torch(first, mult):
    spe, epochs, lr0 = 4, 9, 0.1
    s = schedule(spe, lr_mode="cosine_restarts", initial_lr=lr0, max_epochs=epochs, cosine_restart_epochs=first,
                 cosine_restart_mult=mult, cosine_final_lr_ratio=0.05)
    ref = torch_lrs(lambda o: torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(
        o, T_0=int(first * spe), T_mult=mult, eta_min=lr0 * 0.05), spe * epochs, lr0)
    assert_lrs(s, ref)
    assert max(s.sample(range(spe * epochs))) == pytest.approx(lr0)


@pytest.mark.parametrize("power", [0.9, 1.0, 2.0])
def test_poly_matches_torch_polynomial_lr(power):
    s = schedule(5, lr_mode="poly", initial_lr=0.2, max_epochs=4, poly_power=power)
    ref = torch_lrs(lambda o: torch.optim.lr_scheduler.PolynomialLR(o, total_iters=20, power=power), 20, 0.2)
    assert_lrs(s, ref)
    assert s(19) > 0.0  # the last step keeps a small positive rate


def test_poly_after_warmup_spans_the_remaining_steps():
    s = schedule(4, lr_mode="poly", initial_lr=1.0, max_epochs=2, lr_warmup_steps=3, warmup_initial_lr=0.25)
    expected = [0.5, 0.75, 1.0] + [(1 - k / 5) ** 0.9 for k in range(5)]
    assert_lrs(s, expected)


def test_exponential_per_epoch_matches_torch_and_is_smooth_within_an_epoch():
    s1 = schedule(1, lr_mode="exponential", initial_lr=0.3, max_epochs=6, lr_decay_factor=0.7)
    ref = torch_lrs(lambda o: torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.7), 6, 0.3)
    assert_lrs(s1, ref)
    s4 = schedule(4, lr_mode="exponential", initial_lr=0.3, max_epochs=3, lr_decay_factor=0.7)
    assert_lrs(s4, [0.3 * 0.7 ** (k / 4) for k in range(12)])


def test_step_matches_torch_multistep_lr_per_epoch():
    s = schedule(1, lr_mode="step", initial_lr=0.1, max_epochs=8, lr_updates=[2, 5, 6], lr_decay_factor=0.3)
    ref = torch_lrs(lambda o: torch.optim.lr_scheduler.MultiStepLR(o, milestones=[2, 5, 6], gamma=0.3), 8, 0.1)
    assert_lrs(s, ref)


def test_exponential_and_constant_warmup_forms():
    common = dict(lr_mode="constant", initial_lr=0.8, max_epochs=2, lr_warmup_steps=4, warmup_initial_lr=0.05)
    e = schedule(4, lr_warmup_mode="exponential", **common)
    assert_lrs(e, [0.05 * 16 ** ((k + 1) / 4) for k in range(4)] + [0.8] * 4)
    assert e(3) == pytest.approx(0.8)
    c = schedule(4, lr_warmup_mode="constant", **common)
    assert_lrs(c, [0.05] * 4 + [0.8] * 4)


def test_a_function_of_the_step_is_the_whole_schedule():
    s = schedule(3, lr_mode=lambda step: 0.5 / (1 + step), max_epochs=2)
    assert_lrs(s, [0.5 / (1 + k) for k in range(6)])


@pytest.mark.parametrize("bad", [float("nan"), -0.1, "0.1", torch.tensor(0.1), None])
def test_a_schedule_function_returning_a_bad_value_names_the_step(bad):
    s = schedule(3, lr_mode=lambda step: 0.1 if step < 2 else bad, max_epochs=2)
    assert s(1) == 0.1
    with pytest.raises(ValueError, match=r"lr_mode: the schedule function .* for step 2; allowed: a finite float"):
        s(2)


def test_bad_schedule_settings_are_rejected_naming_the_key():
    from fusetrain.training.params import TrainingParamsError

    with pytest.raises(TrainingParamsError, match="lr_mode: got a function with lr_warmup_epochs"):
        resolve_training_params(dict(lr_mode=lambda s: 0.1, lr_warmup_epochs=1))
    with pytest.raises(TrainingParamsError, match="warmup_initial_lr: got 0 with lr_warmup_mode 'exponential'"):
        resolve_training_params(dict(lr_warmup_steps=5, lr_warmup_mode="exponential", warmup_initial_lr=0.0))
    with pytest.raises(TrainingParamsError, match="lr_warmup_mode"):
        resolve_training_params(dict(lr_warmup_mode="cosine"))
    with pytest.raises(TrainingParamsError, match="cosine_restart_mult"):
        resolve_training_params(dict(lr_mode="cosine_restarts", cosine_restart_mult=0))
    with pytest.raises(TrainingParamsError, match="lr_mode"):
        resolve_training_params(dict(lr_mode="reduce_on_plateau"))


@pytest.mark.parametrize("greater,patience,delta", [(True, 2, 0.0), (False, 0, 0.05), (True, 1, 0.1)])
def test_plateau_matches_torch_reduce_on_plateau(greater, patience, delta):
    metrics = [0.5, 0.6, 0.6, 0.55, 0.61, 0.62, 0.62, 0.7, 0.69, 0.69, 0.69, 0.3, 0.8]
    if not greater:
        metrics = [1.0 - m for m in metrics]
    s = schedule(4, lr_mode="plateau", initial_lr=0.1, lr_decay_factor=0.5, plateau_patience=patience,
                 plateau_min_delta=delta, max_epochs=len(metrics))
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    ref = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="max" if greater else "min", factor=0.5,
                                                     patience=patience, threshold=delta, threshold_mode="abs")
    for epoch, m in enumerate(metrics):
        s.observe(m, greater)
        ref.step(m)
        assert s(4 * (epoch + 1)) == pytest.approx(opt.param_groups[0]["lr"], rel=1e-12), epoch
    assert s.reductions > 0
    again = schedule(4, lr_mode="plateau", initial_lr=0.1, lr_decay_factor=0.5, max_epochs=3)
    again.load_state_dict(s.state_dict())
    assert again(0) == s(0) and again.state_dict() == s.state_dict()


def test_plateau_ignores_missing_values_and_other_modes():
    s = schedule(2, lr_mode="plateau", initial_lr=1.0, plateau_patience=0, max_epochs=4)
    for v in (None, float("nan"), 3.0, 3.0):
        s.observe(v, True)
    assert s.reductions == 1 and s(5) == pytest.approx(0.1)
    c = schedule(2, lr_mode="cosine", initial_lr=1.0, max_epochs=2)
    c.observe(1.0, True)
    c.observe(0.0, True)
    assert c.state_dict() == {"reductions": 0, "best": None, "bad": 0}
