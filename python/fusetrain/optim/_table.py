"""The optimizer table: every optimizer kind of ``fusetrain::fused_step_`` and
the front-end classes that use it, declared once.

NOTE [optimizer table]: an entry (a :class:`Kind`) holds what the rest of
fusetrain derives: the kind's name, its group record's fields in order (type,
default, allowed range, whether a schedule may change it on the device, the
front-end option that sets it), the per-param states it keeps in the slots
state1..3 and when, the rules between its fields, and its classes (the
Python and C++ optimizers, with their lr, torch counterpart and the defaults
where a class differs from the fields). Derived from it:

* ``python -m fusetrain.optim --write`` (_codegen.py) writes the C++ side:
  ``csrc/common/kind_table.h`` (the kernels' kind enum, each kind's fields
  struct and state-slot traits, the list the dispatch expands),
  ``csrc/ops/kind_specs.h`` (the run-time kind table that fused_step_ checks
  records against) and ``csrc/include/fusetrain/optim_table.h`` (the C++
  Options structs, their serialization and the optimizer classes), and the
  generated sections of docs/ops.md, docs/optimizers.md and docs/cpp.md;
* at import, the Python classes' defaults (``DEFAULT`` in a signature) and
  checks (FusedOptimizer), the records they build, the Trainer's and the
  SuperGradients layer's optimizer names and the names error messages list.

An element-wise kind's math (its coefficients and update) is the struct
``<cpp>Math`` in csrc/common/optim_math.h (or rms_math.h), which the CPU and
CUDA kernels both compile; a composite kind's run function is in
``csrc/ops/fused_<name>.cpp``. docs/design.md ("Adding an optimizer") lists the
files an optimizer touches. The native library checks at import that it was
built from this table (fusetrain.optim._kinds).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Tuple

__all__ = ["Field", "State", "Rule", "ParamRule", "OptimizerClass", "Kind", "KIND_TABLE", "CLASSES", "DEFAULT",
           "ELEMENTWISE", "COMPOSITE", "INTERNAL", "table_digest"]

INF = math.inf
ELEMENTWISE = "elementwise"  # one generic run through the fused update kernel; the math in csrc/common
COMPOSITE = "composite"  # its own run function (csrc/ops/fused_<name>.cpp) around the internal passes
INTERNAL = "internal"  # a pass of the fused update kernel that composite kinds run (no record, no class)


class _Default:
    """The marker of a Python optimizer's signature for an argument whose
    default comes from the optimizer table (FusedOptimizer fills it in)."""

    def __repr__(self) -> str:
        return "DEFAULT"


DEFAULT: Any = _Default()


@dataclass(frozen=True)
class Field:
    """One field of a kind's group record (a float64; flags 0 or 1, a choice its index)."""

    name: str
    type: str  # "real", "flag", "int" or "choice"
    default: Any  # a float, bool, int, or one of `choices`
    doc: str
    low: Optional[float] = 0.0  # None: no lower bound
    high: float = INF
    high_closed: bool = False  # [low, high] instead of [low, high)
    option: Optional[str] = None  # the option of a class that sets it (None: the field's own name)
    part: Optional[int] = None  # its index when the option is a tuple (betas[0] = beta1)
    choices: Tuple[str, ...] = ()  # a choice field: the option's values (the record holds the index)
    source: Optional[str] = None  # "initial_lr": the class's lr at construction, not an option
    schedulable: bool = True  # a real field of an element-wise kind: read from the group's device values

    @property
    def option_name(self) -> str:
        return self.option or self.name

    def allowed(self) -> str:
        """The allowed values in words ("in [0, 1)", ">= 0"), "" for any."""
        if self.type == "flag":
            return "0 or 1"
        if self.type == "choice":
            return "one of " + ", ".join(repr(c) for c in self.choices)
        if self.low is None:
            return ""
        if self.high == INF:
            return f">= {_num(self.low)}"
        return f"in [{_num(self.low)}, {_num(self.high)}{']' if self.high_closed else ')'}"

    def admits(self, value: float) -> bool:
        if self.type == "flag":
            return value in (0.0, 1.0)
        if self.type == "choice":
            return value in range(len(self.choices))
        if self.type == "int" and value != int(value):
            return False
        if self.low is None:
            return not math.isnan(value)
        return value >= self.low and (value <= self.high if self.high_closed else value < self.high)


