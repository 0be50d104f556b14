#!/usr/bin/env python3
"""How much accuracy do fusetrain's lean optimizer states cost on the shipped recipes, against float32 state?

Trains a shipped recipe (``--recipe``, default ``default``: digits_cnn on the
digits) once per configuration and seed, each run a fresh
``python -m fusetrain.train_from_recipe`` process, one after the other, and
reads the JSON summary the run prints at its end: the recipe's watched metric
(``metric_to_watch``) of the last epoch and its best epoch. The
configurations (``CONFIGS``) differ only in the weights' dtype, the autocast
precision and the optimizer's ``master_weights`` and ``state_dtype``; model,
data, schedule and seed are the recipe's, so the runs of one seed start from
the same initial weights and see the same batches.

Per configuration the table gives the mean, minimum and maximum over the seeds
of the final and best metric (in points: the metric x 100) and the mean over
the seeds of the per-seed difference against ``fp32`` (with its standard
error) and against ``bf16_master`` (the same seeds; a negative difference: the
configuration is worse), and the mean validation loss of the last epoch where
the recipe logs one. The TARGET lines compare the mean final difference
against ``fp32`` with the thresholds of ``TARGETS``.

The report (``--out``, default benchmarks/results/lean_accuracy_<cpu|cuda>.json)
holds one entry per recipe under ``recipes``; with ``--merge`` the entries of
the other recipes already in the file are kept, and so are this recipe's
finished runs of the same settings (overrides of their configuration,
``--max-epochs``, ``--max-train-batches`` and device): those the sweep
would repeat are not run again, and those of other seeds or configurations
stay in the entry beside the sweep's (``kept_runs`` counts both; the header
and ``elapsed_s`` describe this invocation), so a sweep of new seeds adds
them to the earlier ones.
Every run is recorded with its exact command, wall time and exit status, and
the report is rewritten after each run with the entry's summary and targets
so far, so an interrupted sweep keeps what it finished (``complete`` false
until the sweep's last run; ``config.seeds`` names the seeds asked for).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Mapping, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402

BENCHMARK = "lean_accuracy"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: name -> (what it is, training_params keys it sets). A key the recipe lacks is
#: added with Hydra's ``+``, one it has is changed in place.
def _bf16(master: str, what: str, state: str) -> Any:
    """A configuration with bf16 weights and autocast, master weights ``master`` (described as ``what``)
    and moments in ``state``."""
    label = {"bfloat16": "bf16", "int8": "int8"}[state]
    return (f"bf16 weights, bf16 autocast, {what}, {label} state",
            {"weights_dtype": "bfloat16", "mixed_precision": "bf16", "optimizer_params.master_weights": master,
             "optimizer_params.state_dtype": state})


CONFIGS: Dict[str, Any] = {
    "fp32": ("the recipe as shipped: float32 weights and state, no autocast", {}),
    "bf16_master": ("bf16 weights, bf16 autocast, fp32 master weights, fp32 state",
                    {"weights_dtype": "bfloat16", "mixed_precision": "bf16",
                     "optimizer_params.master_weights": "true"}),
    "bf16_remainder_bf16state": _bf16("remainder", "int16 remainder", "bfloat16"),
    "bf16_stochastic_bf16state": _bf16("stochastic", "stochastic rounding", "bfloat16"),
    "fp32w_bf16state": ("float32 weights, no autocast, bf16 state",
                        {"optimizer_params.state_dtype": "bfloat16"}),
    "bf16_remainder_int8state": _bf16("remainder", "int16 remainder", "int8"),
    "bf16_stochastic_int8state": _bf16("stochastic", "stochastic rounding", "int8"),
}

BASELINE = "fp32"
BF16_BASELINE = "bf16_master"

#: config -> largest allowed drop of the mean final metric against ``fp32``, in points.
TARGETS = {"bf16_remainder_bf16state": 0.1, "bf16_remainder_int8state": 0.3, "bf16_stochastic_int8state": 0.5}


def recipe_overrides(recipe: str, keys: Mapping[str, Any]) -> List[str]:
    """Hydra overrides setting ``training_params.<key>=<value>`` for each of
    ``keys``: plain where the composed recipe has the key, ``+`` where not."""
    from omegaconf import OmegaConf

    from fusetrain.train_from_recipe import compose_recipe

    cfg = compose_recipe(recipe)
    out = []
    for key, value in keys.items():
        path = f"training_params.{key}"
        has = OmegaConf.select(cfg, path, default="<missing>") != "<missing>"
        out.append(f"{'' if has else '+'}{path}={value}")
    return out


def final_summary(stdout: str) -> Optional[Dict[str, Any]]:
    """The JSON object a run prints last (keys ``final`` and ``best``), or None."""
    dec = json.JSONDecoder()
    starts = [i for i in range(len(stdout)) if stdout[i] == "{" and (i == 0 or stdout[i - 1] == "\n")]
    for i in reversed(starts):
        try:
            obj, _ = dec.raw_decode(stdout, i)
        except ValueError:
            continue
        if isinstance(obj, dict) and "final" in obj and "best" in obj:
            return obj
    return None


def run_one(recipe: str, config: str, seed: int, overrides: Sequence[str], common: Sequence[str],
            timeout_s: float) -> Dict[str, Any]:
    """Train ``recipe`` once in a fresh process and return its record."""
    ckpt = tempfile.mkdtemp(prefix=f"lean_{config}_s{seed}_")
    argv = ["-m", "fusetrain.train_from_recipe"]
    if recipe != "default":
        argv.append(f"--config-name={recipe}")
    argv += [f"ckpt_root_dir={ckpt}", "training_params.progress_bar=false", f"training_params.seed={seed}",
             *common, *overrides]
    rec: Dict[str, Any] = {"recipe": recipe, "config": config, "seed": seed,
                           "command": shlex.join(["python", *argv])}
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, *argv], cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
        rec["returncode"] = proc.returncode
        stdout, stderr = proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as e:
        rec["returncode"] = None
        stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        stderr = f"timed out after {timeout_s} s"
    finally:
        rec["wall_s"] = round(time.perf_counter() - t0, 2)
        shutil.rmtree(ckpt, ignore_errors=True)
    summary = final_summary(stdout) if rec["returncode"] == 0 else None
    if summary is None:
        rec["error"] = (stderr or stdout)[-2000:]
        return rec
    metric = summary["best"]["metric"]
    rec.update({
        "metric": metric,
        "final": summary["final"].get(f"valid_{metric}"),
        "final_epoch": summary["final"].get("epoch"),
        "best": summary["best"]["value"],
        "best_epoch": summary["best"]["epoch"],
        "final_valid": {k: v for k, v in summary["final"].items() if k.startswith("valid_")},
        "final_train_loss": summary["final"].get("train_loss"),
    })
    return rec


def reusable_runs(entry: Optional[Mapping[str, Any]], limits: Mapping[str, Optional[int]], device: str,
                  overrides: Mapping[str, List[str]]) -> Dict[Any, Dict[str, Any]]:
    """The finished runs of a recipe's earlier entry that this sweep would
    repeat exactly (same ``limits``: max_epochs and max_train_batches, device
    and overrides), by (config, seed)."""
    if not entry:
        return {}
    old = entry.get("config", {})
    if any(old.get(k) != v for k, v in limits.items()) or old.get("device") != device:
        return {}
    return {(r["config"], r["seed"]): r for r in entry.get("runs", [])
            if r.get("final") is not None and old.get("overrides", {}).get(r["config"]) == overrides.get(r["config"])}


def run_order(run: Mapping[str, Any]) -> Any:
    """Runs seed by seed, the configurations in CONFIGS' order."""
    return run["seed"], list(CONFIGS).index(run["config"]) if run["config"] in CONFIGS else len(CONFIGS)


