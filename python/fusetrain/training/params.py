"""The ``training_params`` schema of the Trainer: keys, defaults, validation and
the reference page.

:data:`TRAINING_PARAMS` is the ordered table of :class:`ParamSpec` rows (name,
allowed values, default, documentation, validator).
:func:`resolve_training_params` turns a user mapping (a dict, or an OmegaConf /
Hydra config) into an immutable :class:`TrainingParams`: defaults filled in,
every value checked (nested dicts included) and normalised, unknown keys
reported with the closest valid key. Problems raise
:class:`TrainingParamsError` with messages of the form
``training_params.<key>: got <value> (<type>); allowed: <description>``.

``python -m fusetrain.training.params --markdown`` prints the reference page,
``docs/training_params.md``.
"""

from __future__ import annotations

import argparse
import copy
import difflib
import inspect
import math
import numbers
import re
import sys
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Type

import torch
from torch import nn

from ..amp import LossScaler
from ..ema import ModelEMA
from ..optim import SGD, Adam, AdamW, Lion
from ..optim._base import FusedOptimizer

__all__ = [
    "ParamSpec",
    "TRAINING_PARAMS",
    "TrainingParams",
    "TrainingParamsError",
    "resolve_training_params",
    "optimizer_class",
    "render_markdown",
    "OPTIMIZERS",
    "LOSSES",
    "LR_MODES",
    "METRIC_NAMES",
    "TORCH_COMPILE_MODES",
    "COMPILE_STEP_MODES",
]

#: The built-in optimizers by canonical name (names are matched case-insensitively).
OPTIMIZERS: Mapping[str, Type[torch.optim.Optimizer]] = MappingProxyType(
    {"AdamW": AdamW, "Adam": Adam, "SGD": SGD, "Lion": Lion})
#: The built-in losses by name: the torch.nn class that ``loss_params`` configure.
LOSSES: Mapping[str, Type[nn.Module]] = MappingProxyType({
    "cross_entropy": nn.CrossEntropyLoss, "mse": nn.MSELoss, "l1": nn.L1Loss, "smooth_l1": nn.SmoothL1Loss,
    "bce_with_logits": nn.BCEWithLogitsLoss, "nll": nn.NLLLoss})
LR_MODES = ("constant", "step", "cosine", "onecycle", "cyclic", "linear")
METRIC_NAMES = ("accuracy", "top5", "loss")
TORCH_COMPILE_MODES = ("default", "reduce-overhead", "max-autotune")
_PRECISIONS = ("fp16", "bf16", "fp32")
_ROOT = "training_params"

# ``python -m fusetrain.training.params`` imports this module through its package
# before running it as __main__; runpy warns about that, harmlessly here (the
# __main__ block below delegates to this module).
warnings.filterwarnings("ignore", category=RuntimeWarning,
                        message=r"'fusetrain\.training\.params' found in sys\.modules after import of package")


class TrainingParamsError(ValueError):
    """Invalid ``training_params``. ``errors`` lists every problem found, one
    message each; the exception message is the single problem, or all of them."""

    def __init__(self, errors: Sequence[str]) -> None:
        self.errors = list(errors)
        if len(self.errors) == 1:
            message = self.errors[0]
        else:
            message = f"{_ROOT}: {len(self.errors)} problems:\n" + "\n".join(f"  - {e}" for e in self.errors)
        super().__init__(message)


class _Invalid(Exception):
    """Raised by validators; carries the complete user-facing message."""


# ---- validators ------------------------------------------------------------------------------
#
# A validator is called as ``validator(value, path)`` and returns the normalised
# value or raises _Invalid; ``validator.description`` is the "allowed: ..."
# text, also shown in the reference table.


class _Validator:
    __slots__ = ("description", "_check")

    def __init__(self, description: str, check: Callable[[Any, str], Any]) -> None:
        self.description = description
        self._check = check

    def __call__(self, value: Any, path: str) -> Any:
        return self._check(value, path)

    def __repr__(self) -> str:
        return f"<validator: {self.description}>"


def _type_name(value: Any) -> str:
    return type(value).__name__


def _show(value: Any) -> str:
    """repr for messages: objects with a multi-line repr (modules, optimizers)
    by their type, long reprs shortened."""
    text = repr(value)
    if "\n" in text:
        return f"<{type(value).__qualname__} object>"
    return text if len(text) <= 160 else text[:157] + "..."


def _reject(path: str, value: Any, allowed: str) -> "None":
    raise _Invalid(f"{path}: got {_show(value)} ({_type_name(value)}); allowed: {allowed}")


def _fmt_num(x: Any) -> str:
    return str(int(x)) if isinstance(x, float) and x.is_integer() else repr(x)


def _bounds_text(lo: Any, hi: Any, lo_inclusive: bool, hi_inclusive: bool) -> str:
    if lo is not None and hi is not None:
        return (f" in {'[' if lo_inclusive else '('}{_fmt_num(lo)}, "
                f"{_fmt_num(hi)}{']' if hi_inclusive else ')'}")
    if lo is not None:
        return f" {'>=' if lo_inclusive else '>'} {_fmt_num(lo)}"
    if hi is not None:
        return f" {'<=' if hi_inclusive else '<'} {_fmt_num(hi)}"
    return ""


def _in_bounds(v: float, lo: Any, hi: Any, lo_inclusive: bool, hi_inclusive: bool) -> bool:
    if lo is not None and (v < lo if lo_inclusive else v <= lo):
        return False
    if hi is not None and (v > hi if hi_inclusive else v >= hi):
        return False
    return True


def _int(min: Optional[int] = None, max: Optional[int] = None) -> _Validator:
    """An int (bools rejected) in [min, max]."""
    desc = "an int" + _bounds_text(min, max, True, True)

    def check(v: Any, path: str) -> int:
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or not _in_bounds(int(v), min, max, True, True):
            _reject(path, v, desc)
        return int(v)

    return _Validator(desc, check)


