"""The base of fusetrain's metrics: :class:`Metric` (state on the device,
read once by ``compute``), :class:`SumMetric` (a ratio of two running sums)
and the error a metric raises for outputs or targets it cannot handle."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from torch import Tensor

from .batches import describe, prediction

__all__ = ["Metric", "MetricInputError", "SumMetric"]


class MetricInputError(ValueError):
    """A metric was given outputs or targets it cannot handle."""


class Metric:
    """Base class. Subclasses set ``name`` and implement ``reset`` (creating
    their state on ``self.device``), ``update`` and ``compute``.

    ``compute`` returns a float, or a dict of floats reported as
    ``<name>_<key>`` (``<name>`` itself for the key ``""``);
    :meth:`result_names` lists those names (used to check ``metric_to_watch``
    before training). The Trainer moves a metric to the training device with
    :meth:`to`, which also resets it."""

    name = "metric"

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.reset()

    def to(self, device: Union[str, torch.device]) -> "Metric":
        self.device = torch.device(device)
        self.reset()
        return self

    def reset(self) -> None:
        raise NotImplementedError

    def update(self, outputs: Any, targets: Any, loss: Optional[Tensor] = None) -> None:
        raise NotImplementedError

    def compute(self) -> Union[float, Dict[str, float]]:
        raise NotImplementedError

    def state_tensors(self) -> List[Tensor]:
        """Device tensors whose sum over ranks is the metric's state (a
        distributed run all-reduces them before ``compute``)."""
        return []

    def result_names(self) -> Optional[Tuple[str, ...]]:
        """The names ``compute`` reports; None when not known in advance."""
        return (self.name,)

    def state_dict(self) -> Dict[str, Any]:
        """The running state (CPU copies), for a mid-epoch checkpoint."""
        return {"tensors": [t.cpu() for t in self.state_tensors()]}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        mine = self.state_tensors()
        if len(mine) != len(state["tensors"]):
            raise ValueError(f"metric {self.name!r}: the checkpoint has {len(state['tensors'])} state tensors, this "
                             f"metric {len(mine)}")
        for t, v in zip(mine, state["tensors"]):
            t.copy_(v)


class SumMetric(Metric):
    """A ratio of two running float64 sums (``_sum / _count``). A count known
    on the host (``count_on_host``) is added up there and folded into
    ``_count`` when the state is read: one launch a batch less."""

    def reset(self) -> None:
        self._sum = torch.zeros((), dtype=torch.float64, device=self.device)
        self._count = torch.zeros((), dtype=torch.float64, device=self.device)
        self._host_count = 0

    def count_on_host(self, n: int) -> None:
        self._host_count += n

    def state_tensors(self) -> List[Tensor]:
        if self._host_count:
            self._count += self._host_count
            self._host_count = 0
        return [self._sum, self._count]

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self._host_count = 0
        super().load_state_dict(state)

    def compute(self) -> float:
        _, count_t = self.state_tensors()
        count = float(count_t.item())
        return float(self._sum.item()) / count if count > 0 else float("nan")


def _prediction(outputs: Any) -> Tensor:
    try:
        return prediction(outputs)
    except ValueError as exc:
        raise MetricInputError(str(exc)) from None


def _class_indices(pred: Tensor, targets: Any, what: str) -> Tensor:
    if pred.dim() < 2:
        raise MetricInputError(f"it needs class scores [N, C, ...], got {describe(pred)}")
    if not isinstance(targets, Tensor) or targets.is_floating_point() or targets.is_complex():
        raise MetricInputError(f"it needs {what} targets as integer class indices [N, ...], got {describe(targets)}")
    if targets.shape != pred.shape[:1] + pred.shape[2:]:
        raise MetricInputError(f"it needs targets of shape {tuple(pred.shape[:1] + pred.shape[2:])} for scores "
                               f"{tuple(pred.shape)} (class indices, one per score vector), got {describe(targets)}")
    return targets
