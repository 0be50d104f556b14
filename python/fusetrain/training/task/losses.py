"""Losses by name, and what a loss may return.

``training_params.loss`` names a loss in one of these ways:

* a snake-case alias of a torch.nn loss: :data:`LOSS_ALIASES`
  (``cross_entropy``, ``mse``, ``l1``, ``smooth_l1``, ``bce_with_logits``,
  ``nll``);
* the class name of any ``torch.nn`` loss (``CrossEntropyLoss``,
  ``BCEWithLogitsLoss``, ``HuberLoss``, ...);
* a name registered with :func:`register_loss` (``fusetrain.register_loss``);
* a class path (``mypackage.losses.FocalLoss``);
* ``model``: the model computes its own loss when called with the targets
  (torchvision's detection models in train mode);

with ``loss_params`` as the constructor's keyword arguments; from Python a
callable (an ``nn.Module`` instance or a function) may be given instead.

A loss returns a scalar tensor, ``(loss, {name: component})`` or a dict
with a ``"loss"`` entry (the other entries are components). A model that
computes its own loss may also return a dict of components only (torchvision:
``loss_classifier``, ``loss_box_reg``, ...); the loss is their sum. The
Trainer accumulates every component on the device and logs its epoch mean.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

from .batches import describe, prediction
from .registry import closest_hint, import_path, registrar

__all__ = ["LOSS_ALIASES", "MODEL_LOSS", "LossOutputError", "PredictionLoss", "register_loss", "loss_names",
           "loss_factory", "build_loss", "split_loss", "torch_losses"]

#: Snake-case names of common torch.nn losses (the names of earlier versions).
LOSS_ALIASES: Dict[str, type] = {
    "cross_entropy": nn.CrossEntropyLoss, "mse": nn.MSELoss, "l1": nn.L1Loss, "smooth_l1": nn.SmoothL1Loss,
    "bce_with_logits": nn.BCEWithLogitsLoss, "nll": nn.NLLLoss}
#: Arguments of torch.nn losses that are tensors (a list in a recipe is converted).
_TENSOR_ARGS = ("weight", "pos_weight")
#: ``loss: model``: the model returns its loss when called with the targets.
MODEL_LOSS = "model"
_REGISTERED: Dict[str, Callable[..., Any]] = {}


class LossOutputError(ValueError):
    """A loss returned something that is not a scalar loss (with components)."""


def torch_losses() -> Dict[str, type]:
    """Every public ``torch.nn`` loss class by its name."""
    out = {}
    for name in dir(nn):
        obj = getattr(nn, name)
        if (name.endswith("Loss") and not name.startswith("_") and isinstance(obj, type)
                and issubclass(obj, nn.Module)):
            out[name] = obj
    return out


#: ``register_loss(name, factory=None, *, replace=False)``: name a loss class or
#: factory (``loss_params`` are its keyword arguments) for training params and
#: recipes; usable as a decorator: ``@fusetrain.register_loss("focal")``. The
#: names of torch.nn losses, the aliases and ``model`` cannot be taken.
register_loss = registrar("loss", _REGISTERED, lambda n: n in LOSS_ALIASES or n in torch_losses() or n == MODEL_LOSS)


def loss_names() -> List[str]:
    """Every name ``loss`` accepts (besides class paths)."""
    return list(LOSS_ALIASES) + sorted(torch_losses()) + sorted(_REGISTERED) + [MODEL_LOSS]


def loss_factory(name: str, where: str = "training_params.loss") -> Optional[Callable[..., Any]]:
    """The class or factory a loss name stands for (None for ``model``).
    Raises ``ValueError`` naming the closest valid name."""
    if name == MODEL_LOSS:
        return None
    if name in LOSS_ALIASES:
        return LOSS_ALIASES[name]
    if name in _REGISTERED:
        return _REGISTERED[name]
    found = torch_losses().get(name)
    if found is not None:
        return found
    if "." in name:
        obj = import_path(name, where)
        if not callable(obj):
            raise ValueError(f"{where}: {name!r} is a {type(obj).__name__}, not a loss class or function")
        return obj
    raise ValueError(f"{where}: unknown loss {name!r}; {closest_hint(name, loss_names())}")


class PredictionLoss(nn.Module):
    """A torch.nn loss applied to the model's prediction (NOTE [prediction
    rule] in :mod:`.batches`): ``CrossEntropyLoss`` works on the ``{"out":
    ...}`` of torchvision's segmentation models or on ``(logits, aux)``."""

    def __init__(self, loss: nn.Module) -> None:
        super().__init__()
        self.loss = loss

    def forward(self, outputs: Any, targets: Any) -> Tensor:
        return self.loss(outputs if isinstance(outputs, Tensor) else prediction(outputs), targets)


def build_loss(loss: Any, params: Dict[str, Any]) -> Optional[Callable[..., Any]]:
    """The loss callable for a resolved ``loss`` / ``loss_params`` pair; None
    for ``model``. torch.nn losses named by their class or alias read the
    model's prediction (:class:`PredictionLoss`)."""
    if not isinstance(loss, str):
        return loss
    factory = loss_factory(loss)
    if factory is None:
        return None
    if loss in LOSS_ALIASES or loss in torch_losses():
        # A recipe gives class weights as a list: torch.nn losses take them as tensors.
        params = {k: torch.tensor(v, dtype=torch.float32) if k in _TENSOR_ARGS and isinstance(v, (list, tuple))
                  else v for k, v in params.items()}
        return PredictionLoss(factory(**params))
    return factory(**params)


def split_loss(value: Any, sum_dict: bool = False, where: str = "the loss") -> Tuple[Tensor, Dict[str, Tensor]]:
    """``(loss, components)`` of what a loss (or a model computing its own
    loss, ``sum_dict``) returned; checks that the loss is a scalar tensor.
    Host checks of shapes only: no synchronisation."""
    if isinstance(value, Tensor):
        loss, comps = value, {}
    elif isinstance(value, (tuple, list)) and len(value) == 2 and isinstance(value[1], Mapping):
        loss, comps = value[0], dict(value[1])
    elif isinstance(value, Mapping) and "loss" in value:
        loss, comps = value["loss"], {k: v for k, v in value.items() if k != "loss"}
    elif isinstance(value, Mapping) and sum_dict and value and all(isinstance(v, Tensor) for v in value.values()):
        comps = dict(value)
        loss = sum(comps.values())
    else:
        raise LossOutputError(
            f"{where} must return a scalar tensor, (loss, {{name: component}}) or a dict with a 'loss' entry"
            + (" (or, for a model computing its own loss, a dict of scalar components)" if sum_dict else "")
            + f"; got {describe(value)}")
    if not isinstance(loss, Tensor) or loss.dim() != 0 or not loss.is_floating_point():
        raise LossOutputError(f"{where} must be a scalar floating-point tensor (reduce it, e.g. reduction='mean'); "
                              f"got {describe(loss)}")
    for k, v in comps.items():
        if not isinstance(k, str) or not isinstance(v, Tensor) or v.dim() != 0:
            raise LossOutputError(f"{where}: component {k!r} must be a scalar tensor under a string name; got "
                                  f"{describe(v)}")
    return loss, comps
