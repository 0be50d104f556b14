"""SuperGradients training hyperparameters -> fusetrain ``training_params``.

:func:`translate` applies SG's defaults, then translates every key, keeping
SG's behaviour where fusetrain's default differs (each such place is listed
in the report's ``reproduced``). A key with no counterpart (an SG task loss,
an SG logger, an SG-only callback) is an error naming the fusetrain
alternative, unless ``supply`` gives the fusetrain value that replaces it."""

from __future__ import annotations

import math
import os
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch

from ...training.params import TRAINING_PARAMS, TrainingParamsError, resolve_training_params
from ...training.params.validators import suggestion
from .defaults import SG_DEFAULTS, SG_OPTIMIZER_DEFAULTS
from .loading import SGObject, load_sg_params
from .names import (SG_LOSSES, SG_LR_MODES, SG_METRICS, SG_OPTIMIZERS, SG_TITLE_TO_METRIC, SG_WARMUPS, fold,
                    lookup)
from .report import SGTranslationError, TranslationReport

__all__ = ["translate"]


class _NoCounterpart(Exception):
    """An SG value without a fusetrain counterpart; the message names the alternative."""


class _Translation:
    def __init__(self, sg: Dict[str, Any], supply: Dict[str, Any], source: str) -> None:
        self.sg, self.supply = sg, supply
        self.out: Dict[str, Any] = {}
        self.report = TranslationReport(source)
        self.errors: List[str] = []
        self.done: set = set()
        self.supplied: set = set()

    def take(self, key: str) -> Any:
        self.done.add(key)
        return self.sg.get(key, SG_DEFAULTS.get(key))

    def set(self, sg_key: str, kind: str, **values: Any) -> None:
        self.out.update(values)
        became = ", ".join(f"{k}: {v!r}" for k, v in values.items()) or "(nothing)"
        self.report.add(sg_key, self.sg.get(sg_key, SG_DEFAULTS.get(sg_key)), kind, became)

    def note(self, sg_key: str, kind: str, text: str) -> None:
        self.report.add(sg_key, self.sg.get(sg_key, SG_DEFAULTS.get(sg_key)), kind, text)

    def fail(self, sg_key: str, targets: Tuple[str, ...], message: str) -> None:
        """No counterpart: supplied values replace it, else one error for the key."""
        if targets and all(t in self.supply for t in targets):
            self.supplied.update(targets)
            self.note(sg_key, "supplied", ", ".join(f"{t}: {self.supply[t]!r}" for t in targets)
                      + f" (from supply; SG's value: {message.split(';')[0]})")
            return
        hint = (" or supply " + ", ".join(targets)) if targets else ""
        self.errors.append(f"{sg_key}: {message}{hint}")


def _kwargs(item: Any) -> Tuple[str, Dict[str, Any]]:
    """An SG name given as a string, a one-entry mapping {name: kwargs} or a ``_target_`` object."""
    if isinstance(item, SGObject):
        return item.name, dict(item.kwargs)
    if isinstance(item, Mapping) and len(item) == 1:
        name, kwargs = next(iter(item.items()))
        return str(name), dict(kwargs or {})
    if isinstance(item, str):
        return item, {}
    return type(item).__name__, {}


# ---- the keys, by group --------------------------------------------------------------------------------------

def _optimizer(t: _Translation) -> None:
    name, params = t.take("optimizer"), dict(t.take("optimizer_params") or {})
    fname = lookup(SG_OPTIMIZERS, name) if isinstance(name, str) else None
    if fname is None:
        t.fail("optimizer", ("optimizer",), f"{name!r} is not an optimizer fusetrain has ("
               + ", ".join(SG_OPTIMIZERS) + "); pass a torch.optim.Optimizer subclass as optimizer from Python")
        t.done.add("optimizer_params")
        return
    t.set("optimizer", "same" if fname == name else "renamed", optimizer=fname)
    merged = {**SG_OPTIMIZER_DEFAULTS.get(fname, {}), **params}
    if fname in SG_OPTIMIZER_DEFAULTS:
        kind = "reproduced" if merged != params else "same"
        t.report.reproduce(f"optimizer {fname}: SG merges {dict(SG_OPTIMIZER_DEFAULTS[fname])} under "
                           f"optimizer_params, so optimizer_params is {merged}")
    else:
        kind = "same"
    t.set("optimizer_params", kind, optimizer_params=merged)


