"""Metrics: accumulated on the device during an epoch, read once at its end.

A metric is a :class:`Metric`: ``update(outputs, targets, loss)`` launches a
few tensor ops per batch and never reads a value back; ``compute()`` returns
Python floats (one host read, at the end of an epoch or a validation). The
built-in ones keep running sums (or a confusion matrix) in device tensors,
which a distributed run all-reduces (:meth:`Metric.state_tensors`).

Metrics are named in ``train_metrics`` / ``valid_metrics`` by a registered
name (:data:`METRICS`, extended by :func:`register_metric`), a name with
constructor arguments (``{"mean_iou": {"ignore_index": 255}}``), a class path
(``"torchmetrics.classification.MulticlassF1Score": {"num_classes": 10}``), or
given as objects: a :class:`Metric` or a ``torchmetrics.Metric`` instance.

What a metric reads: classification and segmentation metrics take the
model's *prediction* (NOTE [prediction rule] in :mod:`.batches`); detection
metrics take a list of per-image dicts (``boxes``, ``scores``, ``labels``), or
a dict whose ``"detections"`` entry is one.
"""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from torch import Tensor

from .batches import describe, prediction
from .detection_metrics import DetectionMAP, TorchMetric
from .metric_base import Metric, MetricInputError, SumMetric, _class_indices, _prediction
from .registry import build_named, registrar

__all__ = ["Metric", "SumMetric", "Accuracy", "MeanLoss", "MeanIoU", "PixelAccuracy", "DetectionMAP", "TorchMetric",
           "MetricInputError", "MetricSet", "METRICS", "register_metric", "build_metric", "metric_names",
           "metric_name", "prediction"]


class Accuracy(SumMetric):
    """Top-k accuracy: the fraction of targets among the k highest scores.
    Scores [N, C] with targets [N] (classification), or [N, C, H, W] with
    [N, H, W] (per pixel). Targets equal to ``ignore_index`` are not counted."""

    def __init__(self, k: int = 1, ignore_index: Optional[int] = None) -> None:
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"Accuracy: k must be an int >= 1, got {k!r}")
        self.k, self.ignore_index = k, ignore_index
        self.name = "accuracy" if k == 1 else f"top{k}"
        super().__init__()

    @torch.no_grad()
    def update(self, outputs: Any, targets: Any, loss: Optional[Tensor] = None) -> None:
        pred = _prediction(outputs)
        targets = _class_indices(pred, targets, "classification")
        k = min(self.k, pred.shape[1])
        if k == 1:
            correct = pred.argmax(dim=1) == targets
        else:
            correct = (pred.topk(k, dim=1).indices == targets.unsqueeze(1)).any(dim=1)
        if self.ignore_index is None:
            self._sum += correct.sum()
            self.count_on_host(targets.numel())
        else:
            valid = targets != self.ignore_index
            self._sum += (correct & valid).sum()
            self._count += valid.sum()


class MeanLoss(SumMetric):
    """Sample-weighted mean of the loss (the loop reports ``loss`` anyway)."""

    name = "loss"

    @torch.no_grad()
    def update(self, outputs: Any, targets: Any, loss: Optional[Tensor] = None) -> None:
        if loss is None:
            raise MetricInputError("it needs the batch's loss")
        n = _leading(targets)
        self._sum.add_(loss.detach(), alpha=n)
        self.count_on_host(n)


def _leading(value: Any) -> int:
    if isinstance(value, Tensor):
        return value.shape[0] if value.dim() else 1
    if isinstance(value, (list, tuple)):
        return len(value)
    return 1


