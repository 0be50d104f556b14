#!/usr/bin/env python3
"""How many bytes per parameter do fusetrain's lean optimizer states keep, and what do they cost in step time?

For each configuration of one table (``CONFIGS``: param dtype, optimizer and
its options, the bytes per element its layout should hold), one run builds the
same model's params, puts fixed random gradients on them and times the
optimizer step alone (no forward, no backward). Per configuration it reports:

- bytes per param counted from the tensors: the params, every tensor in
  ``optimizer.state`` (a tensor subclass counted by its inner tensors, a
  tensor held twice counted once) and, with ``--ema``, an EMA copy of the
  params (with ``--ema-remainders``, the bfloat16 rows' EMA with an int16
  remainder per element, as ``ModelEMA`` keeps it), divided by the number of
  params. The bytes per element
  (``bytes_per_elem`` in the JSON) leave out the state tensors not shaped
  like their param (the 0-d step counters) and are compared with the
  configuration's expected layout (the TARGET lines); the int8-moment rows,
  whose block scales and small tensors' float32 state are not one layout,
  have their bytes per param compared with a bound instead (6.1 with a
  remainder, 4.1 with stochastic rounding); the rows ending in ``_forms`` are
  the int8 rows again with ``FUSETRAIN_Q8_FORMS=1`` set around their steps
  (the CUDA 8-bit kernel's fixed forms, NOTE [q8 forms]; on the CPU the same
  kernel as their rows without it);
- on CUDA, the peak of ``torch.cuda.max_memory_allocated`` while the
  configuration is built and takes its warm-up steps, less what was allocated
  before (params, state, EMA and the step's temporaries; the gradients, shared
  by the configurations of one dtype, are made before and not included);
- the median step time.

Each figure is also given as a ratio row / reference (below 1: leaner or
faster) against the references measured in the same run:
(a) ``torch.optim.AdamW`` on fp32 params (``fused=True`` where the device has
it, else ``foreach=True``): the usual fp32 setup, 12 bytes/param; (b)
fusetrain AdamW on bf16 params with an fp32 master copy and fp32 moments,
14 bytes/param; (c) torchao's ``AdamW8bit`` on fp32 params, where
``import torchao.optim`` works ("not installed" otherwise). A configuration
whose constructor or first step raises is reported as skipped, with the
error.

The model is a stack of transformer-block-shaped ``nn.Linear`` layers (with
bias): per block D->3D, D->D, D->4D and 4D->D, 12 D^2 + 9 D params.
``--d-model`` and ``--blocks`` set its size: 768 x 4 = 28.3M params on CPU,
1024 x 8 = 100.7M on GPU by default; ``--quick``: 64 x 2 (99,456 params).

Timing: after ``--warmup`` steps (which create the state), each repeat times
``--steps`` consecutive steps of every configuration, configurations
interleaved and their order rotated from repeat to repeat; the statistic is
the median over repeats (``time.perf_counter`` on CPU, CUDA events on GPU).
lr 1e-4, betas (0.9, 0.999), eps 1e-8, weight decay 0.01; EMA decay 0.999
(torch's and torchao's rows lerp their EMA with ``torch._foreach_lerp_``; fusetrain's rows
update it in the step through ``attach_ema``).

Usage:
    python benchmarks/optim_memory.py [--device cpu|cuda] [--d-model D] [--blocks L] [--ema] [--ema-remainders]
        [--configs NAME,...] [--repeats N] [--steps N] [--warmup N] [--threads N] [--quick] [--out PATH]
Defaults: CPU 9 repeats x 3 steps after 2 warm-up steps; GPU 10 x 10 after 3.
The table goes to stdout; the JSON to benchmarks/results/optim_memory_<cpu|cuda>.json
(or --out).
"""

from __future__ import annotations

import os
import sys
import time
from unittest import mock
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence, Set, Tuple

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

import fusetrain.optim

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:  # loaded by file path rather than run as a script
    sys.path.insert(0, _HERE)
from _common import (Timer, choose, device_line, fill_defaults, loadavg, make_parser, out_path,  # noqa: E402
                     parse, print_header_row, print_target, rotated, run_header, summary, verdict, write_report)

LR = 1e-4
BETAS = (0.9, 0.999)
EPS = 1e-8
WEIGHT_DECAY = 1e-2
EMA_DECAY = 0.999

F32, BF16 = torch.float32, torch.bfloat16


