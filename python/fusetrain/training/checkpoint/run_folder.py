"""Runs on disk: each run of an experiment writes a folder of its own,
``<ckpt_root_dir>/<experiment>/RUN_<date>_<time>_<microseconds>/`` (as
SuperGradients names them), held under an exclusive lock while it writes.

NOTE [run folders]: a fresh run makes a new run folder, so the same command
can run again; ``resume: true`` and ``resume: auto`` continue the newest run
of the experiment that holds a checkpoint, in its own folder. An experiment
folder that holds checkpoint files itself (written before runs had folders)
counts as its oldest run. A run folder holds the run's checkpoints, its
metrics (CSV, JSONL, TensorBoard, plot), its resolved
``training_params.yaml`` and its ``console.log``.

NOTE [folder lock]: the lock is ``fcntl.flock`` on ``<run folder>/.lock``.
The kernel releases it when its process exits, however it exits (kill -9
included), so a stale lock cannot outlive its holder; the file holds the
holder's pid, host, start time and command for the error message of a second
run. A run that fails before writing anything leaves no folder behind.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import shutil
import socket
import sys
import time
from typing import List, Optional

from ..._warnings import warn
from .files import remove_temp_files

__all__ = ["RunFolder", "ExperimentInUseError", "LATEST", "RUN_PREFIX", "checkpoint_file", "new_run_name",
           "run_folders", "latest_checkpoint"]

LOCK_NAME = ".lock"
RUN_PREFIX = "RUN_"
LATEST = "ckpt_latest.pth"
#: What a run writes into its folder when it starts; a run that writes nothing more leaves no folder.
BOOKKEEPING = ("training_params.yaml", "console.log")


class ExperimentInUseError(RuntimeError):
    """Another live run holds the run folder."""


def new_run_name(now: Optional[datetime.datetime] = None) -> str:
    """A run folder's name: ``RUN_<YYYYMMDD>_<HHMMSS>_<microseconds>`` (local time; sorts by start)."""
    return RUN_PREFIX + (now or datetime.datetime.now()).strftime("%Y%m%d_%H%M%S_%f")


def run_folders(experiment_dir: str) -> List[str]:
    """The experiment's run folders, oldest first (NOTE [run folders]): the experiment folder itself first when
    it holds checkpoint files of its own."""
    if not os.path.isdir(experiment_dir):
        return []
    runs = sorted(os.path.join(experiment_dir, n) for n in os.listdir(experiment_dir)
                  if n.startswith(RUN_PREFIX) and os.path.isdir(os.path.join(experiment_dir, n)))
    legacy = any(n.startswith("ckpt_") and n.endswith(".pth") for n in os.listdir(experiment_dir))
    return ([experiment_dir] if legacy else []) + runs


def latest_checkpoint(experiment_dir: str) -> Optional[str]:
    """``ckpt_latest.pth`` of the newest run of the experiment that has one, or None."""
    for run in reversed(run_folders(experiment_dir)):
        path = os.path.join(run, LATEST)
        if os.path.isfile(path):
            return path
    return None


def checkpoint_file(path: str, name: str = "ckpt_best.pth") -> str:
    """``path`` itself when it is a file; for a run folder its ``name``; for an experiment folder the ``name`` of
    its newest run that has one (NOTE [run folders])."""
    if not os.path.isdir(path):
        return path
    for run in reversed(run_folders(path) or [path]):
        if os.path.isfile(os.path.join(run, name)):
            return os.path.join(run, name)
    return os.path.join(path, name)


class RunFolder:
    """``open()`` takes a run folder (creating it if needed) under its lock and removes temporary files of
    interrupted writes; with ``clear_experiment`` (``overwrite_experiment``) it first deletes the experiment's
    other runs. ``close()`` lets it go."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd: Optional[int] = None
        self._created = self._created_experiment = False

    @property
    def experiment_dir(self) -> str:
        return os.path.dirname(os.path.abspath(self.path))

    def open(self, clear_experiment: bool = False) -> None:
        if clear_experiment:
            self._clear_experiment()
        self._created_experiment = not os.path.isdir(self.experiment_dir)
        self._created = not os.path.isdir(self.path)
        os.makedirs(self.path, exist_ok=True)
        self._lock()
        try:
            removed = remove_temp_files(self.path)
        except BaseException:
            self.close()
            raise
        if removed:
            listed = ", ".join(f"{n} ({size / 2**20:.1f} MiB)" for n, size in removed)
            warn(f"Trainer: removed {len(removed)} temporary file(s) of writes interrupted in an earlier "
                 f"run from {self.path}: {listed}")

    def _clear_experiment(self) -> None:
        """``overwrite_experiment``: delete the experiment's earlier runs (each only when no live run holds it)."""
        removed = []
        for run in run_folders(self.experiment_dir):
            if os.path.abspath(run) == os.path.abspath(self.path):
                continue
            holder = RunFolder(run)
            holder._lock()
            try:
                if run == self.experiment_dir:  # files of a run from before run folders
                    for name in os.listdir(run):
                        path = os.path.join(run, name)
                        if not name.startswith(RUN_PREFIX) and name != LOCK_NAME:
                            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
                else:
                    shutil.rmtree(run)
                removed.append(os.path.basename(run) or run)
            finally:
                holder.close()
        if removed:
            warn(f"Trainer: overwrite_experiment=True: deleted the earlier run(s) {', '.join(removed)} of "
                 f"{self.experiment_dir}")

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
                        f"Trainer.train: the run folder {self.path} is in use by another run "
                        f"({self._holder(lock_path)}); two runs writing one folder would mix their checkpoints "
                        f"and metrics. Wait for it to finish or stop it, or start a fresh run (resume: false)") \
                        from None
                warn(f"Trainer: cannot lock the run folder {self.path} ({e}); nothing stops another run "
                     f"from writing it at the same time")
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

    def close(self) -> None:
        """Release the lock; remove the folder if this run created it and wrote nothing but its
        :data:`BOOKKEEPING` files."""
        if self._fd is None:
            return
        lock_path = os.path.join(self.path, LOCK_NAME)
        try:
            os.remove(lock_path)
        except FileNotFoundError:
            pass
        os.close(self._fd)  # after the removal: see the inode check in _lock
        self._fd = None
        if self._created and set(os.listdir(self.path)) <= set(BOOKKEEPING):  # it failed before writing a thing
            for name in BOOKKEEPING:
                if os.path.isfile(os.path.join(self.path, name)):
                    os.remove(os.path.join(self.path, name))
        for created, path in ((self._created, self.path), (self._created_experiment, self.experiment_dir)):
            if created:
                try:
                    os.rmdir(path)  # only when empty
                except OSError:
                    pass
