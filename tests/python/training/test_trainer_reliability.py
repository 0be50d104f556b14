"""The Trainer under kills, concurrent runs, odd loaders and bad state: each
failure is loud and nothing saved is lost. Kills and concurrent runs use real
processes (_train_child.py) and signals."""

import os
import random
import signal
import time

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from fusetrain.training import TrainingParamsError, resolve_training_params
from fusetrain.training.checkpoint.files import load_checkpoint
from fusetrain.training.checkpoint.run_folder import RunFolder
from fusetrain.training.schedules.lr import LRSchedule
from fusetrain.training.trainer import Trainer

from _test_helpers import latest_run
from _train_helpers import QUICK as FAST, child, cnn, finish, loaders, one_thread, rows_of, train  # noqa: F401


def csv_epochs(d):
    with open(os.path.join(d, "metrics.csv")) as f:
        return [int(line.split(",")[0]) for line in f.read().splitlines()[1:]]


def leftovers(d):
    return [n for n in os.listdir(d) if n.startswith(".tmp_")]


class Mapped:
    """A loader whose batches pass through ``fn`` (length and generator kept)."""

    def __init__(self, loader, fn):
        self.loader, self.fn, self.generator = loader, fn, loader.generator

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        return (self.fn(b) for b in self.loader)


class Stream(IterableDataset):
    """An iterable dataset (no __len__) over the first ``n`` digits samples."""

    def __init__(self, dataset, n):
        self.dataset, self.n = dataset, n

    def __iter__(self):
        return (self.dataset[i] for i in range(self.n))


def wait_for(path, proc, timeout=60):
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.05)


# ---- 1: loaders without a length -------------------------------------------------------------------------

def test_iterable_loader_needs_max_train_batches_and_sets_the_schedule(tmp_path):
    tl, vl = loaders()
    stream = DataLoader(Stream(tl.dataset, 32 * 5), batch_size=32)
    with pytest.raises(TrainingParamsError, match="max_train_batches: got None but the train loader has no length"):
        train(tmp_path, data=(stream, vl), max_train_batches=None)
    assert os.listdir(tmp_path) == []
    # With it, the cosine schedule spans max_epochs * max_train_batches steps.
    params = dict(max_train_batches=5, lr_mode="cosine", max_epochs=3, initial_lr=0.1)
    result, _ = train(tmp_path, data=(stream, vl), **params)
    schedule = LRSchedule(resolve_training_params({**FAST, **params}), 5)
    assert [r["lr"] for r in rows_of(result["run_dir"])] == [schedule(4), schedule(9), schedule(14)]
    assert schedule(14) == pytest.approx(0.1 * 0.01) and schedule(4) > 0.05  # final: cosine_final_lr_ratio
    # A loader that ends before max_train_batches is reported.
    with pytest.warns(UserWarning, match="ended after 5 batches, before max_train_batches=8"):
        train(tmp_path, "short", data=(stream, vl), max_train_batches=8, max_epochs=1)


# ---- 5: empty loaders --------------------------------------------------------------------------------------

EMPTY = DataLoader(TensorDataset(torch.zeros(0, 1, 12, 12), torch.zeros(0, dtype=torch.long)), batch_size=4)


@pytest.mark.parametrize("which,match", [("train", "train_loader is empty"), ("valid", "valid_loader is empty"),
                                         ("named", r"valid_loader\['b'\] is empty")])
def test_empty_loaders_fail_before_writing(tmp_path, which, match):
    tl, vl = loaders()
    data = {"train": (EMPTY, vl), "valid": (tl, EMPTY), "named": (tl, {"a": vl, "b": EMPTY})}[which]
    with pytest.raises(ValueError, match=match):
        train(tmp_path, data=data)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("which", ["train", "valid"])
