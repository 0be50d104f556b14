"""Models the recipes and benchmarks use, built by name: ``build_model(name, **arch_params)``.

Classification (:mod:`.classification`):

* ``digits_cnn``: a small CNN (three conv-BN-ReLU stages, global average
  pooling, one linear layer) for 28x28 digits; about 94k parameters.
* ``seed_mnist``: the 14-convolution + 3-linear network of the mixed-precision
  MNIST experiment (the benchmark model of the seed recipes); layer for layer
  and parameter name for parameter name the same network (``features``,
  ``avgpool``, ``classifier``).
* ``cifar_resnet``: a CIFAR-style ResNet (ResNet-20 by default) for 32x32
  inputs: 3x3 stem, three stages of basic blocks with 16/32/64 channels,
  global average pooling, linear classifier.

Segmentation (:mod:`.segmentation`), logits ``[B, num_classes, H, W]``:

* ``pplite_seg``: a PP-LiteSeg-style net: STDC backbone (concatenated
  multi-scale blocks), SPPM context, UAFM attention-fusion decoder.
* ``ddrnet``: a DDRNet-style net: a 1/8 high-resolution branch and a
  1/16-1/64 low-resolution branch with bilateral fusion, DAPPM-lite context.

Detection (:mod:`.detection`):

* ``yolo_csp``: a small YOLO-style detector: CSP backbone + SPPF, PAN neck,
  dense anchor-free head; trained with :class:`DenseDetectionLoss` against
  :func:`dense_detection_targets`; in eval mode it also returns decoded boxes.

The segmentation and detection models take a ``width`` (channels of the first
stage) so that they can be trained at reduced width and resolution.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, Sequence

from torch import nn

from .classification import SEED_MNIST_CFG, BasicBlock, CifarResNet, DigitsCNN, ResidualBlock, SeedMNISTNet
from .detection import (DenseDetectionLoss, YoloCSP, decode_dense_detections, dense_detection_points,
                        dense_detection_targets)
from .segmentation import DDRNet, PPLiteSeg, STDCBlock

__all__ = ["MODEL_NAMES", "SEED_MNIST_CFG", "BasicBlock", "CifarResNet", "DDRNet", "DenseDetectionLoss", "DigitsCNN",
           "PPLiteSeg", "ResidualBlock", "STDCBlock", "SeedMNISTNet", "YoloCSP", "build_model", "check_arch_params",
           "decode_dense_detections", "dense_detection_points", "dense_detection_targets", "model_kwargs"]

_REGISTRY: Dict[str, Callable[..., nn.Module]] = {
    "digits_cnn": DigitsCNN,
    "seed_mnist": SeedMNISTNet,
    "cifar_resnet": CifarResNet,
    "pplite_seg": PPLiteSeg,
    "ddrnet": DDRNet,
    "yolo_csp": YoloCSP,
}

#: Names accepted by :func:`build_model`.
MODEL_NAMES = tuple(sorted(_REGISTRY))


def model_kwargs(name: str) -> Sequence[str]:
    """The keyword arguments that ``build_model(name, ...)`` accepts."""
    _check_name(name)
    return tuple(p for p in inspect.signature(_REGISTRY[name]).parameters if p != "self")


def _check_name(name: Any) -> None:
    if name not in _REGISTRY:
        raise ValueError(f"arch_params.name: unknown model {name!r}; allowed: " + ", ".join(MODEL_NAMES))


def check_arch_params(name: str, arch_params: Dict[str, Any]) -> None:
    """Raise ``ValueError`` if ``name`` is not a model or ``arch_params`` holds a
    keyword its constructor does not take (builds nothing)."""
    allowed = model_kwargs(name)
    for key in arch_params:
        if key not in allowed:
            raise ValueError(f"arch_params: unknown key {key!r} for model {name!r}; allowed keys: name, "
                             + ", ".join(allowed))


def build_model(name: str, **arch_params: Any) -> nn.Module:
    """Build a registered model by name (see :data:`MODEL_NAMES`).

    ``digits_cnn(num_classes=10, in_channels=1, width=32, dropout=0.0)``,
    ``seed_mnist(num_classes=10, in_channels=1)``,
    ``cifar_resnet(depth=20, num_classes=10, in_channels=3, width=16)``,
    ``pplite_seg(num_classes=19, in_channels=3, width=16, blocks_per_stage=(2, 2, 2))``,
    ``ddrnet(num_classes=19, in_channels=3, width=16, layers=(2, 2, 2, 2))``,
    ``yolo_csp(num_classes=20, in_channels=3, width=16, depth=1, score_threshold=0.05, iou_threshold=0.6,
    max_detections=100)``.
    An unknown name or keyword raises ``ValueError`` listing what is allowed.
    """
    check_arch_params(name, arch_params)
    return _REGISTRY[name](**arch_params)
