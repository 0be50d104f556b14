"""Step-based control inside epochs and the exact mid-epoch resume: a run
stopped by SIGINT or killed with SIGKILL at any step (also while a
checkpoint is written) and resumed ends bit-identical to the uninterrupted
run on the CPU; validation and checkpoints every N steps or T minutes;
keep-last-k step checkpoints."""

import json
import os
import random
import signal
import time

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from fusetrain import Callback
from fusetrain.training import TrainingParamsError, resolve_training_params
from fusetrain.training.schedules import triggers as triggers_mod
from fusetrain.training.checkpoint.files import load_checkpoint
from fusetrain.training.distributed.context import DistContext
from fusetrain.training.checkpoint.position import resume_iterator, rng_state, set_rng_state
from fusetrain.training.checkpoint.elastic import rank_position
from fusetrain.training.trainer import Trainer
from fusetrain.training.distributed.preemption import TrainingInterrupted

from _train_helpers import one_thread  # noqa: F401  (fixture)
from _train_helpers import assert_tree_equal, child, cnn, finish, loaders, rows_of
from _test_helpers import latest_run, run_path
from fusetrain.training.checkpoint.run_folder import latest_checkpoint

BASE = dict(max_epochs=3, max_train_batches=10, max_valid_batches=2, progress_bar=False, device="cpu",
            ckpt_every_n_steps=3)
# Keys of a metrics row that depend on the clock, not on the training.
TIMING = ("epoch_time_s", "warmup_time_s", "samples_per_s", "peak_memory_mb", "reserved_memory_mb")


class SignalAt(Callback):
    """Sends this process ``sig`` at the end of optimizer step ``step``."""

    def __init__(self, step, sig=signal.SIGINT):
        self.step, self.sig = step, sig

    def on_step_end(self, state):
        if state.global_step == self.step:
            os.kill(os.getpid(), self.sig)


def run(tmp_path, name, dropout=0.3, **params):
    tl, vl = loaders()
    model = cnn()
    model.classifier[1].p = dropout  # dropout draws from the global RNG: its state must continue exactly
    return Trainer(name, ckpt_root_dir=str(tmp_path)).train(model, {**BASE, **params}, tl, vl)


def state_of(d):
    ck = load_checkpoint(os.path.join(latest_run(d), "ckpt_latest.pth"))
    return {**{k: ck.get(k) for k in ("model", "optimizer", "ema", "scaler", "global_step", "epoch")},
            "best": ck["progress"]["best"]}


def history(d):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows_of(d)]


def assert_same_run(a, b):
    assert_tree_equal(state_of(a), state_of(b))
    assert history(a) == history(b)


