"""Preemptible and elastic clusters: the signals that stop a run with a
checkpoint, the exit status that says so, Slurm's requeue, and the process
group's store of workers that torchrun restarts (NOTE [restart store]).

NOTE [preemption]: a scheduler that takes a job's machines back warns it
with a signal (Slurm: ``--signal=USR1@90``; Kubernetes and spot instances:
SIGTERM). Each of ``preemption_signals`` (and SIGINT) stops the run after
the step in flight with a mid-epoch checkpoint (NOTE [graceful stop]); the
error that ``Trainer.train`` then raises carries :data:`EXIT_PREEMPTED`,
the status ``fusetrain-train`` exits with, so a job script can tell "stopped
with a checkpoint, run me again" from a failure. Under Slurm,
``auto_requeue: true`` makes rank 0 requeue the job itself after the
checkpoint (``scontrol requeue $SLURM_JOB_ID``); the requeued job runs the
same command, and ``resume: auto`` continues from the checkpoint. It does
so after a stop by any of the signals but SIGINT (a person) and SIGTERM
(``scancel`` sends it to a job cancelled for good).

NOTE [graceful stop]: the first SIGINT (Ctrl-C) or signal of
``preemption_signals`` (default SIGTERM, SIGUSR1) only sets a flag. The step
in flight ends, a checkpoint of the position in the epoch is written, and
``Trainer.train`` raises :class:`TrainingInterrupted` (a
``KeyboardInterrupt``), so ``resume`` continues from the next batch. A
second SIGINT interrupts at once, as Python would; a preemption signal that
comes again while the stop is under way is ignored (a scheduler and torchrun
may both deliver the one signal; NOTE [preemption]).
"""

from __future__ import annotations

import datetime
import os
import shutil
import signal
import subprocess
import sys
import threading
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..._warnings import warn
from ..params.signals import EXIT_PREEMPTED

__all__ = ["EXIT_PREEMPTED", "GracefulStop", "TrainingInterrupted", "check_auto_requeue", "requeues", "requeue",
           "restart_store"]

def check_auto_requeue(p: Any, environ: Any = None) -> None:
    """``auto_requeue`` needs Slurm (SLURM_JOB_ID set) and ``scontrol`` on PATH (before anything is written)."""
    from ..params.validators import TrainingParamsError

    if not p.auto_requeue:
        return
    env = os.environ if environ is None else environ
    if not env.get("SLURM_JOB_ID"):
        raise TrainingParamsError(["training_params.auto_requeue: got True but SLURM_JOB_ID is not set (not a "
                                   "Slurm job); allowed outside Slurm: false (requeue from the job script on exit "
                                   f"status {EXIT_PREEMPTED}, or rerun the same command with resume: auto)"])
    if shutil.which("scontrol", path=env.get("PATH")) is None:
        raise TrainingParamsError(["training_params.auto_requeue: got True but scontrol is not on PATH; allowed: "
                                   "false, or run where Slurm's scontrol is installed"])


def requeues(signal_name: Any) -> bool:
    """Whether ``auto_requeue`` requeues after a stop by ``signal_name``: not after SIGINT (a person) nor
    SIGTERM (``scancel``, and Slurm's own preemption, which requeues by its configuration)."""
    return signal_name is not None and signal_name not in ("SIGINT", "SIGTERM")


def requeue(environ: Any = None) -> None:
    """``scontrol requeue $SLURM_JOB_ID`` (rank 0, after the checkpoint). A failure is reported, not raised:
    the checkpoint is written and the exit status still says so."""
    env = os.environ if environ is None else environ
    job = env.get("SLURM_JOB_ID", "")
    cmd: Sequence[str] = ["scontrol", "requeue", job]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        print(f"auto_requeue: {' '.join(cmd)} failed: {exc}", file=sys.stderr, flush=True)
        return
    if done.returncode != 0:
        print(f"auto_requeue: {' '.join(cmd)} exited with status {done.returncode}: "
              f"{(done.stderr or done.stdout).strip()}", file=sys.stderr, flush=True)
    else:
        print(f"auto_requeue: requeued Slurm job {job}", flush=True)


def restart_store(rank: int, world: int, timeout: datetime.timedelta) -> Dict[str, Any]:
    """NOTE [restart store]: torchrun's c10d rendezvous shares its store with
    the workers, and torch keys the process group's entries by nothing that
    changes when ``--max-restarts`` restarts them, so restarted workers can
    read the previous round's addresses and hang connecting to a dead peer.
    On one node the restart count tells the rounds apart: the group then
    meets under a prefix of it. On several nodes the counts may differ between
    nodes; there ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (set for every
    torchrun) gives each round its own store, and a warning says so. Returns
    init_process_group's ``store``/``rank``/``world_size``, or nothing."""
    import torch.distributed as dist

    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")) <= 0:
        return {}
    if env.get("GROUP_WORLD_SIZE", "1") != "1":
        if rank == 0:
            warn("torchrun restarts workers (--max-restarts) on several nodes with a shared rendezvous "
                 "store: set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in every torchrun's environment, or "
                 "restarted workers may hang connecting to the previous round's peers")
        return {}
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world, is_master=False, timeout=timeout)
    prefix = f"fusetrain/restart_{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    return {"store": dist.PrefixStore(prefix, store), "rank": rank, "world_size": world}


class TrainingInterrupted(KeyboardInterrupt):
    """Training stopped on a signal after writing a checkpoint. ``exit_status``:
    what a script should exit with (``fusetrain-train`` does; NOTE [preemption])."""

    exit_status = EXIT_PREEMPTED


class GracefulStop:
    """Catches SIGINT and ``signals`` (names) while training (main thread only;
    elsewhere signals keep their handlers). NOTE [graceful stop]."""

    def __init__(self, signals: Sequence[str] = ("SIGTERM",)) -> None:
        self.signal: Optional[str] = None
        self.signals = tuple(dict.fromkeys([signal.SIGINT] + [signal.Signals[name] for name in signals]))
        self._previous: List[Tuple[int, Any]] = []
        self._pid = os.getpid()

    @property
    def requested(self) -> bool:
        return self.signal is not None

    def __enter__(self) -> "GracefulStop":
        self._pid = os.getpid()
        if threading.current_thread() is threading.main_thread():
            for s in self.signals:
                self._previous.append((s, signal.signal(s, self._handle)))
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if os.getpid() != self._pid:  # a forked DataLoader worker: it keeps serving the step in flight
            return
        if self.requested and signum != signal.SIGINT:
            print(f"{name} received while stopping: the checkpoint is being written", flush=True)
            return
        if self.requested:  # a second SIGINT: at once
            self._restore()
            raise KeyboardInterrupt(f"{name} received twice")
        self.signal = name
        print(f"{name} received: stopping after this step and writing a checkpoint (SIGINT again stops at "
              f"once)", flush=True)

    def _restore(self) -> None:
        for s, handler in self._previous:
            signal.signal(s, handler)
        self._previous = []

    def __exit__(self, *exc: Any) -> None:
        self._restore()
