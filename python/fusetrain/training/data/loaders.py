"""``dataset_params`` -> ``(train_loader, valid_loader)``: the keys each
dataset name accepts, their checks and defaults (:func:`validate_dataset_params`),
and :func:`build_dataloaders`."""


from __future__ import annotations

import os
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import torch
from torch.utils.data import DataLoader, Dataset

from ..._warnings import warn
from .canvas import DigitCanvas
from .classification import ImageFolderDataset, MNISTIdx, digits_dataset
from .formats import CocoDetection, MaskFolderDataset
from .transforms import Compose, DenseTargets, Resize, collate

__all__ = ["DATASET_NAMES", "build_dataloaders", "validate_dataset_params"]

# ---- dataset_params -> loaders --------------------------------------------------------------------------------

#: Names accepted by ``dataset_params.name``.
DATASET_NAMES = ("digits", "mnist", "image_folder", "digits_detection", "digits_segmentation", "coco_detection",
                 "mask_folders")

# key -> (default, description of allowed values, check)
_COMMON_KEYS: Dict[str, Tuple[Any, str, Callable[[Any], bool]]] = {
    "name": (None, "one of " + ", ".join(repr(n) for n in DATASET_NAMES), lambda v: v in DATASET_NAMES),
    "batch_size": (64, "an int >= 1", lambda v: _is_int(v) and v >= 1),
    "valid_batch_size": (None, "an int >= 1 or null (same as batch_size)", lambda v: v is None or
                         (_is_int(v) and v >= 1)),
    "num_workers": (0, "an int >= 0", lambda v: _is_int(v) and v >= 0),
    "shuffle": (True, "a bool", lambda v: isinstance(v, bool)),
    "drop_last": (False, "a bool", lambda v: isinstance(v, bool)),
    "pin_memory": (False, "a bool", lambda v: isinstance(v, bool)),
    "seed": (0, "an int >= 0", lambda v: _is_int(v) and v >= 0),
}
_PER_NAME_KEYS: Dict[str, Dict[str, Tuple[Any, str, Callable[[Any], bool]]]] = {
    "digits": {"image_size": (28, "an int >= 1", lambda v: _is_int(v) and v >= 1)},
    "mnist": {"root": (None, "the directory holding the MNIST IDX files, or null for the embedded digits "
                       "stand-in", lambda v: v is None or isinstance(v, (str, os.PathLike)))},
    "image_folder": {"root": (None, "a directory with train/ and val/ sub-folders of class folders",
                              lambda v: isinstance(v, (str, os.PathLike)) and str(v) != ""),
                     "image_size": (None, "an int >= 1 or null (keep the stored size)",
                                    lambda v: v is None or (_is_int(v) and v >= 1)),
                     "channels": (3, "1 or 3", lambda v: _is_int(v) and v in (1, 3))},
}
_CANVAS_KEYS: Dict[str, Tuple[Any, str, Callable[[Any], bool]]] = {
    "image_size": (64, "an int >= 32", lambda v: _is_int(v) and v >= 32),
    "num_train": (None, "an int >= 1 or null (1200)", lambda v: v is None or (_is_int(v) and v >= 1)),
    "num_valid": (None, "an int >= 1 or null (300)", lambda v: v is None or (_is_int(v) and v >= 1)),
    "max_digits": (3, "an int >= 1", lambda v: _is_int(v) and v >= 1),
    "digit_size": ([16, 32], "[min, max] ints with 8 <= min <= max <= image_size",
                   lambda v: isinstance(v, (list, tuple)) and len(v) == 2 and all(_is_int(x) for x in v)),
    "channels": (3, "1 or 3", lambda v: _is_int(v) and v in (1, 3)),
}
_DETECTION_KEYS: Dict[str, Tuple[Any, str, Callable[[Any], bool]]] = {
    "label_offset": (0, "0 or 1 (1: labels start at 1, torchvision's detection models keep 0 for the background)",
                     lambda v: _is_int(v) and v in (0, 1)),
    "dense_targets": (False, "a bool (true: train targets are yolo_csp's dense targets, valid targets carry them "
                             "as 'dense' beside the boxes)", lambda v: isinstance(v, bool)),
}
_PATH = (None, "a path", lambda v: isinstance(v, (str, os.PathLike)) and str(v) != "")
_PER_NAME_KEYS["digits_detection"] = {**_CANVAS_KEYS, **_DETECTION_KEYS}
_PER_NAME_KEYS["digits_segmentation"] = dict(_CANVAS_KEYS)
_PER_NAME_KEYS["coco_detection"] = {
    "train_images": _PATH, "train_annotations": _PATH, "valid_images": _PATH, "valid_annotations": _PATH,
    "image_size": (None, "an int >= 1 or null (keep the stored size; images must then share one size to be "
                         "batched)", lambda v: v is None or (_is_int(v) and v >= 1)),
    "channels": (3, "1 or 3", lambda v: _is_int(v) and v in (1, 3)), **_DETECTION_KEYS}
