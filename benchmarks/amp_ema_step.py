#!/usr/bin/env python3
"""How fast is a mixed-precision training step with EMA in fusetrain compared with torch?

One run measures, on real models and the same device, the time of a whole
training step (zero_grad + autocast forward + loss + scaled backward + tail),
and of its tail alone (everything after ``backward``), for three variants:

  (a) torch  -- the usual recipe, with the fastest torch pieces:
          scaler = torch.amp.GradScaler(device)
          opt = torch.optim.AdamW(params, fused=True)
          scaler.scale(loss).backward()
          scaler.unscale_(opt)
          torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
          scaler.step(opt); scaler.update()          # found_inf handed to the fused kernel, no host sync
          torch._foreach_lerp_(ema_params, params, 1 - decay)     # timm-style EMA (ModelEmaV3, foreach)
          torch._foreach_copy_(ema_buffers, buffers)               # buffers copied, not averaged
  (b) fusetrain -- the same work:
          scaler = fusetrain.LossScaler()
          opt = fusetrain.optim.AdamW(params, max_grad_norm=1.0)
          ema = fusetrain.ModelEMA(model, decay, decay_type="constant", include_buffers=False).attach(opt)
          scaler.scale(loss).backward()
          scaler.step(opt); scaler.update()          # grad_stats pass + one update pass writing the EMA;
                                                     # buffers copied by the EMA's post-step hook
  (c) fusetrain without EMA: (b) with no ModelEMA attached.

Reported per model:
  full-step ratio = step(a) / step(b)   (> 1: fusetrain's step is faster)
  tail ratio      = tail(a) / tail(b)   (on CPU the forward/backward dominates the step,
                                         so the tail ratio shows the part fusetrain changes)
  EMA overhead    = step(b) / step(c) - 1, plus the tail-based estimate
                    (tail(b) - tail(c)) / step(c), which is less noisy on a busy CPU.

Models
------
mnist_cnn: the MNIST network of the mixed-precision notebook this project
    started from, ``fusetrain.models.build_model("seed_mnist")``
    (``--quick`` divides its widths by 8): 14 blocks of Conv2d + BatchNorm2d
    + ReLU (channels 1 -> 32 -> 64 -> ... -> 1024, three stride-2 2x2 convs
    and one 2x2 stride-1 conv shrinking 28x28 to 3x3), AdaptiveAvgPool2d(1), then
    Linear(1024, 1000) + ReLU + Linear(1000, 1000) + ReLU + Linear(1000, 10).
    14.7M params in 62 tensors; 42 buffers (BatchNorm running mean and var, and
    14 int64 batch counters, which are copied rather than averaged).
    Input: random 1x28x28 images, random labels of 10 classes, cross-entropy.
    Batch 256 on GPU, 32 on CPU.
transformer: a stack of nn.TransformerEncoderLayer(d_model, nhead,
    dim_feedforward=4*d_model, batch_first=True) (dropout 0.1 as torch's
    default), mean over the sequence, Linear(d_model, 10). Input: random
    [batch, seq, d_model] embeddings, random labels. GPU: 4 layers,
    d_model 512, 8 heads, seq 128, batch 64 (12.6M params). CPU: the same
    layers (the tail's cost depends on the params, not the batch) with seq 64,
    batch 8 so that the CPU run stays short. No buffers.

Autocast: fp16 on GPU (the loss scaler matters there). On CPU fp16 autocast is
slow or unsupported for some ops, so both sides use bf16 autocast and keep the
loss scaler (a bf16 run needs none, but then neither side does the scaling work
this benchmark is about). Params, gradients, optimizer state and the EMA are
fp32 in every variant.

Timing
------
Every variant owns a copy of the same initial model and its own optimizer,
scaler and EMA; all see the same fixed input batch. After ``--warmup`` steps
(which create the optimizer state and let cudnn pick its algorithms), each
repeat runs ``--steps`` consecutive steps of every variant; the variants are
interleaved and their order rotates from repeat to repeat, so load changes on
a shared machine hit them alike. Within a step, markers are taken at the start,
after ``backward`` and at the end: CUDA events on GPU (no host sync inside the
repeat), time.perf_counter() on CPU. Per repeat: step time = (end of the last
step - start of the first) / steps, tail time = mean of (end - after backward).
The statistic is the median over repeats (the minimum is recorded too).

Usage:
    python benchmarks/amp_ema_step.py [--device cpu|cuda] [--models mnist_cnn,transformer]
        [--repeats N] [--steps N] [--warmup N] [--mnist-batch B] [--tf-batch B] [--tf-seq S]
        [--tf-layers L] [--tf-d-model D] [--tf-heads H] [--autocast fp16|bf16] [--quick] [--out PATH]
Defaults: GPU 30 repeats x 10 steps after 10 warm-up steps; CPU 8 x 1 after 2.
The table goes to stdout; the JSON to benchmarks/results/amp_ema_step_<cpu|cuda>.json (or --out).
"""

