"""Metrics computed by torchmetrics: any ``torchmetrics.Metric`` through
:class:`TorchMetric`, and COCO-style box mAP (:class:`DetectionMAP`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from torch import Tensor

from .batches import prediction
from .metric_base import Metric, MetricInputError

__all__ = ["DetectionMAP", "TorchMetric"]


def _detections(outputs: Any) -> List[Dict[str, Tensor]]:
    if isinstance(outputs, Mapping) and "detections" in outputs:
        outputs = outputs["detections"]
    if (isinstance(outputs, (list, tuple)) and all(isinstance(d, Mapping) for d in outputs)
            and all(isinstance(d.get(k), Tensor) for d in outputs for k in ("boxes", "scores", "labels"))):
        return [{"boxes": d["boxes"].float(), "scores": d["scores"].float(), "labels": d["labels"].long()}
                for d in outputs]
    raise MetricInputError("it needs detections: a list of per-image dicts with 'boxes' [K, 4], 'scores' [K] and "
                           "'labels' [K] (a detection model in eval mode), or a dict whose 'detections' entry is one")


def _ground_truth(targets: Any, n: int) -> List[Dict[str, Tensor]]:
    if isinstance(targets, Mapping) and isinstance(targets.get("boxes"), (list, tuple)):
        targets = [{"boxes": b, "labels": c} for b, c in zip(targets["boxes"], targets["labels"])]
    if (isinstance(targets, (list, tuple)) and len(targets) == n and all(isinstance(d, Mapping) for d in targets)
            and all(isinstance(d.get(k), Tensor) for d in targets for k in ("boxes", "labels"))):
        return [{"boxes": d["boxes"].float(), "labels": d["labels"].long()} for d in targets]
    raise MetricInputError(f"it needs targets as a list of {n} per-image dicts with 'boxes' [K, 4] and 'labels' [K]")


def _snake(name: str) -> str:
    out = []
    for i, ch in enumerate(name):
        if ch.isupper() and i and (not name[i - 1].isupper() or (i + 1 < len(name) and name[i + 1].islower())):
            out.append("_")
        out.append(ch.lower())
    return "".join(out)


class TorchMetric(Metric):
    """A ``torchmetrics.Metric`` used as a fusetrain metric: ``update`` receives
    the model's prediction (NOTE [prediction rule]; detection outputs as they
    are) and the targets; ``compute`` is torchmetrics' (which synchronises
    across ranks itself). A tensor result is reported under ``name`` (default:
    the class name in snake case), a dict of scalar tensors as
    ``<name>_<key>``."""

    def __init__(self, metric: Any, name: Optional[str] = None) -> None:
        self.metric = metric
        self.name = name or _snake(type(metric).__name__)
        super().__init__()

    def to(self, device: Union[str, torch.device]) -> "TorchMetric":
        self.metric = self.metric.to(device)
        return super().to(device)

    def reset(self) -> None:
        self.metric.reset()

    @torch.no_grad()
    def update(self, outputs: Any, targets: Any, loss: Optional[Tensor] = None) -> None:
        try:
            preds = prediction(outputs)
        except ValueError:
            preds = outputs
        self.metric.update(preds, targets)

    def compute(self) -> Union[float, Dict[str, float]]:
        res = self.metric.compute()
        if isinstance(res, Mapping):
            return {str(k): float(v) for k, v in res.items() if isinstance(v, Tensor) and v.numel() == 1}
        return float(res)

    def result_names(self) -> Optional[Tuple[str, ...]]:
        return None

    def state_dict(self) -> Dict[str, Any]:
        def cpu(v: Any) -> Any:
            return [cpu(x) for x in v] if isinstance(v, list) else v.cpu() if isinstance(v, Tensor) else v

        return {"states": {k: cpu(v) for k, v in self.metric.metric_state.items()},
                "update_count": getattr(self.metric, "_update_count", 0)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        def dev(v: Any) -> Any:
            return [dev(x) for x in v] if isinstance(v, list) else v.to(self.device) if isinstance(v, Tensor) else v

        for k, v in state["states"].items():
            setattr(self.metric, k, dev(v))
        self.metric._update_count = state["update_count"]


class DetectionMAP(TorchMetric):
    """COCO-style mean average precision of boxes, computed at the end of an
    epoch by ``torchmetrics.detection.MeanAveragePrecision`` (pycocotools'
    evaluation). Reports ``map`` (IoU 0.50:0.95), ``map_50`` and ``map_75``.
    Keyword arguments go to ``MeanAveragePrecision`` (``box_format``,
    ``iou_thresholds``, ``class_metrics``, ``backend``, ...). It keeps every
    image's boxes until ``compute``: a validation metric."""

    def __init__(self, **kwargs: Any) -> None:
        from ..._optional import require

        for module in ("pycocotools", "torchvision"):  # torchmetrics' COCO evaluation and box IoU
            require(module, "the 'map' metric")
        MeanAveragePrecision = require("torchmetrics.detection", "the 'map' metric").MeanAveragePrecision
        super().__init__(MeanAveragePrecision(**kwargs), "map")

    @torch.no_grad()
    def update(self, outputs: Any, targets: Any, loss: Optional[Tensor] = None) -> None:
        preds = _detections(outputs)
        self.metric.update(preds, _ground_truth(targets, len(preds)))

    def compute(self) -> Dict[str, float]:
        res = self.metric.compute()
        return {"": float(res["map"]), "50": float(res["map_50"]), "75": float(res["map_75"])}

    def result_names(self) -> Tuple[str, ...]:
        return ("map", "map_50", "map_75")
