"""Fixtures shared by the test modules. Constants (devices, paths) are in
_test_helpers.py; markers (slow, dist, bench, cuda) are registered in pyproject.toml.

Inner loop: ``python3 -m pytest tests/python -m "not slow and not dist and not bench"``."""

import os

import pytest
import torch

try:  # the property-based tests (tests/python/*/test_*_properties.py); the test extra installs it
    from hypothesis import HealthCheck, Phase, settings
except ImportError:  # pragma: no cover
    settings = None

#: NOTE [hypothesis profiles]: "ci" (the default) runs a fixed set of examples (derandomize: the same on every
#: run) within the CI's budget; "long" (FUSETRAIN_HYPOTHESIS_PROFILE=long) 15 times as many, randomly drawn (a
#: failure prints the blob that reproduces it: @reproduce_failure); "quick" a few, for runs under
#: compute-sanitizer (scripts/gpu-check). A test's own budget is a share of max_examples
#: (_property_helpers.examples).
if settings is not None:
    # No explain phase: it costs more than the failing example it explains.
    _common = dict(deadline=None, print_blob=True, database=None, phases=[p for p in Phase if p != Phase.explain],
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                          HealthCheck.filter_too_much])
    settings.register_profile("ci", max_examples=20, derandomize=True, **_common)
    settings.register_profile("long", max_examples=300, derandomize=False, **_common)
    settings.register_profile("quick", max_examples=5, derandomize=True, **_common)  # under compute-sanitizer
    settings.load_profile(os.environ.get("FUSETRAIN_HYPOTHESIS_PROFILE", "ci"))


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
