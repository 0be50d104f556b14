"""Turning a user mapping into :class:`TrainingParams`: defaults filled in,
every value checked by its validator, then the checks that involve several
keys; problems are collected and raised together as
:class:`TrainingParamsError`."""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Mapping
from typing import Any, Dict, Iterator, List, Optional, Sequence, Type

import torch

from ...optim._base import FusedOptimizer
from ...optim._kinds import SHARD_LOCAL_CLASSES
from ..losses import MODEL_LOSS, loss_factory
from ..metrics import build_metric
from .table import (FUSED_RESERVED, KEY_HINTS, LOSS_RESERVED, OPTIMIZER_RESERVED, OPTIMIZERS, TRAINING_PARAMS,
                    _V_OPTIMIZER)
from .synonyms import METRIC_NAME_SYNONYMS
from .validators import (ROOT, Invalid, TrainingParamsError, check_keys, init_kwargs, show, suggestion, type_name,
                         unknown_key)

__all__ = ["TrainingParams", "resolve_training_params", "optimizer_class", "watch_candidates"]


def _plain(value: Any) -> Any:
    """OmegaConf containers (anywhere in the structure) to plain dicts and lists."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
    except ImportError:  # pragma: no cover - omegaconf is optional
        DictConfig = ListConfig = ()  # type: ignore[assignment]
    if DictConfig and isinstance(value, (DictConfig, ListConfig)):
        return _plain(OmegaConf.to_container(value, resolve=True))
    if isinstance(value, Mapping) and not isinstance(value, TrainingParams):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return value


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
    try:
        check_keys(f"{ROOT}.optimizer_params", values["optimizer_params"], valid, reserved, open_ended=var_kw)
    except Invalid as e:
        errors.append(f"{e} (for optimizer {cls.__name__})" if "unknown key" in str(e) else str(e))
    return errors


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
                      f"fusetrain.training.sharded_checkpoints CKPT OUT, then load them into the model)")
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


def _cross_checks(values: Dict[str, Any]) -> List[str]:
    errors: List[str] = []
    we, ws = values["lr_warmup_epochs"], values["lr_warmup_steps"]
    if we > 0 and ws > 0:
        errors.append(f"{ROOT}.lr_warmup_epochs / lr_warmup_steps: got {we!r} and {ws!r}; "
                      f"allowed: at most one of them > 0")
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


def resolve_training_params(user: Optional[Mapping[str, Any]] = None) -> "TrainingParams":
    """Validate ``user`` (a dict or an OmegaConf DictConfig; None for all
    defaults) and return the complete, normalised :class:`TrainingParams`.

    Raises :class:`TrainingParamsError` listing every problem: unknown keys
    (with the closest valid key), invalid values, inconsistent combinations."""
    if isinstance(user, TrainingParams):
        return user
    try:
        user = _plain(user) if user is not None else {}
    except Exception as e:  # an OmegaConf interpolation that does not resolve, ...
        raise TrainingParamsError([f"{ROOT}: cannot read the config: {e}"]) from e
    if not isinstance(user, Mapping):
        raise TrainingParamsError([f"{ROOT}: got {show(user)} ({type_name(user)}); allowed: a dict (or an "
                                   f"OmegaConf DictConfig) of training parameters"])
    errors: List[str] = []
    for key in user:
        if not isinstance(key, str):
            errors.append(f"{ROOT}: keys must be strings, got {key!r} ({type_name(key)})")
        elif key not in TRAINING_PARAMS:
            errors.append(unknown_key(ROOT, key, list(TRAINING_PARAMS), KEY_HINTS))
    values: Dict[str, Any] = {}
    for name, spec in TRAINING_PARAMS.items():
        raw = user[name] if name in user else copy.deepcopy(spec.default)
        try:
            values[name] = spec.validator(raw, f"{ROOT}.{name}")
        except Invalid as e:
            errors.append(str(e))
    if errors:
        raise TrainingParamsError(errors)
    errors = _cross_checks(values)
    if errors:
        raise TrainingParamsError(errors)
    defaulted = ()
    if values["train_metrics"] is None:
        values["train_metrics"] = default_train_metrics(values["loss"])
        defaulted = ("train_metrics",)
    return TrainingParams._from_values(values, defaulted)


def _thaw(value: Any) -> Any:
    """A copy of the containers of ``value`` (leaves such as classes and modules are shared)."""
    if isinstance(value, dict):
        return {k: _thaw(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_thaw(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_thaw(v) for v in value)
    return value


def _qualified_name(obj: Any) -> str:
    target = obj if isinstance(obj, type) or hasattr(obj, "__qualname__") else type(obj)
    module = getattr(target, "__module__", None)
    qualname = getattr(target, "__qualname__", None) or repr(target)
    return f"{module}.{qualname}" if module and module != "builtins" else qualname


def _json_safe(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, type) or callable(value):
        return _qualified_name(value)
    return repr(value)


class TrainingParams(Mapping):
    """Resolved, immutable training parameters: ``params.max_epochs`` or
    ``params["max_epochs"]``. ``TrainingParams(user)`` is
    ``resolve_training_params(user)``; ``replace(**changes)`` returns a new,
    re-validated copy. Container values (lists, dicts) are returned as copies,
    so changing them never changes the parameters.

    NOTE [task defaults]: a value that follows other keys when not given
    (``train_metrics`` follows ``loss``) is re-derived by ``replace``, so it
    fits the final params; ``_defaulted`` names those values."""

    __slots__ = ("_values", "_defaulted")

    def __init__(self, user: Optional[Mapping[str, Any]] = None) -> None:
        resolved = resolve_training_params(user)
        object.__setattr__(self, "_values", resolved._values)
        object.__setattr__(self, "_defaulted", resolved._defaulted)

    @classmethod
    def _from_values(cls, values: Dict[str, Any], defaulted: Sequence[str] = ()) -> "TrainingParams":
        obj = object.__new__(cls)
        object.__setattr__(obj, "_values", values)
        object.__setattr__(obj, "_defaulted", tuple(defaulted))
        return obj

    def _given(self) -> Dict[str, Any]:
        """The parameters without the task defaults (NOTE [task defaults])."""
        return {k: _thaw(v) for k, v in self._values.items() if k not in self._defaulted}

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        values = self._values
        if name in values:
            return _thaw(values[name])
        raise AttributeError(unknown_key("TrainingParams", name, list(values)))

    def __getitem__(self, key: str) -> Any:
        return _thaw(self._values[key])

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __dir__(self) -> List[str]:
        return sorted(set(super().__dir__()) | set(self._values))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"TrainingParams is immutable: cannot set {name!r}; use params.replace({name}=...) "
                             f"for a modified copy")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"TrainingParams is immutable: cannot delete {name!r}")

    def __reduce__(self):
        return (resolve_training_params, (self._given(),))

    def __repr__(self) -> str:
        return "TrainingParams(" + ", ".join(f"{k}={v!r}" for k, v in self._values.items()) + ")"

    def to_dict(self, json_safe: bool = False) -> Dict[str, Any]:
        """A plain dict of all parameters. With ``json_safe``, classes and
        callables (a custom optimizer, loss or compile backend) are given by
        their qualified name and tuples become lists, so ``json.dumps`` works."""
        if json_safe:
            return {k: _json_safe(v) for k, v in self._values.items()}
        return {k: _thaw(v) for k, v in self._values.items()}

    def replace(self, **changes: Any) -> "TrainingParams":
        """A new TrainingParams with ``changes`` applied and everything re-validated."""
        return resolve_training_params({**self._given(), **changes})
