"""Turning a user mapping into :class:`TrainingParams`: defaults filled in,
every value checked by its validator, then the checks that involve several
keys; problems are collected and raised together as
:class:`TrainingParamsError`."""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from typing import Any, Dict, Iterator, List, Optional, Sequence

import torch

from .cross_checks import (cross_checks, default_train_metrics, optimizer_class, super_gradients_keys,
                           super_gradients_message, watch_candidates)
from .table import KEY_HINTS, TRAINING_PARAMS
from .validators import ROOT, Invalid, TrainingParamsError, show, type_name, unknown_key

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
    sg_keys = super_gradients_keys(user)
    if len(sg_keys) >= 2:  # one alone is a slip, answered by the synonym table below
        raise TrainingParamsError([super_gradients_message(sg_keys)])
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
    errors = cross_checks(values)
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
