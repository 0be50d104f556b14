"""The optimizer table (_table.py, NOTE [optimizer table]) as the Python
classes read it: each kind of ``fusetrain::fused_step_`` by name, and the
names derived from the classes. The native library must have been generated
from the same table: an optimizer's constructor checks that
(``check_native``: a clear error instead of records that do not fit; the
package still imports, so that ``python -m fusetrain.optim --write`` runs)."""

from __future__ import annotations

from typing import Any, Dict, Tuple

from .. import _C
from ._table import CLASSES, INTERNAL, KIND_TABLE, Kind, table_digest

__all__ = ["KINDS", "LEAN_CLASSES", "SHARD_LOCAL_CLASSES", "class_names", "check_native"]


def _entry(kind: Kind) -> Dict[str, Any]:
    fields = [dict(name=f.name, type=f.type, doc=f.doc, default=f.default, allowed=f.allowed()) for f in kind.fields]
    states = [dict(slot=s.slot, name=s.name, when=s.when, when_set=s.when_set, scalar=s.scalar, initial=s.initial,
                   initial_when=s.initial_when) for s in kind.states]
    names = kind.field_names
    return dict(name=kind.name, doc=kind.doc, form=kind.form, fields=fields, states=states,
                value_fields=kind.value_fields, lean=kind.lean, field_names=names,
                state_rules=tuple((s.slot, s.name, s.when, s.when_set) for s in kind.states),
                value_positions=tuple(names.index(n) for n in kind.value_fields), decl=kind)


_NATIVE: Dict[str, bool] = {}


def check_native() -> None:
    """Raises when the native library was generated from another optimizer table than this package's."""
    if _NATIVE.get("ok"):
        return
    built = getattr(_C, "optim_table_digest", lambda: None)()
    if built != table_digest():
        raise RuntimeError(
            f"fusetrain: the native library was generated from another optimizer table ({built}) than "
            f"python/fusetrain/optim/_table.py ({table_digest()}): run `python -m fusetrain.optim --write` and "
            "rebuild the native code (bash scripts/setup)")
    _NATIVE["ok"] = True

#: Every kind fused_step_ takes, by name (the internal passes of the composite kinds are not among them).
KINDS: Dict[str, Dict[str, Any]] = {k.name: _entry(k) for k in KIND_TABLE if k.form != INTERNAL}


def class_names(lean: bool = False) -> Tuple[str, ...]:
    """The optimizer classes' names in the table's order (``lean``: those of the element-wise kinds)."""
    return tuple(name for name, (kind, _) in CLASSES.items() if kind.lean or not lean)


#: The classes that take lean state (NOTE [lean state]) and whose update is element-wise, so that a DTensor's
#: local shard can be updated alone (NOTE [sharded steps] in _sharded.py).
LEAN_CLASSES: Tuple[str, ...] = class_names(lean=True)
SHARD_LOCAL_CLASSES: Tuple[str, ...] = LEAN_CLASSES