def pts(x: Optional[float]) -> Optional[float]:
    return None if x is None else 100.0 * x


def summarize(runs: List[Dict[str, Any]], configs: Sequence[str]) -> Dict[str, Any]:
    """Per configuration: mean/min/max over seeds of the final and best metric
    (points) and the mean per-seed difference against the baselines."""
    ok = {(r["config"], r["seed"]): r for r in runs if r.get("final") is not None}
    out: Dict[str, Any] = {}
    for cfg in configs:
        mine = {s: r for (c, s), r in ok.items() if c == cfg}
        if not mine:
            out[cfg] = {"n": 0}
            continue
        fin = [pts(r["final"]) for r in mine.values()]
        best = [pts(r["best"]) for r in mine.values()]
        row: Dict[str, Any] = {
            "n": len(mine), "seeds": sorted(mine),
            "final_mean": statistics.fmean(fin), "final_min": min(fin), "final_max": max(fin),
            "final_std": statistics.stdev(fin) if len(fin) > 1 else None,
            "best_mean": statistics.fmean(best), "best_min": min(best), "best_max": max(best),
            "wall_s_mean": statistics.fmean(r["wall_s"] for r in mine.values()),
        }
        losses = [r.get("final_valid", {}).get("valid_loss") for r in mine.values()]
        if all(x is not None for x in losses):
            row["valid_loss_mean"] = statistics.fmean(losses)
        for base, tag in ((BASELINE, "fp32"), (BF16_BASELINE, "bf16_master")):
            pairs = [(s, r) for s, r in mine.items() if (base, s) in ok]
            if pairs:
                d_fin = [pts(r["final"]) - pts(ok[(base, s)]["final"]) for s, r in pairs]
                d_best = [pts(r["best"]) - pts(ok[(base, s)]["best"]) for s, r in pairs]
                row[f"final_diff_vs_{tag}"] = statistics.fmean(d_fin)
                row[f"final_diff_vs_{tag}_per_seed"] = d_fin
                row[f"final_diff_vs_{tag}_sem"] = (statistics.stdev(d_fin) / len(d_fin) ** 0.5
                                                   if len(d_fin) > 1 else None)
                row[f"best_diff_vs_{tag}"] = statistics.fmean(d_best)
        out[cfg] = row
    return out


