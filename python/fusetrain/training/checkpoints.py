"""Files written atomically: a crash while writing leaves the previous file
intact (write to a temporary file ``.tmp_<name>...`` in the same directory,
flush, fsync, then rename over the target). A kill during the write leaves
the temporary file behind; :func:`remove_temp_files` clears them when the next
run takes the folder."""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import IO, Any, Callable, Dict, List, Tuple

import torch

__all__ = ["atomic_copy", "atomic_save", "atomic_write", "load_checkpoint", "remove_temp_files", "TMP_PREFIX"]

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


def load_checkpoint(path: str, map_location="cpu", mmap: bool = False) -> Dict[str, Any]:
    """A checkpoint file's contents (``mmap``: tensors read on first use)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint not found: {path}")
    try:
        return torch.load(path, map_location=map_location, weights_only=False, mmap=mmap)
    except Exception as e:  # a truncated or foreign file
        raise ValueError(f"could not read checkpoint {path}: {e}") from e
