"""Detection and segmentation data that ships with the install: scikit-learn's
handwritten digits (real scans, 8x8) placed on a canvas.

Each canvas (``image_size`` x ``image_size``, a faint noise background) holds
1 to ``max_digits`` digits, each scaled to a random size in ``digit_size``,
given a random ink intensity and placed at a random position without
overlapping the others. The train split draws from the digits' train split and
the valid split from its valid split (scikit-learn's digits never appear in
both), so validation measures generalisation to unseen handwriting.
Everything is generated from ``seed`` when the dataset is built: the same
images on every run and machine, no download.

* detection: ``(image, {"boxes": [K, 4] float32 (x1, y1, x2, y2, the tight box
  of the digit's ink), "labels": [K] int64 (digit + label_offset)})``;
  ``label_offset=1`` keeps 0 for the background, as torchvision's detection
  models expect;
* segmentation: ``(image, mask)``, ``mask`` [H, W] int64: 0 background, 1 + the
  digit on the pixels of its ink.

Images are float32 ``[channels, H, W]`` in [0, 1] (grayscale repeated for 3
channels). ``transforms(image, target)`` is applied to each item (see
:mod:`.transforms`).
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import Dataset

from .classification import digits_split

__all__ = ["DigitCanvas", "TASKS"]

TASKS = ("detection", "segmentation")
_INK = 0.35  # a pixel belongs to a digit where its scaled ink is above this (mask)
_BOX_INK = 0.2  # the box is the extent of the pixels above this


def _check_int(name: str, v: Any, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"DigitCanvas: {name} must be an int >= {lo}, got {v!r}")
    return v


class DigitCanvas(Dataset):
    """Digits on a canvas for ``task`` ``"detection"`` or ``"segmentation"``;
    see the module docstring. ``num_images`` defaults to 1200 (train) and 300
    (valid)."""

    def __init__(self, task: str, train: bool = True, num_images: Optional[int] = None, image_size: int = 64,
                 max_digits: int = 3, digit_size: Sequence[int] = (16, 32), channels: int = 3,
                 label_offset: int = 0, seed: int = 0,
                 transforms: Optional[Callable[[Tensor, Any], Tuple[Tensor, Any]]] = None) -> None:
        if task not in TASKS:
            raise ValueError(f"DigitCanvas: task must be one of {TASKS}, got {task!r}")
        num_images = (1200 if train else 300) if num_images is None else _check_int("num_images", num_images, 1)
        _check_int("image_size", image_size, 16)
        _check_int("max_digits", max_digits, 1)
        _check_int("label_offset", label_offset, 0)
        _check_int("seed", seed, 0)
        if channels not in (1, 3):
            raise ValueError(f"DigitCanvas: channels must be 1 or 3, got {channels!r}")
        if (len(digit_size) != 2 or not all(isinstance(s, int) and not isinstance(s, bool) for s in digit_size)
                or not 8 <= digit_size[0] <= digit_size[1] <= image_size):
            raise ValueError(f"DigitCanvas: digit_size must be [min, max] ints with 8 <= min <= max <= image_size "
                             f"({image_size}), got {list(digit_size)!r}")
        self.task, self.train, self.channels, self.transforms = task, bool(train), channels, transforms
        self.image_size, self.label_offset = image_size, label_offset
        self.classes: List[str] = [str(d) for d in range(10)]
        if task == "segmentation":
            self.classes = ["background"] + self.classes
        self.images, self.masks, self.boxes, self.labels = self._generate(num_images, max_digits,
                                                                           tuple(digit_size), seed)

    def _generate(self, n: int, max_digits: int, digit_size: Tuple[int, int], seed: int):
        digits, digit_labels = digits_split(self.train, 8)
        rng = np.random.RandomState([seed, int(self.train)])
        s = self.image_size
        images = np.empty((n, s, s), dtype=np.float32)
        masks = np.zeros((n, s, s), dtype=np.uint8)
        boxes: List[Tensor] = []
        labels: List[Tensor] = []
        for i in range(n):
            canvas = rng.uniform(0.0, 0.15, size=(s, s)).astype(np.float32)
            placed: List[Tuple[int, int, int, int]] = []
            img_boxes, img_labels = [], []
            for _ in range(rng.randint(1, max_digits + 1)):
                for _attempt in range(30):
                    size = rng.randint(digit_size[0], digit_size[1] + 1)
                    x0, y0 = rng.randint(0, s - size + 1), rng.randint(0, s - size + 1)
                    if all(x0 >= bx1 + 1 or x0 + size + 1 <= bx0 or y0 >= by1 + 1 or y0 + size + 1 <= by0
                           for bx0, by0, bx1, by1 in placed):
                        break
                else:
                    continue  # no room left on this canvas
                j = rng.randint(digits.shape[0])
                ink = rng.uniform(0.6, 1.0)
                patch = F.interpolate(digits[j:j + 1], size=(size, size), mode="bilinear",
                                      align_corners=False)[0, 0].clamp_(0, 1).numpy() * ink
                region = canvas[y0:y0 + size, x0:x0 + size]
                np.maximum(region, patch, out=region)
                label = int(digit_labels[j])
                masks[i, y0:y0 + size, x0:x0 + size][patch > _INK * ink] = label + 1
                ys, xs = np.nonzero(patch > _BOX_INK * ink)
                img_boxes.append([x0 + xs.min(), y0 + ys.min(), x0 + xs.max() + 1, y0 + ys.max() + 1])
                img_labels.append(label)
                placed.append((x0, y0, x0 + size, y0 + size))
            images[i] = canvas
            boxes.append(torch.tensor(img_boxes, dtype=torch.float32).reshape(-1, 4))
            labels.append(torch.tensor(img_labels, dtype=torch.int64))
        return torch.from_numpy(images), torch.from_numpy(masks), boxes, labels

    def __len__(self) -> int:
        return self.images.shape[0]

    def __getitem__(self, index: int):
        image = self.images[index].unsqueeze(0)
        if self.channels == 3:
            image = image.expand(3, -1, -1)
        image = image.clone()
        if self.task == "segmentation":
            target: Any = self.masks[index].long()
        else:
            target = {"boxes": self.boxes[index].clone(), "labels": self.labels[index] + self.label_offset}
        if self.transforms is not None:
            image, target = self.transforms(image, target)
        return image, target