_PER_NAME_KEYS["mask_folders"] = {
    "root": (None, "a directory with train/images, train/masks, val/images and val/masks",
             lambda v: isinstance(v, (str, os.PathLike)) and str(v) != ""),
    "image_size": (None, "an int >= 1 or null (keep the stored size)", lambda v: v is None or (_is_int(v) and v >= 1)),
    "channels": (3, "1 or 3", lambda v: _is_int(v) and v in (1, 3))}
#: Keys without a default, per dataset name.
_REQUIRED = {"image_folder": ("root",), "mask_folders": ("root",),
             "coco_detection": ("train_images", "train_annotations", "valid_images", "valid_annotations")}
#: Datasets whose batches are (images, per-image targets): collated by transforms.collate.
_PAIRED = ("digits_detection", "digits_segmentation", "coco_detection", "mask_folders")

_warned_mnist_fallback = False


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def validate_dataset_params(dataset_params: Mapping[str, Any]) -> Dict[str, Any]:
    """Check a ``dataset_params`` mapping and return it as a dict with every
    default filled in. Raises ``ValueError`` naming the key, the value and what
    is allowed. Touches no files."""
    if not isinstance(dataset_params, Mapping):
        raise ValueError(f"dataset_params: expected a mapping, got {type(dataset_params).__name__}")
    params = dict(dataset_params)
    if "name" not in params:
        raise ValueError("dataset_params.name is required; allowed: " + ", ".join(repr(n) for n in DATASET_NAMES))
    name = params["name"]
    if name not in DATASET_NAMES:
        raise ValueError(f"dataset_params.name: got {name!r}; allowed: "
                         + ", ".join(repr(n) for n in DATASET_NAMES))
    spec = dict(_COMMON_KEYS)
    spec.update(_PER_NAME_KEYS[name])
    for key in params:
        if key not in spec:
            raise ValueError(f"dataset_params: unknown key {key!r} for dataset {name!r}; allowed keys: "
                             + ", ".join(sorted(spec)))
    out: Dict[str, Any] = {}
    for key, (default, allowed, check) in spec.items():
        value = params.get(key, default)
        if key in params and not check(value):
            raise ValueError(f"dataset_params.{key}: got {value!r} ({type(value).__name__}); allowed: {allowed}")
        out[key] = value
    for key in _REQUIRED.get(name, ()):
        if key not in params:
            raise ValueError(f"dataset_params.{key} is required for the {name!r} dataset: "
                             f"{spec[key][1]}")
    if out["valid_batch_size"] is None:
        out["valid_batch_size"] = out["batch_size"]
    return out


