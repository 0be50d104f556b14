#!/usr/bin/env python3
"""What does the Trainer cost compared with a hand-written training loop?

The mixed-precision MNIST example this project started from trains its
network with two hand-written loops: a plain fp32 loop and an AMP loop
(GradScaler + fp16 autocast). This benchmark trains the same network on the
same data with those two loops, copied statement for statement, and with
``fusetrain.training.trainer.Trainer`` configured the same way, and compares
the time per epoch (and, on GPU, the memory):

  (1) handwritten_fp32  the example's ``train()`` loop: torch.optim.Adam(lr=1e-4),
                        CrossEntropyLoss, ``losses.append(loss.item())`` every step
  (2) trainer_fp32      Trainer(...).train(model, {"optimizer": "Adam", "initial_lr": 1e-4,
                        "mixed_precision": False, "progress_bar": False, ...}, loader, None)
  (3) handwritten_amp   the example's ``optimized_train()`` loop: GradScaler, autocast,
                        ``scaler.scale(loss).backward(); scaler.step(optimizer); scaler.update()``
  (4) trainer_amp       (2) with mixed_precision "fp16" (GPU) / "bf16" (CPU)

Verdict: Trainer / hand-written median epoch time, for fp32 ((2)/(1)) and AMP
((4)/(3)). Targets: on CPU at most 1.03 (within 3%), on GPU below 1.0.

Model and data
--------------
``fusetrain.models.build_model("seed_mnist")``: 14 Conv2d +
BatchNorm2d + ReLU blocks, AdaptiveAvgPool2d, Linear(1024, 1000) + ReLU +
Linear(1000, 1000) + ReLU + Linear(1000, 10); 14.7M params. Every variant
starts from a copy of the same initial weights. Data: random 1x28x28 images in
[0, 1) with random labels of 10 classes, in a TensorDataset, read through
``DataLoader(batch_size, shuffle=True, drop_last=True, num_workers)`` as in the
example; every variant gets its own loader with the same shuffling seed, so
all see the same batches. GPU: 60000 images, batch 256, 2 workers (the
example's settings). CPU: 4096 images, batch 64 (64 steps per epoch), no
worker processes (the machine has few cores, and workers would compete with
the compute threads), so that the CPU run takes about 5 minutes on an
unloaded 2-core machine. With much shorter epochs the Trainer's checkpoint
(169 MB, fsynced, every epoch) becomes a visible share of the epoch: at 1024
images it is about 2% of it.

Precision on CPU: fp16 autocast is slow or unsupported for some CPU ops, so
the AMP variants use bf16 autocast. The hand-written AMP loop keeps its
GradScaler (``torch.amp.GradScaler("cpu")``) so that it is the example's loop;
the Trainer with "bf16" uses no loss scaler (bf16 has the range of fp32), as
it would in a real bf16 run. The GPU run uses fp16 and a scaler on both sides
(``torch.amp.GradScaler("cuda")``, the current name of the example's
``torch.cuda.amp.GradScaler()``).

What the Trainer does that the loops do not, and which is counted in its time:
a metric (accuracy) and the running loss accumulated on the device, the
learning rate written into a device tensor each step, an epoch log (CSV,
JSONL, TensorBoard, console) and a checkpoint (model + optimizer state,
written atomically with fsync) after every epoch, into a temporary directory,
and per-step logging: every ``--log-interval`` steps (default 4) the loss,
lr and gradient norm go to ``steps.jsonl`` and ``steps.csv`` (one device
read per interval; the hand-written loops read the loss every step).
No validation on either side. The Trainer's default ``cudnn_benchmark=True``
applies to its own epochs; the hand-written loops run with torch's default
(False) as in the example (``--handwritten-cudnn-benchmark`` turns it on for
them).

Timing
------
Each run trains ``--epochs`` epochs; the first epoch is a warm-up and is
excluded. The loops run in worker threads, one per run, and read their data
through a gate: the loader's ``__iter__`` (start of an epoch) and, with
``--interleave step``, every ``--slice-steps``-th request for a batch report
to this script and wait until it lets the loop go on. A *turn* runs from that
release to the loop's next arrival at the gate; the waits in between count
for nobody. So the variants can be interleaved:

* ``--interleave step`` (default on CPU): all runs are set up, then each
  variant in turn trains ``--slice-steps`` steps (default 1); the order
  rotates from cycle to cycle. Load changes on a shared machine then hit the
  variants alike even within an epoch.
* ``--interleave epoch``: the same with whole epochs as turns.
* ``--interleave run`` (default on GPU): one variant's whole run after the
  other (the order rotates from round to round), with only that variant's
  model in memory, so that the memory figures are the variant's own, as in
  the example (``torch.cuda.empty_cache()`` and the peak statistics reset
  before each run). The GPU is not shared, and turns inside an epoch would
  add a ``synchronize`` per turn that the Trainer's loop does not do.

An epoch's wall time is the sum of its turns, from its ``__iter__`` to the
next epoch's (on GPU each turn ends after ``torch.cuda.synchronize()``), so
everything between two epochs counts: for the Trainer the epoch log and the
checkpoint. The last epoch of a run ends when the loop function returns, or,
for the Trainer, when its last checkpoint is written (what follows, the metrics
plot and closing the logs, happens once per run; it is reported as the run
tail). The statistic is the median over the timed epochs of all rounds.

For the Trainer the epoch is split into its own ``epoch_time_s`` (the training
loop, read from the run's metrics.jsonl, minus the time its loader waited at
the gate, all of which falls inside that clock), the time outside the loop (wall -
loop), and of that the checkpoint writes (timed around the Trainer's
``atomic_save`` calls). The ``loop only`` ratio compares the Trainer's loop
alone with the hand-written epoch.

Memory (GPU): ``torch.cuda.memory_reserved()`` at the end of each epoch (the
example's figure), and the run's ``max_memory_reserved`` and
``max_memory_allocated``; only with ``--interleave run``. On CPU there is no
per-variant figure (the process's peak RSS covers every variant); it is
reported as n/a, with the process's ru_maxrss in the JSON.

Usage:
    python benchmarks/trainer_overhead.py [--device cpu|cuda] [--images N] [--batch B]
        [--epochs E] [--rounds R] [--num-workers W] [--interleave step|epoch|run] [--slice-steps K]
        [--variants handwritten_fp32,trainer_fp32,handwritten_amp,trainer_amp]
        [--handwritten-cudnn-benchmark] [--async-checkpoints] [--keep-ckpt-dir] [--quick] [--out PATH]
The table goes to stdout (the loops' own epoch lines to stderr); the JSON to
benchmarks/results/trainer_overhead_<cpu|cuda>.json (or --out).
"""

