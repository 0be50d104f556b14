"""What happens between two optimizer steps of an epoch: validation every N
steps, checkpoints every N steps or T minutes, and a graceful stop on SIGINT
or SIGTERM. Each test is host arithmetic (no device read); in a distributed
run the ranks agree on the time- and signal-driven ones once every
``agree_every`` steps with one small all-reduce.

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

import os
import signal
import threading
import time
from typing import Any, List, Optional, Sequence, Tuple

import torch

from .preemption import EXIT_PREEMPTED

__all__ = ["GracefulStop", "StepTriggers", "TrainingInterrupted"]


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


class StepTriggers:
    """After each optimizer step inside an epoch, says whether to validate,
    write a checkpoint and stop (:meth:`after_step`)."""

    clock = staticmethod(time.monotonic)  # seconds; replaceable in tests

    def __init__(self, p: Any, ctx: Any, device: torch.device, stop: GracefulStop) -> None:
        self.valid_every, self.ckpt_every = p.valid_every_n_steps, p.ckpt_every_n_steps
        self.ckpt_seconds = 60.0 * p.ckpt_every_minutes
        self.ctx, self.device, self.stop = ctx, device, stop
        self.agree_every = p.log_interval or 50
        self.last_ckpt = self.clock()

    def checkpoint_written(self) -> None:
        self.last_ckpt = self.clock()

    def _time_due(self) -> bool:
        return bool(self.ckpt_seconds) and self.clock() - self.last_ckpt >= self.ckpt_seconds

    def after_step(self, step: int) -> Tuple[bool, bool, bool]:
        """``(validate, checkpoint, stop)`` after optimizer step ``step`` (counted from 1)."""
        validate = bool(self.valid_every) and step % self.valid_every == 0
        checkpoint = bool(self.ckpt_every) and step % self.ckpt_every == 0
        if not self.ctx.enabled:
            stop, due = self.stop.requested, self._time_due()
        elif step % self.agree_every == 0:  # every rank takes part, signalled or not
            flags = self.ctx.sum_([torch.zeros(1, device=self.device)],
                                  [float(self.stop.requested), float(self.ctx.is_main and self._time_due())])
            stop, due = flags[0] > 0, flags[1] > 0
        else:
            stop = due = False
        return validate, checkpoint or due or stop, stop

    def stop_at_epoch_end(self) -> bool:
        """Whether a signal asks the run to stop (at an epoch end, where every rank is)."""
        if not self.ctx.enabled:
            return self.stop.requested
        return self.ctx.sum_([torch.zeros(1, device=self.device)], [float(self.stop.requested)])[0] > 0
