"""Detection: ``yolo_csp`` (CSP backbone, PAN neck, dense anchor-free head), its
target assignment, loss and box decoding."""

from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._blocks import ConvBNAct, check_pos_int

__all__ = ["CSPBlock", "DenseDetectionLoss", "SPPF", "YoloCSP", "decode_dense_detections", "dense_detection_points",
           "dense_detection_targets"]


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

    In eval mode the output is a dict: ``{"dense": [B, N, 5 + num_classes],
    "detections": [{"boxes", "scores", "labels"} per image]}``, the boxes
    decoded by :func:`decode_dense_detections` with ``score_threshold``,
    ``iou_threshold`` and ``max_detections`` (the format of torchvision's
    detection models, which the ``map`` metric reads; the loss reads
    ``"dense"``).
    """

    strides = (8, 16, 32)

    def __init__(self, num_classes: int = 20, in_channels: int = 3, width: int = 16, depth: int = 1,
                 score_threshold: float = 0.05, iou_threshold: float = 0.6, max_detections: int = 100) -> None:
        super().__init__()
        check_pos_int("yolo_csp", "num_classes", num_classes)
        check_pos_int("yolo_csp", "max_detections", max_detections)
        for name, v in (("score_threshold", score_threshold), ("iou_threshold", iou_threshold)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0:
                raise ValueError(f"yolo_csp: {name} must be a float in [0, 1], got {v!r}")
        self.score_threshold, self.iou_threshold = float(score_threshold), float(iou_threshold)
        self.max_detections = max_detections
        check_pos_int("yolo_csp", "in_channels", in_channels)
        check_pos_int("yolo_csp", "width", width)
        check_pos_int("yolo_csp", "depth", depth)
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

    def forward(self, x: Tensor):
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
        dense = torch.cat(outs, dim=2).transpose(1, 2)
        if self.training:
            return dense
        return {"dense": dense, "detections": decode_dense_detections(
            dense, x.shape[-2], x.shape[-1], self.strides, self.score_threshold, self.iou_threshold,
            self.max_detections)}


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


def decode_dense_detections(pred: Tensor, height: int, width: int, strides: Sequence[int] = YoloCSP.strides,
                            score_threshold: float = 0.05, iou_threshold: float = 0.6,
                            max_detections: int = 100) -> List[Dict[str, Tensor]]:
    """Boxes of a dense head's output ``pred`` [B, N, 5 + C] for H x W inputs:
    per location the score sigmoid(objectness) * softmax(class logits) of the
    best class and the box from the softplus distances (stride units) around
    the location's centre, clipped to the image; locations scoring at least
    ``score_threshold`` go through per-class non-maximum suppression
    (``torchvision.ops.batched_nms``, IoU ``iou_threshold``) and the best
    ``max_detections`` are kept. Returns one ``{"boxes" [K, 4] (x1, y1, x2,
    y2 pixels), "scores" [K], "labels" [K]}`` per image. Reads the scores on
    the host (thresholding, NMS): for evaluation, not for a training step."""
    from .._optional import require

    batched_nms = require("torchvision.ops", "decoding detections (non-maximum suppression)").batched_nms

    pts, strd = dense_detection_points(height, width, strides)
    pts, strd = pts.to(pred.device), strd.to(pred.device)
    pred = pred.float()
    prob = torch.sigmoid(pred[..., :1]) * torch.softmax(pred[..., 5:], dim=-1)
    scores, labels = prob.max(-1)
    dist = F.softplus(pred[..., 1:5]) * strd[:, None]
    boxes = torch.cat([pts - dist[..., :2], pts + dist[..., 2:]], dim=-1)
    boxes = torch.stack([boxes[..., 0].clamp(0, width), boxes[..., 1].clamp(0, height),
                         boxes[..., 2].clamp(0, width), boxes[..., 3].clamp(0, height)], dim=-1)
    out = []
    for b, s, c in zip(boxes, scores, labels):
        keep = torch.nonzero(s >= score_threshold).flatten()
        b, s, c = b[keep], s[keep], c[keep]
        keep = batched_nms(b, s, c, iou_threshold)[:max_detections]
        out.append({"boxes": b[keep], "scores": s[keep], "labels": c[keep]})
    return out


def _dense_part(value: Any, what: str) -> Tensor:
    """The dense tensor of a prediction or target: the tensor itself, a dict's
    ``"dense"`` entry, or a list of per-image dicts with ``"dense"`` (stacked)."""
    if isinstance(value, Tensor):
        return value
    if isinstance(value, dict) and isinstance(value.get("dense"), Tensor):
        return value["dense"]
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, dict) and "dense" in v for v in value):
        return torch.stack([v["dense"] for v in value])
    raise ValueError(f"DenseDetectionLoss: {what} must be a tensor, a dict with a 'dense' tensor or a list of "
                     f"per-image dicts with 'dense', got {type(value).__name__}")


class DenseDetectionLoss(nn.Module):
    """Loss of a dense anchor-free head (:class:`YoloCSP`) against
    :func:`dense_detection_targets`: objectness BCE-with-logits over all
    locations (mean), plus, over the positive locations, class cross-entropy
    and an L1 loss on the box distances (softplus of the predictions, in
    stride units), both divided by the number of positives (at least 1). All
    tensor arithmetic: no host synchronisation.

    ``pred`` is the head's tensor or YoloCSP's eval-mode dict (its
    ``"dense"``); ``target`` the dense targets [B, N, 6], or per-image dicts
    holding them as ``"dense"``. With ``components=True`` the loss returns
    ``(loss, {"obj": ..., "box": ..., "cls": ...})`` (the three weighted
    terms), which the Trainer logs per epoch."""

    def __init__(self, box_weight: float = 1.0, cls_weight: float = 1.0, components: bool = False) -> None:
        super().__init__()
        self.box_weight, self.cls_weight, self.components = box_weight, cls_weight, bool(components)

    def forward(self, pred: Any, target: Any):
        pred, target = _dense_part(pred, "pred"), _dense_part(target, "target")
        if pred.dim() != 3 or target.shape[:2] != pred.shape[:2] or target.shape[-1] != 6 or pred.shape[-1] < 6:
            raise ValueError(f"DenseDetectionLoss: pred must be [B, N, 5 + classes] and target [B, N, 6], got "
                             f"{tuple(pred.shape)} and {tuple(target.shape)}")
        pred = pred.float()
        pos = target[..., 0]
        n_pos = pos.sum().clamp(min=1.0)
        obj = F.binary_cross_entropy_with_logits(pred[..., 0], pos)
        box = (F.softplus(pred[..., 1:5]) - target[..., 2:]).abs().sum(-1)
        cls = F.cross_entropy(pred[..., 5:].flatten(0, 1), target[..., 1].long().flatten(), reduction="none")
        if not self.components:
            return obj + ((self.box_weight * box + self.cls_weight * cls.view_as(box)) * pos).sum() / n_pos
        box_term = self.box_weight * (box * pos).sum() / n_pos
        cls_term = self.cls_weight * (cls.view_as(box) * pos).sum() / n_pos
        return obj + box_term + cls_term, {"obj": obj, "box": box_term, "cls": cls_term}
