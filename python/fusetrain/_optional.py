"""Optional dependencies: which extra of ``pyproject.toml`` brings each one.

fusetrain itself needs torch and numpy; a feature that needs more (the Hydra
recipes, a shipped dataset, COCO metrics, ONNX export, plots) imports its
package through :func:`require`, so that a missing one is an ``ImportError``
naming the feature and the ``pip install`` that brings it, instead of a bare
``No module named ...``. ``tests/python/project/test_install_extras.py``
checks that each entry names an extra that really lists its package."""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["EXTRAS", "MissingExtra", "require", "install_hint"]

#: top-level module -> (the pip package that provides it, the fusetrain extra that lists that package)
EXTRAS = {
    "hydra": ("hydra-core", "recipes"),
    "omegaconf": ("hydra-core", "recipes"),
    "yaml": ("hydra-core", "recipes"),
    "sklearn": ("scikit-learn", "recipes"),
    "PIL": ("pillow", "recipes"),
    "torchmetrics": ("torchmetrics", "detection"),
    "pycocotools": ("pycocotools", "detection"),
    "torchvision": ("torchvision", "detection"),
    "matplotlib": ("matplotlib", "logging"),
    "tqdm": ("tqdm", "logging"),
    "tensorboard": ("tensorboard", "logging"),
    "onnx": ("onnx", "export"),
    "onnxscript": ("onnxscript", "export"),
    "onnxruntime": ("onnxruntime", "export"),
}


class MissingExtra(ImportError):
    """An optional package is missing; the message names the extra that brings it."""


def install_hint(module: str) -> str:
    """``pip install 'fusetrain[<extra>]'`` (or the package) for a top-level module."""
    package, extra = EXTRAS[module.split(".")[0]]
    return f"pip install 'fusetrain[{extra}]' (or pip install {package})"


def require(module: str, purpose: str) -> ModuleType:
    """Import ``module`` (a dotted name is fine) for ``purpose`` (e.g. "the recipes"); a missing
    package raises ``ImportError`` naming the purpose, the package and the extra."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        top = module.split(".")[0]
        package = EXTRAS[top][0]
        raise MissingExtra(f"{purpose} needs {package}, which is not installed ({type(exc).__name__}: {exc}); "
                          f"install it with {install_hint(top)}") from exc
