"""Datasets and data loaders for the recipes.

Classification (:mod:`.classification`; items ``(image, label)``):

* :func:`digits_dataset` -- scikit-learn's 8x8 handwritten digits (1797 images,
  shipped with scikit-learn, so it needs no download), upsampled to 28x28 and
  split 80/20 into train/valid with a fixed permutation.
* :class:`MNISTIdx` -- MNIST read from the standard IDX files
  (``train-images-idx3-ubyte`` ... , optionally gzipped).
* :class:`ImageFolderDataset` -- ``root/<class>/<image>`` folders read with PIL.

Detection and segmentation:

* :class:`DigitCanvas` (:mod:`.canvas`) -- the digits placed on canvases,
  with per-image boxes and labels or per-pixel class masks (no download).
* :class:`CocoDetection`, :class:`MaskFolderDataset` (:mod:`.formats`) --
  COCO-style JSON annotations and image/mask folder pairs.
* :mod:`.transforms` -- transforms that keep boxes and masks aligned with
  the image, and the collate function of these loaders.

:func:`build_dataloaders` turns the ``dataset_params`` mapping of a recipe
into ``(train_loader, valid_loader)``. Images are float32 ``[C, H, W]``
tensors in ``[0, 1]``.
"""

from .canvas import DigitCanvas
from .classification import (DIGITS_SPLIT_SEED, DIGITS_TRAIN_FRACTION, ImageFolderDataset, MNISTIdx, digits_dataset,
                             read_idx)
from .formats import CocoDetection, MaskFolderDataset, export_coco, export_mask_folders
from .images import IMAGE_EXTENSIONS
from .loaders import DATASET_NAMES, build_dataloaders, validate_dataset_params

__all__ = ["DATASET_NAMES", "DIGITS_SPLIT_SEED", "DIGITS_TRAIN_FRACTION", "IMAGE_EXTENSIONS", "CocoDetection",
           "DigitCanvas", "ImageFolderDataset", "MNISTIdx", "MaskFolderDataset", "build_dataloaders",
           "digits_dataset", "export_coco", "export_mask_folders", "read_idx", "validate_dataset_params"]