def _float(min: Optional[float] = None, max: Optional[float] = None, min_inclusive: bool = True,
           max_inclusive: bool = True) -> _Validator:
    """A finite float (ints accepted, bools rejected) within the bounds."""
    desc = "a float" + _bounds_text(min, max, min_inclusive, max_inclusive)

    def check(v: Any, path: str) -> float:
        if (isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(float(v))
                or not _in_bounds(float(v), min, max, min_inclusive, max_inclusive)):
            _reject(path, v, desc)
        return float(v)

    return _Validator(desc, check)


def _bool() -> _Validator:
    """A real bool: 1/0 and strings such as "yes" are rejected (YAML true/false load as bools)."""
    desc = "a bool (true or false)"

    def check(v: Any, path: str) -> bool:
        if not isinstance(v, bool):
            _reject(path, v, desc)
        return v

    return _Validator(desc, check)


def _str(description: str = "a non-empty string") -> _Validator:
    def check(v: Any, path: str) -> str:
        if not isinstance(v, str) or not v:
            _reject(path, v, description)
        return v

    return _Validator(description, check)


def _choice(*choices: str, case_insensitive: bool = False, description: Optional[str] = None) -> _Validator:
    """One of ``choices``; with ``case_insensitive`` matched ignoring case and
    normalised to the spelling in ``choices``."""
    desc = description or ("one of " + ", ".join(repr(c) for c in choices)
                           + (" (case-insensitive)" if case_insensitive else ""))
    canonical = {(c.lower() if case_insensitive else c): c for c in choices}

    def check(v: Any, path: str) -> str:
        if isinstance(v, str):
            key = v.lower() if case_insensitive else v
            if key in canonical:
                return canonical[key]
        _reject(path, v, desc)

    return _Validator(desc, check)


def _regex(pattern: str, description: str) -> _Validator:
    rx = re.compile(pattern)

    def check(v: Any, path: str) -> str:
        if not isinstance(v, str) or not rx.fullmatch(v):
            _reject(path, v, description)
        return v

    return _Validator(description, check)


def _optional(inner: _Validator) -> _Validator:
    """``inner`` or None."""
    desc = f"{inner.description} or None"

    def check(v: Any, path: str) -> Any:
        if v is None:
            return None
        try:
            return inner(v, path)
        except _Invalid as e:
            if str(e).startswith(f"{path}: got "):  # the value itself is wrong: say that None works too
                _reject(path, v, desc)
            raise  # a problem inside it (a nested key) keeps its own message

    return _Validator(desc, check)


def _any_of(*alternatives: _Validator, description: Optional[str] = None) -> _Validator:
    """The first alternative that accepts the value."""
    descs = [a.description for a in alternatives]
    desc = description or (descs[0] if len(descs) == 1 else ", ".join(descs[:-1]) + " or " + descs[-1])

    def check(v: Any, path: str) -> Any:
        for a in alternatives:
            try:
                return a(v, path)
            except _Invalid:
                pass
        _reject(path, v, desc)

    return _Validator(desc, check)


def _subclass_of(base: type, description: str) -> _Validator:
    def check(v: Any, path: str) -> type:
        if not (isinstance(v, type) and issubclass(v, base)):
            _reject(path, v, description)
        return v

    return _Validator(description, check)


def _callable(description: str) -> _Validator:
    """A callable object or function; classes and strings are rejected."""

    def check(v: Any, path: str) -> Any:
        if isinstance(v, (type, str)) or not callable(v):
            _reject(path, v, description)
        return v

    return _Validator(description, check)


def _list_of(item: _Validator, description: Optional[str] = None, unique: bool = False) -> _Validator:
    """A list (or tuple) of items accepted by ``item``; returns a list."""
    desc = description or (f"a list of values, each {item.description}" + (", no duplicates" if unique else ""))

    def check(v: Any, path: str) -> List[Any]:
        if not isinstance(v, (list, tuple)):
            _reject(path, v, desc)
        out = [item(x, f"{path}[{i}]") for i, x in enumerate(v)]
        if unique and len(set(out)) != len(out):
            _reject(path, v, desc)
        return out

    return _Validator(desc, check)


def _string_keyed_dict(v: Any, path: str, desc: str) -> Dict[str, Any]:
    if not isinstance(v, Mapping) or not all(isinstance(k, str) for k in v):
        _reject(path, v, desc)
    return dict(v)


def _dict(description: str = "a dict with string keys") -> _Validator:
    """Any mapping with string keys (values unchecked)."""

    def check(v: Any, path: str) -> Dict[str, Any]:
        return _string_keyed_dict(v, path, description)

    return _Validator(description, check)


def _unknown_key(path: str, key: str, valid: Sequence[str], hints: Optional[Mapping[str, str]] = None) -> str:
    """The message for an unknown key, suggesting the closest valid one."""
    if hints and key in hints:
        return f"{path}: unknown key {key!r}; did you mean {hints[key]!r}?"
    close = difflib.get_close_matches(key, list(valid), n=1, cutoff=0.6)
    if close:
        return f"{path}: unknown key {key!r}; did you mean {close[0]!r}?"
    listed = ", ".join(valid) if valid else "(none)"
    return f"{path}: unknown key {key!r}; valid keys: {listed}"


def _check_keys(path: str, mapping: Mapping[str, Any], valid: Sequence[str], reserved: Mapping[str, str],
                open_ended: bool = False) -> None:
    """Raise for a reserved key (with its reason) or a key not in ``valid``
    (unless ``open_ended``: the target takes ``**kwargs``)."""
    for key in mapping:
        if key in reserved:
            raise _Invalid(f"{path}: key {key!r} is not allowed; {reserved[key]}")
        if key not in valid and not open_ended:
            raise _Invalid(_unknown_key(path, key, valid))


