"""SuperGradients' names (optimizers, schedules, warmups, losses, metrics and
the titles its metrics report) and fusetrain's for the same thing.

Names are compared as SuperGradients compares them: ignoring case and every
character but letters and digits (``mAP@0.50`` is ``map050``)."""

from __future__ import annotations

import re
from typing import Any, Dict, List, Mapping, Optional, Tuple

from ...optim._table import CLASSES

__all__ = ["fold", "lookup", "SG_OPTIMIZERS", "SG_LR_MODES", "SG_WARMUPS", "SG_LOSSES", "SG_METRICS",
           "SG_TITLE_TO_METRIC"]


def fold(name: Any) -> str:
    """``name`` as SuperGradients matches names: lower case, letters and digits only."""
    return re.sub(r"[^0-9a-z]", "", str(name).lower())


def lookup(table: Mapping[str, Any], name: Any) -> Optional[Any]:
    """The entry of ``table`` whose key folds like ``name`` (None: none)."""
    key = fold(name)
    return next((v for k, v in table.items() if fold(k) == key), None)


#: SG optimizer names -> fusetrain optimizer names: every optimizer of the optimizer table, by its name and its
#: aliases (SG's spellings, e.g. RMSProp).
SG_OPTIMIZERS = {alias: name for name, (_, cls) in CLASSES.items() for alias in (name,) + cls.aliases}

#: SG lr_mode values (scheduler names and class names) -> fusetrain lr_mode.
SG_LR_MODES = {"step": "step", "StepLRScheduler": "step", "cosine": "cosine", "CosineLRScheduler": "cosine",
               "poly": "poly", "PolyLRScheduler": "poly", "exp": "exponential",
               "ExponentialLRScheduler": "exponential"}

#: SG warmup_mode values -> fusetrain lr_warmup_mode.
SG_WARMUPS = {"LinearEpochLRWarmup": "linear_epoch", "linear_epoch_step": "linear_epoch",
              "linear_step": "linear_epoch", "LinearBatchLRWarmup": "linspace", "linear_batch_step": "linspace"}

#: SG loss names -> (fusetrain loss, {SG argument: fusetrain argument}); arguments not listed have no counterpart.
SG_LOSSES: Dict[str, Tuple[str, Dict[str, str]]] = {
    "CrossEntropyLoss": ("CrossEntropyLoss", {"smooth_eps": "label_smoothing", "ignore_index": "ignore_index",
                                              "weight": "weight", "reduction": "reduction"}),
    "cross_entropy": ("CrossEntropyLoss", {"smooth_eps": "label_smoothing", "ignore_index": "ignore_index",
                                           "weight": "weight", "reduction": "reduction"}),
    "LabelSmoothingCrossEntropyLoss": ("CrossEntropyLoss", {"smooth_eps": "label_smoothing",
                                                            "ignore_index": "ignore_index", "weight": "weight",
                                                            "reduction": "reduction"}),
    "MSE": ("MSELoss", {"reduction": "reduction"}),
    "MSELoss": ("MSELoss", {"reduction": "reduction"}),
    "BCEWithLogitsLoss": ("BCEWithLogitsLoss", {"reduction": "reduction", "pos_weight": "pos_weight"}),
    "L1Loss": ("L1Loss", {"reduction": "reduction"}),
}

#: SG metric names -> (fusetrain metric, {SG argument: fusetrain argument}, the titles the SG metric reports).
SG_METRICS: Dict[str, Tuple[str, Dict[str, str], List[str]]] = {
    "Accuracy": ("accuracy", {}, ["Accuracy"]),
    "Top5": ("top5", {}, ["Top5"]),
    "IoU": ("mean_iou", {"num_classes": "num_classes", "ignore_index": "ignore_index"}, ["IoU"]),
    "PixelAccuracy": ("pixel_accuracy", {"ignore_label": "ignore_index", "ignore_index": "ignore_index"},
                      ["PixelAccuracy"]),
    "DetectionMetrics_050": ("map", {}, ["Precision@0.50", "Recall@0.50", "mAP@0.50", "F1@0.50"]),
    "DetectionMetrics": ("map", {}, ["Precision@0.50:0.95", "Recall@0.50:0.95", "mAP@0.50:0.95",
                                     "F1@0.50:0.95"]),
    "DetectionMetrics_050_095": ("map", {}, ["Precision@0.50:0.95", "Recall@0.50:0.95", "mAP@0.50:0.95",
                                             "F1@0.50:0.95"]),
}

#: The titles SG metrics report -> the name fusetrain's metric reports (None: no counterpart).
SG_TITLE_TO_METRIC: Dict[str, Optional[str]] = {
    "Accuracy": "accuracy", "Top5": "top5", "IoU": "mean_iou", "PixelAccuracy": "pixel_accuracy",
    "mAP@0.50": "map_50", "mAP@0.50:0.95": "map",
}