from __future__ import annotations

import copy
import math
import os
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from torch import nn

import fusetrain
import fusetrain.optim
from fusetrain.models import SEED_MNIST_CFG as MNIST_CFG
from fusetrain.models import build_model as build_registered_model

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:  # loaded by file path rather than run as a script
    sys.path.insert(0, _HERE)
from _common import (Timer, choose, device_line, fill_defaults, make_parser, parse, out_path,  # noqa: E402
                     print_header_row, print_target, rotated, run_header, summary, verdict, write_report)

LR = 1e-4
BETAS = (0.9, 0.999)
EPS = 1e-8
WEIGHT_DECAY = 1e-2
MAX_GRAD_NORM = 1.0
EMA_DECAY = 0.9998
INIT_SCALE = 2.0**16
GROWTH_INTERVAL = 2000  # torch's and fusetrain's default
NUM_CLASSES = 10

# Target thresholds
STEP_RATIO_TARGET = 1.0  # (a)/(b) must be above this (fusetrain faster)
EMA_OVERHEAD_TARGET_PCT = 3.0  # (b)/(c) - 1 at most this, in % (a GPU target; CPU figure reported)

VARIANTS = ("torch", "fusetrain", "fusetrain_no_ema")
VARIANT_LABELS = {
    "torch": "(a) GradScaler + AdamW(fused) + unscale_ + clip_grad_norm_ + foreach EMA",
    "fusetrain": "(b) LossScaler + fusetrain AdamW(max_grad_norm) + ModelEMA attached",
    "fusetrain_no_ema": "(c) LossScaler + fusetrain AdamW(max_grad_norm), no EMA",
}


# ---------------------------------------------------------------- models

QUICK_WIDTH_DIVISOR = 8


