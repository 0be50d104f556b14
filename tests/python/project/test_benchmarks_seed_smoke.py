"""Smoke tests of the seed benchmarks (seed_mnist_amp.py, seed_compile_table.py,
step_overhead.py): a --quick run exits 0, writes a complete JSON report and a
PNG chart (to a temporary path, never over the committed results), and the
ratios that answer each question are finite numbers computed from the
reported times."""

import math
import subprocess
import sys
import os

import pytest
import torch

from _bench_helpers import DEVICES, load_script, quick_run, script_path
from _test_helpers import REPO

pytestmark = pytest.mark.bench  # runs benchmarks/ scripts: deselected in the inner loop (README, Tests)


def _common_header(report, device, benchmark):
    for key in ("benchmark", "device_kind", "device_name", "torch_version", "num_threads", "config", "results",
                "targets", "all_targets_met", "elapsed_s", "png"):
        assert key in report, key
    assert report["benchmark"] == benchmark
    assert report["device_kind"] == device and report["device_name"]
    assert report["torch_version"] == torch.__version__
    assert report["config"]["quick"] is True
    for t in report["targets"]:
        assert set(t) >= {"name", "value", "threshold", "op", "met", "applies"}
        assert t["met"] is None or isinstance(t["met"], bool)
    assert report["all_targets_met"] == all(t["met"] for t in report["targets"] if t["applies"])


def _png(tmp_path, name):
    png = tmp_path / f"{name}.png"
    assert png.exists() and png.stat().st_size > 1000
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# Seven rows, each in a process of its own: on a GPU machine running 16 test workers the quick run takes
# longer than scripts/gpu-check's 90-s per-test limit; its own limit is the subprocess's (300 s).
@pytest.mark.timeout(300)
@pytest.mark.parametrize("device", DEVICES)
def test_seed_mnist_amp_quick_run(tmp_path, device):
    proc, report = quick_run("seed_mnist_amp", tmp_path, device)
    _common_header(report, device, "seed_mnist_amp")
    _png(tmp_path, "seed_mnist_amp")
    assert "the seed's own numbers" in proc.stdout
    res = report["results"]
    assert list(res) == ["seed_fp32", "seed_amp", "fusetrain_fp16", "fusetrain_bf16", "fusetrain_bf16_compile_ema",
                         "fusetrain_bf16_cuda_graph_ema", "fusetrain_bf16_cuda_graph_ema_channels_last"]
    ran = [r for r, s in res.items() if s["median_epoch_s"] is not None]
    if device == "cpu":
        assert ran == ["seed_fp32", "seed_amp", "fusetrain_bf16", "fusetrain_bf16_compile_ema"]
        assert res["fusetrain_bf16_cuda_graph_ema"]["unavailable"] == "n/a (needs a GPU)"
        assert res["fusetrain_bf16_cuda_graph_ema_channels_last"]["unavailable"] == "n/a (needs a GPU)"
        assert "fp16" in res["fusetrain_fp16"]["unavailable"]
    else:
        assert ran == list(res)
    cfg = report["config"]
    for r in ran:
        s = res[r]
        assert len(s["epochs"]) == cfg["epochs"] and s["timed_epochs"] == cfg["epochs"] - 1
        assert 0 < s["min_epoch_s"] <= s["median_epoch_s"]
        assert math.isfinite(s["final_loss"]) and s["memory_mb"] > 0
        assert s["memory"]["kind"] == ("torch.cuda.memory_reserved" if device == "cuda" else
                                       "peak RSS (ru_maxrss) of the row's process")
    # Same initial weights, same batches: the first epoch's losses agree across
    # rows (fp32 vs bf16 rounding only).
    first = [res[r]["epochs"][0]["loss"] for r in ran]
    assert max(first) - min(first) < 0.05
    for r in ran:
        if r.startswith("fusetrain"):
            assert res[r]["impl"] in ("TrainStep", "inline")
    assert res["fusetrain_bf16_compile_ema"]["mode"] == "compile" and res["fusetrain_bf16_compile_ema"]["ema"]
    ratios = report["ratios"]
    best = ratios["best_fusetrain_row"]
    assert best in ran and best.startswith("fusetrain")
    assert ratios["best_vs_seed_fp32"] == pytest.approx(res["seed_fp32"]["median_epoch_s"] /
                                                        res[best]["median_epoch_s"])
    assert ratios["best_vs_seed_amp"] == pytest.approx(res["seed_amp"]["median_epoch_s"] / res[best]["median_epoch_s"])
    for k in ("best_vs_seed_fp32", "best_vs_seed_amp", "best_memory_vs_seed_amp"):
        assert math.isfinite(ratios[k]) and ratios[k] > 0, k
    assert len(report["targets"]) == 3
    assert all(t["applies"] is (device == "cuda") for t in report["targets"])
    seed = report["seed_reference"]
    assert seed["seed_fp32"]["median_epoch_s_2_to_10"] == pytest.approx(31.67)
    assert seed["seed_amp"]["median_epoch_s_2_to_10"] == pytest.approx(13.78)


