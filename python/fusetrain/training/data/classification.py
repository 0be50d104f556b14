"""Classification datasets: scikit-learn's digits, MNIST's IDX files and
image folders. Items are ``(image, label)``: a float32 ``[C, H, W]`` tensor in
``[0, 1]`` and an int64 class index."""

from __future__ import annotations

import gzip
import os
from functools import lru_cache
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import Dataset, TensorDataset

from .images import IMAGE_EXTENSIONS, read_image

__all__ = ["DIGITS_SPLIT_SEED", "DIGITS_TRAIN_FRACTION", "ImageFolderDataset", "MNISTIdx", "digits_dataset",
           "digits_split", "read_idx"]

# ---- scikit-learn digits --------------------------------------------------------------------------------------

#: Seed of the fixed permutation that splits the digits into train and valid.
DIGITS_SPLIT_SEED = 0
#: Fraction of the 1797 digits that goes to the train split (1438 train, 359 valid).
DIGITS_TRAIN_FRACTION = 0.8


#: The 1797 digits: 64 pixel values (integers in 0..16) and the label per row.
_DIGITS_SHAPE = (1797, 65)


def _digits_arrays() -> Tuple[np.ndarray, np.ndarray]:
    """The digits' images (float64 ``[1797, 8, 8]``, values 0..16) and labels (int64)."""
    # NOTE [digits without importing scikit-learn]: `import sklearn` imports
    # scipy and takes about 3 s of CPU, the largest part of a small run's start
    # (every process of a torchrun job pays it). The digits are one CSV file in
    # scikit-learn's package, read here the way load_digits reads it (np.loadtxt
    # of the gzipped rows: 64 pixels, then the label); without that file (another
    # layout of the package) load_digits itself reads them.
    import importlib.util

    from ..._optional import require

    spec = importlib.util.find_spec("sklearn")  # None without scikit-learn; imports nothing
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    path = os.path.join(roots[0], "datasets", "data", "digits.csv.gz") if roots else ""
    rows = None
    if path and os.path.isfile(path):
        with gzip.open(path, "rt", encoding="utf-8") as f:
            rows = np.loadtxt(f, delimiter=",")
    if rows is None or rows.shape != _DIGITS_SHAPE:
        # Without scikit-learn, require raises an error naming the extra that brings it.
        digits = require("sklearn.datasets", "the digits dataset").load_digits()
        return np.asarray(digits.images, dtype=np.float64), np.asarray(digits.target, dtype=np.int64)
    return rows[:, :-1].reshape(-1, 8, 8), rows[:, -1].astype(np.int64)


@lru_cache(maxsize=4)
def _digits_tensors(size: int) -> Tuple[Tensor, Tensor, np.ndarray]:
    pixels, targets = _digits_arrays()
    # Pixel values are integers in [0, 16].
    images = torch.from_numpy(np.asarray(pixels, dtype=np.float32) / 16.0).unsqueeze(1)
    if size != images.shape[-1]:
        images = F.interpolate(images, size=(size, size), mode="bilinear", align_corners=False)
    images = images.clamp_(0.0, 1.0).contiguous()
    labels = torch.from_numpy(np.asarray(targets, dtype=np.int64))
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
    return TensorDataset(*digits_split(train, size))


def digits_split(train: bool, size: int = 8) -> Tuple[Tensor, Tensor]:
    """The images ([N, 1, size, size] float32 in [0, 1]) and labels of the
    digits' train or valid split (copies: callers may modify them)."""
    images, labels, perm = _digits_tensors(size)
    n_train = int(round(DIGITS_TRAIN_FRACTION * images.shape[0]))
    idx = torch.from_numpy(np.sort(perm[:n_train] if train else perm[n_train:]))
    return images[idx], labels[idx]


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

    def __getitem__(self, index: int):
        path, label = self.samples[index]
        size = None if self.image_size is None else (self.image_size, self.image_size)
        image = read_image(path, self.channels, size, "ImageFolderDataset")
        if self.transform is not None:
            image = self.transform(image)
        return image, torch.tensor(label, dtype=torch.int64)
