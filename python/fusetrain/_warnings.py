"""NOTE [warnings at the user's call]: fusetrain's warnings are attributed to
the first frame outside the package (the user's ``Trainer.train(...)`` or
``opt.step()`` line), so the message shows the user's file and line rather
than fusetrain's own source."""

from __future__ import annotations

import os
import sys
import warnings
from typing import Type

__all__ = ["warn"]

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def warn(message: str, category: Type[Warning] = UserWarning) -> None:
    """``warnings.warn`` at the first caller outside fusetrain (NOTE [warnings at the user's call])."""
    frame, level = sys._getframe(1), 2
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
