"""Detection and segmentation data in the formats users keep it in.

* :class:`CocoDetection`: images in a folder and COCO-style JSON annotations
  (``images``: ``id``, ``file_name``; ``annotations``: ``image_id``,
  ``bbox`` [x, y, width, height] in pixels, ``category_id``, optional
  ``iscrowd``; ``categories``: ``id``, ``name``). Items are ``(image,
  {"boxes": [K, 4] x1 y1 x2 y2, "labels": [K], "image_id": 0-d})``; category
  ids map to contiguous labels in the order of their ids (plus
  ``label_offset``: 1 keeps 0 for torchvision's background). Crowd regions
  and boxes without area are left out.
* :class:`MaskFolderDataset`: ``images/`` and ``masks/`` folders whose files
  pair up by name (``a.jpg`` with ``a.png``); a mask is a one-channel PNG of
  class indices (255: ignored by the segmentation metrics). Items are
  ``(image, mask [H, W] int64)``.

:func:`export_coco` and :func:`export_mask_folders` write any detection or
segmentation dataset in these formats (the digit canvases, say, to try the
loaders or look at the data).
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor
from torch.utils.data import Dataset

from .images import IMAGE_EXTENSIONS, read_image, read_mask, write_image, write_mask

__all__ = ["CocoDetection", "MaskFolderDataset", "export_coco", "export_mask_folders"]

Transforms = Optional[Callable[[Tensor, Any], Tuple[Tensor, Any]]]


def _field(obj: Dict[str, Any], key: str, where: str, path: str) -> Any:
    if not isinstance(obj, dict) or key not in obj:
        raise ValueError(f"{path}: {where} has no {key!r} field (COCO format: images[].id/file_name, "
                         f"annotations[].image_id/bbox/category_id, categories[].id/name)")
    return obj[key]


class CocoDetection(Dataset):
    """Detection images with COCO-style annotations; see the module docstring."""

    def __init__(self, images_dir: str, annotation_file: str, transforms: Transforms = None, channels: int = 3,
                 label_offset: int = 0) -> None:
        for path, kind in ((images_dir, "images directory"), (annotation_file, "annotation file")):
            if not (os.path.isdir(path) if kind.startswith("images") else os.path.isfile(path)):
                raise FileNotFoundError(f"CocoDetection: {kind} not found: {path}")
        try:
            with open(annotation_file) as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"CocoDetection: cannot read {annotation_file} as JSON ({exc})") from exc
        if not isinstance(data, dict):
            raise ValueError(f"{annotation_file}: expected a JSON object with images, annotations, categories")
        cats = sorted(_field(c, "id", "a category", annotation_file) for c in _field(data, "categories", "the file",
                                                                                       annotation_file))
        names = {c["id"]: c.get("name", str(c["id"])) for c in data["categories"]}
        self.category_ids: List[int] = cats
        self.classes: List[str] = [names[c] for c in cats]
        label_of = {c: i + label_offset for i, c in enumerate(cats)}
        self.images_dir, self.transforms, self.channels = images_dir, transforms, channels
        self.images: List[Tuple[int, str]] = []
        boxes: Dict[int, List[List[float]]] = {}
        labels: Dict[int, List[int]] = {}
        for im in _field(data, "images", "the file", annotation_file):
            iid = _field(im, "id", "an image", annotation_file)
            self.images.append((iid, _field(im, "file_name", f"image {iid}", annotation_file)))
            boxes[iid], labels[iid] = [], []
        for i, ann in enumerate(_field(data, "annotations", "the file", annotation_file)):
            where = f"annotation {i}"
            iid, bbox, cat = (_field(ann, k, where, annotation_file) for k in ("image_id", "bbox", "category_id"))
            if iid not in boxes:
                raise ValueError(f"{annotation_file}: {where} refers to image_id {iid}, which is not in images")
            if cat not in label_of:
                raise ValueError(f"{annotation_file}: {where} has category_id {cat}, which is not in categories")
            if not (isinstance(bbox, list) and len(bbox) == 4):
                raise ValueError(f"{annotation_file}: {where} has bbox {bbox!r}; expected [x, y, width, height]")
            x, y, w, h = (float(v) for v in bbox)
            if ann.get("iscrowd", 0) or w <= 0 or h <= 0:
                continue
            boxes[iid].append([x, y, x + w, y + h])
            labels[iid].append(label_of[cat])
        self._boxes = {k: torch.tensor(v, dtype=torch.float32).reshape(-1, 4) for k, v in boxes.items()}
        self._labels = {k: torch.tensor(v, dtype=torch.int64) for k, v in labels.items()}

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int):
        iid, name = self.images[index]
        path = os.path.join(self.images_dir, name)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"CocoDetection: image {path} (image_id {iid}) not found")
        image = read_image(path, self.channels, who="CocoDetection")
        target = {"boxes": self._boxes[iid].clone(), "labels": self._labels[iid].clone(),
                  "image_id": torch.tensor(iid, dtype=torch.int64)}
        if self.transforms is not None:
            image, target = self.transforms(image, target)
        return image, target


def _files(folder: str, extensions: Sequence[str]) -> Dict[str, str]:
    return {os.path.splitext(n)[0]: n for n in sorted(os.listdir(folder))
            if os.path.splitext(n)[1].lower() in extensions and not n.startswith(".")}


class MaskFolderDataset(Dataset):
    """``images_dir`` and ``masks_dir`` whose files pair up by name; see the
    module docstring. ``image_size`` (height, width) resizes images (bilinear)
    and masks (nearest) at load time."""

    def __init__(self, images_dir: str, masks_dir: str, transforms: Transforms = None, channels: int = 3,
                 image_size: Optional[Tuple[int, int]] = None) -> None:
        for path in (images_dir, masks_dir):
            if not os.path.isdir(path):
                raise FileNotFoundError(f"MaskFolderDataset: directory not found: {path}")
        images, masks = _files(images_dir, IMAGE_EXTENSIONS), _files(masks_dir, (".png",))
        unpaired = sorted(set(images) ^ set(masks))
        if unpaired:
            raise ValueError(f"MaskFolderDataset: {len(unpaired)} file(s) without a partner, e.g. {unpaired[:3]} "
                             f"(every image in {images_dir} needs a .png mask of the same name in {masks_dir})")
        if not images:
            raise ValueError(f"MaskFolderDataset: {images_dir} holds no images ({', '.join(IMAGE_EXTENSIONS)})")
        self.pairs = [(os.path.join(images_dir, images[k]), os.path.join(masks_dir, masks[k])) for k in images]
        self.transforms, self.channels, self.image_size = transforms, channels, image_size

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, index: int):
        image_path, mask_path = self.pairs[index]
        image = read_image(image_path, self.channels, who="MaskFolderDataset")
        mask = read_mask(mask_path, who="MaskFolderDataset")
        if mask.shape != image.shape[-2:]:
            raise ValueError(f"MaskFolderDataset: mask {mask_path} is {tuple(mask.shape)} but image {image_path} "
                             f"is {tuple(image.shape[-2:])}")
        if self.image_size is not None:
            from .transforms import Resize

            image, mask = Resize(tuple(self.image_size))(image, mask)
        if self.transforms is not None:
            image, mask = self.transforms(image, mask)
        return image, mask


def export_coco(dataset: Dataset, directory: str, classes: Optional[Sequence[str]] = None,
                label_offset: int = 0) -> Tuple[str, str]:
    """Write a detection dataset (items ``(image, {"boxes", "labels"})``) as
    ``directory/images/<i>.png`` and ``directory/annotations.json``; returns
    both paths. Labels ``l`` become category ids ``l - label_offset + 1``."""
    images_dir = os.path.join(directory, "images")
    images, annotations = [], []
    n_cls = 0
    for i in range(len(dataset)):
        image, target = dataset[i]
        name = f"{i:06d}.png"
        write_image(image, os.path.join(images_dir, name))
        images.append({"id": i, "file_name": name, "height": int(image.shape[-2]), "width": int(image.shape[-1])})
        for box, label in zip(target["boxes"].tolist(), target["labels"].tolist()):
            cat = int(label) - label_offset + 1
            n_cls = max(n_cls, cat)
            x1, y1, x2, y2 = box
            annotations.append({"id": len(annotations) + 1, "image_id": i, "category_id": cat, "iscrowd": 0,
                                "bbox": [x1, y1, x2 - x1, y2 - y1], "area": (x2 - x1) * (y2 - y1)})
    names = list(classes) if classes is not None else [str(c) for c in range(n_cls)]
    categories = [{"id": c + 1, "name": n} for c, n in enumerate(names)]
    path = os.path.join(directory, "annotations.json")
    with open(path, "w") as f:
        json.dump({"images": images, "annotations": annotations, "categories": categories}, f)
    return images_dir, path


def export_mask_folders(dataset: Dataset, directory: str) -> Tuple[str, str]:
    """Write a segmentation dataset (items ``(image, mask)``) as
    ``directory/images/<i>.png`` and ``directory/masks/<i>.png``."""
    images_dir, masks_dir = os.path.join(directory, "images"), os.path.join(directory, "masks")
    for i in range(len(dataset)):
        image, mask = dataset[i]
        write_image(image, os.path.join(images_dir, f"{i:06d}.png"))
        write_mask(mask, os.path.join(masks_dir, f"{i:06d}.png"))
    return images_dir, masks_dir
