#!/usr/bin/env python3
"""How does the host time of an optimizer step grow with the number of parameter tensors?

A step's host time is what the CPU spends issuing it: reading the gradients,
checking the state, building the kernels' argument lists, launching. Models
with many small tensors (ResNet-50: 161, a transformer of 24 blocks: ~300,
LLMs: thousands) make it the step's bottleneck on a GPU. The tensors here hold
``--numel`` elements each (default 1), so the arithmetic is negligible and
the time is host time; on a GPU no step waits for the device (the timer syncs
only before a repeat).

Variants (AdamW, fp32, one param group, gradients set once):
  fusetrain          fusetrain.optim.AdamW: steps through the step plan (NOTE [step plan]
                     in csrc/python/step_plan.cpp: the lists kept in C++, gradients read in C++)
  fusetrain_clip     the same with max_grad_norm=1.0 (one stats pass more)
  fusetrain_collect  the same optimizer collecting its lists in Python every step (no plan)
  fusetrain_ema      fusetrain with a ModelEMA attached (constant decay, buffers copied): the
                     params held by a module with BatchNorm's buffers for every fourth of
                     them (two float running statistics and an int64 counter), as a CNN has
  torch_fused        torch.optim.AdamW(fused=True)
  torch_foreach      torch.optim.AdamW(foreach=True)

Timing: ``--repeats`` repeats of ``--steps`` consecutive steps of every
variant, interleaved, the order rotating; time.perf_counter around the calls;
the median time per step. A least-squares line through each variant's times
gives its fixed cost and its cost per tensor. Ratio = torch_fused /
fusetrain at each size; target: >= 1.0 at every size. The EMA's host time
(fusetrain_ema - fusetrain) is reported beside it.

Usage:
    python benchmarks/step_host_time.py [--device cpu|cuda] [--tensors 100,161,500,1000,2000] [--numel N]
        [--steps S] [--repeats R] [--warmup W] [--quick] [--out PATH]
Writes benchmarks/results/step_host_time_<cpu|cuda>.json.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
from _common import (device_line, fill_defaults, make_parser, out_path, parse, print_header_row,  # noqa: E402
                     print_target, rotated, run_header, summary, verdict, write_report)

BENCH = "step_host_time"
VARIANTS = ("fusetrain", "fusetrain_clip", "fusetrain_collect", "fusetrain_ema", "torch_fused", "torch_foreach")
LR = 1e-3


class WithBatchNormBuffers(torch.nn.Module):
    """``params``, and BatchNorm's buffers for every fourth of them: two float
    running statistics of ``numel`` elements and an int64 counter."""

    def __init__(self, params: List[torch.nn.Parameter], numel: int):
        super().__init__()
        self.params = torch.nn.ParameterList(params)
        device = params[0].device
        for i in range(len(params) // 4):
            self.register_buffer(f"running_mean{i}", torch.zeros(numel, device=device))
            self.register_buffer(f"running_var{i}", torch.ones(numel, device=device))
            self.register_buffer(f"num_batches_tracked{i}", torch.zeros((), dtype=torch.int64, device=device))


def make_step(name: str, params: List[torch.nn.Parameter], numel: int) -> Callable[[], None]:
    import fusetrain
    import fusetrain.optim as fo

    if name.startswith("fusetrain"):
        opt = fo.AdamW(params, lr=LR, max_grad_norm=1.0 if name == "fusetrain_clip" else None)
        opt._keep_lists = name != "fusetrain_collect"
        if name == "fusetrain_ema":
            model = WithBatchNormBuffers(params, numel)
            # The EMA lives as long as the optimizer holding its hooks.
            fusetrain.ModelEMA(model, decay=0.9998, decay_type="constant", include_buffers=False).attach(opt)
    else:
        opt = torch.optim.AdamW(params, lr=LR, **{name.split("_")[1]: True})
    return opt.step


def host_ms(fn: Callable[[], None], steps: int, device: torch.device) -> float:
    """Host time per call of ``steps`` consecutive calls, from an idle device."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - start) * 1e3 / steps