class _ConfusionMatrix(Metric):
    """A [C, C] confusion matrix (rows: target class, columns: predicted class)
    accumulated on the device with one ``index_put_`` per batch (no
    ``bincount``, whose CUDA kernel reads the maximum on the host). Targets
    equal to ``ignore_index`` or outside [0, C) land in an extra bin that is
    dropped. ``num_classes`` None: the C of the first scores seen."""

    def __init__(self, num_classes: Optional[int] = None, ignore_index: Optional[int] = 255) -> None:
        if num_classes is not None and (isinstance(num_classes, bool) or not isinstance(num_classes, int)
                                        or num_classes < 1):
            raise ValueError(f"{self.name}: num_classes must be an int >= 1 or None, got {num_classes!r}")
        self.num_classes, self.ignore_index = num_classes, ignore_index
        super().__init__()

    def reset(self) -> None:
        n = self.num_classes
        self._cm = None if n is None else torch.zeros(n * n + 1, dtype=torch.float64, device=self.device)

    def state_tensors(self) -> List[Tensor]:
        return [] if self._cm is None else [self._cm]

    def state_dict(self) -> Dict[str, Any]:
        return {"num_classes": self.num_classes, **super().state_dict()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if self._cm is None and state["num_classes"] is not None:
            self.num_classes = state["num_classes"]
            self.reset()
        super().load_state_dict(state)

    @torch.no_grad()
    def update(self, outputs: Any, targets: Any, loss: Optional[Tensor] = None) -> None:
        pred = _prediction(outputs)
        targets = _class_indices(pred, targets, "segmentation")
        c = pred.shape[1]
        if self._cm is None:
            self.num_classes = c
            self.reset()
        elif c != self.num_classes:
            raise MetricInputError(f"it was built for {self.num_classes} classes but the scores have {c}")
        t = targets.reshape(-1).long()
        p = pred.argmax(dim=1).reshape(-1)
        valid = (t >= 0) & (t < c)
        if self.ignore_index is not None:
            valid &= t != self.ignore_index
        idx = torch.where(valid, t * c + p, torch.full_like(t, c * c))
        self._cm.index_put_((idx,), torch.ones((), dtype=torch.float64, device=idx.device).expand_as(idx),
                            accumulate=True)

    def matrix(self) -> Tensor:
        """The confusion matrix so far, [C, C] float64 (on the device)."""
        if self._cm is None:
            raise RuntimeError(f"{self.name}: no batch seen yet")
        c = self.num_classes
        return self._cm[: c * c].view(c, c)


class MeanIoU(_ConfusionMatrix):
    """Mean intersection over union over the classes that occur (in the
    targets or the predictions) in the epoch, from a confusion matrix."""

    name = "mean_iou"

    def compute(self) -> float:
        if self._cm is None:
            return float("nan")
        cm = self.matrix().cpu()
        inter = cm.diagonal()
        union = cm.sum(0) + cm.sum(1) - inter
        present = union > 0
        return float((inter[present] / union[present]).mean()) if bool(present.any()) else float("nan")


class PixelAccuracy(_ConfusionMatrix):
    """The fraction of (non-ignored) pixels whose predicted class is the target."""

    name = "pixel_accuracy"

    def compute(self) -> float:
        if self._cm is None:
            return float("nan")
        cm = self.matrix().cpu()
        total = float(cm.sum())
        return float(cm.diagonal().sum()) / total if total > 0 else float("nan")


# ---- registry ---------------------------------------------------------------------------------------------------

METRICS: Dict[str, Callable[..., Metric]] = {
    "accuracy": Accuracy,
    "top5": lambda **kw: Accuracy(k=5, **kw),
    "loss": MeanLoss,
    "mean_iou": MeanIoU,
    "pixel_accuracy": PixelAccuracy,
    "map": DetectionMAP,
}
_BUILTIN = frozenset(METRICS)


#: ``register_metric(name, factory=None, *, replace=False)``: name a
#: :class:`Metric` subclass (or a callable returning a Metric or a
#: ``torchmetrics.Metric``) for training params and recipes; usable as a
#: decorator: ``@fusetrain.register_metric("f1")``.
register_metric = registrar("metric", METRICS, lambda n: n in _BUILTIN)


def metric_names() -> List[str]:
    return sorted(METRICS)


#: Metric names other libraries report -> the name fusetrain's metrics report. A metric name in
#: train_metrics / valid_metrics / metric_to_watch that matches one of these (ignoring case and
#: punctuation) is taken as the fusetrain name (NOTE [metric names]).
METRIC_NAME_SYNONYMS: Mapping[str, str] = MappingProxyType({
    "Accuracy": "accuracy", "Top1": "accuracy", "Top5": "top5", "IoU": "mean_iou", "mIoU": "mean_iou",
    "PixelAccuracy": "pixel_accuracy", "mAP@0.50:0.95": "map", "mAP": "map", "mAP@0.50": "map_50",
    "mAP@0.5": "map_50", "mAP@0.75": "map_75", "Loss": "loss", "val_loss": "loss", "val_acc": "accuracy",
})


def _fold(name: str) -> str:
    return re.sub(r"[^0-9a-z]", "", name.lower())


def metric_name(name: Any) -> Any:
    """NOTE [metric names]: the name a metric is registered under for a name written the way
    another library writes it. A registered name is itself; otherwise the registered name it
    matches ignoring case and punctuation (``Accuracy``, ``Pixel-Accuracy``), then another
    library's name for a registered metric (SuperGradients' ``IoU``, ``mIoU``, ``Top1``:
    ``METRIC_NAME_SYNONYMS``), then a ``torchmetrics`` class of that name, any
    case (``MulticlassF1Score`` becomes the class path ``torchmetrics.MulticlassF1Score``).
    Anything else (a class path, an unknown name, a non-string) is returned unchanged, for the
    registry to resolve or refuse with the closest names."""
    if not isinstance(name, str) or name in METRICS or re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+", name):
        return name
    folded = _fold(name)
    for known in METRICS:
        if _fold(known) == folded:
            return known
    for other, known in METRIC_NAME_SYNONYMS.items():
        if _fold(other) == folded and known in METRICS:
            return known
    for module in ("torchmetrics", "torchmetrics.classification", "torchmetrics.regression",
                   "torchmetrics.segmentation"):
        try:
            base = importlib.import_module("torchmetrics").Metric
            tm = importlib.import_module(module)
        except ImportError:
            continue
        for attr in dir(tm):
            cls = getattr(tm, attr, None)
            if _fold(attr) == folded and isinstance(cls, type) and issubclass(cls, base):
                return f"{module}.{attr}"
    return name


def _is_torchmetric(obj: Any) -> bool:
    try:
        import torchmetrics
    except ImportError:  # pragma: no cover - torchmetrics is a dependency
        return False
    return isinstance(obj, torchmetrics.Metric)


def as_metric(obj: Any, where: str) -> Metric:
    if isinstance(obj, Metric):
        return obj
    if _is_torchmetric(obj):
        return TorchMetric(obj)
    raise TypeError(f"{where}: got {type(obj).__name__}; allowed: a fusetrain Metric or a torchmetrics.Metric")


def build_metric(spec: Any, where: str = "metric") -> Metric:
    """A :class:`Metric` from a name (any spelling :func:`metric_name` knows), ``{name: kwargs}``,
    class path or object."""
    if isinstance(spec, str):
        spec = metric_name(spec)
    elif isinstance(spec, Mapping) and len(spec) == 1:
        spec = {metric_name(k): v for k, v in spec.items()}
    return as_metric(build_named(spec, METRICS, where, "metric"), where)


class MetricSet:
    """The metrics of one phase (``train``, ``valid``, ``test``): updated per
    batch, computed into ``{result name: float}``. The first update of each
    metric turns any error into a :class:`MetricInputError` naming the metric
    and describing the outputs and targets it was given."""

    def __init__(self, specs: Sequence[Any], phase: str) -> None:
        self.phase = phase
        self.metrics = [build_metric(s, f"training_params.{phase}_metrics[{i}]") for i, s in enumerate(specs)]
        names = [m.name for m in self.metrics]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"training_params.{phase}_metrics: two metrics are named {dup}; give one a name")
        self._checked = False

    def to(self, device: torch.device) -> "MetricSet":
        for m in self.metrics:
            m.to(device)
        return self

    def reset(self) -> None:
        for m in self.metrics:
            m.reset()

    def update(self, outputs: Any, targets: Any, loss: Optional[Tensor]) -> None:
        if self._checked:
            for m in self.metrics:
                m.update(outputs, targets, loss)
            return
        for m in self.metrics:
            try:
                m.update(outputs, targets, loss)
            except Exception as exc:
                raise MetricInputError(
                    f"{self.phase} metric {m.name!r} cannot handle the model's outputs: {exc}. Outputs: "
                    f"{describe(outputs)}; targets: {describe(targets)}") from exc
        self._checked = True

    def state_tensors(self) -> List[Tensor]:
        return [t for m in self.metrics for t in m.state_tensors()]

    def state_dict(self) -> List[Dict[str, Any]]:
        return [m.state_dict() for m in self.metrics]

    def load_state_dict(self, states: List[Dict[str, Any]]) -> None:
        if len(states) != len(self.metrics):
            raise ValueError(f"{self.phase} metrics: the checkpoint has the state of {len(states)} metrics, this run "
                             f"has {len(self.metrics)}")
        for m, s in zip(self.metrics, states):
            m.load_state_dict(s)

    def compute(self) -> Dict[str, float]:
        out: Dict[str, float] = {}
        for m in self.metrics:
            res = m.compute()
            if isinstance(res, Mapping):
                out.update({m.name if k == "" else f"{m.name}_{k}": float(v) for k, v in res.items()})
            else:
                out[m.name] = float(res) if res is not None else math.nan
        return out

    def __len__(self) -> int:
        return len(self.metrics)
