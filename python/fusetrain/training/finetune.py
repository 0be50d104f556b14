"""Starting from pretrained weights: loading a state dict into a model with
another head, freezing by name, per-group learning-rate multipliers and
layer-wise decay (training_params ``pretrained_weights``,
``pretrained_params``, ``freeze``, ``freeze_bn_stats``, ``lr_multipliers``,
``layer_decay``).

Name patterns (``freeze``, ``lr_multipliers``) match parameter names as
``fnmatch`` globs (``backbone.*``, ``*.bias``); a pattern without a wildcard
also matches everything below that module (``backbone`` = ``backbone.*``).
"""

from __future__ import annotations

import difflib
import fnmatch
import re
from typing import Any, Dict, List, Mapping, Optional, Sequence

import torch
from torch import nn

from .._warnings import warn
from .checkpoint.weights import read_weights
from .params import TrainingParamsError

__all__ = ["load_pretrained", "freeze", "frozen_bn_modules", "lr_scales", "param_groups", "LoadReport"]

LoadReport = Dict[str, List[str]]


def matches(name: str, pattern: str) -> bool:
    """Whether a parameter/module name matches a pattern (see the module doc)."""
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(name, pattern)
    return name == pattern or name.startswith(pattern + ".")


def _remap(sd: Mapping[str, torch.Tensor], key_map: Mapping[str, str]) -> Dict[str, torch.Tensor]:
    """Replace the first matching key prefix (longest first); ``""`` -> prefix adds one."""
    prefixes = sorted(key_map, key=len, reverse=True)
    out = {}
    for k, v in sd.items():
        for old in prefixes:
            if k.startswith(old):
                k = key_map[old] + k[len(old):]
                break
        out[k] = v
    return out


def load_pretrained(model: nn.Module, path: str, strict: bool = False, key_map: Optional[Mapping[str, str]] = None,
                    use_ema: bool = False, trusted: bool = False) -> LoadReport:
    """Copy the weights of ``path`` into ``model`` and report what did not fit.

    Keys are remapped by ``key_map`` (checkpoint prefix -> model prefix; the
    ``module.`` prefix of a DDP-saved state dict is dropped when the model has
    none). Tensors whose shape differs from the model's (a new head) are
    skipped. Returns ``{"loaded", "missing", "unexpected", "mismatched"}``
    (key lists; mismatched entries read ``key: checkpoint shape -> model
    shape``). With ``strict`` anything but a full match raises; without it,
    loading nothing at all raises too (a wrong file or prefix). The file is
    read as data unless ``trusted`` (NOTE [checkpoints are data])."""
    sd = read_weights(path, use_ema, trusted)
    own = model.state_dict()
    key_map = dict(key_map or {})
    if not any(k.startswith("module.") for k in own) and sd and all(k.startswith("module.") for k in sd):
        key_map.setdefault("module.", "")
    sd = _remap(sd, key_map)
    report: LoadReport = {"loaded": [], "missing": [], "unexpected": [], "mismatched": []}
    fit = {}
    for k, v in sd.items():
        if k not in own:
            report["unexpected"].append(k)
        elif tuple(v.shape) != tuple(own[k].shape):
            report["mismatched"].append(f"{k}: {tuple(v.shape)} -> {tuple(own[k].shape)}")
        else:
            fit[k] = v
            report["loaded"].append(k)
    report["missing"] = [k for k in own if k not in fit and not any(m.startswith(k + ":") for m in
                                                                     report["mismatched"])]
    problems = {k: v for k, v in report.items() if k != "loaded" and v}
    where = "training_params.pretrained_weights"
    if strict and problems:
        raise ValueError(f"{where}: {path} does not match the model (pretrained_params.strict is true): "
                         + "; ".join(f"{k}: {_few(v)}" for k, v in problems.items()))
    if not fit:
        raise ValueError(f"{where}: none of the {len(sd)} tensors of {path} fits the model (e.g. checkpoint keys "
                         f"{_few(list(sd))}, model keys {_few(list(own))}); map the prefixes with "
                         f"pretrained_params.key_map")
    with torch.no_grad():
        for k, v in fit.items():
            own[k].copy_(v)
    return report


def _few(keys: Sequence[str], n: int = 4) -> str:
    return ", ".join(keys[:n]) + (f" and {len(keys) - n} more" if len(keys) > n else "")


def freeze(model: nn.Module, patterns: Sequence[str]) -> List[str]:
    """Turn off ``requires_grad`` of the parameters matching ``patterns``;
    returns their names. A pattern matching nothing raises."""
    names = [n for n, _ in model.named_parameters()]
    unused = [pat for pat in patterns if not any(matches(n, pat) for n in names)]
    if unused:
        raise TrainingParamsError([f"training_params.freeze: {unused} match(es) no parameter of the model (e.g. "
                                   f"{_few(names)})"])
    frozen = []
    for n, q in model.named_parameters():
        if any(matches(n, pat) for pat in patterns):
            q.requires_grad_(False)
            frozen.append(n)
    return frozen


def frozen_bn_modules(model: nn.Module) -> List[nn.Module]:
    """The normalisation layers with running statistics whose parameters are
    all frozen (or that have none): with ``freeze_bn_stats`` they stay in eval
    mode while the rest trains."""
    out = []
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats:
            if all(not q.requires_grad for q in m.parameters(recurse=False)):
                out.append(m)
    return out


