#!/usr/bin/env python3
"""The mixed-precision MNIST experiment this project started from, with fusetrain's step beside the seed's loops.

The seed trains a 14-convolution + 3-linear network on MNIST (batch 256, Adam
lr 1e-4) twice: a plain fp32 loop, then an AMP loop (GradScaler + fp16
autocast); both call ``loss.item()`` every step. It reports the time per
epoch, ``torch.cuda.memory_reserved()`` and the loss: 31.7 s / 988 MB fp32,
13.8 s / 622 MB AMP (median of epochs 2-10). This script reruns those two
loops, statement for statement, and fusetrain's training step
(``fusetrain.training.step.train_step.TrainStep``, the step the Trainer runs) in five
configurations, on the same data:

  seed_fp32               the seed's train(): torch.optim.Adam, loss.item() per step
  seed_amp                the seed's optimized_train(): GradScaler + fp16 autocast (bf16 on CPU)
  fusetrain_fp16          TrainStep(mode="off"), fusetrain Adam, LossScaler, fp16 autocast
  fusetrain_bf16          TrainStep(mode="off"), bf16 autocast (no loss scaler)
  fusetrain_bf16_compile_ema     bf16, TrainStep(mode="compile") (the whole step compiled), EMA
  fusetrain_bf16_cuda_graph_ema  bf16, TrainStep(mode="cuda_graph") (the whole step captured), EMA
  fusetrain_bf16_cuda_graph_ema_channels_last  the same with the model and inputs channels-last (the
                          Trainer's channels_last: tensor-core convolutions without layout transposes)

Per row: median time per epoch (the first epoch, with compilation or capture,
is a warm-up and not counted), memory (GPU: ``torch.cuda.memory_reserved()``
at the end of the last epoch, the seed's figure; CPU: the peak RSS of the
row's process), the last epoch's mean loss. Ratios: the fastest fusetrain row
against seed_fp32 (target >= 3x on H100/H200) and seed_amp (target >= 1.3x),
and its memory against seed_amp's (target <= 1x).

Data and fairness
-----------------
Every row reads the same batches from the same pipeline: 60000 (GPU) MNIST-
shaped 1x28x28 images and labels of 10 classes held on the device as uint8,
shuffled each epoch with the same seed, each batch gathered on the device
and turned into floats in [0, 1] (as ToTensor does). The seed's
``img.to(DEVICE)`` then copies nothing; the seed's own DataLoader with 2
workers would cap every row at the loader's rate, which is not the question
here. The images are learnable (a fixed random template per class plus
noise), so the losses fall as MNIST's do. Each row runs in its own process
(so that the peak RSS and the reserved memory are its own), from the same
initial weights (seed 0). ``cudnn.benchmark``: torch's default (False) for
the seed's loops, as in the seed; True for fusetrain's rows (the Trainer's
default); ``--seed-cudnn-benchmark`` turns it on for the seed's loops too.

CPU: fp16 autocast has no fast CPU kernels (a step of this network is ~20x
slower than fp32), so on CPU seed_amp uses bf16 autocast (keeping its
GradScaler) and fusetrain_fp16 is skipped unless ``--cpu-fp16``; the
cuda_graph row needs a GPU. The CPU run is at a reduced size and its ratios
say nothing about the GPU targets (reported in parentheses).

Usage:
    python benchmarks/seed_mnist_amp.py [--device cpu|cuda] [--images N] [--batch B] [--epochs E]
        [--rows a,b,...] [--compile-backend NAME] [--ema-decay D] [--seed-cudnn-benchmark] [--cpu-fp16]
        [--quick] [--out PATH]
Writes benchmarks/results/seed_mnist_amp_<cpu|cuda>.json and a .png bar chart beside it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Sequence

import torch
from torch import nn

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:  # loaded by file path rather than run as a script
    sys.path.insert(0, _HERE)
from _common import (choose, device_line, fill_defaults, make_parser, out_path, parse,  # noqa: E402
                     print_header_row, print_target, run_header, seed_optimized_train, seed_train, verdict,
                     write_partial_report)
from _steps import (DeviceBatches, EpochClock, RowUnavailable, bar_chart, make_fusetrain_step,  # noqa: E402
                    median, memory_figures, memory_mb, png_path_for, reset_memory)

BENCH = "seed_mnist_amp"
LR = 1e-4
NUM_CLASSES = 10
DATA_SEED, MODEL_SEED, SHUFFLE_SEED = 1234, 0, 7
QUICK_WIDTH_DIVISOR = 8

ROWS = ("seed_fp32", "seed_amp", "fusetrain_fp16", "fusetrain_bf16", "fusetrain_bf16_compile_ema",
        "fusetrain_bf16_cuda_graph_ema", "fusetrain_bf16_cuda_graph_ema_channels_last")
FUSETRAIN_ROWS = ROWS[2:]
#: row -> (precision, TrainStep mode, EMA, channels_last)
FUSETRAIN_CFG = {
    "fusetrain_fp16": ("fp16", "off", False, False),
    "fusetrain_bf16": ("bf16", "off", False, False),
    "fusetrain_bf16_compile_ema": ("bf16", "compile", True, False),
    "fusetrain_bf16_cuda_graph_ema": ("bf16", "cuda_graph", True, False),
    "fusetrain_bf16_cuda_graph_ema_channels_last": ("bf16", "cuda_graph", True, True),
}
CUDA_GRAPH_ROWS = tuple(r for r, c in FUSETRAIN_CFG.items() if c[1] == "cuda_graph")

# The seed's printed epochs (its GPU, torch of its time): seconds per epoch,
# reserved memory (MB), mean training loss of each of its 10 epochs.
SEED_EPOCH_S = {
    "seed_fp32": [33.29, 30.91, 31.16, 31.36, 31.56, 31.73, 31.71, 31.67, 31.73, 31.86],
    "seed_amp": [13.82, 13.73, 14.48, 13.81, 13.78, 14.08, 13.75, 13.74, 13.79, 13.73],
}
SEED_RESERVED_MB = {"seed_fp32": 988.0, "seed_amp": 622.0}
SEED_FINAL_LOSS = {"seed_fp32": 0.0070, "seed_amp": 0.0080}

TARGET_VS_FP32 = 3.0
TARGET_VS_AMP = 1.3
TARGET_MEMORY = 1.0


def seed_numbers() -> Dict[str, Any]:
    out = {}
    for row, epochs in SEED_EPOCH_S.items():
        out[row] = {"epoch_s": epochs, "median_epoch_s_2_to_10": median(epochs[1:]),
                    "reserved_mb": SEED_RESERVED_MB[row], "final_loss": SEED_FINAL_LOSS[row]}
    out["amp_speedup"] = out["seed_fp32"]["median_epoch_s_2_to_10"] / out["seed_amp"]["median_epoch_s_2_to_10"]
    out["amp_memory_ratio"] = SEED_RESERVED_MB["seed_amp"] / SEED_RESERVED_MB["seed_fp32"]
    return out


# ---------------------------------------------------------------- model and data

def seed_model(quick: bool) -> nn.Module:
    """``build_model("seed_mnist")``; with ``quick``, the same layers at an eighth of the widths."""
    from fusetrain.models import build_model

    torch.manual_seed(MODEL_SEED)
    model = build_model("seed_mnist", num_classes=NUM_CLASSES)
    if quick:
        from amp_ema_step import narrowed

        torch.manual_seed(MODEL_SEED)
        model = narrowed(model, QUICK_WIDTH_DIVISOR)
    return model


def make_data(images: int):
    """Learnable MNIST-shaped data: a fixed random 28x28 template per class,
    blended with uniform noise, as uint8; labels uniform over 10 classes."""
    g = torch.Generator().manual_seed(DATA_SEED)
    templates = torch.rand(NUM_CLASSES, 1, 28, 28, generator=g)
    labels = torch.randint(0, NUM_CLASSES, (images,), generator=g)
    x = 0.6 * templates[labels] + 0.4 * torch.rand(images, 1, 28, 28, generator=g)
    return (x * 255).round().to(torch.uint8), labels


# ---------------------------------------------------------------- the seed's loops

def fusetrain_train(data_loader, step, num_epochs, device, clock, record):
    """fusetrain's loop: one call of the step per batch, the loss summed on
    the device and read once per epoch (after the epoch's clock stops)."""
    for epoch in range(num_epochs):
        loss_sum = torch.zeros((), dtype=torch.float32, device=device)
        start_time = clock.start()
        n = 0
        for img, label in data_loader:
            _, loss = step(img, label)
            loss_sum += loss
            n += 1
        elapsed = clock.stop_s(start_time)
        record(epoch, loss_sum.item() / n, elapsed)


# ---------------------------------------------------------------- one row (in its own process)

def run_row(row: str, cfg: Dict[str, Any]) -> Dict[str, Any]:
    device = torch.device(cfg["device"])
    torch.set_num_threads(cfg["num_threads"])
    clock = EpochClock(device)
    x, y = make_data(cfg["images"])
    data = DeviceBatches(x, y, cfg["batch"], device, seed=SHUFFLE_SEED, uint8_images=True)
    model = seed_model(cfg["quick"]).to(device)
    criterion = nn.CrossEntropyLoss()
    epochs: List[Dict[str, Any]] = []

    def record(epoch, loss, seconds):
        epochs.append({"epoch": epoch + 1, "loss": loss, "wall_s": seconds, "warmup": epoch == 0})
        print(f"[{BENCH}] {row} epoch {epoch + 1}: loss {loss:.4f}, {seconds:.3f} s", file=sys.stderr, flush=True)

    def seed_epoch_end(epoch, losses, start_time):
        record(epoch, sum(losses) / len(losses), clock.stop_s(start_time))

    out: Dict[str, Any] = {"row": row}
    reset_memory(device)
    if row.startswith("seed_"):
        torch.backends.cudnn.benchmark = cfg["seed_cudnn_benchmark"]
        optimizer = torch.optim.Adam(model.parameters(), lr=LR)
        if row == "seed_fp32":
            seed_train(data, model, optimizer, criterion, cfg["epochs"], device, clock.start, seed_epoch_end)
        else:
            amp_dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
            seed_optimized_train(data, model, optimizer, criterion, cfg["epochs"], device, amp_dtype, clock.start,
                                 seed_epoch_end)
            out["autocast"] = str(amp_dtype).replace("torch.", "")
        out["impl"] = "the seed's loop"
    else:
        import fusetrain
        from fusetrain import ModelEMA, resolve_precision

        torch.backends.cudnn.benchmark = True
        prec_name, mode, use_ema, channels_last = FUSETRAIN_CFG[row]
        if channels_last:
            model = model.to(memory_format=torch.channels_last)
        precision = resolve_precision(prec_name, device)
        scaler = precision.make_scaler()
        # As the Trainer builds it: the lr is a device tensor (no host sync, no recompilation).
        optimizer = fusetrain.optim.Adam(model.parameters(), lr=torch.tensor(LR, device=device))
        ema = None
        if use_ema:
            ema = ModelEMA(model, decay=cfg["ema_decay"], total_steps=cfg["epochs"] * len(data))
        opts = {"backend": cfg["compile_backend"]} if mode == "compile" else None
        step, impl = make_fusetrain_step(model, criterion, optimizer, scaler, precision, mode, device, ema=ema,
                                         compile_options=opts, channels_last=channels_last)
        out.update(impl=impl, mode=mode, precision=prec_name, ema=use_ema, channels_last=channels_last,
                   compile_backend=cfg["compile_backend"] if mode == "compile" else None)
        fusetrain_train(data, step, cfg["epochs"], device, clock, record)
    out["epochs"] = epochs
    out["memory"] = memory_figures(device)
    return out


def run_row_isolated(row: str, cfg: Dict[str, Any]) -> Dict[str, Any]:
    """``run_row`` in a fresh Python process (its own memory figures)."""
    with tempfile.TemporaryDirectory(prefix=f"{BENCH}_") as tmp:
        cfg_path, res_path = os.path.join(tmp, "cfg.json"), os.path.join(tmp, "row.json")
        with open(cfg_path, "w") as f:
            json.dump(cfg, f)
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker-row", row, "--worker-cfg",
                               cfg_path, "--worker-out", res_path], stdout=sys.stderr, stderr=sys.stderr)
        if proc.returncode != 0:
            return {"row": row, "error": f"worker exited with status {proc.returncode} (see stderr)"}
        with open(res_path) as f:
            return json.load(f)