def test_empty_loaders_without_a_length_fail_without_a_checkpoint(tmp_path, which):
    tl, vl = loaders()
    stream = DataLoader(Stream(tl.dataset, 0), batch_size=32)
    data = (stream, vl) if which == "train" else (tl, stream)
    match = "train loader yielded no batches in epoch 1" if which == "train" else "valid_loader yielded no samples"
    with pytest.raises(ValueError, match=match):
        train(tmp_path, data=data)
    assert os.listdir(tmp_path) == []  # no checkpoint, no metrics, no folder


def test_trainer_test_on_an_empty_loader_fails():
    with pytest.raises(ValueError, match="Trainer.test: test_loader yielded no samples"):
        Trainer("t").test(cnn(), EMPTY, training_params={"device": "cpu"})


# ---- 4 and 6: kills while writing the metrics or a checkpoint ------------------------------------------------

@pytest.mark.parametrize("mode", ["kill_jsonl", "kill_csv", "kill_ckpt"])
def test_a_kill_while_writing_loses_nothing_and_resume_cleans_up(tmp_path, mode):
    # The child SIGKILLs itself in the middle of epoch 2's write: the metrics
    # line (torn), the CSV rewrite or the checkpoint (a temporary file left).
    code, out = finish(child(tmp_path, "exp", mode))
    assert code == -signal.SIGKILL, out
    d = latest_run(tmp_path / "exp")
    assert load_checkpoint(os.path.join(d, "ckpt_latest.pth"))["epoch"] == 1
    assert csv_epochs(d) == ([1, 2] if mode == "kill_ckpt" else [1])  # the metrics are written first
    if mode == "kill_jsonl":
        with open(os.path.join(d, "metrics.jsonl")) as f:
            assert not f.read().endswith("\n")  # the torn line
    else:
        assert len(leftovers(d)) == 1
    expected = {"kill_jsonl": "line 2 is incomplete", "kill_csv": r"removed 1 temporary file.*\.tmp_metrics\.csv",
                "kill_ckpt": r"removed 1 temporary file.*\.tmp_ckpt_latest\.pth.*\(0\.1 MiB\)"}[mode]
    with pytest.warns(UserWarning, match=expected):
        result, _ = train(tmp_path, max_epochs=3, max_train_batches=2, resume=True)
    assert [r["epoch"] for r in rows_of(d)] == [1, 2, 3] and csv_epochs(d) == [1, 2, 3]
    assert leftovers(d) == [] and result["final"]["epoch"] == 3


def test_a_bad_metrics_line_before_the_last_is_an_error(tmp_path):
    result, _ = train(tmp_path)
    path = os.path.join(result["run_dir"], "metrics.jsonl")
    with open(path) as f:
        lines = f.readlines()
    with open(path, "w") as f:
        f.writelines(["{not json\n"] + lines[1:])
    with pytest.raises(ValueError, match=r"metrics.jsonl: line 1 is not a metrics row"):
        train(tmp_path, max_epochs=3, resume=True)


@pytest.mark.slow
def test_kill_at_random_moments_then_resume(tmp_path):
    # SIGKILL from outside at random moments (after an epoch line, within the
    # next epoch or its writes); each resume continues from an intact
    # checkpoint with a consistent history, and the run ends complete.
    params = dict(max_epochs=10, max_train_batches=12)
    rng = random.Random(0)
    for _ in range(4):
        proc = child(tmp_path, "exp", "run", resume="auto", **params)
        for line in proc.stdout:
            if line.startswith("epoch "):
                break
        time.sleep(rng.uniform(0.0, 0.15))
        proc.send_signal(signal.SIGKILL)
        finish(proc)
        d = latest_run(tmp_path / "exp")
        epoch = load_checkpoint(os.path.join(d, "ckpt_latest.pth"))["epoch"]
        assert [r["epoch"] for r in rows_of(d)][:epoch] == list(range(1, epoch + 1))
    code, out = finish(child(tmp_path, "exp", "run", resume=True, **params))
    assert code == 0, out
    assert [r["epoch"] for r in rows_of(d)] == list(range(1, 11)) and csv_epochs(d) == list(range(1, 11))
    assert leftovers(d) == []


# ---- 3: one run per run folder -----------------------------------------------------------------------------------