def test_seed_mnist_amp_model_is_the_seed_network():
    mod = load_script("seed_mnist_amp")
    from fusetrain.models import SEED_MNIST_CFG

    model = mod.seed_model(quick=False)
    convs = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    assert [(c.in_channels, c.out_channels, c.kernel_size[0], c.stride[0], c.padding[0]) for c in convs] == \
        [tuple(r) for r in SEED_MNIST_CFG]
    assert [(m.in_features, m.out_features) for m in model.modules() if isinstance(m, torch.nn.Linear)] == \
        [(1024, 1000), (1000, 1000), (1000, 10)]
    x, y = mod.make_data(50)
    assert x.dtype == torch.uint8 and x.shape == (50, 1, 28, 28) and y.min() >= 0 and y.max() < 10


@pytest.mark.parametrize("device", DEVICES)
def test_seed_compile_table_quick_run(tmp_path, device):
    # Two of the three models (a segmentation and the detection net) keep the
    # smoke run short; the models themselves are tested in test_seg_det_models.py.
    models = ["pplite_seg", "yolo_csp"]
    _, report = quick_run("seed_compile_table", tmp_path, device, "--models", ",".join(models))
    _common_header(report, device, "seed_compile_table")
    _png(tmp_path, "seed_compile_table")
    mod = load_script("seed_compile_table")
    assert list(report["results"]) == models
    for name, cols in report["results"].items():
        assert list(cols) == list(mod.COLUMNS)
        base = cols["baseline"]["median_epoch_s"]
        assert base > 0
        imp = report["improvements"][name]["improvement_pct"]
        for c in mod.COLUMNS[1:]:
            if c in ("fusetrain_cuda_graph", "torch_compile_reduce_overhead") and device == "cpu":
                assert cols[c]["unavailable"] == "n/a (needs a GPU)" and imp[c] is None
                continue
            if c == "torch_compile_reduce_overhead":  # the quick run's eager backend has no modes
                assert cols[c]["unavailable"].startswith("n/a (reduce-overhead is an inductor mode")
                continue
            # The seed's formula, from the reported medians.
            assert imp[c] == pytest.approx(100.0 * (base - cols[c]["median_epoch_s"]) / base)
            assert math.isfinite(imp[c]) and math.isfinite(cols[c]["final_loss"])
            # The first epoch's compilation or capture, apart from the steady epochs.
            assert cols[c]["first_epoch_extra_s"] == pytest.approx(cols[c]["warmup_epoch_s"] -
                                                                   cols[c]["median_epoch_s"])
        assert report["improvements"][name]["best_fusetrain"] in mod.FUSETRAIN_COLUMNS
        assert report["improvements"][name]["best_torch_compile"] == "torch_compile"
    seeds = {n: report["improvements"][n]["seed_single_gpu_pct"] for n in report["results"]}
    assert seeds["pplite_seg"]["cityscapes_pplite_seg75"] == 56.0 and seeds["yolo_csp"] == {}
    assert len(report["targets"]) == len(models)
    for t in report["targets"]:
        assert math.isfinite(t["value"]) and math.isfinite(t["threshold"])
        assert t["met"] == (t["value"] >= t["threshold"])