def worker_main(argv: Sequence[str]) -> int:
    args = dict(zip(argv[0::2], argv[1::2]))
    with open(args["--worker-cfg"]) as f:
        cfg = json.load(f)
    try:
        res = run_row(args["--worker-row"], cfg)
    except RowUnavailable as e:
        res = {"row": args["--worker-row"], "unavailable": str(e)}
    with open(args["--worker-out"], "w") as f:
        json.dump(res, f)
    return 0


# ---------------------------------------------------------------- report

def summarize(res: Dict[str, Any]) -> Dict[str, Any]:
    if "epochs" not in res:
        return dict(res, median_epoch_s=None, min_epoch_s=None, final_loss=None, memory_mb=None)
    timed = [e["wall_s"] for e in res["epochs"] if not e["warmup"]]
    return dict(res, timed_epochs=len(timed), median_epoch_s=median(timed), min_epoch_s=min(timed),
                warmup_epoch_s=res["epochs"][0]["wall_s"], final_loss=res["epochs"][-1]["loss"],
                memory_mb=memory_mb(res["memory"]))


def evaluate(results: Dict[str, Dict[str, Any]], on_gpu: bool):
    ran = {r: s for r, s in results.items() if s.get("median_epoch_s") is not None}
    ft = {r: s for r, s in ran.items() if r in FUSETRAIN_ROWS}
    best = min(ft, key=lambda r: ft[r]["median_epoch_s"]) if ft else None
    ratios: Dict[str, Any] = {"best_fusetrain_row": best}
    targets = []
    for ref, key, thr in (("seed_fp32", "best_vs_seed_fp32", TARGET_VS_FP32),
                          ("seed_amp", "best_vs_seed_amp", TARGET_VS_AMP)):
        v = ran[ref]["median_epoch_s"] / ft[best]["median_epoch_s"] if best and ref in ran else None
        ratios[key] = v
        ratios[key + "_min_based"] = (ran[ref]["min_epoch_s"] / ft[best]["min_epoch_s"]
                                      if best and ref in ran else None)
        targets.append({"name": f"{best} speed-up over {ref} (epoch time {ref} / {best})", "value": v,
                        "threshold": thr, "op": ">=", "met": None if v is None else bool(v >= thr),
                        "applies": on_gpu})
    m = (ft[best]["memory_mb"] / ran["seed_amp"]["memory_mb"]
         if best and "seed_amp" in ran and ft[best]["memory_mb"] and ran["seed_amp"]["memory_mb"] else None)
    ratios["best_memory_vs_seed_amp"] = m
    targets.append({"name": f"{best} memory / seed_amp memory ({'reserved' if on_gpu else 'peak RSS'})",
                    "value": m, "threshold": TARGET_MEMORY, "op": "<=",
                    "met": None if m is None else bool(m <= TARGET_MEMORY), "applies": on_gpu})
    for r in ran:
        ratios.setdefault("speedup_vs_seed_fp32", {})[r] = (ran["seed_fp32"]["median_epoch_s"] /
                                                            ran[r]["median_epoch_s"] if "seed_fp32" in ran else None)
        ratios.setdefault("speedup_vs_seed_amp", {})[r] = (ran["seed_amp"]["median_epoch_s"] /
                                                           ran[r]["median_epoch_s"] if "seed_amp" in ran else None)
    return ratios, targets


