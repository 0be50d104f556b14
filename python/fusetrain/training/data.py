"""Datasets and data loaders for the recipes.

* :func:`digits_dataset` -- scikit-learn's 8x8 handwritten digits (1797 images,
  shipped with scikit-learn, so it needs no download), upsampled to 28x28 and
  split 80/20 into train/valid with a fixed permutation.
* :class:`MNISTIdx` -- MNIST read from the standard IDX files
  (``train-images-idx3-ubyte`` ... , optionally gzipped).
* :class:`ImageFolderDataset` -- ``root/<class>/<image>`` folders read with PIL.
* :func:`build_dataloaders` -- the ``dataset_params`` mapping of a recipe turned
  into ``(train_loader, valid_loader)``.

Every dataset yields ``(image, label)`` with ``image`` a float32 ``[C, H, W]``
tensor in ``[0, 1]`` and ``label`` an int64 class index.
"""

from __future__ import annotations

import gzip
import os
import warnings
from functools import lru_cache
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, TensorDataset

__all__ = ["DATASET_NAMES", "DIGITS_SPLIT_SEED", "DIGITS_TRAIN_FRACTION", "IMAGE_EXTENSIONS", "ImageFolderDataset",
           "MNISTIdx", "build_dataloaders", "digits_dataset", "read_idx", "validate_dataset_params"]

# ---- scikit-learn digits --------------------------------------------------------------------------------------

#: Seed of the fixed permutation that splits the digits into train and valid.
DIGITS_SPLIT_SEED = 0
#: Fraction of the 1797 digits that goes to the train split (1438 train, 359 valid).
DIGITS_TRAIN_FRACTION = 0.8


@lru_cache(maxsize=4)
def _digits_tensors(size: int) -> Tuple[Tensor, Tensor, np.ndarray]:
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("digits_dataset needs scikit-learn (pip install scikit-learn)") from exc
    digits = load_digits()
    # Pixel values are integers in [0, 16].
    images = torch.from_numpy(np.asarray(digits.images, dtype=np.float32) / 16.0).unsqueeze(1)
    if size != images.shape[-1]:
        images = F.interpolate(images, size=(size, size), mode="bilinear", align_corners=False)
    images = images.clamp_(0.0, 1.0).contiguous()
    labels = torch.from_numpy(np.asarray(digits.target, dtype=np.int64))
    # numpy's legacy RandomState stream is frozen across numpy versions, so the
    # split is the same everywhere.
    perm = np.random.RandomState(DIGITS_SPLIT_SEED).permutation(images.shape[0])
    return images, labels, perm


