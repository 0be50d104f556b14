"""What happens between two optimizer steps of an epoch: validation every N
steps, checkpoints every N steps or T minutes, and a graceful stop on SIGINT
or SIGTERM. Each test is host arithmetic (no device read); in a distributed
run the ranks agree on the time- and signal-driven ones once every
``agree_every`` steps with one small all-reduce. A signal's stop is
:class:`~fusetrain.training.distributed.preemption.GracefulStop` (NOTE
[graceful stop]).
"""

from __future__ import annotations

import time
from typing import Any, Tuple

import torch

__all__ = ["StepTriggers"]


class StepTriggers:
    """After each optimizer step inside an epoch, says whether to validate,
    write a checkpoint and stop (:meth:`after_step`)."""

    clock = staticmethod(time.monotonic)  # seconds; replaceable in tests

    def __init__(self, p: Any, ctx: Any, device: torch.device, stop: Any) -> None:
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
