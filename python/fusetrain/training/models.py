"""Models for the recipes, built by name: ``build_model(name, **arch_params)``.

* ``digits_cnn``: a small CNN (three conv-BN-ReLU stages, global average
  pooling, one linear layer) for 28x28 digits; about 94k parameters.
* ``seed_mnist``: the 14-convolution + 3-linear network of the mixed-precision
  MNIST experiment (the benchmark model of the seed recipes); layer for layer
  and parameter name for parameter name the same network (``features``,
  ``avgpool``, ``classifier``).
* ``cifar_resnet``: a CIFAR-style ResNet (ResNet-20 by default) for 32x32
  inputs: 3x3 stem, three stages of basic blocks with 16/32/64 channels,
  global average pooling, linear classifier.
* ``pplite_seg``: a PP-LiteSeg-style segmentation net: STDC backbone
  (concatenated multi-scale blocks), SPPM context, UAFM attention-fusion
  decoder, logits upsampled to the input size.
* ``ddrnet``: a DDRNet-style segmentation net: a 1/8 high-resolution branch
  and a 1/16-1/64 low-resolution branch with bilateral fusion, DAPPM-lite
  context, logits upsampled to the input size.
* ``yolo_csp``: a small YOLO-style detector: CSP backbone + SPPF, PAN neck,
  dense anchor-free head; trained with :class:`DenseDetectionLoss` against
  :func:`dense_detection_targets`.

The three last ones take a ``width`` (channels of the first stage) so that they
can be trained at reduced width and resolution.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, List, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["MODEL_NAMES", "SEED_MNIST_CFG", "BasicBlock", "CifarResNet", "DDRNet", "DenseDetectionLoss", "DigitsCNN",
           "PPLiteSeg", "ResidualBlock", "SeedMNISTNet", "YoloCSP", "build_model", "check_arch_params",
           "dense_detection_points", "dense_detection_targets", "model_kwargs"]


# ---- digits_cnn -----------------------------------------------------------------------------------------------

def _conv_bn_relu(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class DigitsCNN(nn.Module):
    """conv(width)-pool-conv(2*width)-pool-conv(4*width)-global avg pool-linear.
    Accepts any input size of at least 4x4."""

    def __init__(self, num_classes: int = 10, in_channels: int = 1, width: int = 32, dropout: float = 0.0) -> None:
        super().__init__()
        _check_pos_int("digits_cnn", "num_classes", num_classes)
        _check_pos_int("digits_cnn", "in_channels", in_channels)
        _check_pos_int("digits_cnn", "width", width)
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
        _check_pos_int("seed_mnist", "num_classes", num_classes)
        _check_pos_int("seed_mnist", "in_channels", in_channels)
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
        _check_pos_int("cifar_resnet", "num_classes", num_classes)
        _check_pos_int("cifar_resnet", "in_channels", in_channels)
        _check_pos_int("cifar_resnet", "width", width)
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


# ---- shared blocks of the segmentation and detection nets -----------------------------------------------------

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


def _resize(x: Tensor, like: Tensor) -> Tensor:
    """Bilinear resize of ``x`` to the spatial size of ``like`` (any size, not only x2)."""
    return F.interpolate(x, size=like.shape[-2:], mode="bilinear", align_corners=False)


def _check_input(model: str, x: Tensor, in_channels: int, min_size: int) -> None:
    if x.dim() != 4 or x.shape[1] != in_channels:
        raise ValueError(f"{model}: input must be [batch, {in_channels}, height, width], got {tuple(x.shape)}")
    if x.shape[-1] < min_size or x.shape[-2] < min_size:
        raise ValueError(f"{model}: height and width must be >= {min_size}, got {tuple(x.shape[-2:])}")


# ---- pplite_seg: STDC backbone + SPPM + UAFM decoder ----------------------------------------------------------

class STDCBlock(nn.Module):
    """Short-Term Dense Concatenate module (Fan et al., 2021): ``steps`` convs with
    widths cout/2, cout/4, ..., cout/2^(steps-1), cout/2^(steps-1) (the first 1x1,
    the others 3x3), each fed by the previous; the output is the concatenation of
    all of them (cout channels). With stride 2 the first conv's output is
    downsampled by a depthwise 3x3 stride-2 conv before the next conv, and by a
    3x3 average pool in the concatenation."""

    def __init__(self, cin: int, cout: int, stride: int, steps: int = 4) -> None:
        super().__init__()
        if stride not in (1, 2) or steps < 2 or cout % (2 ** (steps - 1)) != 0:
            raise ValueError(f"STDCBlock: need stride 1 or 2, steps >= 2 and cout divisible by 2^(steps-1), "
                             f"got stride={stride}, steps={steps}, cout={cout}")
        widths = [cout // 2 ** (i + 1) for i in range(steps - 1)] + [cout // 2 ** (steps - 1)]
        self.stride = stride
        self.convs = nn.ModuleList()
        prev = cin
        for i, w in enumerate(widths):
            self.convs.append(ConvBNAct(prev, w, 1 if i == 0 else 3))
            prev = w
        if stride == 2:
            self.down = ConvBNAct(widths[0], widths[0], 3, stride=2, groups=widths[0], act=None)
            self.skip = nn.AvgPool2d(3, stride=2, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        outs = []
        h = self.convs[0](x)
        outs.append(self.skip(h) if self.stride == 2 else h)
        if self.stride == 2:
            h = self.down(h)
        for conv in self.convs[1:]:
            h = conv(h)
            outs.append(h)
        return torch.cat(outs, dim=1)


def _pooled_proj(cin: int, cout: int) -> nn.Sequential:
    """1x1 conv (with bias) + ReLU for pooled context maps (NOTE [pooled projections])."""
    return nn.Sequential(nn.Conv2d(cin, cout, 1), nn.ReLU(inplace=True))


class SPPM(nn.Module):
    """Simple pyramid pooling: average pools to ``bins`` x ``bins`` grids, a conv
    on each, upsampled back and summed, then a 3x3 conv."""

    def __init__(self, cin: int, mid: int, cout: int, bins: Sequence[int] = (1, 2, 4)) -> None:
        super().__init__()
        self.bins = tuple(bins)
        # NOTE [pooled projections]: a conv with bias + ReLU, no BatchNorm: a
        # 1x1 pooled map of a batch of one has one value per channel, which
        # BatchNorm cannot normalise in training.
        self.stages = nn.ModuleList(_pooled_proj(cin, mid) for _ in self.bins)
        self.out = ConvBNAct(mid, cout, 3)

    def forward(self, x: Tensor) -> Tensor:
        acc = None
        for b, conv in zip(self.bins, self.stages):
            y = _resize(conv(F.adaptive_avg_pool2d(x, b)), x)
            acc = y if acc is None else acc + y
        return self.out(acc)


class UAFM(nn.Module):
    """Unified attention fusion with spatial attention: the upsampled deep
    feature ``up`` and the projected shallow feature ``low`` are mixed by a
    per-pixel weight alpha = sigmoid(conv([mean_c(up), max_c(up), mean_c(low),
    max_c(low)])): ``up * alpha + low * (1 - alpha)``, then a 3x3 conv."""

    def __init__(self, low_ch: int, high_ch: int, cout: int) -> None:
        super().__init__()
        self.low = ConvBNAct(low_ch, high_ch, 3)
        self.attn = nn.Sequential(ConvBNAct(4, 2, 3), nn.Conv2d(2, 1, 3, padding=1, bias=False), nn.BatchNorm2d(1))
        self.out = ConvBNAct(high_ch, cout, 3)

    def forward(self, low: Tensor, high: Tensor) -> Tensor:
        low = self.low(low)
        up = _resize(high, low)
        stats = torch.cat([up.mean(1, keepdim=True), up.amax(1, keepdim=True),
                           low.mean(1, keepdim=True), low.amax(1, keepdim=True)], dim=1)
        alpha = torch.sigmoid(self.attn(stats))
        return self.out(up * alpha + low * (1 - alpha))


class PPLiteSeg(nn.Module):
    """A PP-LiteSeg-style segmentation net (Peng et al., 2022) at a chosen width.

    Encoder: STDC backbone: two stride-2 ConvBNReLU stem layers (1/2, 1/4), then
    three stages of STDC blocks (the first of each with stride 2) at 1/8, 1/16,
    1/32 with 4*width, 8*width, 16*width channels (``blocks_per_stage`` blocks).
    Context: SPPM on the 1/32 feature. Decoder: UAFM fusing it with the 1/16,
    then the 1/8 feature (decoder widths ``4*width``, ``2*width``,
    ``2*width``). Head: 3x3 ConvBNReLU + 1x1 conv to ``num_classes`` at 1/8,
    bilinear upsampling to the input size. Output: logits [B, num_classes, H, W].
    Any input of at least 32x32.
    """

    def __init__(self, num_classes: int = 19, in_channels: int = 3, width: int = 16,
                 blocks_per_stage: Sequence[int] = (2, 2, 2)) -> None:
        super().__init__()
        _check_pos_int("pplite_seg", "num_classes", num_classes)
        _check_pos_int("pplite_seg", "in_channels", in_channels)
        _check_pos_int("pplite_seg", "width", width)
        if len(blocks_per_stage) != 3 or any(isinstance(b, bool) or not isinstance(b, int) or b < 1
                                             for b in blocks_per_stage):
            raise ValueError(f"pplite_seg: blocks_per_stage must be 3 ints >= 1, got {blocks_per_stage!r}")
        self.in_channels = in_channels
        w = width
        self.stem = nn.Sequential(ConvBNAct(in_channels, w, 3, stride=2), ConvBNAct(w, 2 * w, 3, stride=2))
        chans = (4 * w, 8 * w, 16 * w)
        stages = []
        cin = 2 * w
        for cout, n in zip(chans, blocks_per_stage):
            stages.append(nn.Sequential(*[STDCBlock(cin if i == 0 else cout, cout, 2 if i == 0 else 1)
                                          for i in range(n)]))
            cin = cout
        self.stages = nn.ModuleList(stages)
        self.sppm = SPPM(chans[2], 2 * w, 4 * w)
        self.fuse16 = UAFM(chans[1], 4 * w, 2 * w)
        self.fuse8 = UAFM(chans[0], 2 * w, 2 * w)
        self.head = nn.Sequential(ConvBNAct(2 * w, 2 * w, 3), nn.Conv2d(2 * w, num_classes, 1))

    def forward(self, x: Tensor) -> Tensor:
        _check_input("pplite_seg", x, self.in_channels, 32)
        f = self.stem(x)
        feats = []
        for stage in self.stages:
            f = stage(f)
            feats.append(f)
        f8, f16, f32 = feats
        y = self.sppm(f32)
        y = self.fuse16(f16, y)
        y = self.fuse8(f8, y)
        return _resize(self.head(y), x)


# ---- ddrnet: two resolutions with bilateral fusion + DAPPM --------------------------------------------------

class _Basic(nn.Module):
    """ResNet basic block (3x3-3x3) with a projection shortcut where needed;
    ``last_relu=False`` leaves the sum unactivated (DDRNet's fusion points)."""

    def __init__(self, cin: int, cout: int, stride: int = 1, last_relu: bool = True) -> None:
        super().__init__()
        self.body = nn.Sequential(ConvBNAct(cin, cout, 3, stride), ConvBNAct(cout, cout, 3, act=None))
        self.short: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.short = ConvBNAct(cin, cout, 1, stride, act=None)
        self.last_relu = last_relu

    def forward(self, x: Tensor) -> Tensor:
        y = self.body(x) + self.short(x)
        return F.relu(y) if self.last_relu else y


class _Bottleneck(nn.Module):
    """1x1-3x3-1x1 bottleneck with ``expansion`` x the inner width out."""

    def __init__(self, cin: int, mid: int, stride: int = 1, expansion: int = 2) -> None:
        super().__init__()
        cout = mid * expansion
        self.body = nn.Sequential(ConvBNAct(cin, mid, 1), ConvBNAct(mid, mid, 3, stride),
                                  ConvBNAct(mid, cout, 1, act=None))
        self.short: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.short = ConvBNAct(cin, cout, 1, stride, act=None)

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(self.body(x) + self.short(x))


def _layer(block: Callable[..., nn.Module], cin: int, cout: int, n: int, stride: int,
           last_relu: bool = True) -> nn.Sequential:
    blocks = [block(cin, cout, stride, last_relu=(last_relu or n > 1))]
    for i in range(1, n):
        blocks.append(block(cout, cout, 1, last_relu=(last_relu or i < n - 1)))
    return nn.Sequential(*blocks)


class DAPPMLite(nn.Module):
    """Deep aggregation pyramid pooling (DDRNet), with fewer scales: the input
    1x1-projected (scale 0), average pools with kernels 5/9 (strides 2/4) and
    a global pool, each projected, upsampled and fused hierarchically with the
    previous scale by a 3x3 conv; the scales are concatenated, compressed by a
    1x1 conv and added to a 1x1 shortcut."""

    def __init__(self, cin: int, mid: int, cout: int) -> None:
        super().__init__()
        self.scale0 = ConvBNAct(cin, mid, 1)
        self.pools = nn.ModuleList([nn.AvgPool2d(5, 2, 2), nn.AvgPool2d(9, 4, 4), nn.AdaptiveAvgPool2d(1)])
        self.proj = nn.ModuleList(_pooled_proj(cin, mid) for _ in self.pools)  # NOTE [pooled projections]
        self.fuse = nn.ModuleList(ConvBNAct(mid, mid, 3) for _ in self.pools)
        self.compress = ConvBNAct(mid * (1 + len(self.pools)), cout, 1, act=None)
        self.shortcut = ConvBNAct(cin, cout, 1, act=None)

    def forward(self, x: Tensor) -> Tensor:
        prev = self.scale0(x)
        outs = [prev]
        for pool, proj, fuse in zip(self.pools, self.proj, self.fuse):
            prev = fuse(_resize(proj(pool(x)), x) + prev)
            outs.append(prev)
        return self.compress(torch.cat(outs, dim=1)) + self.shortcut(x)


class DDRNet(nn.Module):
    """A DDRNet-style real-time segmentation net (Hong et al., 2021), slim.

    Stem to 1/8: two stride-2 convs, ``layers[0]`` basic blocks at 1/4,
    ``layers[1]`` at 1/8 (width w, 2w). Then two branches: a high-resolution
    branch staying at 1/8 (2w channels) and a low-resolution branch going to
    1/16 (4w) and 1/32 (8w), with bilateral fusion after each of those two
    stages (high -> low: strided 3x3 conv(s) + BN, added; low -> high: 1x1
    conv + BN, bilinear upsampling, added). A bottleneck stage on each branch
    (low: stride 2, to 1/64), DAPPM-lite on the low branch, its output
    upsampled and added to the high branch; head: 3x3 ConvBNReLU + 1x1 conv
    at 1/8, upsampled to the input size. Output: logits [B, num_classes, H, W].
    Any input of at least 64x64.
    """

    def __init__(self, num_classes: int = 19, in_channels: int = 3, width: int = 16,
                 layers: Sequence[int] = (2, 2, 2, 2)) -> None:
        super().__init__()
        _check_pos_int("ddrnet", "num_classes", num_classes)
        _check_pos_int("ddrnet", "in_channels", in_channels)
        _check_pos_int("ddrnet", "width", width)
        if len(layers) != 4 or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in layers):
            raise ValueError(f"ddrnet: layers must be 4 ints >= 1, got {layers!r}")
        self.in_channels = in_channels
        w, hw = width, 2 * width
        self.stem = nn.Sequential(ConvBNAct(in_channels, w, 3, 2), ConvBNAct(w, w, 3, 2),
                                  _layer(_Basic, w, w, layers[0], 1), _layer(_Basic, w, hw, layers[1], 2))
        # Low-resolution branch (1/16, 1/32) and high-resolution branch (1/8).
        self.low3 = _layer(_Basic, hw, 4 * w, layers[2], 2, last_relu=False)
        self.high3 = _layer(_Basic, hw, hw, layers[2], 1, last_relu=False)
        self.low4 = _layer(_Basic, 4 * w, 8 * w, layers[3], 2, last_relu=False)
        self.high4 = _layer(_Basic, hw, hw, layers[3], 1, last_relu=False)
        self.down3 = ConvBNAct(hw, 4 * w, 3, 2, act=None)
        self.up3 = ConvBNAct(4 * w, hw, 1, act=None)
        self.down4 = nn.Sequential(ConvBNAct(hw, 4 * w, 3, 2), ConvBNAct(4 * w, 8 * w, 3, 2, act=None))
        self.up4 = ConvBNAct(8 * w, hw, 1, act=None)
        self.low5 = _Bottleneck(8 * w, 8 * w, stride=2)  # 16w channels at 1/64
        self.high5 = _Bottleneck(hw, hw, stride=1)  # 4w channels at 1/8
        self.dappm = DAPPMLite(16 * w, 4 * w, 4 * w)
        self.head = nn.Sequential(ConvBNAct(4 * w, 4 * w, 3), nn.Conv2d(4 * w, num_classes, 1))

    def forward(self, x: Tensor) -> Tensor:
        _check_input("ddrnet", x, self.in_channels, 64)
        f = self.stem(x)
        low, high = self.low3(f), self.high3(f)
        low, high = low + self.down3(F.relu(high)), high + _resize(self.up3(F.relu(low)), high)
        low, high = self.low4(F.relu(low)), self.high4(F.relu(high))
        low, high = low + self.down4(F.relu(high)), high + _resize(self.up4(F.relu(low)), high)
        high = self.high5(F.relu(high))
        ctx = self.dappm(self.low5(F.relu(low)))
        y = self.head(high + _resize(ctx, high))
        return _resize(y, x)


