"""torchvision's detection and segmentation models through Trainer.train on the
CPU with bf16 autocast and torch_compile: a Faster R-CNN that computes its own
loss (a dict of four components) and returns detections in eval mode (mAP),
and a DeepLabV3 whose output is a dict (mIoU). Tiny images, one or two steps.

The compile backends are dynamo's ``eager`` (detection) and ``aot_eager``
(segmentation): they trace the model (graph breaks, guards, recompiles for
train/eval) as inductor would, without inductor's code generation, which
takes minutes for these models on 2 CPU cores."""

import os

import pytest
import torch

from fusetrain import Trainer
from fusetrain.training.data import build_dataloaders

from _train_helpers import one_thread  # noqa: F401  (fixture)

pytestmark = pytest.mark.slow  # torchvision detectors under torch.compile: deselected in the inner loop (README, Tests)

tv = pytest.importorskip("torchvision")




def test_fasterrcnn_trains_with_bf16_and_torch_compile(tmp_path):
    from torchvision.models.detection import fasterrcnn_mobilenet_v3_large_320_fpn

    torch.manual_seed(0)
    # Few proposals and sampled boxes: the box head's bf16 matmuls are slow on CPUs without native bf16.
    model = fasterrcnn_mobilenet_v3_large_320_fpn(
        weights=None, weights_backbone=None, num_classes=11, min_size=64, max_size=64, rpn_pre_nms_top_n_train=64,
        rpn_post_nms_top_n_train=32, rpn_pre_nms_top_n_test=32, rpn_post_nms_top_n_test=16,
        box_batch_size_per_image=16, rpn_batch_size_per_image=32, box_detections_per_img=10)
    # Per-image dicts of boxes and labels (label_offset 1: torchvision keeps 0 for the background).
    train, valid = build_dataloaders({"name": "digits_detection", "batch_size": 2, "num_train": 2, "num_valid": 2,
                                      "label_offset": 1})
    params = dict(max_epochs=1, device="cpu", progress_bar=False, mixed_precision="bf16", torch_compile=True,
                  torch_compile_options={"backend": "eager"}, loss="model", train_metrics=[],
                  valid_metrics=["map"], metric_to_watch="map")
    result = Trainer("frcnn", ckpt_root_dir=str(tmp_path)).train(model, params, train, valid)
    row = result["final"]
    parts = ["train_loss_classifier", "train_loss_box_reg", "train_loss_objectness", "train_loss_rpn_box_reg"]
    for k in parts + ["valid_map", "valid_map_50", "valid_map_75"]:
        assert k in row, k
    assert row["train_loss"] == pytest.approx(sum(row[k] for k in parts), rel=1e-5)
    assert 0.0 <= row["valid_map"] <= 1.0
    assert os.path.isfile(os.path.join(result["run_dir"], "ckpt_best.pth"))


def test_deeplabv3_trains_with_bf16_and_torch_compile(tmp_path):
    from torchvision.models.segmentation import deeplabv3_mobilenet_v3_large

    torch.manual_seed(0)
    model = deeplabv3_mobilenet_v3_large(weights=None, weights_backbone=None, num_classes=11)
    train, valid = build_dataloaders({"name": "digits_segmentation", "batch_size": 2, "num_train": 4,
                                      "num_valid": 2})
    # CrossEntropyLoss reads the {"out": ...} of the model's dict output (and so do the metrics).
    params = dict(max_epochs=1, device="cpu", progress_bar=False, mixed_precision="bf16", torch_compile=True,
                  torch_compile_options={"backend": "aot_eager"}, loss="CrossEntropyLoss",
                  train_metrics=["mean_iou"], valid_metrics=["mean_iou", "pixel_accuracy"],
                  metric_to_watch="mean_iou")
    result = Trainer("deeplab", ckpt_root_dir=str(tmp_path)).train(model, params, train, valid)
    row = result["final"]
    for k in ("train_loss", "train_mean_iou", "valid_loss", "valid_mean_iou", "valid_pixel_accuracy"):
        assert k in row and 0.0 <= row[k] < float("inf"), k
    assert 0.0 <= row["valid_mean_iou"] <= 1.0