def narrowed(model: nn.Module, divisor: int) -> nn.Module:
    """``model`` with every Conv2d, BatchNorm2d and Linear layer made anew with
    its channel and feature counts divided by ``divisor`` (at least 1), except
    the model's input channels and its outputs (the last Linear's)."""
    layers = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
              if isinstance(child, (nn.Conv2d, nn.BatchNorm2d, nn.Linear))]
    last_linear = max(i for i, (_, _, m) in enumerate(layers) if isinstance(m, nn.Linear))

    def w(n: int) -> int:
        return max(1, n // divisor)

    for i, (parent, name, m) in enumerate(layers):
        if isinstance(m, nn.Conv2d):
            new: nn.Module = nn.Conv2d(m.in_channels if i == 0 else w(m.in_channels), w(m.out_channels),
                                       m.kernel_size, stride=m.stride, padding=m.padding, bias=m.bias is not None)
        elif isinstance(m, nn.BatchNorm2d):
            new = nn.BatchNorm2d(w(m.num_features))
        else:
            new = nn.Linear(w(m.in_features), m.out_features if i == last_linear else w(m.out_features),
                            bias=m.bias is not None)
        setattr(parent, name, new)
    return model


def mnist_cnn(quick: bool = False) -> nn.Module:
    """The seed MNIST network (``build_model("seed_mnist")``); with ``quick``,
    the same 14 blocks and 3 Linear layers at an eighth of the widths."""
    model = build_registered_model("seed_mnist", num_classes=NUM_CLASSES)
    return narrowed(model, QUICK_WIDTH_DIVISOR) if quick else model


class TransformerStack(nn.Module):
    """``layers`` batch-first TransformerEncoderLayers, mean over the sequence, a Linear head."""

    def __init__(self, d_model: int, nhead: int, layers: int, num_classes: int = NUM_CLASSES):
        super().__init__()
        self.layers = nn.Sequential(*[
            nn.TransformerEncoderLayer(d_model, nhead, dim_feedforward=4 * d_model, batch_first=True)
            for _ in range(layers)
        ])
        self.head = nn.Linear(d_model, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(x).mean(dim=1))


def build_model(name: str, args) -> nn.Module:
    if name == "mnist_cnn":
        return mnist_cnn(args.quick)
    return TransformerStack(args.tf_d_model, args.tf_heads, args.tf_layers)


def model_sizes(name: str, args) -> Dict[str, Any]:
    if name == "mnist_cnn":
        return {"batch": args.mnist_batch, "image": [1, 28, 28], "classes": NUM_CLASSES,
                "conv_blocks": len(MNIST_CFG), "linear_layers": 3,
                "width_divisor": QUICK_WIDTH_DIVISOR if args.quick else 1}
    return {"batch": args.tf_batch, "seq": args.tf_seq, "d_model": args.tf_d_model, "nhead": args.tf_heads,
            "layers": args.tf_layers, "dim_feedforward": 4 * args.tf_d_model, "classes": NUM_CLASSES}


def make_batch(name: str, args, device: torch.device):
    gen = torch.Generator(device="cpu")
    gen.manual_seed(4321)
    if name == "mnist_cnn":
        x = torch.rand(args.mnist_batch, 1, 28, 28, generator=gen)
        y = torch.randint(0, NUM_CLASSES, (args.mnist_batch,), generator=gen)
    else:
        x = torch.randn(args.tf_batch, args.tf_seq, args.tf_d_model, generator=gen)
        y = torch.randint(0, NUM_CLASSES, (args.tf_batch,), generator=gen)
    return x.to(device), y.to(device)


# ---------------------------------------------------------------- variants

class Variant:
    def __init__(self, name: str, model: nn.Module):
        self.name = name
        self.model = model
        self.fwd_bwd: Optional[Callable[[], None]] = None
        self.tail: Optional[Callable[[], None]] = None
        self.last_loss: Optional[torch.Tensor] = None
        self.ema_params: List[torch.Tensor] = []
        self.ema: Optional[fusetrain.ModelEMA] = None  # kept alive with its hooks
        self.scaler: Any = None
        self.step_ms: List[float] = []
        self.tail_ms: List[float] = []


def build_variants(base: nn.Module, x: torch.Tensor, y: torch.Tensor, device: torch.device,
                   amp_dtype: torch.dtype) -> List[Variant]:
    criterion = nn.CrossEntropyLoss()
    variants = []

    def make_fwd_bwd(v: Variant, opt, scaler):
        model = v.model

        def fwd_bwd():
            opt.zero_grad(set_to_none=True)
            with torch.autocast(device_type=device.type, dtype=amp_dtype):
                loss = criterion(model(x), y)
            scaler.scale(loss).backward()
            v.last_loss = loss.detach()

        return fwd_bwd

    # (a) torch
    v = Variant("torch", copy.deepcopy(base))
    params = [p for p in v.model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, fused=True)
    scaler = torch.amp.GradScaler(device.type, init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
    ema_model = copy.deepcopy(v.model).eval()
    for p in ema_model.parameters():
        p.requires_grad_(False)
    ema_p = list(ema_model.parameters())
    src_p = [p.detach() for p in v.model.parameters()]
    ema_b = list(ema_model.buffers())
    src_b = [b.detach() for b in v.model.buffers()]
    weight = 1.0 - EMA_DECAY

    def torch_tail(opt=opt, scaler=scaler, params=params):
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM, foreach=True)
        scaler.step(opt)
        scaler.update()
        with torch.no_grad():
            torch._foreach_lerp_(ema_p, src_p, weight)
            if ema_b:
                torch._foreach_copy_(ema_b, src_b)

    v.fwd_bwd = make_fwd_bwd(v, opt, scaler)
    v.tail = torch_tail
    v.ema_params = ema_p
    v.scaler = scaler
    variants.append(v)

    # (b) fusetrain with ModelEMA attached, (c) without
    for name, with_ema in (("fusetrain", True), ("fusetrain_no_ema", False)):
        v = Variant(name, copy.deepcopy(base))
        opt = fusetrain.optim.AdamW(v.model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                                    max_grad_norm=MAX_GRAD_NORM)
        scaler = fusetrain.LossScaler(init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
        if with_ema:
            ema = fusetrain.ModelEMA(v.model, decay=EMA_DECAY, decay_type="constant", include_buffers=False)
            ema.attach(opt)
            v.ema_params = list(ema.module.parameters())
            v.ema = ema

        def fusetrain_tail(opt=opt, scaler=scaler):
            scaler.step(opt)
            scaler.update()

        v.fwd_bwd = make_fwd_bwd(v, opt, scaler)
        v.tail = fusetrain_tail
        v.scaler = scaler
        variants.append(v)
    return variants


def run_repeat(v: Variant, steps: int, timer: Timer) -> None:
    marks = []
    for _ in range(steps):
        m0 = timer.mark()
        v.fwd_bwd()
        m1 = timer.mark()
        v.tail()
        m2 = timer.mark()
        marks.append((m0, m1, m2))
    timer.sync()
    v.step_ms.append(timer.ms(marks[0][0], marks[-1][2]) / steps)
    v.tail_ms.append(sum(timer.ms(m1, m2) for _, m1, m2 in marks) / steps)


def run_model(name: str, args, device: torch.device, amp_dtype: torch.dtype, timer: Timer) -> Dict[str, Any]:
    torch.manual_seed(1234)
    base = build_model(name, args).to(device)
    init_params = [p.detach().clone() for p in base.parameters()]
    x, y = make_batch(name, args, device)
    variants = build_variants(base, x, y, device, amp_dtype)
    info = {
        "sizes": model_sizes(name, args),
        "num_params": sum(p.numel() for p in base.parameters()),
        "num_param_tensors": len(list(base.parameters())),
        "num_buffers": len(list(base.buffers())),
    }
    del base

    # Warm-up. Each variant starts from the same RNG state (dropout masks) so
    # their losses after the warm-up can be compared: (b) and (c) train the
    # same model and must agree; (a) differs from them by rounding only.
    loss_first, loss_warm = {}, {}
    for v in variants:
        torch.manual_seed(99)
        v.model.train()
        for i in range(max(1, args.warmup)):
            v.fwd_bwd()
            if i == 0:
                loss_first[v.name] = float(v.last_loss)
            v.tail()
        loss_warm[v.name] = float(v.last_loss)
    timer.sync()

    for r in range(args.repeats):
        for v in rotated(variants, r):
            run_repeat(v, args.steps, timer)
    timer.sync()

    res: Dict[str, Any] = dict(info, variants={})
    total_steps = max(1, args.warmup) + args.repeats * args.steps
    for v in variants:
        step, tail = summary(v.step_ms), summary(v.tail_ms)
        scale = v.scaler.get_scale()  # a host sync, after the timing
        ema_moved = None
        if v.ema_params:
            ema_moved = max(float((e - p0).abs().max()) for e, p0 in zip(v.ema_params, init_params))
        res["variants"][v.name] = {
            "label": VARIANT_LABELS[v.name],
            "step": step,
            "tail": tail,
            "tail_pct_of_step": 100.0 * tail["median_ms"] / step["median_ms"],
            "loss_first_step": loss_first[v.name],
            "loss_after_warmup": loss_warm[v.name],
            "final_loss_scale": scale,
            # Fewer steps than the growth interval: the scale only halves, once per skipped step.
            "skipped_steps": round(math.log2(INIT_SCALE / scale)) if total_steps < GROWTH_INTERVAL else None,
            "ema_max_abs_change": ema_moved,
        }
    med = {n: res["variants"][n]["step"]["median_ms"] for n in VARIANTS}
    tmed = {n: res["variants"][n]["tail"]["median_ms"] for n in VARIANTS}
    mins = {n: res["variants"][n]["step"]["min_ms"] for n in VARIANTS}
    tmins = {n: res["variants"][n]["tail"]["min_ms"] for n in VARIANTS}
    res["ratios"] = {
        "step_torch_over_fusetrain": med["torch"] / med["fusetrain"],
        "tail_torch_over_fusetrain": tmed["torch"] / tmed["fusetrain"],
        "ema_overhead_pct": 100.0 * (med["fusetrain"] / med["fusetrain_no_ema"] - 1.0),
        "ema_overhead_tail_based_pct": 100.0 * (tmed["fusetrain"] - tmed["fusetrain_no_ema"]) / med["fusetrain_no_ema"],
        # The same from the fastest repeats: on a shared machine the least disturbed figures (information only).
        "min_based": {
            "step_torch_over_fusetrain": mins["torch"] / mins["fusetrain"],
            "tail_torch_over_fusetrain": tmins["torch"] / tmins["fusetrain"],
            "ema_overhead_pct": 100.0 * (mins["fusetrain"] / mins["fusetrain_no_ema"] - 1.0),
            "ema_overhead_tail_based_pct": 100.0 * (tmins["fusetrain"] - tmins["fusetrain_no_ema"])
            / mins["fusetrain_no_ema"],
        },
    }
    del variants
    return res


# ---------------------------------------------------------------- report

def evaluate_targets(results: Dict[str, Any], on_gpu: bool) -> List[Dict[str, Any]]:
    targets = []

    def add(name, model, value, threshold, op, unit, applies=True, note=""):
        met = value > threshold if op == ">" else value <= threshold
        targets.append({"name": name, "model": model, "value": value, "threshold": threshold, "op": op,
                        "unit": unit, "met": bool(met), "applies": applies, "note": note})

    for model, res in results.items():
        r = res["ratios"]
        add("full step: fusetrain faster than torch (step(a) / step(b))", model,
            r["step_torch_over_fusetrain"], STEP_RATIO_TARGET, ">", "x")
        add("tail: fusetrain faster than torch (tail(a) / tail(b))", model,
            r["tail_torch_over_fusetrain"], STEP_RATIO_TARGET, ">", "x")
        add("EMA overhead (step(b) / step(c) - 1)", model, r["ema_overhead_pct"], EMA_OVERHEAD_TARGET_PCT, "<=",
            "%", applies=on_gpu, note="" if on_gpu else "GPU target; CPU figure for information")
    return targets


def print_table(results: Dict[str, Any], targets: List[Dict[str, Any]], meta: Dict[str, Any]) -> None:
    cfg = meta["config"]
    print(device_line(meta))
    print(f"threads {meta['num_threads']}, autocast {cfg['autocast_dtype']}, {cfg['steps']} steps x "
          f"{cfg['repeats']} repeats after {cfg['warmup']} warm-up steps; times per step, median (min) over repeats")
    for name, label in VARIANT_LABELS.items():
        print(f"  {name:<17} {label}")
    hdr = (f"{'model':<12} {'variant':<17} {'params':>7} {'step ms':>10} {'(min)':>9} {'tail ms':>9} "
           f"{'(min)':>8} {'tail %':>7} {'loss@warm':>10} {'skipped':>7}")
    print_header_row(hdr)
    for model, res in results.items():
        for name, e in res["variants"].items():
            print(f"{model:<12} {name:<17} {res['num_params'] / 1e6:>6.2f}M {e['step']['median_ms']:>10.2f} "
                  f"{e['step']['min_ms']:>9.2f} {e['tail']['median_ms']:>9.2f} {e['tail']['min_ms']:>8.2f} "
                  f"{e['tail_pct_of_step']:>6.1f}% {e['loss_after_warmup']:>10.4f} "
                  f"{'-' if e['skipped_steps'] is None else e['skipped_steps']:>7}")
    print()
    hdr = (f"{'model':<12} {'from':<6} {'step (a)/(b)':>13} {'tail (a)/(b)':>13} {'EMA ovh (b)/(c)-1':>18} "
           f"{'EMA ovh tail-based':>19}")
    print_header_row(hdr)
    for model, res in results.items():
        for tag, r in (("median", res["ratios"]), ("min", res["ratios"]["min_based"])):
            print(f"{model:<12} {tag:<6} {r['step_torch_over_fusetrain']:>12.3f}x "
                  f"{r['tail_torch_over_fusetrain']:>12.3f}x {r['ema_overhead_pct']:>+17.2f}% "
                  f"{r['ema_overhead_tail_based_pct']:>+18.2f}%")
    print()
    for t in targets:
        val = f"{t['value']:.3f}x" if t["unit"] == "x" else f"{t['value']:+.2f}%"
        thr = f"{t['threshold']:.2f}x" if t["unit"] == "x" else f"{t['threshold']:.0f}%"
        print_target(meta["device_kind"], t["model"], t["name"], val, t["op"], thr, verdict(t["met"], t["applies"]),
                     t["note"])


# ---------------------------------------------------------------- main

def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = make_parser(__doc__)
    ap.add_argument("--models", default="mnist_cnn,transformer",
                    help="comma-separated subset of: mnist_cnn,transformer")
    ap.add_argument("--repeats", type=int, default=None, help="timed repeats per variant (default cuda 30, cpu 8)")
    ap.add_argument("--steps", type=int, default=None, help="steps per timed repeat (default cuda 10, cpu 1)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps first (default cuda 10, cpu 2)")
    ap.add_argument("--mnist-batch", type=int, default=None, help="mnist_cnn batch (default cuda 256, cpu 32)")
    ap.add_argument("--tf-batch", type=int, default=None, help="transformer batch (default cuda 64, cpu 8)")
    ap.add_argument("--tf-seq", type=int, default=None, help="transformer sequence length (default cuda 128, cpu 64)")
    ap.add_argument("--tf-layers", type=int, default=None, help="transformer layers (default 4)")
    ap.add_argument("--tf-d-model", type=int, default=None, help="transformer d_model (default 512)")
    ap.add_argument("--tf-heads", type=int, default=None, help="transformer heads (default 8)")
    ap.add_argument("--autocast", choices=("fp16", "bf16"), default=None,
                    help="autocast dtype for every variant (default cuda fp16, cpu bf16)")
    args, device = parse(ap, argv, "amp_ema_step", "tiny sizes and few steps: a smoke run of a few seconds")
    on_gpu = device.type == "cuda"
    if args.quick:
        fill_defaults(args, {"repeats": 2, "steps": 1, "warmup": 1, "mnist_batch": 2, "tf_batch": 2, "tf_seq": 8,
                             "tf_layers": 2, "tf_d_model": 32, "tf_heads": 4})
    defaults = ({"repeats": 30, "steps": 10, "warmup": 10, "mnist_batch": 256, "tf_batch": 64, "tf_seq": 128}
                if on_gpu else
                {"repeats": 8, "steps": 1, "warmup": 2, "mnist_batch": 32, "tf_batch": 8, "tf_seq": 64})
    defaults.update({"tf_layers": 4, "tf_d_model": 512, "tf_heads": 8,
                     "autocast": "fp16" if on_gpu else "bf16"})
    fill_defaults(args, defaults)
    if args.repeats < 1 or args.steps < 1 or args.warmup < 0:
        ap.error("--repeats and --steps must be >= 1, --warmup >= 0")
    for k in ("mnist_batch", "tf_batch", "tf_seq", "tf_layers", "tf_d_model", "tf_heads"):
        if getattr(args, k) < 1:
            ap.error(f"--{k.replace('_', '-')} must be >= 1")
    if args.tf_d_model % args.tf_heads:
        ap.error("--tf-d-model must be divisible by --tf-heads")
    models = choose(ap, "--models", args.models, ["mnist_cnn", "transformer"], "model")
    amp_dtype = torch.float16 if args.autocast == "fp16" else torch.bfloat16
    if on_gpu:
        torch.backends.cudnn.benchmark = True

    report_path = out_path(args, "amp_ema_step", device.type)
    timer = Timer(device)
    meta = {
        **run_header("amp_ema_step", device),
        "config": {
            "quick": bool(args.quick), "models": models, "warmup": args.warmup, "repeats": args.repeats,
            "steps": args.steps, "autocast_dtype": args.autocast, "param_dtype": "float32", "lr": LR,
            "betas": list(BETAS), "eps": EPS, "weight_decay": WEIGHT_DECAY, "max_grad_norm": MAX_GRAD_NORM,
            "ema_decay": EMA_DECAY, "ema_buffers": "copied", "init_loss_scale": INIT_SCALE,
            "growth_interval": GROWTH_INTERVAL,
            "cudnn_benchmark": on_gpu, "timer": "cuda.Event" if on_gpu else "perf_counter",
            "statistic": "median over repeats of the per-step time (step: zero_grad..tail end; tail: after "
                         "backward..tail end)",
        },
        "variants": VARIANT_LABELS,
    }

    t_start = time.perf_counter()
    results: Dict[str, Any] = {}
    for name in models:
        print(f"[amp_ema_step] {name}: {model_sizes(name, args)} ...", file=sys.stderr, flush=True)
        results[name] = run_model(name, args, device, amp_dtype, timer)
        if on_gpu:
            torch.cuda.empty_cache()

    targets = evaluate_targets(results, on_gpu)
    report = dict(meta, models={m: {"sizes": r["sizes"], "num_params": r["num_params"]} for m, r in results.items()},
                  results=results, targets=targets,
                  all_targets_met=all(t["met"] for t in targets if t["applies"]),
                  elapsed_s=time.perf_counter() - t_start)
    print_table(results, targets, meta)
    write_report(report, report_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
