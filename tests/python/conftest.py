"""Fixtures shared by the test modules. Constants (devices, paths) are in
_test_helpers.py; markers (slow, dist, bench, cuda) are registered in pyproject.toml.

Inner loop: ``python3 -m pytest tests/python -m "not slow and not dist and not bench"``."""

import os

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


@pytest.fixture
def gloo_group():
    """A process group of this process alone (gloo), destroyed after the test."""
    import torch.distributed as dist

    from _dist_helpers import free_port

    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("torch.distributed with the gloo backend is not available")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def pytest_collection_modifyitems(config, items):
    """Mark ``cuda`` every test that runs only on a CUDA GPU: a ``cuda`` case
    of a device parameter, or a test skipped without CUDA (the ``CUDA``
    decorator of _test_helpers.py). ``scripts/gpu-check`` runs ``-m cuda``."""
    for item in items:
        spec = getattr(item, "callspec", None)
        on_cuda = spec is not None and any(v == "cuda" or getattr(v, "type", None) == "cuda"
                                           for v in spec.params.values())
        needs_cuda = any("CUDA" in str(m.kwargs.get("reason", "")) for m in item.iter_markers("skipif"))
        if on_cuda or needs_cuda:
            item.add_marker(pytest.mark.cuda)


def pytest_runtest_logreport(report):
    """With FUSETRAIN_FAILURES_LOG=FILE, each failure's traceback is appended to
    FILE as soon as it happens (pytest prints them only at the end of the run,
    which a time-boxed run such as ``scripts/gpu-check`` may not reach)."""
    path = os.environ.get("FUSETRAIN_FAILURES_LOG")
    # Under pytest-xdist the controller gets every worker's reports: written once, there.
    if path and report.failed and "PYTEST_XDIST_WORKER" not in os.environ:
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")