# ---- yolo_csp: CSP backbone + PAN neck + dense anchor-free head ----------------------------------------------

class _CSPBottleneck(nn.Module):
    def __init__(self, c: int, shortcut: bool = True) -> None:
        super().__init__()
        self.body = nn.Sequential(ConvBNAct(c, c, 1, act="silu"), ConvBNAct(c, c, 3, act="silu"))
        self.shortcut = shortcut

    def forward(self, x: Tensor) -> Tensor:
        y = self.body(x)
        return x + y if self.shortcut else y


class CSPBlock(nn.Module):
    """Cross-stage partial block (C3): the input split by two 1x1 convs into a
    path through ``n`` bottlenecks and a bypass, concatenated and merged by a
    1x1 conv."""

    def __init__(self, cin: int, cout: int, n: int = 1, shortcut: bool = True) -> None:
        super().__init__()
        mid = cout // 2
        self.a = ConvBNAct(cin, mid, 1, act="silu")
        self.b = ConvBNAct(cin, mid, 1, act="silu")
        self.blocks = nn.Sequential(*[_CSPBottleneck(mid, shortcut) for _ in range(n)])
        self.merge = ConvBNAct(2 * mid, cout, 1, act="silu")

    def forward(self, x: Tensor) -> Tensor:
        return self.merge(torch.cat([self.blocks(self.a(x)), self.b(x)], dim=1))


