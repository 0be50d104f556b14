"""Batches of any structure: moving them to the device, splitting them into
inputs and targets, calling the model, and describing them in messages.

The rules (docs/guides/custom_task.md shows them at work):

* **Splitting** (``split_batch``): a tuple or list batch is ``(inputs,
  targets, *extras)``; a dict batch's targets are the entry under the first of
  :data:`TARGET_KEYS` it has, its inputs the other entries (the value itself
  when only one is left). Extras are not used by the loop; callbacks see them
  (``state.batch``). ``training_params.split_batch`` replaces the rule with
  a function ``batch -> (inputs, targets)``.
* **Calling the model** (``model_input``): ``auto`` calls ``model(**inputs)``
  for a dict and ``model(inputs)`` for anything else (a tensor, a list of
  images as torchvision's detection models take, a tuple); ``unpack`` calls
  ``model(*inputs)`` for a tuple or list and ``model(**inputs)`` for a dict;
  ``whole`` always ``model(inputs)``; a function ``fn(model, inputs)`` does
  it itself. A model that computes its own loss (``loss: model``) gets the
  targets too: ``model(inputs, targets)``, ``model(*inputs, targets)``,
  ``model(**inputs, targets=targets)`` or ``fn(model, inputs, targets)``.
* **The prediction** (NOTE [prediction rule]): losses built from a name and
  the classification and segmentation metrics read the model's prediction:
  the output itself when it is a tensor, its ``"out"`` or ``"logits"`` entry
  when it is a dict (torchvision's segmentation models return ``{"out": ...,
  "aux": ...}``), its first item when it is a tuple or list of tensors.
* **Counting samples** (for sample-weighted means): the first dimension of
  the inputs (of their first tensor when they are unpacked or a dict), or the
  length of a list or tuple passed whole (one tensor per image).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Optional, Tuple, Union

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

__all__ = ["TARGET_KEYS", "MODEL_INPUT_MODES", "BatchError", "to_device", "split_batch", "call_model", "prediction",
           "count_samples", "describe", "Signature", "signature", "detach", "to_channels_last", "empty_like_tree",
           "copy_into"]

#: Keys looked up, in this order, for the targets of a dict batch.
TARGET_KEYS = ("targets", "target", "labels", "label", "masks", "mask", "y")
MODEL_INPUT_MODES = ("auto", "unpack", "whole")


class BatchError(ValueError):
    """A batch the Trainer cannot split into inputs and targets."""


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor leaf on ``device`` (non-blocking copies);
    containers (tuple, list, dict, named tuple) keep their type."""
    if isinstance(batch, Tensor):
        return batch.to(device, non_blocking=True)
    if type(batch) in (tuple, list) and all(isinstance(b, Tensor) for b in batch):  # the common (x, y)
        return type(batch)(b.to(device, non_blocking=True) for b in batch)
    return pytree.tree_map(lambda t: t.to(device, non_blocking=True) if isinstance(t, Tensor) else t, batch)


def split_batch(batch: Any, fn: Optional[Callable[[Any], Any]] = None) -> Tuple[Any, Any, Tuple[Any, ...]]:
    """``(inputs, targets, extras)`` of a batch by the rule in the module
    docstring, or by ``fn``. Raises :class:`BatchError` describing the batch."""
    if fn is not None:
        res = fn(batch)
        if not isinstance(res, (tuple, list)) or len(res) not in (2, 3):
            raise BatchError(f"training_params.split_batch must return (inputs, targets), got {describe(res)}")
        return res[0], res[1], tuple(res[2]) if len(res) == 3 else ()
    if isinstance(batch, (tuple, list)) and len(batch) >= 2:
        return batch[0], batch[1], tuple(batch[2:])
    if isinstance(batch, Mapping):
        for key in TARGET_KEYS:
            if key in batch:
                rest = {k: v for k, v in batch.items() if k != key}
                if rest:
                    inputs = next(iter(rest.values())) if len(rest) == 1 else rest
                    return inputs, batch[key], ()
    raise BatchError(
        f"cannot split a training batch into inputs and targets: got {describe(batch)}. A batch must be "
        f"(inputs, targets, *extras) or a dict with a targets entry under one of {list(TARGET_KEYS)} and at "
        f"least one other entry; otherwise set training_params.split_batch to a function batch -> (inputs, targets)")