# ---------------------------------------------------------------- the configurations

class Config(NamedTuple):
    """One row: ``impl`` ("torch", "fusetrain" or "torchao") builds the
    optimizer with ``options`` on params of ``param_dtype``; ``expected`` is
    the bytes per element its layout holds without EMA (param + master +
    moments; None: not checked); ``at_most`` a bound on the bytes per param
    of everything it holds without EMA (int8 moments: block scales and the
    float32 state of small tensors included); ``ref`` tags a reference row
    ("a", "b", "c"); ``env`` holds environment variables set while the
    row's steps run (the CUDA 8-bit kernel's fixed forms, NOTE [q8 forms])."""

    name: str
    label: str
    impl: str
    param_dtype: torch.dtype
    options: Mapping[str, Any]
    expected: Optional[int] = None
    ref: Optional[str] = None
    at_most: Optional[float] = None
    env: Mapping[str, str] = {}


Q8_FORMS = {"FUSETRAIN_Q8_FORMS": "1"}

# NOTE [optim_memory rows]: one line per configuration; the references come
# first, and a new state layout (int8 moments, say) is one more line here.
CONFIGS: Tuple[Config, ...] = (
    Config("torch_fp32", "(a) torch AdamW, fp32", "torch", F32, {}, 4 + 4 + 4, ref="a"),
    Config("bf16_master_fp32", "(b) bf16 + fp32 master, fp32 moments", "fusetrain", BF16,
           {"master_weights": True}, 2 + 4 + 4 + 4, ref="b"),
    Config("torchao_8bit_fp32", "(c) torchao AdamW8bit, fp32", "torchao", F32, {}, None, ref="c"),
    Config("fusetrain_fp32", "fusetrain AdamW, fp32", "fusetrain", F32, {}, 4 + 4 + 4),
    Config("bf16_nomaster_fp32", "bf16, no master, fp32 moments", "fusetrain", BF16,
           {"master_weights": False}, 2 + 4 + 4),
    Config("bf16_remainder_fp32", "bf16 + remainder, fp32 moments", "fusetrain", BF16,
           {"master_weights": "remainder"}, 2 + 2 + 4 + 4),
    Config("bf16_remainder_bf16", "bf16 + remainder, bf16 moments", "fusetrain", BF16,
           {"master_weights": "remainder", "state_dtype": BF16}, 2 + 2 + 2 + 2),
    Config("bf16_stochastic_bf16", "bf16 stochastic, bf16 moments", "fusetrain", BF16,
           {"master_weights": "stochastic", "state_dtype": BF16}, 2 + 2 + 2),
    Config("bf16_master_bf16", "bf16 + fp32 master, bf16 moments", "fusetrain", BF16,
           {"master_weights": True, "state_dtype": BF16}, 2 + 4 + 2 + 2),
    Config("bf16_remainder_int8", "bf16 + remainder, int8 moments", "fusetrain", BF16,
           {"master_weights": "remainder", "state_dtype": "int8"}, at_most=6.1),
    Config("bf16_stochastic_int8", "bf16 stochastic, int8 moments", "fusetrain", BF16,
           {"master_weights": "stochastic", "state_dtype": "int8"}, at_most=4.1),
    Config("bf16_remainder_int8_forms", "bf16 + remainder, int8 moments, fixed forms", "fusetrain", BF16,
           {"master_weights": "remainder", "state_dtype": "int8"}, at_most=6.1, env=Q8_FORMS),
    Config("bf16_stochastic_int8_forms", "bf16 stochastic, int8 moments, fixed forms", "fusetrain", BF16,
           {"master_weights": "stochastic", "state_dtype": "int8"}, at_most=4.1, env=Q8_FORMS),
)
REFERENCES = {c.ref: c.name for c in CONFIGS if c.ref}


def _options_text(options: Mapping[str, Any]) -> Dict[str, Any]:
    return {k: (str(v).replace("torch.", "") if isinstance(v, torch.dtype) else v) for k, v in options.items()}


# ---------------------------------------------------------------- the model

def build_model(d_model: int, blocks: int, device: torch.device) -> nn.Sequential:
    """``blocks`` transformer-block-shaped groups of ``nn.Linear`` (with bias):
    D->3D (qkv), D->D (attention out), D->4D and 4D->D (MLP); fp32."""
    d = d_model
    layers: List[nn.Module] = []
    for _ in range(blocks):
        layers += [nn.Linear(d, 3 * d), nn.Linear(d, d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)]
    return nn.Sequential(*layers).to(device)


