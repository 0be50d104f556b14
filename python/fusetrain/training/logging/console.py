"""What a run shows on the console, and keeps of it in its folder: a header
before the first step, one line per epoch, a summary at the end
(:class:`RunReport`), and ``console.log``, a copy of what the process printed
while it trained (:class:`ConsoleLog`), beside the run's
``training_params.yaml`` (:func:`write_training_params`).
"""

from __future__ import annotations

import io
import json
import os
import sys
from typing import Any, Dict, List, Optional, TextIO

import torch

__all__ = ["ConsoleLog", "RunReport", "describe_precision", "write_training_params"]

CONSOLE_LOG = "console.log"
TRAINING_PARAMS = "training_params.yaml"


def write_training_params(run_dir: str, params: Dict[str, Any]) -> str:
    """The resolved training params (as data) as ``training_params.yaml`` in the run folder; a resumed session
    replaces the file with its own. YAML when PyYAML is installed, else JSON (which YAML reads too)."""
    from ..checkpoint.files import atomic_write

    try:
        import yaml

        text = yaml.safe_dump(params, sort_keys=False, default_flow_style=False)
    except ImportError:
        text = json.dumps(params, indent=2) + "\n"
    path = os.path.join(run_dir, TRAINING_PARAMS)
    atomic_write(path, lambda f: f.write(text), "w")
    return path


class _Tee(io.TextIOBase):
    """A text stream that writes to ``stream`` and keeps each finished line in ``sink`` (a progress bar's
    carriage-return redraws keep only their last state)."""

    def __init__(self, stream: TextIO, sink: TextIO) -> None:
        self.stream, self.sink, self._line = stream, sink, ""

    def write(self, text: str) -> int:
        n = self.stream.write(text)
        if self.sink.closed:  # its run has ended while another stream still wraps this one
            return n if n is not None else len(text)
        *done, self._line = (self._line + text).split("\n")
        for line in done:
            line = line.rsplit("\r", 1)[-1].rstrip()
            if line:
                self.sink.write(line + "\n")
        if done:
            self.sink.flush()
        return n if n is not None else len(text)

    def flush(self) -> None:
        self.stream.flush()

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding, ...
        return getattr(self.stream, name)


class ConsoleLog:
    """While entered, what this process prints to stdout and stderr (the Trainer's lines, warnings, the
    progress bar's final state, the user's own prints) is also appended to ``<run folder>/console.log``."""

    def __init__(self, run_dir: str) -> None:
        self.path = os.path.join(run_dir, CONSOLE_LOG)
        self._file: Optional[TextIO] = None
        self._saved: List[TextIO] = []

    def __enter__(self) -> "ConsoleLog":
        self._file = open(self.path, "a", encoding="utf-8")
        self._saved = [sys.stdout, sys.stderr]
        sys.stdout, sys.stderr = _Tee(sys.stdout, self._file), _Tee(sys.stderr, self._file)
        return self

    def __exit__(self, *exc: Any) -> None:
        # Runs in threads of one process (a benchmark's) end in any order: the streams are put back only
        # when they are still this run's; otherwise its tees stay in the chain and pass text through.
        mine = [s for s in (sys.stdout, sys.stderr) if isinstance(s, _Tee) and s.sink is self._file]
        for stream in mine:
            if stream._line.strip():
                self._file.write(stream._line.rsplit("\r", 1)[-1].rstrip() + "\n")
        if sys.stdout in mine:
            sys.stdout = self._saved[0]
        if sys.stderr in mine:
            sys.stderr = self._saved[1]
        self._file.close()


def describe_precision(setting: Any, name: str, device: torch.device) -> str:
    """The precision as resolved from ``mixed_precision`` and why: ``mixed_precision=true -> bf16 (CPU: no fast
    fp16)``."""
    what = {"fp32": "fp32", "bf16": "bf16 autocast", "fp16": "fp16 autocast with loss scaling"}[name]
    if setting is True:
        why = ("the CPU has no fast fp16" if device.type != "cuda" else
               "the GPU supports bfloat16" if name == "bf16" else "the GPU has no bfloat16")
        return f"{what} (mixed_precision=true -> {name}: {why})"
    return what


def _count(n: float) -> str:
    return f"{n:,.0f}"