@dataclass(frozen=True)
class State:
    """A per-param state tensor in slot `slot` (0..2 = state1..3), kept when
    the field `when` is non-zero (when_set) or zero; `when` None: always. It
    starts at `initial` (when the field `initial_when` is non-zero, if named;
    else 0). `scalar`: a 0-d float32 tensor beside the step (NOTE [tensor
    scalars] in csrc/common/update_launch.h), which the step advances."""

    slot: int
    name: str
    when: Optional[str] = None
    when_set: bool = True
    scalar: bool = False
    initial: float = 0.0
    initial_when: Optional[str] = None


@dataclass(frozen=True)
class Rule:
    """When the field `when` is non-zero, field `field` must be `op` (">", "==", "!=") `value`."""

    when: str
    field: str
    op: str
    value: float


@dataclass(frozen=True)
class ParamRule:
    """When the field `when` is non-zero, every param has at least `min_dim` dims; `hint` says what to do."""

    when: str
    min_dim: int
    hint: str


@dataclass(frozen=True)
class OptimizerClass:
    """A front-end optimizer (the Python class of fusetrain.optim and the C++
    class of fusetrain/optim.h) over a kind."""

    name: str
    lr: float
    reference: str  # the semantics it follows, in words (docs)
    torch: Optional[str] = None  # the torch.optim class whose checks, messages and group keys it shares
    defaults: Mapping[str, Any] = field(default_factory=dict)  # option -> its default, where the field's differs
    fixed: Mapping[str, Any] = field(default_factory=dict)  # field -> the value this class always records
    options: Mapping[str, str] = field(default_factory=dict)  # field -> this class's option name, where it differs
    aliases: Tuple[str, ...] = ()  # more names (any case) that select it in training_params and SG recipes
    maximize: bool = True  # whether it takes maximize
    max_grad_norm: Optional[float] = None  # its default max_grad_norm (None: no clipping)
    note: str = ""  # a remark for its docs row


@dataclass(frozen=True)
class Kind:
    name: str  # fused_step_'s optimizer name
    cpp: str  # the C++ name: OptimKind::<cpp>, <cpp>Fields, <cpp>Math (element-wise and internal kinds)
    form: str  # ELEMENTWISE, COMPOSITE or INTERNAL
    doc: str
    fields: Tuple[Field, ...]
    states: Tuple[State, ...] = ()
    rules: Tuple[Rule, ...] = ()
    param_rules: Tuple[ParamRule, ...] = ()
    classes: Tuple[OptimizerClass, ...] = ()
    aux: str = ""  # internal kinds: "input" when the pass reads a per-tensor factor (NOTE [tensor scalars])

    @property
    def lean(self) -> bool:
        """Whether it takes lean state (NOTE [lean state]): the element-wise kinds."""
        return self.form == ELEMENTWISE

    @property
    def field_names(self) -> Tuple[str, ...]:
        return tuple(f.name for f in self.fields)

    def field(self, name: str) -> Field:
        return next(f for f in self.fields if f.name == name)

    @property
    def value_fields(self) -> Tuple[str, ...]:
        """The schedulable fields in record order (the layout of a group's values tensor)."""
        if self.form != ELEMENTWISE:
            return ()
        return tuple(f.name for f in self.fields if f.type == "real" and f.schedulable)

    @property
    def scalar_state(self) -> Optional[State]:
        return next((s for s in self.states if s.scalar), None)

    def slot_used(self, slot: int) -> bool:
        """Whether the update kernel reads state slot `slot` (a scalar state rides beside the step instead)."""
        return any(s.slot == slot and not s.scalar for s in self.states)

    def options_of(self, cls: "OptimizerClass") -> Tuple[Tuple[str, Tuple[Field, ...]], ...]:
        """The options of class `cls` in field order: (its name for the class, the fields it sets); fixed
        fields and fields from a source are no option."""
        out: Dict[str, Tuple[Field, ...]] = {}
        for f in self.fields:
            if f.name in cls.fixed or f.source is not None:
                continue
            name = cls.options.get(f.name, f.option_name)
            out[name] = out.get(name, ()) + (f,)
        return tuple(out.items())

    def option_default(self, cls: "OptimizerClass", name: str) -> Any:
        """The default of option `name` of class `cls`: the class's own, else its field's (a tuple of the
        fields' for a tuple option)."""
        if name in cls.defaults:
            return cls.defaults[name]
        fields = dict(self.options_of(cls))[name]
        if len(fields) == 1 and fields[0].part is None:
            return fields[0].default
        return tuple(f.default for f in fields)

    def slot_optional(self, slot: int) -> bool:
        """Whether a group may lack the (tensor) state of slot `slot`."""
        states = [s for s in self.states if s.slot == slot and not s.scalar]
        return bool(states) and all(s.when is not None for s in states)


