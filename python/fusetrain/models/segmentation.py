"""Segmentation models: ``pplite_seg`` (PP-LiteSeg style) and ``ddrnet`` (DDRNet
style). Both return logits ``[B, num_classes, H, W]`` at the input size."""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._blocks import ConvBNAct, check_input, check_pos_int, resize_like

__all__ = ["DAPPMLite", "DDRNet", "PPLiteSeg", "SPPM", "STDCBlock", "UAFM"]


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
            y = resize_like(conv(F.adaptive_avg_pool2d(x, b)), x)
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
        up = resize_like(high, low)
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
        check_pos_int("pplite_seg", "num_classes", num_classes)
        check_pos_int("pplite_seg", "in_channels", in_channels)
        check_pos_int("pplite_seg", "width", width)
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
        check_input("pplite_seg", x, self.in_channels, 32)
        f = self.stem(x)
        feats = []
        for stage in self.stages:
            f = stage(f)
            feats.append(f)
        f8, f16, f32 = feats
        y = self.sppm(f32)
        y = self.fuse16(f16, y)
        y = self.fuse8(f8, y)
        return resize_like(self.head(y), x)


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
            prev = fuse(resize_like(proj(pool(x)), x) + prev)
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
        check_pos_int("ddrnet", "num_classes", num_classes)
        check_pos_int("ddrnet", "in_channels", in_channels)
        check_pos_int("ddrnet", "width", width)
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
        check_input("ddrnet", x, self.in_channels, 64)
        f = self.stem(x)
        low, high = self.low3(f), self.high3(f)
        low, high = low + self.down3(F.relu(high)), high + resize_like(self.up3(F.relu(low)), high)
        low, high = self.low4(F.relu(low)), self.high4(F.relu(high))
        low, high = low + self.down4(F.relu(high)), high + resize_like(self.up4(F.relu(low)), high)
        high = self.high5(F.relu(high))
        ctx = self.dappm(self.low5(F.relu(low)))
        y = self.head(high + resize_like(ctx, high))
        return resize_like(y, x)
