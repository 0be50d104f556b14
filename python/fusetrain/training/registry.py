"""Names that training params and recipes use for losses, metrics and
callbacks: a registered name, ``{name: {arguments}}``, or a class path
(``package.module.Name``); unknown names get the closest valid one suggested."""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Mapping
from typing import Any, Dict, Sequence, Tuple

__all__ = ["import_path", "closest_hint", "split_spec", "resolve_name"]


def import_path(path: str, where: str) -> Any:
    """The object at ``package.module.Name``; ``ValueError`` naming ``where`` otherwise."""
    module, _, attr = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ValueError(f"{where}: cannot import {path!r} ({type(exc).__name__}: {exc})") from exc


def closest_hint(name: str, names: Sequence[str]) -> str:
    """``"did you mean 'x'?"``, or the list of valid names when none is close."""
    lowered = {n.lower(): n for n in names}
    if name.lower() in lowered:  # a case slip: crossentropyloss -> CrossEntropyLoss
        close = [lowered[name.lower()]]
    else:
        close = difflib.get_close_matches(name, list(names), n=1, cutoff=0.5)
    return f"did you mean {close[0]!r}?" if close else f"allowed: {', '.join(sorted(names))} or a class path"


def split_spec(spec: Any, where: str) -> Tuple[Any, Dict[str, Any]]:
    """``name`` or ``{name: {arguments}}`` to ``(name, arguments)``."""
    if isinstance(spec, Mapping):
        if len(spec) != 1:
            raise ValueError(f"{where}: got {dict(spec)!r}; allowed: a mapping with one entry {{name: {{arguments}}}}")
        (name, kwargs), = spec.items()
        kwargs = {} if kwargs is None else kwargs
        if not isinstance(kwargs, Mapping):
            raise ValueError(f"{where}.{name}: got {kwargs!r}; allowed: a mapping of constructor arguments")
        return name, dict(kwargs)
    return spec, {}


def resolve_name(name: Any, registry: Mapping[str, Any], where: str, kind: str) -> Any:
    """A registered name's factory, or the object at a class path."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}: got {name!r} ({type(name).__name__}); allowed: a {kind} name, a class path "
                         f"or a {kind} object")
    if name in registry:
        return registry[name]
    if "." in name:
        return import_path(name, where)
    raise ValueError(f"{where}: unknown {kind} {name!r}; {closest_hint(name, list(registry))}")
