"""Reading SuperGradients training hyperparameters as its recipes write them:
a YAML file whose ``defaults`` list names ``default_train_params`` (and maybe
other files of the same folder), ``${...}`` interpolations, and ``_target_``
nodes.

NOTE [safe targets]: a ``_target_`` node is never imported. The few targets
that build plain values (``numpy.arange``, ``numpy.linspace``, SG's
``empty_list``, ``builtins.list``/``dict``) are evaluated here by their
documented meaning; any other becomes an :class:`SGObject` (its name and
arguments), which the translation reports as an SG-only object.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional

from .defaults import sg_defaults

__all__ = ["SGObject", "SAFE_TARGETS", "load_sg_params"]


@dataclass
class SGObject:
    """A ``_target_`` node that is not evaluated: the object SuperGradients
    would build (``target``, a class path) and its arguments."""

    target: str
    kwargs: Dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.target.rsplit(".", 1)[-1]

    def __repr__(self) -> str:
        return f"<{self.target}({', '.join(f'{k}={v!r}' for k, v in self.kwargs.items())})>"


def _arange(start: float = 0, stop: Optional[float] = None, step: float = 1, **_: Any) -> List[Any]:
    if stop is None:
        start, stop = 0, start
    n = max(0, math.ceil((stop - start) / step))
    values = [start + i * step for i in range(n)]
    return [int(v) if float(v).is_integer() else v for v in values]


def _linspace(start: float, stop: float, num: int = 50, endpoint: bool = True, **_: Any) -> List[float]:
    if num == 1:
        return [float(start)]
    div = (num - 1) if endpoint else num
    return [start + (stop - start) * i / div for i in range(num)]


def _empty_list(**_: Any) -> List[Any]:
    return []


#: The ``_target_`` values evaluated (to plain lists and dicts); every other target stays an :class:`SGObject`.
SAFE_TARGETS: Dict[str, Callable[..., Any]] = {
    "numpy.arange": _arange, "np.arange": _arange, "numpy.linspace": _linspace, "np.linspace": _linspace,
    "super_gradients.training.utils.utils.empty_list": _empty_list, "builtins.list": lambda *a, **_: list(*a),
    "builtins.dict": lambda **kw: dict(kw),
}


def _objects(value: Any) -> Any:
    """``_target_`` nodes to plain values (safe targets) or :class:`SGObject`."""
    if isinstance(value, Mapping):
        items = {k: _objects(v) for k, v in value.items() if k not in ("_convert_", "_recursive_", "_partial_")}
        if "_target_" in items:
            target = str(items.pop("_target_"))
            if target in SAFE_TARGETS:
                args = items.pop("_args_", [])
                return SAFE_TARGETS[target](*args, **items)
            return SGObject(target, items)
        return items
    if isinstance(value, (list, tuple)):
        return [_objects(v) for v in value]
    return value


def _read_yaml(path: str) -> Dict[str, Any]:
    from ..._optional import require

    yaml = require("yaml", "reading SuperGradients YAML files")
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if not os.path.isfile(path):
        shipped = _shipped(path)
        hint = f" (fusetrain ships a file of that name: {shipped})" if os.path.isfile(shipped) else ""
        raise FileNotFoundError(f"super_gradients: no file at {path}{hint}")
    try:
        data = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    except (yaml.YAMLError, UnicodeDecodeError, OmegaConfBaseException) as e:
        where = getattr(e, "problem_mark", None)
        line = f" (line {where.line + 1}, column {where.column + 1})" if where is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ValueError(f"super_gradients: {path} is not readable YAML{line}: {problem}; allowed: a YAML file of "
                         f"SG training hyperparameters") from None
    if not isinstance(data, dict):
        raise ValueError(f"super_gradients: {path} holds a {type(data).__name__}; allowed: a mapping of SG training "
                         f"hyperparameters")
    return data


def _merge(base: Dict[str, Any], over: Mapping[str, Any]) -> Dict[str, Any]:
    """``over`` merged into ``base`` as Hydra merges configs: mappings key by
    key, anything else replaced (a list over a ``_target_`` node included)."""
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping) and "_target_" not in v \
                and "_target_" not in out[k]:
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def _shipped(path: str) -> str:
    """The file of ``path``'s name among the SG files fusetrain ships (``SG_RECIPES_DIR``)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "sg_recipes", os.path.basename(path))


