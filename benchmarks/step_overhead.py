#!/usr/bin/env python3
"""How much of a small model's training step is launch overhead, and what do compiling and capturing the whole step save?

Launch-bound models (a small MLP and a small CNN, batch 32): the GPU finishes
each kernel faster than Python and the CUDA driver can launch the next, so
the step time is the number of launches times the launch cost. fusetrain's
step (``fusetrain.training.step.train_step.TrainStep``) runs in three modes; the eager
torch loop is the reference:

  torch_eager          plain loop: forward, loss, backward, torch.optim.AdamW (foreach), zero_grad
  fusetrain_eager      TrainStep(mode="off"): fusetrain AdamW (one fused update pass)
  fusetrain_compile    TrainStep(mode="compile"): the whole step through torch.compile
  fusetrain_cuda_graph TrainStep(mode="cuda_graph"): the whole step captured once, replayed (GPU only)

Models: ``mlp`` (784 -> 256 -> 256 -> 10, ReLU; flattened 28x28 inputs) and
``cnn`` (``build_model("digits_cnn", width=16)``: three conv-BN-ReLU stages,
global pooling, a linear layer; 1x28x28 inputs). fp32, lr 1e-3, random data
(8 batches on the device, cycled).

Timing: after ``--warmup`` steps (which compile or capture), ``--repeats``
repeats of ``--steps`` consecutive steps of every variant, interleaved with
the order rotating from repeat to repeat; CUDA events on GPU (no sync inside
a repeat), time.perf_counter on CPU; the statistic is the median time per
step. Verdict: fusetrain_eager / fusetrain_cuda_graph step time (target >= 2x
on GPU), with the same against torch_eager and the compile mode's ratio.
On CPU the cuda_graph rows are n/a (needs a GPU) and there is no target.

Usage:
    python benchmarks/step_overhead.py [--device cpu|cuda] [--models mlp,cnn] [--batch B] [--steps S]
        [--repeats R] [--warmup W] [--compile-backend NAME] [--quick] [--out PATH]
Writes benchmarks/results/step_overhead_<cpu|cuda>.json and a .png chart beside it.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from torch import nn

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
from _common import (Timer, choose, device_line, fill_defaults, loadavg, make_parser, out_path, parse,  # noqa: E402
                     print_header_row, print_target, rotated, run_header, summary, verdict, write_report)
from _steps import RowUnavailable, bar_chart, make_fusetrain_step, png_path_for  # noqa: E402

BENCH = "step_overhead"
MODELS = ("mlp", "cnn")
VARIANTS = ("torch_eager", "fusetrain_eager", "fusetrain_compile", "fusetrain_cuda_graph")
LR = 1e-3
NUM_CLASSES = 10
N_BATCHES = 8
TARGET_GRAPH_VS_EAGER = 2.0


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "mlp":
        return nn.Sequential(nn.Flatten(), nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                             nn.Linear(256, NUM_CLASSES))
    from fusetrain.models import build_model

    return build_model("digits_cnn", width=16)


class Variant:
    """One variant: its own copy of the model, optimizer and step; ``run(n)``
    does n steps on the cycled batches."""

    def __init__(self, name: str, base: nn.Module, batches, device: torch.device, backend: str) -> None:
        import copy

        import fusetrain

        self.name, self.batches, self.i = name, batches, 0
        self.model = copy.deepcopy(base).to(device)
        self.loss_fn = nn.CrossEntropyLoss()
        self.impl = "plain torch loop"
        self.unavailable: Optional[str] = None
        self.last_loss: Optional[torch.Tensor] = None
        if name == "torch_eager":
            opt = torch.optim.AdamW(self.model.parameters(), lr=LR)

            def step(x, y):
                out = self.model(x)
                loss = self.loss_fn(out, y)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                return out.detach(), loss.detach()

            self.step: Callable = step
            return
        mode = {"fusetrain_eager": "off", "fusetrain_compile": "compile", "fusetrain_cuda_graph": "cuda_graph"}[name]
        opt = fusetrain.optim.AdamW(self.model.parameters(), lr=torch.tensor(LR, device=device))
        try:
            self.step, self.impl = make_fusetrain_step(
                self.model, self.loss_fn, opt, None, None, mode, device,
                compile_options={"backend": backend} if mode == "compile" else None)
        except RowUnavailable as e:
            self.unavailable = str(e)

    def run(self, n: int) -> None:
        for _ in range(n):
            x, y = self.batches[self.i % len(self.batches)]
            self.i += 1
            _, self.last_loss = self.step(x, y)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = make_parser(__doc__)
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated subset of " + ",".join(MODELS))
    ap.add_argument("--batch", type=int, default=32, help="batch size (default 32)")
    ap.add_argument("--steps", type=int, default=None, help="steps per repeat (default cuda 50, cpu 10)")
    ap.add_argument("--repeats", type=int, default=None, help="timed repeats (default cuda 15, cpu 7)")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up steps per variant (default cuda 20, cpu 5)")
    ap.add_argument("--compile-backend", default=None,
                    help="torch.compile backend (default inductor; --quick: eager, i.e. dynamo tracing only)")
    args, device = parse(ap, argv, BENCH, "a few steps: a smoke run")
    on_gpu = device.type == "cuda"
    if args.quick:
        fill_defaults(args, {"steps": 2, "repeats": 2, "warmup": 4, "compile_backend": "eager"})
    fill_defaults(args, {"steps": 50 if on_gpu else 10, "repeats": 15 if on_gpu else 7, "warmup": 20 if on_gpu else 5,
                         "compile_backend": "inductor"})
    if min(args.batch, args.steps, args.repeats, args.warmup) < 1:
        ap.error("--batch, --steps, --repeats and --warmup must be >= 1")
    models = choose(ap, "--models", args.models, MODELS, "model")
    timer = Timer(device)
    meta: Dict[str, Any] = {**run_header(BENCH, device, with_loadavg=True),
                            "config": {"quick": bool(args.quick), "models": models, "batch": args.batch,
                                       "steps": args.steps, "repeats": args.repeats, "warmup": args.warmup,
                                       "compile_backend": args.compile_backend, "precision": "fp32", "lr": LR,
                                       "optimizer": "AdamW", "batches_cycled": N_BATCHES,
                                       "timer": "CUDA events" if on_gpu else "time.perf_counter",
                                       "statistic": "median over repeats of the time per step"}}
    t0 = time.perf_counter()
    results: Dict[str, Any] = {}
    ratios: Dict[str, Any] = {}
    targets: List[Dict[str, Any]] = []
    for name in models:
        base = build(name)
        g = torch.Generator().manual_seed(1)
        batches = [(torch.randn(args.batch, 1, 28, 28, generator=g).to(device),
                    torch.randint(0, NUM_CLASSES, (args.batch,), generator=g).to(device)) for _ in range(N_BATCHES)]
        variants = [Variant(v, base, batches, device, args.compile_backend) for v in VARIANTS]
        live = [v for v in variants if v.unavailable is None]
        for v in live:
            print(f"[{BENCH}] {name}: warming up {v.name}", file=sys.stderr, flush=True)
            v.run(args.warmup)
        timer.sync()
        times: Dict[str, List[float]] = {v.name: [] for v in live}
        for r in range(args.repeats):
            for v in rotated(live, r):
                times[v.name].append(timer.per_step_ms(lambda v=v: v.run(1), args.steps))
        res = {}
        for v in variants:
            if v.unavailable is not None:
                res[v.name] = {"unavailable": v.unavailable, "median_ms": None, "min_ms": None}
            else:
                res[v.name] = dict(summary(times[v.name]), impl=v.impl, last_loss=float(v.last_loss))
        results[name] = {"num_params": sum(p.numel() for p in base.parameters()), "variants": res}

        def ratio(a: str, b: str, key: str = "median_ms") -> Optional[float]:
            x, y = res[a].get(key), res[b].get(key)
            return x / y if x is not None and y is not None and y > 0 else None

        ratios[name] = {
            "graph_vs_fusetrain_eager": ratio("fusetrain_eager", "fusetrain_cuda_graph"),
            "graph_vs_torch_eager": ratio("torch_eager", "fusetrain_cuda_graph"),
            "compile_vs_fusetrain_eager": ratio("fusetrain_eager", "fusetrain_compile"),
            "compile_vs_torch_eager": ratio("torch_eager", "fusetrain_compile"),
            "fusetrain_eager_vs_torch_eager": ratio("torch_eager", "fusetrain_eager"),
            "graph_vs_fusetrain_eager_min_based": ratio("fusetrain_eager", "fusetrain_cuda_graph", "min_ms"),
        }
        v = ratios[name]["graph_vs_fusetrain_eager"]
        targets.append({"name": "whole-step graph speed-up (fusetrain_eager / fusetrain_cuda_graph step time)",
                        "model": name, "value": v, "threshold": TARGET_GRAPH_VS_EAGER, "op": ">=",
                        "met": None if v is None else bool(v >= TARGET_GRAPH_VS_EAGER), "applies": on_gpu})

    meta["loadavg_end"] = loadavg()
    print(f"{device_line(meta)}, threads {meta['num_threads']}, load {meta['loadavg_start']}")
    print(f"batch {args.batch}, fp32, AdamW; {args.repeats} repeats x {args.steps} steps after {args.warmup} warm-up "
          f"steps; compile backend {args.compile_backend}")
    print_header_row(f"{'model':<5} {'variant':<22} {'step ms':>9} {'(min)':>9} {'vs torch_eager':>15}")
    for name, r in results.items():
        for vn, s in r["variants"].items():
            if s["median_ms"] is None:
                print(f"{name:<5} {vn:<22} {s['unavailable']}")
                continue
            rel = r["variants"]["torch_eager"]["median_ms"] / s["median_ms"]
            print(f"{name:<5} {vn:<22} {s['median_ms']:>9.3f} {s['min_ms']:>9.3f} {rel:>14.2f}x")
    print()

    def fmt(v):
        return "n/a" if v is None else f"{v:.2f}x"

    for name, r in ratios.items():
        print(f"{name}: graph vs fusetrain eager {fmt(r['graph_vs_fusetrain_eager'])}, graph vs torch eager "
              f"{fmt(r['graph_vs_torch_eager'])}, compile vs fusetrain eager {fmt(r['compile_vs_fusetrain_eager'])}, "
              f"fusetrain eager vs torch eager {fmt(r['fusetrain_eager_vs_torch_eager'])}")
    for t in targets:
        v = "n/a" if t["value"] is None else f"{t['value']:.2f}"
        print_target(meta["device_kind"], t["model"], t["name"], v, t["op"], f"{t['threshold']:.2f}",
                     verdict(t["met"], t["applies"]), "" if t["applies"] else "a GPU target; n/a (needs a GPU)")
    report_path = out_path(args, BENCH, device.type)
    png = png_path_for(report_path)
    report = dict(meta, results=results, ratios=ratios, targets=targets, png=os.path.basename(png),
                  all_targets_met=all(t["met"] for t in targets if t["applies"]), elapsed_s=time.perf_counter() - t0)
    vals = [results[m]["variants"][v]["median_ms"] for m in results for v in VARIANTS]
    bar_chart(png, list(VARIANTS), vals, f"{BENCH}: time per training step, batch {args.batch} "
              f"({meta['device_name']}, torch {meta['torch_version']})", "ms per step (median)", groups=list(results),
              notes=["n/a: not run here (cuda_graph needs a GPU)"])
    write_report(report, report_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