def _num(x: float) -> str:
    return repr(int(x)) if float(x).is_integer() else repr(x)


# ---- field makers -------------------------------------------------------------------------------------


def real(name: str, default: float, doc: str, **kw: Any) -> Field:
    return Field(name, "real", float(default), doc, **kw)


def unit(name: str, default: float, doc: str, **kw: Any) -> Field:
    """A real in [0, 1): a decay rate such as beta1."""
    return Field(name, "real", float(default), doc, high=1.0, **kw)


def flag(name: str, default: bool, doc: str, **kw: Any) -> Field:
    return Field(name, "flag", bool(default), doc, low=0.0, high=1.0, high_closed=True, **kw)


def integer(name: str, default: int, doc: str, **kw: Any) -> Field:
    return Field(name, "int", int(default), doc, **kw)


def choice(name: str, option: str, choices: Tuple[str, ...], doc: str) -> Field:
    """A flag-like field set by a string option: the record holds the index of the option's value."""
    return Field(name, "choice", choices[0], doc, low=0.0, high=float(len(choices)), option=option, choices=choices)


def betas(beta1: float, beta2: float, option: str = "betas", names: Tuple[str, str] = ("beta1", "beta2"),
          docs: Tuple[str, str] = ("first-moment decay", "second-moment decay")) -> Tuple[Field, Field]:
    return (unit(names[0], beta1, docs[0], option=option, part=0), unit(names[1], beta2, docs[1], option=option, part=1))


# ---- the table -----------------------------------------------------------------------------------------

_ADAM = Kind(
    "adam", "Adam", ELEMENTWISE, "Adam and AdamW (torch.optim.Adam, AdamW); the BertAdam form without bias_correction",
    fields=(*betas(0.9, 0.999),
            real("weight_decay", 0.0, "L2 (or decoupled) weight decay"),
            real("eps", 1e-8, "added to the denominator"),
            flag("amsgrad", False, "keep the running maximum of exp_avg_sq"),
            flag("decoupled_weight_decay", False, "AdamW's decay: p *= 1 - lr * weight_decay"),
            flag("bias_correction", True, "divide the moments by 1 - beta^t (False: the BertAdam form)")),
    states=(State(0, "exp_avg"), State(1, "exp_avg_sq"), State(2, "max_exp_avg_sq", when="amsgrad")),
    classes=(OptimizerClass("AdamW", 1e-3, "torch.optim.AdamW", torch="AdamW", defaults={"weight_decay": 1e-2},
                            fixed={"decoupled_weight_decay": True}, aliases=("adamw_torch",)),
             OptimizerClass("Adam", 1e-3, "torch.optim.Adam", torch="Adam",
                            note="`weight_decay` is L2 (added to the gradient) unless `decoupled_weight_decay`")),
)

