"""The Trainer's progress bar (``progress_bar: true``): tqdm, when installed,
with the epoch's running loss.

NOTE [loss in the progress bar]: the running loss lives on the device; the
bar shows it without waiting for the device. Every half second a copy of the
loss sum into page-locked host memory is queued (on a GPU, non-blocking, with
an event), and the bar shows the newest copy whose event has completed, so
what it shows is at most a fraction of a second old and no step waits for
it. On the CPU the sum is read at once.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Optional, Tuple

import torch

from ..._warnings import warn

__all__ = ["Progress"]

_PEEK_EVERY_S = 0.5


class Progress:
    """tqdm bar whose rate (and so ETA) excludes the first, warm-up step; it stays on screen when its epoch
    ends, showing the epoch's loss."""

    def __init__(self, enabled: bool, total: int, desc: str) -> None:
        self.bar = None
        if enabled:
            try:
                from tqdm.auto import tqdm

                self.bar = tqdm(total=total, desc=desc, leave=True, dynamic_ncols=True, file=sys.stderr)
            except ImportError:
                warn("progress_bar=True but tqdm is not installed, so no progress bar is shown; install it "
                     "with `pip install tqdm` or `pip install fusetrain[logging]`, or set progress_bar=False")
                self.bar = None
        self.total = total
        self._last_peek = 0.0
        self._host: Optional[torch.Tensor] = None
        self._pending: Optional[Tuple[Any, int]] = None  # (event, samples) of the copy in flight

    def first_step_done(self) -> None:
        if self.bar is not None:
            self.bar.reset(total=self.total)  # restart the clock after warm-up/compilation
            self.bar.update(1)

    def update(self, **postfix) -> None:
        if self.bar is not None:
            self.bar.update(1)
            if postfix:
                self.bar.set_postfix(**postfix)

    def running_loss(self, loss_sum: torch.Tensor, samples: int) -> None:
        """Show the mean loss so far (``loss_sum`` over ``samples``) without waiting for the device (NOTE [loss
        in the progress bar])."""
        if self.bar is None:
            return
        if self._pending is not None and self._pending[0].query():
            self._show(self._host.item(), self._pending[1])
            self._pending = None
        now = time.monotonic()
        if now - self._last_peek < _PEEK_EVERY_S or self._pending is not None:
            return
        self._last_peek = now
        if loss_sum.device.type != "cuda":
            self._show(loss_sum.item(), samples)
            return
        if self._host is None:
            self._host = torch.empty((), dtype=loss_sum.dtype, pin_memory=True)
        self._host.copy_(loss_sum, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._pending = (event, samples)

    def _show(self, loss_sum: float, samples: int) -> None:
        self.bar.set_postfix(loss=f"{loss_sum / max(samples, 1):.4f}", refresh=False)

    def note(self, text: str) -> None:
        """A line printed above the bar (or plainly without one)."""
        if self.bar is not None:
            self.bar.write(text, file=sys.stdout)
        else:
            print(text, flush=True)

    def close(self, loss: Optional[float] = None) -> None:
        """End the bar, showing the epoch's ``loss``."""
        if self.bar is not None:
            if loss is not None:
                self.bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
            self.bar.close()