def _initial_lr(t: _Translation) -> None:
    lr = t.take("initial_lr")
    if lr is None:
        t.fail("initial_lr", ("initial_lr",), "missing (SG requires it)")
        return
    if isinstance(lr, Mapping):
        rates = {k: float(v) for k, v in lr.items()}
        frozen = [k for k, v in rates.items() if v == 0 and k != "default"]
        if rates.get("default", 0) == 0:
            t.fail("initial_lr", ("initial_lr",), "a 'default' rate of 0 freezes every other parameter in SG; set "
                   "freeze and a positive default")
            return
        for k in frozen:
            del rates[k]
        t.set("initial_lr", "same", initial_lr=rates)
        if frozen:
            t.out["freeze"] = [k + "*" for k in frozen]
            t.report.reproduce(f"initial_lr: prefixes with rate 0 ({frozen}) are frozen, as SG freezes them "
                               f"(freeze: {t.out['freeze']})")
        t.report.reproduce("initial_lr by prefix: SG's name.startswith(prefix) groups, each with its own rate")
        return
    t.set("initial_lr", "same", initial_lr=float(lr))


def _schedule(t: _Translation) -> None:
    mode = t.take("lr_mode")
    fn = t.take("lr_schedule_function")
    for k in ("lr_updates", "lr_decay_factor", "step_lr_update_freq", "cosine_final_lr_ratio", "lr_cooldown_epochs"):
        t.take(k)
    max_epochs, cool = int(t.sg["max_epochs"]), int(t.sg.get("lr_cooldown_epochs") or 0)
    t.set("lr_cooldown_epochs", "same", lr_cooldown_epochs=cool)
    if mode is None:
        t.set("lr_mode", "same", lr_mode="constant")
    elif fold(mode) in ("function", "functionlrscheduler") or fn is not None:
        t.fail("lr_mode", ("lr_mode",), f"{mode!r} with lr_schedule_function: an SG function of (initial_lr, epoch, "
               "iter, max_epoch, iters_per_epoch); from Python, give fusetrain a function of the optimizer step as "
               "lr_mode")
    elif isinstance(mode, str) and lookup(SG_LR_MODES, mode):
        t.set("lr_mode", "same" if mode == lookup(SG_LR_MODES, mode) else "renamed", lr_mode=lookup(SG_LR_MODES, mode))
    else:
        t.fail("lr_mode", ("lr_mode",), f"{mode!r} is not an SG schedule fusetrain has (" + ", ".join(SG_LR_MODES)
               + "); pick a fusetrain lr_mode (docs/training_params.md)")
    lr_mode = t.out.get("lr_mode")
    warm = int(t.sg.get("lr_warmup_epochs") or 0)
    if lr_mode not in (None, "step") and cool and warm + cool >= max_epochs:
        # A recipe shortened for a smoke test (max_epochs=1 with SG's warmup 5 and cooldown 15).
        t.set("lr_cooldown_epochs", "reproduced", lr_cooldown_epochs=0)
        if lr_mode != "constant":
            t.set("lr_mode", "reproduced", lr_mode="constant")
        t.report.reproduce(f"lr_warmup_epochs {warm} + lr_cooldown_epochs {cool} >= max_epochs {max_epochs}: SG runs "
                           f"its {mode!r} schedule from epoch lr_warmup_epochs to max_epochs - lr_cooldown_epochs, "
                           f"which is no epoch of this run, so the rate follows the warmup, then stays at "
                           f"initial_lr (lr_mode: constant, lr_cooldown_epochs: 0)")
        lr_mode = "constant"
    if fn is None:
        t.note("lr_schedule_function", "no effect", "(no function)")
    t.set("cosine_final_lr_ratio", "same", cosine_final_lr_ratio=float(t.sg.get("cosine_final_lr_ratio", 0.01)))
    t.set("lr_decay_factor", "same", lr_decay_factor=float(t.sg.get("lr_decay_factor", 0.1)))
    if lr_mode == "poly":
        t.out["poly_power"] = 0.9
        t.report.reproduce("lr_mode poly: SG's fixed power 0.9 (poly_power: 0.9)")
    if lr_mode == "cosine":
        t.report.differ("lr_mode cosine: SG's last scheduled step runs at cos(pi * (T - 1) / (T + 1)) of the way "
                        "down, fusetrain's at initial_lr * cosine_final_lr_ratio exactly")
    updates, freq = t.sg.get("lr_updates") or [], t.sg.get("step_lr_update_freq")
    if lr_mode != "step":
        t.note("lr_updates", "no effect", f"(lr_mode {lr_mode!r} has no decay epochs)")
        t.note("step_lr_update_freq", "no effect", f"(lr_mode {lr_mode!r})")
        return
    if cool:
        t.set("lr_cooldown_epochs", "reproduced", lr_cooldown_epochs=0)
        t.report.reproduce(f"lr_cooldown_epochs {cool} with lr_mode step: SG's step decays go on in the cooldown "
                           f"epochs (the cooldown only bounds step_lr_update_freq), so lr_cooldown_epochs: 0")
    if freq and updates:
        t.fail("step_lr_update_freq", ("lr_updates",), f"{freq!r} with lr_updates {list(updates)}: SG refuses both")
        return
    if freq:
        if freq < 1:
            t.fail("step_lr_update_freq", ("lr_updates",), f"{freq!r} decays several times at one epoch's end in SG "
                   "(its epochs are rounded up); give lr_updates, or fusetrain's step_lr_update_freq (decays at "
                   "fractional epochs)")
            return
        last = max_epochs - cool
        updates = [math.ceil(freq * x) for x in range(1, last) if warm <= math.ceil(freq * x) < last]
        t.note("step_lr_update_freq", "reproduced", f"SG's decay epochs {updates} (ceil(x * {freq}) from "
               f"lr_warmup_epochs to max_epochs - lr_cooldown_epochs)")
        t.report.reproduce(f"step_lr_update_freq {freq}: SG's rule, decay epochs ceil(x * freq) within "
                           f"[lr_warmup_epochs, max_epochs - lr_cooldown_epochs): {updates}")
    else:
        t.note("step_lr_update_freq", "no effect", "(not set)")
    shifted = sorted({int(u) + 1 for u in updates if int(u) + 1 < max_epochs})
    if not shifted:
        t.set("lr_updates", "reproduced", lr_mode="constant", lr_updates=[])
        t.report.reproduce(f"lr_mode {mode!r}: no decay of lr_updates {list(updates)} falls within the "
                           f"{max_epochs} epochs, so the rate stays at initial_lr (lr_mode: constant)")
        return
    t.set("lr_updates", "reproduced", lr_updates=shifted)
    t.report.reproduce(f"lr_updates: SG decays after epoch u (counted from 0) ends, so the decay applies from epoch "
                       f"u + 1: fusetrain lr_updates {shifted}")


