"""Classification models: ``digits_cnn``, ``seed_mnist``, ``cifar_resnet``."""

from __future__ import annotations

from typing import Any, List

import torch
from torch import Tensor, nn

from ._blocks import check_pos_int

__all__ = ["SEED_MNIST_CFG", "BasicBlock", "CifarResNet", "DigitsCNN", "ResidualBlock", "SeedMNISTNet"]


# ---- digits_cnn -----------------------------------------------------------------------------------------------

def _conv_bn_relu(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class DigitsCNN(nn.Module):
    """conv(width)-pool-conv(2*width)-pool-conv(4*width)-global avg pool-linear.
    Accepts any input size of at least 4x4."""

    def __init__(self, num_classes: int = 10, in_channels: int = 1, width: int = 32, dropout: float = 0.0) -> None:
        super().__init__()
        check_pos_int("digits_cnn", "num_classes", num_classes)
        check_pos_int("digits_cnn", "in_channels", in_channels)
        check_pos_int("digits_cnn", "width", width)
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
            raise ValueError(f"digits_cnn: dropout must be a float in [0, 1), got {dropout!r}")
        self.features = nn.Sequential(
            _conv_bn_relu(in_channels, width), nn.MaxPool2d(2),
            _conv_bn_relu(width, 2 * width), nn.MaxPool2d(2),
            _conv_bn_relu(2 * width, 4 * width),
        )
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Flatten(), nn.Dropout(dropout), nn.Linear(4 * width, num_classes))

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.pool(self.features(x)))


# ---- seed_mnist -----------------------------------------------------------------------------------------------

#: [in_channels, out_channels, kernel_size, stride, padding] of the 14 convolutions.
SEED_MNIST_CFG: List[List[int]] = [
    [1, 32, 3, 1, 1],
    [32, 64, 3, 1, 1],
    [64, 64, 2, 2, 0],
    [64, 128, 3, 1, 1],
    [128, 128, 3, 1, 1],
    [128, 128, 3, 1, 1],
    [128, 128, 2, 2, 0],
    [128, 256, 3, 1, 1],
    [256, 256, 2, 1, 0],
    [256, 512, 3, 1, 1],
    [512, 512, 3, 1, 1],
    [512, 512, 3, 1, 1],
    [512, 512, 2, 2, 0],
    [512, 1024, 3, 1, 1],
]


class BasicBlock(nn.Module):
    """Conv2d (with bias) -> BatchNorm2d -> ReLU, kept in ``self.block``."""

    def __init__(self, **conv_kwargs: Any) -> None:
        super().__init__()
        self.block = nn.Sequential(
            nn.Conv2d(**conv_kwargs),
            nn.BatchNorm2d(num_features=conv_kwargs["out_channels"]),
            nn.ReLU(),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.block(x)


class SeedMNISTNet(nn.Module):
    """14 ``BasicBlock`` convolutions (:data:`SEED_MNIST_CFG`), AdaptiveAvgPool2d(1),
    then Flatten, Linear(1024, 1000), ReLU, Linear(1000, 1000), ReLU,
    Linear(1000, num_classes). ``in_channels`` replaces the first convolution's
    input channels (1 for MNIST)."""

    def __init__(self, num_classes: int = 10, in_channels: int = 1) -> None:
        super().__init__()
        check_pos_int("seed_mnist", "num_classes", num_classes)
        check_pos_int("seed_mnist", "in_channels", in_channels)
        cfg = [list(layer) for layer in SEED_MNIST_CFG]
        cfg[0][0] = in_channels
        self.features = nn.Sequential(*[
            BasicBlock(in_channels=c[0], out_channels=c[1], kernel_size=c[2], stride=c[3], padding=c[4]) for c in cfg
        ])
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(in_features=1024, out_features=1000),
            nn.ReLU(),
            nn.Linear(in_features=1000, out_features=1000),
            nn.ReLU(),
            nn.Linear(in_features=1000, out_features=num_classes),
        )

    def forward(self, x: Tensor) -> Tensor:
        x = self.features(x)
        x = self.avgpool(x)
        return self.classifier(x)


# ---- cifar_resnet ---------------------------------------------------------------------------------------------

class ResidualBlock(nn.Module):
    """Two 3x3 conv-BN layers with a shortcut; the shortcut is a 1x1 conv-BN
    projection when the stride or the channel count changes."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class CifarResNet(nn.Module):
    """ResNet for 32x32 images (He et al., 2016, section 4.2): depth = 6n + 2
    (20, 32, 44, 56, 110), stages of n blocks with width, 2*width, 4*width
    channels at 32x32, 16x16, 8x8."""

    def __init__(self, depth: int = 20, num_classes: int = 10, in_channels: int = 3, width: int = 16) -> None:
        super().__init__()
        check_pos_int("cifar_resnet", "num_classes", num_classes)
        check_pos_int("cifar_resnet", "in_channels", in_channels)
        check_pos_int("cifar_resnet", "width", width)
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 8 or (depth - 2) % 6 != 0:
            raise ValueError(f"cifar_resnet: depth must be 6n + 2 with n >= 1 (8, 14, 20, 32, 44, 56, 110), "
                             f"got {depth!r}")
        n = (depth - 2) // 6
        self.stem = nn.Sequential(nn.Conv2d(in_channels, width, 3, padding=1, bias=False), nn.BatchNorm2d(width),
                                  nn.ReLU(inplace=True))
        stages: List[nn.Module] = []
        cin = width
        for i, cout in enumerate((width, 2 * width, 4 * width)):
            blocks = []
            for j in range(n):
                blocks.append(ResidualBlock(cin, cout, stride=2 if (i > 0 and j == 0) else 1))
                cin = cout
            stages.append(nn.Sequential(*blocks))
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(4 * width, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: Tensor) -> Tensor:
        x = self.stages(self.stem(x))
        return self.fc(torch.flatten(self.pool(x), 1))