def print_table(meta, results, ratios, targets) -> None:
    cfg = meta["config"]
    on_gpu = meta["device_kind"] == "cuda"
    print(f"{device_line(meta)}, threads {meta['num_threads']}, load {meta['loadavg_start']}")
    print(f"{cfg['images']} MNIST-shaped images on the device, batch {cfg['batch']} ({cfg['steps_per_epoch']} steps/"
          f"epoch), Adam lr {LR}, {cfg['epochs']} epochs per row (epoch 1 = warm-up, excluded); model: "
          f"seed_mnist{' at 1/8 width (--quick)' if cfg['quick'] else ''}; memory: "
          f"{'torch.cuda.memory_reserved() at the end' if on_gpu else 'peak RSS of the row process'}")
    hdr = (f"{'row':<30} {'epoch s':>9} {'(min)':>8} {'warm-up s':>9} {'memory MB':>10} {'final loss':>10} "
           f"{'vs seed_fp32':>12} {'vs seed_amp':>11}")
    print_header_row(hdr)
    seed = meta["seed_reference"]
    for row, s in results.items():
        if s.get("median_epoch_s") is None:
            print(f"{row:<30} {s.get('unavailable') or s.get('error')}")
            continue
        vf = ratios["speedup_vs_seed_fp32"].get(row)
        va = ratios["speedup_vs_seed_amp"].get(row)
        print(f"{row:<30} {s['median_epoch_s']:>9.3f} {s['min_epoch_s']:>8.3f} {s['warmup_epoch_s']:>9.2f} "
              f"{s['memory_mb']:>10.0f} {s['final_loss']:>10.4f} "
              f"{(f'{vf:.2f}x' if vf else '-'):>12} {(f'{va:.2f}x' if va else '-'):>11}")
    print()
    print("the seed's own numbers (its GPU, 60000 MNIST images, batch 256, DataLoader with 2 workers):")
    for row in ("seed_fp32", "seed_amp"):
        s = seed[row]
        print(f"  {row:<10} {s['median_epoch_s_2_to_10']:.2f} s/epoch (median of epochs 2-10), "
              f"{s['reserved_mb']:.0f} MB reserved, final loss {s['final_loss']:.4f}")
    print(f"  seed AMP speed-up over fp32: {seed['amp_speedup']:.2f}x, memory {seed['amp_memory_ratio']:.2f}x")
    print()
    best = ratios["best_fusetrain_row"]

    def fmt(v):
        return "n/a" if v is None else f"{v:.2f}x"

    print(f"fastest fusetrain row: {best}")
    print(f"  speed-up over seed_fp32: {fmt(ratios['best_vs_seed_fp32'])} (min-based "
          f"{fmt(ratios['best_vs_seed_fp32_min_based'])})")
    print(f"  speed-up over seed_amp:  {fmt(ratios['best_vs_seed_amp'])} (min-based "
          f"{fmt(ratios['best_vs_seed_amp_min_based'])})")
    print(f"  memory vs seed_amp:      {fmt(ratios['best_memory_vs_seed_amp'])}")
    for t in targets:
        v = "n/a" if t["value"] is None else f"{t['value']:.2f}"
        print_target(meta["device_kind"], None, t["name"], v, t["op"], f"{t['threshold']:.2f}",
                     verdict(t["met"], t["applies"]), "" if t["applies"] else "an H100/H200 target")


