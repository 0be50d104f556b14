"""The signals a run may stop on (``preemption_signals``) and the exit status
of such a stop: what the settings check and the stop reports (NOTE
[preemption] in :mod:`fusetrain.training.distributed.preemption`)."""

from __future__ import annotations

import signal
from typing import Any, List

__all__ = ["EXIT_PREEMPTED", "signal_names", "parse_signal"]

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