CONFIGS = {
    "fp32": {},
    "bf16_ema_accumulate": dict(mixed_precision="bf16", ema=True, batch_accumulate=2, clip_grad_norm=1.0,
                                lr_mode="cosine", lr_warmup_steps=4),
    "fp16_scaler_replay": dict(mixed_precision="fp16", ema=True, resume_skip="replay", valid_every_n_steps=4),
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_sigint_mid_epoch_then_resume_is_bit_identical(tmp_path, config):
    params = CONFIGS[config]
    run(tmp_path, "whole", **params)
    step = 7 if params.get("batch_accumulate") != 2 else 3  # mid-epoch 1 (5 steps per epoch with accumulation)
    with pytest.raises(TrainingInterrupted, match=f"stopped on SIGINT after optimizer step {step}; .*ckpt_latest.pth "
                                                  f"continues it with resume=True"):
        run(tmp_path, "cut", callbacks=[SignalAt(step)], **params)
    ck = load_checkpoint(run_path(str(tmp_path), "cut", "ckpt_latest.pth"))
    assert ck["global_step"] == step and ck["epoch"] == 0 and ck["position"]["batches"] == step * params.get(
        "batch_accumulate", 1)
    with pytest.warns(UserWarning, match="callbacks"):
        run(tmp_path, "cut", resume=True, **params)
    assert_same_run(os.path.join(str(tmp_path), "whole"), os.path.join(str(tmp_path), "cut"))


def test_sigterm_in_the_last_batches_of_an_epoch_and_a_second_epoch_resume(tmp_path):
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    run(tmp_path, "whole")
    with pytest.raises(TrainingInterrupted, match="SIGTERM after optimizer step 19"):
        run(tmp_path, "cut", callbacks=[SignalAt(19, signal.SIGTERM)])
    assert load_checkpoint(run_path(str(tmp_path), "cut", "ckpt_latest.pth"))["position"]["epoch"] == 1
    with pytest.warns(UserWarning, match="callbacks"):
        run(tmp_path, "cut", resume=True)
    assert_same_run(os.path.join(str(tmp_path), "whole"), os.path.join(str(tmp_path), "cut"))
    # The handlers are the ones from before again after train() returns or raises.
    assert {s: signal.getsignal(s) for s in handlers} == handlers


def test_a_signal_at_the_last_step_of_an_epoch_stops_after_its_checkpoint(tmp_path):
    with pytest.raises(TrainingInterrupted, match="after optimizer step 10"):
        run(tmp_path, "cut", callbacks=[SignalAt(10)])
    ck = load_checkpoint(run_path(str(tmp_path), "cut", "ckpt_latest.pth"))
    assert ck["epoch"] == 1 and ck.get("position") is None and [r["epoch"] for r in rows_of(ck_dir(tmp_path))] == [1]


def ck_dir(tmp_path, name="cut"):
    return os.path.join(str(tmp_path), name)


def test_kill_9_at_random_steps_and_during_checkpoint_writes_then_resume_is_bit_identical(tmp_path):
    # Real processes: SIGKILL at a step (mid-epoch), SIGKILL while a mid-epoch checkpoint is being written,
    # SIGKILL from outside at a random moment, and an outside SIGINT; after each the run resumes from
    # ckpt_latest.pth, and the whole ends as the uninterrupted run did.
    params = dict(max_epochs=3, max_train_batches=12, ckpt_every_n_steps=2, valid_every_n_steps=5,
                  mixed_precision="bf16", ema=True, keep_last_ckpts=2, _model={"dropout": 0.3}, _step_sleep=0.05)
    code, out = finish(child(tmp_path, "whole", "run", **params))
    assert code == 0, out
    exp = os.path.join(str(tmp_path), "cut")
    rng = random.Random(0)
    # Steps 5 and 10 in epoch 1, 17 in epoch 2, 28 in epoch 3 (12 steps each). An outside signal comes within
    # about 2 steps (50 ms each) of a step validation (every 5 steps), so each trial starts before the next one's
    # step.
    trials = ["kill_step:5", "kill_ckpt_step:10", "outside_kill", "kill_step:17", "outside_sigint",
              "kill_ckpt_step:28"]
    for mode in trials:
        latest = latest_checkpoint(exp)
        before = load_checkpoint(latest)["global_step"] if latest else 0
        proc = child(tmp_path, "cut", "run" if mode.startswith("outside") else mode, resume="auto", **params)
        if mode.startswith("outside"):
            for line in proc.stdout:  # a step validation, then a random moment
                if line.startswith("step "):
                    break
            time.sleep(rng.uniform(0.0, 0.1))
            proc.send_signal(signal.SIGKILL if mode == "outside_kill" else signal.SIGINT)
        code, out = finish(proc)
        assert code != 0, out
        ck = load_checkpoint(latest_checkpoint(exp))  # always loadable
        if mode == "outside_sigint":  # a clean stop: the checkpoint of the step it stopped at
            assert "SIGINT received" in out and "TrainingInterrupted" in out, out
            assert f"after optimizer step {ck['global_step']};" in out
        if mode.startswith("kill_ckpt_step"):  # died writing it: the previous checkpoint is intact
            assert ck["global_step"] == int(mode.split(":")[1]) - 2
        assert ck["global_step"] >= before
    code, out = finish(child(tmp_path, "cut", "run", resume=True, **params))
    assert code == 0, out
    d = latest_run(exp)
    assert_tree_equal(state_of(os.path.join(str(tmp_path), "whole")), state_of(d))
    assert history(os.path.join(str(tmp_path), "whole")) == history(d)
    assert sorted(n for n in os.listdir(d) if n.startswith("ckpt_step_")) == ["ckpt_step_34.pth", "ckpt_step_36.pth"]
    assert not [n for n in os.listdir(d) if n.startswith(".tmp_")]


# ---- step-based control --------------------------------------------------------------------------------------

class Recorder:
    def __init__(self):
        self.rows = []

    def log_scalars(self, step, values):
        self.rows.append((step, dict(values)))

    def close(self):
        pass


class Saved(Callback):
    def __init__(self):
        self.paths = []

    def on_checkpoint_saved(self, state, path):
        self.paths.append((state.global_step, os.path.basename(path)))


def test_validation_every_n_steps_reports_at_the_step_and_keeps_the_best(tmp_path):
    rec, saved = Recorder(), Saved()
    result = run(tmp_path, "v", valid_every_n_steps=4, ckpt_every_n_steps=0, keep_last_ckpts=0, loggers=[rec],
                 log_interval=2, callbacks=[saved], max_epochs=2, initial_lr=3e-3)
    d = result["run_dir"]
    with open(os.path.join(d, "valid_steps.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    # Steps 4, 8, 12, 16 (10 steps per epoch; 20 ends an epoch and is validated there).
    assert [(r["epoch"], r["step"]) for r in rows] == [(1, 3), (1, 7), (2, 11), (2, 15)]
    assert all(0.0 <= r["valid_accuracy"] <= 1.0 and r["valid_loss"] > 0 for r in rows)
    logged = {s: v for s, v in rec.rows if "valid_accuracy" in v}
    assert sorted(logged) == [3, 7, 11, 15] and logged[7]["valid_accuracy"] == rows[1]["valid_accuracy"]
    # The best value is the first maximum in time (step validations and the epoch ends at steps 10 and 20).
    timeline = sorted([(r["step"] + 1, r["valid_accuracy"], True) for r in rows]
                      + [(r["epoch"] * 10, r["valid_accuracy"], False) for r in rows_of(d)])
    best = result["best"]
    assert best["value"] == max(v for _, v, _ in timeline)
    at_step, _, mid = next(t for t in timeline if t[1] == best["value"])
    assert best.get("step") == (at_step if mid else None)
    best_ck = load_checkpoint(os.path.join(d, "ckpt_best.pth"))
    assert best_ck["global_step"] == at_step and (best_ck.get("position") is not None) == mid
    assert (at_step, "ckpt_best.pth") in saved.paths


def test_checkpoints_every_n_steps_keep_the_last_k(tmp_path):
    saved = Saved()
    result = run(tmp_path, "k", ckpt_every_n_steps=4, keep_last_ckpts=3, callbacks=[saved])
    d = result["run_dir"]
    latest_steps = [s for s, n in saved.paths if n == "ckpt_latest.pth"]
    assert latest_steps == [4, 8, 10, 12, 16, 20, 24, 28, 30]  # every 4 steps and each epoch end (10, 20, 30)
    assert sorted(n for n in os.listdir(d) if n.startswith("ckpt_step_")) == [
        "ckpt_step_24.pth", "ckpt_step_28.pth", "ckpt_step_30.pth"]
    assert_tree_equal(load_checkpoint(os.path.join(d, "ckpt_step_30.pth"))["model"],
                      load_checkpoint(os.path.join(d, "ckpt_latest.pth"))["model"])
    assert load_checkpoint(os.path.join(d, "ckpt_step_28.pth"))["position"]["batches"] == 8


def test_checkpoints_every_t_minutes(tmp_path, monkeypatch):
    clock = [0.0]

    class Tick(Callback):  # each optimizer step takes "40 seconds"
        def on_step_end(self, state):
            clock[0] += 40.0

    monkeypatch.setattr(triggers_mod.StepTriggers, "clock", staticmethod(lambda: clock[0]))
    saved = Saved()
    run(tmp_path, "t", ckpt_every_n_steps=0, ckpt_every_minutes=2.0, callbacks=[saved, Tick()], max_epochs=2)
    # 120 s = 3 steps after the last checkpoint (an epoch end counts as one).
    assert [s for s, n in saved.paths if n == "ckpt_latest.pth"] == [3, 6, 9, 10, 13, 16, 19, 20]


def test_new_params_are_validated():
    with pytest.raises(TrainingParamsError, match=r"ckpt_every_n_steps: got -1.*an int >= 0"):
        resolve_training_params({"ckpt_every_n_steps": -1})
    with pytest.raises(TrainingParamsError, match=r"resume_skip: got 'skip'.*'fast', 'replay'"):
        resolve_training_params({"resume_skip": "skip"})
    with pytest.raises(TrainingParamsError, match=r"keep_last_ckpt.*did you mean 'keep_last_ckpts'"):
        resolve_training_params({"keep_last_ckpt": 2})
    with pytest.raises(TrainingParamsError, match=r"ckpt_every_minutes: got 'soon'"):
        resolve_training_params({"ckpt_every_minutes": "soon"})


# ---- the iterator that continues an epoch ------------------------------------------------------------------

def _data(n=50):
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, 3, generator=g), torch.arange(n))


@pytest.mark.parametrize("with_generator", [True, False])
@pytest.mark.parametrize("mode", ["fast", "replay"])
def test_resume_iterator_continues_the_epoch_and_the_random_states(with_generator, mode):
    gen = torch.Generator().manual_seed(3) if with_generator else None
    loader = DataLoader(_data(), batch_size=8, shuffle=True, generator=gen)
    torch.manual_seed(5)
    start = rng_state(loader)
    it = iter(loader)
    whole = []
    for k, (_, idx) in enumerate(it):
        whole.append((idx, torch.rand(2)))  # the training's own draws between batches
        if k == 2:
            at_3 = rng_state(loader)
    torch.rand(7)  # anything before (the setup of the resumed run)
    set_rng_state(start, loader)
    rest = resume_iterator(loader, 3, mode)
    set_rng_state(at_3, loader)
    again = [(idx, torch.rand(2)) for _, idx in rest]
    assert len(again) == len(whole) - 3
    for (a, ra), (b, rb) in zip(whole[3:], again):
        assert torch.equal(a, b) and torch.equal(ra, rb)


def test_resume_iterator_refuses_a_shorter_loader():
    loader = DataLoader(_data(20), batch_size=8)
    for mode in ("fast", "replay"):
        with pytest.raises(ValueError, match="written after batch 4 of its epoch, but the train loader"):
            resume_iterator(loader, 4, mode)


def test_a_mid_epoch_position_on_another_number_of_processes():
    ranks = [{"sums": {"loss": torch.tensor(2.0 + r), "components": {}}, "train_metrics": [{"tensors": [
        torch.tensor([1.0 * r, 4.0])]}], "samples": 12, "rng_start": "s", "rng": "r"} for r in range(2)]
    position = {"epoch": 2, "batches": 3, "step0": 20, "skipped_seen": 0.0, "ranks": ranks}
    shard_order = {"position": position, "world_size": 2,
                   "data_order": {"global": False, "seed": None, "batch_size": 4, "batch_accumulate": 1,
                                  "world_size": 2}}
    with pytest.raises(ValueError, match=r"middle of epoch 3 by 2 process\(es\) and its train loader did not read "
                                         r"the global order; allowed: resume it with 2"):
        rank_position(shard_order, DistContext(), "x.pth", 8)
    assert rank_position(shard_order, DistContext(rank=1, world_size=2), "x.pth", 4)["rng"] == "r"
    # 3 batches of 4 on 2 processes: 24 samples into the global order; 1 process of batch 8 skips 3 batches,
    # 3 processes of batch 2 skip 4 each; rank 0 takes the sums of both old ranks.
    ck = dict(shard_order, data_order=dict(shard_order["data_order"], **{"global": True, "seed": 5}))
    one = rank_position(ck, DistContext(), "x.pth", 8)
    assert one["batches"] == 3 and one["samples"] == 24 and one["step0"] == 20 and one["rng"] is None
    assert one["sums"]["loss"].item() == 5.0 and one["train_metrics"][0]["tensors"][0].tolist() == [1.0, 8.0]
    third = [rank_position(ck, DistContext(rank=r, world_size=3), "x.pth", 2) for r in range(3)]
    assert [t["batches"] for t in third] == [4, 4, 4] and [t["samples"] for t in third] == [24, 0, 0]
    assert third[1]["sums"] is None
    with pytest.raises(ValueError, match=r"24 samples into epoch 3\) is not a whole number of batches of 5"):
        rank_position(ck, DistContext(rank=0, world_size=3), "x.pth", 5)
