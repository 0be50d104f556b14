"""Transforms of a sample ``(image, target)`` that keep the target aligned with
the image, and the collate function of detection and segmentation loaders.

A target is a class index (classification, left alone), a mask ``[H, W]``
(segmentation: resized with nearest neighbours, flipped with the image) or a
dict with ``boxes`` ``[K, 4]`` (x1, y1, x2, y2 pixels) and ``labels``
(detection: boxes scaled and flipped with the image; other entries kept).
"""

from __future__ import annotations

import random
from typing import Any, Callable, Dict, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["Compose", "Resize", "RandomHorizontalFlip", "Normalize", "DenseTargets", "collate"]

Sample = Tuple[Tensor, Any]


class Compose:
    """Apply ``transforms`` in order to ``(image, target)``."""

    def __init__(self, transforms: Sequence[Callable[[Tensor, Any], Sample]]) -> None:
        self.transforms = list(transforms)

    def __call__(self, image: Tensor, target: Any) -> Sample:
        for t in self.transforms:
            image, target = t(image, target)
        return image, target


def _size(size: Union[int, Sequence[int]]) -> Tuple[int, int]:
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size, size
    if (isinstance(size, (tuple, list)) and len(size) == 2
            and all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in size)):
        return int(size[0]), int(size[1])
    raise ValueError(f"Resize: size must be an int > 0 or (height, width), got {size!r}")


class Resize:
    """Resize the image to ``size`` (an int: square; or (height, width)),
    bilinearly; a mask with nearest neighbours; boxes scaled."""

    def __init__(self, size: Union[int, Sequence[int]]) -> None:
        self.size = _size(size)

    def __call__(self, image: Tensor, target: Any) -> Sample:
        h, w = image.shape[-2:]
        if (h, w) == self.size:
            return image, target
        image = F.interpolate(image[None], size=self.size, mode="bilinear", align_corners=False)[0]
        sy, sx = self.size[0] / h, self.size[1] / w
        if isinstance(target, Tensor) and target.shape[-2:] == (h, w) and target.dim() >= 2:
            target = F.interpolate(target[None, None].float(), size=self.size, mode="nearest")[0, 0].to(target.dtype)
        elif isinstance(target, dict) and "boxes" in target:
            target = dict(target, boxes=target["boxes"] * torch.tensor([sx, sy, sx, sy], dtype=target["boxes"].dtype))
        return image, target


class RandomHorizontalFlip:
    """Flip image and target left-right with probability ``p`` (Python's
    ``random``, which the Trainer seeds)."""

    def __init__(self, p: float = 0.5) -> None:
        self.p = float(p)

    def __call__(self, image: Tensor, target: Any) -> Sample:
        if random.random() >= self.p:
            return image, target
        w = image.shape[-1]
        image = image.flip(-1)
        if isinstance(target, Tensor) and target.dim() >= 2 and target.shape[-1] == w:
            target = target.flip(-1)
        elif isinstance(target, dict) and "boxes" in target:
            b = target["boxes"]
            target = dict(target, boxes=torch.stack([w - b[:, 2], b[:, 1], w - b[:, 0], b[:, 3]], dim=1))
        return image, target


class Normalize:
    """``(image - mean) / std`` per channel; the target is left alone."""

    def __init__(self, mean: Sequence[float], std: Sequence[float]) -> None:
        self.mean = torch.tensor(mean, dtype=torch.float32)[:, None, None]
        self.std = torch.tensor(std, dtype=torch.float32)[:, None, None]

    def __call__(self, image: Tensor, target: Any) -> Sample:
        return (image - self.mean) / self.std, target


class DenseTargets:
    """Box targets to the dense per-location targets of ``yolo_csp``
    (:func:`fusetrain.models.dense_detection_targets`, computed once per sample
    here rather than in the training step). ``keep_boxes``: return the dict
    with a ``"dense"`` entry added (validation: the loss reads ``dense``, the
    mAP metric ``boxes`` and ``labels``); otherwise the dense tensor alone."""

    def __init__(self, keep_boxes: bool = False) -> None:
        self.keep_boxes = bool(keep_boxes)

    def __call__(self, image: Tensor, target: Dict[str, Tensor]) -> Sample:
        from ...models import dense_detection_targets

        dense = dense_detection_targets(target["boxes"], target["labels"], image.shape[-2], image.shape[-1])
        return image, (dict(target, dense=dense) if self.keep_boxes else dense)


def _stack_or_list(items: Sequence[Any]) -> Any:
    if all(isinstance(t, Tensor) for t in items) and len({(t.shape, t.dtype) for t in items}) == 1:
        return torch.stack(list(items))
    return list(items)


def collate(batch: Sequence[Sample]) -> Tuple[Any, Any]:
    """``(images, targets)`` of a batch of samples: tensors of one shape are
    stacked (images, masks, dense targets), anything else (per-image dicts of
    boxes, images of different sizes) becomes a list."""
    images, targets = zip(*batch)
    return _stack_or_list(images), _stack_or_list(targets)
