"""benchmarks/lean_accuracy.py: the overrides it builds for a recipe, the run
summary it parses, the per-seed differences it averages (hand-computed), the
finished runs it reuses, and a one-epoch, one-seed run of two configurations
(then a --merge sweep that adds a seed) that writes its report to a temporary
path (never over the committed results)."""

import json
import subprocess
import sys

import pytest

from _bench_helpers import REPO, load_script, script_path


def test_overrides_add_missing_keys_and_change_present_ones():
    mod = load_script("lean_accuracy")
    # The default recipe has mixed_precision and optimizer_params, not weights_dtype or state_dtype.
    assert mod.recipe_overrides("default", mod.CONFIGS["bf16_remainder_bf16state"][1]) == [
        "+training_params.weights_dtype=bfloat16",
        "training_params.mixed_precision=bf16",
        "+training_params.optimizer_params.master_weights=remainder",
        "+training_params.optimizer_params.state_dtype=bfloat16",
    ]
    assert mod.recipe_overrides("default", mod.CONFIGS["fp32"][1]) == []


@pytest.mark.parametrize("flag", ["--max-epochs", "--max-train-batches"])
def test_a_limit_below_one_is_refused_before_any_run(tmp_path, monkeypatch, capsys, flag):
    mod = load_script("lean_accuracy")
    monkeypatch.setattr(mod, "run_one", lambda *a, **k: pytest.fail("a run started"))
    out = tmp_path / "lean_accuracy.json"
    with pytest.raises(SystemExit) as e:
        mod.main(["--device", "cpu", flag, "0", "--out", str(out)])
    assert e.value.code == 2 and f"{flag}: expected an integer >= 1, got 0" in capsys.readouterr().err
    assert not out.exists()


def test_final_summary_is_the_last_json_object():
    mod = load_script("lean_accuracy")
    last = {"final": {"epoch": 2, "valid_accuracy": 0.5}, "best": {"metric": "accuracy", "value": 0.6, "epoch": 1}}
    stdout = ("Epoch: 1, Loss: 1.0 {not json}\n" + json.dumps({"final": {}, "best": {}}) + "\n"
              + json.dumps(last, indent=2) + "\n")
    assert mod.final_summary(stdout) == last
    assert mod.final_summary("Epoch: 1, Loss: 1.0\n{\n  \"final\": {\n") is None


def test_summary_differences_are_per_seed_means():
    mod = load_script("lean_accuracy")

    def run(config, seed, final, best):
        return {"config": config, "seed": seed, "final": final, "best": best, "wall_s": 10.0}

    runs = [dict(run("fp32", 0, 0.90, 0.92), final_valid={"valid_loss": 0.5}),
            dict(run("fp32", 1, 0.80, 0.81), final_valid={"valid_loss": 0.7}),
            run("bf16_master", 0, 0.91, 0.92), run("bf16_master", 1, 0.80, 0.82),
            run("fp32w_bf16state", 0, 0.88, 0.90), run("fp32w_bf16state", 1, 0.81, 0.81),
            run("fp32w_bf16state", 2, 0.99, 0.99),  # no fp32 run of seed 2: left out of the differences
            {"config": "bf16_remainder_bf16state", "seed": 0, "wall_s": 1.0, "returncode": 1}]
    s = mod.summarize(runs, ["fp32", "bf16_master", "fp32w_bf16state", "bf16_remainder_bf16state"])
    row = s["fp32w_bf16state"]
    assert row["n"] == 3 and row["seeds"] == [0, 1, 2]
    assert row["final_mean"] == pytest.approx((88 + 81 + 99) / 3)
    assert (row["final_min"], row["final_max"]) == (pytest.approx(81), pytest.approx(99))
    assert row["final_diff_vs_fp32_per_seed"] == [pytest.approx(-2), pytest.approx(1)]
    assert row["final_diff_vs_fp32"] == pytest.approx(-0.5)
    assert row["final_diff_vs_fp32_sem"] == pytest.approx(1.5)  # stdev of (-2, 1) = sqrt(4.5), over sqrt(2)
    assert "valid_loss_mean" not in row and s["fp32"]["valid_loss_mean"] == pytest.approx(0.6)
    assert row["final_diff_vs_bf16_master"] == pytest.approx((-3 + 1) / 2)
    assert row["best_diff_vs_fp32"] == pytest.approx((-2 + 0) / 2)
    assert s["fp32"]["final_diff_vs_fp32"] == 0
    assert s["bf16_remainder_bf16state"] == {"n": 0}


