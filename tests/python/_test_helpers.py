"""Constants shared by the test modules: ``from _test_helpers import DEVICES``
(pytest puts tests/python on sys.path, as for the other ``_*_helpers``
modules; not named ``_common``, which is the benchmark scripts' own helper
module). Fixtures every module gets are in conftest.py."""

import os

import pytest
import torch

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

#: Skips a test (with the reason) on a machine without a usable CUDA GPU.
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)")

#: ``@pytest.mark.parametrize("device", DEVICES)``: the CPU path always runs,
#: the CUDA one where a GPU is present.
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]


def outcome(fn):
    """``(exception type, message)`` of calling ``fn``, or None when it returns:
    to compare what fusetrain and torch do with the same arguments."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the comparison is the point
        return type(e), str(e)
    return None
