"""Per-step scalars: StepLog collects device scalars without host reads and
writes them once per interval to the csv/jsonl/TensorBoard loggers (or any
object with log_scalars/close)."""

import pathlib
import csv
import json
import math

import pytest
import torch

from fusetrain.training.logging import step_log
from fusetrain.training.logging.step_log import StepLog

from _test_helpers import run_path


class Recorder:
    def __init__(self):
        self.rows, self.closed = [], False

    def log_scalars(self, step, values):
        self.rows.append((step, dict(values)))

    def close(self):
        self.closed = True


def test_rows_are_written_once_per_interval_and_at_close(monkeypatch):
    rec = Recorder()
    log = StepLog([rec], interval=3, device=torch.device("cpu"))
    reads = []
    real_tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(1) or real_tolist(t))
    scale = torch.tensor(1024.0)
    for k in range(7):
        loss = torch.tensor(1.0 / (k + 1))
        norm = torch.tensor(float(k)) if k % 2 == 0 else torch.tensor(float("nan"))
        log.record(k, lr=0.1 * k, loss=loss, loss_scale=scale if k < 5 else None, grad_norm=norm)
        scale = scale * 2  # a new tensor each step: the row holds the value of its own step
    assert len(reads) == 2 and [s for s, _ in rec.rows] == list(range(6))  # two full intervals
    log.close()
    assert len(reads) == 3 and rec.closed and [s for s, _ in rec.rows] == list(range(7))
    steps = dict(rec.rows)
    assert steps[0] == pytest.approx({"lr": 0.0, "loss": 1.0, "loss_scale": 1024.0, "grad_norm": 0.0})
    assert steps[3] == pytest.approx({"lr": 0.3, "loss": 0.25, "loss_scale": 8192.0})  # NaN norm left out
    assert steps[6] == pytest.approx({"lr": 0.6, "loss": 1 / 7, "grad_norm": 6.0})  # no scaler


def test_csv_jsonl_and_tensorboard_files(tmp_path):
    pytest.importorskip("tensorboard")
    loggers = step_log.build_loggers(["csv", "jsonl", "tensorboard"], {}, str(tmp_path), "exp")
    log = StepLog(loggers, interval=2, device=torch.device("cpu"))
    for k in range(3):
        log.record(10 + k, lr=0.01, loss=torch.tensor(float(k)))
    log.close()
    rows = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert rows == [{"step": 10, "lr": 0.01, "loss": 0.0}, {"step": 11, "lr": 0.01, "loss": 1.0},
                    {"step": 12, "lr": 0.01, "loss": 2.0}]
    with open(tmp_path / "steps.csv") as f:
        table = list(csv.reader(f))
    assert table[0] == ["step", "lr", "loss"] and [r[0] for r in table[1:]] == ["10", "11", "12"]
    assert any((tmp_path / "tensorboard").iterdir())


def test_missing_packages_are_named_before_anything_is_written(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_wandb(name, *a, **k):
        if name == "wandb":
            raise ImportError("No module named 'wandb'")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    with pytest.raises(ValueError, match="loggers: 'wandb' needs the package 'wandb'"):
        step_log.check_logger_packages(["csv", "wandb"])


def test_without_loggers_nothing_is_kept():
    log = StepLog([], interval=4, device=torch.device("cpu"))
    log.record(0, lr=0.1, loss=torch.tensor(float("nan")))
    assert log._steps == [] and math.isnan(log._buf[0, 0].item())


def test_trainer_writes_per_step_scalars_with_one_read_per_interval(tmp_path):
    from fusetrain.models import build_model
    from fusetrain.training.data import build_dataloaders
    from fusetrain.training.trainer import Trainer

    torch.manual_seed(0)
    model = build_model("digits_cnn", num_classes=10, width=8)
    tl, vl = build_dataloaders({"name": "digits", "batch_size": 32, "image_size": 12})
    rec = Recorder()
    params = dict(max_epochs=2, max_train_batches=5, max_valid_batches=1, progress_bar=False, device="cpu",
                  lr_mode="linear", clip_grad_norm=1.0, log_interval=2, loggers=["jsonl", rec])
    result = Trainer("steps", ckpt_root_dir=str(tmp_path)).train(model, params, tl, vl)
    assert rec.closed and [s for s, _ in rec.rows] == list(range(10))
    rows = [json.loads(line) for line in pathlib.Path(run_path(tmp_path, "steps", "steps.jsonl")).read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(10))
    assert all(set(r) == {"step", "lr", "loss", "grad_norm"} for r in rows)  # fp32: no loss scale
    assert rows[0]["lr"] == pytest.approx(1e-3) and rows[-1]["lr"] == pytest.approx(0.0, abs=1e-12)
    assert all(math.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in rows)
    # The epoch's mean train loss is the mean of its steps' losses (one batch per step).
    first_epoch = [r["loss"] for r in rows[:5]]
    assert result["final"]["train_loss"] > 0 and sum(first_epoch) / 5 == pytest.approx(
        json.loads(pathlib.Path(run_path(tmp_path, "steps", "metrics.jsonl")).read_text().splitlines()[0])["train_loss"], rel=1e-5)
