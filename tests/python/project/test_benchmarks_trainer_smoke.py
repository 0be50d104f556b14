"""Smoke test of benchmarks/trainer_overhead.py: a --quick run exits 0 and
writes a complete JSON report (to a temporary path, never over the committed
results); the four variants trained the same model on the same batches, and
the Trainer's epochs include its checkpoint writes."""

import math

import pytest
import torch

from _bench_helpers import DEVICES, quick_run

pytestmark = pytest.mark.bench  # runs benchmarks/ scripts: deselected in the inner loop (README, Tests)

VARIANTS = ("handwritten_fp32", "trainer_fp32", "handwritten_amp", "trainer_amp")


@pytest.mark.parametrize("device", DEVICES)
def test_trainer_overhead_quick_run_writes_report(tmp_path, device):
    proc, report = quick_run("trainer_overhead", tmp_path, device)
    assert proc.stdout.count("Trainer / hand-written") >= 2

    for key in ("benchmark", "device_kind", "device_name", "torch_version", "num_threads", "loadavg_start",
                "loadavg_end", "config", "variants", "results", "ratios", "targets", "all_targets_met", "elapsed_s"):
        assert key in report, key
    assert report["benchmark"] == "trainer_overhead"
    assert report["device_kind"] == device
    assert report["device_name"]
    assert report["torch_version"] == torch.__version__
    cfg = report["config"]
    assert cfg["quick"] is True
    assert cfg["model"] == "seed_mnist" and cfg["num_params"] > 14_000_000
    assert cfg["amp_dtype"] == ("fp16" if device == "cuda" else "bf16")
    assert cfg["interleave"] == ("run" if device == "cuda" else "step")
    assert cfg["steps_per_epoch"] == cfg["images"] // cfg["batch"]
    for which, mp in (("resolved_fp32", False), ("resolved_amp", cfg["amp_dtype"])):
        tp = cfg["trainer_training_params"][which]
        assert tp["optimizer"] == "Adam" and tp["initial_lr"] == 1e-4
        assert tp["mixed_precision"] == mp and tp["progress_bar"] is False
    assert set(report["variants"]) == set(VARIANTS)
    assert set(report["results"]) == set(VARIANTS)

    timed = cfg["rounds"] * (cfg["epochs"] - 1)
    for name in VARIANTS:
        res = report["results"][name]
        assert res["timed_epochs"] == timed == len(res["wall_s"])
        assert 0 < res["min_s"] <= res["median_s"]
        assert len(res["runs"]) == cfg["rounds"]
        for run in res["runs"]:
            assert [e["epoch"] for e in run["epochs"]] == list(range(1, cfg["epochs"] + 1))
            assert [e["warmup"] for e in run["epochs"]] == [True] + [False] * (cfg["epochs"] - 1)
            for e in run["epochs"]:
                assert e["wall_s"] > 0 and e["gate_wait_s"] >= 0 and math.isfinite(e["loss"])
                if device == "cpu":  # one turn per step, plus the turn that ends the epoch
                    assert e["slices"] == cfg["steps_per_epoch"] + 1
                if name.startswith("trainer"):
                    # The Trainer's own loop clock, the rest of the epoch, and the
                    # checkpoint written in it (model + Adam state: ~3x the params).
                    assert 0 < e["trainer_loop_s"] < e["wall_s"]
                    assert e["outside_loop_s"] == pytest.approx(e["wall_s"] - e["trainer_loop_s"])
                    assert e["ckpt_files"] == 1
                    assert 0 < e["ckpt_write_s"] <= e["outside_loop_s"] + 1e-6
                    assert e["ckpt_mb"] > 3 * 4 * cfg["num_params"] / 2**20 * 0.99
        if name.startswith("trainer"):
            assert res["ckpt_mb"] > 0 and 0 < res["ckpt_write_pct_of_epoch"] < 100
            assert all(t is not None and t >= 0 for t in res["run_tail_s"])
        if device == "cuda":
            assert res["memory"]["max_reserved_mb"] >= res["memory"]["reserved_mb_last_epoch"] > 0
        else:
            assert res["memory"] is None

    # Same model, same batches: the hand-written fp32 loop and the Trainer's
    # (torch.optim.Adam vs fusetrain's fused Adam, fp32) start from the same
    # loss and stay together to rounding; the AMP pair alike to bf16/fp16 rounding.
    runs = {n: report["results"][n]["runs"][0]["epochs"] for n in VARIANTS}
    # On a GPU the Trainer's cudnn_benchmark=True picks other convolution algorithms than the hand-written
    # loop (benchmark off), which round differently from the first step on.
    first_rel = 1e-5 if device == "cpu" else 2e-4
    assert runs["trainer_fp32"][0]["loss"] == pytest.approx(runs["handwritten_fp32"][0]["loss"], rel=first_rel)
    assert runs["trainer_fp32"][-1]["loss"] == pytest.approx(runs["handwritten_fp32"][-1]["loss"], rel=1e-3)
    assert runs["trainer_amp"][-1]["loss"] == pytest.approx(runs["handwritten_amp"][-1]["loss"], rel=2e-2)
    # ... and they trained: the random labels of the few images are being learnt.
    assert runs["handwritten_fp32"][-1]["loss"] < runs["handwritten_fp32"][0]["loss"]

    assert set(report["ratios"]) == {"fp32", "amp"}
    for pair, r in report["ratios"].items():
        t = report["results"][f"trainer_{pair}"]
        h = report["results"][f"handwritten_{pair}"]
        assert r["trainer_over_handwritten"] == pytest.approx(t["median_s"] / h["median_s"])
        assert r["loop_only"] == pytest.approx(t["trainer_loop_median_s"] / h["median_s"])
        assert r["min_based"] > 0
    assert {t["pair"] for t in report["targets"]} == {"fp32", "amp"}
    for t in report["targets"]:
        assert set(t) >= {"name", "pair", "value", "threshold", "op", "met"}
        assert isinstance(t["met"], bool)
        assert t["threshold"] == (1.0 if device == "cuda" else 1.03)
        assert t["met"] == (t["value"] < t["threshold"] if t["op"] == "<" else t["value"] <= t["threshold"])
    assert report["all_targets_met"] == all(t["met"] for t in report["targets"])


def test_trainer_overhead_async_checkpoints_attributes_the_background_writes(tmp_path):
    # The writes of the background writer thread count for the run whose experiment it serves.
    _, report = quick_run("trainer_overhead", tmp_path, "cpu", "--variants", "handwritten_fp32,trainer_fp32",
                          "--async-checkpoints")
    cfg = report["config"]
    assert cfg["async_checkpoints"] is True
    assert cfg["trainer_training_params"]["resolved_fp32"]["async_checkpoints"] is True
    for run in report["results"]["trainer_fp32"]["runs"]:
        for e in run["epochs"]:
            assert e["ckpt_files"] == 1 and e["ckpt_write_s"] > 0