def test_seed_compile_table_columns_subset_writes_a_complete_report(tmp_path):
    # --columns leaves the others out (reported as not asked for); the report
    # rewritten after each cell ends complete. Sizes given (here --quick's) win over the preset's.
    _, report = quick_run("seed_compile_table", tmp_path, "cpu", "--models", "ddrnet",
                          "--columns", "torch_compile,fusetrain_eager", "--preset", "seed")
    mod = load_script("seed_compile_table")
    assert report["config"]["preset"] == "seed"
    assert {k: report["config"][k] for k in ("height", "width", "channels", "batch")} == {
        k: mod.QUICK[k] for k in ("height", "width", "channels", "batch")}
    cols = report["results"]["ddrnet"]
    assert report["complete"] is True and report["config"]["columns"] == ["baseline", "torch_compile",
                                                                         "fusetrain_eager"]
    assert cols["fusetrain_compile"] == {"unavailable": "not asked for (--columns)"}
    assert cols["baseline"]["median_epoch_s"] > 0 and cols["fusetrain_eager"]["median_epoch_s"] > 0
    assert report["improvements"]["ddrnet"]["best_fusetrain"] == "fusetrain_eager"
    proc = subprocess.run([sys.executable, script_path("seed_compile_table"), "--quick", "--columns", "fast"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "fast" in proc.stderr


def test_seed_compile_table_improvement_formula():
    mod = load_script("seed_compile_table")
    # The seed's rows: (270.63 - 119.11) / 270.63 = 56%, (226.51 - 174.11) / 226.51 = 23.1%.
    for recipe, (base, comp, pct) in ((r, v["single_gpu"]) for r, v in mod.SEED_TABLE.items()):
        assert mod.improvement_pct(base, comp) == pytest.approx(pct, abs=0.1), recipe
    assert mod.improvement_pct(None, 1.0) is None and mod.improvement_pct(2.0, None) is None


@pytest.mark.parametrize("device", DEVICES)
def test_step_overhead_quick_run(tmp_path, device):
    _, report = quick_run("step_overhead", tmp_path, device)
    _common_header(report, device, "step_overhead")
    _png(tmp_path, "step_overhead")
    cfg = report["config"]
    assert cfg["batch"] == 32
    for name in ("mlp", "cnn"):
        vs = report["results"][name]["variants"]
        assert list(vs) == ["torch_eager", "fusetrain_eager", "fusetrain_compile", "fusetrain_cuda_graph"]
        for vn, s in vs.items():
            if vn == "fusetrain_cuda_graph" and device == "cpu":
                assert s["unavailable"] == "n/a (needs a GPU)" and s["median_ms"] is None
                continue
            assert len(s["times_ms"]) == cfg["repeats"] and 0 < s["min_ms"] <= s["median_ms"]
            assert math.isfinite(s["last_loss"])
        r = report["ratios"][name]
        assert r["compile_vs_fusetrain_eager"] == pytest.approx(vs["fusetrain_eager"]["median_ms"] /
                                                                vs["fusetrain_compile"]["median_ms"])
        for k in ("compile_vs_fusetrain_eager", "compile_vs_torch_eager", "fusetrain_eager_vs_torch_eager"):
            assert math.isfinite(r[k]) and r[k] > 0
        if device == "cpu":
            assert r["graph_vs_fusetrain_eager"] is None
        else:
            assert math.isfinite(r["graph_vs_fusetrain_eager"])
    assert all(t["applies"] is (device == "cuda") for t in report["targets"])