def _warmup(t: _Translation) -> None:
    we, ws = int(t.take("lr_warmup_epochs") or 0), int(t.take("lr_warmup_steps") or 0)
    mode, wil = t.take("warmup_mode"), t.take("warmup_initial_lr")
    t.set("lr_warmup_epochs", "same", lr_warmup_epochs=we)
    t.set("lr_warmup_steps", "same", lr_warmup_steps=ws)
    if we == 0 and ws == 0:
        t.note("warmup_mode", "no effect", "(no warmup: lr_warmup_epochs and lr_warmup_steps are 0)")
        t.note("warmup_initial_lr", "no effect", "(no warmup)")
        return
    lr = t.out.get("initial_lr", t.sg.get("initial_lr"))
    default_lr = float(lr["default"] if isinstance(lr, Mapping) else lr or 0.0)
    if mode is None:  # no warmup callback: SG's schedules wait for the warmup epochs at initial_lr
        t.set("warmup_mode", "reproduced", lr_warmup_mode="constant")
        t.set("warmup_initial_lr", "reproduced", warmup_initial_lr=default_lr)
        t.report.reproduce("warmup_mode empty: SG runs the warmup at initial_lr and starts its schedule after it "
                           "(lr_warmup_mode: constant at initial_lr)")
        return
    fmode = lookup(SG_WARMUPS, mode) if isinstance(mode, str) else None
    if fmode is None:
        t.fail("warmup_mode", ("lr_warmup_mode",), f"{mode!r} is not an SG warmup fusetrain has ("
               + ", ".join(SG_WARMUPS) + "); a custom warmup is a fusetrain callback (callbacks) or part of a "
               "function lr_mode")
        return
    if fmode == "linear_epoch":
        if ws:
            t.fail("lr_warmup_steps", ("lr_warmup_steps",), f"{ws!r} with {mode}: SG's epoch warmup ignores it; "
                   "set lr_warmup_epochs")
            return
        t.set("warmup_mode", "renamed", lr_warmup_mode="linear_epoch")
        t.report.reproduce(f"warmup {mode}: one learning rate per epoch, warmup_initial_lr + (initial_lr - "
                           f"warmup_initial_lr) * epoch / lr_warmup_epochs (lr_warmup_mode: linear_epoch)")
        if wil is None:
            start = default_lr / (we + 1)
            t.set("warmup_initial_lr", "reproduced", warmup_initial_lr=start)
            t.report.reproduce(f"warmup_initial_lr empty: SG starts at initial_lr / (lr_warmup_epochs + 1) = {start!r}")
        else:
            t.set("warmup_initial_lr", "same", warmup_initial_lr=float(wil))
    else:
        if we:
            t.fail("lr_warmup_epochs", ("lr_warmup_epochs",), f"{we!r} with {mode}: SG's batch warmup counts "
                   "lr_warmup_steps only; set lr_warmup_steps")
            return
        if wil is None:
            t.fail("warmup_initial_lr", ("warmup_initial_lr",), f"empty with {mode}: SG requires it for a batch "
                   "warmup (it fails without one)")
            return
        t.set("warmup_mode", "renamed", lr_warmup_mode="linspace")
        t.set("warmup_initial_lr", "same", warmup_initial_lr=float(wil))
        t.report.reproduce(f"warmup {mode}: the first step at warmup_initial_lr, the last at initial_lr, capped at "
                           f"one epoch (lr_warmup_mode: linspace)")
    if isinstance(lr, Mapping) and wil is not None:
        t.report.differ("warmup_initial_lr with per-prefix initial_lr: SG starts every group at warmup_initial_lr, "
                        "fusetrain at warmup_initial_lr times the group's rate relative to 'default'")