def call_model(model: Callable[..., Any], inputs: Any, mode: Union[str, Callable[..., Any]],
               targets: Any = None, with_targets: bool = False) -> Any:
    """The model's outputs for ``inputs`` (NOTE in the module docstring);
    with ``with_targets`` the targets are passed too (a model that computes
    its own loss)."""
    if callable(mode):
        return mode(model, inputs, targets) if with_targets else mode(model, inputs)
    if isinstance(inputs, Mapping) and mode != "whole":
        return model(**inputs, targets=targets) if with_targets else model(**inputs)
    if mode == "unpack" and isinstance(inputs, (tuple, list)):
        return model(*inputs, targets) if with_targets else model(*inputs)
    return model(inputs, targets) if with_targets else model(inputs)


def prediction(outputs: Any) -> Tensor:
    """The tensor of scores in a model's outputs (NOTE [prediction rule])."""
    if isinstance(outputs, Tensor):
        return outputs
    if isinstance(outputs, Mapping):
        for key in ("out", "logits"):
            if isinstance(outputs.get(key), Tensor):
                return outputs[key]
    elif isinstance(outputs, (list, tuple)) and outputs and isinstance(outputs[0], Tensor):
        return outputs[0]
    raise ValueError(f"it needs a tensor of scores [N, C, ...]: the output itself, a dict's 'out' or 'logits' "
                     f"entry, or the first item of a tuple of tensors; got {describe(outputs)}")


def count_samples(inputs: Any, mode: Union[str, Callable[..., Any]]) -> int:
    """The number of samples in ``inputs`` (a host int from shapes, no sync)."""
    if isinstance(inputs, Tensor):
        return int(inputs.shape[0]) if inputs.dim() else 1
    if isinstance(inputs, (tuple, list)):
        if not inputs:
            return 0
        if mode == "unpack" or callable(mode):
            return count_samples(inputs[0], mode)
        return len(inputs)
    if isinstance(inputs, Mapping) and inputs:
        return count_samples(next(iter(inputs.values())), "unpack")
    return 1


def describe(obj: Any, depth: int = 0) -> str:
    """A short description of a structure for messages: ``Tensor[8, 3, 64, 64]
    float32``, ``list of 8 dict{boxes: Tensor[2, 4] float32, ...}``."""
    if isinstance(obj, Tensor):
        return f"Tensor{list(obj.shape)} {str(obj.dtype).replace('torch.', '')}"
    if depth >= 3:
        return type(obj).__name__
    if isinstance(obj, Mapping):
        items = list(obj.items())
        body = ", ".join(f"{k}: {describe(v, depth + 1)}" for k, v in items[:6])
        return f"dict{{{body}{', ...' if len(items) > 6 else ''}}}"
    if isinstance(obj, (tuple, list)):
        kind = type(obj).__name__
        if len(obj) > 4 and all(type(o) is type(obj[0]) for o in obj):
            return f"{kind} of {len(obj)} {describe(obj[0], depth + 1)}"
        return f"{kind}({', '.join(describe(o, depth + 1) for o in obj)})"
    text = repr(obj)
    return f"{type(obj).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


# ---- signatures (what a compiled or captured step was built for) ------------------------------------------------

_PAIR = "tensor pair"  # the spec of an (inputs, targets) pair of tensors (flattened without pytree)