class SPPF(nn.Module):
    """Spatial pyramid pooling, fast: three chained 5x5 max pools, concatenated
    with their input."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        mid = cin // 2
        self.reduce = ConvBNAct(cin, mid, 1, act="silu")
        self.pool = nn.MaxPool2d(5, 1, 2)
        self.out = ConvBNAct(4 * mid, cout, 1, act="silu")

    def forward(self, x: Tensor) -> Tensor:
        x = self.reduce(x)
        p1 = self.pool(x)
        p2 = self.pool(p1)
        return self.out(torch.cat([x, p1, p2, self.pool(p2)], dim=1))


class YoloCSP(nn.Module):
    """A small YOLO-style detector: CSP backbone, PAN neck, dense anchor-free head.

    Backbone: a stride-2 stem then four stages (stride-2 ConvBNSiLU + CSP
    block) to 1/4 ... 1/32, widths w, 2w, 4w, 8w, 16w, SPPF at 1/32. Neck: a
    top-down path (1/32 -> 1/16 -> 1/8, nearest upsampling, concatenation,
    CSP blocks) and a bottom-up path back to 1/16 and 1/32. Head: per level
    (strides 8, 16, 32) a shared-structure 3x3 ConvBNSiLU and a 1x1 conv to
    ``5 + num_classes`` values per location (objectness logit, 4 box
    distances, class logits). Output: [B, N, 5 + num_classes], N the number
    of locations of the three levels (row-major, level by level), the layout
    :class:`DenseDetectionLoss` and :func:`dense_detection_targets` use.
    The input's sides must be multiples of 32.
    """

    strides = (8, 16, 32)

    def __init__(self, num_classes: int = 20, in_channels: int = 3, width: int = 16, depth: int = 1) -> None:
        super().__init__()
        _check_pos_int("yolo_csp", "num_classes", num_classes)
        _check_pos_int("yolo_csp", "in_channels", in_channels)
        _check_pos_int("yolo_csp", "width", width)
        _check_pos_int("yolo_csp", "depth", depth)
        self.in_channels, self.num_classes = in_channels, num_classes
        w = width
        self.stem = ConvBNAct(in_channels, w, 3, 2, act="silu")

        def stage(cin: int, cout: int, n: int) -> nn.Sequential:
            return nn.Sequential(ConvBNAct(cin, cout, 3, 2, act="silu"), CSPBlock(cout, cout, n))

        self.c2, self.c3 = stage(w, 2 * w, depth), stage(2 * w, 4 * w, 2 * depth)
        self.c4, self.c5 = stage(4 * w, 8 * w, 2 * depth), stage(8 * w, 16 * w, depth)
        self.sppf = SPPF(16 * w, 16 * w)
        self.lat5 = ConvBNAct(16 * w, 8 * w, 1, act="silu")
        self.td4 = CSPBlock(16 * w, 8 * w, depth, shortcut=False)
        self.lat4 = ConvBNAct(8 * w, 4 * w, 1, act="silu")
        self.td3 = CSPBlock(8 * w, 4 * w, depth, shortcut=False)
        self.down3 = ConvBNAct(4 * w, 4 * w, 3, 2, act="silu")
        self.bu4 = CSPBlock(8 * w, 8 * w, depth, shortcut=False)
        self.down4 = ConvBNAct(8 * w, 8 * w, 3, 2, act="silu")
        self.bu5 = CSPBlock(16 * w, 16 * w, depth, shortcut=False)
        self.heads = nn.ModuleList(nn.Sequential(ConvBNAct(c, c, 3, act="silu"), nn.Conv2d(c, 5 + num_classes, 1))
                                   for c in (4 * w, 8 * w, 16 * w))

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() != 4 or x.shape[1] != self.in_channels or x.shape[-1] % 32 or x.shape[-2] % 32 or x.shape[-1] < 32 \
                or x.shape[-2] < 32:
            raise ValueError(f"yolo_csp: input must be [batch, {self.in_channels}, H, W] with H and W positive "
                             f"multiples of 32, got {tuple(x.shape)}")
        c3 = self.c3(self.c2(self.stem(x)))
        c4 = self.c4(c3)
        c5 = self.sppf(self.c5(c4))
        p5 = self.lat5(c5)
        p4 = self.td4(torch.cat([F.interpolate(p5, scale_factor=2.0, mode="nearest"), c4], 1))
        l4 = self.lat4(p4)
        n3 = self.td3(torch.cat([F.interpolate(l4, scale_factor=2.0, mode="nearest"), c3], 1))
        n4 = self.bu4(torch.cat([self.down3(n3), l4], 1))
        n5 = self.bu5(torch.cat([self.down4(n4), p5], 1))
        outs = [head(f).flatten(2) for head, f in zip(self.heads, (n3, n4, n5))]
        return torch.cat(outs, dim=2).transpose(1, 2)


def dense_detection_points(height: int, width: int, strides: Sequence[int] = YoloCSP.strides) -> Tuple[Tensor, Tensor]:
    """The centres (x, y) in pixels of every head location of an H x W input,
    level by level and row-major (the order of :class:`YoloCSP`'s output), and
    the stride of each: ([N, 2], [N])."""
    pts, strd = [], []
    for s in strides:
        ys, xs = torch.meshgrid(torch.arange(height // s), torch.arange(width // s), indexing="ij")
        pts.append(torch.stack([xs.flatten(), ys.flatten()], 1).float() * s + s / 2)
        strd.append(torch.full((pts[-1].shape[0],), float(s)))
    return torch.cat(pts), torch.cat(strd)


def dense_detection_targets(boxes: Tensor, labels: Tensor, height: int, width: int,
                            strides: Sequence[int] = YoloCSP.strides) -> Tensor:
    """FCOS-style assignment of one image's boxes to the head locations.

    ``boxes``: [K, 4] (x1, y1, x2, y2) pixels; ``labels``: [K] ints. A location
    is positive for the smallest box whose inside holds its centre and whose
    largest centre-to-side distance falls in the level's range (stride 8:
    [0, 64], 16: (64, 128], 32: (128, inf)). Returns [N, 6] float: positive
    flag, class, and the distances left, top, right, bottom in units of the
    location's stride (zeros where negative). Runs once per image when the data
    is made, never inside a training step."""
    if boxes.dim() != 2 or boxes.shape[-1] != 4 or labels.shape != boxes.shape[:1]:
        raise ValueError(f"dense_detection_targets: boxes must be [K, 4] and labels [K], got {tuple(boxes.shape)} "
                         f"and {tuple(labels.shape)}")
    pts, strd = dense_detection_points(height, width, strides)
    out = torch.zeros(pts.shape[0], 6)
    if boxes.shape[0] == 0:
        return out
    boxes = boxes.float()
    ltrb = torch.cat([pts[:, None] - boxes[None, :, :2], boxes[None, :, 2:] - pts[:, None]], dim=2)  # [N, K, 4]
    inside = ltrb.amin(2) > 0
    reach = ltrb.amax(2)
    lo = torch.where(strd == strides[0], torch.zeros_like(strd), strd * 4)
    hi = torch.where(strd == strides[-1], torch.full_like(strd, float("inf")), strd * 8)
    ok = inside & (reach > lo[:, None]) & (reach <= hi[:, None])
    area = ((boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1]))[None].expand_as(ok)
    area = torch.where(ok, area, torch.full_like(area, float("inf")))
    best_area, best = area.min(1)
    pos = torch.isfinite(best_area)
    idx = torch.arange(pts.shape[0])
    out[:, 0] = pos.float()
    out[:, 1] = torch.where(pos, labels[best].float(), torch.zeros(()))
    out[:, 2:] = torch.where(pos[:, None], ltrb[idx, best] / strd[:, None], torch.zeros(()))
    return out


class DenseDetectionLoss(nn.Module):
    """Loss of a dense anchor-free head (:class:`YoloCSP`) against
    :func:`dense_detection_targets`: objectness BCE-with-logits over all
    locations (mean), plus, over the positive locations, class cross-entropy
    and an L1 loss on the box distances (softplus of the predictions, in
    stride units), both divided by the number of positives (at least 1). All
    tensor arithmetic: no host synchronisation."""

    def __init__(self, box_weight: float = 1.0, cls_weight: float = 1.0) -> None:
        super().__init__()
        self.box_weight, self.cls_weight = box_weight, cls_weight

    def forward(self, pred: Tensor, target: Tensor) -> Tensor:
        if pred.dim() != 3 or target.shape[:2] != pred.shape[:2] or target.shape[-1] != 6 or pred.shape[-1] < 6:
            raise ValueError(f"DenseDetectionLoss: pred must be [B, N, 5 + classes] and target [B, N, 6], got "
                             f"{tuple(pred.shape)} and {tuple(target.shape)}")
        pred = pred.float()
        pos = target[..., 0]
        n_pos = pos.sum().clamp(min=1.0)
        obj = F.binary_cross_entropy_with_logits(pred[..., 0], pos)
        box = (F.softplus(pred[..., 1:5]) - target[..., 2:]).abs().sum(-1)
        cls = F.cross_entropy(pred[..., 5:].flatten(0, 1), target[..., 1].long().flatten(), reduction="none")
        return obj + ((self.box_weight * box + self.cls_weight * cls.view_as(box)) * pos).sum() / n_pos


# ---- registry -------------------------------------------------------------------------------------------------

def _check_pos_int(model: str, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{model}: {name} must be an int >= 1, got {value!r}")


_REGISTRY: Dict[str, Callable[..., nn.Module]] = {
    "digits_cnn": DigitsCNN,
    "seed_mnist": SeedMNISTNet,
    "cifar_resnet": CifarResNet,
    "pplite_seg": PPLiteSeg,
    "ddrnet": DDRNet,
    "yolo_csp": YoloCSP,
}

#: Names accepted by :func:`build_model`.
MODEL_NAMES = tuple(sorted(_REGISTRY))


def model_kwargs(name: str) -> Sequence[str]:
    """The keyword arguments that ``build_model(name, ...)`` accepts."""
    _check_name(name)
    return tuple(p for p in inspect.signature(_REGISTRY[name]).parameters if p != "self")


def _check_name(name: Any) -> None:
    if name not in _REGISTRY:
        raise ValueError(f"arch_params.name: unknown model {name!r}; allowed: " + ", ".join(MODEL_NAMES))


def check_arch_params(name: str, arch_params: Dict[str, Any]) -> None:
    """Raise ``ValueError`` if ``name`` is not a model or ``arch_params`` holds a
    keyword its constructor does not take (builds nothing)."""
    allowed = model_kwargs(name)
    for key in arch_params:
        if key not in allowed:
            raise ValueError(f"arch_params: unknown key {key!r} for model {name!r}; allowed keys: name, "
                             + ", ".join(allowed))


def build_model(name: str, **arch_params: Any) -> nn.Module:
    """Build a registered model by name (see :data:`MODEL_NAMES`).

    ``digits_cnn(num_classes=10, in_channels=1, width=32, dropout=0.0)``,
    ``seed_mnist(num_classes=10, in_channels=1)``,
    ``cifar_resnet(depth=20, num_classes=10, in_channels=3, width=16)``,
    ``pplite_seg(num_classes=19, in_channels=3, width=16, blocks_per_stage=(2, 2, 2))``,
    ``ddrnet(num_classes=19, in_channels=3, width=16, layers=(2, 2, 2, 2))``,
    ``yolo_csp(num_classes=20, in_channels=3, width=16, depth=1)``.
    An unknown name or keyword raises ``ValueError`` listing what is allowed.
    """
    check_arch_params(name, arch_params)
    return _REGISTRY[name](**arch_params)