def test_a_second_run_into_a_busy_run_folder_fails_naming_the_holder(tmp_path):
    first, _ = train(tmp_path, max_epochs=1)
    holder = child(tmp_path, "exp", "hold", resume=True)  # continues the first run, in its folder
    wait_for(os.path.join(str(tmp_path), "exp.ready"), holder)
    code, out = finish(child(tmp_path, "exp", "run", resume=True))
    assert code == 1 and "ExperimentInUseError" in out and f"in use by another run (pid {holder.pid} on " in out
    fresh, _ = train(tmp_path, "exp", max_epochs=1)  # a fresh run takes a folder of its own meanwhile
    assert fresh["run_dir"] != first["run_dir"]
    open(os.path.join(str(tmp_path), "exp.go"), "w").close()
    code, out = finish(holder)
    assert code == 0, out
    d = first["run_dir"]
    assert [r["epoch"] for r in rows_of(d)] == [1, 2, 3] and not os.path.exists(os.path.join(d, ".lock"))


def test_the_lock_of_a_killed_run_is_taken_over(tmp_path):
    holder = child(tmp_path, "exp", "hold")
    wait_for(os.path.join(str(tmp_path), "exp.ready"), holder)
    holder.send_signal(signal.SIGKILL)
    finish(holder)
    d = latest_run(tmp_path / "exp")
    assert sorted(os.listdir(d)) == [".lock", "console.log", "training_params.yaml"]  # the killed holder's
    folder = RunFolder(d)
    folder.open()  # the kernel released the dead holder's lock
    folder.close()
    assert ".lock" not in os.listdir(d)


def test_the_same_run_twice_makes_two_run_folders(tmp_path):
    first, _ = train(tmp_path, save_ckpt_epoch_list=[1])
    d = first["run_dir"]
    before = {n: open(os.path.join(d, n), "rb").read() for n in ("metrics.jsonl", "ckpt_latest.pth")}
    second, _ = train(tmp_path, max_epochs=1)
    assert second["run_dir"] != d and os.path.dirname(second["run_dir"]) == os.path.dirname(d)
    assert {n: open(os.path.join(d, n), "rb").read() for n in before} == before
    assert [r["epoch"] for r in rows_of(second["run_dir"])] == [1]
    for run in (d, second["run_dir"]):
        assert {"training_params.yaml", "console.log", "metrics.jsonl", "ckpt_latest.pth"} <= set(os.listdir(run))
    # overwrite_experiment deletes the earlier runs first (an explicit choice).
    with pytest.warns(UserWarning, match=r"overwrite_experiment=True: deleted the earlier run\(s\) RUN_"):
        third, _ = train(tmp_path, max_epochs=1, overwrite_experiment=True)
    assert os.listdir(os.path.dirname(d)) == [os.path.basename(third["run_dir"])]
    with pytest.raises(TrainingParamsError, match="overwrite_experiment: got True with resume"):
        train(tmp_path, resume=True, overwrite_experiment=True)


# ---- 2: resume with changed training_params -------------------------------------------------------------------

def test_resume_applies_changed_hyperparameters_and_says_so(tmp_path):
    base = dict(optimizer="AdamW", optimizer_params={"weight_decay": 0.01}, mixed_precision="fp16",
                scaler_params={"init_scale": 2.0**10, "growth_interval": 50}, ema=True, seed=1)
    result, _ = train(tmp_path, **base)
    d = result["run_dir"]
    scale = load_checkpoint(os.path.join(d, "ckpt_latest.pth"))["scaler"]["scale"]
    changed = dict(base, optimizer_params={"weight_decay": 0.05}, ema_params={"decay": 0.5}, seed=2, max_epochs=3,
                   scaler_params={"init_scale": 1.0, "growth_interval": 7}, resume=True)
    with pytest.warns(UserWarning, match="changed since the checkpoint") as record:
        train(tmp_path, **changed)
    text = "\n".join(str(w.message) for w in record)
    for line in ("optimizer_params.weight_decay: 0.01 -> 0.05 (applied to the restored optimizer",
                 "scaler_params.growth_interval: 50 -> 7", "scaler_params.init_scale: 1024.0 -> 1.0",
                 "the scale and its growth tracker continue from the checkpoint",
                 "ema_params.decay: '<default>' -> 0.5",
                 "seed: 1 -> 2 (not used", "max_epochs: 2 -> 3 (applied"):
        assert line in text, (line, text)
    ck = load_checkpoint(os.path.join(d, "ckpt_latest.pth"))
    assert [g["weight_decay"] for g in ck["optimizer"]["param_groups"]] == [0.05]
    assert ck["scaler"]["growth_interval"] == 7 and ck["ema"]["decay"] == 0.5
    assert ck["scaler"]["scale"] >= scale  # continued (growing or not), not restarted at init_scale 1.0


