"""Validators of training parameters and the error they raise.

A validator is called as ``validator(value, path)`` and returns the
normalised value or raises :class:`Invalid` with the complete user-facing
message (``<path>: got <value> (<type>); allowed: <description>``);
``validator.description`` is the "allowed: ..." text, also shown in the
reference table.
"""

from __future__ import annotations

import copy
import difflib
import inspect
import math
import numbers
import re
from collections.abc import Mapping
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

ROOT = "training_params"


class TrainingParamsError(ValueError):
    """Invalid ``training_params``. ``errors`` lists every problem found, one
    message each; the exception message is the single problem, or all of them."""

    def __init__(self, errors: Sequence[str]) -> None:
        self.errors = list(errors)
        if len(self.errors) == 1:
            message = self.errors[0]
        else:
            message = f"{ROOT}: {len(self.errors)} problems:\n" + "\n".join(f"  - {e}" for e in self.errors)
        super().__init__(message)


class Invalid(Exception):
    """Raised by validators; carries the complete user-facing message."""


class Validator:
    __slots__ = ("description", "_check")

    def __init__(self, description: str, check: Callable[[Any, str], Any]) -> None:
        self.description = description
        self._check = check

    def __call__(self, value: Any, path: str) -> Any:
        return self._check(value, path)

    def __repr__(self) -> str:
        return f"<validator: {self.description}>"


def type_name(value: Any) -> str:
    return type(value).__name__


def show(value: Any) -> str:
    """repr for messages: objects with a multi-line repr (modules, optimizers)
    by their type, long reprs shortened."""
    text = repr(value)
    if "\n" in text:
        return f"<{type(value).__qualname__} object>"
    return text if len(text) <= 160 else text[:157] + "..."


def reject(path: str, value: Any, allowed: str) -> "None":
    raise Invalid(f"{path}: got {show(value)} ({type_name(value)}); allowed: {allowed}")


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


def int_range(min: Optional[int] = None, max: Optional[int] = None) -> Validator:
    """An int (bools rejected) in [min, max]."""
    desc = "an int" + _bounds_text(min, max, True, True)

    def check(v: Any, path: str) -> int:
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or not _in_bounds(int(v), min, max, True, True):
            reject(path, v, desc)
        return int(v)

    return Validator(desc, check)


def float_range(min: Optional[float] = None, max: Optional[float] = None, min_inclusive: bool = True,
           max_inclusive: bool = True) -> Validator:
    """A finite float (ints accepted, bools rejected) within the bounds."""
    desc = "a float" + _bounds_text(min, max, min_inclusive, max_inclusive)

    def check(v: Any, path: str) -> float:
        if (isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(float(v))
                or not _in_bounds(float(v), min, max, min_inclusive, max_inclusive)):
            reject(path, v, desc)
        return float(v)

    return Validator(desc, check)


def boolean() -> Validator:
    """A real bool: 1/0 and strings such as "yes" are rejected (YAML true/false load as bools)."""
    desc = "a bool (true or false)"

    def check(v: Any, path: str) -> bool:
        if not isinstance(v, bool):
            reject(path, v, desc)
        return v

    return Validator(desc, check)


def string(description: str = "a non-empty string") -> Validator:
    def check(v: Any, path: str) -> str:
        if not isinstance(v, str) or not v:
            reject(path, v, description)
        return v

    return Validator(description, check)


def choice(*choices: str, case_insensitive: bool = False, description: Optional[str] = None,
           hints: Optional[Mapping[str, str]] = None) -> Validator:
    """One of ``choices``; with ``case_insensitive`` matched ignoring case and
    normalised to the spelling in ``choices``. A string that is none of them
    gets a "did you mean" from ``hints`` (other libraries' names) or the
    closest choices."""
    desc = description or ("one of " + ", ".join(repr(c) for c in choices)
                           + (" (case-insensitive)" if case_insensitive else ""))
    canonical = {(c.lower() if case_insensitive else c): c for c in choices}

    def check(v: Any, path: str) -> str:
        if isinstance(v, str):
            key = v.lower() if case_insensitive else v
            if key in canonical:
                return canonical[key]
            raise Invalid(f"{path}: got {show(v)} ({type_name(v)}); allowed: {desc}"
                          + suggestion(v, choices, hints))
        reject(path, v, desc)

    return Validator(desc, check)