def _record(fields: Mapping[str, _Validator], required: Sequence[str] = (),
            defaults: Optional[Mapping[str, Any]] = None, reserved: Optional[Mapping[str, str]] = None,
            description: Optional[str] = None) -> _Validator:
    """A dict with known keys, each checked by its own validator; ``required``
    keys must be present, ``defaults`` fill missing ones, other keys are left out."""
    defaults = dict(defaults or {})
    reserved = dict(reserved or {})
    parts = []
    for k, v in fields.items():
        extra = ", required" if k in required else (f", default {defaults[k]!r}" if k in defaults else "")
        parts.append(f"{k}: {v.description}{extra}")
    desc = description or "a dict {" + "; ".join(parts) + "}"

    def check(v: Any, path: str) -> Dict[str, Any]:
        v = _string_keyed_dict(v, path, desc)
        _check_keys(path, v, list(fields), reserved)
        for k in required:
            if k not in v:
                raise _Invalid(f"{path}: missing required key {k!r} ({fields[k].description})")
        out = {}
        for k, val in fields.items():
            if k in v:
                out[k] = val(v[k], f"{path}.{k}")
            elif k in defaults:
                out[k] = copy.deepcopy(defaults[k])
        return out

    return _Validator(desc, check)


def _init_kwargs(cls: type, skip_first: bool = False, exclude: Sequence[str] = ()) -> Tuple[Tuple[str, ...], bool]:
    """Keyword-argument names of ``cls.__init__`` (without ``self``, the first
    positional argument if ``skip_first``, and ``exclude``), and whether it
    takes ``**kwargs``."""
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    if skip_first and params and params[0].kind in (inspect.Parameter.POSITIONAL_ONLY,
                                                    inspect.Parameter.POSITIONAL_OR_KEYWORD):
        params = params[1:]
    names = tuple(p.name for p in params
                  if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
                  and p.name not in exclude)
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    return names, var_kw


def _kwargs_of(cls: type, exclude: Sequence[str], reserved: Mapping[str, str], description: str) -> _Validator:
    """A dict of keyword arguments of ``cls`` (keys checked, values left to the constructor)."""

    def check(v: Any, path: str) -> Dict[str, Any]:
        v = _string_keyed_dict(v, path, description)
        names, var_kw = _init_kwargs(cls, exclude=tuple(exclude) + tuple(reserved))
        _check_keys(path, v, names, reserved, open_ended=var_kw)
        return v

    return _Validator(description, check)


# ---- the schema -------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParamSpec:
    """One training parameter: its name, the allowed values (in words), the
    default, the user-facing documentation and the validator."""

    name: str
    allowed: str
    default: Any
    doc: str
    validator: Callable[[Any, str], Any]


_EMA_RESERVED = {"model": "the EMA follows the model being trained"}
_SCALER_RESERVED = {"device": "the scaler follows the training device",
                    "enabled": "loss scaling is enabled by mixed_precision='fp16' (and only then)"}
_OPTIMIZER_RESERVED = {"params": "the parameters come from the model",
                       "lr": "set the learning rate with training_params.initial_lr"}
_FUSED_RESERVED = {"max_grad_norm": "set gradient clipping with training_params.clip_grad_norm"}
_LOSS_RESERVED = {"size_average": "deprecated by torch; use reduction", "reduce": "deprecated by torch; use reduction"}
_COMPILE_RESERVED = {"mode": "set it with training_params.torch_compile_mode", "model": "the model is compiled"}

_V_OPTIMIZER = _any_of(_choice(*OPTIMIZERS, case_insensitive=True),
                       _subclass_of(torch.optim.Optimizer, "a torch.optim.Optimizer subclass (the class, "
                                                                    "not an instance)"))
_V_LOSS = _any_of(_choice(*LOSSES), _callable("a callable (outputs, targets) -> loss (an nn.Module instance "
                                              "or a function)"))
_V_METRICS = _list_of(_choice(*METRIC_NAMES), unique=True,
                      description="a list of metric names from " + ", ".join(repr(m) for m in METRIC_NAMES)
                      + " (no duplicates)")
_V_EPOCHS = _list_of(_int(min=1), description="a list of ints >= 1 (epochs)")
_V_COMPILE_OPTIONS = _record(
    {"fullgraph": _bool(), "dynamic": _optional(_bool()),
     "backend": _any_of(_str("a backend name"), _callable("a callable backend")),
     "options": _dict(), "disable": _bool()},
    reserved=_COMPILE_RESERVED,
    description="a dict of torch.compile keyword arguments: fullgraph, dynamic, backend, options, disable")
_V_EARLY_STOPPING = _optional(_record({"patience": _int(min=1), "min_delta": _float(min=0)}, required=("patience",),
                                      defaults={"min_delta": 0.0}))


def _multi_gpu_check(v: Any, path: str) -> str:
    if isinstance(v, bool):  # YAML 1.1 reads a bare off/on as a boolean
        return "ddp" if v else "off"
    if isinstance(v, str) and v.lower() in ("off", "auto", "ddp"):
        return v.lower()
    _reject(path, v, _MULTI_GPU_DESC)


_MULTI_GPU_DESC = "one of 'off', 'auto', 'ddp' (case-insensitive; false means 'off', true 'ddp')"
_V_MULTI_GPU = _Validator(_MULTI_GPU_DESC, _multi_gpu_check)


COMPILE_STEP_MODES = ("off", "compile", "cuda_graph")
_COMPILE_STEP_DESC = "one of 'off', 'compile', 'cuda_graph' (false means 'off')"


def _compile_step_check(v: Any, path: str) -> str:
    if v is False:  # YAML 1.1 reads a bare off as a boolean
        return "off"
    if isinstance(v, str) and v in COMPILE_STEP_MODES:
        return v
    _reject(path, v, _COMPILE_STEP_DESC)


_V_COMPILE_STEP = _Validator(_COMPILE_STEP_DESC, _compile_step_check)


def _p(name: str, validator: _Validator, default: Any, doc: str) -> ParamSpec:
    return ParamSpec(name, validator.description, default, " ".join(doc.split()), validator)