def _loss(t: _Translation) -> None:
    loss, params = t.take("loss"), dict(t.take("criterion_params") or {})
    if loss is None:
        t.fail("loss", ("loss",), "missing (SG requires a loss)")
        if not params:
            t.note("criterion_params", "no effect", "(no loss)")
        return
    name, kwargs = _kwargs(loss)
    params = {**kwargs, **params}
    found = lookup(SG_LOSSES, name)
    if found is None:
        t.fail("loss", ("loss",), f"{name!r} is an SG loss with no fusetrain counterpart; register your own with "
               "fusetrain.register_loss (or give a torch.nn loss name, a class path, or 'model')")
        if "loss" in t.supply:
            t.note("criterion_params", "supplied", f"loss_params: {t.supply.get('loss_params', {})!r} (the "
                   f"arguments of the replaced {name})")
        return
    fname, arg_map = found
    unknown = [k for k in params if k not in arg_map]
    if unknown:
        t.fail("criterion_params", ("loss_params",), f"{unknown} of {name} have no counterpart in "
               f"torch.nn.{fname} (allowed: {list(arg_map)})")
        return
    t.set("loss", "renamed" if fname != name else "same", loss=fname)
    t.set("criterion_params", "renamed", loss_params={arg_map[k]: v for k, v in params.items()})
    if "smooth_eps" in params:
        t.report.reproduce(f"loss {name} smooth_eps: SG's label smoothing is torch's label_smoothing "
                           f"({params['smooth_eps']!r})")


def _metric_list(t: _Translation, sg_key: str, key: str) -> List[str]:
    """Translate an SG metrics list; returns the SG titles the metrics report."""
    items = t.take(sg_key) or []
    out, titles, problems = [], [], []
    for item in items:
        name, kwargs = _kwargs(item)
        found = lookup(SG_METRICS, name)
        if found is None:
            problems.append(f"{name!r}")
            continue
        fname, arg_map, reported = found
        mapped = {arg_map[k]: v for k, v in kwargs.items() if k in arg_map}
        dropped = sorted(k for k in kwargs if k not in arg_map)
        if dropped:
            t.report.differ(f"{sg_key} {name}: arguments {dropped} are SG's evaluation settings; fusetrain's "
                            f"{fname!r} reads the model's predictions itself (per-image boxes, scores and labels "
                            f"for detection)")
        out.append({fname: mapped} if mapped else fname)
        titles += reported
    if problems:
        t.fail(sg_key, (key,), f"metric(s) {', '.join(problems)} have no fusetrain counterpart (fusetrain has "
               + ", ".join(SG_METRICS) + "); register one with fusetrain.register_metric or give a torchmetrics "
               "class path")
        return titles
    t.set(sg_key, "renamed", **{key: out})
    return titles