class Signature:
    """The structure of a step's ``(inputs, targets)`` and, per leaf, (shape,
    dtype, device) for a tensor or the value for anything else (a captured
    graph bakes such values in)."""

    __slots__ = ("spec", "leaves")

    def __init__(self, spec: Any, leaves: Tuple[Any, ...]) -> None:
        self.spec, self.leaves = spec, leaves

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Signature) and self.leaves == other.leaves and self.spec == other.spec

    def _first_dim(self) -> Optional[int]:
        firsts = {leaf[0][0] if len(leaf[0]) else None for leaf in self.leaves if _is_tensor_meta(leaf)}
        return next(iter(firsts)) if len(firsts) == 1 else None

    def partial_of(self, full: "Signature") -> bool:
        """The same batch with fewer samples: every tensor leaf's first dimension
        shrinks from one common size to another, all else equal."""
        if self.spec != full.spec or len(self.leaves) != len(full.leaves):
            return False
        mine, theirs = self._first_dim(), full._first_dim()
        if mine is None or theirs is None or not 0 < mine < theirs:
            return False
        for a, b in zip(self.leaves, full.leaves):
            if _is_tensor_meta(a) != _is_tensor_meta(b) or (not _is_tensor_meta(a) and a != b):
                return False
            if _is_tensor_meta(a) and (a[1:] != b[1:] or len(a[0]) != len(b[0]) or a[0][1:] != b[0][1:]):
                return False
        return True

    def text(self) -> str:
        if self.spec == _PAIR:
            (sx, dx, devx), (sy, dy, devy) = self.leaves
            return f"x {sx} {dx} on {devx}, y {sy} {dy} on {devy}"
        shown = ", ".join(_leaf_text(leaf) for leaf in self.leaves[:6])
        return f"a batch of {len(self.leaves)} leaves ({shown}{', ...' if len(self.leaves) > 6 else ''})"

    def mismatch(self, built: "Signature") -> str:
        """Why this batch does not match the one the step was built for."""
        if self.spec != built.spec:
            return "its structure differs (a list of another length, other keys, ...)"
        for i, (a, b) in enumerate(zip(self.leaves, built.leaves)):
            if a != b:
                return f"leaf {i} is {_leaf_text(a)} instead of {_leaf_text(b)}"
        return "it differs"


def _is_tensor_meta(leaf: Any) -> bool:
    return len(leaf) == 3 and isinstance(leaf[1], torch.dtype)


def _leaf_text(leaf: Any) -> str:
    if _is_tensor_meta(leaf):
        return f"{leaf[0]} {leaf[1]} on {leaf[2]}"
    return f"{leaf[0].__name__} {leaf[1]!r}"


def _meta(leaf: Any) -> Tuple[Any, ...]:
    if isinstance(leaf, Tensor):
        return (tuple(leaf.shape), leaf.dtype, leaf.device)
    return (type(leaf), leaf if isinstance(leaf, (int, float, str, bool, type(None))) else "<object>")


def signature(inputs: Any, targets: Any) -> Signature:
    if isinstance(inputs, Tensor) and isinstance(targets, Tensor):
        return Signature(_PAIR, (_meta(inputs), _meta(targets)))
    leaves, spec = pytree.tree_flatten((inputs, targets))
    return Signature(spec, tuple(_meta(v) for v in leaves))


def detach(tree: Any) -> Any:
    """``tree`` with every tensor leaf detached (outputs kept past backward)."""
    if isinstance(tree, Tensor):
        return tree.detach()
    if type(tree) is dict and all(isinstance(v, Tensor) for v in tree.values()):  # loss components, or none
        return {k: v.detach() for k, v in tree.items()}
    return pytree.tree_map(lambda t: t.detach() if isinstance(t, Tensor) else t, tree)


def to_channels_last(tree: Any) -> Any:
    """Every 4-d tensor leaf in the channels-last memory format."""
    if isinstance(tree, Tensor):
        return tree.contiguous(memory_format=torch.channels_last) if tree.dim() == 4 else tree
    return pytree.tree_map(lambda t: t.contiguous(memory_format=torch.channels_last)
                           if isinstance(t, Tensor) and t.dim() == 4 else t, tree)


def empty_like_tree(tree: Any) -> Any:
    """Static buffers for a batch: an uninitialised copy of every tensor leaf
    (same shape, dtype, device and strides), other leaves shared."""
    return pytree.tree_map(lambda t: torch.empty_like(t) if isinstance(t, Tensor) else t, tree)


def copy_into(static: Any, batch: Any) -> None:
    """Copy every tensor leaf of ``batch`` into the matching leaf of ``static``."""
    for dst, src in zip(pytree.tree_leaves(static), pytree.tree_leaves(batch)):
        if isinstance(dst, Tensor):
            dst.copy_(src)


def tensor_count(tree: Any) -> int:
    return sum(isinstance(v, Tensor) for v in pytree.tree_leaves(tree))