_SPECS = [
    _p("max_epochs", _int(min=1), 10, """
        Number of passes over the training loader. Schedules (and the EMA's `exp` decay horizon) span
        `max_epochs` times the number of optimizer steps per epoch."""),
    _p("optimizer", _V_OPTIMIZER, "AdamW", """
        The optimizer. A name selects one of fusetrain's fused optimizers (`fusetrain.optim.AdamW`, `Adam`, `SGD`,
        `Lion`), whose whole step (unscaling of fp16 gradients, non-finite check, clipping, update and EMA) runs in
        fused kernels without synchronising with the host; its learning rate is a device tensor that the schedule
        rewrites each step. Names are case-insensitive and normalised to the spelling shown. From Python, a
        `torch.optim.Optimizer` subclass may be given instead: it is built as
        `cls(param_groups, lr=initial_lr, **optimizer_params)` and stepped the ordinary way (clipping with
        `torch.nn.utils.clip_grad_norm_`)."""),
    _p("optimizer_params", _dict("a dict of the optimizer's keyword arguments"), {}, """
        Further keyword arguments of the optimizer's constructor, e.g. `{weight_decay: 0.05, betas: [0.9, 0.95]}`
        for AdamW or `{momentum: 0.9, nesterov: true}` for SGD. Keys are checked against the constructor's
        signature; values are checked by the optimizer when it is built. The learning rate comes from `initial_lr`
        and the parameters from the model, so `lr` and `params` are not allowed here; for fusetrain optimizers
        `max_grad_norm` is set from `clip_grad_norm`."""),
    _p("initial_lr", _float(min=0, min_inclusive=False), 1e-3, """
        The base (peak) learning rate: the value reached at the end of warmup, from which the schedule of `lr_mode`
        starts."""),
    _p("lr_mode", _choice(*LR_MODES), "constant", """
        The learning-rate schedule after warmup, evaluated for each optimizer step on the host from the step index
        and written into the optimizer's learning-rate tensor (no host synchronisation, no recompilation under
        `torch.compile`). `constant` keeps `initial_lr`; `step` multiplies it by `lr_decay_factor` at each epoch of
        `lr_updates`; `cosine` anneals it to `initial_lr * cosine_final_lr_ratio` along a half cosine; `linear`
        decays it linearly to `initial_lr * linear_final_lr_ratio`; `onecycle` rises from
        `initial_lr / onecycle_div_factor` to `initial_lr` over the first `onecycle_pct_start` of the steps, then
        anneals to `initial_lr / (onecycle_div_factor * onecycle_final_div_factor)` (both phases cosine, like
        `torch.optim.lr_scheduler.OneCycleLR`); `cyclic` is a triangular wave between
        `initial_lr * cyclic_min_lr_ratio` and `initial_lr` with a period of `cyclic_period_epochs`. The decaying
        schedules span the steps from the end of warmup to the last step of `max_epochs`."""),
    _p("lr_updates", _V_EPOCHS, [], """
        For `lr_mode: step`, the epochs at which the learning rate is multiplied by `lr_decay_factor`: an entry `e`
        applies from the moment `e` epochs are complete. With `lr_mode: step` the list must be non-empty, in
        increasing order without duplicates, and each entry below `max_epochs`; other modes ignore it."""),
    _p("lr_decay_factor", _float(min=0, max=1, min_inclusive=False), 0.1, """
        For `lr_mode: step`, the factor applied at each epoch of `lr_updates`; after `k` of them the learning rate
        is `initial_lr * lr_decay_factor ** k`."""),
    _p("cosine_final_lr_ratio", _float(min=0, max=1), 0.01, """
        For `lr_mode: cosine`, the learning rate at the last optimizer step, as a fraction of `initial_lr`."""),
    _p("linear_final_lr_ratio", _float(min=0, max=1), 0.0, """
        For `lr_mode: linear`, the learning rate at the last optimizer step, as a fraction of `initial_lr`."""),
    _p("onecycle_pct_start", _float(min=0, max=1, min_inclusive=False, max_inclusive=False), 0.3, """
        For `lr_mode: onecycle`, the fraction of the (post-warmup) steps spent rising to `initial_lr`."""),
    _p("onecycle_div_factor", _float(min=0, min_inclusive=False), 25.0, """
        For `lr_mode: onecycle`, the starting learning rate is `initial_lr / onecycle_div_factor`."""),
    _p("onecycle_final_div_factor", _float(min=0, min_inclusive=False), 1e4, """
        For `lr_mode: onecycle`, the final learning rate is the starting one divided by this factor, i.e.
        `initial_lr / (onecycle_div_factor * onecycle_final_div_factor)`."""),
    _p("cyclic_min_lr_ratio", _float(min=0, max=1, min_inclusive=False), 0.1, """
        For `lr_mode: cyclic`, the low end of the triangular wave as a fraction of `initial_lr` (the high end is
        `initial_lr`)."""),
    _p("cyclic_period_epochs", _float(min=0, min_inclusive=False), 2.0, """
        For `lr_mode: cyclic`, the length of one low-high-low cycle in epochs (fractions allowed; at least one
        optimizer step)."""),
    _p("lr_warmup_epochs", _int(min=0), 0, """
        Length of the linear learning-rate warmup in epochs (converted to optimizer steps): over W warmup steps
        the rate rises linearly from `warmup_initial_lr` (step k runs at
        `warmup_initial_lr + (initial_lr - warmup_initial_lr) * (k + 1) / W`) and reaches `initial_lr` at the last
        warmup step, then the schedule of `lr_mode` runs
        over the remaining steps. 0 disables warmup. At most one of `lr_warmup_epochs` and `lr_warmup_steps` may be
        non-zero."""),
    _p("lr_warmup_steps", _int(min=0), 0, """
        Length of the linear learning-rate warmup in optimizer steps, for runs whose epochs are long; otherwise as
        `lr_warmup_epochs` (at most one of the two may be non-zero)."""),
    _p("warmup_initial_lr", _optional(_float(min=0)), None, """
        The learning rate at the start of warmup; None means `initial_lr * 0.01`."""),
    _p("zero_weight_decay_on_bias_and_bn", _bool(), False, """
        Put every one-dimensional parameter (biases and the weights of normalisation layers such as BatchNorm,
        LayerNorm and GroupNorm) in a parameter group with weight decay 0; the other parameters keep the
        optimizer's `weight_decay`."""),
    _p("mixed_precision", _any_of(_bool(), _choice(*_PRECISIONS, case_insensitive=True)), False, """
        Precision of the forward passes (training and validation), resolved for the training device by
        `fusetrain.resolve_precision`. `false` or `fp32`: float32 throughout. `bf16`: `torch.autocast` with
        bfloat16, no loss scaling. `fp16`: autocast with float16 and a `fusetrain.LossScaler` (see
        `scaler_params`) whose unscaling, non-finite check and step skipping happen inside the fused optimizer
        step, on the device. `true`: bf16 on CPU and on GPUs that support it, fp16 on older GPUs. Weights and
        optimizer state stay float32. Strings are case-insensitive and normalised to lower case."""),
    _p("scaler_params", _kwargs_of(LossScaler, ("device", "enabled"), _SCALER_RESERVED, "a dict of "
                                   "fusetrain.LossScaler keyword arguments"), {}, """
        Keyword arguments of `fusetrain.LossScaler` for fp16 training (dynamic loss scaling: the initial scale, how
        it grows after a run of finite steps and shrinks after a non-finite one). Ignored for the other precisions.
        `device` and `enabled` are set by the Trainer. Values are checked when the scaler is built."""),
    _p("torch_compile", _bool(), False, """
        Compile the model with `torch.compile(model, mode=torch_compile_mode, **torch_compile_options)` for training
        (and the EMA model for validation). The first steps then include the compilation time."""),
    _p("torch_compile_mode", _choice(*TORCH_COMPILE_MODES), "default", """
        The `mode` argument of `torch.compile`; `reduce-overhead` uses CUDA graphs, `max-autotune` searches for the
        fastest kernels (long compilation). Used when `torch_compile` is true or `compile_step` is `compile`."""),
    _p("torch_compile_options", _V_COMPILE_OPTIONS, {}, """
        Further keyword arguments of `torch.compile`: `fullgraph` (bool), `dynamic` (bool or None), `backend` (a
        backend name or, from Python, a callable), `options` (a dict of backend options) and `disable` (bool). The
        mode comes from `torch_compile_mode`. Used when `torch_compile` is true or `compile_step` is `compile`."""),
    _p("compile_step", _V_COMPILE_STEP, "off", """
        How each training step runs (`fusetrain.TrainStep`). `off`: eagerly. `compile`: the whole step (autocast
        forward, loss, scaled backward, the fused optimizer step with clipping and EMA, the loss-scale update) under
        `torch.compile` with `torch_compile_mode` and `torch_compile_options`; dynamo splits it at `backward()` into
        a forward graph (its backward compiled by AOTAutograd) and a tail graph, and with a `torch.optim`
        optimizer only forward and backward are compiled. `cuda_graph`: the step captured as CUDA graphs and
        replayed for every batch (a GPU and a fusetrain optimizer are required; the first 3 optimizer steps run
        eagerly as warm-up, then the batch is copied into static buffers, gradients stay allocated and are zeroed
        in place; with `batch_accumulate` > 1 a micro-step graph and a step graph share one memory pool). Both are
        built for the shapes of the first batch: a smaller last batch of an epoch runs eagerly (exact, nothing
        dropped, nothing recompiled); any other shape, dtype or device change also runs eagerly with a one-time
        warning. The learning rate and the EMA decay are device tensors, so schedules never recompile or
        recapture; a resumed run builds a fresh step. The model must not synchronise with the host in its
        forward (no `.item()`, no `if` on a tensor) for `cuda_graph`; capture fails with an explanation
        otherwise. With `torch_compile` also true, `compile_step` compiles the training step (the model is not
        compiled a second time) and `torch_compile` compiles the model used for validation. `false` means `off`.
        Not available in distributed runs with `cuda_graph`."""),
    _p("ema", _bool(), False, """
        Keep an exponential moving average of the weights (`fusetrain.ModelEMA`, configured by `ema_params`). With
        a fusetrain optimizer the EMA update rides in the fused optimizer step, and a skipped (non-finite) step
        leaves the EMA untouched. Validation then runs on the EMA weights, and checkpoints include the EMA."""),
    _p("ema_params", _kwargs_of(ModelEMA, ("model",), _EMA_RESERVED, "a dict of fusetrain.ModelEMA keyword "
                                "arguments"), {}, """
        Keyword arguments of `fusetrain.ModelEMA`, e.g. `{decay: 0.9999, decay_type: exp, beta: 15}`;
        `total_steps` defaults to the run's number of optimizer steps. Values are checked when the EMA is built.
        Ignored when `ema` is false."""),
    _p("clip_grad_norm", _optional(_float(min=0, min_inclusive=False)), None, """
        Clip gradients to this global L2 norm inside the fused optimizer step (computed on the device, no host
        sync); applied to unscaled gradients under fp16. With clipping on, a step whose gradients are not finite is
        skipped. None disables clipping."""),
    _p("batch_accumulate", _int(min=1), 1, """
        Number of batches whose gradients are accumulated before each optimizer step. Each batch's loss is divided
        by `batch_accumulate`, so the step sees the mean gradient and the effective batch size is
        `batch_size * batch_accumulate`; a partial group at the end of an epoch also steps. Schedules count
        optimizer steps."""),
    _p("sync_bn", _bool(), False, """
        Convert BatchNorm layers to `torch.nn.SyncBatchNorm`, which synchronises batch statistics across processes.
        Only meaningful in a `torch.distributed` run; otherwise a warning is issued and the layers stay local."""),
    _p("channels_last", _bool(), False, """
        Use the channels-last memory format for the model and the 4-d input batches, which speeds up convolutions on
        tensor-core GPUs (especially with mixed precision)."""),
    _p("loss", _V_LOSS, "cross_entropy", """
        The loss, called as `loss(outputs, targets)`. A name builds the torch.nn loss with `loss_params` as
        constructor arguments: `cross_entropy` is `nn.CrossEntropyLoss`, `mse` `nn.MSELoss`, `l1` `nn.L1Loss`,
        `smooth_l1` `nn.SmoothL1Loss`, `bce_with_logits` `nn.BCEWithLogitsLoss`, `nll` `nn.NLLLoss`. From Python a
        callable can be given instead: an `nn.Module` instance (moved to the training device) or a function."""),
    _p("loss_params", _dict("a dict of the loss class's keyword arguments"), {}, """
        Keyword arguments of the named loss's torch.nn class, e.g. `{label_smoothing: 0.1}` for `cross_entropy`;
        keys are checked against its signature. Must be empty when `loss` is a callable."""),
    _p("train_metrics", _V_METRICS, ["accuracy"], """
        Metrics accumulated on the device over each epoch's training batches and read once at its end, reported as
        `train_<name>`: `accuracy` (top-1), `top5` (top-5 accuracy) and `loss` (the mean loss). The mean training
        loss is always reported as `train_loss`."""),
    _p("valid_metrics", _V_METRICS, ["accuracy"], """
        Metrics computed on the validation loader, reported as `valid_<name>`; the mean validation loss is always
        reported as `valid_loss`."""),
    _p("metric_to_watch", _choice(*METRIC_NAMES, description="'loss' or one of valid_metrics (metric names: "
                                  + ", ".join(repr(m) for m in METRIC_NAMES) + ")"), "accuracy", """
        The validation metric that selects the best checkpoint and drives `early_stopping`: `loss` or one of
        `valid_metrics`."""),
    _p("greater_metric_to_watch_is_better", _bool(), True, """
        Whether a larger `metric_to_watch` is better: true for accuracies, false when watching `loss`."""),
    _p("run_validation_freq", _int(min=1), 1, """
        Validate every `run_validation_freq` epochs; the last epoch is always validated."""),
    _p("max_train_batches", _optional(_int(min=1)), None, """
        Use at most this many batches of the training loader per epoch (None: all of them), e.g. for quick runs.
        The schedules follow the shortened epochs."""),
    _p("max_valid_batches", _optional(_int(min=1)), None, """
        Use at most this many batches of the validation loader at each validation (None: all of them)."""),
    _p("save_ckpt_epoch_list", _V_EPOCHS, [], """
        Epochs (counted from 1) after which an extra checkpoint `ckpt_epoch_<N>.pth` is kept in the experiment
        directory, besides `ckpt_latest.pth` (written after every epoch) and `ckpt_best.pth` (the best
        `metric_to_watch` so far)."""),
    _p("resume", _bool(), False, """
        Continue the run from a checkpoint: `resume_path` if set, else the experiment's `ckpt_latest.pth`. The
        model, optimizer (with master weights), loss scaler, EMA, schedule position, best metric and random states
        are restored, so training continues where it stopped."""),
    _p("resume_path", _optional(_str("a non-empty string (a checkpoint path)")), None, """
        The checkpoint file to resume from; setting it implies `resume`. None: the experiment's `ckpt_latest.pth`
        when `resume` is true."""),
    _p("seed", _int(min=0), 42, """
        Seed of torch (CPU and CUDA), Python's `random` and NumPy, set at the start of training."""),
    _p("cudnn_benchmark", _bool(), True, """
        Set `torch.backends.cudnn.benchmark`: cuDNN times the candidate convolution algorithms for each new input
        shape and keeps the fastest (faster with fixed shapes, but not bit-reproducible across runs)."""),
    _p("early_stopping", _V_EARLY_STOPPING, None, """
        Stop training when `metric_to_watch` has not improved by more than `min_delta` for `patience` consecutive
        validations. `min_delta` also applies when choosing the best checkpoint. None disables early stopping."""),
    _p("log_interval", _int(min=0), 0, """
        Training batches between host reads of the running loss shown in the progress bar; 0 reads it only at the
        end of the epoch. Each read waits for the device, so small values cost some speed."""),
    _p("device", _any_of(_choice("auto", "cpu", "cuda"), _regex(r"cuda:\d+", "'cuda:N'"),
                         description="'auto', 'cpu', 'cuda' or 'cuda:N' (N a device index)"), "auto", """
        Where to train: `auto` picks CUDA when available, else the CPU; `cuda` is the current CUDA device,
        `cuda:N` a given one."""),
    _p("multi_gpu", _V_MULTI_GPU, "auto", """
        Data-parallel training over several processes (`torch.nn.parallel.DistributedDataParallel`, one process
        per GPU, or per CPU worker with gloo). `auto`: distributed when the process was started by a launcher
        (`torchrun --nproc_per_node=N ...`, one node or several: `RANK`/`WORLD_SIZE`/`LOCAL_RANK` in the
        environment) or when `num_gpus` / `num_processes` asks for more than one process, else a single process.
        `ddp`: the same under a launcher; otherwise the Trainer starts the workers itself on this node with
        torch's elastic launcher, `num_gpus` GPUs (default: all visible) or `num_processes` CPU processes, each
        running the same training (from Python the model, loaders and
        params are pickled to the workers; a recipe rebuilds them in each worker). `off`: a single process, and
        an error when started by a launcher with `WORLD_SIZE > 1`. Each process loads its shard of the training
        data (`DistributedSampler`), so the effective batch size is `batch_size * batch_accumulate * world_size`.
        Case-insensitive; `false` (YAML's bare `off`) means `off`, `true` means `ddp`. See the README's
        "Distributed training" section."""),
    _p("num_gpus", _optional(_int(min=1)), None, """
        With `multi_gpu: ddp` or `auto` outside a launcher, the number of GPUs (worker processes) to start on this node;
        None: all visible CUDA devices. Asking for more GPUs than are visible is an error. Ignored under a
        launcher (the launcher chose the processes)."""),
    _p("num_processes", _optional(_int(min=1)), None, """
        With `multi_gpu: ddp` or `auto` outside a launcher on the CPU, the number of worker processes to start
        (gloo backend); required for `ddp` there. Not allowed for a CUDA run (use `num_gpus`)."""),
    _p("dist_backend", _choice("auto", "nccl", "gloo"), "auto", """
        The `torch.distributed` backend when the Trainer initialises the process group: `auto` is NCCL for CUDA
        devices and gloo for the CPU. A process group the caller initialised is used as it is."""),
    _p("dist_timeout_s", _float(min=0, min_inclusive=False), 300.0, """
        Timeout in seconds of the process group's collectives and of the barrier after each epoch's checkpoint:
        if a rank dies or hangs, the others stop with an error after at most this long instead of waiting
        forever (a launcher such as torchrun usually stops them sooner, as soon as a worker exits with an
        error). Raise it when one rank may legitimately wait long for the others, e.g. a long first
        compilation."""),
    _p("find_unused_parameters", _bool(), False, """
        `DistributedDataParallel(find_unused_parameters=...)`: set it when some parameters get no gradient in a
        step (conditional branches); it costs a traversal of the autograd graph per step."""),
    _p("progress_bar", _bool(), True, """
        Show a progress bar for each epoch on stderr (when tqdm is installed)."""),
]