def test_reusable_runs_need_the_same_sweep_settings():
    mod = load_script("lean_accuracy")
    ov = {"fp32": [], "fp32w_bf16state": ["+training_params.optimizer_params.state_dtype=bfloat16"]}
    done = {"config": "fp32", "seed": 0, "final": 0.9}
    entry = {"config": {"max_epochs": None, "device": "cpu", "overrides": ov},  # an entry without max_train_batches
             "runs": [done, {"config": "fp32", "seed": 1, "returncode": 1},
                      {"config": "fp32w_bf16state", "seed": 0, "final": 0.8}]}
    whole = {"max_epochs": None, "max_train_batches": None}
    assert mod.reusable_runs(entry, whole, "cpu", ov) == {("fp32", 0): done, ("fp32w_bf16state", 0): entry["runs"][2]}
    assert mod.reusable_runs(entry, whole, "cpu", {"fp32": [], "fp32w_bf16state": []}) == {("fp32", 0): done}
    assert mod.reusable_runs(entry, {**whole, "max_epochs": 1}, "cpu", ov) == {}
    assert mod.reusable_runs(entry, {**whole, "max_train_batches": 2}, "cpu", ov) == {}
    assert mod.reusable_runs(entry, whole, "cuda", ov) == {}
    assert mod.reusable_runs(None, whole, "cpu", ov) == {}


def test_merge_keeps_the_earlier_runs_outside_the_sweep(tmp_path, monkeypatch):
    """A --merge sweep of seeds and configurations that are all in the file runs nothing, and the file's
    other finished runs of the same settings (another seed, another configuration) stay in its entry."""
    mod = load_script("lean_accuracy")

    def run(cfg, seed, final):
        return {"recipe": "default", "config": cfg, "seed": seed, "returncode": 0, "wall_s": 1.0,
                "metric": "accuracy", "final": final, "final_epoch": 1, "best": final, "best_epoch": 1,
                "final_valid": {"valid_loss": 0.5, "valid_accuracy": final}}

    overrides = {c: mod.recipe_overrides("default", mod.CONFIGS[c][1]) for c in mod.CONFIGS}
    earlier = [run("fp32", 0, 0.90), run("bf16_remainder_bf16state", 0, 0.88), run("fp32", 1, 0.92),
               {"recipe": "default", "config": "fp32", "seed": 2, "returncode": 1, "final": None}]
    other = {"config": {}, "runs": []}
    out = tmp_path / "lean_accuracy.json"
    out.write_text(json.dumps({"recipes": {"digits_detection": other, "default": {
        "config": {"max_epochs": 1, "device": "cpu", "overrides": overrides}, "runs": earlier}}}))
    monkeypatch.setattr(mod, "run_one", lambda *a, **k: pytest.fail("a kept run was run again"))
    monkeypatch.setattr(sys, "argv", ["lean_accuracy.py", "--device", "cpu", "--max-epochs", "1", "--seeds", "1",
                                      "--configs", "fp32", "--merge", "--out", str(out)])
    mod.main()
    report = json.loads(out.read_text())
    entry = report["recipes"]["default"]
    assert report["recipes"]["digits_detection"] == other
    assert [(r["config"], r["seed"]) for r in entry["runs"]] == [
        ("fp32", 0), ("bf16_remainder_bf16state", 0), ("fp32", 1)]  # the failed run is not kept
    assert entry["kept_runs"] == 3
    assert entry["config"]["seeds"] == [0, 1] and entry["config"]["configs"] == ["fp32", "bf16_remainder_bf16state"]
    assert entry["summary"]["fp32"]["n"] == 2
    assert entry["summary"]["bf16_remainder_bf16state"]["final_diff_vs_fp32"] == pytest.approx(-2.0)
    assert entry["complete"] is True and entry["targets"]["bf16_remainder_bf16state"]["met"] is False