def fit(xs: Sequence[float], ys: Sequence[float]) -> Dict[str, float]:
    """The least-squares line y = fixed + per_tensor * x (ys in ms, results in us)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx > 0 else 0.0
    return {"fixed_us": (my - slope * mx) * 1e3, "per_tensor_us": slope * 1e3}


def run_size(tensors: int, args, device: torch.device) -> Dict[str, Dict]:
    steps = {}
    for name in args.variants:
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(args.numel, device=device)) for _ in range(tensors)]
        for p in params:
            p.grad = torch.randn_like(p)
        steps[name] = make_step(name, params, args.numel)
    for fn in steps.values():
        for _ in range(args.warmup):
            fn()
    times: Dict[str, List[float]] = {k: [] for k in steps}
    for r in range(args.repeats):
        for k in rotated(list(steps), r):
            times[k].append(host_ms(steps[k], args.steps, device))
    return {k: summary(t) for k, t in times.items()}


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = make_parser(__doc__)
    ap.add_argument("--tensors", default="100,161,500,1000,2000", help="parameter-tensor counts, comma-separated")
    ap.add_argument("--numel", type=int, default=1, help="elements per tensor (default 1)")
    ap.add_argument("--repeats", type=int, default=None, help="timed repeats (default 7)")
    ap.add_argument("--steps", type=int, default=None, help="steps per timed repeat (default 50)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 5)")
    args, device = parse(ap, argv, BENCH, "two small sizes and few steps: a smoke run of a few seconds")
    if args.quick:
        args.tensors = "8,24"
        fill_defaults(args, {"repeats": 2, "steps": 3, "warmup": 2})
    fill_defaults(args, {"repeats": 7, "steps": 50, "warmup": 5})
    counts = [int(n) for n in args.tensors.split(",") if n]
    if len(counts) < 2 or min(counts) < 1 or args.numel < 1:
        ap.error("--tensors needs two or more positive counts and --numel a positive count")
    args.variants = list(VARIANTS)
    if device.type == "cpu":
        torch.set_num_threads(1)  # host time: one thread, as the step's issuing thread on a GPU machine
    meta = {**run_header(BENCH, device, with_loadavg=True),
            "config": {"quick": bool(args.quick), "tensors": counts, "numel": args.numel, "repeats": args.repeats,
                       "steps": args.steps, "warmup": args.warmup, "lr": LR}}
    t0 = time.perf_counter()
    results = {n: run_size(n, args, device) for n in counts}
    print(device_line(meta))
    print(f"AdamW on {args.numel}-element fp32 tensors; median host ms per step over {args.repeats} repeats "
          f"of {args.steps} steps")
    print_header_row(f"{'tensors':>8} " + " ".join(f"{v:>17}" for v in args.variants) + f" {'ratio':>6}")
    targets = []
    for n, r in results.items():
        ratio = r["torch_fused"]["median_ms"] / r["fusetrain"]["median_ms"]
        r["ratio_torch_fused_over_fusetrain"] = ratio
        print(f"{n:8d} " + " ".join(f"{r[v]['median_ms']:17.4f}" for v in args.variants) + f" {ratio:6.2f}")
        targets.append({"name": f"{n} tensors: torch fused / fusetrain", "value": ratio, "threshold": 1.0,
                        "met": ratio >= 1.0})
    lines = {v: fit(counts, [results[n][v]["median_ms"] for n in counts]) for v in args.variants}
    print("least-squares line per variant: fixed us + us per tensor")
    for v, line in lines.items():
        print(f"  {v:18s} {line['fixed_us']:9.1f} us + {line['per_tensor_us']:7.3f} us/tensor")
    ema_us = {n: (r["fusetrain_ema"]["median_ms"] - r["fusetrain"]["median_ms"]) * 1e3 for n, r in results.items()}
    print("the attached EMA's host time per step (fusetrain_ema - fusetrain): "
          + ", ".join(f"{n} tensors {us:.1f} us" for n, us in ema_us.items()))
    for tg in targets:
        print_target(device.type, None, tg["name"], f"{tg['value']:.2f}x", ">=", "1.00x", verdict(tg["met"]))
    meta["loadavg_end"] = run_header(BENCH, device, with_loadavg=True)["loadavg_start"]
    write_report(dict(meta, results={str(k): v for k, v in results.items()}, lines=lines,
                      ema_host_us={str(k): v for k, v in ema_us.items()}, targets=targets,
                      all_targets_met=all(t["met"] for t in targets), elapsed_s=time.perf_counter() - t0),
                 out_path(args, BENCH, device.type))
    return 0


if __name__ == "__main__":
    sys.exit(main())
