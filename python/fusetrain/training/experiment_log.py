"""Per-epoch logs of an experiment: metrics.csv, metrics.jsonl, TensorBoard
event files (when tensorboard is installed) and, at the end, a PNG plot of the
loss and metrics per epoch. Nothing is created before the first row is logged.
Validations every N steps (``valid_every_n_steps``) append their rows to
valid_steps.jsonl.

NOTE [append-only history]: each epoch appends one line to metrics.jsonl
(flushed and fsynced) and replaces metrics.csv atomically, so a kill at any
moment leaves every earlier row intact; at worst the last jsonl line is torn,
and a resume drops it (with a warning) and rewrites both files atomically.
"""

from __future__ import annotations

import csv
import json
import math
import os
import warnings
from typing import Any, Dict, List

from .checkpoints import atomic_write

__all__ = ["ExperimentLogger", "NullLogger", "read_jsonl_rows"]


def read_jsonl_rows(path: str) -> List[Dict[str, Any]]:
    """The rows of a metrics.jsonl. A torn last line (a kill while it was
    appended) is dropped with a warning; a bad line before it is an error."""
    with open(path, "rb") as f:
        lines = f.read().decode("utf-8", errors="replace").split("\n")
    rows: List[Dict[str, Any]] = []
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    for i, line in enumerate(lines[:last + 1]):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, dict):
                raise ValueError(f"a {type(row).__name__}, not an object")
        except ValueError as e:
            if i == last:
                warnings.warn(f"{path}: line {i + 1} is incomplete (the run was stopped while writing it) and is "
                              f"dropped: {line[:80]!r}", stacklevel=3)
                break
            raise ValueError(f"{path}: line {i + 1} is not a metrics row ({e}); fix or delete that line to "
                             f"resume") from None
        rows.append(row)
    return rows


class ExperimentLogger:
    def __init__(self, directory: str, tensorboard: bool = True) -> None:
        self.directory = directory
        self.rows: List[Dict[str, Any]] = []
        self._jsonl = os.path.join(directory, "metrics.jsonl")
        self._csv = os.path.join(directory, "metrics.csv")
        self._steps_jsonl = os.path.join(directory, "valid_steps.jsonl")
        self._tensorboard = tensorboard
        self._tb = None

    def _open_tensorboard(self) -> None:
        self._tensorboard = False
        try:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=os.path.join(self.directory, "tensorboard"))
        except ImportError as e:  # tensorboard is optional (the `logging` extra)
            warnings.warn(f"TensorBoard logging disabled: tensorboard is not installed ({e}); "
                          f"install it with `pip install tensorboard` or `pip install fusetrain[logging]`", stacklevel=3)
        except Exception as e:
            warnings.warn(f"TensorBoard logging disabled: {e}", stacklevel=3)

    def load_existing(self, up_to_epoch: int, up_to_step: int = 0) -> None:
        """On resume: keep the rows of epochs already done (those of later
        epochs and a torn last line are dropped from both files), and the
        step validations of the ``up_to_step`` optimizer steps done."""
        if os.path.isfile(self._steps_jsonl):
            kept = [r for r in read_jsonl_rows(self._steps_jsonl) if r.get("step", 0) < up_to_step]
            atomic_write(self._steps_jsonl, lambda f: f.writelines(json.dumps(r) + "\n" for r in kept), "w")
        if not os.path.isfile(self._jsonl):
            if up_to_epoch > 0:
                warnings.warn(f"resume: {self._jsonl} is missing; the metrics history starts at epoch "
                              f"{up_to_epoch + 1}", stacklevel=3)
            return
        rows = read_jsonl_rows(self._jsonl)
        self.rows = [r for r in rows if r.get("epoch", 0) <= up_to_epoch]
        missing = sorted(set(range(1, up_to_epoch + 1)) - {r.get("epoch") for r in self.rows})
        if missing:
            warnings.warn(f"resume: {self._jsonl} has no rows for epoch(s) {missing} of the checkpoint's "
                          f"{up_to_epoch}", stacklevel=3)
        atomic_write(self._jsonl, lambda f: f.writelines(json.dumps(r) + "\n" for r in self.rows), "w")
        self._write_csv()

    def log_step_validation(self, row: Dict[str, Any]) -> None:
        """A ``valid_every_n_steps`` row (``epoch``, ``step``: the step's index, ``valid_*``), appended and synced."""
        os.makedirs(self.directory, exist_ok=True)
        with open(self._steps_jsonl, "a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def log_epoch(self, row: Dict[str, Any]) -> None:
        self.rows.append(dict(row))
        os.makedirs(self.directory, exist_ok=True)
        with open(self._jsonl, "a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self._write_csv()
        if self._tensorboard:
            self._open_tensorboard()
        if self._tb is not None:
            epoch = int(row["epoch"])
            for k, v in row.items():
                if k != "epoch" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                    self._tb.add_scalar(k, v, epoch)
            self._tb.flush()

    def _write_csv(self) -> None:
        keys: List[str] = []
        for r in self.rows:
            keys.extend(k for k in r if k not in keys)

        def write(f) -> None:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            for r in self.rows:
                w.writerow(r)

        atomic_write(self._csv, write, "w")

    def plot(self, filename: str = "metrics.png") -> str:
        """Loss (left) and other metrics (right) per epoch; returns the path, or
        "" (with a warning) when matplotlib is not installed."""
        try:
            import matplotlib
        except ImportError:
            warnings.warn(f"metrics plot {filename} not written: matplotlib is not installed; install it with "
                          f"`pip install matplotlib` or `pip install fusetrain[logging]`", stacklevel=2)
            return ""

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        path = os.path.join(self.directory, filename)
        epochs = [r["epoch"] for r in self.rows]
        fig, (ax_loss, ax_m) = plt.subplots(1, 2, figsize=(10, 4))
        for key in [k for k in self._numeric_keys() if "loss" in k and k.startswith(("train_", "valid_"))]:
            pts = [(r["epoch"], r[key]) for r in self.rows if key in r]
            ax_loss.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=key)
        for key in [k for k in self._numeric_keys() if k.startswith(("train_", "valid_")) and "loss" not in k]:
            pts = [(r["epoch"], r[key]) for r in self.rows if key in r]
            ax_m.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=key)
        ax_loss.set_xlabel("epoch")
        ax_loss.set_title("loss")
        ax_m.set_xlabel("epoch")
        ax_m.set_title("metrics")
        for ax in (ax_loss, ax_m):
            if ax.lines:
                ax.legend()
            if epochs:
                ax.set_xticks(sorted(set(epochs)))
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path

    def _numeric_keys(self) -> List[str]:
        keys: List[str] = []
        for r in self.rows:
            for k, v in r.items():
                if k not in keys and isinstance(v, (int, float)) and not isinstance(v, bool):
                    keys.append(k)
        return keys

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None


class NullLogger:
    """The ExperimentLogger interface for ranks other than 0: logs nothing."""

    def __init__(self) -> None:
        self.rows: List[Dict[str, Any]] = []

    def load_existing(self, up_to_epoch: int, up_to_step: int = 0) -> None:
        pass

    def log_step_validation(self, row: Dict[str, Any]) -> None:
        pass

    def log_epoch(self, row: Dict[str, Any]) -> None:
        pass

    def plot(self, filename: str = "metrics.png") -> str:
        return ""

    def close(self) -> None:
        pass