_SGD = Kind(
    "sgd", "SGD", ELEMENTWISE, "SGD (torch.optim.SGD)",
    fields=(real("momentum", 0.0, "momentum factor (0: no momentum buffer)"),
            real("dampening", 0.0, "dampening of the momentum", low=None),
            real("weight_decay", 0.0, "L2 weight decay"),
            flag("nesterov", False, "Nesterov momentum")),
    states=(State(0, "momentum_buffer", when="momentum"),),
    rules=(Rule("nesterov", "momentum", ">", 0.0), Rule("nesterov", "dampening", "==", 0.0)),
    classes=(OptimizerClass("SGD", 1e-3, "torch.optim.SGD", torch="SGD", aliases=("momentum", "nesterov")),),
)

_LION = Kind(
    "lion", "Lion", ELEMENTWISE, "Lion",
    fields=(*betas(0.9, 0.99, docs=("interpolation of the update's momentum", "decay of exp_avg")),
            real("weight_decay", 0.0, "decoupled weight decay")),
    states=(State(0, "exp_avg"),),
    classes=(OptimizerClass("Lion", 1e-4, "the Lion paper (sign of an interpolated momentum)"),),
)

_RMSPROP = Kind(
    "rmsprop", "RMSprop", ELEMENTWISE, "RMSprop (torch.optim.RMSprop) and timm's RMSpropTF (tf_style)",
    fields=(real("alpha", 0.99, "smoothing constant of square_avg"),
            real("eps", 1e-8, "added to the denominator (inside the square root with tf_style)"),
            real("weight_decay", 0.0, "L2 (or decoupled) weight decay"),
            real("momentum", 0.0, "momentum factor (0: no momentum buffer)"),
            flag("centered", False, "normalise by the centered second moment (keeps grad_avg)"),
            flag("tf_style", False, "the TensorFlow form; square_avg starts at 1"),
            flag("lr_in_momentum", False, "the lr multiplies the momentum buffer's input (tf_style)"),
            flag("decoupled_weight_decay", False, "p *= 1 - lr * weight_decay (tf_style)")),
    states=(State(0, "square_avg", initial=1.0, initial_when="tf_style"), State(1, "momentum_buffer", when="momentum"),
            State(2, "grad_avg", when="centered")),
    rules=(Rule("lr_in_momentum", "tf_style", "!=", 0.0), Rule("decoupled_weight_decay", "tf_style", "!=", 0.0)),
    classes=(OptimizerClass("RMSprop", 1e-2, "torch.optim.RMSprop", torch="RMSprop", aliases=("RMSProp",),
                            fixed={"tf_style": False, "lr_in_momentum": False, "decoupled_weight_decay": False}),
             OptimizerClass("RMSpropTF", 1e-2, "timm's RMSpropTF (TensorFlow's form: eps inside the square root, "
                            "square_avg starting at 1)", defaults={"alpha": 0.9, "eps": 1e-10, "lr_in_momentum": True},
                            fixed={"tf_style": True}, options={"decoupled_weight_decay": "decoupled_decay"})),
)

_ADADELTA = Kind(
    "adadelta", "Adadelta", ELEMENTWISE, "Adadelta (torch.optim.Adadelta)",
    fields=(real("rho", 0.9, "decay of square_avg and acc_delta", high=1.0, high_closed=True),
            real("eps", 1e-6, "added inside the square roots"),
            real("weight_decay", 0.0, "L2 weight decay")),
    states=(State(0, "square_avg"), State(1, "acc_delta")),
    classes=(OptimizerClass("Adadelta", 1.0, "torch.optim.Adadelta", torch="Adadelta"),),
)

_RADAM = Kind(
    "radam", "RAdam", ELEMENTWISE, "RAdam (torch.optim.RAdam)",
    fields=(*betas(0.9, 0.999),
            real("eps", 1e-8, "added to the denominator"),
            real("weight_decay", 0.0, "L2 (or decoupled) weight decay"),
            flag("decoupled_weight_decay", False, "p *= 1 - lr * weight_decay")),
    states=(State(0, "exp_avg"), State(1, "exp_avg_sq")),
    classes=(OptimizerClass("RAdam", 1e-3, "torch.optim.RAdam", torch="RAdam"),),
)

