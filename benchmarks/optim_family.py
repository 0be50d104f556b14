"""How fast is each fusetrain optimizer's step compared with its torch.optim
counterpart?

For every optimizer of the family (Adam, AdamW, SGD with momentum, RMSprop
centered with momentum, Adadelta, RAdam, NAdam, RMSpropTF with momentum,
Lamb, AdamP, Muon) on
one parameter layout (ResNet-50's 161 tensors by default): fusetrain's plain
step against torch.optim's fastest implementation on the device
(``fused=True`` where torch has it, else ``foreach=True``; for RMSpropTF,
Lamb and AdamP timm's classes, which have one implementation, a loop over
the tensors (Lamb's built-in clipping off in the plain step); for
Muon ``torch.optim.Muon`` on the matrices and filters, each as its 2-D view,
plus ``torch.optim.AdamW(foreach=True)`` on the rest), and fusetrain's full tail (clip + step + EMA in one call)
against torch's sequence (``clip_grad_norm_(foreach=True)``, the step,
``_foreach_lerp_`` for the EMA). Variants are interleaved: each repeat runs
every variant's ``--steps`` steps in a rotated order. Ratio = torch / fusetrain
(> 1: fusetrain faster). Targets: plain >= 1.0x for every torch.optim
counterpart; full >= 1.3x for every optimizer.
"""

from __future__ import annotations

import functools
import math
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch

import fusetrain.optim as fo
from _common import (Timer, device_line, fill_defaults, make_parser, out_path, parse, print_header_row,
                     print_target, rotated, run_header, summary, verdict, write_report)
from optim_step import large_shapes, numel, resnet50_shapes

LR = 1e-3
EMA_DECAY = 0.999
MAX_GRAD_NORM = 1.0


def _timm(name: str, **kw):
    """timm's class ``name`` (the reference implementation of RMSpropTF, Lamb and AdamP), imported when used."""
    def get():
        import timm.optim

        return functools.partial(getattr(timm.optim, name), **kw)
    return get


class _TorchMuonAdamW:
    """torch.optim.Muon on the params of 2+ dims (a filter through a 2-D leaf
    view of its storage: torch's Muon takes matrices only) and
    torch.optim.AdamW(foreach=True) on the others, as fusetrain's Muon splits them."""

    def __init__(self, params, lr, **_):
        mats = [p for p in params if p.dim() >= 2]
        self.views = [(p, p.detach().view(p.shape[0], -1).requires_grad_()) for p in mats]
        self.muon = torch.optim.Muon([v for _, v in self.views], lr=lr)
        rest = [p for p in params if p.dim() < 2]
        self.adamw = torch.optim.AdamW(rest, lr=lr, betas=(0.9, 0.95), weight_decay=0.1, foreach=True)

    def step(self):
        for p, v in self.views:
            v.grad = p.grad.view(v.shape)
        self.muon.step()
        self.adamw.step()


# name -> (fusetrain class, reference class (or a function returning it), kwargs, whether the reference has
# fused=True; None: it has neither fused nor foreach)
FAMILY = {
    "Adam": (fo.Adam, torch.optim.Adam, {}, True),
    "AdamW": (fo.AdamW, torch.optim.AdamW, {"weight_decay": 0.01}, True),
    "SGD": (fo.SGD, torch.optim.SGD, {"momentum": 0.9}, True),
    "RMSprop": (fo.RMSprop, torch.optim.RMSprop, {"momentum": 0.9, "centered": True}, False),
    "Adadelta": (fo.Adadelta, torch.optim.Adadelta, {}, False),
    "RAdam": (fo.RAdam, torch.optim.RAdam, {}, False),
    "NAdam": (fo.NAdam, torch.optim.NAdam, {}, False),
    "RMSpropTF": (fo.RMSpropTF, _timm("RMSpropTF"), {"momentum": 0.9}, None),
    # Both without clipping in the plain step (the full tail passes max_grad_norm to ours, clips timm's separately).
    "Lamb": (functools.partial(fo.Lamb, max_grad_norm=None), _timm("Lamb", max_grad_norm=None), {}, None),
    "AdamP": (fo.AdamP, _timm("AdamP"), {"weight_decay": 0.01}, None),
    "Muon": (fo.Muon, lambda: _TorchMuonAdamW, {}, None),
}
REFERENCE_NAMES = {"RMSpropTF": "timm", "Lamb": "timm", "AdamP": "timm",
                   "Muon": "Muon+AdamW"}  # references with neither fused nor foreach


def make_variants(name: str, base_p, base_g, device) -> Dict[str, Callable[[], None]]:
    ours_cls, torch_cls, kw, has_fused = FAMILY[name]
    if not isinstance(torch_cls, type):
        torch_cls = torch_cls()
    if has_fused is None:
        impl = {}
    else:
        impl = {"fused": True} if (has_fused and device.type in ("cpu", "cuda")) else {"foreach": True}

    def params():
        ps = [p.clone().requires_grad_() for p in base_p]
        for p, g in zip(ps, base_g):
            p.grad = g.clone()
        return ps

    p1, p2, p3, p4 = params(), params(), params(), params()
    lr = torch.tensor(LR, device=device) if device.type == "cuda" else LR
    ours = ours_cls(p1, lr=lr, **kw)
    theirs = torch_cls(p2, lr=LR, **impl, **kw)
    ours_full = ours_cls(p3, lr=lr, max_grad_norm=MAX_GRAD_NORM, **kw)
    ema_ours = {p: p.detach().clone() for p in p3}
    ours_full.attach_ema(ema_ours, torch.tensor(EMA_DECAY, device=device))
    theirs_full = torch_cls(p4, lr=LR, **impl, **kw)
    ema_t = [p.detach().clone() for p in p4]
    src = [p.detach() for p in p4]

    def torch_full():
        torch.nn.utils.clip_grad_norm_(p4, MAX_GRAD_NORM, foreach=True)
        theirs_full.step()
        torch._foreach_lerp_(ema_t, src, 1.0 - EMA_DECAY)

    return {"fusetrain": ours.step, "torch": theirs.step, "fusetrain_full": ours_full.step,
            "torch_full": torch_full, "impl": next(iter(impl), REFERENCE_NAMES.get(name))}