def _metrics(t: _Translation, loss_name: Optional[str]) -> None:
    sg_train = t.sg.get("train_metrics_list", [])
    _metric_list(t, "train_metrics_list", "train_metrics")
    if not sg_train:
        t.report.reproduce("train_metrics_list empty (SG's default []): train_metrics: []")
    titles = _metric_list(t, "valid_metrics_list", "valid_metrics")
    watch = t.take("metric_to_watch")
    t.set("greater_metric_to_watch_is_better", "same",
          greater_metric_to_watch_is_better=bool(t.take("greater_metric_to_watch_is_better")))
    match = next((x for x in titles if fold(x) == fold(watch)), None)
    loss_like = fold(watch) in ("loss", fold(loss_name or "loss")) or str(watch).split("/")[0] == loss_name
    if match is not None and SG_TITLE_TO_METRIC.get(match):
        t.set("metric_to_watch", "renamed", metric_to_watch=SG_TITLE_TO_METRIC[match])
        t.report.reproduce(f"metric_to_watch {watch!r}: SG matches names ignoring case and symbols ({match!r} -> "
                           f"{SG_TITLE_TO_METRIC[match]!r})")
    elif loss_like:
        t.set("metric_to_watch", "renamed", metric_to_watch="loss")
    else:
        t.fail("metric_to_watch", ("metric_to_watch",), f"{watch!r} is none of the names the validation metrics "
               f"report that fusetrain has ({[x for x in titles if SG_TITLE_TO_METRIC.get(x)] + ['loss']})"
               + suggestion(str(watch), titles))


# Keys whose SG default is all fusetrain needs: any other value has no counterpart (message: the alternative).
_NO_EFFECT: Dict[str, Tuple[str, Tuple[str, ...]]] = {
    "launch_tensorboard": ("start TensorBoard yourself on the experiment folder", ()),
    "tensorboard_port": ("start TensorBoard yourself on the experiment folder", ()),
    "tb_files_user_prompt": ("fusetrain never prompts; overwrite_experiment decides", ("overwrite_experiment",)),
    "save_tensorboard_to_s3": ("copy the experiment folder yourself", ()),
    "log_installed_packages": ("fusetrain does not log installed packages", ()),
    "save_full_train_log": ("fusetrain's logs are metrics.csv/metrics.jsonl and the loggers", ("loggers",)),
    "dataset_statistics": ("no counterpart; a callback can compute them (callbacks)", ("callbacks",)),
    "precise_bn": ("no counterpart; recompute BatchNorm statistics in a callback (callbacks)", ("callbacks",)),
    "precise_bn_batch_size": ("no counterpart (precise_bn)", ()),
    "load_opt_params": ("fusetrain always restores the optimizer state on resume", ()),
    "save_model": ("fusetrain always writes checkpoints", ()),
    "ckpt_name": ("set resume_path to the checkpoint file", ("resume_path",)),
    "ckpt_best_name": ("fusetrain's best checkpoint is ckpt_best.pth", ()),
    "resume_from_remote_sg_logger": ("download the checkpoint and set resume_path", ("resume_path",)),
    "run_id": ("fusetrain's run folder is the experiment_name", ()),
    "run_test_freq": ("fusetrain tests once, after training (test_loader)", ()),
    "pre_prediction_callback": ("set model_input (a function (model, inputs) -> outputs)", ("model_input",)),
    "torch_compile_loss": ("the loss compiles with the step under compile_step: compile", ("compile_step",)),
    "finetune": ("set per-prefix initial_lr or lr_multipliers", ("lr_multipliers",)),
    "kill_ddp_pgroup_on_end": ("fusetrain destroys the process group it created", ()),
    "sg_logger_params": ("fusetrain's loggers take logger_params", ("logger_params",)),
    "warmup_bias_lr": ("a YOLO warmup of SG's; write a fusetrain callback (callbacks)", ("callbacks",)),
    "warmup_momentum": ("a YOLO warmup of SG's; write a fusetrain callback (callbacks)", ("callbacks",)),
    "loss_logging_items_names": ("fusetrain names loss components from the loss's output dict", ()),
}