def fmt(x: Optional[float], signed: bool = False) -> str:
    if x is None:
        return "-"
    return f"{x:+.2f}" if signed else f"{x:.2f}"


def print_table(recipe: str, metric: str, summary: Mapping[str, Any]) -> None:
    print(f"\nrecipe {recipe!r}, watched metric {metric!r} (points = metric x 100; diffs: mean over the same seeds, "
          f"se: its standard error; valid loss: mean at the last epoch)")
    C.print_header_row(f"{'config':<27} {'n':>2} {'final mean':>10} {'[min, max]':>15} {'best mean':>10} "
                       f"{'d fp32':>7} {'(se)':>6} {'d bf16m':>7} {'d best fp32':>11} {'valid loss':>10} "
                       f"{'wall s':>7}")
    for cfg, row in summary.items():
        if not row["n"]:
            print(f"{cfg:<27} {0:>2}  (no finished run)")
            continue
        rng = f"[{fmt(row['final_min'])}, {fmt(row['final_max'])}]"
        loss = f"{row['valid_loss_mean']:.4f}" if "valid_loss_mean" in row else "-"
        print(f"{cfg:<27} {row['n']:>2} {fmt(row['final_mean']):>10} {rng:>15} {fmt(row['best_mean']):>10} "
              f"{fmt(row.get('final_diff_vs_fp32'), True):>7} {fmt(row.get('final_diff_vs_fp32_sem')):>6} "
              f"{fmt(row.get('final_diff_vs_bf16_master'), True):>7} {fmt(row.get('best_diff_vs_fp32'), True):>11} "
              f"{loss:>10} {row['wall_s_mean']:>7.0f}")


def targets(summary: Mapping[str, Any]) -> Dict[str, Any]:
    """Each target's verdict: the mean final difference against fp32 over the same seeds and its threshold."""
    out = {}
    for cfg, limit in TARGETS.items():
        d = summary.get(cfg, {}).get("final_diff_vs_fp32")
        out[cfg] = {"diff_points": d, "threshold_points": -limit, "met": None if d is None else d >= -limit}
    return out


def print_targets(device_kind: str, recipe: str, verdicts: Mapping[str, Any]) -> None:
    for cfg, v in verdicts.items():
        C.print_target(device_kind, recipe, f"{cfg} final vs fp32", fmt(v["diff_points"], True) + " pts", ">=",
                       f"{v['threshold_points']}", C.verdict(v["met"]), "mean over the same seeds")