def test_resume_into_another_optimizer_is_refused_before_writing(tmp_path):
    result, _ = train(tmp_path, optimizer="SGD", optimizer_params={"momentum": 0.9})
    path = os.path.join(result["run_dir"], "ckpt_latest.pth")
    before = open(path, "rb").read()
    with pytest.raises(TrainingParamsError, match=r"optimizer: got 'AdamW' but the checkpoint .* was trained with "
                                                  r"'SGD'; allowed on resume: 'SGD'"):
        train(tmp_path, optimizer="AdamW", max_epochs=3, resume=True)
    assert open(path, "rb").read() == before and len(rows_of(result["run_dir"])) == 2


# ---- 7: a diverged fp16 run stops and says so -------------------------------------------------------------------

class AlwaysInf(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        out = self.inner(x)
        return out * float("inf") if self.training else out


def test_a_run_whose_scale_reaches_the_floor_stops_as_diverged(tmp_path):
    model = AlwaysInf(cnn())
    before = [q.detach().clone() for q in model.parameters()]
    params = dict(mixed_precision="fp16", scaler_params={"init_scale": 2.0**-124}, max_epochs=4, max_train_batches=3,
                  progress_bar=True, log_interval=1)
    with pytest.warns(RuntimeWarning) as record:
        result, _ = train(tmp_path, model=model, **params)
    text = [str(w.message) for w in record]
    assert any("the run diverged at step 2: the loss scale is at its floor" in t for t in text), text  # 2**-124 / 4
    assert any("the run diverged: the loss scale reached its floor 2**-126 in epoch 1 (3 of its 3 steps" in t
               for t in text), text
    assert [r["epoch"] for r in rows_of(result["run_dir"])] == [1]  # stopped after the epoch
    assert result["final"]["loss_scale"] == 2.0**-126 and result["final"]["skipped_steps"] == 3
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_a_fully_skipped_epoch_above_the_floor_warns(tmp_path):
    with pytest.warns(RuntimeWarning, match=r"every optimizer step of epoch 1 \(3\) was skipped"):
        result, _ = train(tmp_path, model=AlwaysInf(cnn()), mixed_precision="fp16", max_epochs=1)
    assert result["final"]["loss_scale"] == 2.0**13


# ---- 8: causes named before anything is written -----------------------------------------------------------------

def test_an_all_frozen_model_is_named(tmp_path):
    model = cnn().requires_grad_(False)
    with pytest.raises(ValueError, match="the model has no trainable parameters"):
        train(tmp_path, model=model)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("fn,match", [
    (lambda b: (b[0].double(), b[1]), "the batch's inputs are float64 but the model's parameters are float32"),
    (lambda b: (b[0], b[1] + 3), r"class targets range over \[\d+, 12\] but the model outputs 10 classes"),
    (lambda b: (b[0], b[1] - 1), r"class targets range over \[-1, 8\] .*or ignore_index -100"),
])
def test_a_bad_first_batch_is_named_before_writing(tmp_path, fn, match):
    tl, vl = loaders()
    with pytest.raises(ValueError, match=match):
        train(tmp_path, data=(Mapped(tl, fn), vl))
    assert os.listdir(tmp_path) == []
