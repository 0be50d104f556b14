"""fusetrain: PyTorch training whose per-step tail (unscale, non-finite check,
clipping, optimizer update, EMA) runs as fused C++/CUDA kernels with no
host-device synchronisation."""

import torch  # noqa: F401  (loads libtorch before the native core)

from ._torch_check import load_native as _load_native

_load_native()  # loads _C; a clear ImportError when it was built against another torch
from . import _ops  # registers the fake kernels of the native ops
from . import nn, optim
from ._ops import build_info
from .amp import LossScaler, Precision, resolve_precision
from .ema import ModelEMA, unwrap_model
from .training.task.callbacks import Callback, TrainerState, register_callback
from .training.task.losses import register_loss
from .training.task.metrics import register_metric
from .training.step.train_step import TrainStep
from .training.trainer import Trainer

__version__ = "0.1.0"


def _cmake_prefix_path() -> str:
    # The CMake package (include/, lib/cmake/fusetrain) is installed next to the
    # native libraries, which is the package dir of a regular install and the
    # build's install dir of an editable one.
    import importlib.util
    import os

    spec = importlib.util.find_spec("fusetrain._C")
    if spec is not None and spec.origin:
        return os.path.dirname(os.path.abspath(spec.origin))
    return os.path.dirname(os.path.abspath(__file__))


#: Prefix for CMake's CMAKE_PREFIX_PATH: ``find_package(fusetrain CONFIG)`` then
#: gives the imported target ``fusetrain::core`` (C++ API, see docs/cpp.md).
cmake_prefix_path: str = _cmake_prefix_path()

__all__ = ["nn", "optim", "build_info", "Trainer", "TrainStep", "Callback", "TrainerState", "register_loss",
           "register_metric", "register_callback", "LossScaler", "Precision", "resolve_precision", "ModelEMA",
           "unwrap_model", "cmake_prefix_path", "__version__"]
