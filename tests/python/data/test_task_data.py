"""Detection and segmentation data: the digit canvases, the COCO and
image/mask folder formats (written by the exporters, read back), the
transforms that keep boxes and masks aligned with the image, the collate
function and the dataset_params of the new datasets."""

import json
import os

import pytest
import torch

from fusetrain.training.data import (CocoDetection, DigitCanvas, MaskFolderDataset, build_dataloaders,
                                     export_coco, export_mask_folders, validate_dataset_params)
from fusetrain.training.data.transforms import Compose, DenseTargets, RandomHorizontalFlip, Resize, collate


@pytest.fixture(scope="module")
def det():
    return DigitCanvas("detection", train=False, num_images=6, image_size=64)


@pytest.fixture(scope="module")
def seg():
    return DigitCanvas("segmentation", train=False, num_images=6, image_size=64)


def test_canvases_are_deterministic_and_boxes_hold_the_digits(det, seg):
    again = DigitCanvas("detection", train=False, num_images=6, image_size=64)
    assert torch.equal(det.images, again.images) and all(torch.equal(a, b) for a, b in zip(det.boxes, again.boxes))
    assert not torch.equal(det.images[:6], DigitCanvas("detection", train=True, num_images=6).images)
    assert torch.equal(det.images, seg.images)  # same seed and split: the same canvases
    for i in range(len(seg)):
        image, mask = seg[i]
        _, target = det[i]
        assert image.shape == (3, 64, 64) and 0.0 <= float(image.min()) and float(image.max()) <= 1.0
        assert 1 <= len(target["labels"]) <= 3 and target["boxes"].shape == (len(target["labels"]), 4)
        for box, label in zip(target["boxes"].long().tolist(), target["labels"].tolist()):
            x1, y1, x2, y2 = box
            inside = mask[y1:y2, x1:x2]
            assert (inside == label + 1).any()  # the digit's pixels are in its box
        # Every digit pixel of the mask lies in a box of its class.
        covered = torch.zeros_like(mask, dtype=torch.bool)
        for box, label in zip(target["boxes"].long().tolist(), target["labels"].tolist()):
            x1, y1, x2, y2 = box
            covered[y1:y2, x1:x2] |= mask[y1:y2, x1:x2] == label + 1
        assert torch.equal(covered, mask > 0)
    off = DigitCanvas("detection", train=False, num_images=2, label_offset=1)
    assert torch.equal(off[0][1]["labels"], det[0][1]["labels"] + 1)


def test_coco_roundtrip(tmp_path, det):
    images_dir, ann = export_coco(det, str(tmp_path / "coco"), classes=det.classes)
    ds = CocoDetection(images_dir, ann, label_offset=0)
    assert len(ds) == len(det) and ds.classes == det.classes
    for i in range(len(ds)):
        image, target = ds[i]
        ref_image, ref = det[i]
        torch.testing.assert_close(image, ref_image, atol=1 / 255 + 1e-6, rtol=0)
        torch.testing.assert_close(target["boxes"], ref["boxes"])
        assert torch.equal(target["labels"], ref["labels"]) and int(target["image_id"]) == i
    data = json.load(open(ann))
    data["annotations"][0]["category_id"] = 99
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="annotation 0 has category_id 99, which is not in categories"):
        CocoDetection(images_dir, str(bad))
    with pytest.raises(FileNotFoundError, match="annotation file not found"):
        CocoDetection(images_dir, str(tmp_path / "none.json"))
    data = json.load(open(ann))
    del data["images"][0]["file_name"]
    bad.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="image 0 has no 'file_name' field"):
        CocoDetection(images_dir, str(bad))


def test_mask_folders_roundtrip_and_errors(tmp_path, seg):
    images_dir, masks_dir = export_mask_folders(seg, str(tmp_path / "seg"))
    ds = MaskFolderDataset(images_dir, masks_dir)
    assert len(ds) == len(seg)
    for i in range(len(ds)):
        assert torch.equal(ds[i][1], seg[i][1])
    os.remove(os.path.join(masks_dir, "000002.png"))
    with pytest.raises(ValueError, match=r"1 file\(s\) without a partner, e.g. \['000002'\]"):
        MaskFolderDataset(images_dir, masks_dir)


def test_transforms_keep_boxes_and_masks_aligned(det, seg):
    image, target = det[0]
    _, mask = seg[0]
    flip = RandomHorizontalFlip(p=1.0)
    fimage, ftarget = flip(image, target)
    _, fmask = flip(image, mask)
    assert torch.equal(fimage, image.flip(-1)) and torch.equal(fmask, mask.flip(-1))
    for box, label in zip(ftarget["boxes"].long().tolist(), ftarget["labels"].tolist()):
        x1, y1, x2, y2 = box
        assert (fmask[y1:y2, x1:x2] == label + 1).any()
    rimage, rtarget = Resize(32)(image, target)
    _, rmask = Resize((32, 32))(image, mask)
    assert rimage.shape == (3, 32, 32) and rmask.shape == (32, 32) and rmask.dtype == torch.int64
    torch.testing.assert_close(rtarget["boxes"], target["boxes"] / 2)
    assert set(rmask.unique().tolist()) <= set(mask.unique().tolist())
    _, dense = Compose([Resize(64), DenseTargets()])(image, target)
    assert dense.shape == (8 * 8 + 4 * 4 + 2 * 2, 6) and dense[:, 0].sum() >= 1
    images, targets = collate([det[0], det[1]])
    assert images.shape == (2, 3, 64, 64) and isinstance(targets, list) and len(targets) == 2
    images, masks = collate([seg[0], seg[1]])
    assert masks.shape == (2, 64, 64)


def test_dataset_params_of_the_new_datasets(tmp_path, det, seg):
    with pytest.raises(ValueError, match="dataset_params.train_images is required for the 'coco_detection'"):
        validate_dataset_params({"name": "coco_detection"})
    with pytest.raises(ValueError, match="dataset_params.root is required for the 'mask_folders' dataset"):
        validate_dataset_params({"name": "mask_folders"})
    with pytest.raises(ValueError, match="unknown key 'dense_targets' for dataset 'digits_segmentation'"):
        validate_dataset_params({"name": "digits_segmentation", "dense_targets": True})
    for split in ("train", "valid"):
        export_coco(det, str(tmp_path / "coco" / split))
    root = tmp_path / "coco"
    tl, vl = build_dataloaders({"name": "coco_detection", "batch_size": 3, "image_size": 32, "dense_targets": True,
                                **{f"{s}_{k}": str(root / s / p) for s in ("train", "valid")
                                   for k, p in (("images", "images"), ("annotations", "annotations.json"))}})
    x, y = next(iter(tl))
    assert x.shape == (3, 3, 32, 32) and y.shape == (3, 4 * 4 + 2 * 2 + 1, 6)
    x, y = next(iter(vl))
    assert isinstance(y, list) and {"boxes", "labels", "dense", "image_id"} <= set(y[0])
    for split in ("train", "val"):
        export_mask_folders(seg, str(tmp_path / "masks" / split))
    tl, _ = build_dataloaders({"name": "mask_folders", "root": str(tmp_path / "masks"), "batch_size": 2})
    x, y = next(iter(tl))
    assert x.shape == (2, 3, 64, 64) and y.shape == (2, 64, 64)
