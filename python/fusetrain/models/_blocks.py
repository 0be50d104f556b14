"""Building blocks shared by the segmentation and detection models."""

from __future__ import annotations

from typing import Any, List

import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["ConvBNAct", "check_input", "check_pos_int", "resize_like"]


def check_pos_int(model: str, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{model}: {name} must be an int >= 1, got {value!r}")


class ConvBNAct(nn.Sequential):
    """Conv2d (no bias) -> BatchNorm2d -> activation (ReLU by default; None for none)."""

    def __init__(self, cin: int, cout: int, kernel_size: int = 3, stride: int = 1, groups: int = 1,
                 act: Any = "relu") -> None:
        layers: List[nn.Module] = [nn.Conv2d(cin, cout, kernel_size, stride=stride, padding=kernel_size // 2,
                                             groups=groups, bias=False), nn.BatchNorm2d(cout)]
        if act == "relu":
            layers.append(nn.ReLU(inplace=True))
        elif act == "silu":
            layers.append(nn.SiLU(inplace=True))
        elif act is not None:
            raise ValueError(f"ConvBNAct: act must be 'relu', 'silu' or None, got {act!r}")
        super().__init__(*layers)


def resize_like(x: Tensor, like: Tensor) -> Tensor:
    """Bilinear resize of ``x`` to the spatial size of ``like`` (any size, not only x2)."""
    return F.interpolate(x, size=like.shape[-2:], mode="bilinear", align_corners=False)


def check_input(model: str, x: Tensor, in_channels: int, min_size: int) -> None:
    if x.dim() != 4 or x.shape[1] != in_channels:
        raise ValueError(f"{model}: input must be [batch, {in_channels}, height, width], got {tuple(x.shape)}")
    if x.shape[-1] < min_size or x.shape[-2] < min_size:
        raise ValueError(f"{model}: height and width must be >= {min_size}, got {tuple(x.shape[-2:])}")
