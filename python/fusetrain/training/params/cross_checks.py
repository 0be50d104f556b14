"""The checks of :func:`~.resolve.resolve_training_params` that involve several keys (the optimizer and its
settings, the loss, the distributed and FSDP settings, the compiled step, the metric to watch, the schedule), and
the recognition of a SuperGradients training-params dict."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Dict, List, Optional, Sequence, Type

import torch

from ...optim._base import FusedOptimizer
from ...optim._kinds import SHARD_LOCAL_CLASSES
from ..task.losses import MODEL_LOSS, loss_factory
from ..task.metrics import build_metric
from .synonyms import KEY_SYNONYMS, METRIC_NAME_SYNONYMS
from .table import (FUSED_RESERVED, LOSS_RESERVED, OPTIMIZER_RESERVED, OPTIMIZERS, TRAINING_PARAMS,
                    _V_OPTIMIZER)
from .validators import ROOT, Invalid, check_keys, init_kwargs, show, suggestion, type_name

__all__ = ["optimizer_class", "watch_candidates", "default_train_metrics", "cross_checks", "super_gradients_keys",
           "super_gradients_message"]


def optimizer_class(optimizer: Any) -> Type[torch.optim.Optimizer]:
    """The optimizer class for a (resolved) ``optimizer`` value: a name of
    :data:`OPTIMIZERS` (any case) or a ``torch.optim.Optimizer`` subclass."""
    if isinstance(optimizer, str):
        for name, cls in OPTIMIZERS.items():
            if name.lower() == optimizer.lower():
                return cls
    elif isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
        return optimizer
    raise ValueError(f"{ROOT}.optimizer: got {show(optimizer)} ({type_name(optimizer)}); "
                     f"allowed: {_V_OPTIMIZER.description}")


def _check_optimizer(values: Dict[str, Any]) -> List[str]:
    cls = optimizer_class(values["optimizer"])
    names, var_kw = init_kwargs(cls, skip_first=True)
    errors = []
    if "lr" not in names and not var_kw:
        errors.append(f"{ROOT}.optimizer: {cls.__name__} takes no 'lr' argument; the Trainer builds the "
                      f"optimizer as cls(param_groups, lr=initial_lr, **optimizer_params)")
    reserved = dict(OPTIMIZER_RESERVED, **(FUSED_RESERVED if issubclass(cls, FusedOptimizer) else {}))
    valid = [n for n in names if n not in reserved]
    foreign = [k for k in values["optimizer_params"] if k not in valid and k not in reserved]
    if foreign and not var_kw:
        owners = _optimizers_taking(foreign[0], cls)
        if owners:
            errors.append(f"{ROOT}.optimizer_params: {foreign[0]!r} is not an argument of {cls.__name__}; it is one of "
                          f"{', '.join(owners)} (set optimizer to one of them, or drop the key); {cls.__name__} takes: "
                          f"{', '.join(valid)}")
            return errors
    try:
        check_keys(f"{ROOT}.optimizer_params", values["optimizer_params"], valid, reserved, open_ended=var_kw)
    except Invalid as e:
        errors.append(f"{e} (for optimizer {cls.__name__})" if "unknown key" in str(e) else str(e))
    return errors


def _optimizers_taking(key: str, cls: type) -> List[str]:
    """The built-in optimizers other than ``cls`` whose constructor takes ``key``, read from their
    signatures (``momentum``: SGD, RMSprop, ...)."""
    return [name for name, other in OPTIMIZERS.items()
            if other is not cls and key in init_kwargs(other, skip_first=True)[0]]


def _check_loss_params(values: Dict[str, Any]) -> List[str]:
    loss, loss_params, path = values["loss"], values["loss_params"], f"{ROOT}.loss_params"
    factory = loss_factory(loss) if isinstance(loss, str) else None
    if factory is None:
        if loss_params:
            what = "a callable (configure the callable itself)" if not isinstance(loss, str) else f"{MODEL_LOSS!r}"
            return [f"{path}: got {show(loss_params)} (dict); allowed: only {{}} when loss is {what}"]
        return []
    names, var_kw = init_kwargs(factory)
    valid = [n for n in names if n not in LOSS_RESERVED]
    try:
        check_keys(path, loss_params, valid, LOSS_RESERVED, open_ended=var_kw)
    except Invalid as e:
        return [str(e)]
    return []


def _check_distributed(values: Dict[str, Any]) -> List[str]:
    errors: List[str] = []
    mg, ng, npr, dev = values["multi_gpu"], values["num_gpus"], values["num_processes"], values["device"]
    if ng is not None and npr is not None:
        errors.append(f"{ROOT}.num_gpus / num_processes: got {ng!r} and {npr!r}; allowed: at most one of them "
                      f"(num_gpus for CUDA runs, num_processes for CPU runs)")
    if ng is not None and dev == "cpu":
        errors.append(f"{ROOT}.num_gpus: got {ng!r} with device 'cpu'; allowed: None on the CPU (use "
                      f"num_processes)")
    if npr is not None and dev.startswith("cuda"):
        errors.append(f"{ROOT}.num_processes: got {npr!r} with device {dev!r}; allowed: None for a CUDA run (use "
                      f"num_gpus)")
    for key, n in (("num_gpus", ng), ("num_processes", npr)):
        if n is not None and n > 1 and mg == "off":
            errors.append(f"{ROOT}.{key}: got {n!r} with multi_gpu 'off'; allowed: 1 or None with multi_gpu 'off' "
                          f"(set multi_gpu to 'ddp' or 'auto' to start {n} processes)")
    if values["dist_backend"] == "nccl" and dev == "cpu":
        errors.append(f"{ROOT}.dist_backend: got 'nccl' with device 'cpu'; allowed: 'gloo' or 'auto' on the CPU")
    if mg != "off" and dev.startswith("cuda:") and ng is not None and ng > 1:
        errors.append(f"{ROOT}.device: got {dev!r} with num_gpus {ng!r}; allowed: 'auto' or 'cuda' (each process "
                      f"uses cuda:LOCAL_RANK)")
    if mg == "fsdp":
        errors += _check_fsdp(values)
    return errors


def _check_fsdp(values: Dict[str, Any]) -> List[str]:
    """What a sharded model cannot do (yet), said before anything runs."""
    errors: List[str] = []
    opt = optimizer_class(values["optimizer"])
    if not getattr(opt, "_shard_local", True):
        errors.append(f"{ROOT}.optimizer: got {opt.__name__} with multi_gpu 'fsdp'; its update needs whole "
                      f"tensors (per-tensor norms), which a sharded model does not hold; allowed with fsdp: an "
                      f"element-wise optimizer ({', '.join(SHARD_LOCAL_CLASSES)}) or a torch.optim one, or "
                      f"multi_gpu 'ddp'")
    if values["export"]:
        errors.append(f"{ROOT}.export: got {values['export']!r} with multi_gpu 'fsdp'; no rank holds the whole "
                      f"model; allowed with fsdp: [] (export from the full weights afterwards: python -m "
                      f"fusetrain.training.checkpoint.sharded CKPT OUT, then load them into the model)")
    if values["average_best_models"]:
        errors.append(f"{ROOT}.average_best_models: got True with multi_gpu 'fsdp'; no rank holds the whole model "
                      f"to average; allowed with fsdp: False (or multi_gpu 'ddp')")
    if values["compile_step"] != "off":
        errors.append(f"{ROOT}.compile_step: got {values['compile_step']!r} with multi_gpu 'fsdp'; allowed with "
                      f"fsdp: 'off' (torch_compile compiles the sharded model's forward and backward; FSDP2's "
                      f"collectives run in its hooks around them)")
    return errors


def _check_compile_step(values: Dict[str, Any]) -> List[str]:
    if values["compile_step"] != "cuda_graph":
        return []
    errors: List[str] = []
    if values["device"] == "cpu":
        errors.append(f"{ROOT}.compile_step: got 'cuda_graph' with device 'cpu'; CUDA graphs need a GPU; allowed "
                      f"on the CPU: 'off' or 'compile'")
    opt = values["optimizer"]
    if not isinstance(opt, str) and not issubclass(opt, FusedOptimizer):
        errors.append(f"{ROOT}.compile_step: got 'cuda_graph' with optimizer {opt.__name__}; allowed: a fusetrain "
                      f"optimizer (its step never reads the host), or compile_step 'off' / 'compile'")
    return errors


def watch_candidates(valid_metrics: List[Any]) -> Optional[List[str]]:
    """The names the validation metrics report (None when a metric cannot say
    in advance, e.g. a torchmetrics object)."""
    names: List[str] = []
    for i, spec in enumerate(valid_metrics):
        metric = build_metric(spec, f"{ROOT}.valid_metrics[{i}]")
        reported = metric.result_names()
        if reported is None:
            return None
        names += reported
    return names


def _watch_name(values: Dict[str, Any]) -> str:
    """metric_to_watch as the validation metrics report it: a name they report written with another
    case or punctuation, or another library's name for it (``Accuracy``, ``mAP@0.50:0.95``), becomes
    the reported name (NOTE [metric names] in training/metrics.py); anything else is left as given
    for :func:`_check_watch`."""
    watch = values["metric_to_watch"]
    try:
        names = watch_candidates(values["valid_metrics"])
    except (ValueError, TypeError):
        return watch
    if names is None or watch in names or watch.startswith("loss"):
        return watch
    known = names + ["loss"]
    folded = _fold(watch)
    match = next((n for n in known if _fold(n) == folded), None)
    if match is None:
        match = next((n for other, n in METRIC_NAME_SYNONYMS.items() if _fold(other) == folded and n in known), None)
    return match if match is not None else watch


def _fold(name: str) -> str:
    return re.sub(r"[^0-9a-z]", "", name.lower())


def _check_watch(values: Dict[str, Any]) -> List[str]:
    watch = values["metric_to_watch"]
    if watch == "loss" and values["loss"] == MODEL_LOSS:
        return [f"{ROOT}.metric_to_watch: got 'loss' with loss {MODEL_LOSS!r}; allowed: a name valid_metrics "
                f"reports (validation runs the model in eval mode, which returns predictions, not a loss)"]
    if watch.startswith("loss"):  # the loss or one of its components (named at run time)
        return []
    try:
        names = watch_candidates(values["valid_metrics"])
    except (ValueError, TypeError) as e:
        return [str(e)]
    if names is None or watch in names or any(watch.endswith("_" + n) for n in names):
        return []  # <loader>_<name> with several validation loaders: checked when the loaders are known
    return [f"{ROOT}.metric_to_watch: got {watch!r} (str); allowed: 'loss' or one of valid_metrics ({names!r}); "
            f"add it to valid_metrics or watch 'loss'" + suggestion(watch, names + ["loss"], METRIC_NAME_SYNONYMS,
                                                                   valid_hints_only=True)]


def cross_checks(values: Dict[str, Any]) -> List[str]:
    errors: List[str] = []
    we, ws = values["lr_warmup_epochs"], values["lr_warmup_steps"]
    if we > 0 and ws > 0:
        errors.append(f"{ROOT}.lr_warmup_epochs / lr_warmup_steps: got {we!r} and {ws!r}; "
                      f"allowed: at most one of them > 0")
    values["metric_to_watch"] = _watch_name(values)
    errors += _check_watch(values)
    warmup = we > 0 or ws > 0
    if callable(values["lr_mode"]) and warmup:
        errors.append(f"{ROOT}.lr_mode: got a function with lr_warmup_epochs {we!r} / lr_warmup_steps {ws!r}; "
                      f"allowed: a schedule function is the whole schedule, so lr_warmup_epochs and lr_warmup_steps "
                      f"must be 0 (put the warmup in the function)")
    if warmup and values["lr_warmup_mode"] == "exponential" and values["warmup_initial_lr"] == 0:
        errors.append(f"{ROOT}.warmup_initial_lr: got 0 with lr_warmup_mode 'exponential'; allowed: > 0 or None "
                      f"(a geometric rise cannot start at 0)")
    unknown = [k for k in values["logger_params"] if k not in ("tensorboard", "csv", "jsonl", "wandb", "mlflow")]
    if unknown:
        errors.append(f"{ROOT}.logger_params: unknown logger(s) {unknown}; allowed keys: 'tensorboard', 'csv', "
                      f"'jsonl', 'wandb', 'mlflow'")
    ld = values["layer_decay"]
    if ld is not None:
        try:
            problem = "" if re.compile(ld["pattern"]).groups >= 1 else "no group"
        except re.error as e:
            problem = f"not a regex: {e}"
        if problem:
            errors.append(f"{ROOT}.layer_decay.pattern: got {ld['pattern']!r} ({problem}); allowed: a regex whose "
                          f"group 1 captures the block index, e.g. 'blocks\\.(\\d+)\\.'")
    errors += _check_schedule_extras(values)
    if values["lr_mode"] == "step" and values["step_lr_update_freq"] is None:
        ups, max_epochs = values["lr_updates"], values["max_epochs"]
        if not ups or ups != sorted(set(ups)) or ups[-1] >= max_epochs:
            errors.append(f"{ROOT}.lr_updates: got {show(ups)} (list); allowed: for lr_mode 'step', a non-empty "
                          f"list of epochs in increasing order without duplicates, each >= 1 and < max_epochs "
                          f"({max_epochs})")
    if values["overwrite_experiment"] and (values["resume"] or values["resume_path"]):
        errors.append(f"{ROOT}.overwrite_experiment: got True with resume; allowed: resume to continue the run in "
                      f"the experiment folder, or overwrite_experiment to delete it and start over, not both")
    errors += _check_distributed(values)
    errors += _check_optimizer(values)
    errors += _check_loss_params(values)
    errors += _check_compile_step(values)
    return errors


#: Losses whose outputs are class scores, for which the default train_metrics is [accuracy].
CLASSIFICATION_LOSSES = ("cross_entropy", "CrossEntropyLoss", "nll", "NLLLoss")


def default_train_metrics(loss: Any) -> List[str]:
    """``train_metrics: None``: top-1 accuracy for a classification loss on
    logits, nothing for any other loss (detection, a model's own loss, ...)."""
    return ["accuracy"] if isinstance(loss, str) and loss in CLASSIFICATION_LOSSES else []


def _check_schedule_extras(values: Dict[str, Any]) -> List[str]:
    """lr_cooldown_epochs, step_lr_update_freq and the epoch-based warmups."""
    errors: List[str] = []
    we, cool, max_epochs = values["lr_warmup_epochs"], values["lr_cooldown_epochs"], values["max_epochs"]
    if cool and values["max_steps"] is None and we + cool >= max_epochs:
        errors.append(f"{ROOT}.lr_cooldown_epochs: got {cool!r} with lr_warmup_epochs {we!r} and max_epochs "
                      f"{max_epochs!r}; allowed: lr_warmup_epochs + lr_cooldown_epochs < max_epochs")
    if values["momentum_schedule"] == "onecycle" and values["lr_mode"] != "onecycle":
        errors.append(f"{ROOT}.momentum_schedule: got 'onecycle' with lr_mode {show(values['lr_mode'])}; allowed: "
                      f"lr_mode 'onecycle' (or momentum_schedule 'cosine', 'linear' or 'constant')")
    freq = values["step_lr_update_freq"]
    if freq is not None and values["lr_updates"]:
        errors.append(f"{ROOT}.step_lr_update_freq: got {freq!r} with lr_updates {show(values['lr_updates'])}; "
                      f"allowed: at most one of them (lr_updates lists the decay epochs, step_lr_update_freq spaces "
                      f"them evenly)")
    if values["lr_warmup_mode"] == "linear_epoch" and values["lr_warmup_steps"] > 0:
        errors.append(f"{ROOT}.lr_warmup_mode: got 'linear_epoch' with lr_warmup_steps {values['lr_warmup_steps']!r}; "
                      f"allowed: lr_warmup_epochs for an epoch staircase (or lr_warmup_mode 'linear' / 'linspace' "
                      f"for a warmup in steps)")
    return errors


def super_gradients_keys(user: Mapping[str, Any]) -> List[str]:
    """The keys of ``user`` that are SuperGradients' training hyperparameters and not fusetrain's."""
    from ...compat.super_gradients.defaults import SG_DEFAULTS  # late: compat imports this package

    return [k for k in user if isinstance(k, str) and k in SG_DEFAULTS and k not in TRAINING_PARAMS]


def super_gradients_message(keys: Sequence[str]) -> str:
    """One message for a dict of SuperGradients training hyperparameters: the translate() call
    (which applies SG's defaults and semantics), then the plain renames."""
    renames = ", ".join(f"{k} -> {KEY_SYNONYMS[k]}" for k in keys if k in KEY_SYNONYMS)
    return (f"{ROOT}: {', '.join(repr(k) for k in keys)} {'is' if len(keys) == 1 else 'are'} SuperGradients' "
            f"name{'' if len(keys) == 1 else 's'}: these look like SG training hyperparameters. Translate them "
            f"(SG's defaults and semantics applied, every key reported):\n"
            f"    from fusetrain.compat.super_gradients import translate\n"
            f"    training_params, report = translate(sg_training_params)\n"
            f"    print(report)\n"
            f"and pass training_params on (docs/guides/from_super_gradients.md)"
            + (f"; or rename them yourself: {renames}" if renames else ""))
