"""The experiment folder of a run, held under an exclusive lock while the run
writes it.

NOTE [folder lock]: the lock is ``fcntl.flock`` on ``<folder>/.lock``. The
kernel releases it when its process exits, however it exits (kill -9
included), so a stale lock cannot outlive its holder; the file holds the
holder's pid, host, start time and command for the error message of a second
run. A run that fails before writing anything leaves no folder behind.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import socket
import sys
import time
import warnings
from typing import List, Optional

from .files import remove_temp_files

__all__ = ["ExperimentDir", "ExperimentInUseError", "ExperimentExistsError", "run_files"]

LOCK_NAME = ".lock"


class ExperimentInUseError(RuntimeError):
    """Another live run holds the experiment folder."""


class ExperimentExistsError(FileExistsError):
    """A fresh run into a folder (``path``) that holds an earlier run's files (``files``)."""

    def __init__(self, message: str, path: str = "", files: Optional[List[str]] = None) -> None:
        super().__init__(message)
        self.path, self.files = path, list(files or [])

    def __str__(self) -> str:
        return str(self.args[0])


def run_files(directory: str) -> List[str]:
    """The files and folders a run writes that exist in ``directory``."""
    if not os.path.isdir(directory):
        return []
    return sorted(n for n in os.listdir(directory)
                  if (n.startswith("ckpt_") and n.endswith(".pth")) or n.endswith((".pt2", ".onnx"))
                  or n in ("metrics.jsonl", "metrics.csv", "metrics.png", "test_metrics.json", "tensorboard",
                           "steps.jsonl", "steps.csv", "valid_steps.jsonl", "shards", "average_model.pth",
                           "average_model_snapshots.pth"))


class ExperimentDir:
    """``open()`` takes the folder (creating it if needed) for a fresh run
    (``resume=False``: the folder must hold no earlier run unless
    ``overwrite``, which deletes that run's files) or a resumed one; it also
    removes temporary files of interrupted writes. ``close()`` lets it go."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd: Optional[int] = None
        self._created = False

    def open(self, resume: bool, overwrite: bool, why: str = "overwrite_experiment=True") -> None:
        self._created = not os.path.isdir(self.path)
        os.makedirs(self.path, exist_ok=True)
        self._lock()
        try:
            self._prepare(resume, overwrite, why)
        except BaseException:
            self.close()
            raise

    def _lock(self) -> None:
        lock_path = os.path.join(self.path, LOCK_NAME)
        while True:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise ExperimentInUseError(
                        f"Trainer.train: the experiment folder {self.path} is in use by another run "
                        f"({self._holder(lock_path)}); two runs writing one folder would mix their checkpoints "
                        f"and metrics. Wait for it to finish or stop it, or choose another experiment_name") from None
                warnings.warn(f"Trainer: cannot lock the experiment folder {self.path} ({e}); nothing stops "
                              f"another run from writing it at the same time", stacklevel=4)
                return
            # The previous holder may have removed the file between our open and flock.
            try:
                same = os.stat(lock_path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        info = {"pid": os.getpid(), "host": socket.gethostname(),
                "started": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv)[:300]}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        self._fd = fd

    @staticmethod
    def _holder(lock_path: str) -> str:
        try:
            with open(lock_path) as f:
                h = json.load(f)
            return f"pid {h['pid']} on {h['host']}, started {h['started']}: {h['command']}"
        except (OSError, ValueError, KeyError, TypeError):
            return "holder unknown"

    def _prepare(self, resume: bool, overwrite: bool, why: str) -> None:
        removed = remove_temp_files(self.path)
        if removed:
            listed = ", ".join(f"{n} ({size / 2**20:.1f} MiB)" for n, size in removed)
            warnings.warn(f"Trainer: removed {len(removed)} temporary file(s) of writes interrupted in an earlier "
                          f"run from {self.path}: {listed}", stacklevel=4)
        if resume:
            return
        earlier = run_files(self.path)
        if earlier and not overwrite:
            raise ExperimentExistsError(
                f"Trainer.train: the experiment folder {self.path} holds an earlier run ({', '.join(earlier)}); "
                f"set training_params.resume=True to continue it, overwrite_experiment=True to delete its files "
                f"and start over, or choose another experiment_name", self.path, earlier)
        for name in earlier:
            path = os.path.join(self.path, name)
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        if earlier:
            warnings.warn(f"Trainer: {why}: deleted the earlier run's {', '.join(earlier)} "
                          f"from {self.path}", stacklevel=4)

    def close(self) -> None:
        """Release the lock; remove the folder if this run created it and wrote nothing."""
        if self._fd is None:
            return
        lock_path = os.path.join(self.path, LOCK_NAME)
        try:
            os.remove(lock_path)
        except FileNotFoundError:
            pass
        os.close(self._fd)  # after the removal: see the inode check in _lock
        self._fd = None
        if self._created:
            try:
                os.rmdir(self.path)  # only when empty
            except OSError:
                pass