from __future__ import annotations

import contextlib
import copy
import gc
import json
import os
import queue
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
import traceback
from typing import Any, Dict, List, Optional, Sequence

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fusetrain.training.checkpoint.manager as checkpoint_mod
from fusetrain.training.logging.experiment_log import wait_for_plots
from fusetrain.models import build_model
from fusetrain.training.params import resolve_training_params
from fusetrain.training.trainer import Trainer

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:  # loaded by file path rather than run as a script
    sys.path.insert(0, _HERE)
from _common import (csv_list, device_line, fill_defaults, loadavg, make_parser, parse, out_path,  # noqa: E402
                     print_header_row, print_target, rotated, run_header, seed_optimized_train, seed_train, verdict,
                     write_report)

LR = 1e-4  # the example's LR
NUM_CLASSES = 10
DATA_SEED = 1234
MODEL_SEED = 0
SHUFFLE_SEED = 7

CPU_RATIO_TARGET = 1.03  # Trainer / hand-written at most this on CPU
GPU_RATIO_TARGET = 1.0  # ... and below this on GPU

VARIANTS = ("handwritten_fp32", "trainer_fp32", "handwritten_amp", "trainer_amp")
PAIRS = (("fp32", "trainer_fp32", "handwritten_fp32"), ("amp", "trainer_amp", "handwritten_amp"))


def variant_labels(on_gpu: bool) -> Dict[str, str]:
    amp = "fp16" if on_gpu else "bf16"
    scaler = 'torch.amp.GradScaler("cuda")' if on_gpu else 'torch.amp.GradScaler("cpu")'
    return {
        "handwritten_fp32": "(1) the example's train(): torch.optim.Adam, loss.item() every step",
        "trainer_fp32": "(2) Trainer: optimizer Adam, mixed_precision False, progress_bar False",
        "handwritten_amp": f"(3) the example's optimized_train(): {scaler} + {amp} autocast, loss.item() every step",
        "trainer_amp": f"(4) Trainer: optimizer Adam, mixed_precision {amp!r}"
                       + ("" if on_gpu else " (no loss scaler for bf16)") + ", progress_bar False",
    }


# ---------------------------------------------------------------- the example's loops