def test_an_interrupted_sweep_leaves_a_whole_entry(tmp_path, monkeypatch):
    """The report written after each run holds the entry's summary, targets and counts so far: a sweep cut off
    after its first run (here by a KeyboardInterrupt in the second) leaves an entry a reader can use."""
    mod = load_script("lean_accuracy")
    done = []

    def run_one(recipe, cfg, seed, *a, **k):
        if done:
            raise KeyboardInterrupt
        done.append(cfg)
        return {"recipe": recipe, "config": cfg, "seed": seed, "returncode": 0, "wall_s": 1.0, "metric": "accuracy",
                "final": 0.9, "final_epoch": 1, "best": 0.9, "best_epoch": 1,
                "final_valid": {"valid_loss": 0.5, "valid_accuracy": 0.9}}

    out = tmp_path / "lean_accuracy.json"
    monkeypatch.setattr(mod, "run_one", run_one)
    monkeypatch.setattr(sys, "argv", ["lean_accuracy.py", "--device", "cpu", "--max-epochs", "1", "--seeds", "5,6",
                                      "--configs", "fp32,bf16_remainder_bf16state", "--out", str(out)])
    with pytest.raises(KeyboardInterrupt):
        mod.main()
    entry = json.loads(out.read_text())["recipes"]["default"]
    assert entry["complete"] is False and entry["config"]["seeds"] == [5, 6]
    assert [(r["config"], r["seed"]) for r in entry["runs"]] == [("fp32", 5)]
    assert entry["metric"] == "accuracy" and entry["kept_runs"] == 0 and entry["failed_runs"] == []
    assert entry["summary"]["fp32"]["n"] == 1 and entry["targets"]["bf16_remainder_bf16state"]["met"] is None


@pytest.mark.slow
@pytest.mark.bench
def test_one_epoch_run_writes_report(tmp_path):
    out = tmp_path / "lean_accuracy.json"
    smoke = ["--device", "cpu", "--max-epochs", "1", "--max-train-batches", "2"]
    proc = subprocess.run([sys.executable, script_path("lean_accuracy"), *smoke,
                           "--seeds", "3", "--configs", "fp32,bf16_remainder_bf16state", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "TARGET [cpu] [default] bf16_remainder_bf16state" in proc.stdout
    report = json.loads(out.read_text())
    entry = report["recipes"]["default"]
    assert entry["config"]["configs"] == ["fp32", "bf16_remainder_bf16state"]
    assert entry["metric"] == "accuracy" and entry["failed_runs"] == []
    assert [(r["config"], r["seed"]) for r in entry["runs"]] == [("fp32", 3), ("bf16_remainder_bf16state", 3)]
    for r in entry["runs"]:
        assert r["returncode"] == 0 and r["final_epoch"] == 1 and 0 <= r["final"] <= 1
        assert r["final"] == r["final_valid"]["valid_accuracy"] and r["best_epoch"] == 1
        assert "training_params.max_epochs=1" in r["command"] and "training_params.seed=3" in r["command"]
        assert "training_params.max_train_batches=2" in r["command"]
    assert entry["config"]["max_epochs"] == 1 and entry["config"]["max_train_batches"] == 2
    assert "+training_params.optimizer_params.state_dtype=bfloat16" in entry["runs"][1]["command"]
    assert entry["summary"]["bf16_remainder_bf16state"]["final_diff_vs_fp32"] == pytest.approx(
        100 * (entry["runs"][1]["final"] - entry["runs"][0]["final"]))

    # A second sweep with --merge keeps the finished runs of seed 3 (the fp32 one without running it again)
    # and runs seed 4 only.
    proc = subprocess.run([sys.executable, script_path("lean_accuracy"), *smoke,
                           "--seeds", "3,4", "--configs", "fp32", "--merge", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("(kept from") == 1
    again = json.loads(out.read_text())["recipes"]["default"]
    assert again["runs"][:2] == entry["runs"] and again["kept_runs"] == 2
    assert [(r["config"], r["seed"]) for r in again["runs"]] == [
        ("fp32", 3), ("bf16_remainder_bf16state", 3), ("fp32", 4)]