#: The ordered table of training parameters, by name.
TRAINING_PARAMS: Mapping[str, ParamSpec] = MappingProxyType({s.name: s for s in _SPECS})
del _SPECS

# Common names from other libraries, pointed at the key that does the job.
_KEY_HINTS = {"lr": "initial_lr", "learning_rate": "initial_lr", "weight_decay": "optimizer_params.weight_decay",
              "momentum": "optimizer_params.momentum", "amp": "mixed_precision", "epochs": "max_epochs"}


# ---- resolution -------------------------------------------------------------------------------


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
    raise ValueError(f"{_ROOT}.optimizer: got {_show(optimizer)} ({_type_name(optimizer)}); "
                     f"allowed: {_V_OPTIMIZER.description}")


def _check_optimizer(values: Dict[str, Any]) -> List[str]:
    cls = optimizer_class(values["optimizer"])
    names, var_kw = _init_kwargs(cls, skip_first=True)
    errors = []
    if "lr" not in names and not var_kw:
        errors.append(f"{_ROOT}.optimizer: {cls.__name__} takes no 'lr' argument; the Trainer builds the "
                      f"optimizer as cls(param_groups, lr=initial_lr, **optimizer_params)")
    reserved = dict(_OPTIMIZER_RESERVED, **(_FUSED_RESERVED if issubclass(cls, FusedOptimizer) else {}))
    valid = [n for n in names if n not in reserved]
    try:
        _check_keys(f"{_ROOT}.optimizer_params", values["optimizer_params"], valid, reserved, open_ended=var_kw)
    except _Invalid as e:
        errors.append(f"{e} (for optimizer {cls.__name__})" if "unknown key" in str(e) else str(e))
    return errors


