"""``average_best_models``: the weight average of the k best models of a run.

NOTE [average of the best models]: after each epoch-end validation the
watched weights (the EMA's with ``ema``, else the model's) join the k best
models by ``metric_to_watch`` when fewer than k are kept or when they beat
the worst kept one (strictly; a tie keeps the earlier model); a non-finite
metric never joins. The average is the element-wise mean of the kept state
dicts, computed in float64 and stored in each tensor's dtype: floating
tensors (weights, BatchNorm running mean and variance) are averaged as they
are; integer tensors (BatchNorm's ``num_batches_tracked``) take the mean
rounded down, so the file loads into the model with its dtypes.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Mapping, Optional

import torch

__all__ = ["BestModels", "average_state_dicts"]


def average_state_dicts(state_dicts: List[Mapping[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    """The element-wise mean of state dicts with the same keys (NOTE [average of the best models])."""
    if not state_dicts:
        raise ValueError("average_state_dicts: got no state dicts")
    n = len(state_dicts)
    out: Dict[str, torch.Tensor] = {}
    for key, first in state_dicts[0].items():
        if first.is_floating_point() or first.is_complex():
            total = sum(sd[key].to(torch.complex128 if first.is_complex() else torch.float64) for sd in state_dicts)
            out[key] = (total / n).to(first.dtype)
        elif first.dtype == torch.bool:
            out[key] = first.clone()
        else:
            total = sum(sd[key].to(torch.int64) for sd in state_dicts)
            out[key] = torch.div(total, n, rounding_mode="floor").to(first.dtype)
    return out


class BestModels:
    """The ``k`` best models of a run by a metric, each as a CPU state dict."""

    def __init__(self, k: int, greater_is_better: bool) -> None:
        self.k, self.greater = k, greater_is_better
        self.kept: List[Dict[str, Any]] = []  # {"epoch", "value", "model"} in the order they joined

    def offer(self, epoch: int, value: Optional[float], state_dict: Mapping[str, torch.Tensor]) -> bool:
        """Keep these weights if they are among the k best so far; returns whether they were kept."""
        if value is None or not math.isfinite(value):
            return False
        entry = {"epoch": epoch, "value": float(value),
                 "model": {k: v.detach().to("cpu", copy=True) for k, v in state_dict.items()}}
        if len(self.kept) < self.k:
            self.kept.append(entry)
            return True
        worst = (min if self.greater else max)(range(len(self.kept)), key=lambda i: self.kept[i]["value"])
        w = self.kept[worst]["value"]
        if (value > w) if self.greater else (value < w):
            self.kept[worst] = entry
            return True
        return False

    def average(self) -> Dict[str, torch.Tensor]:
        return average_state_dicts([e["model"] for e in self.kept])

    def summary(self) -> List[Dict[str, Any]]:
        """``[{"epoch", "value"}]`` of the kept models (what a checkpoint records)."""
        return [{"epoch": e["epoch"], "value": e["value"]} for e in self.kept]

    def state_dict(self) -> Dict[str, Any]:
        return {"k": self.k, "kept": self.kept}

    def load_state_dict(self, state: Mapping[str, Any], listed: Optional[List[Mapping[str, Any]]]) -> List[int]:
        """Keep the saved models that the checkpoint lists (``listed``); returns the epochs it lists but the
        saved state lacks."""
        wanted = [(e["epoch"], e["value"]) for e in (listed or [])]
        by_key = {(e["epoch"], e["value"]): e for e in state.get("kept", [])}
        self.kept = [by_key[w] for w in wanted if w in by_key][: self.k]
        return [epoch for epoch, value in wanted if (epoch, value) not in by_key]