def closest_prefixes(prefix: str, names: Sequence[str], n: int = 3) -> List[str]:
    """The ``n`` module paths and parameter names of ``names`` nearest to
    ``prefix``: those sharing more of its leading dotted parts first, then
    those as deep as it, then by string similarity."""
    candidates: Dict[str, None] = {}
    for name in names:
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            candidates.setdefault(".".join(parts[:i]))
    wanted = prefix.split(".")

    def shared(candidate: str) -> int:
        k = 0
        for a, b in zip(candidate.split("."), wanted):
            if a != b:
                break
            k += 1
        return k

    ranked = sorted(candidates, key=lambda c: (-shared(c), abs(c.count(".") - prefix.count(".")),
                                               -difflib.SequenceMatcher(None, prefix, c).ratio()))
    return ranked[:n]


def prefix_scales(names: Sequence[str], initial_lr: Any) -> Dict[str, float]:
    """``initial_lr`` by parameter-name prefix ({default: .., prefix: ..}): each
    name's rate relative to ``default``, from the longest prefix it starts with
    (1.0 for a plain float)."""
    if not isinstance(initial_lr, Mapping):
        return {n: 1.0 for n in names}
    default = float(initial_lr["default"])
    prefixes = sorted((k for k in initial_lr if k != "default"), key=len, reverse=True)
    unused = [pre for pre in prefixes if not any(n.startswith(pre) for n in names)]
    if unused:
        raise TrainingParamsError([
            f"training_params.initial_lr: prefix {pre!r} matches no trainable parameter of the model; its closest "
            f"parameter-name prefixes: {', '.join(map(repr, closest_prefixes(pre, names)))}; allowed: a prefix "
            f"of trainable parameter names, or 'default'" for pre in sorted(unused)])
    return {n: next((float(initial_lr[pre]) / default for pre in prefixes if n.startswith(pre)), 1.0)
            for n in names}


def lr_scales(model: nn.Module, multipliers: Mapping[str, float], layer_decay: Optional[Mapping[str, Any]],
              initial_lr: Any = None) -> Dict[str, float]:
    """The lr multiplier of every trainable parameter: its per-prefix
    ``initial_lr`` relative to the default one, times the first matching
    ``multipliers`` pattern (1.0 for none), times the layer-wise decay."""
    names = [n for n, q in model.named_parameters() if q.requires_grad]
    by_prefix = prefix_scales(names, initial_lr)
    unused = [pat for pat in multipliers if not any(matches(n, pat) for n in names)]
    if unused:
        raise TrainingParamsError([f"training_params.lr_multipliers: {unused} match(es) no trainable parameter "
                                   f"(e.g. {_few(names)})"])
    scales = {}
    for n in names:
        scales[n] = by_prefix[n] * next((float(m) for pat, m in multipliers.items() if matches(n, pat)), 1.0)
    if layer_decay:
        for n, s in _layer_decay(names, layer_decay).items():
            scales[n] *= s
    return scales


def _layer_decay(names: Sequence[str], cfg: Mapping[str, Any]) -> Dict[str, float]:
    """rate ** (L + 1 - layer) with layer 1..L the block a parameter sits in,
    0 for those before the first block (embeddings) and L + 1 after (head)."""
    rx = re.compile(cfg["pattern"])
    ids: Dict[str, Optional[int]] = {}
    for n in names:
        m = rx.search(n)
        ids[n] = int(m.group(1)) + 1 if m else None
    blocks = [i for i in ids.values() if i is not None]
    if not blocks:
        raise TrainingParamsError([f"training_params.layer_decay.pattern: {cfg['pattern']!r} matches no trainable "
                                   f"parameter (e.g. {_few(list(names))}); allowed: a regex whose group 1 is the "
                                   f"block index"])
    last = max(blocks)
    seen_block = False
    out = {}
    for n in names:  # model order: before the first block is the stem, after the blocks the head
        if ids[n] is not None:
            seen_block = True
            layer = ids[n]
        else:
            layer = last + 1 if seen_block else 0
        out[n] = float(cfg["rate"]) ** (last + 1 - layer)
    return out


def param_groups(model: nn.Module, zero_decay_1d: bool, multipliers: Mapping[str, float],
                 layer_decay: Optional[Mapping[str, Any]], initial_lr: Any = None) -> List[Dict[str, Any]]:
    """The optimizer's param groups: one per (lr scale, weight decay off) pair,
    in order of first appearance; each carries ``lr_scale``, which every
    schedule multiplies the learning rate by."""
    scales = lr_scales(model, multipliers, layer_decay, initial_lr)
    groups: Dict[Any, Dict[str, Any]] = {}
    for n, q in model.named_parameters():
        if not q.requires_grad:
            continue
        no_decay = zero_decay_1d and q.dim() <= 1
        key = (scales[n], no_decay)
        if key not in groups:
            groups[key] = {"params": [], "lr_scale": scales[n], **({"weight_decay": 0.0} if no_decay else {})}
        groups[key]["params"].append(q)
    if not groups:
        raise ValueError("Trainer: the model has no trainable parameters (every parameter has requires_grad False; "
                         "training_params.freeze may have frozen them all)")
    return list(groups.values())


def report_text(report: LoadReport, path: str) -> str:
    parts = [f"loaded {len(report['loaded'])} tensors from {path}"]
    for k in ("mismatched", "missing", "unexpected"):
        if report[k]:
            parts.append(f"{k} ({len(report[k])}): {_few(report[k])}")
    return "; ".join(parts)


def warn_report(report: LoadReport, path: str) -> None:
    if report["mismatched"] or report["missing"] or report["unexpected"]:
        warn(f"training_params.pretrained_weights: {report_text(report, path)}")