_NADAM = Kind(
    "nadam", "NAdam", ELEMENTWISE, "NAdam (torch.optim.NAdam)",
    fields=(*betas(0.9, 0.999),
            real("eps", 1e-8, "added to the denominator"),
            real("weight_decay", 0.0, "L2 (or decoupled) weight decay"),
            real("momentum_decay", 4e-3, "the momentum schedule's decay"),
            flag("decoupled_weight_decay", False, "p *= 1 - lr * weight_decay")),
    states=(State(0, "exp_avg"), State(1, "exp_avg_sq"), State(2, "mu_product", scalar=True, initial=1.0)),
    classes=(OptimizerClass("NAdam", 2e-3, "torch.optim.NAdam", torch="NAdam"),),
)

_LAMB = Kind(
    "lamb", "Lamb", COMPOSITE, "Lamb (timm's Lamb; its clipping is max_grad_norm)",
    fields=(*betas(0.9, 0.999),
            real("eps", 1e-6, "added to the denominator"),
            real("weight_decay", 0.01, "L2 (or decoupled) weight decay"),
            flag("bias_correction", True, "divide the moments by 1 - beta^t"),
            flag("grad_averaging", True, "exp_avg takes (1 - beta1) * g (else g)"),
            flag("trust_clip", False, "the trust ratio is at most 1"),
            flag("always_adapt", False, "apply the trust ratio also without weight decay"),
            flag("caution", False, "drop the update's entries whose sign disagrees with the gradient's"),
            flag("decoupled_weight_decay", False, "p *= 1 - lr * weight_decay", option="decoupled_decay"),
            flag("corrected_weight_decay", False, "the decoupled decay is scaled by lr / max_lr"),
            real("max_lr", 0.0, "the constructor's lr (corrected_weight_decay's scale)", source="initial_lr")),
    states=(State(0, "exp_avg"), State(1, "exp_avg_sq")),
    classes=(OptimizerClass("Lamb", 1e-3, "timm's Lamb (NVLAMB: Adam moments, the update scaled per tensor by the "
                            "trust ratio ||w|| / ||update||)", max_grad_norm=1.0,
                            note="`max_grad_norm` is timm's built-in global-norm clipping"),),
)

_ADAMP = Kind(
    "adamp", "AdamP", COMPOSITE, "AdamP (timm's AdamP; NOTE [adamp projection] in csrc/ops/fused_adamp.cpp)",
    fields=(*betas(0.9, 0.999),
            real("eps", 1e-8, "added to the denominator and the norms"),
            real("weight_decay", 0.0, "decoupled weight decay (times wd_ratio where projected)"),
            real("delta", 0.1, "cosine threshold of the projection"),
            real("wd_ratio", 0.1, "the weight decay's factor where the projection is taken"),
            flag("nesterov", False, "Nesterov momentum in the direction")),
    states=(State(0, "exp_avg"), State(1, "exp_avg_sq")),
    classes=(OptimizerClass("AdamP", 1e-3, "timm's AdamP (the update of a weight of 2+ dims projected off the "
                            "weight's direction when the gradient is nearly orthogonal to it, per channel or per "
                            "layer)"),),
)

