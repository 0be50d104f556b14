#!/usr/bin/env python3
"""What does the Trainer cost against the loop a user writes, on models small enough that every per-sample,
per-step and per-epoch cost shows?

Two rows, each one epoch of training and one validation:

  mlp    a 16-64-2 MLP on 51,200 rows of 16 features (a TensorDataset), batch 64, validation on 4,096 rows
  cnn16  ``digits_cnn`` at width 16 on 6,400 random 1x28x28 images (10 classes), batch 64, validation on 1,024

Two variants of each, both AdamW (lr 1e-3, constant) with cross-entropy, fp32, from the same initial weights
and the same data:

  hand     the loop a user writes: ``DataLoader(shuffle=True)``, ``model.train()``, per batch ``.to(device)``,
           forward, loss, ``zero_grad``, ``backward``, ``torch.optim.AdamW.step``, the loss summed on the
           device (no per-step read); then ``model.eval()`` and ``torch.no_grad()`` validation counting the
           correct predictions on the device, read once
  trainer  ``Trainer(...).train(model, training_params, train_loader, valid_loader)`` with the same settings
           (``optimizer: AdamW``, ``lr_mode: constant``, ``max_epochs: 1``) and every other training param at
           its default but ``progress_bar: false``: training accuracy, the epoch log (CSV, JSONL, TensorBoard),
           ``ckpt_latest.pth`` and ``ckpt_best.pth`` and the metrics plot are all part of its call

Each round runs both variants in one process, in turns whose order alternates; the figures are medians over the
rounds. Each call is split into its parts: ``setup`` (from the call to the first batch's request), ``epoch``
(the training loop over the loader; the Trainer's own ``epoch_time_s``), ``after`` (validation, logs and
checkpoints, up to the return) and, for the Trainer, ``plot`` (the metrics plot drawn after ``train()``
returned, NOTE [metrics plot]; waited for outside the call's time so the next turn runs alone). ``per step``
is the epoch over its optimizer steps. Start-up is measured in fresh processes (``--startup-runs`` of each):
from the ``train`` call to the end of the first optimizer step (the hand loop pays torch's lazy imports there
as the Trainer does), and ``import fusetrain`` apart.

Targets (CPU, one thread): the Trainer's epoch at most 1.10x the hand loop's, its whole call at most 1.3x,
its start-up within 1 s of the hand loop's.

Usage:
    python benchmarks/trainer_small_model.py [--device cpu|cuda] [--rows mlp,cnn16] [--rounds R]
        [--threads T] [--startup-runs K] [--quick] [--out PATH]
The JSON goes to benchmarks/results/trainer_small_model_<cpu|cuda>.json (or --out).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:  # loaded by file path rather than run as a script
    sys.path.insert(0, _HERE)
from _common import (choose, loadavg, make_parser, parse, out_path, print_header_row, print_target,  # noqa: E402
                     run_header, device_line, verdict, write_report)

BENCHMARK = "trainer_small_model"
LR = 1e-3
BATCH = 64
EPOCH_TARGET, WHOLE_TARGET, STARTUP_TARGET_S = 1.10, 1.3, 1.0
VARIANTS = ("hand", "trainer")


# ---------------------------------------------------------------- the rows

class Row:
    """A model and its data; ``scale`` shrinks the data (``--quick``)."""

    def __init__(self, name: str, what: str, n_train: int, n_valid: int, make: Callable[[int, int], tuple],
                 model: Callable[[], nn.Module]) -> None:
        self.name, self.what, self.n_train, self.n_valid = name, what, n_train, n_valid
        self._make, self._model = make, model
        self._data: Optional[tuple] = None

    def data(self, scale: float) -> tuple:
        if self._data is None:
            self._data = self._make(max(BATCH * 4, int(self.n_train * scale)), max(BATCH, int(self.n_valid * scale)))
        return self._data

    def model(self) -> nn.Module:
        torch.manual_seed(0)
        return self._model()

    def loaders(self, scale: float):
        x, y, xv, yv = self.data(scale)
        train = DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=True,
                           generator=torch.Generator().manual_seed(1))
        return train, DataLoader(TensorDataset(xv, yv), batch_size=256)


def _tabular(n: int, nv: int) -> tuple:
    g = torch.Generator().manual_seed(1234)
    x, xv = torch.randn(n, 16, generator=g), torch.randn(nv, 16, generator=g)
    w = torch.randn(16, generator=g)
    return x, (x @ w > 0).long(), xv, (xv @ w > 0).long()


def _images(n: int, nv: int) -> tuple:
    g = torch.Generator().manual_seed(1234)
    return (torch.rand(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g),
            torch.rand(nv, 1, 28, 28, generator=g), torch.randint(0, 10, (nv,), generator=g))


def _cnn16() -> nn.Module:
    from fusetrain.models import build_model

    return build_model("digits_cnn", num_classes=10, width=16)


ROWS = {
    "mlp": Row("mlp", "16-64-2 MLP, 51,200 rows of 16 features", 51200, 4096, _tabular,
               lambda: nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 2))),
    "cnn16": Row("cnn16", "digits_cnn width 16, 6,400 images 1x28x28", 6400, 1024, _images, _cnn16),
}


# ---------------------------------------------------------------- the two variants

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_hand(row: Row, device: torch.device, scale: float, first_step: Optional[List[float]] = None) -> Dict:
    """The hand-written loop; its parts (s) and its validation accuracy."""
    model = row.model().to(device)
    train, valid = row.loaders(scale)
    t_call = time.perf_counter()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    loss_fn = nn.CrossEntropyLoss()
    loss_sum = torch.zeros((), device=device)
    t_epoch = time.perf_counter()
    model.train()
    steps = 0
    for x, y in train:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        loss = loss_fn(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        loss_sum += loss.detach()
        steps += 1
        if first_step is not None and steps == 1:
            _sync(device)
            first_step.append(time.perf_counter() - t_call)
    _sync(device)
    t_epoch_end = time.perf_counter()
    model.eval()
    correct = torch.zeros((), dtype=torch.long, device=device)
    with torch.no_grad():
        for x, y in valid:
            correct += (model(x.to(device)).argmax(1) == y.to(device)).sum()
    accuracy = correct.item() / len(valid.dataset)
    t_end = time.perf_counter()
    return {"setup": t_epoch - t_call, "epoch": t_epoch_end - t_epoch, "after": t_end - t_epoch_end,
            "whole": t_end - t_call, "steps": steps, "valid_accuracy": accuracy,
            "train_loss": float(loss_sum.item()) / steps}


def run_trainer(row: Row, device: torch.device, scale: float, first_step: Optional[List[float]] = None) -> Dict:
    """``Trainer.train`` with the same settings; its parts (s) and its validation accuracy."""
    from fusetrain import Callback, Trainer
    from fusetrain.training.logging.experiment_log import wait_for_plots

    marks: Dict[str, float] = {}

    class Marks(Callback):
        def on_epoch_start(self, state):
            marks.setdefault("epoch_start", time.perf_counter())

        if first_step is not None:
            def on_step_end(self, state):
                if state.global_step == 1:
                    _sync(device)
                    first_step.append(time.perf_counter() - marks["call"])

    model = row.model()
    train, valid = row.loaders(scale)
    root = tempfile.mkdtemp(prefix="fusetrain_small_")
    params = {"max_epochs": 1, "optimizer": "AdamW", "initial_lr": LR, "lr_mode": "constant",
              "loss": "CrossEntropyLoss", "valid_metrics": ["accuracy"], "metric_to_watch": "accuracy",
              "progress_bar": False, "device": device.type, "callbacks": [Marks()]}
    try:
        marks["call"] = time.perf_counter()
        result = Trainer(row.name, ckpt_root_dir=root).train(model, params, train, valid)
        t_end = time.perf_counter()
        wait_for_plots()
        t_plot = time.perf_counter()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    final = result["final"]
    setup = marks["epoch_start"] - marks["call"]
    return {"setup": setup, "epoch": final["epoch_time_s"], "after": t_end - marks["call"] - setup -
            final["epoch_time_s"], "whole": t_end - marks["call"], "plot": t_plot - t_end,
            "steps": len(train), "valid_accuracy": final["valid_accuracy"], "train_loss": final["train_loss"]}


RUNS = {"hand": run_hand, "trainer": run_trainer}


# ---------------------------------------------------------------- start-up, in fresh processes

_CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
import fusetrain
t2 = time.perf_counter()
torch.set_num_threads({threads})
sys.path.insert(0, {here!r})
import trainer_small_model as b
first = []
b.RUNS[{variant!r}](b.ROWS[{row!r}], torch.device({device!r}), {scale}, first_step=first)
print("STARTUP " + json.dumps({{"import_torch": t1 - t0, "import_fusetrain": t2 - t1, "first_step": first[0]}}))
"""


