"""Metrics that accumulate on the device and are read once per epoch.

Each metric keeps running sums in device tensors; ``update`` launches a few
tensor ops and never reads a value back; ``compute`` returns Python floats
(one host read per metric, at the end of an epoch or a log interval).
"""

from __future__ import annotations

from typing import Dict, List, Sequence

import torch
from torch import Tensor

__all__ = ["Metric", "Accuracy", "MeanLoss", "build_metrics", "METRIC_NAMES"]


class Metric:
    name = "metric"

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.reset()

    def reset(self) -> None:
        self._sum = torch.zeros((), dtype=torch.float64, device=self.device)
        self._count = torch.zeros((), dtype=torch.float64, device=self.device)

    def update(self, outputs: Tensor, targets: Tensor, loss: Tensor) -> None:
        raise NotImplementedError

    def state_tensors(self) -> List[Tensor]:
        """The running sums (``[sum, count]``, float64 device tensors) that
        define the metric; a distributed run all-reduces them."""
        return [self._sum, self._count]

    def compute(self) -> float:
        count = float(self._count.item())
        return float(self._sum.item()) / count if count > 0 else float("nan")


class Accuracy(Metric):
    """Top-k classification accuracy over (N, C) logits and (N,) class indices."""

    def __init__(self, device: torch.device, k: int = 1) -> None:
        self.k = k
        self.name = "accuracy" if k == 1 else f"top{k}"
        super().__init__(device)

    @torch.no_grad()
    def update(self, outputs: Tensor, targets: Tensor, loss: Tensor) -> None:
        if outputs.dim() != 2:
            raise ValueError(f"{self.name}: needs (N, C) outputs, got shape {tuple(outputs.shape)}")
        k = min(self.k, outputs.shape[1])
        top = outputs.topk(k, dim=1).indices
        correct = (top == targets.view(-1, 1)).any(dim=1)
        self._sum += correct.sum()
        self._count += targets.numel()


class MeanLoss(Metric):
    """Sample-weighted mean of the loss."""

    name = "loss"

    @torch.no_grad()
    def update(self, outputs: Tensor, targets: Tensor, loss: Tensor) -> None:
        n = outputs.shape[0]
        self._sum += loss.detach().double() * n
        self._count += n


METRIC_NAMES = ("accuracy", "top5", "loss")


def build_metrics(names: Sequence[str], device: torch.device) -> List[Metric]:
    out: List[Metric] = []
    for n in names:
        if n == "accuracy":
            out.append(Accuracy(device, 1))
        elif n == "top5":
            out.append(Accuracy(device, 5))
        elif n == "loss":
            out.append(MeanLoss(device))
        else:
            raise ValueError(f"metrics: unknown metric {n!r}; allowed: {', '.join(METRIC_NAMES)}")
    return out


def compute_all(metrics: Sequence[Metric]) -> Dict[str, float]:
    return {m.name: m.compute() for m in metrics}