class RunReport:
    """The run's lines on the console (rank 0): the header, the epoch lines and the summary."""

    def __init__(self, run: Any) -> None:
        self.run = run

    def header(self) -> List[str]:
        r, p = self.run, self.run.p
        params = list(r.model.parameters())
        total, trainable = sum(t.numel() for t in params), sum(t.numel() for t in params if t.requires_grad)
        procs = (f"{r.ctx.world_size} processes, {'fsdp' if r.ctx.fsdp else 'ddp'}" if r.ctx.enabled
                 else "1 process")
        schedule = f"lr {_lr(p.initial_lr)}, {p.lr_mode if not callable(p.lr_mode) else 'a function'} schedule"
        if p.lr_warmup_epochs or p.lr_warmup_steps:
            schedule += (f", warmup {p.lr_warmup_steps} steps" if p.lr_warmup_steps
                         else f", warmup {p.lr_warmup_epochs} epoch(s)")
        extras = [f"clip_grad_norm {p.clip_grad_norm:g}"] if p.clip_grad_norm else []
        extras += ["ema"] if r.ema is not None else []
        step = {"off": "eager", "compile": "compiled step (torch.compile)", "cuda_graph": "captured CUDA graphs"}[
            p.compile_step]
        if p.torch_compile and p.compile_step == "off":
            step = "eager step, torch.compile'd model"
        if p.torch_compile or p.compile_step != "off":
            step += ": the first steps compile, so the first epoch takes longer"
        samples = getattr(getattr(r.train_loader, "dataset", None), "__len__", None)
        data = f"{r.steps_per_epoch} optimizer steps per epoch"
        if samples is not None:
            data = f"{_count(samples())} training samples, " + data
        lines = [f"fusetrain: run {os.path.basename(r.run_dir)} of experiment "
                 f"{os.path.basename(os.path.dirname(r.run_dir))}",
                 f"  folder     {r.run_dir}",
                 f"  device     {r.device} ({procs})",
                 f"  precision  {describe_precision(p.mixed_precision, r.precision.name, r.device)}",
                 f"  model      {type(r.model).__name__}: {_count(trainable)} trainable parameters of "
                 f"{_count(total)}",
                 f"  optimizer  {type(r.opt).__name__} ({', '.join([schedule] + extras)})",
                 f"  step       {step}",
                 f"  data       {data}; {p.max_steps} steps" if p.max_steps else
                 f"  data       {data}; {p.max_epochs} epoch{'s' if p.max_epochs != 1 else ''}"]
        return lines

    def epoch_line(self, row: Dict[str, Any], n_epochs: int, improved: bool, saved: List[str]) -> str:
        """``epoch 3/8 | train_loss 0.1234 ... valid_accuracy 0.9722 (best) | lr 0.003 | 1.4 s, 1,024 samples/s |
        saved ckpt_latest.pth, ckpt_best.pth``: the metrics, the watched one marked, lr, time, memory, files."""
        r = self.run
        metrics = []
        for k, v in row.items():
            if k.startswith(("train_", "valid_")) and isinstance(v, (int, float)) and not isinstance(v, bool):
                text = f"{k} {v:.4f}"
                if k == r.watch_key:
                    best = r.state.best
                    text += " (best)" if improved else (f" (best {best['value']:.4f}, epoch {best['epoch']})"
                                                        if best.get("value") is not None else "")
                metrics.append(text)
        groups = [f"epoch {row['epoch']}/{n_epochs}", "  ".join(metrics), f"lr {row['lr']:.3g}",
                  f"{row['epoch_time_s']:.1f} s, {_count(row['samples_per_s'])} samples/s"]
        if row.get("peak_memory_mb") is not None:
            groups.append(f"peak memory {_count(row['peak_memory_mb'])} MB")
        if saved:
            groups.append("saved " + ", ".join(saved))
        return " | ".join(g for g in groups if g)

    def summary(self, last: Dict[str, Any], seconds: float) -> List[str]:
        r = self.run
        best = r.state.best
        lines = [f"done: {last.get('epoch', r.state.epoch)} epoch(s), {r.state.global_step} optimizer steps in "
                 f"{seconds:.1f} s"]
        if best.get("value") is not None:
            lines.append(f"  best {r.watch_key} {best['value']:.4f} at epoch {best['epoch']}")
        files = sorted(n for n in os.listdir(r.run_dir) if not n.startswith("."))
        lines.append(f"  files in {r.run_dir}: {', '.join(files)}")
        return lines


def _lr(initial_lr: Any) -> str:
    if isinstance(initial_lr, dict):
        return f"{initial_lr['default']:g} (by name prefix)"
    return f"{initial_lr:g}"