def handwritten_epoch_end(data_loader, device: torch.device, losses_out: List[float]):
    """The example's end of epoch, but for the clock: the line it prints shows
    the gate's time of the epoch (its slices without the waits, see Gate)."""
    def end(epoch: int, losses: List[float], _token) -> None:
        end_time = time.perf_counter()
        losses_out.append(sum(losses) / len(losses))
        print(epoch_line(epoch, losses, data_loader.epoch_elapsed(end_time), device), flush=True)
    return end


def epoch_line(epoch: int, losses: List[float], elapsed: float, device: torch.device) -> str:
    s = f'Epoch: {epoch + 1}, Loss: {sum(losses) / len(losses):.4f}, Elapsed Time: {elapsed:.2f}sec'
    if device.type == "cuda":
        s += f', Reserved Memory: {torch.cuda.memory_reserved(device) / 2**20:.2f}MB'
    return s


# ---------------------------------------------------------------- the gate

def _cuda_memory(device: torch.device) -> Dict[str, float]:
    return {"reserved_mb": torch.cuda.memory_reserved(device) / 2**20,
            "max_reserved_mb": torch.cuda.max_memory_reserved(device) / 2**20,
            "max_allocated_mb": torch.cuda.max_memory_allocated(device) / 2**20}


class Gate:
    """Wraps a DataLoader so that the conductor decides when a loop runs.

    ``__iter__`` (the start of an epoch) and, with ``slice_steps``, every
    ``slice_steps``-th request for a batch report an *arrival* to the
    conductor and wait until it *releases* the loop. A slice runs from a
    release to the next arrival; its time is the variant's, the waits are
    nobody's. An epoch is the slices from its ``__iter__`` to the next epoch's
    (the end-of-epoch work of a loop, such as the Trainer's log and checkpoint,
    falls into the epoch's last slice). Everything else is delegated to the
    loader (``len``, ``generator``, ...)."""

    def __init__(self, loader: DataLoader, device: torch.device, slice_steps: Optional[int]) -> None:
        self.loader = loader
        self.device = device
        self.slice_steps = slice_steps
        self.messages: "queue.Queue" = queue.Queue()
        self._go = threading.Semaphore(0)
        # [kind ("epoch" | "slice" | "done"), arrival, release, cuda memory at arrival or None]
        self.events: List[list] = []

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str):
        if name == "loader":  # not set yet (copy/pickle)
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __iter__(self):
        self._turn("epoch")
        it = iter(self.loader)
        return it if self.slice_steps is None else self._sliced(it)

    def _sliced(self, it):
        n = 0
        while True:
            if n and n % self.slice_steps == 0:
                self._turn("slice")  # the previous steps are done: the loop asks for the next batch
            try:
                batch = next(it)
            except StopIteration:
                return
            n += 1
            yield batch

    def _turn(self, kind: str) -> None:
        self.arrive(kind)
        self._go.acquire()
        self.events[-1][2] = time.perf_counter()

    def arrive(self, kind: str) -> None:
        mem = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            if kind != "slice":
                mem = _cuda_memory(self.device)
        self.events.append([kind, time.perf_counter(), None, mem])
        self.messages.put(kind)

    def release(self) -> None:
        self._go.release()

    def epoch_elapsed(self, now: float) -> float:
        """This epoch's time so far (its slices, without the waits)."""
        first = max(j for j, e in enumerate(self.events) if e[0] == "epoch")
        total = 0.0
        for j in range(first, len(self.events)):
            end = self.events[j + 1][1] if j + 1 < len(self.events) else now
            total += end - self.events[j][2]
        return total


# Checkpoint writes of the Trainer, timed per experiment folder (one per run).
_SAVES: Dict[str, List[Dict[str, Any]]] = {}
_SAVES_LOCK = threading.Lock()


@contextlib.contextmanager
def timed_checkpoint_writes():
    """Wrap the checkpoint manager's ``atomic_save`` to time each checkpoint write."""
    original = checkpoint_mod.atomic_save

    def timed_atomic_save(obj, path):
        t0 = time.perf_counter()
        original(obj, path)
        t1 = time.perf_counter()
        rec = {"start": t0, "end": t1, "path": path, "bytes": os.path.getsize(path)}
        with _SAVES_LOCK:
            # Keyed by the experiment folder: the run's own thread writes, or its background writer
            # with async_checkpoints.
            _SAVES.setdefault(os.path.realpath(os.path.dirname(path)), []).append(rec)

    checkpoint_mod.atomic_save = timed_atomic_save
    try:
        yield
    finally:
        checkpoint_mod.atomic_save = original


# ---------------------------------------------------------------- runs

