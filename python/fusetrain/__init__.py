"""fusetrain: PyTorch training whose per-step tail (unscale, non-finite check,
clipping, optimizer update, EMA) runs as fused C++/CUDA kernels with no
host-device synchronisation."""

import torch  # noqa: F401  (loads libtorch before the native core)

from . import _ops  # registers the fake kernels of the native ops
from . import optim
from ._ops import build_info
from .amp import LossScaler, Precision, resolve_precision
from .ema import ModelEMA, unwrap_model
from .training.trainer import Trainer

__version__ = "0.1.0"

__all__ = ["optim", "build_info", "Trainer", "LossScaler", "Precision", "resolve_precision", "ModelEMA", "unwrap_model",
           "__version__"]
