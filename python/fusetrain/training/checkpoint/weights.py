"""Weights read from a file for fine-tuning or inference: whatever a
checkpoint of fusetrain (or of timm, Lightning, SuperGradients) or a plain
state dict holds (:func:`read_weights`)."""

from __future__ import annotations

import os
from typing import Mapping

import torch
from torch import nn

from .files import load_checkpoint
from .sharded import full_state_dict

__all__ = ["read_weights"]

_NESTED = ("state_dict", "model", "module", "model_state_dict", "net")  # where checkpoints keep the weights


def read_weights(path: str, use_ema: bool = False, trusted: bool = False,
                 key: str = "training_params.pretrained_weights", trust: str = "pretrained_params: {trusted: true}",
                 ema_key: str = "training_params.pretrained_params.use_ema") -> Mapping[str, torch.Tensor]:
    """The weights a file holds, as a state dict: a fusetrain checkpoint's (its EMA's with ``use_ema``; sharded
    or not), a plain state dict, a saved ``torch.nn`` module, or a dict with the weights under one of
    ``state_dict``, ``model``, ``module``, ``model_state_dict``, ``net`` (timm, Lightning, SuperGradients), or
    a ``.safetensors`` file. Read as data unless ``trusted`` (NOTE [checkpoints are data]); ``key``, ``trust``
    and ``ema_key`` name the settings of the path, of the trust and of ``use_ema`` in messages."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{key}: no file at {path} (checkpoint not found)")
    if path.endswith(".safetensors"):
        try:
            from safetensors.torch import load_file
        except ImportError as e:
            raise ValueError(f"{key}: {path} is a safetensors file; pip install safetensors to read it") from e
        return load_file(path)
    try:  # NOTE [checkpoints are data]
        obj = load_checkpoint(path, trusted=trusted, trust=trust, torch_modules=True)
    except ValueError as e:  # a truncated, foreign or untrusted file
        raise type(e)(f"{key}: {e}") from None
    if isinstance(obj, nn.Module):
        obj = obj.state_dict()
    if isinstance(obj, Mapping) and obj.get("shards") is not None:  # NOTE [sharded checkpoints]
        if use_ema and obj.get("ema") is None:
            raise ValueError(f"{ema_key}: {path} has no EMA weights (train with ema: true)")
        return full_state_dict(path, ema=use_ema, trusted=trusted, trust=trust)
    if not isinstance(obj, Mapping):
        raise ValueError(f"{key}: {path} holds a {type(obj).__name__}; allowed: a state dict, a module or a "
                         f"checkpoint dict with one under {_NESTED}")
    if use_ema:
        ema = obj.get("ema")
        if not isinstance(ema, Mapping) or not isinstance(ema.get("module"), Mapping):
            raise ValueError(f"{ema_key}: {path} has no EMA weights (a fusetrain checkpoint of a run with ema: "
                             f"true has them)")
        return ema["module"]
    if all(isinstance(v, torch.Tensor) for v in obj.values()):
        return obj
    for k in _NESTED:  # fusetrain checkpoints ("model"), Lightning/timm ("state_dict"), ...
        inner = obj.get(k)
        if isinstance(inner, nn.Module):
            return inner.state_dict()
        if isinstance(inner, Mapping) and inner and all(isinstance(v, torch.Tensor) for v in inner.values()):
            return inner
    raise ValueError(f"{key}: {path} is a dict without tensors at the top level or under any of {_NESTED}")