class Run:
    """One variant's run (``epochs`` epochs) in its own thread, driven through its Gate."""

    def __init__(self, variant: str, round_idx: int, cfg: Dict[str, Any], base_model: nn.Module,
                 dataset: TensorDataset, ckpt_root: str) -> None:
        self.variant = variant
        self.round = round_idx
        self.cfg = cfg
        self.device: torch.device = cfg["device"]
        self.thread_name = f"{variant}#r{round_idx}"
        gen = torch.Generator()
        gen.manual_seed(SHUFFLE_SEED + round_idx)  # the same batches for every variant of a round
        loader = DataLoader(dataset, batch_size=cfg["batch"], shuffle=True, drop_last=True,
                            num_workers=cfg["num_workers"], generator=gen)
        self.gate = Gate(loader, self.device, cfg["slice_steps"])
        self.model = copy.deepcopy(base_model)
        self.is_trainer = variant.startswith("trainer")
        self.amp = variant.endswith("amp")
        self.error: Optional[str] = None
        self.finished = False
        self.losses: List[float] = []
        self.thread_num_threads: Optional[int] = None
        self.trainer_dir: Optional[str] = None
        self.training_params: Optional[Dict[str, Any]] = None
        self.trainer: Optional[Trainer] = None
        if self.is_trainer:
            self.training_params = trainer_params(cfg, self.amp)
            self.trainer = Trainer(self.thread_name.replace("#", "_"), ckpt_root_dir=ckpt_root)
        # cudnn.benchmark is global: set before each of this run's slices.
        self.cudnn_benchmark = (resolve_training_params(self.training_params).cudnn_benchmark if self.is_trainer
                                else cfg["handwritten_cudnn_benchmark"])
        self.thread: Optional[threading.Thread] = None

    def _body(self) -> None:
        self.thread_num_threads = torch.get_num_threads()
        try:
            if self.is_trainer:
                res = self.trainer.train(self.model, self.training_params, train_loader=self.gate, valid_loader=None)
                self.trainer_dir = res["run_dir"]  # its checkpoints and metrics (NOTE [run folders])
            else:
                self.model.to(self.device)
                criterion = nn.CrossEntropyLoss()
                optimizer = torch.optim.Adam(self.model.parameters(), lr=LR)
                # The example's train() / optimized_train() (_common.seed_train / seed_optimized_train).
                epoch_end = handwritten_epoch_end(self.gate, self.device, self.losses)
                if self.amp:
                    seed_optimized_train(self.gate, self.model, optimizer, criterion, self.cfg["epochs"], self.device,
                                         self.cfg["amp_dtype"], lambda: None, epoch_end)
                else:
                    seed_train(self.gate, self.model, optimizer, criterion, self.cfg["epochs"], self.device,
                               lambda: None, epoch_end)
        except BaseException:
            self.error = traceback.format_exc()
        finally:
            self.gate.arrive("done")

    def start(self) -> None:
        """Start the thread and wait until the run is set up (at the gate of epoch 1)."""
        self.thread = threading.Thread(target=self._body, name=self.thread_name, daemon=True)
        self.thread.start()
        self._receive()

    def advance(self) -> str:
        """Release the loop for one slice and wait for its next arrival."""
        torch.backends.cudnn.benchmark = self.cudnn_benchmark
        self.gate.release()
        return self._receive()

    def _receive(self) -> str:
        kind = self.gate.messages.get()
        if self.error is not None:
            raise RuntimeError(f"{self.thread_name} failed:\n{self.error}")
        if kind == "done":
            self.finished = True
        return kind

    def finish(self) -> Dict[str, Any]:
        """Join the thread and turn its time stamps into per-epoch records."""
        self.thread.join()
        ev = self.gate.events
        n = self.cfg["epochs"]
        epoch_idx = [j for j, e in enumerate(ev) if e[0] == "epoch"]
        assert len(epoch_idx) == n and ev[-1][0] == "done", [e[0] for e in ev]
        saves = _SAVES.pop(os.path.realpath(self.trainer_dir), []) if self.is_trainer else []
        rows: List[Dict[str, Any]] = []
        if self.is_trainer:
            # The metrics plot is drawn after the run by a thread of its own (NOTE [metrics plot]): waited for
            # here, outside the timed epochs, so that no turn of the next round and no exit runs beside it.
            wait_for_plots(self.trainer_dir)
            with open(os.path.join(self.trainer_dir, "metrics.jsonl")) as f:
                rows = [json.loads(line) for line in f if line.strip()]
            assert len(rows) == n, len(rows)
        epochs = []
        run_tail = None
        bounds = epoch_idx + [len(ev) - 1]
        for k in range(n):
            first, stop = bounds[k], bounds[k + 1]  # events first..stop-1 start this epoch's slices
            start, end_t = ev[first][2], ev[stop][1]
            wall = sum(ev[j + 1][1] - ev[j][2] for j in range(first, stop))
            waits = sum(ev[j][2] - ev[j][1] for j in range(first, stop))
            rec: Dict[str, Any] = {"epoch": k + 1, "warmup": k == 0, "slices": stop - first}
            mem = ev[stop][3]
            if self.is_trainer:
                mine = [s for s in saves if start <= s["start"] <= end_t]
                if k == n - 1 and mine and mine[-1]["start"] >= ev[stop - 1][2]:
                    # The run's end: cut the last slice at the last checkpoint write
                    # (the metrics plot and closing the logs follow once per run).
                    run_tail = end_t - mine[-1]["end"]
                    wall -= run_tail
                row = rows[k]
                # The Trainer's epoch clock starts after it asked for the epoch's iterator (the gate's first wait
                # of the epoch); the later waits fall inside it.
                loop = row["epoch_time_s"] - (waits - (ev[first][2] - ev[first][1]))
                rec.update(wall_s=wall, loss=row["train_loss"], trainer_epoch_time_s=row["epoch_time_s"],
                           trainer_loop_s=loop, outside_loop_s=wall - loop,
                           ckpt_write_s=sum(s["end"] - s["start"] for s in mine),
                           ckpt_files=len(mine), ckpt_mb=sum(s["bytes"] for s in mine) / 2**20)
            else:
                rec.update(wall_s=wall, loss=self.losses[k])
            rec["gate_wait_s"] = waits
            if mem is not None:
                rec["memory"] = mem
            epochs.append(rec)
        out = {"round": self.round, "epochs": epochs, "thread_num_threads": self.thread_num_threads}
        if self.is_trainer:
            out["run_tail_s"] = run_tail
        return out

    def free(self) -> None:
        self.model = None
        self.trainer = None
        self.gate = None


