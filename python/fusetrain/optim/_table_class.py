"""What a Python optimizer class takes from its entry in the optimizer table
(NOTE [optimizer table] in _table.py): the defaults of its signature, the
checks of its arguments, its param groups' keys, and the record of a group.
A mixin of ``FusedOptimizer`` (_base.py).

NOTE [table defaults]: a class's ``__init__`` keeps torch's signature (names,
order, keyword-only arguments) and writes ``DEFAULT`` where the value comes
from the table; defining the class replaces each ``DEFAULT`` by the table's
value (``inspect.signature`` and ``help()`` show the numbers), and
``_from_table(params, locals())`` does the rest."""

from __future__ import annotations

import inspect
import math
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .. import _C
from ._kinds import check_native
from .._checks import check_number
from ._settings import _no_differentiable, _torch_checks
from ._table import CLASSES, DEFAULT, ELEMENTWISE, Field, Kind, OptimizerClass

# The arguments FusedOptimizer.__init__ takes itself.
_BASE_ARGS = ("max_grad_norm", "master_weights", "state_dtype", "state_block_size")
_PLANS: Dict[type, Any] = {}  # TableClass._record_plan, per class
_MAXIMIZE = Field("maximize", "flag", False, "")


def _table_default(cls: type, name: str) -> Any:
    kind, decl = cls._table_kind, cls._decl
    if name == "lr":
        return decl.lr
    if name == "max_grad_norm":
        return decl.max_grad_norm
    if name in dict(kind.options_of(decl)):
        return kind.option_default(decl, name)
    raise TypeError(f"{cls.__name__}.__init__: {name}=DEFAULT, but '{name}' is no option of the optimizer table's "
                    f"{decl.name} (python/fusetrain/optim/_table.py)")


def _fill_defaults(cls: type) -> None:
    """NOTE [table defaults]: the table's values for the DEFAULT markers of ``cls.__init__``."""
    init = cls.__dict__["__init__"]
    code = init.__code__
    names = code.co_varnames[:code.co_argcount]
    if init.__defaults__:
        positional = names[len(names) - len(init.__defaults__):]
        init.__defaults__ = tuple(_table_default(cls, n) if d is DEFAULT else d
                                  for n, d in zip(positional, init.__defaults__))
    if init.__kwdefaults__:
        init.__kwdefaults__ = {n: _table_default(cls, n) if d is DEFAULT else d for n, d in init.__kwdefaults__.items()}


def _check_real(opt: str, name: str, f: Field, value: Any) -> float:
    """A real option (or a part of a tuple option) in its field's range, or a clear error naming it."""
    check_number(opt, name, value, f.low, None if math.isinf(f.high) else f.high, high_closed=f.high_closed,
                 tensor=True)
    return float(value)


def _check_option(opt: str, name: str, fields: Tuple[Field, ...], value: Any, strict_flags: bool) -> Any:
    """``value`` of option ``name`` checked against its fields and normalised (tuples of floats, bools, ints),
    or a clear error naming it."""
    first = fields[0]
    if len(fields) > 1 or first.part is not None:
        if not isinstance(value, (tuple, list)) or len(value) != len(fields):
            what = "a pair" if len(fields) == 2 else f"{len(fields)} numbers"
            raise ValueError(f"{opt}: {name} must be {what} ({', '.join(f.name for f in fields)}), got {value!r}")
        return tuple(_check_real(opt, f"{name}[{f.part}]", f, v) for f, v in zip(fields, value))
    if first.type == "flag":
        if strict_flags and not isinstance(value, bool):
            raise TypeError(f"{opt}: {name} must be a bool (True or False), got {type(value).__name__} {value!r}")
        return bool(value)
    if first.type == "int":
        if isinstance(value, bool) or not isinstance(value, int) or not first.admits(float(value)):
            raise ValueError(f"{opt}: {name} must be an int {first.allowed()}, got {value!r}")
        return value
    if first.type == "choice":
        if value is not None and value not in first.choices:
            raise ValueError(f"{opt}: {name} must be None or {first.allowed()}, got {value!r}")
        return value
    return _check_real(opt, name, first, value)


