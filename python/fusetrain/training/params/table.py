"""The table of training parameters: one :class:`ParamSpec` per key (name,
allowed values, default, documentation, validator), in the order of the
reference page."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, List, Type

import torch

from ...amp import LossScaler
from ...ema import ModelEMA
from ...optim import OPTIMIZERS as _TABLE_OPTIMIZERS
from ..task.batches import MODEL_INPUT_MODES
from ..task.callbacks import CALLBACKS, Callback
from ..task.losses import LOSS_ALIASES, MODEL_LOSS, loss_factory
from ..task.metrics import METRICS, Metric, metric_name
from ..task.registry import import_path, resolve_name, split_spec
from .signals import EXIT_PREEMPTED, parse_signal
from .synonyms import (DEVICE_SYNONYMS, KEY_SYNONYMS, LR_MODE_SYNONYMS, OPTIMIZER_SYNONYMS, PRECISION_SYNONYMS,
                       WARMUP_MODE_SYNONYMS)
from .validators import (Invalid, Validator, show, any_of, boolean, callable_value, choice, dict_of, float_range,
                         int_range, kwargs_of, list_of, optional, record, regex, reject, str_dict, string,
                         subclass_of)

__all__ = ["ParamSpec", "TRAINING_PARAMS", "OPTIMIZERS", "LR_MODES", "TORCH_COMPILE_MODES", "COMPILE_STEP_MODES",
           "KEY_HINTS"]

#: The built-in optimizers by canonical name (names are matched case-insensitively): the optimizer table's.
OPTIMIZERS: Mapping[str, Type[torch.optim.Optimizer]] = _TABLE_OPTIMIZERS
_OPTIMIZER_NAMES = ", ".join(f"`{name}`" for name in OPTIMIZERS)
LR_MODES = ("constant", "step", "cosine", "onecycle", "cyclic", "linear", "poly", "exponential", "cosine_restarts",
            "plateau")
WARMUP_MODES = ("linear", "constant", "exponential", "linear_epoch", "linspace")
TORCH_COMPILE_MODES = ("default", "reduce-overhead", "max-autotune")
PRECISIONS = ("fp16", "bf16", "fp32")


@dataclass(frozen=True)
class ParamSpec:
    """One training parameter: its name, the allowed values (in words), the
    default, the user-facing documentation and the validator."""

    name: str
    allowed: str
    default: Any
    doc: str
    validator: Callable[[Any, str], Any]


_SIGNAL_DESC = "a signal name ('SIGTERM', 'SIGUSR1', 'USR2', ...; not SIGINT, which always stops, nor SIGKILL)"


def _signal_check(v: Any, path: str) -> str:
    try:
        return parse_signal(v)
    except ValueError as e:
        raise Invalid(f"{path}: {e}; allowed: {_SIGNAL_DESC}") from None


_V_SIGNAL = Validator(_SIGNAL_DESC, _signal_check)


EMA_RESERVED = {"model": "the EMA follows the model being trained"}
SCALER_RESERVED = {"device": "the scaler follows the training device",
                    "enabled": "loss scaling is enabled by mixed_precision='fp16' (and only then)"}
OPTIMIZER_RESERVED = {"params": "the parameters come from the model",
                       "lr": "set the learning rate with training_params.initial_lr"}
FUSED_RESERVED = {"max_grad_norm": "set gradient clipping with training_params.clip_grad_norm"}
LOSS_RESERVED = {"size_average": "deprecated by torch; use reduction", "reduce": "deprecated by torch; use reduction"}
COMPILE_RESERVED = {"mode": "set it with training_params.torch_compile_mode", "model": "the model is compiled"}

def _prefix(v: Any, path: str) -> str:
    if not isinstance(v, str):
        reject(path, v, "a key prefix (a string, may be empty)")
    return v


_V_PREFIX = Validator("a key prefix (a string, may be empty)", _prefix)
STEP_LOGGERS = ("tensorboard", "csv", "jsonl", "wandb", "mlflow")


def _logger_object(v: Any, path: str) -> Any:
    if isinstance(v, (str, type)) or not (callable(getattr(v, "log_scalars", None))
                                          and callable(getattr(v, "close", None))):
        reject(path, v, "an object with log_scalars(step, values) and close()")
    return v


_V_LOGGER_OBJECT = Validator("an object with log_scalars(step, values) and close() (from Python)", _logger_object)
_V_OPTIMIZER = any_of(choice(*OPTIMIZERS, case_insensitive=True, hints=OPTIMIZER_SYNONYMS),
                      subclass_of(torch.optim.Optimizer, "a torch.optim.Optimizer subclass (the class, not an "
                                                         "instance)"))
LOSS_DESC = ("a loss name (a torch.nn loss class name such as 'CrossEntropyLoss', one of "
             + ", ".join(repr(n) for n in LOSS_ALIASES) + f", a name registered with fusetrain.register_loss, a class "
             f"path, or {MODEL_LOSS!r}) or a callable (outputs, targets) -> loss (an nn.Module instance or a function)")


def _loss_check(v: Any, path: str) -> Any:
    if isinstance(v, str) and v:
        try:
            loss_factory(v, path)
        except ValueError as e:
            raise Invalid(str(e)) from None
        return v
    if isinstance(v, (type, str)) or not callable(v):
        reject(path, v, LOSS_DESC)
    return v


_V_LOSS = Validator(LOSS_DESC, _loss_check)


def _named_items(kind: str, registry: Mapping[str, Any], instance_of: Any, unique: bool,
                 canonical: Callable[[Any], Any] = lambda name: name) -> Validator:
    """A list of {kind}s: registered names, class paths, ``{name: {arguments}}`` or objects;
    ``canonical`` turns a name into the one it stands for (NOTE [metric names])."""
    desc = (f"a list of {kind}s, each a registered name (" + ", ".join(repr(n) for n in sorted(registry))
            + f"), a class path, a one-entry mapping {{name: {{arguments}}}}, or a {kind} object"
            + (" (no duplicates)" if unique else ""))

    def item(v: Any, path: str) -> Any:
        if isinstance(v, (str, Mapping)):
            try:
                name, kwargs = split_spec(v, path)
                name = canonical(name)
                resolve_name(name, registry, path, kind)
            except ValueError as e:
                raise Invalid(str(e)) from None
            return {name: kwargs} if isinstance(v, Mapping) else name
        if not instance_of(v):
            reject(path, v, f"a {kind} name, a class path, {{name: {{arguments}}}} or a {kind} object")
        return v

    def check(v: Any, path: str) -> List[Any]:
        if not isinstance(v, (list, tuple)):
            reject(path, v, desc)
        out = [item(x, f"{path}[{i}]") for i, x in enumerate(v)]
        names = [x if isinstance(x, str) else next(iter(x)) for x in out if isinstance(x, (str, Mapping))]
        if unique and len(set(names)) != len(names):
            reject(path, v, desc)
        return out

    return Validator(desc, check)


def _is_metric_object(v: Any) -> bool:
    if isinstance(v, Metric):
        return True
    try:
        import torchmetrics
    except ImportError:  # pragma: no cover - torchmetrics is a dependency
        return False
    return isinstance(v, torchmetrics.Metric)


_V_METRICS = _named_items("metric", METRICS, _is_metric_object, unique=True, canonical=metric_name)
_V_CALLBACKS = _named_items("callback", CALLBACKS, lambda v: isinstance(v, Callback), unique=False)


def _function_or_path(description: str, modes: tuple = ()) -> Validator:
    """A function, a class path of one (imported to check it), or one of ``modes``."""

    def check(v: Any, path: str) -> Any:
        if isinstance(v, str) and v in modes:
            return v
        if isinstance(v, str) and "." in v:
            try:
                obj = import_path(v, path)
            except ValueError as e:
                raise Invalid(str(e)) from None
            if not callable(obj):
                reject(path, v, description)
            return v
        if isinstance(v, (type, str)) or not callable(v):
            reject(path, v, description)
        return v

    return Validator(description, check)


_V_MODEL_INPUT = _function_or_path("one of " + ", ".join(repr(m) for m in MODEL_INPUT_MODES) + ", or a function "
                                   "(model, inputs) -> outputs (or its path, package.module.function)",
                                   MODEL_INPUT_MODES)
_V_SPLIT_BATCH = optional(_function_or_path("a function batch -> (inputs, targets) (or its path, "
                                            "package.module.function)"))
_V_EPOCHS = list_of(int_range(min=1), description="a list of ints >= 1 (epochs)")
_V_COMPILE_OPTIONS = record(
    {"fullgraph": boolean(), "dynamic": optional(boolean()),
     "backend": any_of(string("a backend name"), callable_value("a callable backend")),
     "options": str_dict(), "disable": boolean()},
    reserved=COMPILE_RESERVED,
    description="a dict of torch.compile keyword arguments: fullgraph, dynamic, backend, options, disable")
_V_EARLY_STOPPING = optional(record({"patience": int_range(min=1), "min_delta": float_range(min=0)},
                                    required=("patience",), defaults={"min_delta": 0.0}))


def _multi_gpu_check(v: Any, path: str) -> str:
    if isinstance(v, bool):  # YAML 1.1 reads a bare off/on as a boolean
        return "ddp" if v else "off"
    if isinstance(v, str) and v.lower() in ("off", "auto", "ddp", "fsdp"):
        return v.lower()
    reject(path, v, _MULTI_GPU_DESC)


_MULTI_GPU_DESC = "one of 'off', 'auto', 'ddp', 'fsdp' (case-insensitive; false means 'off', true 'ddp')"
_V_MULTI_GPU = Validator(_MULTI_GPU_DESC, _multi_gpu_check)
_V_FSDP = record(
    {"wrap": any_of(choice("blocks"), list_of(string("a class name"), unique=True),
                    _function_or_path("a function module -> bool (or its path, package.module.function)"),
                    description="'blocks', a list of module class names, or a function module -> bool (or its "
                                "path)"),
     "reshard_after_forward": boolean()},
    defaults={"wrap": "blocks", "reshard_after_forward": True},
    description="a dict with keys wrap ('blocks', a list of class names or a function module -> bool) and "
                "reshard_after_forward (bool)")


COMPILE_STEP_MODES = ("off", "compile", "cuda_graph")
_COMPILE_STEP_DESC = "one of 'off', 'compile', 'cuda_graph' (false means 'off')"


def _compile_step_check(v: Any, path: str) -> str:
    if v is False:  # YAML 1.1 reads a bare off as a boolean
        return "off"
    if isinstance(v, str) and v in COMPILE_STEP_MODES:
        return v
    reject(path, v, _COMPILE_STEP_DESC)


_V_COMPILE_STEP = Validator(_COMPILE_STEP_DESC, _compile_step_check)


_INITIAL_LR_DESC = ("a float > 0, or a dict of parameter-name prefix -> learning rate > 0 with a 'default' entry "
                    "(e.g. {default: 0.01, backbone: 0.001})")


def _initial_lr_check(v: Any, path: str) -> Any:
    if isinstance(v, Mapping):
        rates = dict_of(float_range(min=0, min_inclusive=False), _INITIAL_LR_DESC)(v, path)
        if "default" not in rates:
            raise Invalid(f"{path}: got {show(v)} (dict) without a 'default' entry; allowed: {_INITIAL_LR_DESC}")
        if "" in rates:
            raise Invalid(f"{path}: got an empty prefix ''; allowed: {_INITIAL_LR_DESC} (the 'default' entry is the "
                          f"rate of every parameter no prefix fits)")
        return rates
    try:
        return float_range(min=0, min_inclusive=False)(v, path)
    except Invalid:
        reject(path, v, _INITIAL_LR_DESC)


_V_INITIAL_LR = Validator(_INITIAL_LR_DESC, _initial_lr_check)


def _p(name: str, validator: Validator, default: Any, doc: str) -> ParamSpec:
    return ParamSpec(name, validator.description, default, " ".join(doc.split()), validator)


_SPECS = [
    _p("max_epochs", int_range(min=1), 10, """
        Number of passes over the training loader. Schedules (and the EMA's `exp` decay horizon) span
        `max_epochs` times the number of optimizer steps per epoch. Not used when `max_steps` is set."""),
    _p("max_steps", optional(int_range(min=1)), None, """
        Train for this many optimizer steps instead of `max_epochs` epochs: epochs follow one another until the
        step count is reached, the last one ending early at that step (validation and checkpoints as at any epoch
        end); schedules and the EMA's decay horizon span `max_steps`. None: `max_epochs` decides."""),
    _p("optimizer", _V_OPTIMIZER, "AdamW", f"""
        The optimizer. A name selects one of fusetrain's fused optimizers ({_OPTIMIZER_NAMES}), each with the
        arguments and defaults of the optimizer it follows (torch.optim's or timm's; see docs/optimizers.md),
        whose whole step (unscaling of fp16 gradients, non-finite check, clipping, update and EMA) runs in
        fused kernels without synchronising with the host; its learning rate is a device tensor that the schedule
        rewrites each step. Names are case-insensitive and normalised to the spelling shown. From Python, a
        `torch.optim.Optimizer` subclass may be given instead: it is built as
        `cls(param_groups, lr=initial_lr, **optimizer_params)` and stepped the ordinary way (clipping with
        `torch.nn.utils.clip_grad_norm_`)."""),
    _p("optimizer_params", str_dict("a dict of the optimizer's keyword arguments"), {}, """
        Further keyword arguments of the optimizer's constructor, e.g. `{weight_decay: 0.05, betas: [0.9, 0.95]}`
        for AdamW or `{momentum: 0.9, nesterov: true}` for SGD. Keys are checked against the constructor's
        signature; values are checked by the optimizer when it is built. The learning rate comes from `initial_lr`
        and the parameters from the model, so `lr` and `params` are not allowed here; for fusetrain optimizers
        `max_grad_norm` is set from `clip_grad_norm`."""),
    _p("initial_lr", _V_INITIAL_LR, 1e-3, """
        The base (peak) learning rate: the value reached at the end of warmup, from which the schedule of `lr_mode`
        starts. A dict `{default: 0.01, encoder.backbone: 0.001}` sets absolute learning rates by parameter-name
        prefix: a parameter whose name starts with a prefix (the longest one that fits) runs at that prefix's
        rate, the others at `default` (required). Every schedule and warmup then scales each group's rate the same
        way (a group's learning rate at every step is its own initial rate times the schedule's factor); the
        groups multiply with `lr_multipliers` and `layer_decay`. A prefix that matches no trainable parameter is
        an error raised before anything is written, naming the model's closest parameter-name prefixes; freeze
        parameters with `freeze`."""),
    _p("lr_mode", any_of(choice(*LR_MODES, hints=LR_MODE_SYNONYMS), callable_value("a function step -> lr (from Python)")), "constant", """
        The learning-rate schedule after warmup, evaluated for each optimizer step on the host from the step index
        and written into the optimizer's learning-rate tensor (no host synchronisation, no recompilation under
        `torch.compile`). `constant` keeps `initial_lr`; `step` multiplies it by `lr_decay_factor` at each epoch of
        `lr_updates` (torch's `MultiStepLR`); `exponential` multiplies it by `lr_decay_factor` per epoch, smoothly
        from step to step; `cosine` anneals it to `initial_lr * cosine_final_lr_ratio` along a half cosine;
        `cosine_restarts` does the same within cycles of `cosine_restart_epochs`, each `cosine_restart_mult` times
        longer than the one before, restarting at `initial_lr` (torch's `CosineAnnealingWarmRestarts`); `poly` is
        `initial_lr * (1 - k / K) ** poly_power` for post-warmup step k of K (the segmentation standard); `linear`
        decays it linearly to `initial_lr * linear_final_lr_ratio`; `onecycle` rises from
        `initial_lr / onecycle_div_factor` to `initial_lr` over the first `onecycle_pct_start` of the steps, then
        anneals to `initial_lr / (onecycle_div_factor * onecycle_final_div_factor)` (both phases cosine, like
        `torch.optim.lr_scheduler.OneCycleLR`); `cyclic` is a triangular wave between
        `initial_lr * cyclic_min_lr_ratio` and `initial_lr` with a period of `cyclic_period_epochs`; `plateau`
        multiplies it by `lr_decay_factor` after more than `plateau_patience` validations in which
        `metric_to_watch` did not improve by more than `plateau_min_delta` (torch's `ReduceLROnPlateau`; the
        reductions are saved in checkpoints). The decaying
        schedules span the steps from the end of warmup to the last step of `max_epochs`. From Python, a function
        of the 0-based optimizer step returning the learning rate (a float) may be given instead: it is the whole
        schedule (no warmup is added)."""),
    _p("lr_updates", _V_EPOCHS, [], """
        For `lr_mode: step`, the epochs at which the learning rate is multiplied by `lr_decay_factor`: an entry `e`
        applies from the moment `e` epochs are complete. With `lr_mode: step` the list must be non-empty, in
        increasing order without duplicates, and each entry below `max_epochs`; other modes ignore it."""),
    _p("step_lr_update_freq", optional(float_range(min=0, min_inclusive=False)), None, """
        For `lr_mode: step`, instead of `lr_updates`: multiply the learning rate by `lr_decay_factor` every
        `step_lr_update_freq` epochs of the run (fractions allowed: with 2.5 after 2.5, 5, 7.5, ... epochs, each at
        the first optimizer step at or after that point). Decays that fall within the warmup are left out (the
        one at its very end counts), and none happens during `lr_cooldown_epochs`. At most one of `lr_updates`
        and `step_lr_update_freq` may be set."""),
    _p("lr_decay_factor", float_range(min=0, max=1, min_inclusive=False), 0.1, """
        For `lr_mode: step`, the factor applied at each epoch of `lr_updates`; after `k` of them the learning rate
        is `initial_lr * lr_decay_factor ** k`. For `lr_mode: exponential`, the factor per epoch: after `e`
        epochs (fractions included) past warmup the learning rate is `initial_lr * lr_decay_factor ** e`. For
        `lr_mode: plateau`, the factor of each reduction."""),
    _p("cosine_final_lr_ratio", float_range(min=0, max=1), 0.01, """
        For `lr_mode: cosine`, the learning rate at the last optimizer step, as a fraction of `initial_lr`; for
        `lr_mode: cosine_restarts`, the low end of each cycle."""),
    _p("cosine_restart_epochs", float_range(min=0, min_inclusive=False), 10.0, """
        For `lr_mode: cosine_restarts`, the length of the first cosine cycle in epochs (fractions allowed; at least
        one optimizer step)."""),
    _p("cosine_restart_mult", int_range(min=1), 1, """
        For `lr_mode: cosine_restarts`, each cycle is this many times longer than the one before (1: equal
        cycles)."""),
    _p("poly_power", float_range(min=0, min_inclusive=False), 0.9, """
        For `lr_mode: poly`, the exponent of `(1 - k / K)`."""),
    _p("plateau_patience", int_range(min=0), 10, """
        For `lr_mode: plateau`, the validations without improvement that are tolerated; the next one reduces the
        learning rate."""),
    _p("plateau_min_delta", float_range(min=0), 0.0, """
        For `lr_mode: plateau`, how much `metric_to_watch` must improve (absolute) to count as an improvement."""),
    _p("linear_final_lr_ratio", float_range(min=0, max=1), 0.0, """
        For `lr_mode: linear`, the learning rate at the last optimizer step, as a fraction of `initial_lr`."""),
    _p("onecycle_pct_start", float_range(min=0, max=1, min_inclusive=False, max_inclusive=False), 0.3, """
        For `lr_mode: onecycle`, the fraction of the (post-warmup) steps spent rising to `initial_lr`."""),
    _p("onecycle_div_factor", float_range(min=0, min_inclusive=False), 25.0, """
        For `lr_mode: onecycle`, the starting learning rate is `initial_lr / onecycle_div_factor`."""),
    _p("onecycle_final_div_factor", float_range(min=0, min_inclusive=False), 1e4, """
        For `lr_mode: onecycle`, the final learning rate is the starting one divided by this factor, i.e.
        `initial_lr / (onecycle_div_factor * onecycle_final_div_factor)`."""),
    _p("cyclic_min_lr_ratio", float_range(min=0, max=1, min_inclusive=False), 0.1, """
        For `lr_mode: cyclic`, the low end of the triangular wave as a fraction of `initial_lr` (the high end is
        `initial_lr`)."""),
    _p("cyclic_period_epochs", float_range(min=0, min_inclusive=False), 2.0, """
        For `lr_mode: cyclic`, the length of one low-high-low cycle in epochs (fractions allowed; at least one
        optimizer step)."""),
    _p("lr_warmup_epochs", int_range(min=0), 0, """
        Length of the linear learning-rate warmup in epochs (converted to optimizer steps): over W warmup steps
        the rate rises linearly from `warmup_initial_lr` (step k runs at
        `warmup_initial_lr + (initial_lr - warmup_initial_lr) * (k + 1) / W`) and reaches `initial_lr` at the last
        warmup step, then the schedule of `lr_mode` runs
        over the remaining steps. 0 disables warmup. At most one of `lr_warmup_epochs` and `lr_warmup_steps` may be
        non-zero."""),
    _p("lr_warmup_steps", int_range(min=0), 0, """
        Length of the linear learning-rate warmup in optimizer steps, for runs whose epochs are long; otherwise as
        `lr_warmup_epochs` (at most one of the two may be non-zero)."""),
    _p("lr_warmup_mode", choice(*WARMUP_MODES, hints=WARMUP_MODE_SYNONYMS), "linear", """
        The form of the warmup: `linear` (above), `exponential` rises geometrically (step k of W runs at
        `warmup_initial_lr * (initial_lr / warmup_initial_lr) ** ((k + 1) / W)`, so `warmup_initial_lr` must be
        > 0), `constant` runs every warmup step at `warmup_initial_lr` and switches to the schedule after.
        `linear_epoch` is a staircase of one rate per epoch: every step of epoch e (counted from 0) of the
        `lr_warmup_epochs` W runs at `warmup_initial_lr + (initial_lr - warmup_initial_lr) * e / W`, so the first
        epoch runs at `warmup_initial_lr` and the schedule starts at `initial_lr` after epoch W (needs
        `lr_warmup_epochs`). `linspace` rises linearly over S steps, the first at `warmup_initial_lr` and the last
        at `initial_lr` (step k runs at `warmup_initial_lr + (initial_lr - warmup_initial_lr) * k / (S - 1)`),
        with S the warmup length capped at one epoch; the warmup steps after the cap run at `initial_lr`.
        SuperGradients' `LinearEpochLRWarmup` and `LinearBatchLRWarmup` are these two."""),
    _p("warmup_initial_lr", optional(float_range(min=0)), None, """
        The learning rate at the start of warmup; None means `initial_lr * 0.01`, or `initial_lr /
        (lr_warmup_epochs + 1)` with `lr_warmup_mode: linear_epoch` (so each warmup epoch adds the same step up
        to `initial_lr`). With per-prefix `initial_lr`, each group starts at this value times its rate relative
        to `default`."""),
    _p("lr_cooldown_epochs", int_range(min=0), 0, """
        The last `lr_cooldown_epochs` epochs keep the learning rate of the last optimizer step before them: the
        decaying schedules of `lr_mode` span the steps from the end of warmup to the start of the cooldown
        (`cosine` reaches `initial_lr * cosine_final_lr_ratio` at the last step before it), and `step` decays
        stop there. 0: no cooldown. `lr_warmup_epochs + lr_cooldown_epochs` must stay below `max_epochs`."""),
    _p("momentum_schedule", choice("constant", "cosine", "linear", "onecycle"), "constant", """
        How the optimizer's momentum (SGD's and RMSprop's `momentum`, the first of `betas` for AdamW, Lion, Lamb
        and the rest of the Adam family) changes over the run. `constant` keeps the value of `optimizer_params`;
        `cosine` and `linear` go from it to `momentum_final` over the steps after the lr warmup, on the lr
        schedule's progress (held during the warmup and the cooldown); `onecycle` (with `lr_mode: onecycle`) moves
        opposite to the lr like torch's `OneCycleLR(cycle_momentum=True)`: down to `momentum_final` while the lr
        rises, back to the optimizer's value while it anneals. fusetrain optimizers read the momentum on the
        device, so a compiled or captured step follows it without recompiling. The optimizer's momentum must not
        be 0."""),
    _p("momentum_final", float_range(min=0, max=1, max_inclusive=False), 0.85, """
        For `momentum_schedule` `cosine` / `linear`, the momentum at the last optimizer step; for `onecycle`, the
        momentum at the lr peak (torch's `base_momentum`)."""),
    _p("weight_decay_schedule", choice("constant", "cosine", "linear"), "constant", """
        How the weight decay changes over the run: `constant` keeps `optimizer_params.weight_decay`; `cosine` and
        `linear` go from it to `weight_decay_final` over the steps after the lr warmup, on the lr schedule's
        progress. Each param group's decay is scaled by the same factor, so groups without decay (e.g.
        `zero_weight_decay_on_bias_and_bn`) keep 0. Read on the device by fusetrain optimizers (no recompile)."""),
    _p("weight_decay_final", float_range(min=0), 0.0, """
        For `weight_decay_schedule` `cosine` / `linear`, the weight decay at the last optimizer step."""),
    _p("zero_weight_decay_on_bias_and_bn", boolean(), False, """
        Put every one-dimensional parameter (biases and the weights of normalisation layers such as BatchNorm,
        LayerNorm and GroupNorm) in a parameter group with weight decay 0; the other parameters keep the
        optimizer's `weight_decay`."""),
    _p("lr_multipliers", dict_of(float_range(min=0, min_inclusive=False),
                                 "a dict of parameter-name pattern -> lr multiplier > 0"), {}, """
        Per-group learning rates: each trainable parameter runs at the scheduled learning rate times the multiplier
        of the first pattern its name matches (1 when none does), e.g. `{backbone: 0.1}` for a pretrained backbone
        under a new head. Patterns are `fnmatch` globs over parameter names (`backbone.*`, `*.bias`); a pattern
        without a wildcard also matches everything below that module. Every schedule, resume and the device-side
        learning rate keep the multipliers (one learning-rate tensor per multiplier; no host synchronisation, no
        recompilation). A pattern that matches no trainable parameter is an error."""),
    _p("layer_decay", optional(record({"rate": float_range(min=0, max=1, min_inclusive=False),
                                       "pattern": string("a regex whose group 1 is the block index")},
                                      required=("rate",),
                                      defaults={"pattern": r"(?:blocks|layers|layer)\.(\d+)\."})), None, """
        Layer-wise learning-rate decay for transformer-style models: with blocks numbered 1..L by the block index
        that `pattern` captures in a parameter name (0-based in the name), a parameter of block l runs at the
        learning rate times `rate ** (L + 1 - l)`; parameters before the first block (embeddings) count as block
        0, those after the last (the head) as block L + 1, so the head keeps the full rate. Multiplies with
        `lr_multipliers`."""),
    _p("pretrained_weights", optional(string("a file path")), None, """
        Initialise the model from this file before training (not when resuming, whose checkpoint has the
        weights): a fusetrain checkpoint, a plain `state_dict` (`torch.save(model.state_dict())`, as timm and
        torchvision publish them), a saved module, a checkpoint with the weights under `state_dict`/`model`, or a
        `.safetensors` file. Tensors whose shape differs from the model's (a new head) are skipped; the loaded,
        skipped, missing and unexpected keys are reported in the result (`pretrained`) and as a warning. See
        `pretrained_params`."""),
    _p("pretrained_params", record({"strict": boolean(), "key_map": dict_of(_V_PREFIX),
                                    "use_ema": boolean(), "trusted": boolean()},
                                   defaults={"strict": False, "key_map": {}, "use_ema": False, "trusted": False}),
       {"strict": False, "key_map": {}, "use_ema": False, "trusted": False}, """
        How `pretrained_weights` is read. `key_map`: checkpoint key prefix -> model key prefix, e.g.
        `{"backbone.": "encoder."}` or `{"": "backbone."}` to load a bare backbone into `model.backbone` (the
        longest matching prefix is replaced; a `module.` prefix of a DDP-saved file is dropped by itself).
        `strict`: any missing, unexpected or shape-mismatched key is an error (otherwise only a file of which
        nothing fits is). `use_ema`: take the EMA weights of a fusetrain checkpoint. `trusted`: the file is read
        as data (`torch.load(weights_only=True)`: tensors, numbers, strings, plain containers, and a saved module
        built only of `torch.nn`'s own layers) unless this is true; a file that needs more (a module of other
        classes, NumPy arrays) is refused before training starts, because reading it runs code from the file.
        Set it only for files you trust (`docs/checkpoints.md`)."""),
    _p("freeze", list_of(string("a parameter-name pattern"), "a list of parameter-name patterns"), [], """
        Parameters whose names match one of these patterns (as in `lr_multipliers`) are frozen
        (`requires_grad` off) before the optimizer is built, e.g. `[backbone]` to train only a new head. A pattern
        that matches no parameter is an error, and so is freezing every parameter."""),
    _p("freeze_bn_stats", boolean(), False, """
        Keep the normalisation layers with running statistics (BatchNorm and friends) whose parameters are all
        frozen in eval mode during training: their running mean and variance stay those of the pretrained
        weights."""),
    _p("mixed_precision", any_of(boolean(), choice(*PRECISIONS, case_insensitive=True, hints=PRECISION_SYNONYMS)),
       False, """
        Precision of the forward passes (training and validation), resolved for the training device by
        `fusetrain.resolve_precision`. `false` or `fp32`: float32 throughout. `bf16`: `torch.autocast` with
        bfloat16, no loss scaling. `fp16`: autocast with float16 and a `fusetrain.LossScaler` (see
        `scaler_params`) whose unscaling, non-finite check and step skipping happen inside the fused optimizer
        step, on the device. `true`: bf16 on CPU and on GPUs that support it, fp16 on older GPUs. Weights and
        optimizer state stay float32. Strings are case-insensitive and normalised to lower case."""),
    _p("weights_dtype", choice("float32", "bfloat16", case_insensitive=True), "float32", """
        The dtype of the model's weights and buffers during training. `bfloat16` halves them and, with the
        element-wise optimizers' lean state (`optimizer_params: {master_weights: remainder, state_dtype:
        bfloat16}`, docs/optimizers.md "Lean state"), brings AdamW from 12 bytes per parameter to 8 (6 with
        `master_weights: stochastic`). Needs `mixed_precision: bf16` (or `true` resolving to it), whose autocast
        feeds the weights. Checkpoints hold the bfloat16 weights (sharded with `multi_gpu: fsdp`, the remainders and
        moments alike). An `ema` is kept in bfloat16 with an int16 remainder per value, which together are the
        exact float32 EMA (`ema_params: {remainder: false}` drops them, and a decay close to 1 then rounds its
        updates away; under `multi_gpu: fsdp` the remainders are sharded like the EMA copy and saved in its
        shards). Without
        a master (`master_weights` false or `stochastic`) each epoch row reports `stalled_updates`: the weight
        updates lost because they did not move a bfloat16 value (many of them: the lr is too small for bfloat16
        weights)."""),
    _p("scaler_params", kwargs_of(LossScaler, ("device", "enabled"), SCALER_RESERVED, "a dict of "
                                   "fusetrain.LossScaler keyword arguments"), {}, """
        Keyword arguments of `fusetrain.LossScaler` for fp16 training (dynamic loss scaling: the initial scale, how
        it grows after a run of finite steps and shrinks after a non-finite one). Ignored for the other precisions.
        `device` and `enabled` are set by the Trainer. Values are checked when the scaler is built."""),
    _p("torch_compile", boolean(), False, """
        Compile the model with `torch.compile(model, mode=torch_compile_mode, **torch_compile_options)` for training
        (and the EMA model for validation). The first steps then include the compilation time."""),
    _p("torch_compile_mode", choice(*TORCH_COMPILE_MODES), "default", """
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
    _p("ema", boolean(), False, """
        Keep an exponential moving average of the weights (`fusetrain.ModelEMA`, configured by `ema_params`). With
        a fusetrain optimizer the EMA update rides in the fused optimizer step, and a skipped (non-finite) step
        leaves the EMA untouched. Validation then runs on the EMA weights, and checkpoints include the EMA."""),
    _p("ema_params", kwargs_of(ModelEMA, ("model",), EMA_RESERVED, "a dict of fusetrain.ModelEMA keyword "
                                "arguments"), {}, """
        Keyword arguments of `fusetrain.ModelEMA`, e.g. `{decay: 0.9999, decay_type: exp, beta: 15}`;
        `total_steps` defaults to the run's number of optimizer steps. Values are checked when the EMA is built.
        Ignored when `ema` is false."""),
    _p("clip_grad_norm", optional(float_range(min=0, min_inclusive=False)), None, """
        Clip gradients to this global L2 norm inside the fused optimizer step (computed on the device, no host
        sync); applied to unscaled gradients under fp16. With clipping on, a step whose gradients are not finite is
        skipped. None disables clipping."""),
    _p("batch_accumulate", int_range(min=1), 1, """
        Number of batches whose gradients are accumulated before each optimizer step. Each batch's loss is divided
        by `batch_accumulate` (see `batch_accumulate_reduction`), so the step sees the mean gradient and the
        effective batch size is `batch_size * batch_accumulate`; a partial group at the end of an epoch also
        steps. Schedules count optimizer steps."""),
    _p("batch_accumulate_reduction", choice("mean", "sum"), "mean", """
        How the gradients of the `batch_accumulate` batches combine: `mean` divides each batch's loss by
        `batch_accumulate` (the step sees the mean gradient); `sum` does not divide (the step sees the sum of the
        batches' gradients, `batch_accumulate` times larger, as SuperGradients accumulates). The logged loss is
        the undivided one in both cases."""),
    _p("sync_bn", boolean(), False, """
        Convert BatchNorm layers to `torch.nn.SyncBatchNorm`, which synchronises batch statistics across processes.
        Only meaningful in a `torch.distributed` run; otherwise a warning is issued and the layers stay local."""),
    _p("channels_last", boolean(), False, """
        Use the channels-last memory format for the model and the 4-d input batches, which speeds up convolutions on
        tensor-core GPUs (especially with mixed precision)."""),
    _p("loss", _V_LOSS, "cross_entropy", """
        The loss, called as `loss(outputs, targets)` on the model's outputs and the batch's targets (any
        structure). A name builds a loss with `loss_params` as constructor arguments: the class name of any
        `torch.nn` loss (`CrossEntropyLoss`, `BCEWithLogitsLoss`, `HuberLoss`, ...), the snake-case aliases
        `cross_entropy`, `mse`, `l1`, `smooth_l1`, `bce_with_logits`, `nll`, a name registered with
        `fusetrain.register_loss`, or a class path (`package.module.MyLoss`). `model`: the model computes its own
        loss when called with the targets (see `model_input`), as torchvision's detection models do in train mode;
        validation then calls it without targets and reports metrics on its predictions (no validation loss). From
        Python a callable can be given instead: an `nn.Module` instance (moved to the training device) or a
        function. A loss returns a scalar tensor, `(loss, {name: component})` or a dict with a `loss` entry and
        components; a model computing its own loss may return a dict of components only, whose sum is the loss.
        Components are accumulated on the device and logged per epoch as `train_<component>` and
        `valid_<component>` (prefixed `loss_` unless their name starts with `loss`). Anything else (a
        non-scalar loss, say) stops training at the first batch with an error saying what was returned."""),
    _p("loss_params", str_dict("a dict of the loss class's keyword arguments"), {}, """
        Keyword arguments of the named loss's class (or registered factory), e.g. `{label_smoothing: 0.1}` for
        `cross_entropy`; keys are checked against its signature. For torch.nn losses, `weight` and `pos_weight`
        given as lists (class weights in a recipe) become tensors. Must be empty when `loss` is a callable or
        `model`."""),
    _p("train_metrics", optional(_V_METRICS), None, """
        Metrics accumulated on the device over each epoch's training batches and read once at its end, reported as
        `train_<name>`. Built in (`fusetrain.training.task.metrics`): `accuracy` (top-1; per pixel for segmentation
        scores), `top5`, `loss` (the mean loss), `mean_iou` and `pixel_accuracy` (segmentation, from a confusion
        matrix on the device; arguments `num_classes`, `ignore_index` default 255) and `map` (detection mean
        average precision, COCO-style, through torchmetrics and pycocotools at the end of the epoch; reports
        `map`, `map_50`, `map_75`). Also: names registered with `fusetrain.register_metric`, class paths (e.g.
        `torchmetrics.classification.MulticlassF1Score`), one-entry mappings `{name: {arguments}}`, and from Python
        `fusetrain.training.task.metrics.Metric` or `torchmetrics.Metric` objects. Classification and segmentation
        metrics read the model's prediction: the output tensor, a dict's `out` or `logits` entry, or a tuple's
        first item; detection metrics read per-image dicts of boxes, scores and labels. A metric that cannot handle
        the outputs stops training at the first batch with an error naming it. The mean training loss is always
        reported as `train_loss`. None (the default) fits the task: `[accuracy]` when the loss is a
        classification loss on logits (`cross_entropy`, `CrossEntropyLoss`, `nll`, `NLLLoss`), else `[]` (a model
        computing its own loss, detection and other losses whose outputs are not class scores), and follows the
        final `loss`: `TrainingParams.replace(loss=...)` derives it again."""),
    _p("valid_metrics", _V_METRICS, ["accuracy"], """
        Metrics computed on the validation loader(s), reported as `valid_<name>` (with several validation loaders,
        `valid_<loader>_<name>`), and on the test loader(s) after training (`test_<name>`); the same choices as
        `train_metrics`. The mean validation loss is always reported as `valid_loss` (unless the model computes its
        own loss)."""),
    _p("metric_to_watch", string("a metric name: 'loss' or a name reported by valid_metrics"), "accuracy", """
        The validation value that selects the best checkpoint and drives `early_stopping`: `loss`, a name reported
        by one of `valid_metrics` (`map_50` for `map`, say) or a loss component. With several validation loaders it
        refers to the first one, or names the loader: `<loader>_<name>`."""),
    _p("greater_metric_to_watch_is_better", boolean(), True, """
        Whether a larger `metric_to_watch` is better: true for accuracies, false when watching `loss`."""),
    _p("run_validation_freq", int_range(min=1), 1, """
        Validate every `run_validation_freq` epochs; the last epoch is always validated."""),
    _p("valid_every_n_steps", int_range(min=0), 0, """
        Also validate every `valid_every_n_steps` optimizer steps, in the middle of epochs (0: only at epoch ends,
        as `run_validation_freq` says). Each result is printed, written to the step `loggers` as `valid_<name>` at
        that step and to `valid_steps.jsonl`, and updates `ckpt_best.pth` like an epoch-end validation;
        `early_stopping` and the `plateau` schedule follow the epoch-end validations only."""),
    _p("max_train_batches", optional(int_range(min=1)), None, """
        Use at most this many batches of the training loader per epoch (None: all of them), e.g. for quick runs.
        The schedules follow the shortened epochs. Required for a train loader without a length (a DataLoader over
        an `IterableDataset`): it is then the length of an epoch for the schedule, the warmup and the EMA (an
        epoch also ends when the loader does, with a warning when that is sooner)."""),
    _p("max_valid_batches", optional(int_range(min=1)), None, """
        Use at most this many batches of the validation loader at each validation (None: all of them)."""),
    _p("save_ckpt_epoch_list", _V_EPOCHS, [], """
        Epochs (counted from 1) after which an extra checkpoint `ckpt_epoch_<N>.pth` is kept in the experiment
        directory, besides `ckpt_latest.pth` (written after every epoch) and `ckpt_best.pth` (the best
        `metric_to_watch` so far)."""),
    _p("average_best_models", boolean(), False, """
        Keep the `number_of_models_to_average` best models by `metric_to_watch` (the EMA's weights with `ema`)
        and write their weight average to `average_model.pth` in the run folder after each epoch-end
        validation (a fusetrain checkpoint with the weights under `model`, usable as `pretrained_weights`), as
        SuperGradients' option of the same name does. A model joins when fewer are kept or when it beats the worst
        kept one; a non-finite metric never joins. Floating tensors (weights, BatchNorm running mean and
        variance) are averaged; integer ones (BatchNorm's `num_batches_tracked`) take the mean rounded down.
        After training the result reports it under `average_model` (validated, in a single-process run). The kept
        models are held on the CPU and saved to `average_model_snapshots.pth`, so a resume continues the
        average. Needs a `valid_loader`; not with `multi_gpu: fsdp`."""),
    _p("number_of_models_to_average", int_range(min=1), 10, """
        How many of the best models `average_best_models` averages."""),
    _p("ckpt_every_n_steps", int_range(min=0), 0, """
        Also write `ckpt_latest.pth` every `ckpt_every_n_steps` optimizer steps, in the middle of epochs (0: at
        epoch ends only). A mid-epoch checkpoint records the position in the epoch (the batches already trained
        on, the epoch's running sums and the random states), so `resume` continues from the next batch and ends
        as the uninterrupted run would (`docs/checkpoints.md`)."""),
    _p("ckpt_every_minutes", float_range(min=0.0), 0.0, """
        Also write `ckpt_latest.pth` after the first optimizer step that ends `ckpt_every_minutes` minutes after
        the last checkpoint (0: off); like `ckpt_every_n_steps`, a mid-epoch checkpoint. In a distributed run the
        ranks agree on it once every `log_interval` steps (every epoch with `log_interval: 0`)."""),
    _p("keep_last_ckpts", int_range(min=0), 0, """
        Besides `ckpt_latest.pth`, keep the last `keep_last_ckpts` checkpoints as `ckpt_step_<N>.pth` (N: the
        optimizer step at which each was written; epoch-end and mid-epoch checkpoints alike), deleting older ones
        (0: keep none). `ckpt_best.pth` and the `save_ckpt_epoch_list` files are kept in any case."""),
    _p("async_checkpoints", boolean(), True, """
        Write checkpoint files in a background thread: at a checkpoint the training loop only queues the copy of
        the state to host memory (page-locked buffers on a GPU, kept for the next checkpoint), then trains on
        while the files are written (each still atomically, so
        `ckpt_latest.pth` is always a whole checkpoint). The next checkpoint and the end of the run (also a
        failed or interrupted one) wait for the write in flight; `on_checkpoint_saved` callbacks run on the
        training thread once their file is written, and a failed write raises there. Host memory holds one extra
        copy of the checkpoint while it is written (set false where it cannot). A `multi_gpu: fsdp` run writes in
        the foreground."""),
    _p("resume_skip", choice("fast", "replay"), "fast", """
        How a resume from a mid-epoch checkpoint skips the batches already trained on. `fast`: a torch DataLoader
        over a map-style dataset skips them in its batch sampler, without loading them (exact data order; with
        `num_workers > 0`, random augmentations in the workers differ from those of an uninterrupted run);
        `replay`: the batches are loaded and dropped (exact in every case, at the cost of loading them). Loaders
        that cannot skip in their sampler replay in any case."""),
    _p("resume", any_of(boolean(), choice("auto"), description="a bool or 'auto'"), False, """
        Continue a run from a checkpoint: `resume_path` if set, else the `ckpt_latest.pth` of the experiment's newest run that has one, in that run's folder (`docs/checkpoints.md`). The
        model, optimizer (with master weights), loss scaler, EMA, schedule position, best metric and random states
        are restored, so training continues where it stopped. Hyperparameters come from these training_params:
        what a resume keeps from the checkpoint and what it takes from the new values is listed in
        `docs/checkpoints.md`; each changed key is reported in a warning, and a change that cannot work (another
        `optimizer`) is an error. `auto`: resume when that checkpoint exists, else start a fresh run (the log
        says which), so one command serves the first start and every restart (a requeued job, torchrun's
        `--max-restarts`); the checkpoint may come from another number of processes (`docs/checkpoints.md`)."""),
    _p("preemption_signals", list_of(_V_SIGNAL, unique=True), ["SIGTERM", "SIGUSR1"], f"""
        Signals that stop the run after the optimizer step in flight with a mid-epoch checkpoint (SIGINT always
        does). `Trainer.train` then raises `TrainingInterrupted`, and `fusetrain-train` exits with status
        {EXIT_PREEMPTED}: rerun the same command with `resume: auto` (or requeue the job) to continue. The signal
        repeated while the checkpoint is written is ignored; a second SIGINT stops at once."""),
    _p("auto_requeue", boolean(), False, """
        Under Slurm (`SLURM_JOB_ID` set): after the checkpoint of a stop by a signal of `preemption_signals` other
        than SIGTERM (which `scancel` sends), e.g. the SIGUSR1 of `#SBATCH --signal=USR1@90`, rank 0 requeues the
        job with `scontrol requeue $SLURM_JOB_ID`; with `resume: auto` the requeued job continues from the
        checkpoint. Outside Slurm an error (before anything is written)."""),
    _p("resume_path", optional(string("a non-empty string (a checkpoint path)")), None, """
        The checkpoint file to resume from; setting it implies `resume`. None: the newest run's `ckpt_latest.pth`
        when `resume` is true."""),
    _p("resume_trusted", boolean(), False, """
        Read the checkpoint of `resume` with any pickle allowed. A checkpoint is read as data
        (`torch.load(weights_only=True)`); one that needs more (a checkpoint of an older fusetrain, whose random
        states hold NumPy arrays) is refused before anything is loaded or written, because reading it runs code
        from the file. Set it only for a file you trust, or rewrite the file once with `python -m
        fusetrain.training.checkpoint.convert PATH` (`docs/checkpoints.md`)."""),
    _p("overwrite_experiment", boolean(), False, """
        Each fresh run (not `resume`) writes a run folder of its own under the experiment's folder, so runs never
        share files; true first deletes the experiment's earlier runs (each only when no live run holds it). A
        run holds a lock on its folder, and a second run into it (two resumes of one run) fails with an error
        naming the holder."""),
    _p("seed", int_range(min=0), 42, """
        Seed of torch (CPU and CUDA), Python's `random` and NumPy, set at the start of training; a recipe
        (`train_from_recipe`) also sets it before it builds the data and the model, so the initial weights are
        reproducible. A model built by the caller keeps the weights it was built with."""),
    _p("cudnn_benchmark", boolean(), True, """
        Set `torch.backends.cudnn.benchmark`: cuDNN times the candidate convolution algorithms for each new input
        shape and keeps the fastest (faster with fixed shapes, but not bit-reproducible across runs)."""),
    _p("early_stopping", _V_EARLY_STOPPING, None, """
        Stop training when `metric_to_watch` has not improved by more than `min_delta` for `patience` consecutive
        validations. `min_delta` also applies when choosing the best checkpoint. None disables early stopping."""),
    _p("log_interval", int_range(min=0), 0, """
        Training batches between host reads of the running loss shown in the progress bar; 0 reads it only at the
        end of the epoch. Each read waits for the device, so small values cost some speed. With `loggers`, also
        the number of optimizer steps whose scalars are written together (one host read per interval)."""),
    _p("loggers", list_of(any_of(choice(*STEP_LOGGERS), _V_LOGGER_OBJECT), "a list of logger names or objects"), [],
       """
        Per-step scalars (the loss of the step's last batch, the learning rate, the loss scale and the global
        gradient norm when they exist) every `log_interval` optimizer steps, to these loggers: `tensorboard`
        (`<experiment>/tensorboard`, tag `step/<name>`), `csv` (`steps.csv`), `jsonl` (`steps.jsonl`), `wandb` and
        `mlflow` (when those packages are installed; their keyword arguments from `logger_params`), or from Python
        any object with `log_scalars(step, values)` and `close()`. The scalars stay on the device between the host
        reads, one per interval (one per epoch with `log_interval: 0`). The per-epoch logs
        (metrics.csv, metrics.jsonl, TensorBoard per epoch) are written in any case."""),
    _p("logger_params", str_dict("a dict of logger name -> keyword arguments"), {}, """
        Keyword arguments of the named loggers, e.g. `{wandb: {project: digits}, mlflow: {run_name: try1}}` (wandb:
        `wandb.init`; mlflow: `mlflow.start_run`, plus `experiment` for the MLflow experiment name, default the
        experiment_name)."""),
    _p("export", list_of(regex(r".+\.(pt2|onnx)$", "a file name ending in .pt2 or .onnx"),
                         "a list of file names ending in .pt2 (torch.export) or .onnx"), [], """
        After training, export the final weights (the EMA's with `ema: true`) to these files in the run
        folder: `.pt2` with `torch.export`, `.onnx` with the ONNX exporter (needs `pip install
        'fusetrain[export]'`, checked before training). The batch dimension is dynamic, and each file is run on the
        first validation batch and must match the eager model (ONNX through onnxruntime); the result lists the
        files under `export`. `python -m fusetrain.export` exports from a recipe and a checkpoint instead."""),
    _p("model_input", _V_MODEL_INPUT, "auto", """
        How a batch's inputs reach the model. A batch is split into inputs and targets (see `split_batch`); then
        `auto` calls `model(**inputs)` for a dict and `model(inputs)` for anything else (a tensor, a list of images
        as torchvision's detection models take, a tuple); `unpack` calls `model(*inputs)` for a tuple or list and
        `model(**inputs)` for a dict; `whole` always calls `model(inputs)`. A function `fn(model, inputs)` (or its
        path) calls the model itself. With `loss: model` the targets are passed too: `model(inputs, targets)`,
        `model(*inputs, targets)`, `model(**inputs, targets=targets)` or `fn(model, inputs, targets)`."""),
    _p("split_batch", _V_SPLIT_BATCH, None, """
        How a batch is split into inputs and targets. None: a tuple or list batch is `(inputs, targets, *extras)`
        (extras are passed to callbacks only); a dict batch's targets are its `targets`, `target`, `labels`,
        `label`, `masks`, `mask` or `y` entry (the first present) and its inputs the other entries (the entry
        itself when one is left). A function `batch -> (inputs, targets)` (or its path) replaces the rule. Every
        tensor in the batch, at any depth (lists of per-image dicts included), is moved to the device; a batch
        that cannot be split stops training before anything is written."""),
    _p("callbacks", _V_CALLBACKS, [], """
        Callbacks called at fixed points of the loop (`fusetrain.Callback`: `on_train_start`, `on_epoch_start`,
        `on_train_batch_end`, `on_step_end`, `on_train_epoch_end`, `on_validation_end`, `on_epoch_end`,
        `on_checkpoint_saved`, `on_train_end`, `on_test_end`) with a `fusetrain.TrainerState` they can read and
        use to stop training (`state.request_stop()`). Per-step values in the state are device tensors, never
        read on the host by the loop. Given as objects, or (from a recipe) as names registered with
        `fusetrain.register_callback` (built in: `ThresholdStop`), class paths or one-entry mappings
        `{name: {arguments}}`."""),
    _p("device", any_of(choice("auto", "cpu", "cuda", hints=DEVICE_SYNONYMS), regex(r"cuda:\d+", "'cuda:N'"),
                         description="'auto', 'cpu', 'cuda' or 'cuda:N' (N a device index)"), "auto", """
        Where to train: `auto` picks CUDA when available, else the CPU; `cuda` is the current CUDA device,
        `cuda:N` a given one."""),
    _p("multi_gpu", _V_MULTI_GPU, "auto", """
        Data-parallel training over several processes (one per GPU, or per CPU worker with gloo). `ddp`:
        `torch.nn.parallel.DistributedDataParallel`, every process holds the whole model, its gradients and its
        optimizer state. `fsdp`: FSDP2 (`torch.distributed.fsdp.fully_shard`, configured by `fsdp_params`),
        every process holds a shard of the weights, gradients, optimizer state, master weights and EMA, and
        checkpoints are written shard by shard with `torch.distributed.checkpoint` (see
        docs/distributed.md). `auto`: DDP when the process was started by a launcher
        (`torchrun --nproc_per_node=N ...`, one node or several: `RANK`/`WORLD_SIZE`/`LOCAL_RANK` in the
        environment) or when `num_gpus` / `num_processes` asks for more than one process, else a single process.
        `ddp` / `fsdp`: the same under a launcher; otherwise the Trainer starts the workers itself on this node
        with torch's elastic launcher, `num_gpus` GPUs (default: all visible) or `num_processes` CPU processes,
        each running the same training (from Python the model, loaders and params are pickled to the workers; a
        recipe rebuilds them in each worker). `off`: a single process, and an error when started by a launcher
        with `WORLD_SIZE > 1`. Each process loads its shard of the training data (`DistributedSampler`), so the
        effective batch size is `batch_size * batch_accumulate * world_size`. Case-insensitive; `false` (YAML's
        bare `off`) means `off`, `true` means `ddp`."""),
    _p("fsdp_params", _V_FSDP, {"wrap": "blocks", "reshard_after_forward": True}, """
        With `multi_gpu: fsdp`: `wrap` picks the modules that get their own `fully_shard` (each one all-gather of
        its weights before its forward and one reduce-scatter of its gradients): `blocks` (every child with
        parameters of an `nn.ModuleList` or `nn.Sequential`, the repeated blocks of most models), a list of class
        names (e.g. `[TransformerBlock]`), or a function `module -> bool` (or its path); the root module is
        always sharded last. `reshard_after_forward`: free the gathered weights after each forward (less memory,
        one more all-gather in the backward). The mixed-precision policy follows `mixed_precision` (weights
        gathered in bf16/fp16 for compute, gradients reduced in fp32)."""),
    _p("num_gpus", optional(int_range(min=1)), None, """
        With `multi_gpu: ddp`, `fsdp` or `auto` outside a launcher, the number of GPUs (worker processes) to start
        on this node; None: all visible CUDA devices. Asking for more GPUs than are visible is an error. Ignored under a
        launcher (the launcher chose the processes)."""),
    _p("num_processes", optional(int_range(min=1)), None, """
        With `multi_gpu: ddp`, `fsdp` or `auto` outside a launcher on the CPU, the number of worker processes to start
        (gloo backend); required for `ddp` there. Not allowed for a CUDA run (use `num_gpus`)."""),
    _p("dist_backend", choice("auto", "nccl", "gloo"), "auto", """
        The `torch.distributed` backend when the Trainer initialises the process group: `auto` is NCCL for CUDA
        devices and gloo for the CPU. A process group the caller initialised is used as it is."""),
    _p("dist_timeout_s", float_range(min=0, min_inclusive=False), 300.0, """
        Timeout in seconds of the process group's collectives and of the barrier after each epoch's checkpoint:
        if a rank dies or hangs, the others stop with an error after at most this long instead of waiting
        forever (a launcher such as torchrun usually stops them sooner, as soon as a worker exits with an
        error). Raise it when one rank may legitimately wait long for the others, e.g. a long first
        compilation."""),
    _p("find_unused_parameters", boolean(), False, """
        `DistributedDataParallel(find_unused_parameters=...)`: set it when some parameters get no gradient in a
        step (conditional branches); it costs a traversal of the autograd graph per step."""),
    _p("progress_bar", boolean(), True, """
        Show a progress bar for each epoch on stderr (when tqdm is installed)."""),
]

#: The ordered table of training parameters, by name.
TRAINING_PARAMS: Mapping[str, ParamSpec] = MappingProxyType({s.name: s for s in _SPECS})
del _SPECS

# Common names from other libraries, pointed at the key that does the job.
KEY_HINTS = KEY_SYNONYMS
