#!/usr/bin/env python3
"""The torch.compile table of the seed recipes, reproduced on models of the package, with fusetrain's step modes beside it.

The seed reports, per segmentation recipe, the time per epoch of an eager AMP
training loop, the same with ``torch.compile`` of the model, and the
improvement (baseline - compiled) / baseline (single GPU: PP-LiteSeg 56%,
STDC-Seg 63.9%, DDRNet 23.1%, ...; 8x RTX 3090, PyTorch 2.0, AMP on, EMA
and SyncBN off). This script measures the same columns on three models of
``fusetrain.models`` at reduced width and resolution, and adds
fusetrain's training step (``fusetrain.training.step.train_step.TrainStep``) in its
modes, each compared with the same baseline:

  baseline            eager AMP loop: autocast forward + loss, torch.amp.GradScaler, torch.optim.SGD
                      (momentum 0.9, weight decay 5e-4), the loss summed on the device
  torch_compile       the seed's way: torch.compile(model), the same eager AMP loop
  torch_compile_reduce_overhead  torch.compile(model, mode="reduce-overhead") (CUDA graphs of the
                      compiled forward and backward; GPU and the inductor backend only)
  fusetrain_eager     TrainStep(mode="off"): fused tail (fusetrain SGD + LossScaler), eager forward/backward
  fusetrain_compile   TrainStep(mode="compile"): the whole step compiled
  fusetrain_cuda_graph  TrainStep(mode="cuda_graph"): the whole step captured as a CUDA graph (GPU only)

Models (``build_model``): ``pplite_seg`` (STDC backbone, SPPM, UAFM decoder),
``ddrnet`` (two-resolution branches, bilateral fusion, DAPPM-lite) and
``yolo_csp`` (CSP backbone, PAN neck, dense anchor-free head, trained with
``DenseDetectionLoss``). Two presets of sizes (``--preset``; a size given
on the command line wins):

  reduced (default)   GPU: 256x512 images, width 16, batch 8, 160 images an epoch; CPU: 64x128,
                      width 8, batch 4, 8 images
  seed                the seed's scale: 512x1024 images (a Cityscapes crop), batch 8 (the seed's
                      per-GPU batch), the full models' width 64 (pplite_seg: STDC1's 256/512/1024
                      channels, PP-LiteSeg-T; ddrnet: DDRNet-23's 64/128 branches), 160 images an epoch

At the seed preset the models have the full ones' sizes (pplite_seg 8.1M params, ddrnet 22.1M) and a
training step is 0.92 and 1.84 TFLOP (forward and backward, torch's flop counter), 61x and 63x the reduced
preset's GPU step; on an H200 an epoch is about a second, and the compiled columns' first epochs
(tens of seconds each) dominate a model's run.

AMP is fp16 on GPU (as the seed), bf16 on CPU (the GradScaler is kept in the
baseline loops, as they are written for fp16).

Per model and column: median time per epoch (the first epoch, with
compilation or capture, is a warm-up and not counted) and the improvement
over the baseline in %, computed as the seed does. Target: fusetrain's best
mode improves at least as much as the better torch.compile column, on every
row. The first epoch's time beyond a steady epoch (compilation, capture,
autotuning) is reported apart, per cell.
The seed's own single-GPU improvements are printed beside (its models are
full size, on Cityscapes 1024x2048 crops, so only the direction compares).

Usage:
    python benchmarks/seed_compile_table.py [--device cpu|cuda] [--models a,b] [--height H] [--width W]
        [--channels C] [--batch B] [--images N] [--epochs E] [--preset reduced|seed] [--compile-backend NAME]
        [--quick] [--out PATH]
Writes benchmarks/results/seed_compile_table_<cpu|cuda>.json and a .png chart beside it.
"""

from __future__ import annotations

import copy
import os
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