def model_params(d_model: int, blocks: int) -> int:
    """The model's param count: 12 D^2 + 9 D per block."""
    return blocks * (12 * d_model * d_model + 9 * d_model)


# ---------------------------------------------------------------- counting bytes

def tensor_bytes(t: Tensor, seen: Set[Tuple[int, int, torch.dtype]]) -> int:
    """numel * element_size of ``t``, or of its inner tensors for a wrapper
    subclass (a quantized state); a tensor already in ``seen`` counts 0."""
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, n), seen) for n in names)
    key = (t.data_ptr(), t.numel(), t.dtype)
    if key in seen:
        return 0
    seen.add(key)
    return t.numel() * t.element_size()


def count_bytes(params: Sequence[Tensor], state: Mapping[Tensor, Mapping[str, Any]],
                ema: Sequence[Tensor], ema_remainders: Sequence[Tensor] = ()) -> Dict[str, Any]:
    """Bytes held by ``params``, every tensor of ``state`` (per key), ``ema``
    and its ``ema_remainders``; ``other`` sums the state tensors with another
    element count than their param (the 0-d step counters)."""
    seen: Set[Tuple[int, int, torch.dtype]] = set()
    by_key: Dict[str, int] = {"param": sum(tensor_bytes(p.detach(), seen) for p in params)}
    dtypes: Dict[str, str] = {"param": str(params[0].dtype).replace("torch.", "")}
    other = 0
    for p in params:
        for key, val in state.get(p, {}).items():
            if not isinstance(val, Tensor):
                continue
            b = tensor_bytes(val, seen)
            by_key[key] = by_key.get(key, 0) + b
            dtypes.setdefault(key, type(val).__name__ if is_traceable_wrapper_subclass(val)
                              else str(val.dtype).replace("torch.", ""))
            if val.numel() != p.numel():
                other += b
    if ema:
        by_key["ema"] = sum(tensor_bytes(e, seen) for e in ema)
        dtypes["ema"] = str(ema[0].dtype).replace("torch.", "")
    if ema_remainders:
        by_key["ema_remainder"] = sum(tensor_bytes(r, seen) for r in ema_remainders)
        dtypes["ema_remainder"] = str(ema_remainders[0].dtype).replace("torch.", "")
    return {"by_key": by_key, "dtypes": dtypes, "total": sum(by_key.values()), "other": other}


# ---------------------------------------------------------------- building a row

def row_env(config: Config):
    """The row's environment variables, set for the duration of a ``with`` and restored after it."""
    return mock.patch.dict(os.environ, config.env)


class Row:
    def __init__(self, config: Config):
        self.config = config
        self.status = "ok"
        self.error: Optional[str] = None
        self.step: Optional[Callable[[], None]] = None
        self.optimizer: Any = None
        self.params: List[Tensor] = []
        self.ema: List[Tensor] = []
        self.ema_remainders: List[Tensor] = []
        self.peak_bytes: Optional[int] = None
        self.times_ms: List[float] = []

    def drop(self, status: str, exc: BaseException) -> None:
        self.status = status
        self.error = f"{type(exc).__name__}: {exc}"
        self.step, self.optimizer, self.params, self.ema, self.ema_remainders = None, None, [], [], []


def _torch_adamw_kwargs(device: torch.device) -> Dict[str, bool]:
    """``fused=True`` where torch's fused AdamW runs on ``device``, else ``foreach=True``."""
    probe = torch.zeros(8, device=device, requires_grad=True)
    probe.grad = torch.ones_like(probe)
    try:
        with torch.no_grad():
            torch.optim.AdamW([probe], lr=LR, fused=True).step()
        return {"fused": True}
    except (RuntimeError, ValueError):
        return {"foreach": True}