def digits_dataset(train: bool, size: int = 28) -> TensorDataset:
    """scikit-learn's handwritten digits as a ``TensorDataset`` of
    (float32 ``[N, 1, size, size]`` in [0, 1], int64 labels in 0..9).

    The 8x8 images are scaled from [0, 16] to [0, 1] and upsampled with bilinear
    interpolation. ``train=True`` returns the 1438-image train split,
    ``train=False`` the 359-image valid split; the split is a fixed permutation
    (seed :data:`DIGITS_SPLIT_SEED`), identical on every run and machine.
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"digits_dataset: size must be an int >= 1, got {size!r}")
    images, labels, perm = _digits_tensors(size)
    n_train = int(round(DIGITS_TRAIN_FRACTION * images.shape[0]))
    idx = torch.from_numpy(np.sort(perm[:n_train] if train else perm[n_train:]))
    # Indexing copies, so callers may modify the tensors freely.
    return TensorDataset(images[idx], labels[idx])


# ---- MNIST IDX files ------------------------------------------------------------------------------------------

_IDX_DTYPES = {0x08: np.dtype(np.uint8), 0x09: np.dtype(np.int8), 0x0B: np.dtype(">i2"), 0x0C: np.dtype(">i4"),
               0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8")}


def read_idx(path: str) -> np.ndarray:
    """Read one IDX file (``.gz`` is decompressed) into a numpy array.

    Raises ``FileNotFoundError`` if ``path`` does not exist and ``ValueError``
    naming the file if the magic number, the dimensions or the size are wrong.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"IDX file not found: {path}")
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            data = f.read()
    except (OSError, EOFError) as exc:  # e.g. a truncated or non-gzip .gz file
        raise ValueError(f"{path}: cannot read the file ({exc})") from exc
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] not in _IDX_DTYPES:
        raise ValueError(f"{path}: not an IDX file (bad magic number {data[:4].hex() or '<empty>'}; expected "
                         "00 00 <type code> <ndim>, e.g. 00000803 for images, 00000801 for labels)")
    dtype = _IDX_DTYPES[data[2]]
    ndim = data[3]
    header = 4 + 4 * ndim
    if ndim == 0:
        raise ValueError(f"{path}: IDX header declares 0 dimensions")
    if len(data) < header:
        raise ValueError(f"{path}: truncated IDX header (ndim={ndim} needs {header} bytes, file has {len(data)})")
    dims = tuple(int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim))
    expected = header + int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
    if len(data) != expected:
        raise ValueError(f"{path}: IDX size mismatch: header says shape {dims} ({expected} bytes with the header) "
                         f"but the file has {len(data)} bytes")
    arr = np.frombuffer(data, dtype=dtype, offset=header).reshape(dims)
    return arr.astype(dtype.newbyteorder("="), copy=True)


class MNISTIdx(Dataset):
    """MNIST from the standard IDX files in ``root``.

    Looks for ``train-images-idx3-ubyte`` / ``train-labels-idx1-ubyte``
    (``train=True``) or ``t10k-images-idx3-ubyte`` / ``t10k-labels-idx1-ubyte``
    (``train=False``), each optionally gzipped (``.gz``) and also accepted with
    a dot before ``idx`` (``train-images.idx3-ubyte``). Besides ``root`` itself,
    ``root/MNIST/raw`` (torchvision's download layout) is searched.

    Items are (float32 ``[1, 28, 28]`` in [0, 1], int64 label); ``transform``,
    if given, is applied to the image tensor.
    """

    _STEMS = {True: "train", False: "t10k"}

    def __init__(self, root: str, train: bool = True, transform: Optional[Callable[[Tensor], Any]] = None) -> None:
        if not root:
            raise ValueError("MNISTIdx: root must be the directory holding the MNIST IDX files, got "
                             f"{root!r}")
        root = os.path.expanduser(str(root))
        if not os.path.isdir(root):
            raise FileNotFoundError(f"MNISTIdx: MNIST directory not found: {root} (expected a directory holding "
                                    f"{self.expected_files(train)[0]} and {self.expected_files(train)[1]})")
        self.root = root
        self.train = bool(train)
        self.transform = transform
        images_path = self._find(root, self.expected_files(train)[0])
        labels_path = self._find(root, self.expected_files(train)[1])
        images = read_idx(images_path)
        labels = read_idx(labels_path)
        if images.ndim != 3:
            raise ValueError(f"{images_path}: expected a 3-d image array [N, rows, cols], got shape {images.shape}")
        if labels.ndim != 1:
            raise ValueError(f"{labels_path}: expected a 1-d label array [N], got shape {labels.shape}")
        if images.dtype != np.uint8 or labels.dtype != np.uint8:
            raise ValueError(f"MNISTIdx: expected unsigned byte IDX files, got {images.dtype} images "
                             f"({images_path}) and {labels.dtype} labels ({labels_path})")
        if images.shape[0] != labels.shape[0]:
            raise ValueError(f"MNISTIdx: {images_path} holds {images.shape[0]} images but {labels_path} holds "
                             f"{labels.shape[0]} labels")
        self.images_path, self.labels_path = images_path, labels_path
        self.images = torch.from_numpy(images)          # uint8 [N, rows, cols]
        self.targets = torch.from_numpy(labels.astype(np.int64))

    @classmethod
    def expected_files(cls, train: bool) -> Tuple[str, str]:
        stem = cls._STEMS[bool(train)]
        return f"{stem}-images-idx3-ubyte", f"{stem}-labels-idx1-ubyte"

    @staticmethod
    def _find(root: str, name: str) -> str:
        dotted = name.replace("-idx", ".idx")
        dirs = [root, os.path.join(root, "MNIST", "raw")]
        for d in dirs:
            for candidate in (name, name + ".gz", dotted, dotted + ".gz"):
                path = os.path.join(d, candidate)
                if os.path.isfile(path):
                    return path
        raise FileNotFoundError(f"MNISTIdx: {name} (or {name}.gz) not found in {root}"
                                + (" or its MNIST/raw subfolder" if len(dirs) > 1 else ""))

    def __len__(self) -> int:
        return self.images.shape[0]

    def __getitem__(self, index: int):
        image = self.images[index].unsqueeze(0).to(torch.float32).div_(255.0)
        if self.transform is not None:
            image = self.transform(image)
        return image, self.targets[index]