# Keys whose value may be an SG object (a _target_ node) that the translation names.
_OBJECT_KEYS = ("loss", "sg_logger", "phase_callbacks", "train_metrics_list", "valid_metrics_list")

_SAME = ("max_epochs", "ema", "zero_weight_decay_on_bias_and_bn", "sync_bn", "run_validation_freq", "seed",
         "clip_grad_norm", "max_train_batches", "max_valid_batches", "resume", "resume_path", "torch_compile",
         "save_ckpt_epoch_list")


def _rest(t: _Translation) -> None:
    for key in _SAME:
        t.set(key, "same", **{key: t.take(key)})
    ema_params = dict(t.take("ema_params") or {})
    t.set("ema_params", "same", ema_params={k: v for k, v in ema_params.items() if k in ("decay", "decay_type",
                                                                                       "beta")})
    if set(ema_params) - {"decay", "decay_type", "beta"}:
        t.fail("ema_params", ("ema_params",), f"{sorted(set(ema_params) - {'decay', 'decay_type', 'beta'})} have no "
               "counterpart in fusetrain.ModelEMA (decay, decay_type, beta, ...)")
    t.set("silent_mode", "renamed", progress_bar=not bool(t.take("silent_mode")))
    mp = t.take("mixed_precision")
    device = t.supply.get("device", "auto")
    on_cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
    if mp and on_cpu:
        t.set("mixed_precision", "reproduced", mixed_precision=False)
        t.report.reproduce(f"mixed_precision true on a CPU (device {device!r}"
                           + (", and this machine has no GPU" if device == "auto" else "")
                           + "): SG turns mixed precision off there, with a warning, so mixed_precision: false; "
                           "on a CPU, bf16 is the fast choice (supply mixed_precision: bf16)")
    elif mp:
        t.set("mixed_precision", "reproduced", mixed_precision="fp16")
        t.report.reproduce("mixed_precision true: SG runs fp16 autocast with a GradScaler on a GPU (mixed_precision: "
                           "fp16, with fusetrain's LossScaler)")
    else:
        t.set("mixed_precision", "same", mixed_precision=False)
    acc = int(t.take("batch_accumulate") or 1)
    if acc > 1:
        t.set("batch_accumulate", "reproduced", batch_accumulate=acc, batch_accumulate_reduction="sum")
        t.report.reproduce(f"batch_accumulate {acc}: SG sums the gradients of the batches (the loss is not "
                           f"divided): batch_accumulate_reduction: sum")
        t.report.differ("batch_accumulate: SG steps only on every batch_accumulate-th batch of the run and "
                        "advances its schedules per batch; fusetrain also steps on an epoch's last partial group "
                        "and counts optimizer steps")
    else:
        t.set("batch_accumulate", "same", batch_accumulate=1)
    opts = dict(t.take("torch_compile_options") or {})
    if not t.sg.get("torch_compile") and opts == SG_DEFAULTS["torch_compile_options"]:
        t.note("torch_compile_options", "no effect", "(SG's default; torch_compile is off)")
    else:
        mode = opts.pop("mode", None)
        opts = {k: v for k, v in opts.items() if v is not None}
        t.set("torch_compile_options", "renamed", torch_compile_options=opts,
              **({"torch_compile_mode": mode} if mode else {}))
    avg = t.take("average_best_models")
    if "average_best_models" in TRAINING_PARAMS:
        t.set("average_best_models", "same", average_best_models=avg)
    else:
        t.note("average_best_models", "not available", f"{avg!r}: the averaged checkpoint is not written")
    callbacks = t.take("phase_callbacks") or []
    if callbacks:
        names = [_kwargs(c)[0] for c in callbacks]
        t.fail("phase_callbacks", ("callbacks",), f"SG callbacks {names} have no fusetrain counterpart; write "
               "fusetrain.Callback subclasses (callbacks)")
    else:
        t.note("phase_callbacks", "no effect", "(none)")
    logger = t.take("sg_logger")
    lname = _kwargs(logger)[0] if logger is not None else None
    if lname in (None, "base_sg_logger"):
        t.note("sg_logger", "no effect", "fusetrain's own logs (metrics.csv, metrics.jsonl, TensorBoard)")
    elif fold(lname) == "wandbsglogger":
        t.set("sg_logger", "renamed", loggers=["wandb"])
    else:
        t.fail("sg_logger", ("loggers",), f"{lname!r} is an SG logger; fusetrain's loggers are tensorboard, csv, "
               "jsonl, wandb, mlflow or any object with log_scalars(step, values) and close() (loggers)")
    for key, (alternative, targets) in _NO_EFFECT.items():
        if key in t.done or (key not in t.sg and key not in SG_DEFAULTS):
            continue
        value = t.take(key)
        default = SG_DEFAULTS.get(key)
        if key == "sg_logger_params" and lname not in (None, "base_sg_logger"):
            t.set(key, "renamed", logger_params={"wandb": {k: v for k, v in (value or {}).items()
                                                           if k not in SG_DEFAULTS["sg_logger_params"]}})
        elif value == default or (value in (None, [], {}, False) and key not in SG_DEFAULTS):
            t.note(key, "no effect", "(SG's default)")
        else:
            t.fail(key, targets, f"{value!r} has no fusetrain counterpart; {alternative}")


