"""Smoke test of benchmarks/optim_memory.py: a --quick run exits 0, reports every configuration (run, skipped
with its error, or not installed) and counts the bytes of the reference configurations as computed by hand."""

import importlib.util

import pytest
import torch

from _bench_helpers import DEVICES, load_script, quick_run

pytestmark = pytest.mark.bench  # runs benchmarks/ scripts: deselected in the inner loop (README, Tests)

D, BLOCKS = 64, 2  # the --quick model
N = BLOCKS * (3 * D * D + 3 * D + D * D + D + 4 * D * D + 4 * D + 4 * D * D + D)  # weights + biases
TENSORS = BLOCKS * 4 * 2


def test_quick_model_and_byte_count():
    mod = load_script("optim_memory")
    model = mod.build_model(D, BLOCKS, torch.device("cpu"))
    assert sum(p.numel() for p in model.parameters()) == N == mod.model_params(D, BLOCKS) == 99_456
    assert len(list(model.parameters())) == TENSORS

    p = torch.zeros(3, 4, dtype=torch.bfloat16)
    m = torch.zeros(3, 4)
    state = {p: {"step": torch.zeros(()), "exp_avg": m, "same_again": m, "remainder": torch.zeros(3, 4,
                                                                                                   dtype=torch.int16)}}
    counted = mod.count_bytes([p], state, [torch.zeros(3, 4, dtype=torch.bfloat16)])
    # bf16 param 24 + fp32 moment 48 (held twice, counted once) + int16 24 + 0-d step 4 + bf16 EMA 24.
    assert counted["by_key"] == {"param": 24, "step": 4, "exp_avg": 48, "same_again": 0, "remainder": 24, "ema": 24}
    assert counted["total"] == 124 and counted["other"] == 4


@pytest.mark.parametrize("ema, ema_rem", [(False, False), (True, False), (True, True)],
                         ids=["no_ema", "ema", "ema_remainders"])
@pytest.mark.parametrize("device", DEVICES)
def test_optim_memory_quick_run_counts_bytes(tmp_path, device, ema, ema_rem):
    mod = load_script("optim_memory")
    flags = ["--ema"] * ema + ["--ema-remainders"] * ema_rem
    _, report = quick_run("optim_memory", tmp_path, device, *flags)

    for key in ("device_kind", "device_name", "torch_version", "fusetrain_version", "num_threads", "loadavg_start",
                "config", "results", "targets", "all_targets_met"):
        assert key in report, key
    assert report["device_kind"] == device and report["torch_version"] == torch.__version__
    cfg = report["config"]
    assert cfg["num_params"] == N and cfg["num_tensors"] == TENSORS and cfg["ema"] is ema
    assert cfg["ema_remainders"] is ema_rem
    results = report["results"]
    assert list(results) == [c.name for c in mod.CONFIGS]

    # By hand: fp32 AdamW holds param + exp_avg + exp_avg_sq, 4 bytes each per element, and a 0-d float32
    # step per tensor; bf16 params with an fp32 master hold 2 + 4 + 4 + 4. An EMA is one more param copy, with
    # --ema-remainders and bf16 params an int16 remainder beside it.
    hand = {
        "torch_fp32": {"param": 4 * N, "exp_avg": 4 * N, "exp_avg_sq": 4 * N, "step": 4 * TENSORS},
        "bf16_master_fp32": {"param": 2 * N, "master_param": 4 * N, "exp_avg": 4 * N, "exp_avg_sq": 4 * N,
                             "step": 4 * TENSORS},
    }
    per_elem = {"torch_fp32": 12 + 4 * ema, "bf16_master_fp32": 14 + 2 * ema + 2 * ema_rem}
    for name, by_key in hand.items():
        e = results[name]
        assert e["status"] == "ok", e
        if ema:
            by_key = dict(by_key, ema=by_key["param"])
        if ema_rem and name == "bf16_master_fp32":
            by_key = dict(by_key, ema_remainder=2 * N)
        assert e["bytes"] == by_key
        assert e["total_bytes"] == sum(by_key.values()) and e["other_state_bytes"] == 4 * TENSORS
        assert e["bytes_per_param"] == pytest.approx(sum(by_key.values()) / N)
        assert e["bytes_per_elem"] == per_elem[name] == e["expected_bytes_per_elem"]
    assert results["bf16_master_fp32"]["state_dtypes"]["master_param"] == "float32"
    assert results["torch_fp32"]["vs"]["a"]["bytes_per_param"] == pytest.approx(1.0)
    assert results["bf16_master_fp32"]["vs"]["a"]["bytes_per_param"] == pytest.approx(
        (14 * N + 4 * TENSORS + 2 * N * ema + 2 * N * ema_rem) / (12 * N + 4 * TENSORS + 4 * N * ema))
    assert results["torch_fp32"]["vs"]["b"]["median_ms"] == pytest.approx(
        results["torch_fp32"]["median_ms"] / results["bf16_master_fp32"]["median_ms"])
    if device == "cuda":
        assert results["torch_fp32"]["peak_bytes"] >= results["torch_fp32"]["total_bytes"]

    torchao = importlib.util.find_spec("torchao") is not None
    assert (results["torchao_8bit_fp32"]["status"] == "not installed") is not torchao

    targets = {t["config"]: t for t in report["targets"]}
    for name, e in results.items():
        assert e["status"] in ("ok", "skipped", "not installed"), e
        if e["status"] != "ok":
            assert e["error"], name
            continue
        assert len(e["times_ms"]) == cfg["repeats"] and e["median_ms"] > 0
        assert e["vs"]["a"]["median_ms"] > 0
        if e["expected_bytes_per_elem"] is not None:
            # Each layout, once the optimizer offers it, holds exactly the bytes it promises.
            assert e["bytes_per_elem"] == e["expected_bytes_per_elem"], (name, e["bytes"])
            assert targets[name]["met"] is True
        options = e["options"]
        if options.get("master_weights") == "remainder":
            assert e["state_dtypes"]["master_remainder"] == "int16" and "master_param" not in e["bytes"]
        if options.get("master_weights") == "stochastic":
            assert "master_param" not in e["bytes"] and "master_remainder" not in e["bytes"]
        if options.get("state_dtype") == "bfloat16":
            assert e["state_dtypes"]["exp_avg"] == e["state_dtypes"]["exp_avg_sq"] == "bfloat16"


def test_ema_remainders_need_the_ema(capsys):
    mod = load_script("optim_memory")
    with pytest.raises(SystemExit) as exc:
        mod.main(["--quick", "--ema-remainders"])
    assert exc.value.code == 2 and "--ema-remainders is a form of the EMA: give --ema too" in capsys.readouterr().err
