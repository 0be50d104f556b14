"""The segmentation and detection models of fusetrain.models
(pplite_seg, ddrnet, yolo_csp): structure, output shapes on odd sizes, the
dense detection targets and loss against direct computations, and a training
step with fusetrain's fused optimizer."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fusetrain
import fusetrain.models
from fusetrain.models import (DDRNet, DenseDetectionLoss, PPLiteSeg, STDCBlock, YoloCSP, build_model,
                                       dense_detection_points, dense_detection_targets)


def _n_params(m):
    return sum(p.numel() for p in m.parameters())


@pytest.mark.parametrize("name, kwargs, shape", [
    ("pplite_seg", {"width": 4}, (2, 3, 64, 96)),
    ("pplite_seg", {"width": 4, "num_classes": 5, "in_channels": 1, "blocks_per_stage": (1, 3, 1)}, (1, 1, 40, 72)),
    ("ddrnet", {"width": 4}, (2, 3, 64, 128)),
    ("ddrnet", {"width": 4, "num_classes": 3, "layers": (1, 1, 1, 1)}, (1, 3, 72, 100)),
])
def test_segmentation_logits_have_the_input_size(name, kwargs, shape):
    torch.manual_seed(0)
    model = build_model(name, **kwargs)
    out = model(torch.rand(*shape))
    assert out.shape == (shape[0], kwargs.get("num_classes", 19), shape[2], shape[3])
    assert torch.isfinite(out).all()
    out.square().mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_stdc_block_concatenates_its_steps():
    block = STDCBlock(8, 32, stride=2)
    y = block(torch.rand(2, 8, 16, 20))
    assert y.shape == (2, 32, 8, 10)
    # widths 16, 8, 4, 4: the first conv's output (avg-pooled) is the first 16 channels.
    h = block.convs[0](torch.rand(1, 8, 16, 20))
    assert h.shape[1] == 16
    assert [c[0].out_channels for c in block.convs] == [16, 8, 4, 4]
    assert block.convs[0][0].kernel_size == (1, 1) and all(c[0].kernel_size == (3, 3) for c in block.convs[1:])
    with pytest.raises(ValueError, match="cout divisible"):
        STDCBlock(8, 30, stride=1)


def test_pplite_seg_structure():
    m = PPLiteSeg(width=8)
    assert [len(s) for s in m.stages] == [2, 2, 2]
    assert all(isinstance(b, STDCBlock) for s in m.stages for b in s)
    assert [s[0].stride for s in m.stages] == [2, 2, 2]
    assert m.sppm.bins == (1, 2, 4)
    # The decoder's attention weight is per pixel: one channel from 4 statistics.
    assert m.fuse16.attn[0][0].in_channels == 4 and m.fuse16.attn[1].out_channels == 1
    with pytest.raises(ValueError, match="height and width must be >= 32"):
        m(torch.rand(1, 3, 16, 64))
    with pytest.raises(ValueError, match="blocks_per_stage"):
        PPLiteSeg(blocks_per_stage=(1, 2))


def test_ddrnet_branch_resolutions():
    m = DDRNet(width=4)
    feats = {}
    for mod_name in ("stem", "low3", "high3", "low4", "high4", "low5", "high5"):
        getattr(m, mod_name).register_forward_hook(lambda mod, i, o, k=mod_name: feats.__setitem__(k, o.shape))
    m(torch.rand(1, 3, 128, 256))
    assert feats["stem"][-2:] == (16, 32)  # 1/8
    assert feats["high3"][-2:] == feats["high4"][-2:] == feats["high5"][-2:] == (16, 32)  # stays at 1/8
    assert feats["low3"][-2:] == (8, 16) and feats["low4"][-2:] == (4, 8) and feats["low5"][-2:] == (2, 4)
    assert feats["low5"][1] == 16 * 4 and feats["high5"][1] == 4 * 4
    with pytest.raises(ValueError, match=">= 64"):
        m(torch.rand(1, 3, 32, 64))


def test_yolo_csp_output_layout():
    m = YoloCSP(num_classes=7, width=4)
    out = m(torch.rand(2, 3, 64, 96))
    n = sum((64 // s) * (96 // s) for s in YoloCSP.strides)
    assert out.shape == (2, n, 5 + 7)
    pts, strides = dense_detection_points(64, 96)
    assert pts.shape == (n, 2) and strides.shape == (n,)
    # Level by level, row-major: the first location is the centre of the first stride-8 cell.
    assert pts[0].tolist() == [4.0, 4.0] and strides[0] == 8 and strides[-1] == 32
    assert pts[1].tolist() == [12.0, 4.0]
    with pytest.raises(ValueError, match="multiples of 32"):
        m(torch.rand(1, 3, 64, 80))


def test_dense_detection_targets_match_a_direct_assignment():
    torch.manual_seed(3)
    h, w = 128, 160
    boxes = torch.tensor([[10.0, 12.0, 50.0, 40.0], [20.0, 20.0, 150.0, 120.0], [60.0, 5.0, 100.0, 70.0]])
    labels = torch.tensor([4, 1, 9])
    t = dense_detection_targets(boxes, labels, h, w)
    pts, strides = dense_detection_points(h, w)
    # Direct per-location loop (the reference).
    for i in range(pts.shape[0]):
        x, y = pts[i].tolist()
        s = float(strides[i])
        lo, hi = (0.0 if s == 8 else 4 * s), (math.inf if s == 32 else 8 * s)
        best, best_area = None, math.inf
        for k, (x1, y1, x2, y2) in enumerate(boxes.tolist()):
            d = [x - x1, y - y1, x2 - x, y2 - y]
            if min(d) > 0 and lo < max(d) <= hi:
                area = (x2 - x1) * (y2 - y1)
                if area < best_area:
                    best, best_area = k, area
        if best is None:
            assert t[i].tolist() == [0.0] * 6, i
        else:
            x1, y1, x2, y2 = boxes[best].tolist()
            exp = [1.0, float(labels[best]), (x - x1) / s, (y - y1) / s, (x2 - x) / s, (y2 - y) / s]
            torch.testing.assert_close(t[i], torch.tensor(exp), rtol=1e-6, atol=1e-6)
    assert t[:, 0].sum() > 0
    assert dense_detection_targets(torch.zeros(0, 4), torch.zeros(0, dtype=torch.long), h, w).abs().sum() == 0
    with pytest.raises(ValueError, match="boxes must be"):
        dense_detection_targets(boxes[:, :3], labels, h, w)


def test_dense_detection_loss_against_direct_formula():
    torch.manual_seed(0)
    b, n, c = 2, 30, 6
    pred = torch.randn(b, n, 5 + c, dtype=torch.float64)
    target = torch.zeros(b, n, 6, dtype=torch.float64)
    pos = torch.rand(b, n) < 0.3
    target[..., 0] = pos.double()
    target[..., 1] = torch.where(pos, torch.randint(0, c, (b, n)).double(), torch.zeros(()).double())
    target[..., 2:] = torch.where(pos[..., None], torch.rand(b, n, 4, dtype=torch.float64) * 5, torch.zeros(()).double())
    loss = DenseDetectionLoss()(pred, target)
    # Reference, term by term over the positives.
    obj = F.binary_cross_entropy_with_logits(pred[..., 0].float(), pos.float()).double()
    terms = 0.0
    for i in range(b):
        for j in range(n):
            if pos[i, j]:
                terms += float((F.softplus(pred[i, j, 1:5]) - target[i, j, 2:]).abs().sum())
                terms += float(F.cross_entropy(pred[i, j, 5:][None], target[i, j, 1].long()[None]))
    ref = float(obj) + terms / max(1, int(pos.sum()))
    assert float(loss) == pytest.approx(ref, rel=1e-5)
    # No positives: the objectness term only (divided by 1, not 0).
    none = DenseDetectionLoss()(pred, torch.zeros(b, n, 6, dtype=torch.float64))
    assert float(none) == pytest.approx(float(F.binary_cross_entropy_with_logits(pred[..., 0].float(),
                                                                                  torch.zeros(b, n))), rel=1e-6)
    with pytest.raises(ValueError, match="pred must be"):
        DenseDetectionLoss()(pred[0], target)


@pytest.mark.parametrize("name", ["pplite_seg", "ddrnet", "yolo_csp"])
def test_a_few_fused_training_steps_reduce_the_loss(name):
    torch.manual_seed(0)
    h, w = 64, 64
    if name == "yolo_csp":
        model, loss_fn = build_model(name, num_classes=3, width=4), DenseDetectionLoss()
        boxes = torch.tensor([[8.0, 8.0, 40.0, 36.0]])
        y = torch.stack([dense_detection_targets(boxes, torch.tensor([2]), h, w)] * 2)
        x = torch.rand(2, 3, h, w)
    else:
        model, loss_fn = build_model(name, num_classes=3, width=4), nn.CrossEntropyLoss()
        y = (torch.arange(w)[None, None, :] >= w // 2).long().expand(2, h, w).contiguous()
        x = torch.rand(2, 3, h, w) + y[:, None].float()
    opt = fusetrain.optim.AdamW(model.parameters(), lr=3e-3, max_grad_norm=5.0)
    losses = []
    for _ in range(6):
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0]


def test_registry_and_arch_params():
    assert {"pplite_seg", "ddrnet", "yolo_csp"} <= set(fusetrain.models.MODEL_NAMES)
    assert _n_params(build_model("pplite_seg", width=8)) < _n_params(build_model("pplite_seg", width=16))
    with pytest.raises(ValueError, match="width must be an int >= 1"):
        build_model("ddrnet", width=0)
    with pytest.raises(ValueError, match="unknown key 'depth' for model 'pplite_seg'"):
        build_model("pplite_seg", depth=2)