def trainer_params(cfg: Dict[str, Any], amp: bool) -> Dict[str, Any]:
    p = {"max_epochs": cfg["epochs"], "optimizer": "Adam", "initial_lr": LR,
         "mixed_precision": cfg["amp_name"] if amp else False, "progress_bar": False,
         "device": str(cfg["device"])}
    # Written out either way: the default writes in the background, where the write's cost is not
    # outside the loop, so the benchmark's default times the synchronous write.
    p["async_checkpoints"] = bool(cfg["async_checkpoints"])
    if cfg["log_interval"]:  # per-step scalars to JSONL and CSV files, as a logged run does
        p.update(log_interval=cfg["log_interval"], loggers=["jsonl", "csv"])
    return p


def drive(runs: List[Run], rotation: int) -> None:
    """Advance the runs one slice each, in turn, until all are done; the
    order rotates from cycle to cycle."""
    active = list(runs)
    cycle = rotation
    while active:
        for r in rotated(active, cycle):
            kind = r.advance()
            if kind == "epoch":
                print(f"[trainer_overhead] round {r.round + 1}: {r.variant} starts epoch "
                      f"{sum(e[0] == 'epoch' for e in r.gate.events)}/{r.cfg['epochs']}", file=sys.stderr, flush=True)
        active = [r for r in active if not r.finished]
        cycle += 1


def run_round(round_idx: int, variants: Sequence[str], cfg: Dict[str, Any], base_model: nn.Module,
              dataset: TensorDataset, ckpt_root: str, results: Dict[str, List[Dict[str, Any]]]) -> None:
    n = len(variants)
    cuda = cfg["device"].type == "cuda"
    if cfg["interleave"] in ("step", "epoch"):
        runs = [Run(v, round_idx, cfg, base_model, dataset, ckpt_root) for v in variants]
        for r in runs:  # set up one after the other (untimed)
            r.start()
        drive(runs, round_idx)
        for r in runs:
            results[r.variant].append(r.finish())
            r.free()
        del runs
    else:  # "run": one variant at a time, alone in memory
        k = round_idx % n
        for v in list(variants[k:]) + list(variants[:k]):
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(cfg["device"])
            r = Run(v, round_idx, cfg, base_model, dataset, ckpt_root)
            r.start()
            drive([r], 0)
            results[v].append(r.finish())
            r.free()
            del r
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


# ---------------------------------------------------------------- summary