# ---- image folders --------------------------------------------------------------------------------------------

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".ppm", ".pgm", ".tif", ".tiff", ".webp")


class ImageFolderDataset(Dataset):
    """Images in ``root/<class name>/<file>`` folders, decoded with PIL.

    Classes are the sub-folders of ``root`` in sorted order (``classes``,
    ``class_to_idx``); files are those with an extension in
    :data:`IMAGE_EXTENSIONS` (case-insensitive), sorted. Items are
    (float32 ``[channels, H, W]`` in [0, 1], int64 label). ``channels`` is 3
    (RGB) or 1 (grayscale); ``image_size`` (int) resizes every image to
    ``image_size x image_size`` (bilinear), otherwise images keep their size
    and must all have the same size to be batched. ``transform``, if given, is
    applied to the image tensor.
    """

    def __init__(self, root: str, transform: Optional[Callable[[Tensor], Any]] = None, channels: int = 3,
                 image_size: Optional[int] = None) -> None:
        if not root:
            raise ValueError(f"ImageFolderDataset: root must be a directory of class folders, got {root!r}")
        root = os.path.expanduser(str(root))
        if not os.path.isdir(root):
            raise FileNotFoundError(f"ImageFolderDataset: directory not found: {root} (expected "
                                    "root/<class name>/<image file>)")
        if channels not in (1, 3):
            raise ValueError(f"ImageFolderDataset: channels must be 1 or 3, got {channels!r}")
        if image_size is not None and (isinstance(image_size, bool) or not isinstance(image_size, int)
                                       or image_size < 1):
            raise ValueError(f"ImageFolderDataset: image_size must be an int >= 1 or None, got {image_size!r}")
        self.root = root
        self.transform = transform
        self.channels = channels
        self.image_size = image_size
        self.classes: List[str] = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
        if not self.classes:
            raise ValueError(f"ImageFolderDataset: {root} has no class sub-folders (expected "
                             "root/<class name>/<image file>)")
        self.class_to_idx: Dict[str, int] = {c: i for i, c in enumerate(self.classes)}
        self.samples: List[Tuple[str, int]] = []
        empty = []
        for cls in self.classes:
            folder = os.path.join(root, cls)
            files = sorted(e.name for e in os.scandir(folder)
                           if e.is_file() and os.path.splitext(e.name)[1].lower() in IMAGE_EXTENSIONS)
            if not files:
                empty.append(cls)
            self.samples.extend((os.path.join(folder, f), self.class_to_idx[cls]) for f in files)
        if empty:
            raise ValueError(f"ImageFolderDataset: class folder(s) {empty} under {root} hold no image files "
                             f"(extensions {', '.join(IMAGE_EXTENSIONS)})")
        self.targets = [label for _, label in self.samples]

    def __len__(self) -> int:
        return len(self.samples)

    def _load(self, path: str) -> Tensor:
        try:
            from PIL import Image
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError("ImageFolderDataset needs Pillow to decode images (pip install pillow)") from exc
        try:
            with Image.open(path) as img:
                img = img.convert("RGB" if self.channels == 3 else "L")
                if self.image_size is not None and img.size != (self.image_size, self.image_size):
                    img = img.resize((self.image_size, self.image_size), Image.BILINEAR)
                arr = np.array(img, dtype=np.uint8)
        except OSError as exc:
            raise ValueError(f"ImageFolderDataset: cannot decode image {path} ({exc})") from exc
        t = torch.from_numpy(arr)
        t = t.unsqueeze(0) if t.ndim == 2 else t.permute(2, 0, 1)
        return t.contiguous().to(torch.float32).div_(255.0)

    def __getitem__(self, index: int):
        path, label = self.samples[index]
        image = self._load(path)
        if self.transform is not None:
            image = self.transform(image)
        return image, torch.tensor(label, dtype=torch.int64)


