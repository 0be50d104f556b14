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
"""

from __future__ import annotations

import datetime
import os
import shutil
import signal
import subprocess
import sys
import warnings
from typing import Any, Dict, List, Sequence

__all__ = ["EXIT_PREEMPTED", "signal_names", "parse_signal", "check_auto_requeue", "requeues", "requeue",
           "restart_store"]

#: The exit status of ``fusetrain-train`` after a stop with a checkpoint (a signal): EX_TEMPFAIL of
#: sysexits.h, "try again later". A job script requeues (or reruns the same command) on it.
EXIT_PREEMPTED = 75

#: Signals that cannot be caught, or that mean something else to a training process.
_REFUSED = {"SIGKILL": "it cannot be caught", "SIGSTOP": "it cannot be caught",
            "SIGINT": "it always stops the run (Ctrl-C); list only the other signals",
            "SIGCHLD": "child processes (DataLoader workers) send it when they end",
            "SIGSEGV": "it reports a crash", "SIGBUS": "it reports a crash", "SIGFPE": "it reports a crash",
            "SIGILL": "it reports a crash", "SIGABRT": "it reports a crash", "SIGPIPE": "it reports a closed pipe"}


def signal_names() -> List[str]:
    """The signal names ``preemption_signals`` accepts on this system."""
    return sorted(s.name for s in signal.Signals if s.name not in _REFUSED and not s.name.startswith("SIG_")
                  and s.name.startswith("SIG") and not s.name.startswith(("SIGRT",)))


def parse_signal(value: Any) -> str:
    """``'USR1'``, ``'sigusr1'``, ``'SIGUSR1'`` or a number -> ``'SIGUSR1'``; ValueError for the others."""
    if isinstance(value, bool):
        raise ValueError(f"got {value!r}")
    if isinstance(value, int):
        try:
            name = signal.Signals(value).name
        except ValueError:
            raise ValueError(f"got {value!r}, which is no signal number here") from None
    elif isinstance(value, str) and value.strip():
        name = value.strip().upper()
        name = name if name.startswith("SIG") else "SIG" + name
    else:
        raise ValueError(f"got {value!r}")
    if name in _REFUSED:
        raise ValueError(f"got {value!r}: {name} is not allowed ({_REFUSED[name]})")
    if name not in signal_names():
        raise ValueError(f"got {value!r}, which is no signal name here")
    return name


def check_auto_requeue(p: Any, environ: Any = None) -> None:
    """``auto_requeue`` needs Slurm (SLURM_JOB_ID set) and ``scontrol`` on PATH (before anything is written)."""
    from .params.validators import TrainingParamsError

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
            warnings.warn("torchrun restarts workers (--max-restarts) on several nodes with a shared rendezvous "
                          "store: set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in every torchrun's environment, or "
                          "restarted workers may hang connecting to the previous round's peers", stacklevel=3)
        return {}
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world, is_master=False, timeout=timeout)
    prefix = f"fusetrain/restart_{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    return {"store": dist.PrefixStore(prefix, store), "rank": rank, "world_size": world}