class TableClass:
    """A class of the optimizer table (``_decl``) over its kind (``_table_kind``)."""

    _decl: Optional[OptimizerClass] = None
    _table_kind: Optional[Kind] = None
    # Record fields the class computes itself in _kind_values (Muon's use_muon, from its params).
    _own_fields: Tuple[str, ...] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        entry = CLASSES.get(cls.__name__)
        if entry is not None:
            cls._table_kind, cls._decl = entry
            cls._kind = entry[0].name
            cls._opt_name = cls.__name__
            cls._scalar_states = tuple(s.name for s in entry[0].states if s.scalar)
            # Whether a DTensor's local shard can be updated alone (NOTE [sharded steps] in _sharded.py).
            cls._shard_local = entry[0].form == ELEMENTWISE
        if "__init__" in cls.__dict__ and cls._decl is not None:
            _fill_defaults(cls)

    def _from_table(self, params: Any, args: Dict[str, Any]) -> None:
        """The constructor of a table class; ``args``: its arguments (``locals()`` of its ``__init__``).
        Where the class has a torch counterpart its checks run first (torch's exceptions and messages), then
        the table's checks of every option; the group defaults are torch's keys with the class's own."""
        check_native()
        kind, decl, opt = self._table_kind, self._decl, self._opt_name
        args = {k: v for k, v in args.items() if k not in ("self", "params", "__class__")}
        if "differentiable" in args:
            _no_differentiable(opt, args.pop("differentiable"))
        base = {k: args.pop(k) for k in _BASE_ARGS if k in args}
        defaults: Dict[str, Any] = {}
        takes: Any = ()  # the arguments torch's class takes (and checks)
        if decl.torch is not None:
            torch_cls = getattr(torch.optim, decl.torch)
            takes = inspect.signature(torch_cls).parameters
            defaults = _torch_checks(torch_cls, **{k: v for k, v in args.items() if k in takes})
        else:
            check_number(opt, "lr", args["lr"], 0.0, tensor=True)
        options = dict(kind.options_of(decl), maximize=(_MAXIMIZE,))
        for name, value in args.items():
            if name in options:
                # A flag torch does not take must be a bool (a string such as "false" would count as true).
                value = _check_option(opt, name, options[name], value, strict_flags=name not in takes)
            defaults[name] = value
        if not decl.maximize:
            defaults["maximize"] = False
        lr = args["lr"]
        self._initial_lr = float(lr)  # a source of the record (Lamb's max_lr), read once
        record = [float(v) for v in self._record_of(defaults)]
        try:
            _C.check_kind_record(kind.name, record)  # the rules between fields
        except ValueError as e:
            raise ValueError(f"{opt}: {str(e).removeprefix(kind.name + ': ')}") from None
        self._init_fused(params, defaults, **base)

    def _check_group_options(self, where: str, group: Dict[str, Any]) -> None:
        """A param group's lr and options checked as the constructor checks its arguments (the group keeps
        its values as given), or a clear error naming the first bad one."""
        kind, decl = self._table_kind, self._decl
        if decl is None:
            return
        check_number(where, "lr", group["lr"], 0.0, tensor=True)
        takes = inspect.signature(getattr(torch.optim, decl.torch)).parameters if decl.torch is not None else ()
        for name, fields in dict(kind.options_of(decl), maximize=(_MAXIMIZE,)).items():
            if name in group:
                _check_option(where, name, fields, group[name], strict_flags=name not in takes)

    def _record_of(self, group: Dict[str, Any]) -> List[Any]:
        """The record fields of a group (a dict with the class's option keys) in the table's order, as the
        group holds them (bools, floats, a choice's index)."""
        plan = _PLANS.get(type(self)) or self._record_plan()
        own = self._kind_values(group) if self._own_fields else None
        return [get(self, group, own) for get in plan]

    def _kind_values(self, group: Dict[str, Any]) -> Dict[str, Any]:
        """The fields of ``_own_fields``, by name."""
        return {}

    def _record_plan(self) -> Tuple[Callable[..., Any], ...]:
        """Per class, made once: a getter per record field (from the group's option, a fixed value, the
        initial lr or ``_kind_values``)."""
        kind, decl = self._table_kind, self._decl
        options = {f.name: name for name, fields in kind.options_of(decl) for f in fields}
        plan = tuple(_getter(f, decl, options.get(f.name), f.name in self._own_fields) for f in kind.fields)
        _PLANS[type(self)] = plan
        return plan


def _getter(f: Field, decl: OptimizerClass, option: Optional[str], own: bool) -> Callable[..., Any]:
    """How a record field is read: ``get(optimizer, group, own_values)``."""
    name = f.name
    if own:
        return lambda opt, group, values: values[name]
    if name in decl.fixed:
        fixed = float(decl.fixed[name])
        return lambda opt, group, values: fixed
    if f.source == "initial_lr":
        return lambda opt, group, values: opt._initial_lr
    if f.type == "choice":
        choices = f.choices
        return lambda opt, group, values: 0 if group[option] is None else choices.index(group[option])
    if f.part is not None:
        part = f.part
        return lambda opt, group, values: group[option][part]
    return lambda opt, group, values: group[option]