import torch
from torch import nn

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
from _common import (choose, device_line, fill_defaults, make_parser, out_path, parse,  # noqa: E402
                     print_header_row, print_target, run_header, verdict, write_partial_report)
from _steps import (DeviceBatches, EpochClock, RowUnavailable, bar_chart, make_fusetrain_step,  # noqa: E402
                    median, png_path_for, sync)

BENCH = "seed_compile_table"
MODELS = ("pplite_seg", "ddrnet", "yolo_csp")
COLUMNS = ("baseline", "torch_compile", "torch_compile_reduce_overhead", "fusetrain_eager", "fusetrain_compile",
           "fusetrain_cuda_graph")
TORCH_COMPILE_COLUMNS = COLUMNS[1:3]
FUSETRAIN_COLUMNS = COLUMNS[3:]
#: The sizes of each preset per device kind (``--preset``); --quick and explicit sizes override them.
PRESETS = {
    "reduced": {"cuda": {"height": 256, "width": 512, "channels": 16, "batch": 8, "images": 160, "epochs": 3},
                "cpu": {"height": 64, "width": 128, "channels": 8, "batch": 4, "images": 8, "epochs": 3}},
    "seed": {kind: {"height": 512, "width": 1024, "channels": 64, "batch": 8, "images": 160, "epochs": 3}
             for kind in ("cuda", "cpu")},
}
QUICK = {"height": 64, "width": 64, "channels": 4, "batch": 2, "images": 2, "epochs": 2, "compile_backend": "eager"}
SEG_CLASSES, DET_CLASSES = 19, 20
LR, MOMENTUM, WEIGHT_DECAY = 0.01, 0.9, 5e-4
DATA_SEED, MODEL_SEED, SHUFFLE_SEED = 1234, 0, 7

#: The seed's table: (recipe, baseline s, torch.compile s, improvement %), single GPU and DDP.
SEED_TABLE = {
    "cityscapes_pplite_seg75": {"single_gpu": (270.63, 119.11, 56.0), "ddp": (49.95, 35.91, 18.0)},
    "cityscapes_regseg48": {"single_gpu": (125.14, 108.57, 13.2), "ddp": (44.959, 44.55, 0.9)},
    "cityscapes_segformer": {"single_gpu": (199.97, 162.52, 18.7), "ddp": (46.21, 43.71, 5.4)},
    "cityscapes_stdc_seg75": {"single_gpu": (425.19, 153.16, 63.9), "ddp": (73.07, 45.89, 37.19)},
    "cityscapes_ddrnet": {"single_gpu": (226.51, 174.11, 23.1), "ddp": (51.78, 48.29, 7.3)},
}
#: Our model -> the seed recipes it stands for.
SEED_COUNTERPART = {"pplite_seg": ["cityscapes_pplite_seg75", "cityscapes_stdc_seg75"],
                    "ddrnet": ["cityscapes_ddrnet"], "yolo_csp": []}


def improvement_pct(base: Optional[float], other: Optional[float]) -> Optional[float]:
    """(base - other) / base in %, as the seed computes it."""
    if base is None or other is None or base <= 0:
        return None
    return 100.0 * (base - other) / base


# ---------------------------------------------------------------- data