def _check_loss_params(values: Dict[str, Any]) -> List[str]:
    loss, loss_params, path = values["loss"], values["loss_params"], f"{_ROOT}.loss_params"
    if not isinstance(loss, str):
        if loss_params:
            return [f"{path}: got {_show(loss_params)} (dict); allowed: only {{}} when loss is a callable "
                    f"(configure the callable itself)"]
        return []
    names, var_kw = _init_kwargs(LOSSES[loss])
    valid = [n for n in names if n not in _LOSS_RESERVED]
    try:
        _check_keys(path, loss_params, valid, _LOSS_RESERVED, open_ended=var_kw)
    except _Invalid as e:
        return [str(e)]
    return []


def _check_distributed(values: Dict[str, Any]) -> List[str]:
    errors: List[str] = []
    mg, ng, npr, dev = values["multi_gpu"], values["num_gpus"], values["num_processes"], values["device"]
    if ng is not None and npr is not None:
        errors.append(f"{_ROOT}.num_gpus / num_processes: got {ng!r} and {npr!r}; allowed: at most one of them "
                      f"(num_gpus for CUDA runs, num_processes for CPU runs)")
    if ng is not None and dev == "cpu":
        errors.append(f"{_ROOT}.num_gpus: got {ng!r} with device 'cpu'; allowed: None on the CPU (use "
                      f"num_processes)")
    if npr is not None and dev.startswith("cuda"):
        errors.append(f"{_ROOT}.num_processes: got {npr!r} with device {dev!r}; allowed: None for a CUDA run (use "
                      f"num_gpus)")
    for key, n in (("num_gpus", ng), ("num_processes", npr)):
        if n is not None and n > 1 and mg == "off":
            errors.append(f"{_ROOT}.{key}: got {n!r} with multi_gpu 'off'; allowed: 1 or None with multi_gpu 'off' "
                          f"(set multi_gpu to 'ddp' or 'auto' to start {n} processes)")
    if values["dist_backend"] == "nccl" and dev == "cpu":
        errors.append(f"{_ROOT}.dist_backend: got 'nccl' with device 'cpu'; allowed: 'gloo' or 'auto' on the CPU")
    if mg != "off" and dev.startswith("cuda:") and ng is not None and ng > 1:
        errors.append(f"{_ROOT}.device: got {dev!r} with num_gpus {ng!r}; allowed: 'auto' or 'cuda' (each process "
                      f"uses cuda:LOCAL_RANK)")
    return errors


