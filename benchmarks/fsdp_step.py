"""How long is an optimizer step on an FSDP2-sharded model, as the number of
parameter tensors grows?

The same model (``--tensors`` parameter tensors: Linear layers, a weight and a
bias each, about ``--params`` parameters in all) is sharded with
``fully_shard`` per layer over ``--procs`` processes (gloo on the CPU, NCCL on
GPUs), once for each optimizer. Timed per step, interleaved, on every rank:
fusetrain's AdamW (the fused pass over the local shards) against
``torch.optim.AdamW(fused=True)`` on the same DTensor parameters, plain and
with global-norm clipping (fusetrain: in the step, one all-reduce for the
norm and the non-finite flag, NOTE [sharded steps]; torch:
``clip_grad_norm_`` first). A rank's time is its median over the repeats;
the reported time is the slowest rank's. Ratio = torch / fusetrain (> 1:
fusetrain faster). Target on the CPU: fusetrain at least as fast at every
size (plain and clipped).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from _common import (Timer, device_line, fill_defaults, make_parser, out_path, parse, print_header_row,
                     print_target, rotated, run_header, summary, verdict, write_report)

LR = 1e-3
MAX_GRAD_NORM = 1.0


def make_model(tensors: int, params: float, device) -> nn.Module:
    """``tensors // 2`` Linear layers of equal width holding about ``params`` parameters."""
    layers = max(1, tensors // 2)
    width = max(8, int((params / layers) ** 0.5))
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)]).to(device)


def sharded(tensors: int, params: float, device) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = make_model(tensors, params, device)
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    gen = torch.Generator().manual_seed(dist.get_rank())
    for p in model.parameters():  # gradients as after backward: DTensors sharded like the params
        p.grad = p.detach().clone()
        p.grad.to_local().copy_(torch.randn(p.grad.to_local().shape, generator=gen).mul_(1e-2))
    return model


def run_size(tensors: int, args, device) -> Dict[str, Dict]:
    import fusetrain.optim as fo

    lr = torch.tensor(LR, device=device) if device.type == "cuda" else LR
    models = {k: sharded(tensors, args.params, device) for k in ("fusetrain", "torch", "fusetrain_clip", "torch_clip")}
    ours = fo.AdamW(models["fusetrain"].parameters(), lr=lr)
    ours_clip = fo.AdamW(models["fusetrain_clip"].parameters(), lr=lr, max_grad_norm=MAX_GRAD_NORM)
    theirs = torch.optim.AdamW(models["torch"].parameters(), lr=LR, fused=True)
    theirs_clip = torch.optim.AdamW(models["torch_clip"].parameters(), lr=LR, fused=True)
    clip_params = list(models["torch_clip"].parameters())

    def torch_clip():
        torch.nn.utils.clip_grad_norm_(clip_params, MAX_GRAD_NORM)
        theirs_clip.step()

    variants = {"fusetrain": ours.step, "torch": theirs.step, "fusetrain_clip": ours_clip.step,
                "torch_clip": torch_clip}
    timer = Timer(device)
    for fn in variants.values():
        for _ in range(args.warmup):
            fn()
    times: Dict[str, List[float]] = {k: [] for k in variants}
    for r in range(args.repeats):
        for k in rotated(list(variants), r):
            dist.barrier()
            times[k].append(timer.per_step_ms(variants[k], args.steps))
    out = {}
    for k, t in times.items():
        s = summary(t)
        worst = torch.tensor([s["median_ms"]], dtype=torch.float64, device=device)  # NCCL: a CUDA tensor
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        s["slowest_rank_median_ms"] = float(worst)
        out[k] = s
    return out


def worker(rank: int, world: int, store: str, args, result_file: str) -> None:
    device = torch.device(f"cuda:{rank}" if args.device == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.set_num_threads(max(1, (os.cpu_count() or world) // world))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"file://{store}", rank=rank,
                            world_size=world)
    try:
        results = {n: run_size(n, args, device) for n in args.tensor_counts}
        if rank == 0:
            torch.save(results, result_file)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # A process that used fully_shard over gloo sometimes aborts in the interpreter's teardown after all its work
    # ("terminate called without an active exception"; NOTE [exit after success] in tests/python/_dist_helpers.py).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = make_parser(__doc__)
    ap.add_argument("--procs", type=int, default=2, help="processes (default 2)")
    ap.add_argument("--tensors", default="100,500,1000,2000", help="parameter-tensor counts, comma-separated")
    ap.add_argument("--params", type=float, default=None, help="parameters in all (default 4e6; quick 2e4)")
    ap.add_argument("--repeats", type=int, default=None, help="timed repeats (default 7)")
    ap.add_argument("--steps", type=int, default=None, help="steps per timed repeat (default 3)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 2)")
    args, device = parse(ap, argv, "fsdp_step", "two small sizes and few steps: a smoke run of a few seconds")
    if args.quick:
        args.tensors = "8,24"
        fill_defaults(args, {"params": 2e4, "repeats": 2, "steps": 1, "warmup": 1})
    fill_defaults(args, {"params": 4e6, "repeats": 7, "steps": 3, "warmup": 2})
    args.tensor_counts = [int(n) for n in args.tensors.split(",") if n]
    if device.type == "cuda" and torch.cuda.device_count() < args.procs:
        ap.error(f"--procs {args.procs} needs as many GPUs; {torch.cuda.device_count()} visible")
    meta = {**run_header("fsdp_step", device, with_loadavg=True),
            "config": {"quick": bool(args.quick), "procs": args.procs, "tensors": args.tensor_counts,
                       "params": args.params, "repeats": args.repeats, "steps": args.steps, "warmup": args.warmup,
                       "lr": LR, "max_grad_norm": MAX_GRAD_NORM}}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fusetrain-fsdp-bench-") as tmp:
        result_file = os.path.join(tmp, "results.pt")
        mp.spawn(worker, args=(args.procs, os.path.join(tmp, "store"), args, result_file), nprocs=args.procs)
        results = torch.load(result_file)
    print(device_line(meta))
    print(f"{args.procs} processes, {args.steps} steps x {args.repeats} repeats; slowest rank's median ms per step")
    print_header_row(f"{'tensors':>8} {'fusetrain':>10} {'torch':>10} {'ratio':>6}  {'clip ft':>9} {'clip torch':>10} "
                     f"{'ratio':>6}")
    targets = []
    for n, r in results.items():
        t = {k: v["slowest_rank_median_ms"] for k, v in r.items()}
        plain, clip = t["torch"] / t["fusetrain"], t["torch_clip"] / t["fusetrain_clip"]
        r["plain_ratio"], r["clip_ratio"] = plain, clip
        print(f"{n:8d} {t['fusetrain']:10.3f} {t['torch']:10.3f} {plain:6.2f}  {t['fusetrain_clip']:9.3f} "
              f"{t['torch_clip']:10.3f} {clip:6.2f}")
        for name, value in ((f"{n} tensors plain step", plain), (f"{n} tensors clip + step", clip)):
            targets.append({"name": name, "value": value, "threshold": 1.0, "met": value >= 1.0})
    for tg in targets:
        print_target(device.type, "fsdp", tg["name"], f"{tg['value']:.2f}x", ">=", "1.00x",
                     verdict(tg["met"], applies=device.type == "cpu"))
    meta["loadavg_end"] = run_header("fsdp_step", device, with_loadavg=True)["loadavg_start"]
    write_report(dict(meta, results={str(k): v for k, v in results.items()}, targets=targets,
                      elapsed_s=time.perf_counter() - t0), out_path(args, "fsdp_step", device.type))
    return 0


if __name__ == "__main__":
    sys.exit(main())
