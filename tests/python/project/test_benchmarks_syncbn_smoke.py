"""Smoke test of benchmarks/syncbn.py: a --quick run (2 gloo processes, the
aot_eager backend) exits 0, writes a complete JSON report (to a temporary
path) and a chart, and fusetrain's SyncBatchNorm traces without graph breaks."""

import math
import os

import pytest
import torch

from _bench_helpers import load_script, quick_run
from _dist_helpers import requires_gloo

pytestmark = pytest.mark.bench  # runs benchmarks/ scripts: deselected in the inner loop (README, Tests)


def test_torch_algorithm_stand_in_matches_batchnorm_in_one_process():
    # The CPU stand-in for torch's SyncBatchNorm (world of one rank) is batch norm.
    import torch.distributed as dist

    mod = load_script("syncbn")
    assert not dist.is_initialized()
    x = torch.randn(4, 5, 6, 6, requires_grad=True)
    w, b = torch.rand(5) + 0.5, torch.randn(5)
    # all_gather / all_reduce need a group: use a one-process gloo group.
    from _dist_helpers import free_port
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        y = mod._TorchAlgorithmSyncBN.apply(x, w, b, 1e-5, 1)
        y.backward(torch.ones_like(y) * torch.arange(6.0))
    finally:
        dist.destroy_process_group()
    xr = x.detach().clone().requires_grad_()
    yr = torch.nn.functional.batch_norm(xr, None, None, w, b, True, 0.0, 1e-5)
    yr.backward(torch.ones_like(yr) * torch.arange(6.0))
    torch.testing.assert_close(y, yr, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-4, atol=1e-5)


@requires_gloo
@pytest.mark.dist
def test_syncbn_quick_run_writes_report(tmp_path):
    proc, report = quick_run("syncbn", tmp_path, "cpu")
    for key in ("device_kind", "device_name", "torch_version", "config", "results", "ratios", "targets",
                "all_targets_met", "elapsed_s"):
        assert key in report, key
    cfg = report["config"]
    assert cfg["quick"] is True and cfg["backend"] == "gloo" and cfg["world_size"] == 2
    for v in ("torch", "fusetrain"):
        r = report["results"][v]
        assert len(r["times_ms"]) == cfg["repeats"] and r["median_ms"] > 0
        assert math.isfinite(r["loss_first_step"])
        assert r["graphs"] >= 1
    # Same model, data and weights: the first losses agree.
    assert report["results"]["fusetrain"]["loss_first_step"] == pytest.approx(
        report["results"]["torch"]["loss_first_step"], rel=1e-4)
    # ... and so do the first step's gradients (a compiled variant that dropped
    # the gradient flowing through its batch norms would differ here).
    gn = [report["results"][v]["grad_norm_first_step"] for v in ("torch", "fusetrain")]
    assert gn[0] > 0 and gn[1] == pytest.approx(gn[0], rel=1e-3)
    assert report["results"]["fusetrain"]["graph_breaks"] == 0
    assert report["ratios"]["step_torch_over_fusetrain"] > 0
    assert os.path.exists(os.path.splitext(str(tmp_path / "syncbn.json"))[0] + ".png")
    assert "step time torch / fusetrain" in proc.stdout
