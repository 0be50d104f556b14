"""Smoke test of benchmarks/amp_ema_step.py: a --quick run exits 0 and writes a
complete JSON report (to a temporary path, never over the committed results),
and the three variants trained the same model on the same data."""

import math

import pytest
import torch

from _bench_helpers import DEVICES, load_script, quick_run

pytestmark = pytest.mark.bench  # runs benchmarks/ scripts: deselected in the inner loop (README, Tests)

VARIANTS = {"torch", "fusetrain", "fusetrain_no_ema"}
MODELS = ("mnist_cnn", "transformer")


def test_mnist_model_matches_the_seed_architecture():
    mod = load_script("amp_ema_step")
    model = mod.mnist_cnn()
    convs = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    bns = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert len(convs) == 14 and len(bns) == 14
    assert [(c.in_channels, c.out_channels, c.kernel_size[0], c.stride[0], c.padding[0]) for c in convs] == \
        [tuple(row) for row in mod.MNIST_CFG]
    assert [(m.in_features, m.out_features) for m in linears] == [(1024, 1000), (1000, 1000), (1000, 10)]
    # Conv weights and biases, BatchNorm weights and biases, Linear weights and biases.
    expected = sum(c[0] * c[1] * c[2] * c[2] + c[1] + 2 * c[1] for c in mod.MNIST_CFG) + \
        1024 * 1000 + 1000 + 1000 * 1000 + 1000 + 1000 * 10 + 10
    assert sum(p.numel() for p in model.parameters()) == expected
    # 28x28 images down to 3x3 before the pooling; 10 logits out.
    out = model.features(torch.rand(2, 1, 28, 28))
    assert tuple(out.shape) == (2, 1024, 3, 3)
    assert tuple(model(torch.rand(2, 1, 28, 28)).shape) == (2, 10)


def test_quick_mnist_model_is_the_seed_architecture_at_an_eighth_of_the_widths():
    mod = load_script("amp_ema_step")
    full, quick = mod.mnist_cnn(), mod.mnist_cnn(quick=True)
    assert [(n, type(m)) for n, m in quick.named_modules()] == [(n, type(m)) for n, m in full.named_modules()]

    def convs(model):
        return [(c.in_channels, c.out_channels, c.kernel_size, c.stride, c.padding, c.bias is not None)
                for c in model.modules() if isinstance(c, torch.nn.Conv2d)]

    assert convs(quick) == [(1 if i == 0 else cin // 8, cout // 8, k, s, p, b)
                            for i, (cin, cout, k, s, p, b) in enumerate(convs(full))]
    assert [m.num_features for m in quick.modules() if isinstance(m, torch.nn.BatchNorm2d)] == \
        [c[1] for c in convs(quick)]
    assert [(m.in_features, m.out_features) for m in quick.modules() if isinstance(m, torch.nn.Linear)] == \
        [(128, 125), (125, 125), (125, 10)]
    assert tuple(quick(torch.rand(2, 1, 28, 28)).shape) == (2, 10)


@pytest.mark.parametrize("device", DEVICES)
def test_amp_ema_step_quick_run_writes_report(tmp_path, device):
    _, report = quick_run("amp_ema_step", tmp_path, device, "--warmup", "2")

    for key in ("device_kind", "device_name", "torch_version", "num_threads", "config", "models", "results",
                "targets", "all_targets_met", "elapsed_s"):
        assert key in report, key
    assert report["device_kind"] == device
    assert report["device_name"]
    assert report["torch_version"] == torch.__version__
    assert report["num_threads"] >= 1
    cfg = report["config"]
    assert cfg["quick"] is True and cfg["warmup"] == 2
    assert cfg["autocast_dtype"] == ("fp16" if device == "cuda" else "bf16")
    assert set(report["results"]) == set(MODELS)
    assert report["models"]["mnist_cnn"]["sizes"]["conv_blocks"] == 14
    assert report["models"]["transformer"]["sizes"]["seq"] >= 1

    for model in MODELS:
        res = report["results"][model]
        assert res["num_params"] > 0
        assert set(res["variants"]) == VARIANTS
        for name, v in res["variants"].items():
            for part in ("step", "tail"):
                assert len(v[part]["times_ms"]) == cfg["repeats"]
                assert v[part]["median_ms"] > 0 and v[part]["min_ms"] > 0
            # The tail is a part of the step.
            assert v["tail"]["median_ms"] <= v["step"]["median_ms"] * 1.001 + 1e-3, (model, name)
            assert math.isfinite(v["loss_after_warmup"])
            assert v["final_loss_scale"] > 0
            assert v["skipped_steps"] >= 0
            if device == "cpu":  # bf16 autocast: nothing overflows, no step is skipped
                assert v["final_loss_scale"] == cfg["init_loss_scale"] and v["skipped_steps"] == 0
        ratios = res["ratios"]
        for k in ("step_torch_over_fusetrain", "tail_torch_over_fusetrain", "ema_overhead_pct",
                  "ema_overhead_tail_based_pct"):
            assert math.isfinite(ratios[k]), k
        assert ratios["step_torch_over_fusetrain"] > 0 and ratios["tail_torch_over_fusetrain"] > 0

        # Same work: all variants start from the same model, data and dropout
        # seed, so the first loss is the same; the EMA does not change
        # training, so (b) and (c) still agree after an update; torch differs
        # by rounding only. (On GPU, backward kernels with atomics may differ
        # in the last bits between runs, so (b) vs (c) gets a looser bound.)
        vs = res["variants"]
        first = vs["torch"]["loss_first_step"]
        assert vs["fusetrain"]["loss_first_step"] == pytest.approx(first, rel=1e-6)
        assert vs["fusetrain_no_ema"]["loss_first_step"] == pytest.approx(first, rel=1e-6)
        b_c = abs(vs["fusetrain"]["loss_after_warmup"] - vs["fusetrain_no_ema"]["loss_after_warmup"])
        if device == "cpu":
            assert b_c <= 1e-6 * abs(first)
        # One update moved the loss (by ~0.04 on CPU); torch and fusetrain
        # moved it alike. Checked when no step was skipped: an fp16 run may
        # skip its first step on overflow, and then nothing moved yet.
        if all(v["skipped_steps"] == 0 for v in vs.values()):
            moved = vs["torch"]["loss_after_warmup"] - first
            assert abs(moved) > 1e-3
            assert abs(vs["fusetrain"]["loss_after_warmup"] - vs["torch"]["loss_after_warmup"]) < 0.1 * abs(moved)
            assert b_c < 0.1 * abs(moved)
        # The EMAs moved (the EMA really rode along); (c) has none.
        assert vs["torch"]["ema_max_abs_change"] > 0
        assert vs["fusetrain"]["ema_max_abs_change"] > 0
        assert vs["fusetrain"]["ema_max_abs_change"] == pytest.approx(vs["torch"]["ema_max_abs_change"], rel=0.5)
        assert vs["fusetrain_no_ema"]["ema_max_abs_change"] is None

    names = {(t["model"], t["name"]) for t in report["targets"]}
    assert len(names) == 3 * len(MODELS)
    for t in report["targets"]:
        assert set(t) >= {"name", "model", "value", "threshold", "op", "met", "applies"}
        assert isinstance(t["met"], bool)
        if "EMA overhead" in t["name"]:
            assert t["applies"] is (device == "cuda")
    assert report["all_targets_met"] == all(t["met"] for t in report["targets"] if t["applies"])