def regex(pattern: str, description: str) -> Validator:
    rx = re.compile(pattern)

    def check(v: Any, path: str) -> str:
        if not isinstance(v, str) or not rx.fullmatch(v):
            reject(path, v, description)
        return v

    return Validator(description, check)


def optional(inner: Validator) -> Validator:
    """``inner`` or None."""
    desc = f"{inner.description} or None"

    def check(v: Any, path: str) -> Any:
        if v is None:
            return None
        try:
            return inner(v, path)
        except Invalid as e:
            if str(e).startswith(f"{path}: got "):  # the value itself is wrong: say that None works too
                hint = str(e).rsplit("; did you mean", 1)[1] if "; did you mean" in str(e) else ""
                raise Invalid(f"{path}: got {show(v)} ({type_name(v)}); allowed: {desc}"
                              + (f"; did you mean{hint}" if hint else "")) from None
            raise  # a problem inside it (a nested key) keeps its own message

    return Validator(desc, check)


def any_of(*alternatives: Validator, description: Optional[str] = None) -> Validator:
    """The first alternative that accepts the value."""
    descs = [a.description for a in alternatives]
    desc = description or (descs[0] if len(descs) == 1 else ", ".join(descs[:-1]) + " or " + descs[-1])

    def check(v: Any, path: str) -> Any:
        hint = ""
        for a in alternatives:
            try:
                return a(v, path)
            except Invalid as e:
                hint = hint or ("; did you mean" + str(e).rsplit("; did you mean", 1)[1]
                                if "; did you mean" in str(e) else "")
        raise Invalid(f"{path}: got {show(v)} ({type_name(v)}); allowed: {desc}{hint}")

    return Validator(desc, check)


def subclass_of(base: type, description: str) -> Validator:
    def check(v: Any, path: str) -> type:
        if not (isinstance(v, type) and issubclass(v, base)):
            reject(path, v, description)
        return v

    return Validator(description, check)


def callable_value(description: str) -> Validator:
    """A callable object or function; classes and strings are rejected."""

    def check(v: Any, path: str) -> Any:
        if isinstance(v, (type, str)) or not callable(v):
            reject(path, v, description)
        return v

    return Validator(description, check)


def list_of(item: Validator, description: Optional[str] = None, unique: bool = False) -> Validator:
    """A list (or tuple) of items accepted by ``item``; returns a list."""
    desc = description or (f"a list of values, each {item.description}" + (", no duplicates" if unique else ""))

    def check(v: Any, path: str) -> List[Any]:
        if not isinstance(v, (list, tuple)):
            reject(path, v, desc)
        out = [item(x, f"{path}[{i}]") for i, x in enumerate(v)]
        if unique and len(set(out)) != len(out):
            reject(path, v, desc)
        return out

    return Validator(desc, check)


def string_keyed_dict(v: Any, path: str, desc: str) -> Dict[str, Any]:
    if not isinstance(v, Mapping) or not all(isinstance(k, str) for k in v):
        reject(path, v, desc)
    return dict(v)


def str_dict(description: str = "a dict with string keys") -> Validator:
    """Any mapping with string keys (values unchecked)."""

    def check(v: Any, path: str) -> Dict[str, Any]:
        return string_keyed_dict(v, path, description)

    return Validator(description, check)


def dict_of(value: Validator, description: Optional[str] = None) -> Validator:
    """A mapping with string keys whose values are each accepted by ``value``
    (insertion order kept); returns a dict."""
    desc = description or f"a dict with string keys and values {value.description}"

    def check(v: Any, path: str) -> Dict[str, Any]:
        v = string_keyed_dict(v, path, desc)
        return {k: value(x, f"{path}[{k!r}]") for k, x in v.items()}

    return Validator(desc, check)


DOCS_HINT = "see docs/training_params.md"


def _fold(text: str) -> str:
    """``text`` without case, spaces and punctuation: ``mAP@0.50`` and ``map_50`` differ, ``Top-5`` and ``top5`` not."""
    return re.sub(r"[^0-9a-z]", "", text.lower())


def closest(name: str, valid: Sequence[str], n: int = 3) -> List[str]:
    """The valid names closest to ``name``: an exact match ignoring case and
    punctuation first, then difflib's closest spellings (ignoring case)."""
    folded = [v for v in valid if _fold(v) == _fold(name)]
    if folded:
        return folded[:1]
    lower = {v.lower(): v for v in valid}
    ranked = [(difflib.SequenceMatcher(None, name.lower(), m).ratio(), m) for m in
              difflib.get_close_matches(name.lower(), list(lower), n=n, cutoff=0.6)]
    # Only names about as close as the best one: 'max_epoch' is 'max_epochs', not also 'max_steps'.
    return [lower[m] for r, m in ranked if r >= ranked[0][0] - 0.1]