def _compose(path: str, seen: tuple = ()) -> Dict[str, Any]:
    """The file's keys over those of its defaults list (in order), as Hydra
    merges them with the file itself last. A bare file name that is not in the
    working directory is looked up among the shipped files."""
    if not seen and not os.path.dirname(path) and not os.path.isfile(path) and os.path.isfile(_shipped(path)):
        path = _shipped(path)
    if path in seen:
        raise ValueError(f"super_gradients: {path}: its defaults list includes itself ({' -> '.join(seen)})")
    data = _read_yaml(path)
    defaults = data.pop("defaults", [])
    if not isinstance(defaults, list):
        raise ValueError(f"super_gradients: {path}: defaults: got {defaults!r}; allowed: a list of file names")
    merged: Dict[str, Any] = {}
    for entry in defaults:
        name = entry if isinstance(entry, str) else None
        if isinstance(entry, dict) and len(entry) == 1:  # {training_hyperparams: name} or {override ...: name}
            name = str(next(iter(entry.values())))
        if name is None:
            raise ValueError(f"super_gradients: {path}: defaults entry {entry!r} is not a file name")
        if name == "_self_":
            continue
        name = name.split("/")[-1].lstrip("@")
        if name == "default_train_params":
            base: Dict[str, Any] = sg_defaults()
        else:
            sibling = os.path.join(os.path.dirname(path), name + ".yaml")
            if not os.path.isfile(sibling):
                raise FileNotFoundError(f"super_gradients: {path}: defaults entry {name!r}: no file {sibling}")
            base = _compose(sibling, seen + (path,))
        merged = _merge(merged, base)
    return _merge(merged, data)


def _override(raw: Dict[str, Any], overrides: Mapping[str, Any]) -> Dict[str, Any]:
    """``overrides`` (dotted keys, as Hydra's ``key.sub=value``) set in ``raw``."""
    out = dict(raw)
    for dotted, value in overrides.items():
        node, parts = out, str(dotted).split(".")
        for part in parts[:-1]:
            child = node.get(part)
            node[part] = dict(child) if isinstance(child, Mapping) else {}
            node = node[part]
        node[parts[-1]] = value
    return out


def load_sg_params(source: Any, overrides: Optional[Mapping[str, Any]] = None) -> Dict[str, Any]:
    """SG training hyperparameters from a YAML path (defaults list followed,
    ``${...}`` resolved within the file) or a dict as SG's Hydra resolves it,
    with ``overrides`` (dotted SG keys -> values, set before interpolations
    resolve), SG's defaults under the keys it does not set and ``_target_``
    nodes evaluated or kept as :class:`SGObject` (NOTE [safe targets])."""
    from ..._optional import require

    require("omegaconf", "translating SuperGradients training hyperparameters")
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    overrides = dict(overrides or {})
    if isinstance(source, Mapping):  # already resolved by SG's Hydra (it may hold objects OmegaConf refuses)
        resolved = _override(dict(source), overrides)
    elif isinstance(source, (str, os.PathLike)):
        try:
            raw = _override(_compose(os.fspath(source)), overrides)
            resolved = OmegaConf.to_container(OmegaConf.create(raw), resolve=True)
        except OmegaConfBaseException as e:
            raise ValueError(f"super_gradients: {os.fspath(source)}: an interpolation does not resolve within the "
                             f"training hyperparameters ({e}); pass the dict as SG's Hydra resolves the whole "
                             f"recipe") from None
    else:
        raise TypeError(f"super_gradients.translate: got {type(source).__name__}; allowed: a path to an SG training "
                        f"hyperparameters YAML or a dict of them")
    params = sg_defaults()
    for key, value in resolved.items():
        params[key] = value
    params.pop("_convert_", None)
    return _objects(params)