def run_one(name: str, shapes, device, args, timer: Timer) -> Dict:
    gen = torch.Generator().manual_seed(0)
    base_p = [torch.randn(s, generator=gen).to(device) for s in shapes]
    base_g = [torch.randn(s, generator=gen).mul_(1e-2).to(device) for s in shapes]
    v = make_variants(name, base_p, base_g, device)
    impl = v.pop("impl")
    for fn in v.values():
        for _ in range(args.warmup):
            fn()
    times: Dict[str, List[float]] = {k: [] for k in v}
    for r in range(args.repeats):
        for k in rotated(list(v), r):
            times[k].append(timer.per_step_ms(v[k], args.steps))
    out = {k: summary(t) for k, t in times.items()}
    out["torch_impl"] = impl
    out["plain_ratio"] = out["torch"]["median_ms"] / out["fusetrain"]["median_ms"]
    out["full_ratio"] = out["torch_full"]["median_ms"] / out["fusetrain_full"]["median_ms"]
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = make_parser(__doc__)
    ap.add_argument("--repeats", type=int, default=None, help="timed repeats (default cpu 7, cuda 10)")
    ap.add_argument("--steps", type=int, default=None, help="steps per timed repeat (default cpu 3, cuda 20)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 2)")
    ap.add_argument("--layout", choices=["resnet50", "large"], default="resnet50")
    ap.add_argument("--scale", type=float, default=1.0, help="shrink the layout's params by about this factor")
    ap.add_argument("--optimizers", default=",".join(FAMILY), help="comma-separated subset of " + ",".join(FAMILY))
    args, device = parse(ap, argv, "optim_family", "tiny sizes and few steps: a smoke run of a few seconds")
    if args.quick:
        args.scale = min(args.scale, 0.002)
        fill_defaults(args, {"repeats": 2, "steps": 1, "warmup": 1})
    fill_defaults(args, {"repeats": 10, "steps": 20, "warmup": 2} if device.type == "cuda" else
                  {"repeats": 7, "steps": 3, "warmup": 2})
    names = [n for n in args.optimizers.split(",") if n]
    unknown = [n for n in names if n not in FAMILY]
    if unknown:
        ap.error(f"--optimizers: unknown {unknown}; allowed: {', '.join(FAMILY)}")
    shapes = (resnet50_shapes(width=math.sqrt(args.scale)) if args.layout == "resnet50"
              else large_shapes(25e6 * args.scale))
    timer = Timer(device)
    meta = {**run_header("optim_family", device, with_loadavg=True),
            "config": {"quick": bool(args.quick), "layout": args.layout, "num_tensors": len(shapes),
                       "num_params": numel(shapes), "repeats": args.repeats, "steps": args.steps,
                       "warmup": args.warmup, "lr": LR, "max_grad_norm": MAX_GRAD_NORM, "ema_decay": EMA_DECAY,
                       "kwargs": {n: FAMILY[n][2] for n in names}}}
    t0 = time.perf_counter()
    results = {}
    for n in names:
        print(f"[optim_family] {n} on {args.layout} ({numel(shapes) / 1e6:.2f}M params) ...", file=sys.stderr,
              flush=True)
        results[n] = run_one(n, shapes, device, args, timer)
    print(device_line(meta, cpu_capability=True))
    print(f"threads {meta['num_threads']}, {args.steps} steps x {args.repeats} repeats; median ms per step")
    print_header_row(f"{'optimizer':10} {'torch impl':10} {'fusetrain':>10} {'torch':>10} {'ratio':>6}  "
                     f"{'full ft':>9} {'full torch':>10} {'ratio':>6}")
    targets = []
    for n, r in results.items():
        print(f"{n:10} {r['torch_impl']:10} {r['fusetrain']['median_ms']:10.3f} {r['torch']['median_ms']:10.3f} "
              f"{r['plain_ratio']:6.2f}  {r['fusetrain_full']['median_ms']:9.3f} {r['torch_full']['median_ms']:10.3f} "
              f"{r['full_ratio']:6.2f}")
        if r["torch_impl"] != "timm":  # the plain target is for the torch.optim counterparts
            targets.append({"name": f"{n} plain step vs torch ({r['torch_impl']})", "value": r["plain_ratio"],
                            "threshold": 1.0, "met": r["plain_ratio"] >= 1.0})
        targets.append({"name": f"{n} full tail vs torch sequence", "value": r["full_ratio"], "threshold": 1.3,
                        "met": r["full_ratio"] >= 1.3})
    for t in targets:
        print_target(device.type, args.layout, t["name"], f"{t['value']:.2f}x", ">=", f"{t['threshold']:.2f}x",
                     verdict(t["met"]))
    meta["loadavg_end"] = run_header("optim_family", device, with_loadavg=True)["loadavg_start"]
    write_report(dict(meta, results=results, targets=targets, elapsed_s=time.perf_counter() - t0),
                 out_path(args, "optim_family", device.type))
    return 0


if __name__ == "__main__":
    sys.exit(main())