def translate(sg_params: Any, supply: Optional[Mapping[str, Any]] = None,
              overrides: Optional[Mapping[str, Any]] = None) -> Tuple[Dict[str, Any], TranslationReport]:
    """Translate SuperGradients training hyperparameters into fusetrain
    ``training_params``.

    ``sg_params``: a path to an SG training-hyperparameters YAML (as SG's
    recipes write them: ``defaults: [default_train_params]``, ``${...}``,
    ``_target_`` nodes of plain values) or the dict SG's Hydra resolves.
    ``supply``: fusetrain training_params that replace SG values with no
    counterpart (e.g. ``{"loss": "model"}`` for an SG detection loss) and
    override the translation. ``overrides``: SG keys (dotted for nested
    ones) set before translating, as SG's Hydra overrides would (e.g.
    ``{"max_epochs": 1}`` for a quick run). Returns ``(training_params, report)``; the
    params are validated. Raises :class:`SGTranslationError` listing one
    error per SG key that has no counterpart."""
    supply = dict(supply or {})
    source = os.fspath(sg_params) if isinstance(sg_params, (str, os.PathLike)) else "a dict"
    sg = load_sg_params(sg_params, overrides)
    t = _Translation(sg, supply, source)
    if sg.get("max_epochs") is None:
        t.fail("max_epochs", ("max_epochs",), "missing (SG requires it)")
        raise SGTranslationError(t.errors, source)
    for key, value in list(sg.items()):
        if isinstance(value, SGObject) and key not in _OBJECT_KEYS:
            t.done.add(key)
            t.fail(key, (key,) if key in TRAINING_PARAMS else (), f"{value.target} is an SG object (a _target_ "
                   f"node, never imported here) with no fusetrain counterpart; give the value itself")
            sg[key] = SG_DEFAULTS.get(key)
    _optimizer(t)
    _initial_lr(t)
    _schedule(t)
    _warmup(t)
    _loss(t)
    loss = sg.get("loss")
    _metrics(t, _kwargs(loss)[0] if loss is not None else None)
    _rest(t)
    for key in sg:
        if key not in t.done and key not in _SAME and not any(e.sg_key == key for e in t.report.entries):
            t.errors.append(f"{key}: not an SG training hyperparameter this translation knows"
                            + suggestion(key, list(SG_DEFAULTS) + ["max_epochs", "initial_lr"]))
    if t.errors:
        raise SGTranslationError(t.errors, source)
    params = {**t.out, **supply}
    for key, value in supply.items():
        if key not in t.supplied and t.out.get(key, object()) != value:
            t.report.add(f"(supply) {key}", t.out.get(key), "supplied", f"{key}: {value!r}")
    try:
        resolve_training_params(params)
    except TrainingParamsError as e:
        raise SGTranslationError([f"the translated training_params do not validate: {e}"], source) from None
    return params, t.report
