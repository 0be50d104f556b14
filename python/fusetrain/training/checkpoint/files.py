"""Checkpoint files: written atomically, read as data.

Writes: a crash while writing leaves the previous file intact (write to a
temporary file ``.tmp_<name>...`` in the same directory, flush, fsync, then
rename over the target). A kill during the write leaves the temporary file
behind; :func:`remove_temp_files` clears them when the next run takes the
folder.

NOTE [checkpoints are data]: every read is ``torch.load(weights_only=True)``:
tensors, numbers, strings, ``None`` and plain containers, nothing whose
unpickling runs code from the file (for ``pretrained_weights``, a saved
module built only of ``torch.nn``'s own layer classes too). fusetrain writes only such values (the
random states included: NumPy's as a tensor and numbers). A file that needs
more (a pickled module, NumPy arrays, an object of another library) is
refused with :class:`UntrustedCheckpointError`, which names the setting that
trusts it; ``python -m fusetrain.training.checkpoint.convert OLD.pth``
rewrites a trusted file (an older fusetrain checkpoint) as data once.
"""

from __future__ import annotations

import os
import pickle
import re
import shutil
import tempfile
from typing import IO, Any, Callable, Dict, List, Optional, Tuple

import torch

__all__ = ["atomic_copy", "atomic_save", "atomic_write", "load_checkpoint", "remove_temp_files", "TMP_PREFIX",
           "UntrustedCheckpointError"]

TMP_PREFIX = ".tmp_"
_UMASK = os.umask(0)  # read once (os.umask can only be read by setting it) ...
os.umask(_UMASK)  # ... and put back: written files get the usual mode, not mkstemp's 0600


def atomic_write(path: str, write: Callable[[IO], None], mode: str = "wb") -> None:
    """Call ``write(f)`` on a temporary file next to ``path``, then rename it over ``path``."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX + os.path.basename(path), dir=directory)
    try:
        with os.fdopen(fd, mode, **({} if "b" in mode else {"newline": ""})) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_UMASK)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def atomic_save(obj: Dict[str, Any], path: str) -> None:
    atomic_write(path, lambda f: torch.save(obj, f))


def atomic_copy(src: str, dst: str) -> None:
    """Make ``dst`` a copy of the finished file ``src`` atomically: a hard link
    where the file system has them (nothing written; later atomic writes to
    either path replace that path only), else a copy."""
    directory = os.path.dirname(os.path.abspath(dst))
    tmp = os.path.join(directory, f"{TMP_PREFIX}{os.path.basename(dst)}.{os.getpid()}")
    try:
        if os.path.lexists(tmp):
            os.remove(tmp)
        try:
            os.link(src, tmp)
        except OSError:
            def copy(f: IO) -> None:
                with open(src, "rb") as source:
                    shutil.copyfileobj(source, f)

            atomic_write(dst, copy)
            return
        os.replace(tmp, dst)
    except BaseException:
        if os.path.lexists(tmp):
            os.remove(tmp)
        raise


def remove_temp_files(directory: str) -> List[Tuple[str, int]]:
    """Delete the temporary files of writes that a kill interrupted; returns
    ``[(name, size in bytes)]``. Only call it while holding the folder's lock
    (another run's writes in progress would be deleted too)."""
    removed = []
    for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else []:
        path = os.path.join(directory, name)
        if name.startswith(TMP_PREFIX) and os.path.isfile(path):
            size = os.path.getsize(path)
            os.remove(path)
            removed.append((name, size))
    return removed


class UntrustedCheckpointError(ValueError):
    """A file whose reading would run code from it (NOTE [checkpoints are data])."""


def _torch_module_classes(path: str) -> Optional[List[type]]:
    """The classes a pickled module names, when every global the file needs is a module class of
    ``torch.nn`` itself (a saved ``nn.Sequential`` of torch layers); else None."""
    import importlib

    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:
        return None
    classes = []
    for name in names:
        module, _, attr = name.rpartition(".")
        if not module.startswith("torch.nn.modules."):
            return None
        cls = getattr(importlib.import_module(module), attr, None)
        if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
            return None
        classes.append(cls)
    return classes


def load_checkpoint(path: str, map_location="cpu", mmap: bool = False, trusted: bool = False,
                    trust: str = "trusted=True", torch_modules: bool = False) -> Any:
    """A checkpoint file's contents (``mmap``: tensors read on first use),
    read as data; ``trusted`` reads any pickle (it may run code from the
    file). ``trust`` names the setting that trusts the file, for the error.
    ``torch_modules``: a saved module built only of ``torch.nn``'s own module
    classes reads as data too (unpickling it runs only torch's code)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint not found: {path}")
    try:
        try:
            return torch.load(path, map_location=map_location, weights_only=not trusted, mmap=mmap)
        except pickle.UnpicklingError:
            classes = None if trusted or not torch_modules else _torch_module_classes(path)
            if not classes:
                raise
            with torch.serialization.safe_globals(classes):
                return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        if trusted or "weights_only" not in str(e):
            raise ValueError(f"could not read checkpoint {path} (not a file torch.save wrote, or a truncated one): "
                             f"{e}") from e
        found = sorted(set(re.findall(r"(?:Unsupported global|Unsupported operand[^:]*): (?:GLOBAL )?([\w.]+)",
                                      str(e))))
        what = f" (it names {', '.join(found)})" if found else ""
        raise UntrustedCheckpointError(
            f"{path} holds more than tensors, numbers, strings and plain containers{what}: reading it would run "
            f"code from the file, so it is not read. If you trust the file, set {trust}, or rewrite it once as "
            f"data with `python -m fusetrain.training.checkpoint.convert {path}` (docs/checkpoints.md)") from None
    except Exception as e:  # a truncated or foreign file
        raise ValueError(f"could not read checkpoint {path} (not a file torch.save wrote, or a truncated one): "
                         f"{e}") from e
