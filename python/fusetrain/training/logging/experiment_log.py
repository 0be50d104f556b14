"""Per-epoch logs of an experiment: metrics.csv, metrics.jsonl, TensorBoard
event files (when tensorboard is installed) and, at the end, a PNG plot of the
loss and metrics per epoch (NOTE [metrics plot]). Nothing is created before the first row is logged.
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
import threading
from typing import Any, Dict, List, Optional, Tuple

from ..._warnings import warn
from ..checkpoint.files import atomic_write

__all__ = ["ExperimentLogger", "NullLogger", "plot_rows", "read_jsonl_rows", "wait_for_plots"]


_PLOTS: List[Tuple[threading.Thread, str]] = []  # plots being drawn and their folders (NOTE [metrics plot])
_PLOTS_LOCK = threading.Lock()


def wait_for_plots(directory: Optional[str] = None, timeout: Optional[float] = None) -> None:
    """Wait until the metrics plots being drawn in the background (into ``directory``, or anywhere) are written
    (NOTE [metrics plot])."""
    with _PLOTS_LOCK:
        threads = [t for t, d in _PLOTS if directory is None or d == os.path.abspath(directory)]
    for t in threads:
        t.join(timeout)


def _numeric_keys(rows: List[Dict[str, Any]]) -> List[str]:
    keys: List[str] = []
    for r in rows:
        for k, v in r.items():
            if k not in keys and isinstance(v, (int, float)) and not isinstance(v, bool):
                keys.append(k)
    return keys


def plot_rows(rows: List[Dict[str, Any]], path: str) -> str:
    """Loss (left) and other metrics (right) per epoch of metrics rows, as an
    image at ``path`` (written atomically; matplotlib's object API, so the
    process's pyplot state is left alone); returns the path, or "" (with a
    warning) when matplotlib is not installed."""
    try:
        import matplotlib  # noqa: F401  (first: a blocked or missing matplotlib fails here, not in a submodule)
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        warn(f"metrics plot {os.path.basename(path)} not written: matplotlib is not installed; install "
             f"it with `pip install matplotlib` or `pip install fusetrain[logging]`")
        return ""
    fig = Figure(figsize=(10, 4))
    FigureCanvasAgg(fig)
    ax_loss, ax_m = fig.subplots(1, 2)
    keys = [k for k in _numeric_keys(rows) if k.startswith(("train_", "valid_"))]
    for ax, chosen in ((ax_loss, [k for k in keys if "loss" in k]), (ax_m, [k for k in keys if "loss" not in k])):
        for key in chosen:
            pts = [(r["epoch"], r[key]) for r in rows if key in r]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=key)
        ax.set_xlabel("epoch")
        if ax.lines:
            ax.legend()
    ax_loss.set_title("loss")
    ax_m.set_title("metrics")
    epochs = sorted({r["epoch"] for r in rows})
    for ax in (ax_loss, ax_m):
        if epochs:
            ax.set_xticks(epochs)
    fig.tight_layout()
    ext = os.path.splitext(path)[1].lstrip(".") or "png"
    atomic_write(path, lambda f: fig.savefig(f, dpi=100, format=ext), "wb")
    return path


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
                warn(f"{path}: line {i + 1} is incomplete (the run was stopped while writing it) and is "
                     f"dropped: {line[:80]!r}")
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
            warn(f"TensorBoard logging disabled: tensorboard is not installed ({e}); "
                 f"install it with `pip install tensorboard` or `pip install fusetrain[logging]`")
        except Exception as e:
            warn(f"TensorBoard logging disabled: {e}")

    def load_existing(self, up_to_epoch: int, up_to_step: int = 0) -> None:
        """On resume: keep the rows of epochs already done (those of later
        epochs and a torn last line are dropped from both files), and the
        step validations of the ``up_to_step`` optimizer steps done."""
        if os.path.isfile(self._steps_jsonl):
            kept = [r for r in read_jsonl_rows(self._steps_jsonl) if r.get("step", 0) < up_to_step]
            atomic_write(self._steps_jsonl, lambda f: f.writelines(json.dumps(r) + "\n" for r in kept), "w")
        if not os.path.isfile(self._jsonl):
            if up_to_epoch > 0:
                warn(f"resume: {self._jsonl} is missing; the metrics history starts at epoch "
                     f"{up_to_epoch + 1}")
            return
        rows = read_jsonl_rows(self._jsonl)
        self.rows = [r for r in rows if r.get("epoch", 0) <= up_to_epoch]
        missing = sorted(set(range(1, up_to_epoch + 1)) - {r.get("epoch") for r in self.rows})
        if missing:
            warn(f"resume: {self._jsonl} has no rows for epoch(s) {missing} of the checkpoint's "
                 f"{up_to_epoch}")
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
        """Draw :func:`plot_rows` of the rows so far now; returns the path ("" without matplotlib)."""
        return plot_rows(self.rows, os.path.join(self.directory, filename))

    def plot_in_background(self, filename: str = "metrics.png") -> Optional[threading.Thread]:
        """NOTE [metrics plot]: the plot is drawn at the end of a run by a thread of its own, so ``train()``
        returns without waiting for matplotlib (its import and first figure take 1-2 s on a CPU); the
        process waits for the thread before it exits, a new run in the same folder waits for it before it opens
        the folder, and :func:`wait_for_plots` waits for it at once."""
        if not self.rows:
            return None
        rows, path = [dict(r) for r in self.rows], os.path.join(self.directory, filename)

        def draw() -> None:
            try:
                plot_rows(rows, path)
            except Exception as e:  # the plot is a convenience, never a failure
                warn(f"could not write the metrics plot {path}: {e}")

        thread = threading.Thread(target=draw, name=f"fusetrain-plot:{os.path.basename(self.directory)}")
        with _PLOTS_LOCK:
            _PLOTS[:] = [(t, d) for t, d in _PLOTS if t.is_alive()] + [(thread, os.path.abspath(self.directory))]
        thread.start()
        return thread

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

    def plot_in_background(self, filename: str = "metrics.png") -> None:
        return None

    def close(self) -> None:
        pass
