"""What the training-step benchmarks (seed_mnist_amp.py, seed_compile_table.py,
step_overhead.py) share: building fusetrain's training step in a given mode,
device-resident data served in shuffled batches, epoch timing, memory figures
and the bar chart written beside each JSON report.

fusetrain's step is ``fusetrain.training.step.train_step.TrainStep`` (the step the
Trainer runs, with its ``compile_step`` modes "off", "compile" and
"cuda_graph"). Where that module is not importable, modes "off" and "compile"
fall back to the same step written here (autocast forward, scaled backward,
``scaler.step`` with the fused optimizer and the attached EMA, ``update``,
``zero_grad``; compiled whole for "compile") and the report says which ran;
"cuda_graph" then is unavailable.
"""

from __future__ import annotations

import math
import os
import resource
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

MODES = ("off", "compile", "cuda_graph")


class RowUnavailable(Exception):
    """A row that cannot run here (e.g. a CUDA graph on CPU); the message says why."""


def train_step_class():
    """``fusetrain.training.step.train_step.TrainStep``, or None where it is not there."""
    try:
        from fusetrain.training.step.train_step import TrainStep
    except ImportError:
        return None
    return TrainStep


class _InlineStep:
    """The fused step written out (used only where TrainStep is absent):
    autocast forward + loss, ``scaler.scale(loss).backward()``,
    ``scaler.step(opt)`` (fused optimizer, EMA attached), ``scaler.update()``,
    ``opt.zero_grad(set_to_none=True)``; returns the detached output and loss.
    Mode "compile" compiles this whole function."""

    def __init__(self, model, loss_fn, optimizer, scaler, precision, mode, ema, compile_options, channels_last):
        self.model, self.loss_fn, self.opt, self.scaler, self.precision = model, loss_fn, optimizer, scaler, precision
        self.channels_last = channels_last
        if ema is not None:
            ema.attach(optimizer)
        self._fn = self._step
        if mode == "compile":
            self._fn = torch.compile(self._step, **(compile_options or {}))

    def _step(self, x: Tensor, y: Tensor):
        with self.precision.autocast():
            out = self.model(x)
            loss = self.loss_fn(out, y)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.opt)
        self.scaler.update()
        self.opt.zero_grad(set_to_none=True)
        return out.detach(), loss.detach()

    def __call__(self, x: Tensor, y: Tensor):
        if self.channels_last and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        return self._fn(x, y)


def make_fusetrain_step(model: nn.Module, loss_fn, optimizer, scaler, precision, mode: str, device: torch.device,
                        ema=None, compile_options: Optional[Dict[str, Any]] = None,
                        channels_last: bool = False) -> Tuple[Callable, str]:
    """fusetrain's training step in ``mode``; returns (step, implementation),
    the implementation "TrainStep" or "inline" (see the module docstring).
    Raises RowUnavailable for "cuda_graph" on CPU or without TrainStep."""
    if mode not in MODES:
        raise ValueError(f"mode: got {mode!r}; allowed: {MODES}")
    if mode == "cuda_graph" and device.type != "cuda":
        raise RowUnavailable("n/a (needs a GPU)")
    cls = train_step_class()
    if cls is not None:
        return cls(model, loss_fn, optimizer, scaler, precision, mode=mode, ema=ema, compile_options=compile_options,
                   channels_last=channels_last), "TrainStep"
    if mode == "cuda_graph":
        raise RowUnavailable("n/a (fusetrain.training.step.train_step.TrainStep is not available in this build)")
    return _InlineStep(model, loss_fn, optimizer, scaler, precision, mode, ema, compile_options,
                       channels_last), "inline"


# ---------------------------------------------------------------- data

class DeviceBatches:
    """A data set held on the device, served as shuffled batches (the last
    partial batch dropped, as ``DataLoader(shuffle=True, drop_last=True)``).
    Every row gets its own instance with the same seed, so all see the same
    batches in the same order. Images may be stored as uint8 and turned into
    floats in [0, 1] per batch (as ``ToTensor`` does), which keeps the data's
    footprint in device memory small."""

    def __init__(self, x: Tensor, y: Tensor, batch: int, device: torch.device, seed: int = 7,
                 uint8_images: bool = False) -> None:
        if x.shape[0] != y.shape[0] or batch < 1 or batch > x.shape[0]:
            raise ValueError(f"DeviceBatches: {x.shape[0]} images, {y.shape[0]} targets, batch {batch}")
        self.x, self.y = x.to(device), y.to(device)
        self.batch, self.device, self.uint8 = batch, device, uint8_images
        self.gen = torch.Generator().manual_seed(seed)

    def __len__(self) -> int:
        return self.x.shape[0] // self.batch

    def __iter__(self):
        perm = torch.randperm(self.x.shape[0], generator=self.gen).to(self.device)
        for i in range(len(self)):
            idx = perm[i * self.batch:(i + 1) * self.batch]
            xb = self.x.index_select(0, idx)
            if self.uint8:
                xb = xb.float().div_(255.0)
            yield xb, self.y.index_select(0, idx)