def startup(row: str, variant: str, device: torch.device, scale: float, threads: int) -> Dict[str, float]:
    code = _CHILD.format(threads=threads, here=_HERE, variant=variant, row=row, device=device.type, scale=scale)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("STARTUP ")]
    if out.returncode != 0 or not line:
        raise RuntimeError(f"start-up run {variant} {row} failed:\n{out.stdout}\n{out.stderr}")
    return json.loads(line[-1][len("STARTUP "):])


# ---------------------------------------------------------------- the report

def _median(runs: List[Dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    ap = make_parser(__doc__)
    ap.add_argument("--rows", default="mlp,cnn16", help="comma-separated, of: " + ", ".join(ROWS))
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 5; --quick 2)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    ap.add_argument("--startup-runs", type=int, default=None, help="fresh processes per variant (default 3; "
                                                                   "--quick 1)")
    args, device = parse(ap, argv, BENCHMARK, "a tenth of the data, 2 rounds, 1 start-up run: a smoke test")
    rows = choose(ap, "--rows", args.rows, list(ROWS), "row")
    rounds = args.rounds or (2 if args.quick else 5)
    startup_runs = args.startup_runs if args.startup_runs is not None else (1 if args.quick else 3)
    scale = 0.1 if args.quick else 1.0
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    meta = run_header(BENCHMARK, device, with_loadavg=True)
    meta.update(rounds=rounds, scale=scale, batch=BATCH, lr=LR, startup_runs=startup_runs)
    print(device_line(meta), f"threads {torch.get_num_threads()}, load average {meta['loadavg_start']}")
    report_rows: Dict[str, Any] = {}
    targets: List[Dict[str, Any]] = []
    for name in rows:
        row = ROWS[name]
        for v in VARIANTS:  # warm-up: first-use costs (imports, allocator) for neither variant's rounds
            RUNS[v](row, device, scale)
        runs: Dict[str, List[Dict]] = {v: [] for v in VARIANTS}
        for r in range(rounds):
            for v in (VARIANTS if r % 2 == 0 else VARIANTS[::-1]):
                runs[v].append(RUNS[v](row, device, scale))
        ups: Dict[str, List[Dict]] = {v: [] for v in VARIANTS}
        for k in range(startup_runs):
            for v in (VARIANTS if k % 2 == 0 else VARIANTS[::-1]):
                ups[v].append(startup(name, v, device, scale, args.threads))
        med = {v: {k: _median(runs[v], k) for k in ("setup", "epoch", "after", "whole")} for v in VARIANTS}
        med["trainer"]["plot"] = _median(runs["trainer"], "plot")
        steps = runs["hand"][0]["steps"]
        first = {v: statistics.median(u["first_step"] for u in ups[v]) if ups[v] else None for v in VARIANTS}
        ratios = {"epoch": med["trainer"]["epoch"] / med["hand"]["epoch"],
                  "whole": med["trainer"]["whole"] / med["hand"]["whole"]}
        startup_diff = (first["trainer"] - first["hand"]) if ups["hand"] else None
        report_rows[name] = {"what": row.what, "steps": steps, "runs": runs, "medians_s": med, "ratios": ratios,
                             "startup": ups, "startup_first_step_median_s": first,
                             "startup_difference_s": startup_diff}
        print(f"\n{name}: {row.what}, {steps} steps of {BATCH}, {rounds} rounds (medians, s)")
        print_header_row(f"{'variant':8s} {'setup':>7s} {'epoch':>7s} {'per step':>9s} {'after':>7s} "
                         f"{'whole':>7s} {'plot':>6s} {'1st step':>9s} {'valid acc':>9s}")
        for v in VARIANTS:
            m = med[v]
            acc = statistics.median(x["valid_accuracy"] for x in runs[v])
            plot = f"{m['plot']:6.2f}" if "plot" in m else f"{'-':>6s}"
            fs = f"{first[v]:9.2f}" if first[v] is not None else f"{'-':>9s}"
            print(f"{v:8s} {m['setup']:7.3f} {m['epoch']:7.3f} {m['epoch'] / steps * 1e3:7.3f}ms {m['after']:7.3f} "
                  f"{m['whole']:7.3f} {plot} {fs} {acc:9.4f}")
        print(f"Trainer / hand loop: epoch {ratios['epoch']:.3f}x, whole call {ratios['whole']:.3f}x"
              + (f"; start-up {startup_diff:+.2f} s (import fusetrain "
                 f"{statistics.median(u['import_fusetrain'] for u in ups['trainer']):.2f} s apart)"
                 if startup_diff is not None else ""))
        on_cpu = device.type == "cpu"
        for label, value, op, limit, met in (
                ("epoch", ratios["epoch"], "<=", EPOCH_TARGET, ratios["epoch"] <= EPOCH_TARGET),
                ("whole call", ratios["whole"], "<=", WHOLE_TARGET, ratios["whole"] <= WHOLE_TARGET),
                ("start-up difference", startup_diff, "<=", STARTUP_TARGET_S,
                 None if startup_diff is None else startup_diff <= STARTUP_TARGET_S)):
            shown = "n/a" if value is None else (f"{value:+.2f} s" if "start" in label else f"{value:.3f}x")
            print_target(device.type, name, f"Trainer / hand loop, {label}", shown, op, str(limit),
                         verdict(met, on_cpu))
            targets.append({"row": name, "name": label, "value": value, "limit": limit, "met": met,
                            "applies": on_cpu})
    meta["loadavg_end"] = loadavg()
    report = dict(meta, rows=report_rows, targets=targets, elapsed_s=time.perf_counter() - t0,
                  all_targets_met=all(t["met"] for t in targets if t["applies"] and t["met"] is not None))
    write_report(report, out_path(args, BENCHMARK, device.type))
    return report


if __name__ == "__main__":
    main()