def _build_datasets(p: Mapping[str, Any]) -> Tuple[Dataset, Dataset]:
    global _warned_mnist_fallback
    name = p["name"]
    if name == "digits":
        return digits_dataset(True, p["image_size"]), digits_dataset(False, p["image_size"])
    if name == "mnist":
        root = p["root"]
        if root is None or str(root) == "":
            if not _warned_mnist_fallback:
                _warned_mnist_fallback = True
                warn("dataset_params.root is not set for 'mnist': using the embedded scikit-learn digits "
                     "resized to 28x28 instead of MNIST (1438 train / 359 valid images); set "
                     "dataset_params.root=/path/to/mnist to train on MNIST's IDX files", UserWarning)
            return digits_dataset(True, 28), digits_dataset(False, 28)
        return MNISTIdx(str(root), train=True), MNISTIdx(str(root), train=False)
    if name in ("digits_detection", "digits_segmentation"):
        return _canvas_datasets(p, name.split("_")[1])
    if name == "coco_detection":
        return tuple(CocoDetection(os.path.expanduser(str(p[f"{split}_images"])),
                                   os.path.expanduser(str(p[f"{split}_annotations"])),
                                   transforms=_detection_transforms(p, split == "train"), channels=p["channels"],
                                   label_offset=p["label_offset"]) for split in ("train", "valid"))
    if name == "mask_folders":
        return tuple(MaskFolderDataset(*_split_dirs(p["root"], split, ("images", "masks")), channels=p["channels"],
                                       image_size=None if p["image_size"] is None else (p["image_size"],) * 2)
                     for split in ("train", "val"))
    # image_folder
    root = os.path.expanduser(str(p["root"]))
    if not os.path.isdir(root):
        raise FileNotFoundError(f"dataset_params.root: directory not found: {root} (expected a directory with "
                                "train/ and val/ sub-folders of class folders)")
    splits = []
    for split in ("train", "val"):
        path = os.path.join(root, split)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"dataset_params.root: {root} has no {split}/ sub-folder (expected "
                                    f"{root}/train/<class>/<image> and {root}/val/<class>/<image>)")
        splits.append(ImageFolderDataset(path, channels=p["channels"], image_size=p["image_size"]))
    train_ds, valid_ds = splits
    if train_ds.classes != valid_ds.classes:
        raise ValueError(f"dataset_params.root: the class folders of {root}/train ({train_ds.classes}) and "
                         f"{root}/val ({valid_ds.classes}) differ")
    return train_ds, valid_ds


def _split_dirs(root: Any, split: str, subdirs: Tuple[str, ...]) -> List[str]:
    root = os.path.expanduser(str(root))
    paths = [os.path.join(root, split, d) for d in subdirs]
    for path in paths:
        if not os.path.isdir(path):
            raise FileNotFoundError(f"dataset_params.root: {path} not found (expected "
                                    + " and ".join(f"{root}/{{train,val}}/{d}" for d in subdirs) + ")")
    return paths


def _detection_transforms(p: Mapping[str, Any], train: bool) -> Optional[Callable]:
    ts: List[Callable] = []
    if p.get("image_size") is not None:
        ts.append(Resize(p["image_size"]))
    if p["dense_targets"]:
        ts.append(DenseTargets(keep_boxes=not train))
    return Compose(ts) if ts else None


def _canvas_datasets(p: Mapping[str, Any], task: str) -> Tuple[Dataset, Dataset]:
    kw = dict(image_size=p["image_size"], max_digits=p["max_digits"], digit_size=tuple(p["digit_size"]),
              channels=p["channels"], seed=p["seed"])
    out = []
    for train in (True, False):
        extra: Dict[str, Any] = {}
        if task == "detection":
            extra = dict(label_offset=p["label_offset"], transforms=_detection_transforms(p, train))
        out.append(DigitCanvas(task, train, num_images=p["num_train" if train else "num_valid"], **kw, **extra))
    return out[0], out[1]


