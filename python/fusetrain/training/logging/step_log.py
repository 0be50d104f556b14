"""Per-step scalars (loss, lr, loss scale, gradient norm) every
``log_interval`` optimizer steps, to the loggers of ``training_params.loggers``.

NOTE [step log without syncs]: each step copies its device scalars into a
device buffer (no host read); the buffer is read once per interval, so a run
with ``log_interval: 50`` waits for the device once every 50 steps, not every
step. The learning rate is a host value (the schedule's).

A logger is any object with ``log_scalars(step, values)`` and ``close()``
(values: name -> float). Built-in ones by name: ``tensorboard``, ``csv``,
``jsonl`` (files in the experiment folder), ``wandb`` and ``mlflow`` (when
those packages are installed; their keyword arguments come from
``logger_params``).
"""

from __future__ import annotations

import csv
import json
import math
import os
from typing import Any, List, Mapping, Optional, Sequence

import torch

__all__ = ["LOGGERS", "StepLog", "build_loggers", "JsonlLogger", "CsvLogger", "TensorBoardLogger"]

KEYS = ("loss", "loss_scale", "grad_norm")  # device scalars; "lr" comes from the host


class JsonlLogger:
    def __init__(self, directory: str, **_: Any) -> None:
        self.path = os.path.join(directory, "steps.jsonl")

    def log_scalars(self, step: int, values: Mapping[str, float]) -> None:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **values}) + "\n")

    def close(self) -> None:
        pass


class CsvLogger:
    def __init__(self, directory: str, **_: Any) -> None:
        self.path = os.path.join(directory, "steps.csv")
        self._keys: Optional[List[str]] = None

    def log_scalars(self, step: int, values: Mapping[str, float]) -> None:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        if self._keys is None:
            self._keys = ["step", *values]
            if not os.path.isfile(self.path) or os.path.getsize(self.path) == 0:
                with open(self.path, "a", newline="") as f:
                    csv.writer(f).writerow(self._keys)
        with open(self.path, "a", newline="") as f:
            csv.writer(f).writerow([step] + [values.get(k, "") for k in self._keys[1:]])

    def close(self) -> None:
        pass


class TensorBoardLogger:
    def __init__(self, directory: str, **kwargs: Any) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._w = SummaryWriter(log_dir=os.path.join(directory, "tensorboard"), **kwargs)

    def log_scalars(self, step: int, values: Mapping[str, float]) -> None:
        for k, v in values.items():
            self._w.add_scalar(f"step/{k}", v, step)

    def close(self) -> None:
        self._w.flush()
        self._w.close()


class WandbLogger:
    def __init__(self, directory: str, experiment_name: str = "", **kwargs: Any) -> None:
        import wandb

        kwargs.setdefault("name", experiment_name or None)
        kwargs.setdefault("dir", directory)
        self._run = wandb.init(**kwargs)

    def log_scalars(self, step: int, values: Mapping[str, float]) -> None:
        self._run.log(dict(values), step=step)

    def close(self) -> None:
        self._run.finish()


class MlflowLogger:
    def __init__(self, directory: str, experiment_name: str = "", **kwargs: Any) -> None:
        import mlflow

        self._mlflow = mlflow
        if experiment_name:
            mlflow.set_experiment(kwargs.pop("experiment", experiment_name))
        self._run = mlflow.start_run(**kwargs)

    def log_scalars(self, step: int, values: Mapping[str, float]) -> None:
        self._mlflow.log_metrics(dict(values), step=step)

    def close(self) -> None:
        self._mlflow.end_run()


LOGGERS = {"tensorboard": (TensorBoardLogger, "tensorboard"), "csv": (CsvLogger, None),
           "jsonl": (JsonlLogger, None), "wandb": (WandbLogger, "wandb"), "mlflow": (MlflowLogger, "mlflow")}


def check_logger_packages(names: Sequence[Any]) -> None:
    """Raise, before anything is written, for a named logger whose package is missing."""
    for n in names:
        if isinstance(n, str) and LOGGERS[n][1] is not None:
            try:
                __import__(LOGGERS[n][1])
            except ImportError as e:
                from ..._optional import EXTRAS, install_hint

                how = f"; {install_hint(LOGGERS[n][1])}" if LOGGERS[n][1] in EXTRAS else ""
                raise ValueError(f"training_params.loggers: {n!r} needs the package {LOGGERS[n][1]!r}, which is not "
                                 f"installed ({e}){how}") from None


def build_loggers(names: Sequence[Any], params: Mapping[str, Mapping[str, Any]], directory: str,
                  experiment_name: str) -> List[Any]:
    out = []
    for n in names:
        if isinstance(n, str):
            cls = LOGGERS[n][0]
            extra = {"experiment_name": experiment_name} if n in ("wandb", "mlflow") else {}
            out.append(cls(directory, **extra, **dict(params.get(n, {}))))
        else:  # an object with log_scalars/close
            out.append(n)
    return out


class StepLog:
    """Collects one row of device scalars per optimizer step and writes the
    rows of an interval with a single host read (NOTE [step log without syncs])."""

    def __init__(self, loggers: Sequence[Any], interval: int, device: torch.device) -> None:
        self.loggers = list(loggers)
        self.interval = max(1, int(interval))
        self._buf = torch.full((self.interval, len(KEYS)), float("nan"), dtype=torch.float32, device=device)
        self._steps: List[int] = []
        self._lrs: List[float] = []

    def record(self, step: int, lr: float, loss: torch.Tensor, loss_scale: Optional[torch.Tensor] = None,
               grad_norm: Optional[torch.Tensor] = None) -> None:
        """Store step ``step``'s scalars (device tensors; no host read); writes
        the interval's rows when it is full."""
        if not self.loggers:
            return
        row = self._buf[len(self._steps)]
        for j, t in enumerate((loss, loss_scale, grad_norm)):
            if t is None:
                row[j].fill_(float("nan"))
            else:
                row[j].copy_(t.detach().reshape(()))
        self._steps.append(int(step))
        self._lrs.append(float(lr))
        if len(self._steps) == self.interval:
            self.flush()

    def flush(self) -> None:
        """Write the rows collected so far (one host read)."""
        if not self._steps:
            return
        values = self._buf[:len(self._steps)].tolist()
        for step, lr, row in zip(self._steps, self._lrs, values):
            out = {"lr": lr, **{k: v for k, v in zip(KEYS, row) if not math.isnan(v)}}
            for lg in self.loggers:
                lg.log_scalars(step, out)
        self._steps.clear()
        self._lrs.clear()

    def write(self, step: int, values: Mapping[str, float]) -> None:
        """Write host ``values`` at ``step`` now (after the rows collected so far)."""
        self.flush()
        for lg in self.loggers:
            lg.log_scalars(step, dict(values))

    def close(self) -> None:
        self.flush()
        for lg in self.loggers:
            lg.close()
