"""Reading and writing images and masks (Pillow)."""

from __future__ import annotations

import os
from typing import Optional, Tuple

import numpy as np
import torch
from torch import Tensor

__all__ = ["IMAGE_EXTENSIONS", "read_image", "read_mask", "write_image", "write_mask"]

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".ppm", ".pgm", ".tif", ".tiff", ".webp")


def _pil():
    from ..._optional import require

    return require("PIL.Image", "reading and writing images")


def read_image(path: str, channels: int = 3, size: Optional[Tuple[int, int]] = None, who: str = "dataset") -> Tensor:
    """The image at ``path`` as float32 ``[channels, H, W]`` in [0, 1] (RGB for
    3 channels, grayscale for 1); ``size`` (height, width) resizes it
    (bilinear). ``ValueError`` naming the file when it cannot be decoded."""
    Image = _pil()
    try:
        with Image.open(path) as img:
            img = img.convert("RGB" if channels == 3 else "L")
            if size is not None and img.size != (size[1], size[0]):
                img = img.resize((size[1], size[0]), Image.BILINEAR)
            arr = np.array(img, dtype=np.uint8)
    except OSError as exc:
        raise ValueError(f"{who}: cannot decode image {path} ({exc})") from exc
    t = torch.from_numpy(arr)
    t = t.unsqueeze(0) if t.ndim == 2 else t.permute(2, 0, 1)
    return t.contiguous().to(torch.float32).div_(255.0)


def read_mask(path: str, who: str = "dataset") -> Tensor:
    """A class-index mask (a one-channel or palette PNG) as int64 ``[H, W]``."""
    Image = _pil()
    try:
        with Image.open(path) as img:
            if img.mode not in ("L", "P", "I", "I;16"):
                raise ValueError(f"{who}: mask {path} has mode {img.mode!r}; allowed: a one-channel image ('L', "
                                 f"'P', 'I') of class indices")
            arr = np.array(img)
    except OSError as exc:
        raise ValueError(f"{who}: cannot decode mask {path} ({exc})") from exc
    return torch.from_numpy(arr.astype(np.int64))


def write_image(image: Tensor, path: str) -> None:
    """Save a [C, H, W] float image in [0, 1] as PNG (RGB or grayscale)."""
    Image = _pil()
    arr = (image.detach().clamp(0, 1) * 255).round().to(torch.uint8).cpu()
    arr = arr[0].numpy() if arr.shape[0] == 1 else arr.permute(1, 2, 0).numpy()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    Image.fromarray(arr).save(path)


def write_mask(mask: Tensor, path: str) -> None:
    """Save an [H, W] class-index mask (values 0..255) as a one-channel PNG."""
    Image = _pil()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    Image.fromarray(mask.detach().cpu().to(torch.uint8).numpy(), mode="L").save(path)