def write_chart(png: str, meta, results) -> None:
    rows = list(results)
    vals = [results[r].get("median_epoch_s") for r in rows]
    bar_chart(png, rows, vals, f"{BENCH}: time per epoch ({meta['device_name']}, torch {meta['torch_version']})",
              "seconds per epoch (median)",
              notes=[f"{meta['config']['images']} images, batch {meta['config']['batch']}; n/a: not run here"])


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--worker-row":
        return worker_main(argv)
    ap = make_parser(__doc__)
    ap.add_argument("--images", type=int, default=None, help="images per epoch (default cuda 60000, cpu 64)")
    ap.add_argument("--batch", type=int, default=None, help="batch size (default cuda 256, cpu 32)")
    ap.add_argument("--epochs", type=int, default=None, help="epochs per row, the first a warm-up (default 3)")
    ap.add_argument("--rows", default=",".join(ROWS), help="comma-separated subset of " + ",".join(ROWS))
    ap.add_argument("--compile-backend", default=None,
                    help="torch.compile backend of the compile row (default inductor; --quick: eager, i.e. dynamo tracing only)")
    ap.add_argument("--ema-decay", type=float, default=0.9999, help="ModelEMA decay (default 0.9999)")
    ap.add_argument("--seed-cudnn-benchmark", action="store_true",
                    help="cudnn.benchmark = True for the seed's loops too (default: torch's False, as the seed)")
    ap.add_argument("--cpu-fp16", action="store_true", help="run fusetrain_fp16 on CPU too (very slow)")
    args, device = parse(ap, argv, BENCH, "a tiny model and a few images: a smoke run")
    on_gpu = device.type == "cuda"
    if args.quick:
        fill_defaults(args, {"images": 16, "batch": 8, "epochs": 2, "compile_backend": "eager"})
    fill_defaults(args, {"images": 60000 if on_gpu else 64, "batch": 256 if on_gpu else 32, "epochs": 3,
                         "compile_backend": "inductor"})
    if args.epochs < 2 or args.batch < 1 or args.images < args.batch:
        ap.error("need --epochs >= 2 (the first is a warm-up), --batch >= 1 and --images >= --batch")
    rows = choose(ap, "--rows", args.rows, ROWS, "row")
    rows = [r for r in ROWS if r in rows]

    cfg = {"device": str(device), "images": args.images, "batch": args.batch, "epochs": args.epochs,
           "quick": bool(args.quick), "compile_backend": args.compile_backend, "ema_decay": args.ema_decay,
           "seed_cudnn_benchmark": bool(args.seed_cudnn_benchmark), "num_threads": torch.get_num_threads()}
    meta: Dict[str, Any] = {
        **run_header(BENCH, device, with_loadavg=True),
        "config": dict(cfg, steps_per_epoch=args.images // args.batch, rows=rows, lr=LR, classes=NUM_CLASSES,
                       model="seed_mnist" + (f" (widths / {QUICK_WIDTH_DIVISOR})" if args.quick else ""),
                       image_shape=[1, 28, 28], data="learnable random MNIST-shaped images, uint8 on the device",
                       warmup_epochs=1, statistic="median over the timed epochs",
                       timer="CUDA events" if on_gpu else "time.perf_counter",
                       memory="torch.cuda.memory_reserved() at the end of the last epoch" if on_gpu
                       else "peak RSS (ru_maxrss) of the row's own process",
                       fusetrain_cudnn_benchmark=True, isolation="one process per row"),
        "seed_reference": seed_numbers(),
    }
    t0 = time.perf_counter()
    report_path = out_path(args, BENCH, device.type)
    png = png_path_for(report_path)
    raw: Dict[str, Dict[str, Any]] = {}

    def write(final: bool) -> None:
        """The report of the rows run so far (rewritten after each, so that a run cut off keeps them)."""
        results = {r: summarize(raw.get(r, {"row": r, "unavailable": "not run yet"})) for r in rows}
        ratios, targets = evaluate(results, on_gpu)
        if final:
            print_table(meta, results, ratios, targets)
            write_chart(png, meta, results)
        write_partial_report(meta, report_path, png, targets, t0, final, results=results, ratios=ratios)

    for row in rows:
        if row == "fusetrain_fp16" and not on_gpu and not args.cpu_fp16:
            raw[row] = {"row": row, "unavailable": "skipped on CPU: fp16 autocast has no fast CPU kernels "
                                                   "(--cpu-fp16 runs it)"}
            continue
        if row in CUDA_GRAPH_ROWS and not on_gpu:
            raw[row] = {"row": row, "unavailable": "n/a (needs a GPU)"}
            continue
        print(f"[{BENCH}] running {row}", file=sys.stderr, flush=True)
        raw[row] = run_row_isolated(row, cfg)
        write(final=False)
    write(final=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