def build_dataloaders(dataset_params: Mapping[str, Any]) -> Tuple[DataLoader, DataLoader]:
    """Build ``(train_loader, valid_loader)`` from a recipe's ``dataset_params``.

    Keys (defaults in brackets):

    * ``name``: one of :data:`DATASET_NAMES` (required).
    * ``root``: ``mnist``: the directory with the IDX files; ``null`` trains on
      the embedded digits resized to 28x28 instead (with a warning).
      ``image_folder``: a directory with ``train/`` and ``val/`` sub-folders,
      each holding ``<class name>/<image>`` (required).
    * ``batch_size`` [64], ``valid_batch_size`` [= batch_size],
      ``num_workers`` [0], ``shuffle`` [true] (train only), ``drop_last``
      [false] (train only), ``pin_memory`` [false; only used when CUDA is
      available], ``seed`` [0]: seed of the
      train loader's shuffling generator (``train_loader.generator``).

    In one process of a distributed run (``WORLD_SIZE > 1`` in the
    environment, as set by torchrun) the train loader samples this rank's shard
    with a ``DistributedSampler`` (``shuffle``, ``seed`` and ``drop_last`` as
    above; ``batch_size`` is per process) and the valid loader reads an exact
    shard (every ``WORLD_SIZE``-th sample).
    * ``digits``: ``image_size`` [28].
    * ``image_folder``: ``image_size`` [null: keep the stored size],
      ``channels`` [3].
    * ``digits_detection`` / ``digits_segmentation`` (:class:`DigitCanvas`):
      ``image_size`` [64], ``num_train`` [1200], ``num_valid`` [300],
      ``max_digits`` [3], ``digit_size`` [[16, 32]], ``channels`` [3].
    * ``digits_detection`` and ``coco_detection``: ``label_offset`` [0],
      ``dense_targets`` [false: targets are per-image dicts of boxes and
      labels; true: yolo_csp's dense targets for training, and both for
      validation].
    * ``coco_detection`` (:class:`CocoDetection`): ``train_images``,
      ``train_annotations``, ``valid_images``, ``valid_annotations``
      (required), ``image_size`` [null], ``channels`` [3].
    * ``mask_folders`` (:class:`MaskFolderDataset`): ``root`` with
      ``train/images``, ``train/masks``, ``val/images``, ``val/masks``
      (required), ``image_size`` [null], ``channels`` [3].

    Detection and segmentation loaders collate with
    :func:`.transforms.collate` (images stacked, per-image targets in a list
    unless they share one shape).

    Unknown keys or names raise ``ValueError``; missing directories or files
    raise ``FileNotFoundError`` naming the path.
    """
    p = validate_dataset_params(dataset_params)
    train_ds, valid_ds = _build_datasets(p)
    generator = torch.Generator()
    generator.manual_seed(p["seed"])
    # Pinned memory only helps copies to a GPU; without one DataLoader would warn.
    pin = p["pin_memory"] and torch.cuda.is_available()
    from ..distributed.context import env_world
    from ..distributed.sharding import ShardSampler

    kw: Dict[str, Any] = {"collate_fn": collate} if p["name"] in _PAIRED else {}

    rank, world, _ = env_world()
    if world > 1:
        # One process of a distributed run (torchrun): this rank's shard of the training data, reshuffled
        # each epoch by the Trainer's set_epoch; validation on an exact shard (sums added up across ranks).
        from torch.utils.data.distributed import DistributedSampler

        sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=p["shuffle"], seed=p["seed"],
                                     drop_last=p["drop_last"])
        train_loader = DataLoader(train_ds, batch_size=p["batch_size"], sampler=sampler, drop_last=p["drop_last"],
                                  num_workers=p["num_workers"], pin_memory=pin, generator=generator, **kw)
        valid_loader = DataLoader(valid_ds, batch_size=p["valid_batch_size"], drop_last=False,
                                  sampler=ShardSampler(valid_ds, world, rank), num_workers=p["num_workers"],
                                  pin_memory=pin, **kw)
        return train_loader, valid_loader
    train_loader = DataLoader(train_ds, batch_size=p["batch_size"], shuffle=p["shuffle"], drop_last=p["drop_last"],
                              num_workers=p["num_workers"], pin_memory=pin, generator=generator, **kw)
    valid_loader = DataLoader(valid_ds, batch_size=p["valid_batch_size"], shuffle=False, drop_last=False,
                              num_workers=p["num_workers"], pin_memory=pin, **kw)
    return train_loader, valid_loader