# ---------------------------------------------------------------- timing and memory

def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class EpochClock:
    """Wall time of an epoch: ``time.perf_counter`` on CPU; CUDA events on GPU
    (recorded on the stream at the start and the end of the epoch, read after a
    synchronize at the end, none inside)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device

    def start(self):
        sync(self.device)
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def stop_s(self, start) -> float:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        return time.perf_counter() - start


def reset_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def memory_figures(device: torch.device) -> Dict[str, Any]:
    """GPU: ``torch.cuda.memory_reserved()`` now (the seed's figure) and the
    peaks; CPU: the process's peak RSS (``ru_maxrss``)."""
    if device.type == "cuda":
        return {"kind": "torch.cuda.memory_reserved", "reserved_mb": torch.cuda.memory_reserved(device) / 2**20,
                "max_reserved_mb": torch.cuda.max_memory_reserved(device) / 2**20,
                "max_allocated_mb": torch.cuda.max_memory_allocated(device) / 2**20}
    return {"kind": "peak RSS (ru_maxrss) of the row's process",
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0}


def memory_mb(mem: Optional[Dict[str, Any]]) -> Optional[float]:
    """The one memory figure a table shows: reserved on GPU, peak RSS on CPU."""
    if not mem:
        return None
    return mem.get("reserved_mb", mem.get("peak_rss_mb"))


def finite_or_none(v: Optional[float]) -> Optional[float]:
    return v if v is not None and math.isfinite(v) else None


# ---------------------------------------------------------------- chart

def bar_chart(png_path: str, labels: Sequence[str], values: Sequence[Optional[float]], title: str, ylabel: str,
              groups: Optional[Sequence[str]] = None, notes: Optional[Sequence[str]] = None) -> str:
    """A bar chart (matplotlib, Agg) of ``values`` (None: no bar, the label
    says n/a). With ``groups`` the values are a groups x labels matrix
    flattened row by row, drawn as grouped bars. Returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(os.path.dirname(os.path.abspath(png_path)), exist_ok=True)
    if groups is None:
        fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(labels)), 4.5))
        xs = list(range(len(labels)))
        ax.bar([x for x, v in zip(xs, values) if v is not None], [v for v in values if v is not None],
               color="tab:blue")
        for x, v in zip(xs, values):
            ax.text(x, v if v is not None else 0.0, f"{v:.3g}" if v is not None else "n/a", ha="center",
                    va="bottom", fontsize=8)
        ax.set_xticks(xs)
        ax.set_xticklabels(labels, rotation=20, ha="right", fontsize=8)
    else:
        n_g, n_l = len(groups), len(labels)
        fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * n_g * n_l / 2), 4.5))
        width = 0.8 / n_l
        for j, lab in enumerate(labels):
            xs = [g + (j - (n_l - 1) / 2) * width for g in range(n_g)]
            vals = [values[g * n_l + j] for g in range(n_g)]
            ax.bar([x for x, v in zip(xs, vals) if v is not None], [v for v in vals if v is not None], width,
                   label=lab)
            for x, v in zip(xs, vals):
                ax.text(x, v if v is not None else 0.0, f"{v:.3g}" if v is not None else "n/a", ha="center",
                        va="bottom", fontsize=6, rotation=90)
        ax.set_xticks(list(range(n_g)))
        ax.set_xticklabels(groups, fontsize=8)
        ax.legend(fontsize=7)
    ax.set_title(title, fontsize=9)
    ax.set_ylabel(ylabel)
    if notes:
        fig.text(0.01, 0.01, "\n".join(notes), fontsize=6, va="bottom")
        fig.subplots_adjust(bottom=0.3)
    fig.tight_layout(rect=(0, 0.06 * bool(notes), 1, 1))
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return png_path


def png_path_for(json_path: str) -> str:
    return os.path.splitext(json_path)[0] + ".png"


def median(xs: List[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])