def summarize(variant: str, runs: List[Dict[str, Any]], per_variant_memory: bool) -> Dict[str, Any]:
    timed = [e for r in runs for e in r["epochs"] if not e["warmup"]]
    wall = [e["wall_s"] for e in timed]
    s: Dict[str, Any] = {
        "runs": runs,
        "timed_epochs": len(timed),
        "wall_s": wall,
        "median_s": statistics.median(wall),
        "min_s": min(wall),
        "warmup_wall_s": [r["epochs"][0]["wall_s"] for r in runs],
        "last_loss": runs[-1]["epochs"][-1]["loss"],
    }
    if variant.startswith("trainer"):
        loop = [e["trainer_loop_s"] for e in timed]
        outside = [e["outside_loop_s"] for e in timed]
        ckpt = [e["ckpt_write_s"] for e in timed]
        s.update(trainer_loop_median_s=statistics.median(loop), outside_loop_median_s=statistics.median(outside),
                 ckpt_write_median_s=statistics.median(ckpt),
                 ckpt_write_pct_of_epoch=100.0 * statistics.median([c / w for c, w in zip(ckpt, wall)]),
                 outside_loop_pct_of_epoch=100.0 * statistics.median([o / w for o, w in zip(outside, wall)]),
                 ckpt_mb=timed[-1]["ckpt_mb"] if timed else None,
                 run_tail_s=[r["run_tail_s"] for r in runs])
    mems = [e["memory"] for r in runs for e in r["epochs"] if "memory" in e]
    if mems and per_variant_memory:
        s["memory"] = {"reserved_mb_last_epoch": runs[-1]["epochs"][-1]["memory"]["reserved_mb"],
                       "max_reserved_mb": max(m["max_reserved_mb"] for m in mems),
                       "max_allocated_mb": max(m["max_allocated_mb"] for m in mems)}
    else:
        s["memory"] = None
    return s


def evaluate(summary: Dict[str, Dict[str, Any]], on_gpu: bool):
    ratios: Dict[str, Any] = {}
    targets = []
    threshold = GPU_RATIO_TARGET if on_gpu else CPU_RATIO_TARGET
    op = "<" if on_gpu else "<="
    for pair, tr, hw in PAIRS:
        if tr not in summary or hw not in summary:
            continue
        t, h = summary[tr], summary[hw]
        r = {"trainer_over_handwritten": t["median_s"] / h["median_s"],
             "min_based": t["min_s"] / h["min_s"],
             "loop_only": t["trainer_loop_median_s"] / h["median_s"]}
        ratios[pair] = r
        v = r["trainer_over_handwritten"]
        met = v < threshold if on_gpu else v <= threshold
        targets.append({"name": f"{pair}: Trainer / hand-written median epoch time ({tr} / {hw})", "pair": pair,
                        "value": v, "threshold": threshold, "op": op, "met": bool(met)})
    return ratios, targets


def print_table(summary, ratios, targets, meta) -> None:
    cfg = meta["config"]
    print(f"{device_line(meta)}, threads {meta['num_threads']}")
    print(f"load average (1/5/15 min) at start {meta['loadavg_start']}, at end {meta['loadavg_end']}")
    print(f"{cfg['images']} random 1x28x28 images, batch {cfg['batch']} ({cfg['steps_per_epoch']} steps/epoch), "
          f"{cfg['num_workers']} loader workers; {cfg['epochs']} epochs per run (epoch 1 = warm-up, excluded), "
          f"{cfg['rounds']} round(s), interleave: {cfg['interleave']}"
          + (f" (turns of {cfg['slice_steps']} step(s))" if cfg["slice_steps"] else "") + f"; AMP = {cfg['amp_dtype']}")
    for name, label in meta["variants"].items():
        if name in summary:
            print(f"  {name:<17} {label}")
    hdr = (f"{'variant':<17} {'epoch s':>9} {'(min)':>8} {'n':>3} {'loss':>7} {'loop s':>8} {'outside s':>10} "
           f"{'ckpt s':>7} {'ckpt %':>7} {'memory':>22}")
    print_header_row(hdr)
    for name, s in summary.items():
        tr = name.startswith("trainer")
        mem = "n/a"
        if s["memory"] is not None:
            mem = f"{s['memory']['reserved_mb_last_epoch']:.0f} MB (max {s['memory']['max_reserved_mb']:.0f})"
        print(f"{name:<17} {s['median_s']:>9.3f} {s['min_s']:>8.3f} {s['timed_epochs']:>3} {s['last_loss']:>7.4f} "
              + (f"{s['trainer_loop_median_s']:>8.3f} {s['outside_loop_median_s']:>10.3f} "
                 f"{s['ckpt_write_median_s']:>7.3f} {s['ckpt_write_pct_of_epoch']:>6.2f}%" if tr else
                 f"{'-':>8} {'-':>10} {'-':>7} {'-':>7}")
              + f" {mem:>22}")
    print("epoch s: median wall time per timed epoch (min); loop s: the Trainer's own epoch_time_s less its gate "
          "wait; outside s: wall - loop (log + checkpoint); ckpt: checkpoint writes"
          + ("" if cfg["per_variant_memory"] else "; memory: n/a (no per-variant figure"
             + (" on CPU)" if meta["device_kind"] == "cpu" else " without --interleave run)")))
    print()
    for pair, r in ratios.items():
        print(f"{pair:<5} Trainer / hand-written: {r['trainer_over_handwritten']:.3f}  (min-based "
              f"{r['min_based']:.3f}; Trainer loop only {r['loop_only']:.3f})")
    print()
    for t in targets:
        print_target(meta["device_kind"], None, t["name"], f"{t['value']:.3f}", t["op"], f"{t['threshold']:.2f}",
                     verdict(t["met"]))