def suggestion(name: str, valid: Sequence[str], hints: Optional[Mapping[str, str]] = None,
               valid_hints_only: bool = False) -> str:
    """"; did you mean ...?" for ``name``: the synonym table ``hints`` first
    (with ``valid_hints_only``, a synonym that is one of ``valid``), then the
    closest valid names other than ``name`` (empty when nothing is close)."""
    if hints:
        hint = hints.get(name)
        if hint is None:
            hint = next((h for k, h in hints.items() if _fold(k) == _fold(name)), None)
        if hint is not None and hint != name and (hint in valid or not valid_hints_only):
            return f"; did you mean {hint!r}?"
    close = [c for c in closest(name, valid) if c != name]
    if not close:
        return ""
    return "; did you mean " + " or ".join(repr(c) for c in close) + "?"


def unknown_key(path: str, key: str, valid: Sequence[str], hints: Optional[Mapping[str, str]] = None) -> str:
    """The message for an unknown key: a known synonym, else the few closest
    valid keys, else where the keys are listed (never all of them)."""
    hint = suggestion(key, valid, hints)
    if hint:
        return f"{path}: unknown key {key!r}{hint}"
    if len(valid) <= 12:
        listed = ", ".join(valid) if valid else "(none)"
        return f"{path}: unknown key {key!r}; valid keys: {listed}"
    return f"{path}: unknown key {key!r}; no valid key is close ({DOCS_HINT} for all {len(valid)})"


def check_keys(path: str, mapping: Mapping[str, Any], valid: Sequence[str], reserved: Mapping[str, str],
                open_ended: bool = False) -> None:
    """Raise for a reserved key (with its reason) or a key not in ``valid``
    (unless ``open_ended``: the target takes ``**kwargs``)."""
    for key in mapping:
        if key in reserved:
            raise Invalid(f"{path}: key {key!r} is not allowed; {reserved[key]}")
        if key not in valid and not open_ended:
            raise Invalid(unknown_key(path, key, valid))


def record(fields: Mapping[str, Validator], required: Sequence[str] = (),
            defaults: Optional[Mapping[str, Any]] = None, reserved: Optional[Mapping[str, str]] = None,
            description: Optional[str] = None) -> Validator:
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
        v = string_keyed_dict(v, path, desc)
        check_keys(path, v, list(fields), reserved)
        for k in required:
            if k not in v:
                raise Invalid(f"{path}: missing required key {k!r} ({fields[k].description})")
        out = {}
        for k, val in fields.items():
            if k in v:
                out[k] = val(v[k], f"{path}.{k}")
            elif k in defaults:
                out[k] = copy.deepcopy(defaults[k])
        return out

    return Validator(desc, check)


def init_kwargs(cls: Any, skip_first: bool = False, exclude: Sequence[str] = ()) -> Tuple[Tuple[str, ...], bool]:
    """Keyword-argument names of ``cls.__init__`` (without ``self``), or of a
    function ``cls``, without the first positional argument if ``skip_first``
    and without ``exclude``; and whether it takes ``**kwargs``."""
    if isinstance(cls, type):
        params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    else:
        try:
            params = list(inspect.signature(cls).parameters.values())
        except (TypeError, ValueError):  # a builtin without a signature: accept any keyword
            return (), True
    if skip_first and params and params[0].kind in (inspect.Parameter.POSITIONAL_ONLY,
                                                    inspect.Parameter.POSITIONAL_OR_KEYWORD):
        params = params[1:]
    names = tuple(p.name for p in params
                  if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
                  and p.name not in exclude)
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    return names, var_kw


def kwargs_of(cls: type, exclude: Sequence[str], reserved: Mapping[str, str], description: str) -> Validator:
    """A dict of keyword arguments of ``cls`` (keys checked, values left to the constructor)."""

    def check(v: Any, path: str) -> Dict[str, Any]:
        v = string_keyed_dict(v, path, description)
        names, var_kw = init_kwargs(cls, exclude=tuple(exclude) + tuple(reserved))
        check_keys(path, v, names, reserved, open_ended=var_kw)
        return v

    return Validator(description, check)
