"""The Trainer's progress bar (``progress_bar: true``): tqdm, when installed."""

from __future__ import annotations

import sys
import warnings

__all__ = ["Progress"]


class Progress:
    """tqdm bar whose rate (and so ETA) excludes the first, warm-up step."""

    def __init__(self, enabled: bool, total: int, desc: str) -> None:
        self.bar = None
        if enabled:
            try:
                from tqdm.auto import tqdm

                self.bar = tqdm(total=total, desc=desc, leave=False, dynamic_ncols=True, file=sys.stderr)
            except ImportError:
                warnings.warn("progress_bar=True but tqdm is not installed, so no progress bar is shown; install it "
                              "with `pip install tqdm` or `pip install fusetrain[logging]`, or set progress_bar=False",
                              stacklevel=3)
                self.bar = None
        self.total = total

    def first_step_done(self) -> None:
        if self.bar is not None:
            self.bar.reset(total=self.total)  # restart the clock after warm-up/compilation
            self.bar.update(1)

    def update(self, **postfix) -> None:
        if self.bar is not None:
            self.bar.update(1)
            if postfix:
                self.bar.set_postfix(**postfix)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
