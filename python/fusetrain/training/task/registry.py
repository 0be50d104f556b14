"""Names that training params and recipes use for losses, metrics and
callbacks: a registered name, ``{name: {arguments}}``, or a class path
(``package.module.Name``); unknown names get the closest valid one suggested."""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Mapping
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

__all__ = ["import_path", "closest_hint", "split_spec", "resolve_name", "build_named", "registrar"]


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


def build_named(spec: Any, registry: Mapping[str, Any], where: str, kind: str) -> Any:
    """The object a spec stands for: a name or ``{name: {arguments}}`` is
    resolved (registry or class path) and called with the arguments; anything
    else is returned as it is (an object given from Python)."""
    if not isinstance(spec, (str, Mapping)):
        return spec
    name, kwargs = split_spec(spec, where)
    factory = resolve_name(name, registry, where, kind)
    try:
        return factory(**kwargs)
    except TypeError as exc:
        raise ValueError(f"{where}: cannot build {kind} {name!r} with {kwargs!r}: {exc}") from exc


def registrar(kind: str, table: Dict[str, Any], reserved: Callable[[str], bool]):
    """The ``register_<kind>(name, factory=None, *, replace=False)`` function of a
    registry ``table``: usable directly or as a decorator; names for which
    ``reserved(name)`` holds (the built-ins) cannot be taken, a registered
    name needs ``replace=True``."""

    def register(name: str, factory: Optional[Any] = None, *, replace: bool = False):
        def add(f: Any) -> Any:
            if not isinstance(name, str) or not name or "." in name:
                raise ValueError(f"register_{kind}: name must be a non-empty string without '.', got {name!r}")
            if not callable(f):
                raise TypeError(f"register_{kind}: {name!r} needs a callable factory, got {type(f).__name__}")
            if reserved(name):
                raise ValueError(f"register_{kind}: {name!r} is a built-in {kind} name")
            if name in table and not replace:
                raise ValueError(f"register_{kind}: {name!r} is already registered; pass replace=True to "
                                 f"replace it")
            table[name] = f
            return f

        return add if factory is None else add(factory)

    register.__doc__ = (f"Register ``factory`` (a class, or a callable returning the {kind}) under ``name`` "
                        f"so that training params and recipes can name it; usable as a decorator: "
                        f"``@fusetrain.register_{kind}(\"name\")``. Built-in names cannot be taken; a "
                        f"registered name needs ``replace=True`` to be replaced.")
    return register
