"""Fixtures shared by the test modules. Constants (devices, paths) are in
_test_helpers.py; markers (slow, dist, bench) are registered in pyproject.toml.

Inner loop: ``python3 -m pytest tests/python -m "not slow and not dist and not bench"``."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed(request):
    """``torch.manual_seed(SEED)`` before each test of a module that sets
    ``SEED = <int>`` (fresh random inputs per test, reproducible per module)."""
    seed = getattr(request.module, "SEED", None)
    if seed is not None:
        torch.manual_seed(seed)


@pytest.fixture
def fresh_dynamo():
    """Resets torch.compile's caches before and after the test, so that
    compile counters and recompilation checks see only the test's own graphs.
    Use with ``pytestmark = pytest.mark.usefixtures("fresh_dynamo")``."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