# ---- dataset_params -> loaders --------------------------------------------------------------------------------

#: Names accepted by ``dataset_params.name``.
DATASET_NAMES = ("digits", "mnist", "image_folder")

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
    if name == "image_folder" and "root" not in params:
        raise ValueError("dataset_params.root is required for the 'image_folder' dataset: a directory with "
                         "train/ and val/ sub-folders of class folders")
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
                warnings.warn("dataset_params.root is not set for 'mnist': using the embedded scikit-learn digits "
                              "resized to 28x28 instead of MNIST (1438 train / 359 valid images); set "
                              "dataset_params.root=/path/to/mnist to train on MNIST's IDX files", UserWarning,
                              stacklevel=3)
            return digits_dataset(True, 28), digits_dataset(False, 28)
        return MNISTIdx(str(root), train=True), MNISTIdx(str(root), train=False)
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


def build_dataloaders(dataset_params: Mapping[str, Any]) -> Tuple[DataLoader, DataLoader]:
    """Build ``(train_loader, valid_loader)`` from a recipe's ``dataset_params``.

    Keys (defaults in brackets):

    * ``name``: ``"digits"`` | ``"mnist"`` | ``"image_folder"`` (required).
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

    Unknown keys or names raise ``ValueError``; missing directories or files
    raise ``FileNotFoundError`` naming the path.
    """
    p = validate_dataset_params(dataset_params)
    train_ds, valid_ds = _build_datasets(p)
    generator = torch.Generator()
    generator.manual_seed(p["seed"])
    # Pinned memory only helps copies to a GPU; without one DataLoader would warn.
    pin = p["pin_memory"] and torch.cuda.is_available()
    from .distributed import ShardSampler, env_world

    rank, world, _ = env_world()
    if world > 1:
        # One process of a distributed run (torchrun): this rank's shard of the training data, reshuffled
        # each epoch by the Trainer's set_epoch; validation on an exact shard (sums added up across ranks).
        from torch.utils.data.distributed import DistributedSampler

        sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=p["shuffle"], seed=p["seed"],
                                     drop_last=p["drop_last"])
        train_loader = DataLoader(train_ds, batch_size=p["batch_size"], sampler=sampler, drop_last=p["drop_last"],
                                  num_workers=p["num_workers"], pin_memory=pin, generator=generator)
        valid_loader = DataLoader(valid_ds, batch_size=p["valid_batch_size"], drop_last=False,
                                  sampler=ShardSampler(valid_ds, world, rank), num_workers=p["num_workers"],
                                  pin_memory=pin)
        return train_loader, valid_loader
    train_loader = DataLoader(train_ds, batch_size=p["batch_size"], shuffle=p["shuffle"], drop_last=p["drop_last"],
                              num_workers=p["num_workers"], pin_memory=pin, generator=generator)
    valid_loader = DataLoader(valid_ds, batch_size=p["valid_batch_size"], shuffle=False, drop_last=False,
                              num_workers=p["num_workers"], pin_memory=pin)
    return train_loader, valid_loader
