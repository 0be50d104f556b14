"""Checkpoint files written atomically: a crash while writing leaves the
previous file intact (write to a temporary file in the same directory, flush,
fsync, then rename over the target)."""

from __future__ import annotations

import os
import tempfile
from typing import Any, Dict

import torch

__all__ = ["atomic_save", "load_checkpoint"]


def atomic_save(obj: Dict[str, Any], path: str) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp_" + os.path.basename(path), dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def load_checkpoint(path: str, map_location="cpu") -> Dict[str, Any]:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint not found: {path}")
    try:
        return torch.load(path, map_location=map_location, weights_only=False)
    except Exception as e:  # a truncated or foreign file
        raise ValueError(f"could not read checkpoint {path}: {e}") from e
