"""Smoke tests of benchmarks/optim_step.py and step_host_time.py: a --quick run exits 0 and writes a
complete JSON report (to a temporary path, never over the committed results)."""

import math

import pytest
import torch

from _bench_helpers import DEVICES, load_script, quick_run

pytestmark = pytest.mark.bench  # runs benchmarks/ scripts: deselected in the inner loop (README, Tests)


def test_resnet50_layout_matches_torchvision_counts():
    mod = load_script("optim_step")
    shapes = mod.resnet50_shapes()
    # torchvision.models.resnet50(): 161 parameter tensors, 25,557,032 params.
    assert len(shapes) == 161
    assert sum(math.prod(s) for s in shapes) == 25_557_032
    assert shapes[0] == (64, 3, 7, 7)
    assert shapes[-2:] == [(1000, 2048), (1000,)]
    # Shrinking keeps the tensor count and scales the params about linearly.
    small = mod.resnet50_shapes(width=0.5)
    assert len(small) == 161
    ratio = sum(math.prod(s) for s in small) / 25_557_032
    assert 0.2 < ratio < 0.3


@pytest.mark.parametrize("device", DEVICES)
def test_optim_step_quick_run_writes_report(tmp_path, device):
    _, report = quick_run("optim_step", tmp_path, device)

    for key in ("device_kind", "device_name", "torch_version", "num_threads", "config", "layouts", "results",
                "copy_bandwidth", "targets", "all_targets_met"):
        assert key in report, key
    assert report["device_kind"] == device
    assert report["torch_version"] == torch.__version__
    assert report["num_threads"] >= 1
    assert report["config"]["quick"] is True
    assert report["layouts"]["resnet50"]["num_tensors"] == 161

    expected = {"fusetrain", "torch_forloop", "torch_foreach", "torch_fused", "fusetrain_full", "torch_sequence"}
    for layout in ("resnet50", "large"):
        res = report["results"][layout]
        assert set(res["variants"]) == expected
        for name in ("fusetrain", "fusetrain_full", "torch_sequence", "torch_forloop", "torch_foreach"):
            v = res["variants"][name]
            assert v["status"] == "ok", v
            assert len(v["times_ms"]) == report["config"]["repeats"]
            assert v["median_ms"] > 0 and v["gbps"] > 0 and v["ratio"] > 0
        assert res["variants"]["torch_sequence"]["ratio"] == pytest.approx(1.0)
        # The compared variants did the same work: after the warm-up their
        # params (and EMAs) agree to fp32 rounding.
        agreement = res["agreement_after_warmup"]
        assert "torch_sequence_vs_fusetrain_full_ema" in agreement
        for k, diff in agreement.items():
            assert diff < 1e-5, (k, diff)

    assert report["copy_bandwidth"]["gbps"] > 0
    assert report["targets"], "no target verdicts"
    for t in report["targets"]:
        assert set(t) >= {"name", "layout", "value", "threshold", "met"}
        assert t["met"] in (True, False, None)


@pytest.mark.parametrize("device", DEVICES)
def test_optim_family_quick_run_has_a_row_per_optimizer(tmp_path, device):
    _, report = quick_run("optim_family", tmp_path, device)
    assert set(report["results"]) == {"Adam", "AdamW", "SGD", "RMSprop", "Adadelta", "RAdam", "NAdam", "RMSpropTF",
                                      "Lamb", "AdamP", "Muon"}
    for name, r in report["results"].items():
        impl = {"RMSpropTF": "timm", "Lamb": "timm", "AdamP": "timm", "Muon": "Muon+AdamW"}.get(
            name, "fused" if name in ("Adam", "AdamW", "SGD") else "foreach")
        assert r["torch_impl"] == impl
        for variant in ("fusetrain", "torch", "fusetrain_full", "torch_full"):
            assert r[variant]["median_ms"] > 0, (name, variant)
        assert r["plain_ratio"] > 0 and r["full_ratio"] > 0
    # A plain and a full target per optimizer, no plain one against timm's class.
    assert len(report["targets"]) == 19 and report["loadavg_start"] is not None


def test_fsdp_step_quick_run_has_a_row_per_size(tmp_path):
    pytest.importorskip("torch.distributed.fsdp")
    _, report = quick_run("fsdp_step", tmp_path, "cpu")
    assert set(report["results"]) == {"8", "24"} and report["config"]["procs"] == 2
    for r in report["results"].values():
        for variant in ("fusetrain", "torch", "fusetrain_clip", "torch_clip"):
            assert r[variant]["slowest_rank_median_ms"] > 0, variant
        assert r["plain_ratio"] > 0 and r["clip_ratio"] > 0
    assert len(report["targets"]) == 4


@pytest.mark.parametrize("device", DEVICES)
def test_step_host_time_quick_run_writes_report(tmp_path, device):
    _, report = quick_run("step_host_time", tmp_path, device)
    mod = load_script("step_host_time")
    assert report["device_kind"] == device and report["config"]["tensors"] == [8, 24]
    for n in ("8", "24"):
        res = report["results"][n]
        assert set(mod.VARIANTS) <= set(res), res.keys()
        for v in mod.VARIANTS:
            assert len(res[v]["times_ms"]) == report["config"]["repeats"] and res[v]["median_ms"] > 0
        assert res["ratio_torch_fused_over_fusetrain"] > 0
    assert set(report["lines"]) == set(mod.VARIANTS)
    assert len(report["targets"]) == 2
    # The least-squares line goes through two points exactly.
    line, ms = report["lines"]["fusetrain"], [report["results"][n]["fusetrain"]["median_ms"] for n in ("8", "24")]
    assert line["fixed_us"] + 8 * line["per_tensor_us"] == pytest.approx(ms[0] * 1e3, rel=1e-6, abs=1e-6)
    assert line["fixed_us"] + 24 * line["per_tensor_us"] == pytest.approx(ms[1] * 1e3, rel=1e-6, abs=1e-6)