def settle(entry: Dict[str, Any], kept: Mapping[Any, Any], configs: Sequence[str], metric: str,
           complete: bool) -> None:
    """The fields of a recipe's entry that follow from its runs so far, rewritten after every run so that an
    interrupted sweep leaves a whole entry (``complete`` false): the runs in order, how many were kept from
    the file, the summary, the targets' verdicts and the failed runs."""
    entry["metric"] = metric
    entry["runs"].sort(key=run_order)
    entry["kept_runs"] = sum(1 for r in entry["runs"] if kept.get((r["config"], r["seed"])) is r)
    entry["summary"] = summarize(entry["runs"], configs)
    entry["targets"] = targets(entry["summary"])
    entry["failed_runs"] = [f"{r['config']}/seed {r['seed']}" for r in entry["runs"] if r.get("final") is None]
    entry["complete"] = complete


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    ap = C.make_parser(__doc__)
    ap.add_argument("--recipe", default="default", help="a shipped recipe (default: default)")
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (default 0,1,2)")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"a subset of {list(CONFIGS)}")
    ap.add_argument("--max-epochs", type=int, default=None, help="override the recipe's max_epochs (smoke runs)")
    ap.add_argument("--max-train-batches", type=int, default=None,
                    help="override the recipe's max_train_batches, the batches of an epoch (smoke runs)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per run before it is stopped")
    ap.add_argument("--merge", action="store_true",
                    help="keep the other recipes' entries already in --out and this recipe's finished runs that "
                         "would be repeated exactly")
    ap.add_argument("--out", default=None, help=f"JSON path (default benchmarks/results/{BENCHMARK}_<cpu|cuda>.json)")
    args = ap.parse_args(argv)
    import torch

    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda requested but torch.cuda.is_available() is False")
    configs = C.choose(ap, "--configs", args.configs, list(CONFIGS), "configuration")
    try:
        seeds = [int(s) for s in C.csv_list(args.seeds)]
    except ValueError:
        ap.error(f"--seeds: expected comma-separated integers, got {args.seeds!r}")
    if not seeds:
        ap.error("--seeds: no seed given")
    limits = {"max_epochs": args.max_epochs, "max_train_batches": args.max_train_batches}
    for key, value in limits.items():
        if value is not None and value < 1:
            ap.error(f"--{key.replace('_', '-')}: expected an integer >= 1, got {value}")
    device = torch.device(args.device)
    out = C.out_path(args, BENCHMARK, device.type)

    common = [f"training_params.device={args.device}"]
    common += recipe_overrides(args.recipe, {k: v for k, v in limits.items() if v is not None})
    all_overrides = {cfg: recipe_overrides(args.recipe, CONFIGS[cfg][1]) for cfg in CONFIGS}
    overrides = {cfg: all_overrides[cfg] for cfg in configs}

    report: Dict[str, Any] = C.run_header(BENCHMARK, device, with_loadavg=True)
    recipes: Dict[str, Any] = {}
    kept: Dict[Any, Dict[str, Any]] = {}
    if args.merge and os.path.exists(out):
        with open(out) as f:
            recipes = json.load(f).get("recipes", {})
        kept = reusable_runs(recipes.pop(args.recipe, None), limits, args.device, all_overrides)
    # The earlier entry's runs outside this sweep stay, first, so that an interrupted sweep keeps them too.
    others = sorted((r for (c, s), r in kept.items() if c not in configs or s not in seeds), key=run_order)
    configs_all = [c for c in CONFIGS if c in configs or any(r["config"] == c for r in others)]
    seeds_all = sorted(set(seeds) | {r["seed"] for r in others})
    entry: Dict[str, Any] = {
        "config": {"seeds": seeds_all, "configs": configs_all, **limits, "device": args.device,
                   "overrides": {c: all_overrides[c] for c in configs_all},
                   "descriptions": {c: CONFIGS[c][0] for c in configs_all}},
        "runs": list(others),
    }
    recipes[args.recipe] = entry
    report["recipes"] = recipes
    print(C.device_line(report))
    print(f"recipe {args.recipe!r}: {len(configs)} configurations x {len(seeds)} seeds, one process per run")
    t_start = time.perf_counter()
    metric = "?"
    for seed in seeds:  # seed-major: a change of load on a shared machine hits every configuration alike
        for cfg in configs:
            rec = kept.get((cfg, seed))
            reused = rec is not None
            if not reused:
                rec = run_one(args.recipe, cfg, seed, overrides[cfg], common, args.timeout)
            entry["runs"].append(rec)
            metric = rec.get("metric", metric)
            status = (f"final {fmt(pts(rec['final']))}  best {fmt(pts(rec['best']))} (epoch {rec['best_epoch']})"
                      if rec.get("final") is not None else f"FAILED (exit {rec['returncode']})")
            kept_note = f"  (kept from {out})" if reused else ""
            print(f"  seed {seed} {cfg:<27} {status}  {rec['wall_s']:.0f} s{kept_note}", flush=True)
            if reused:
                continue
            settle(entry, kept, configs_all, metric, complete=False)
            report["elapsed_s"] = time.perf_counter() - t_start
            C.write_report(report, out)
    settle(entry, kept, configs_all, metric, complete=True)
    print_table(args.recipe, metric, entry["summary"])
    print_targets(device.type, args.recipe, entry["targets"])
    report["loadavg_end"] = C.loadavg()
    report["elapsed_s"] = time.perf_counter() - t_start
    C.write_report(report, out)
    if entry["failed_runs"]:
        print(f"failed runs: {', '.join(entry['failed_runs'])}", file=sys.stderr)
        sys.exit(1)
    return report


if __name__ == "__main__":
    main()