_MUON = Kind(
    "muon", "Muon", COMPOSITE,
    "Muon (torch.optim.Muon's update) for use_muon groups, AdamW for the others (NOTE [muon groups])",
    fields=(flag("use_muon", True, "a Muon group (else AdamW)"),
            unit("momentum", 0.95, "momentum factor"),
            flag("nesterov", True, "Nesterov momentum"),
            real("weight_decay", 0.1, "decoupled weight decay (both kinds of groups)"),
            real("ns_a", 3.4445, "Newton-Schulz coefficient a", low=None, option="ns_coefficients", part=0),
            real("ns_b", -4.775, "Newton-Schulz coefficient b", low=None, option="ns_coefficients", part=1),
            real("ns_c", 2.0315, "Newton-Schulz coefficient c", low=None, option="ns_coefficients", part=2),
            real("eps", 1e-7, "floor of the Newton-Schulz normalisation"),
            integer("ns_steps", 5, "Newton-Schulz iterations", high=100.0),
            choice("match_rms_adamw", "adjust_lr_fn", ("original", "match_rms_adamw"),
                   "adjust_lr_fn: 'original' (lr x sqrt(max(1, rows/cols))) or 'match_rms_adamw' (lr x 0.2 "
                   "sqrt(max(rows, cols)))"),
            *betas(0.9, 0.95, option="adamw_betas", names=("adamw_beta1", "adamw_beta2"),
                   docs=("AdamW groups: first-moment decay", "AdamW groups: second-moment decay")),
            real("adamw_eps", 1e-8, "AdamW groups: added to the denominator")),
    states=(State(0, "momentum_buffer", when="use_muon"), State(0, "exp_avg", when="use_muon", when_set=False),
            State(1, "exp_avg_sq", when="use_muon", when_set=False)),
    param_rules=(ParamRule("use_muon", 2, "Muon updates matrices and convolution filters: put params of fewer than "
                                          "2 dims in a group with use_muon false (AdamW)"),),
    classes=(OptimizerClass("Muon", 1e-3, "torch.optim.Muon for params of 2 or more dims, AdamW for the others",
                            torch="Muon", maximize=False),),
)

# The passes of the composite kinds (NOTE [apply pass] in csrc/ops/aten_stage.h).
_DIRECTION = Kind(
    "direction", "Direction", INTERNAL, "Adam's moments and direction into a scratch tensor (Lamb, AdamP)",
    fields=(real("beta1", 0.9, "first-moment decay"), real("beta2", 0.999, "second-moment decay"),
            real("eps", 1e-8, "added to the denominator"),
            real("beta3", 0.1, "the gradient's weight in the first moment (Lamb without grad_averaging: 1)"),
            real("l2_decay", 0.0, "added as l2_decay * w to the direction, or 0"),
            flag("bias_correction", True, "divide the moments by 1 - beta^t"),
            flag("nesterov", False, "Nesterov momentum")),
    states=(State(0, "exp_avg"), State(1, "exp_avg_sq"), State(2, "weights", when="l2_decay")),
)

_APPLY = Kind(
    "apply", "Apply", INTERNAL, "decay and step with a direction computed before (Lamb, AdamP, Muon)",
    fields=(real("weight_decay", 0.0, "decoupled weight decay"),
            real("lr_ratio", 1.0, "Muon's shape adjustment of the lr (adjust_lr_fn)"),
            flag("aux_scales_step", False, "the per-tensor input scales the step (Lamb's trust ratio)"),
            real("aux_base", 0.0, "else the decay is weight_decay * (aux_base + aux_mul * input)", low=None),
            real("aux_mul", 1.0, "(AdamP: an exact 0/1 selector, aux_base 1, aux_mul wd_ratio - 1)", low=None),
            real("decay_max_lr", 0.0, "> 0: the decay is scaled by lr / decay_max_lr (timm's corrected decay)")),
    aux="input",
)

#: Every kind: the element-wise ones first (the order of the kernels' kind enum), then the composite ones and the
#: internal passes.
KIND_TABLE: Tuple[Kind, ...] = (_ADAM, _SGD, _LION, _RMSPROP, _ADADELTA, _RADAM, _NADAM, _LAMB, _ADAMP, _MUON,
                                _DIRECTION, _APPLY)


def _classes() -> Dict[str, Tuple[Kind, OptimizerClass]]:
    out: Dict[str, Tuple[Kind, OptimizerClass]] = {}
    for kind in KIND_TABLE:
        for cls in kind.classes:
            out[cls.name] = (kind, cls)
    return out


#: Every front-end class by name, with its kind, in the table's order.
CLASSES: Dict[str, Tuple[Kind, OptimizerClass]] = _classes()


def table_digest() -> str:
    """A digest of the whole table; the native library carries the one it was generated from."""
    return hashlib.sha1(repr(KIND_TABLE).encode()).hexdigest()[:16]
