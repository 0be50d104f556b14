"""The translation report: each SG key, what it became, and the places where
SuperGradients' behaviour is reproduced on purpose."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Sequence

__all__ = ["Entry", "TranslationReport", "SGTranslationError", "KINDS"]

#: How an SG key translates.
KINDS = {
    "same": "the same key and meaning",
    "renamed": "another fusetrain key (or value name)",
    "reproduced": "SG's behaviour reproduced on purpose (see below)",
    "no effect": "SG's default, or a setting with nothing to do in fusetrain",
    "supplied": "SG's value has no counterpart; the value given in `supply` is used",
    "not available": "no counterpart in this fusetrain; nothing changes in training",
}


def _short(value: Any, limit: int = 70) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


@dataclass
class Entry:
    sg_key: str
    sg_value: Any
    kind: str
    became: str


@dataclass
class TranslationReport:
    """What :func:`~fusetrain.compat.super_gradients.translate` did: ``entries``
    (one per SG key), ``reproduced`` (SG behaviours kept on purpose) and
    ``differences`` (where a result can still differ from SG's). ``str()``
    renders it as text."""

    source: str
    entries: List[Entry] = field(default_factory=list)
    reproduced: List[str] = field(default_factory=list)
    differences: List[str] = field(default_factory=list)

    def add(self, sg_key: str, sg_value: Any, kind: str, became: str) -> None:
        if kind not in KINDS:
            raise ValueError(f"report kind {kind!r}; allowed: {list(KINDS)}")
        self.entries.append(Entry(sg_key, sg_value, kind, became))

    def reproduce(self, text: str) -> None:
        if text not in self.reproduced:
            self.reproduced.append(text)

    def differ(self, text: str) -> None:
        if text not in self.differences:
            self.differences.append(text)

    def entry(self, sg_key: str) -> Entry:
        return next(e for e in self.entries if e.sg_key == sg_key)

    def to_dict(self) -> Dict[str, Any]:
        return {"source": self.source, "reproduced": list(self.reproduced), "differences": list(self.differences),
                "entries": [{"sg_key": e.sg_key, "sg_value": repr(e.sg_value), "kind": e.kind, "became": e.became}
                            for e in self.entries]}

    def __str__(self) -> str:
        width = max([len(e.sg_key) for e in self.entries] + [6])
        lines = [f"SuperGradients training hyperparameters from {self.source}:", ""]
        for kind in KINDS:
            rows = [e for e in self.entries if e.kind == kind]
            if not rows:
                continue
            lines.append(f"{kind} ({KINDS[kind]}):")
            lines += [f"  {e.sg_key:<{width}}  {_short(e.sg_value):<30} -> {e.became}" for e in rows]
            lines.append("")
        if self.reproduced:
            lines.append("SuperGradients' behaviour reproduced on purpose:")
            lines += [f"  - {t}" for t in self.reproduced]
            lines.append("")
        if self.differences:
            lines.append("Where the run can still differ from SuperGradients':")
            lines += [f"  - {t}" for t in self.differences]
        return "\n".join(lines).rstrip() + "\n"


class SGTranslationError(ValueError):
    """SG training hyperparameters that cannot be translated: ``errors`` holds
    one message per SG key, each naming the fusetrain alternative."""

    def __init__(self, errors: Sequence[str], source: str = "") -> None:
        self.errors = list(errors)
        head = f"super_gradients: {source}: " if source else "super_gradients: "
        if len(self.errors) == 1:
            message = head + self.errors[0]
        else:
            message = head + f"{len(self.errors)} keys have no fusetrain counterpart:\n" + "\n".join(
                f"  - {e}" for e in self.errors)
        super().__init__(message)
