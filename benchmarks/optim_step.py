#!/usr/bin/env python3
"""How fast is fusetrain's optimizer step compared with torch's?

One run measures, on the same parameter layouts and the same device:

1. Plain step (AdamW, no scaling, no clipping, no EMA):
     fusetrain.optim.AdamW.step()
     torch.optim.AdamW(foreach=False)  -- per-tensor for-loop
     torch.optim.AdamW(foreach=True)   -- multi-tensor ops
     torch.optim.AdamW(fused=True)     -- torch's fused kernel ('n/a' if unavailable)
   Ratio of a row = torch_fused_time / row_time (> 1: faster than torch fused).

2. Full step = unscale + non-finite check + global-norm clip + AdamW + EMA:
     torch sequence (the best torch offers):
         scaler.unscale_(opt)                                # GradScaler: unscale + inf/NaN check
         torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
         scaler.step(opt); scaler.update()                   # AdamW(fused=True), found_inf passed in
         torch._foreach_lerp_(ema, params, 1 - decay)
     fusetrain:
         opt = fusetrain.optim.AdamW(..., max_grad_norm=1.0)
         opt.attach_ema({p: e}, decay_tensor)
         opt._fused_step(inv_scale=inv_scale_tensor)         # grad_stats pass + one update pass (incl. EMA)
   Ratio of a row = torch_sequence_time / row_time.

3. Copy bandwidth: ``dst.copy_(src)`` of a buffer as large as the "large"
   layout, counting read + write. On GPU the update pass' bandwidth (the plain
   fusetrain step, which is exactly one update pass) is reported as a
   percentage of it.

Layouts (fp32 params, one param group)
--------------------------------------
resnet50: the parameter shapes of torchvision's ResNet-50 (161 tensors,
    25,557,032 params: conv weights [out, in, k, k], BatchNorm weight and
    bias, fc weight and bias), generated here without torchvision.
large: 4 square matrices, 100M params on GPU ([5000, 5000] each) and 25M
    on CPU ([2500, 2500]) so that the CPU run takes a couple of minutes on
    2 cores; ``--large-mparams`` sets that size. ``--scale F`` shrinks every
    layout to about F times its params (resnet50 keeps its 161 tensors: the
    channel counts shrink by sqrt(F)). ``--quick`` uses tiny layouts.

Fairness of the full step
-------------------------
torch's ``unscale_`` multiplies the gradients in place and ``clip_grad_norm_``
scales them in place, while fusetrain only reads them. Re-copying the
gradients before every torch step would add a pass that fusetrain does not
pay for, and keeping a real loss scale S > 1 would divide the gradients by S
again at every repeated step until they underflow (denormals are slow on CPU).
So the loss scale is S = 1.0 for both: ``GradScaler(init_scale=1.0,
growth_interval=10**9)`` (the scale never changes) and ``inv_scale = 1.0`` for
fusetrain. Multiplying by 1.0 still reads and writes every gradient element
(the kernels do not special-case the value), so each approach does exactly
the work it does with any finite scale. The gradients stay finite, so no step
is skipped. torch's clipping rescales its gradients to norm 1 on the first
step, after which the clip coefficient is ~1 but the multiply pass still runs;
fusetrain re-clips the unchanged original gradients to norm 1 every step, so
both apply the same effective gradients (checked after the warm-up: see
"agreement" in the JSON). ``scaler.scale(loss)`` belongs to the forward pass
and is called once at set-up only, to create the scale tensor.

Bytes model (fp32 everywhere, 4 bytes an element; GB/s = bytes / median time)
----------------------------------------------------------------------------
plain step, every variant: the minimum any AdamW must move, 28 B/param:
    grad read (4) + param r/w (8) + exp_avg r/w (8) + exp_avg_sq r/w (8).
    (torch's for-loop and foreach variants move more than that; their GB/s
    column is the effective bandwidth on the same work.)
fusetrain full step, 40 B/param: grad_stats reads the grads (4), the update
    pass reads the grads again (4) and reads/writes param, exp_avg,
    exp_avg_sq and ema (32).
torch sequence, 60 B/param: unscale r/w grad (8) + norm reads grad (4) +
    clip multiply r/w grad (8) + fused AdamW (28) + lerp r/w ema, read param (12).
copy: read + write (8 B/element).

Timing
------
Every variant owns clones of the same initial params and gradients. After
``--warmup`` steps (which also create the optimizer state), each repeat times
``--steps`` consecutive steps of every variant, variants interleaved (their
order rotated each repeat) so that load changes on a shared machine hit all
of them alike; the reported time is the median over repeats of the per-step
time. CPU: time.perf_counter(); GPU: torch.cuda.Event. torch's thread count
is left at its default and recorded. lr is small (1e-4) so repeated steps keep
the values well inside fp32 range.

Usage:
    python benchmarks/optim_step.py [--device cpu|cuda] [--repeats N] [--steps N] [--quick]
        [--warmup N] [--scale F] [--large-mparams M] [--layouts resnet50,large] [--out PATH]
Defaults: CPU 7 repeats x 4 steps after 2 warm-up steps; GPU 10 x 20 after 5.
The table goes to stdout; the JSON to benchmarks/results/optim_step_<cpu|cuda>.json
(or --out).
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

import fusetrain
import fusetrain.optim

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:  # loaded by file path rather than run as a script
    sys.path.insert(0, _HERE)
from _common import (Timer, choose, device_line, fill_defaults, make_parser, parse, out_path,  # noqa: E402
                     print_header_row, print_target, rotated, run_header, summary, verdict, write_report)

Shape = Tuple[int, ...]

LR = 1e-4
BETAS = (0.9, 0.999)
EPS = 1e-8
WEIGHT_DECAY = 1e-2
MAX_GRAD_NORM = 1.0
EMA_DECAY = 0.999
LOSS_SCALE = 1.0  # see "Fairness of the full step" in the docstring

ELEM = 4  # fp32 bytes
BYTES_PER_PARAM = {
    "plain": 7 * ELEM,  # g r, p r/w, m r/w, v r/w
    "fusetrain_full": 10 * ELEM,  # g r (stats) + g r, p r/w, m r/w, v r/w, ema r/w
    "torch_sequence": 15 * ELEM,  # unscale 2 + norm 1 + clip 2 + adamw 7 + lerp 3
    "copy": 2 * ELEM,
}

# Target thresholds (ratios in x, bandwidth in % of the copy bandwidth)
CPU_TARGETS = {"plain": 1.0, "full": 1.3}
GPU_TARGETS = {"full": 1.4, "update_pass_pct_of_copy": 85.0}


# ---------------------------------------------------------------- layouts

def resnet50_shapes(width: float = 1.0, classes: int = 1000) -> List[Shape]:
    """Parameter shapes of torchvision's ResNet-50, in module order (conv
    weights [out, in, k, k] without bias, BatchNorm weight and bias, fc weight
    and bias): 161 tensors, 25,557,032 params at width 1. ``width`` multiplies
    every channel count and the class count (params shrink ~ width**2)."""
    def ch(n: int) -> int:
        return max(1, int(round(n * width)))

    shapes: List[Shape] = []

    def conv(out_c: int, in_c: int, k: int) -> None:
        shapes.append((out_c, in_c, k, k))

    def bn(c: int) -> None:
        shapes.extend([(c,), (c,)])

    stem = ch(64)
    conv(stem, 3, 7)
    bn(stem)
    inplanes = stem
    for planes, blocks in zip((64, 128, 256, 512), (3, 4, 6, 3)):
        mid, out = ch(planes), ch(planes * 4)
        for b in range(blocks):
            conv(mid, inplanes, 1)
            bn(mid)
            conv(mid, mid, 3)
            bn(mid)
            conv(out, mid, 1)
            bn(out)
            if b == 0:  # downsample: 1x1 conv + BN
                conv(out, inplanes, 1)
                bn(out)
            inplanes = out
    ncls = ch(classes)
    shapes.extend([(ncls, inplanes), (ncls,)])
    return shapes


def large_shapes(total_params: float, count: int = 4) -> List[Shape]:
    """``count`` square matrices totalling about ``total_params``."""
    side = max(1, int(round(math.sqrt(total_params / count))))
    return [(side, side)] * count


def numel(shapes: Sequence[Shape]) -> int:
    return sum(math.prod(s) for s in shapes)


# ---------------------------------------------------------------- variants

class Variant:
    def __init__(self, name: str, kind: str, bytes_per_param: int):
        self.name = name
        self.kind = kind  # "plain" | "full"
        self.bytes_per_param = bytes_per_param
        self.step: Optional[Callable[[], None]] = None
        self.params: List[torch.Tensor] = []
        self.ema: List[torch.Tensor] = []
        self.times_ms: List[float] = []
        self.error: Optional[str] = None


def _clone_params(base_p, base_g):
    params = []
    for p, g in zip(base_p, base_g):
        q = p.clone().requires_grad_(True)
        q.grad = g.clone()
        params.append(q)
    return params


def build_variants(base_p, base_g, device: torch.device) -> List[Variant]:
    variants: List[Variant] = []

    # --- plain step
    v = Variant("fusetrain", "plain", BYTES_PER_PARAM["plain"])
    v.params = _clone_params(base_p, base_g)
    opt_f = fusetrain.optim.AdamW(v.params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    v.step = opt_f.step
    variants.append(v)

    for name, kw in (("torch_forloop", {"foreach": False}), ("torch_foreach", {"foreach": True}),
                     ("torch_fused", {"fused": True})):
        v = Variant(name, "plain", BYTES_PER_PARAM["plain"])
        try:
            probe = torch.zeros(8, device=device, requires_grad=True)  # fused may be unavailable here
            probe.grad = torch.ones_like(probe)
            with torch.no_grad():
                torch.optim.AdamW([probe], lr=LR, **kw).step()
            v.params = _clone_params(base_p, base_g)
            v.step = torch.optim.AdamW(v.params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                                       **kw).step
        except Exception as exc:  # noqa: BLE001 -- recorded as 'n/a'
            v.error = f"{type(exc).__name__}: {exc}"
            v.params = []
        variants.append(v)

    # --- full step: fusetrain
    v = Variant("fusetrain_full", "full", BYTES_PER_PARAM["fusetrain_full"])
    v.params = _clone_params(base_p, base_g)
    v.ema = [p.detach().clone() for p in base_p]
    opt_ff = fusetrain.optim.AdamW(v.params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                                   max_grad_norm=MAX_GRAD_NORM)
    decay = torch.full((), EMA_DECAY, dtype=torch.float32, device=device)
    opt_ff.attach_ema(dict(zip(v.params, v.ema)), decay)
    inv_scale = torch.full((), 1.0 / LOSS_SCALE, dtype=torch.float32, device=device)

    def fusetrain_full_step(opt=opt_ff, inv=inv_scale):
        opt._fused_step(inv_scale=inv)

    v.step = fusetrain_full_step
    variants.append(v)

    # --- full step: torch sequence
    v = Variant("torch_sequence", "full", BYTES_PER_PARAM["torch_sequence"])
    try:
        v.params = _clone_params(base_p, base_g)
        v.ema = [p.detach().clone() for p in base_p]
        opt_t = torch.optim.AdamW(v.params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, fused=True)
        scaler = torch.amp.GradScaler(device.type, init_scale=LOSS_SCALE, growth_interval=10**9)
        scaler.scale(torch.ones((), device=device))  # creates the scale tensor (the loss scaling of the forward)
        detached = [p.detach() for p in v.params]
        weight = 1.0 - EMA_DECAY

        def torch_sequence_step(opt=opt_t, scaler=scaler, params=v.params, ema=v.ema, src=detached):
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM, foreach=True)
            scaler.step(opt)
            scaler.update()
            torch._foreach_lerp_(ema, src, weight)

        v.step = torch_sequence_step
    except Exception as exc:  # noqa: BLE001
        v.error = f"{type(exc).__name__}: {exc}"
        v.params, v.ema = [], []
    variants.append(v)
    return variants


def max_rel_diff(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    """max |a - b| / max |b| over all tensors."""
    num, den = 0.0, 0.0
    for x, y in zip(a, b):
        num = max(num, float((x.detach() - y.detach()).abs().max()))
        den = max(den, float(y.detach().abs().max()))
    return num / den if den > 0 else num


# ---------------------------------------------------------------- the run

def run_layout(shapes: List[Shape], device: torch.device, args, timer: Timer) -> Dict:
    gen = torch.Generator(device=device)
    gen.manual_seed(1234)
    base_p = [torch.randn(s, generator=gen, device=device) * 0.02 for s in shapes]
    base_g = [torch.randn(s, generator=gen, device=device) * 0.01 for s in shapes]
    n = numel(shapes)
    variants = build_variants(base_p, base_g, device)
    del base_p, base_g
    live = [v for v in variants if v.step is not None]

    with torch.no_grad():
        for v in live:
            for _ in range(args.warmup):
                v.step()
        timer.sync()

        # Same initial state, same gradients, same number of steps: the
        # params (and EMAs) of the variants must agree to rounding.
        by_name = {v.name: v for v in variants}
        agreement = {}
        ref = by_name["fusetrain"]
        for v in live:
            if v.kind == "plain" and v is not ref:
                agreement[f"{v.name}_vs_fusetrain_params"] = max_rel_diff(v.params, ref.params)
        ref = by_name["fusetrain_full"]
        seq = by_name["torch_sequence"]
        if seq.step is not None:
            agreement["torch_sequence_vs_fusetrain_full_params"] = max_rel_diff(seq.params, ref.params)
            agreement["torch_sequence_vs_fusetrain_full_ema"] = max_rel_diff(seq.ema, ref.ema)

        for r in range(args.repeats):
            for v in rotated(live, r):
                v.times_ms.append(timer.per_step_ms(v.step, args.steps))

    out = {"num_tensors": len(shapes), "num_params": n, "agreement_after_warmup": agreement, "variants": {}}
    med = {v.name: statistics.median(v.times_ms) for v in live}
    mins = {v.name: min(v.times_ms) for v in live}
    plain_ref = "torch_fused" if "torch_fused" in med else ("torch_foreach" if "torch_foreach" in med else None)
    for v in variants:
        entry: Dict = {"kind": v.kind, "bytes_per_param": v.bytes_per_param, "bytes": v.bytes_per_param * n}
        if v.step is None:
            entry.update({"status": "n/a", "error": v.error})
        else:
            m = med[v.name]
            reference = plain_ref if v.kind == "plain" else ("torch_sequence" if "torch_sequence" in med else None)
            entry.update({
                "status": "ok",
                **summary(v.times_ms),
                "gbps": v.bytes_per_param * n / (m * 1e-3) / 1e9,
                "reference": reference,
                "ratio": (med[reference] / m) if reference else None,
                # Same ratio on the fastest repeats: a cross-check when the machine is busy.
                "ratio_of_min": (mins[reference] / mins[v.name]) if reference else None,
            })
        out["variants"][v.name] = entry
    del variants, live
    return out


def copy_bandwidth(n: int, device: torch.device, args, timer: Timer) -> Dict:
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    fn = lambda: dst.copy_(src)  # noqa: E731
    for _ in range(max(1, args.warmup)):
        fn()
    timer.sync()
    stats = summary([timer.per_step_ms(fn, args.steps) for _ in range(args.repeats)])
    nbytes = BYTES_PER_PARAM["copy"] * n
    return {"numel": n, "bytes": nbytes, **stats, "gbps": nbytes / (stats["median_ms"] * 1e-3) / 1e9}


def evaluate_targets(results: Dict, copy: Dict, device: torch.device, large_full_size: bool) -> List[Dict]:
    targets: List[Dict] = []

    def ratio(layout: str, variant: str) -> Optional[float]:
        e = results[layout]["variants"].get(variant, {})
        return e.get("ratio") if e.get("status") == "ok" else None

    def add(name: str, layout: Optional[str], value: Optional[float], threshold: float, unit: str, note: str = ""):
        met = None if value is None else bool(value >= threshold)
        targets.append({"name": name, "layout": layout, "value": value, "threshold": threshold, "unit": unit,
                        "met": met, "note": note})

    layouts = list(results)
    if device.type == "cpu":
        for lay in layouts:
            ref = results[lay]["variants"]["fusetrain"].get("reference")
            note = "" if ref == "torch_fused" else f"torch fused AdamW n/a on this device; reference: {ref}"
            add("plain step vs torch fused AdamW (torch_fused / fusetrain)", lay, ratio(lay, "fusetrain"),
                CPU_TARGETS["plain"], "x", note)
        for lay in layouts:
            add("full step vs torch sequence (torch_sequence / fusetrain_full)", lay,
                ratio(lay, "fusetrain_full"), CPU_TARGETS["full"], "x")
    else:
        for lay in layouts:
            add("full step vs torch sequence (torch_sequence / fusetrain_full)", lay,
                ratio(lay, "fusetrain_full"), GPU_TARGETS["full"], "x")
        if "large" in results:
            e = results["large"]["variants"]["fusetrain"]
            pct = 100.0 * e["gbps"] / copy["gbps"] if e.get("status") == "ok" and copy else None
            note = "" if large_full_size else "large layout is scaled below 100M params"
            add("update pass bandwidth as % of device copy bandwidth", "large", pct,
                GPU_TARGETS["update_pass_pct_of_copy"], "%", note)
    return targets


def print_table(results: Dict, copy: Dict, targets: List[Dict], meta: Dict) -> None:
    print(device_line(meta, cpu_capability=True))
    print(f"threads {meta['num_threads']}, {meta['config']['steps']} steps x {meta['config']['repeats']} repeats "
          f"after {meta['config']['warmup']} warm-up steps; times are per step")
    hdr = f"{'layout':<9} {'variant':<15} {'params':>9} {'median ms':>10} {'min ms':>9} {'B/param':>7} " \
          f"{'GB/s':>7} {'ratio':>6} {'(min)':>6}  reference"
    print_header_row(hdr)
    for lay, res in results.items():
        for name, e in res["variants"].items():
            params = f"{res['num_params'] / 1e6:.2f}M"
            if e["status"] != "ok":
                print(f"{lay:<9} {name:<15} {params:>9} {'n/a':>10} {'':>9} {e['bytes_per_param']:>7} "
                      f"{'':>7} {'':>6} {'':>6}  ({e['error']})")
                continue
            r = f"{e['ratio']:.2f}" if e["ratio"] is not None else "-"
            rm = f"{e['ratio_of_min']:.2f}" if e["ratio_of_min"] is not None else "-"
            print(f"{lay:<9} {name:<15} {params:>9} {e['median_ms']:>10.3f} {e['min_ms']:>9.3f} "
                  f"{e['bytes_per_param']:>7} {e['gbps']:>7.1f} {r:>6} {rm:>6}  {e['reference'] or '-'}")
    if copy:
        print(f"{'copy':<9} {'dst.copy_(src)':<15} {copy['numel'] / 1e6:>8.2f}M {copy['median_ms']:>10.3f} "
              f"{copy['min_ms']:>9.3f} {BYTES_PER_PARAM['copy']:>7} {copy['gbps']:>7.1f}")
    for lay, res in results.items():
        agr = ", ".join(f"{k}={v:.1e}" for k, v in res["agreement_after_warmup"].items())
        print(f"agreement after warm-up [{lay}] (max rel diff): {agr}")
    print()
    for t in targets:
        val = "n/a" if t["value"] is None else (f"{t['value']:.2f}x" if t["unit"] == "x" else f"{t['value']:.1f}%")
        thr = f"{t['threshold']:.2f}x" if t["unit"] == "x" else f"{t['threshold']:.0f}%"
        print_target(meta["device_kind"], t["layout"], t["name"], val, ">=", thr, verdict(t["met"]), t["note"])


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = make_parser(__doc__)
    ap.add_argument("--repeats", type=int, default=None, help="timed repeats per variant (default cpu 7, cuda 10)")
    ap.add_argument("--steps", type=int, default=None, help="steps per timed repeat (default cpu 4, cuda 20)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps first (default cpu 2, cuda 5)")
    ap.add_argument("--scale", type=float, default=1.0,
                    help="shrink every layout: params are multiplied by about this factor (default 1.0)")
    ap.add_argument("--large-mparams", type=float, default=None,
                    help="params of the 'large' layout in millions before --scale (default cuda 100, cpu 25)")
    ap.add_argument("--layouts", default="resnet50,large", help="comma-separated subset of: resnet50,large")
    args, device = parse(ap, argv, "optim_step", "tiny sizes and few steps: a smoke run of a few seconds")
    on_gpu = device.type == "cuda"
    if args.quick:
        args.scale = min(args.scale, 0.002)
        args.large_mparams = args.large_mparams or 20.0
        fill_defaults(args, {"repeats": 2, "steps": 2, "warmup": 1})
    fill_defaults(args, {"repeats": 10, "steps": 20, "warmup": 5} if on_gpu else
                  {"repeats": 7, "steps": 4, "warmup": 2})
    if args.large_mparams is None:
        args.large_mparams = 100.0 if on_gpu else 25.0
    if args.repeats < 1 or args.steps < 1 or args.warmup < 0 or args.scale <= 0:
        ap.error("--repeats and --steps must be >= 1, --warmup >= 0, --scale > 0")

    all_layouts = {
        "resnet50": resnet50_shapes(width=math.sqrt(args.scale)),
        "large": large_shapes(args.large_mparams * 1e6 * args.scale),
    }
    wanted = choose(ap, "--layouts", args.layouts, list(all_layouts), "layout")
    layouts = {k: all_layouts[k] for k in wanted}

    report_path = out_path(args, "optim_step", device.type)
    timer = Timer(device)
    meta = {
        **run_header("optim_step", device),
        "config": {
            "quick": bool(args.quick), "steps": args.steps, "repeats": args.repeats, "warmup": args.warmup,
            "scale": args.scale, "large_mparams": args.large_mparams, "dtype": "float32", "lr": LR,
            "betas": list(BETAS), "eps": EPS, "weight_decay": WEIGHT_DECAY, "max_grad_norm": MAX_GRAD_NORM,
            "ema_decay": EMA_DECAY, "loss_scale": LOSS_SCALE, "timer": "cuda.Event" if on_gpu else "perf_counter",
            "statistic": "median over repeats of per-step time",
        },
        "bytes_per_param": BYTES_PER_PARAM,
        "layouts": {k: {"num_tensors": len(v), "num_params": numel(v), "shapes": [list(s) for s in v]}
                    for k, v in layouts.items()},
    }

    t_start = time.perf_counter()
    results = {}
    for lay, shapes in layouts.items():
        print(f"[optim_step] {lay}: {len(shapes)} tensors, {numel(shapes) / 1e6:.2f}M params ...",
              file=sys.stderr, flush=True)
        results[lay] = run_layout(shapes, device, args, timer)
        if on_gpu:
            torch.cuda.empty_cache()
    copy_n = numel(all_layouts["large"])
    print(f"[optim_step] copy bandwidth: {copy_n / 1e6:.2f}M floats ...", file=sys.stderr, flush=True)
    copy = copy_bandwidth(copy_n, device, args, timer)

    large_full = args.large_mparams * args.scale >= 100.0 - 1e-9
    targets = evaluate_targets(results, copy, device, large_full)
    update_pass = None
    if "large" in results and results["large"]["variants"]["fusetrain"].get("status") == "ok":
        g = results["large"]["variants"]["fusetrain"]["gbps"]
        update_pass = {"gbps": g, "copy_gbps": copy["gbps"], "pct_of_copy": 100.0 * g / copy["gbps"]}
    report = dict(meta, results=results, copy_bandwidth=copy, update_pass_vs_copy=update_pass, targets=targets,
                  all_targets_met=all(t["met"] is True for t in targets),
                  elapsed_s=time.perf_counter() - t_start)

    print_table(results, copy, targets, meta)
    if update_pass is not None:
        print(f"update pass (plain fusetrain step, large): {update_pass['gbps']:.1f} GB/s = "
              f"{update_pass['pct_of_copy']:.1f}% of copy bandwidth ({copy['gbps']:.1f} GB/s)"
              + ("" if on_gpu else "; information only on CPU"))
    write_report(report, report_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