def make_seg_data(n: int, h: int, w: int):
    """Images whose pixels carry their class: a random label map at 1/16
    resolution (nearest-upsampled), a fixed colour per class plus noise."""
    g = torch.Generator().manual_seed(DATA_SEED)
    coarse = torch.randint(0, SEG_CLASSES, (n, 1, max(1, h // 16), max(1, w // 16)), generator=g)
    labels = nn.functional.interpolate(coarse.float(), size=(h, w), mode="nearest").long()[:, 0]
    palette = torch.rand(SEG_CLASSES, 3, generator=g)
    img = 0.6 * palette[labels].permute(0, 3, 1, 2) + 0.4 * torch.rand(n, 3, h, w, generator=g)
    return (img * 255).round().to(torch.uint8), labels


def make_det_data(n: int, h: int, w: int, boxes_per_image: int = 4):
    """Images with ``boxes_per_image`` filled boxes of class colours on noise,
    and their dense targets (``dense_detection_targets``)."""
    from fusetrain.models import dense_detection_targets

    g = torch.Generator().manual_seed(DATA_SEED)
    palette = torch.rand(DET_CLASSES, 3, generator=g)
    img = 0.4 * torch.rand(n, 3, h, w, generator=g)
    targets = []
    for i in range(n):
        wh = torch.rand(boxes_per_image, 2, generator=g) * 0.5 + 0.1
        xy = torch.rand(boxes_per_image, 2, generator=g) * (1 - wh)
        boxes = torch.cat([xy, xy + wh], 1) * torch.tensor([w, h, w, h])
        labels = torch.randint(0, DET_CLASSES, (boxes_per_image,), generator=g)
        for b, c in zip(boxes.round().long().tolist(), labels.tolist()):
            img[i, :, b[1]:b[3], b[0]:b[2]] += 0.6 * palette[c][:, None, None]
        targets.append(dense_detection_targets(boxes, labels, h, w))
    return (img.clamp(0, 1) * 255).round().to(torch.uint8), torch.stack(targets)


def build(name: str, width: int):
    from fusetrain.models import DenseDetectionLoss, build_model

    torch.manual_seed(MODEL_SEED)
    if name == "yolo_csp":
        return build_model(name, num_classes=DET_CLASSES, width=width), DenseDetectionLoss()
    return build_model(name, num_classes=SEG_CLASSES, width=width), nn.CrossEntropyLoss(ignore_index=255)


# ---------------------------------------------------------------- loops

def baseline_loop(data, model, loss_fn, optimizer, epochs, device, clock, amp_dtype, record) -> None:
    """The eager AMP loop of the seed's trainer, without its logging: autocast
    forward and loss, GradScaler, optimizer step, zero_grad; the loss summed
    on the device, read once per epoch."""
    scaler = torch.amp.GradScaler(device.type)
    for epoch in range(epochs):
        loss_sum = torch.zeros((), device=device)
        start = clock.start()
        n = 0
        for x, y in data:
            with torch.autocast(device_type=device.type, dtype=amp_dtype):
                out = model(x)
                loss = loss_fn(out, y)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            loss_sum += loss.detach().float()
            n += 1
        record(epoch, clock.stop_s(start), loss_sum.item() / n)


def fusetrain_loop(data, step, epochs, device, clock, record) -> None:
    for epoch in range(epochs):
        loss_sum = torch.zeros((), device=device)
        start = clock.start()
        n = 0
        for x, y in data:
            _, loss = step(x, y)
            loss_sum += loss.float()
            n += 1
        record(epoch, clock.stop_s(start), loss_sum.item() / n)


def run_cell(name: str, column: str, base_model: nn.Module, loss_fn, data, cfg, device) -> Dict[str, Any]:
    """One model x column: a fresh copy of the initial weights, ``epochs`` epochs."""
    import fusetrain
    from fusetrain import resolve_precision

    if column in ("fusetrain_cuda_graph", "torch_compile_reduce_overhead") and device.type != "cuda":
        return {"unavailable": "n/a (needs a GPU)"}
    if column == "torch_compile_reduce_overhead" and cfg["compile_backend"] != "inductor":
        return {"unavailable": f"n/a (reduce-overhead is an inductor mode; backend {cfg['compile_backend']})"}
    clock = EpochClock(device)
    model = copy.deepcopy(base_model).to(device)
    epochs: List[Dict[str, Any]] = []

    def record(epoch, seconds, loss):
        epochs.append({"epoch": epoch + 1, "wall_s": seconds, "loss": loss, "warmup": epoch == 0})
        print(f"[{BENCH}] {name} {column} epoch {epoch + 1}: {seconds:.3f} s, loss {loss:.4f}", file=sys.stderr,
              flush=True)

    torch.backends.cudnn.benchmark = True
    amp_dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
    out: Dict[str, Any] = {}
    opts = {"backend": cfg["compile_backend"]}
    if column == "baseline" or column in TORCH_COMPILE_COLUMNS:
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)
        train_model, out["impl"] = model, "eager AMP loop"
        if column == "torch_compile":
            train_model, out["impl"] = torch.compile(model, **opts), "eager AMP loop + torch.compile(model)"
        elif column == "torch_compile_reduce_overhead":
            train_model = torch.compile(model, mode="reduce-overhead")
            out["impl"] = 'eager AMP loop + torch.compile(model, mode="reduce-overhead")'
        try:
            baseline_loop(data, train_model, loss_fn, opt, cfg["epochs"], device, clock, amp_dtype, record)
        except Exception as e:  # noqa: BLE001 - a compiled column that does not run is reported, not fatal
            if column == "baseline":
                raise
            return {"unavailable": f"failed: {type(e).__name__}: {str(e)[:300]}"}
    else:
        mode = {"fusetrain_eager": "off", "fusetrain_compile": "compile", "fusetrain_cuda_graph": "cuda_graph"}[column]
        precision = resolve_precision("fp16" if device.type == "cuda" else "bf16", device)
        scaler = precision.make_scaler()
        opt = fusetrain.optim.SGD(model.parameters(), lr=torch.tensor(LR, device=device), momentum=MOMENTUM,
                                  weight_decay=WEIGHT_DECAY)
        try:
            step, impl = make_fusetrain_step(model, loss_fn, opt, scaler, precision, mode, device,
                                             compile_options=opts if mode == "compile" else None)
        except RowUnavailable as e:
            return {"unavailable": str(e)}
        fusetrain_loop(data, step, cfg["epochs"], device, clock, record)
        out.update(impl=impl, mode=mode)
    sync(device)
    timed = [e["wall_s"] for e in epochs if not e["warmup"]]
    out.update(epochs=epochs, median_epoch_s=median(timed), min_epoch_s=min(timed), warmup_epoch_s=epochs[0]["wall_s"],
               first_epoch_extra_s=epochs[0]["wall_s"] - median(timed), final_loss=epochs[-1]["loss"])
    return out


# ---------------------------------------------------------------- report

def evaluate(results: Dict[str, Dict[str, Dict[str, Any]]], on_gpu: bool):
    table: Dict[str, Any] = {}
    targets = []
    for name, cols in results.items():
        base = cols["baseline"].get("median_epoch_s")
        imp = {c: improvement_pct(base, cols[c].get("median_epoch_s")) for c in COLUMNS if c != "baseline"}
        imp_min = {c: improvement_pct(cols["baseline"].get("min_epoch_s"), cols[c].get("min_epoch_s"))
                   for c in COLUMNS if c != "baseline"}
        ft = {c: v for c, v in imp.items() if c in FUSETRAIN_COLUMNS and v is not None}
        best = max(ft, key=ft.get) if ft else None
        table[name] = {"improvement_pct": imp, "improvement_pct_min_based": imp_min, "best_fusetrain": best,
                       "seed_single_gpu_pct": {r: SEED_TABLE[r]["single_gpu"][2] for r in SEED_COUNTERPART[name]}}
        tc = {c: imp[c] for c in TORCH_COMPILE_COLUMNS if imp.get(c) is not None}
        best_tc = max(tc, key=tc.get) if tc else None
        table[name]["best_torch_compile"] = best_tc
        v, ref = (ft[best] if best else None), (tc[best_tc] if best_tc else None)
        met = None if v is None or ref is None else bool(v >= ref)
        targets.append({"name": f"{name}: best fusetrain improvement ({best}) >= best torch.compile improvement "
                                f"({best_tc})",
                        "model": name, "value": v, "threshold": ref, "op": ">=", "met": met, "applies": True})
    return table, targets


def fmt_pct(v: Optional[float]) -> str:
    return "n/a" if v is None else f"{v:+.1f}%"


def print_table(meta, results, table, targets) -> None:
    cfg = meta["config"]
    print(f"{device_line(meta)}, threads {meta['num_threads']}, load {meta['loadavg_start']}")
    print(f"images {cfg['height']}x{cfg['width']}, model width {cfg['channels']}, batch {cfg['batch']}, "
          f"{cfg['images']} images ({cfg['steps_per_epoch']} steps/epoch), {cfg['epochs']} epochs per cell "
          f"(epoch 1 = warm-up, excluded); AMP {cfg['amp_dtype']}; compile backend {cfg['compile_backend']}")
    hdr = (f"{'model':<11} " + " ".join(f"{c + ' s':>22}" for c in COLUMNS))
    for title, key in (("time per epoch (median), seconds", "median_epoch_s"),
                       ("first epoch beyond a steady one (compilation, capture, autotuning), seconds",
                        "first_epoch_extra_s")):
        print(title)
        print_header_row(hdr)
        for name, cols in results.items():
            cells = []
            for c in COLUMNS:
                v = cols[c].get(key)
                cells.append(f"{(f'{v:.3f}' if v is not None else 'n/a'):>22}")
            print(f"{name:<11} " + " ".join(cells))
        print()
    print("improvement over the baseline, (baseline - column) / baseline, as the seed computes it")
    hdr = (f"{'model':<11} " + " ".join(f"{c:>21}" for c in COLUMNS[1:]) + f" {'seed torch.compile':>26}")
    print_header_row(hdr)
    for name, row in table.items():
        seed = ", ".join(f"{r.replace('cityscapes_', '')} {p:.1f}%" for r, p in row["seed_single_gpu_pct"].items())
        print(f"{name:<11} " + " ".join(f"{fmt_pct(row['improvement_pct'][c]):>21}" for c in COLUMNS[1:])
              + f" {seed or '- (no seed row)':>26}")
    print()
    for t in targets:
        v = "n/a" if t["value"] is None else f"{t['value']:+.1f}%"
        thr = "n/a" if t["threshold"] is None else f"{t['threshold']:+.1f}%"
        print_target(meta["device_kind"], t["model"], t["name"], v, t["op"], thr, verdict(t["met"], t["applies"]))


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = make_parser(__doc__)
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated subset of " + ",".join(MODELS))
    ap.add_argument("--preset", choices=tuple(PRESETS), default="reduced",
                    help="the sizes below when not given: reduced (default) or seed (the seed's scale; see above)")
    ap.add_argument("--height", type=int, default=None, help="image height (reduced: cuda 256, cpu 64; seed 512)")
    ap.add_argument("--width", type=int, default=None, help="image width (reduced: cuda 512, cpu 128; seed 1024)")
    ap.add_argument("--channels", type=int, default=None, help="model width (reduced: cuda 16, cpu 8; seed 64)")
    ap.add_argument("--batch", type=int, default=None, help="batch size (reduced: cuda 8, cpu 4; seed 8)")
    ap.add_argument("--images", type=int, default=None,
                    help="images per epoch (reduced: cuda 160, cpu 8; seed 160)")
    ap.add_argument("--epochs", type=int, default=None, help="epochs per cell, the first a warm-up (default 3)")
    ap.add_argument("--columns", default=",".join(COLUMNS),
                    help="comma-separated subset of " + ",".join(COLUMNS) + " (baseline is always run)")
    ap.add_argument("--compile-backend", default=None,
                    help="torch.compile backend for every compiled column (default inductor; --quick: eager)")
    args, device = parse(ap, argv, BENCH, "tiny images and widths: a smoke run")
    on_gpu = device.type == "cuda"
    if args.quick:
        fill_defaults(args, QUICK)
    fill_defaults(args, {**PRESETS[args.preset][device.type], "compile_backend": "inductor"})
    if args.height % 32 or args.width % 32 or args.height < 64 or args.width < 64:
        ap.error("--height and --width must be multiples of 32, at least 64")
    if args.epochs < 2 or args.batch < 1 or args.images < args.batch:
        ap.error("need --epochs >= 2 (the first is a warm-up), --batch >= 1 and --images >= --batch")
    models = choose(ap, "--models", args.models, MODELS, "model")
    columns = set(choose(ap, "--columns", args.columns, COLUMNS, "column")) | {"baseline"}

    cfg = {"preset": args.preset, "height": args.height, "width": args.width, "channels": args.channels,
           "batch": args.batch,
           "images": args.images, "epochs": args.epochs, "compile_backend": args.compile_backend,
           "steps_per_epoch": args.images // args.batch, "quick": bool(args.quick), "models": models,
           "columns": [c for c in COLUMNS if c in columns],
           "amp_dtype": "fp16" if on_gpu else "bf16", "optimizer": f"SGD(lr={LR}, momentum={MOMENTUM}, "
           f"weight_decay={WEIGHT_DECAY})", "warmup_epochs": 1, "statistic": "median over the timed epochs",
           "timer": "CUDA events" if on_gpu else "time.perf_counter", "cudnn_benchmark": True,
           "data": "device-resident uint8 images (learnable: class colours + noise), shuffled per epoch"}
    meta: Dict[str, Any] = {**run_header(BENCH, device, with_loadavg=True), "config": cfg,
                            "seed_reference": {"table": SEED_TABLE, "counterparts": SEED_COUNTERPART,
                                               "setup": "8x RTX 3090, PyTorch 2.0, CUDA 11.8, AMP on, EMA and "
                                                        "SyncBN off, median of 5 epochs"}}
    t0 = time.perf_counter()
    report_path = out_path(args, BENCH, device.type)
    png = png_path_for(report_path)
    results: Dict[str, Dict[str, Dict[str, Any]]] = {}

    def write(final: bool) -> None:
        """The report of the cells run so far (rewritten after each, so that a run cut off keeps them)."""
        pending = {c: {"unavailable": "not run yet"} for c in COLUMNS}
        done = {m: dict(pending, **cols) for m, cols in results.items()}
        table, targets = evaluate(done, on_gpu)
        if final:
            print_table(meta, done, table, targets)
            vals = [table[m]["improvement_pct"][c] for m in done for c in COLUMNS[1:]]
            bar_chart(png, list(COLUMNS[1:]), vals, f"{BENCH}: improvement over the eager AMP baseline "
                      f"({meta['device_name']}, torch {meta['torch_version']})", "improvement, %",
                      groups=list(done), notes=[f"{args.height}x{args.width}, width {args.channels}, batch "
                                                f"{args.batch}; n/a: not run here"])
        write_partial_report(meta, report_path, png, targets, t0, final, results=done, improvements=table)

    for name in models:
        base_model, loss_fn = build(name, args.channels)
        x, y = (make_det_data if name == "yolo_csp" else make_seg_data)(args.images, args.height, args.width)
        meta["config"].setdefault("num_params", {})[name] = sum(p.numel() for p in base_model.parameters())
        results[name] = {}
        for col in COLUMNS:
            if col not in columns:
                results[name][col] = {"unavailable": "not asked for (--columns)"}
                continue
            data = DeviceBatches(x, y, args.batch, device, seed=SHUFFLE_SEED, uint8_images=True)
            print(f"[{BENCH}] {name}: {col}", file=sys.stderr, flush=True)
            results[name][col] = run_cell(name, col, base_model, loss_fn.to(device), data, cfg, device)
            torch._dynamo.reset()  # each compiled cell compiles afresh (no cache shared between cells)
            write(final=False)
    write(final=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