# ---------------------------------------------------------------- main

def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = make_parser(__doc__)
    ap.add_argument("--images", type=int, default=None, help="random images per epoch (default cuda 60000, cpu 4096)")
    ap.add_argument("--batch", type=int, default=None, help="batch size (default cuda 256, cpu 64)")
    ap.add_argument("--epochs", type=int, default=None,
                    help="epochs per run, the first one a warm-up (default cuda 5, cpu 5)")
    ap.add_argument("--rounds", type=int, default=None, help="fresh runs per variant (default cuda 2, cpu 1)")
    ap.add_argument("--num-workers", type=int, default=None, help="DataLoader workers (default cuda 2, cpu 0)")
    ap.add_argument("--interleave", choices=("step", "epoch", "run"), default=None,
                    help="alternate the variants every --slice-steps steps, every epoch, or run after run "
                         "(default cuda run, cpu step)")
    ap.add_argument("--slice-steps", type=int, default=1, help="steps per turn with --interleave step (default 1)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {','.join(VARIANTS)}")
    ap.add_argument("--handwritten-cudnn-benchmark", action="store_true",
                    help="run the hand-written loops with torch.backends.cudnn.benchmark = True, like the Trainer")
    ap.add_argument("--keep-ckpt-dir", action="store_true", help="keep the Trainer's temporary experiment folders")
    ap.add_argument("--async-checkpoints", action="store_true",
                    help="the Trainer's default, async_checkpoints=True (files written in a background thread); without it the run writes them synchronously, so their cost is timed")
    ap.add_argument("--log-interval", type=int, default=4,
                    help="the Trainer's per-step logging: log_interval with loggers [jsonl, csv] (default 4; "
                         "0 turns it off)")
    args, device = parse(ap, argv, "trainer_overhead", "a few tiny epochs: a smoke run")
    on_gpu = device.type == "cuda"
    if args.quick:
        fill_defaults(args, {"images": 4, "batch": 2, "epochs": 2, "rounds": 1, "num_workers": 0})
    defaults = ({"images": 60000, "batch": 256, "epochs": 5, "rounds": 2, "num_workers": 2, "interleave": "run"}
                if on_gpu else
                {"images": 4096, "batch": 64, "epochs": 5, "rounds": 1, "num_workers": 0, "interleave": "step"})
    fill_defaults(args, defaults)
    if args.epochs < 2:
        ap.error("--epochs must be >= 2 (the first epoch is a warm-up)")
    if args.rounds < 1 or args.num_workers < 0 or args.batch < 1 or args.slice_steps < 1:
        ap.error("--rounds, --batch and --slice-steps must be >= 1, --num-workers >= 0")
    if args.images < args.batch:
        ap.error("--images must be at least --batch (the loader drops the last partial batch)")
    variants = csv_list(args.variants)
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants or len(set(variants)) != len(variants):
        ap.error(f"--variants: {args.variants!r}; choose from {list(VARIANTS)}")
    variants = [v for v in VARIANTS if v in variants]  # fixed order

    amp_name = "fp16" if on_gpu else "bf16"
    kind = device.type
    report_path = out_path(args, "trainer_overhead", kind)
    cfg = {"device": device, "images": args.images, "batch": args.batch, "epochs": args.epochs,
           "rounds": args.rounds, "num_workers": args.num_workers, "interleave": args.interleave,
           "amp_name": amp_name, "amp_dtype": torch.float16 if on_gpu else torch.bfloat16,
           "handwritten_cudnn_benchmark": bool(args.handwritten_cudnn_benchmark),
           "slice_steps": args.slice_steps if args.interleave == "step" else None,
           "log_interval": max(0, args.log_interval), "async_checkpoints": bool(args.async_checkpoints)}
    per_variant_memory = on_gpu and args.interleave == "run"

    gen = torch.Generator().manual_seed(DATA_SEED)
    images = torch.rand(args.images, 1, 28, 28, generator=gen)
    labels = torch.randint(0, NUM_CLASSES, (args.images,), generator=gen)
    dataset = TensorDataset(images, labels)
    torch.manual_seed(MODEL_SEED)
    base_model = build_model("seed_mnist")
    num_params = sum(p.numel() for p in base_model.parameters())

    labels_by_variant = variant_labels(on_gpu)
    meta: Dict[str, Any] = {
        **run_header("trainer_overhead", device, with_loadavg=True),
        "config": {
            "quick": bool(args.quick), "model": "seed_mnist", "num_params": num_params,
            "images": args.images, "image_shape": [1, 28, 28], "classes": NUM_CLASSES, "batch": args.batch,
            "steps_per_epoch": args.images // args.batch, "num_workers": args.num_workers,
            "shuffle": True, "drop_last": True, "epochs": args.epochs, "warmup_epochs": 1,
            "rounds": args.rounds, "interleave": args.interleave, "variants": variants, "lr": LR,
            "amp_dtype": amp_name,
            "handwritten_amp_scaler": f'torch.amp.GradScaler("{kind}")',
            "trainer_amp_scaler": "LossScaler" if on_gpu else "none (bf16)",
            "handwritten_cudnn_benchmark": bool(args.handwritten_cudnn_benchmark),
            "async_checkpoints": cfg["async_checkpoints"],
            "validation": None,
            "slice_steps": cfg["slice_steps"],
            "trainer_step_logging": (f"log_interval {cfg['log_interval']}, loggers jsonl + csv"
                                     if cfg["log_interval"] else None),
            "trainer_training_params": {  # as given, and as resolved (every key)
                "given": {"fp32": trainer_params(cfg, False), "amp": trainer_params(cfg, True)},
                "resolved_fp32": resolve_training_params(trainer_params(cfg, False)).to_dict(json_safe=True),
                "resolved_amp": resolve_training_params(trainer_params(cfg, True)).to_dict(json_safe=True),
            },
            "ckpt_root_dir": "tempfile.mkdtemp()",
            "per_variant_memory": per_variant_memory,
            "timer": "time.perf_counter at the gate" + (" after torch.cuda.synchronize()" if on_gpu else ""),
            "statistic": "median over the timed epochs (all but the first of each run) of the epoch wall time",
        },
        "variants": {v: labels_by_variant[v] for v in variants},
    }

    ckpt_root = tempfile.mkdtemp(prefix="trainer_overhead_")
    print("[trainer_overhead] the epoch lines below are the loops' own; the Trainer's 'Elapsed Time' also holds "
          "the waits for its turns (the table does not)", file=sys.stderr, flush=True)
    results: Dict[str, List[Dict[str, Any]]] = {v: [] for v in variants}
    t_start = time.perf_counter()
    try:
        # The loops print their epoch lines; keep stdout for the table.
        with timed_checkpoint_writes(), contextlib.redirect_stdout(sys.stderr), warnings_once():
            for r in range(args.rounds):
                run_round(r, variants, cfg, base_model, dataset, ckpt_root, results)
    finally:
        if args.keep_ckpt_dir:
            print(f"[trainer_overhead] experiment folders kept in {ckpt_root}", file=sys.stderr)
        else:
            shutil.rmtree(ckpt_root, ignore_errors=True)

    summary = {v: summarize(v, results[v], per_variant_memory) for v in variants}
    ratios, targets = evaluate(summary, on_gpu)
    meta["loadavg_end"] = loadavg()
    meta["config"]["ckpt_root_dir_kept"] = ckpt_root if args.keep_ckpt_dir else None
    report = dict(meta, results=summary, ratios=ratios, targets=targets,
                  all_targets_met=all(t["met"] for t in targets),
                  process_ru_maxrss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
                  elapsed_s=time.perf_counter() - t_start)
    print_table(summary, ratios, targets, meta)
    write_report(report, report_path)
    return 0


@contextlib.contextmanager
def warnings_once():
    """Show each warning of the runs once (four runs would repeat them)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("once")
        yield


if __name__ == "__main__":
    sys.exit(main())