def _check_compile_step(values: Dict[str, Any]) -> List[str]:
    if values["compile_step"] != "cuda_graph":
        return []
    errors: List[str] = []
    if values["device"] == "cpu":
        errors.append(f"{_ROOT}.compile_step: got 'cuda_graph' with device 'cpu'; CUDA graphs need a GPU; allowed "
                      f"on the CPU: 'off' or 'compile'")
    opt = values["optimizer"]
    if not isinstance(opt, str) and not issubclass(opt, FusedOptimizer):
        errors.append(f"{_ROOT}.compile_step: got 'cuda_graph' with optimizer {opt.__name__}; allowed: a fusetrain "
                      f"optimizer (its step never reads the host), or compile_step 'off' / 'compile'")
    return errors


def _cross_checks(values: Dict[str, Any]) -> List[str]:
    errors: List[str] = []
    we, ws = values["lr_warmup_epochs"], values["lr_warmup_steps"]
    if we > 0 and ws > 0:
        errors.append(f"{_ROOT}.lr_warmup_epochs / lr_warmup_steps: got {we!r} and {ws!r}; "
                      f"allowed: at most one of them > 0")
    watch, valid = values["metric_to_watch"], values["valid_metrics"]
    if watch != "loss" and watch not in valid:
        errors.append(f"{_ROOT}.metric_to_watch: got {watch!r} (str); allowed: 'loss' or one of valid_metrics "
                      f"({valid!r}); add it to valid_metrics or watch 'loss'")
    if values["lr_mode"] == "step":
        ups, max_epochs = values["lr_updates"], values["max_epochs"]
        if not ups or ups != sorted(set(ups)) or ups[-1] >= max_epochs:
            errors.append(f"{_ROOT}.lr_updates: got {_show(ups)} (list); allowed: for lr_mode 'step', a non-empty "
                          f"list of epochs in increasing order without duplicates, each >= 1 and < max_epochs "
                          f"({max_epochs})")
    errors += _check_distributed(values)
    errors += _check_optimizer(values)
    errors += _check_loss_params(values)
    errors += _check_compile_step(values)
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
        raise TrainingParamsError([f"{_ROOT}: cannot read the config: {e}"]) from e
    if not isinstance(user, Mapping):
        raise TrainingParamsError([f"{_ROOT}: got {_show(user)} ({_type_name(user)}); allowed: a dict (or an "
                                   f"OmegaConf DictConfig) of training parameters"])
    errors: List[str] = []
    for key in user:
        if not isinstance(key, str):
            errors.append(f"{_ROOT}: keys must be strings, got {key!r} ({_type_name(key)})")
        elif key not in TRAINING_PARAMS:
            errors.append(_unknown_key(_ROOT, key, list(TRAINING_PARAMS), _KEY_HINTS))
    values: Dict[str, Any] = {}
    for name, spec in TRAINING_PARAMS.items():
        raw = user[name] if name in user else copy.deepcopy(spec.default)
        try:
            values[name] = spec.validator(raw, f"{_ROOT}.{name}")
        except _Invalid as e:
            errors.append(str(e))
    if errors:
        raise TrainingParamsError(errors)
    errors = _cross_checks(values)
    if errors:
        raise TrainingParamsError(errors)
    return TrainingParams._from_values(values)


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
    so changing them never changes the parameters."""

    __slots__ = ("_values",)

    def __init__(self, user: Optional[Mapping[str, Any]] = None) -> None:
        object.__setattr__(self, "_values", resolve_training_params(user)._values)

    @classmethod
    def _from_values(cls, values: Dict[str, Any]) -> "TrainingParams":
        obj = object.__new__(cls)
        object.__setattr__(obj, "_values", values)
        return obj

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        values = self._values
        if name in values:
            return _thaw(values[name])
        raise AttributeError(_unknown_key("TrainingParams", name, list(values)))

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
        return (resolve_training_params, (self.to_dict(),))

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
        return resolve_training_params({**self.to_dict(), **changes})


# ---- reference page ---------------------------------------------------------------------------


def _keys_line(names: Sequence[str]) -> str:
    return ", ".join(f"`{n}`" for n in names)


def _details(name: str) -> List[str]:
    """Extra bullet lines for keys whose nested keys come from code."""
    if name == "optimizer_params":
        lines = []
        for opt_name, cls in OPTIMIZERS.items():
            names, _ = _init_kwargs(cls, skip_first=True)
            reserved = dict(_OPTIMIZER_RESERVED, **_FUSED_RESERVED)
            lines.append(f"- Keys for `{opt_name}`: {_keys_line([n for n in names if n not in reserved])}")
        return lines
    if name == "ema_params":
        names, _ = _init_kwargs(ModelEMA, exclude=tuple(_EMA_RESERVED))
        return [f"- Keys: {_keys_line(names)}"]
    if name == "scaler_params":
        names, _ = _init_kwargs(LossScaler, exclude=tuple(_SCALER_RESERVED))
        return [f"- Keys: {_keys_line(names)}"]
    if name == "loss_params":
        return ["- Keys: the keyword arguments of " + ", ".join(
            f"`nn.{cls.__name__}` (`{n}`)" for n, cls in LOSSES.items())]
    if name == "torch_compile_options":
        return ["- Keys: `fullgraph` (a bool), `dynamic` (a bool or None), `backend` (a backend name or a callable), "
                "`options` (a dict), `disable` (a bool)"]
    if name == "early_stopping":
        return ["- Keys: `patience` (an int >= 1, required), `min_delta` (a float >= 0, default 0.0)"]
    return []


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render_markdown() -> str:
    """The reference page of the training parameters (docs/training_params.md)."""
    out = [
        "# Training parameters",
        "",
        "<!-- Generated by `python -m fusetrain.training.params --markdown`; do not edit by hand. -->",
        "",
        "`Trainer.train(model, training_params, train_loader, valid_loader)` takes these keys as a dict or an",
        "OmegaConf/Hydra config (`fusetrain.training.resolve_training_params` validates them). Missing keys take",
        "their default. An unknown key, a value of the wrong type or out of range, or an inconsistent combination",
        "raises `TrainingParamsError` naming the key (a misspelt key gets the closest valid one suggested).",
        "Booleans must be real booleans (`true`/`false` in YAML, not 1/0 or \"yes\"); floats accept integers.",
        "Defaults are shown as Python literals: in YAML, `None` is `null` and `True`/`False` are `true`/`false`.",
        "",
        "| Key | Type / allowed values | Default |",
        "| --- | --- | --- |",
    ]
    for name, spec in TRAINING_PARAMS.items():
        out.append(f"| [`{name}`](#{name}) | {_cell(spec.allowed)} | `{_cell(repr(spec.default))}` |")
    for name, spec in TRAINING_PARAMS.items():
        out += ["", f"## {name}", "", spec.doc, "", f"- Allowed: {spec.allowed}", f"- Default: `{spec.default!r}`"]
        out += _details(name)
    return "\n".join(out) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fusetrain.training.params",
                                     description="Reference of the Trainer's training_params.")
    parser.add_argument("--markdown", action="store_true", help="print the reference page (docs/training_params.md)")
    args = parser.parse_args(argv)
    if not args.markdown:
        parser.print_help()
        return 2
    sys.stdout.write(render_markdown())
    return 0


if __name__ == "__main__":
    from fusetrain.training.params import main as _main

    sys.exit(_main())