def _make_optimizer(config: Config, params: List[Tensor], device: torch.device):
    hyper = dict(lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    if config.impl == "torch":
        return torch.optim.AdamW(params, **hyper, **_torch_adamw_kwargs(device), **config.options)
    if config.impl == "fusetrain":
        return fusetrain.optim.AdamW(params, **hyper, **config.options)
    if config.impl == "torchao":
        import torchao.optim  # not a dependency: the row reads "not installed" without it

        return torchao.optim.AdamW8bit(params, **hyper, **config.options)
    raise ValueError(f"config {config.name}: unknown impl {config.impl!r}")


def ema_remainders(config: Config, args) -> bool:
    """Whether the row's EMA keeps int16 remainders (``--ema-remainders``: fusetrain's bfloat16 rows)."""
    return bool(args.ema_remainders) and config.impl == "fusetrain" and config.param_dtype == BF16


def ema_bytes(config: Config, args) -> int:
    """The EMA's bytes per element of the row: its dtype's, and 2 for a remainder."""
    return (config.param_dtype.itemsize + 2 * ema_remainders(config, args)) if args.ema else 0


def build_row(config: Config, base: Sequence[Tensor], grads: Mapping[torch.dtype, List[Tensor]],
              device: torch.device, args, timer: Timer) -> Row:
    """The row's params (``base`` cast to its dtype, the shared gradients of
    that dtype), optimizer, EMA and step; the warm-up steps run here (on CUDA
    inside the peak-memory window)."""
    row = Row(config)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    try:
        params = [b.detach().to(config.param_dtype).clone().requires_grad_(True) for b in base]
        for p, g in zip(params, grads[config.param_dtype]):
            p.grad = g
        row.params = params
        opt = _make_optimizer(config, params, device)
        row.optimizer = opt
        if args.ema:
            row.ema = [p.detach().clone() for p in params]
        if config.impl == "fusetrain":
            if args.ema:
                if ema_remainders(config, args):
                    row.ema_remainders = [torch.zeros_like(p, dtype=torch.int16) for p in params]
                opt.attach_ema(dict(zip(params, row.ema)), torch.full((), EMA_DECAY, dtype=F32, device=device),
                               remainders=dict(zip(params, row.ema_remainders)) or None)
            row.step = opt.step
        elif args.ema:
            detached = [p.detach() for p in params]

            def step_with_ema(opt=opt, ema=row.ema, src=detached, weight=1.0 - EMA_DECAY):
                opt.step()
                torch._foreach_lerp_(ema, src, weight)

            row.step = step_with_ema
        else:
            row.step = opt.step
        with torch.no_grad(), row_env(config):
            for _ in range(max(1, args.warmup)):  # the first step makes the state
                row.step()
        timer.sync()
        if cuda:
            row.peak_bytes = torch.cuda.max_memory_allocated(device) - before
    except ImportError as exc:
        row.drop("not installed", exc)
    except Exception as exc:  # noqa: BLE001 -- a configuration the optimizer does not offer is reported, not fatal
        row.drop("skipped", exc)
    return row


# ---------------------------------------------------------------- the run

def _ratio(x: Optional[float], ref: Optional[float]) -> Optional[float]:
    return x / ref if x is not None and ref else None


def run(configs: Sequence[Config], device: torch.device, args, timer: Timer) -> Tuple[Dict[str, Any], int, int]:
    torch.manual_seed(1234)
    model = build_model(args.d_model, args.blocks, device)
    base = [p.detach() for p in model.parameters()]
    n, tensors = sum(p.numel() for p in base), len(base)
    gen = torch.Generator(device=device)
    gen.manual_seed(4321)
    g32 = [torch.randn(p.shape, generator=gen, device=device) * 1e-2 for p in base]
    grads = {dt: [g.to(dt) for g in g32] for dt in {c.param_dtype for c in configs}}
    del g32

    rows: List[Row] = []
    for c in configs:
        print(f"[optim_memory] building {c.name} ...", file=sys.stderr, flush=True)
        rows.append(build_row(c, base, grads, device, args, timer))
    del model, base
    live = [r for r in rows if r.step is not None]
    with torch.no_grad():
        for rep in range(args.repeats):
            for r in rotated(live, rep):
                with row_env(r.config):
                    r.times_ms.append(timer.per_step_ms(r.step, args.steps))

    results: Dict[str, Any] = {}
    for r in rows:
        c = r.config
        entry: Dict[str, Any] = {"label": c.label, "impl": c.impl, "param_dtype": str(c.param_dtype).replace(
            "torch.", ""), "options": _options_text(c.options), "reference_tag": c.ref, "env": dict(c.env),
            "status": r.status}
        expected = None if c.expected is None else c.expected + ema_bytes(c, args)
        entry["expected_bytes_per_elem"] = expected
        entry["at_most_bytes_per_param"] = None if c.at_most is None else c.at_most + ema_bytes(c, args)
        if r.step is None:
            entry["error"] = r.error
            results[c.name] = entry
            continue
        counted = count_bytes(r.params, r.optimizer.state, r.ema, r.ema_remainders)
        entry.update({
            "bytes": counted["by_key"], "state_dtypes": counted["dtypes"], "total_bytes": counted["total"],
            "other_state_bytes": counted["other"],
            "bytes_per_param": counted["total"] / n,
            "bytes_per_elem": (counted["total"] - counted["other"]) / n,
            "peak_bytes": r.peak_bytes,
            "peak_bytes_per_param": None if r.peak_bytes is None else r.peak_bytes / n,
            **summary(r.times_ms),
        })
        results[c.name] = entry
    del rows, live

    for entry in results.values():
        entry["vs"] = {}
        for tag, ref_name in REFERENCES.items():
            ref = results.get(ref_name)
            if entry["status"] != "ok" or ref is None or ref["status"] != "ok":
                continue
            entry["vs"][tag] = {
                "bytes_per_param": _ratio(entry["bytes_per_param"], ref["bytes_per_param"]),
                "peak_bytes": _ratio(entry["peak_bytes"], ref["peak_bytes"]),
                "median_ms": _ratio(entry["median_ms"], ref["median_ms"]),
                "min_ms": _ratio(entry["min_ms"], ref["min_ms"]),
            }
    return results, n, tensors


def evaluate_targets(results: Mapping[str, Any]) -> List[Dict[str, Any]]:
    """Per configuration with an expected layout: the counted bytes per
    element (state not shaped like its param left out) equal it. A skipped row has no value."""
    targets = []
    for name, e in results.items():
        bound = e["at_most_bytes_per_param"]
        if bound is not None:
            value = e.get("bytes_per_param")
            targets.append({"name": "bytes per param (params + all state) <= the target", "config": name,
                            "value": value, "threshold": bound, "op": "<=",
                            "met": None if value is None else bool(value <= bound),
                            "note": "" if value is not None else e["status"]})
        if e["expected_bytes_per_elem"] is None:
            continue
        value = e.get("bytes_per_elem")
        met = None if value is None else bool(value == e["expected_bytes_per_elem"])
        targets.append({"name": "counted bytes per param element == the layout's", "config": name, "value": value,
                        "threshold": e["expected_bytes_per_elem"], "met": met,
                        "note": "" if value is not None else e["status"]})
    return targets


def _fmt(x: Optional[float], spec: str) -> str:
    """``x`` formatted by ``spec`` (width.precision + type), or "-" as wide."""
    return "-".rjust(int(spec.split(".")[0])) if x is None else format(x, spec)


def print_table(results: Mapping[str, Any], targets: List[Dict[str, Any]], meta: Mapping[str, Any]) -> None:
    cfg = meta["config"]
    print(device_line(meta, cpu_capability=True))
    print(f"model: {cfg['blocks']} blocks x d_model {cfg['d_model']} = {cfg['num_params'] / 1e6:.2f}M params in "
          f"{cfg['num_tensors']} tensors; EMA {'on' if cfg['ema'] else 'off'}; threads {meta['num_threads']}; "
          f"{cfg['steps']} steps x {cfg['repeats']} repeats after {cfg['warmup']} warm-up; "
          f"loadavg {meta['loadavg_start']}")
    print("ratios = row / reference (a) torch AdamW fp32, (b) bf16 + fp32 master, (c) torchao AdamW8bit; "
          "below 1: leaner / faster")
    cuda = meta["device_kind"] == "cuda"
    peak = f" {'peak B/p':>8} {'/(a)':>5}" if cuda else ""
    w = max([22] + [len(name) for name in results])  # the configuration column
    hdr = (f"{'config':<{w}} {'B/param':>7} {'/(a)':>5} {'/(b)':>5} {'/(c)':>5}{peak} {'median ms':>10} {'min ms':>9} "
           f"{'t/(a)':>6} {'t/(b)':>6} {'t/(c)':>6}")
    print_header_row(hdr)
    for name, e in results.items():
        if e["status"] != "ok":
            err = (e["error"] or "").splitlines()[0][:110]
            print(f"{name:<{w}} {e['status']}: {err}")
            continue
        vs = {t: e["vs"].get(t, {}) for t in ("a", "b", "c")}
        pk = f" {_fmt(e['peak_bytes_per_param'], '8.2f')} {_fmt(vs['a'].get('peak_bytes'), '5.2f')}" if cuda else ""
        print(f"{name:<{w}} {e['bytes_per_param']:>7.2f} {_fmt(vs['a'].get('bytes_per_param'), '5.2f')} "
              f"{_fmt(vs['b'].get('bytes_per_param'), '5.2f')} {_fmt(vs['c'].get('bytes_per_param'), '5.2f')}{pk} "
              f"{e['median_ms']:>10.2f} {e['min_ms']:>9.2f} {_fmt(vs['a'].get('median_ms'), '6.2f')} "
              f"{_fmt(vs['b'].get('median_ms'), '6.2f')} {_fmt(vs['c'].get('median_ms'), '6.2f')}")
    print()
    for t in targets:
        val = "n/a" if t["value"] is None else f"{t['value']:.2f} B"
        print_target(meta["device_kind"], t["config"], t["name"], val, t.get("op", "=="), f"{t['threshold']} B",
                     verdict(t["met"]), t["note"])


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = make_parser(__doc__)
    ap.add_argument("--d-model", type=int, default=None, help="width D of the blocks (default cpu 768, cuda 1024)")
    ap.add_argument("--blocks", type=int, default=None, help="number of blocks (default cpu 4, cuda 8)")
    ap.add_argument("--ema", action="store_true", help="keep an EMA copy of the params (counted, updated each step)")
    ap.add_argument("--ema-remainders", action="store_true",
                    help="with --ema: the bfloat16 rows' EMA keeps an int16 remainder per element, as ModelEMA does")
    ap.add_argument("--configs", default=",".join(c.name for c in CONFIGS),
                    help="comma-separated subset of the configurations (default: all)")
    ap.add_argument("--repeats", type=int, default=None,
                    help="timed repeats per configuration (default cpu 9, cuda 10)")
    ap.add_argument("--steps", type=int, default=None, help="steps per timed repeat (default cpu 3, cuda 10)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps first, at least 1 (default cpu 2, cuda 3)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch.set_num_threads(N) before the run (default: torch's own count, recorded)")
    args, device = parse(ap, argv, "optim_memory", "a tiny model and few steps: a smoke run of a few seconds")
    on_gpu = device.type == "cuda"
    if args.quick:
        fill_defaults(args, {"d_model": 64, "blocks": 2, "repeats": 2, "steps": 1, "warmup": 1})
    fill_defaults(args, {"d_model": 1024, "blocks": 8, "repeats": 10, "steps": 10, "warmup": 3} if on_gpu else
                  {"d_model": 768, "blocks": 4, "repeats": 9, "steps": 3, "warmup": 2})
    if args.d_model < 1 or args.blocks < 1 or args.repeats < 1 or args.steps < 1 or args.warmup < 1:
        ap.error("--d-model, --blocks, --repeats, --steps and --warmup must be >= 1")
    if args.ema_remainders and not args.ema:
        ap.error("--ema-remainders is a form of the EMA: give --ema too")
    if args.threads is not None:
        if args.threads < 1:
            ap.error(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    by_name = {c.name: c for c in CONFIGS}
    configs = [by_name[k] for k in choose(ap, "--configs", args.configs, list(by_name), "configuration")]

    timer = Timer(device)
    meta: Dict[str, Any] = {**run_header("optim_memory", device, with_loadavg=True)}
    t_start = time.perf_counter()
    results, n, tensors = run(configs, device, args, timer)
    meta["config"] = {
        "quick": bool(args.quick), "d_model": args.d_model, "blocks": args.blocks, "num_params": n,
        "num_tensors": tensors, "ema": bool(args.ema), "ema_remainders": bool(args.ema_remainders),
        "steps": args.steps, "repeats": args.repeats,
        "warmup": args.warmup, "lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WEIGHT_DECAY,
        "ema_decay": EMA_DECAY, "timer": "cuda.Event" if on_gpu else "perf_counter",
        "statistic": "median over repeats of per-step time", "references": REFERENCES,
        "torch_reference_impl": _torch_adamw_kwargs(device),
    }
    targets = evaluate_targets(results)
    report = dict(meta, loadavg_end=loadavg(), results=results, targets=targets,
                  all_targets_met=all(t["met"] is True for t in targets),
                  elapsed_s=time.perf_counter() - t_start)
    print_table(results, targets, meta)
    write_report(report, out_path(args, "optim_memory", device.type))
    return 0


if __name__ == "__main__":
    sys.exit(main())
