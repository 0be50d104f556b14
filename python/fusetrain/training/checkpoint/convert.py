"""``python -m fusetrain.training.checkpoint.convert OLD.pth [--out NEW.pth]``:
rewrite a checkpoint you trust (one written by an older fusetrain) so that it
reads as data (NOTE [checkpoints are data]) in the current schema (NOTE
[checkpoint schema]): :func:`convert`."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Any, Optional, Sequence

import torch

from .files import TMP_PREFIX, UntrustedCheckpointError, atomic_copy, load_checkpoint
from .schema import upgrade

__all__ = ["as_data", "convert", "main"]


def as_data(obj: Any) -> Any:
    """``obj`` with NumPy values made plain: a legacy NumPy random state
    ``("MT19937", keys, pos, has_gauss, gauss)`` becomes the dict that
    :func:`fusetrain.training.checkpoint.position.rng_state` writes, an array a tensor,
    a NumPy scalar a Python number."""
    import numpy as np

    from .position import numpy_state_as_data

    if isinstance(obj, tuple) and len(obj) == 5 and obj[0] == "MT19937" and isinstance(obj[1], np.ndarray):
        return numpy_state_as_data(obj)
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(obj.copy())
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, dict):
        return type(obj)((k, as_data(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(as_data(v) for v in obj)
    return obj


def convert(path: str, out: Optional[str] = None) -> str:
    """Rewrite a trusted checkpoint (``path``, read with code execution
    allowed) as data (:func:`as_data`) at ``out`` (default: in place,
    atomically); the result is checked to read with ``weights_only=True``
    before it replaces anything. Returns the path written."""
    if out is not None and os.path.isdir(out):
        raise ValueError(f"convert: out {out} is a directory; allowed: a file path")
    out = out or path
    raw = load_checkpoint(path, trusted=True)
    if not isinstance(raw, dict):
        raise ValueError(f"convert: {path} holds a {type(raw).__name__}, not a checkpoint; allowed: a file "
                         f"torch.save wrote a checkpoint or state dict (a dict) to")
    data = upgrade(as_data(raw), path)
    directory = os.path.dirname(os.path.abspath(out))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX + os.path.basename(out), dir=directory)
    os.close(fd)
    try:
        torch.save(data, tmp)
        try:
            load_checkpoint(tmp)
        except UntrustedCheckpointError as e:
            raise ValueError(f"convert: {path} holds objects that are not data even after conversion; "
                             f"{str(e).split(': reading it')[0].replace(tmp, 'the result')}") from None
        atomic_copy(tmp, out)
    finally:
        os.remove(tmp)
    return out


#: The exit status of a file that is missing or not a checkpoint (as argparse's for bad arguments).
EXIT_BAD_FILE = 2


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fusetrain.training.checkpoint.convert",
                                     description="Rewrite a checkpoint you trust (e.g. one written by an older "
                                                 "fusetrain) so that it reads as data (torch.load "
                                                 "weights_only=True); the result is checked before it replaces "
                                                 "anything.")
    parser.add_argument("checkpoint", help="the file to read (its pickle may run code: only files you trust)")
    parser.add_argument("--out", default=None, help="where to write (default: replace the file)")
    args = parser.parse_args(argv)
    try:
        written = convert(args.checkpoint, args.out)
    except (ValueError, OSError) as e:  # missing, unreadable or not a checkpoint: nothing was written
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_FILE
    print(f"wrote {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
