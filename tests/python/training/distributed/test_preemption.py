"""Preemption: ``preemption_signals`` stop a run after the step in flight
with a checkpoint, ``fusetrain-train`` exits with status 75, under Slurm
``auto_requeue`` calls ``scontrol requeue $SLURM_JOB_ID`` once (a stand-in
script on PATH records the call), and ``resume: auto`` is one command for
the first start and every restart."""

import pathlib
import os
import signal
import subprocess
import sys

import pytest

from fusetrain.training import TrainingParamsError, resolve_training_params
from fusetrain.training.checkpoint.files import load_checkpoint
from fusetrain.training.distributed.preemption import EXIT_PREEMPTED, requeues
from fusetrain.training.trainer import Trainer
from fusetrain.training.distributed.preemption import GracefulStop, TrainingInterrupted

from _train_helpers import cnn, loaders

from _test_helpers import TESTS as HERE  # where the helpers are
from _test_helpers import run_path


def test_preemption_params_are_validated():
    p = resolve_training_params({"resume": "auto", "preemption_signals": ["usr2", "SIGTERM", 10]})
    assert p.resume == "auto" and p.preemption_signals == ["SIGUSR2", "SIGTERM", "SIGUSR1"]
    assert resolve_training_params({}).preemption_signals == ["SIGTERM", "SIGUSR1"]
    assert resolve_training_params({}).auto_requeue is False
    for bad, match in ((["SIGKILL"], r"preemption_signals\[0\]: got 'SIGKILL'.*cannot be caught"),
                       (["SIGINT"], r"SIGINT is not allowed \(it always stops the run"),
                       (["SIGNOPE"], r"got 'SIGNOPE', which is no signal name here"),
                       (["SIGTERM", "TERM"], r"preemption_signals: got .*no duplicates")):
        with pytest.raises(TrainingParamsError, match=match):
            resolve_training_params({"preemption_signals": bad})
    with pytest.raises(TrainingParamsError, match=r"resume: got 'maybe' \(str\); allowed: a bool or 'auto'"):
        resolve_training_params({"resume": "maybe"})
    with pytest.raises(TrainingParamsError, match=r"overwrite_experiment: got True with resume"):
        resolve_training_params({"resume": "auto", "overwrite_experiment": True})
    assert TrainingInterrupted.exit_status == EXIT_PREEMPTED == 75
    # auto_requeue: not after a person's Ctrl-C nor scancel's SIGTERM (a job cancelled for good).
    assert [requeues(s) for s in ("SIGUSR1", "SIGUSR2", "SIGTERM", "SIGINT", None)] == [True, True, False, False,
                                                                                    False]


def test_auto_requeue_outside_slurm_is_an_error_before_anything_is_written(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with pytest.raises(TrainingParamsError, match=r"auto_requeue: got True but SLURM_JOB_ID is not set .*allowed "
                                                  r"outside Slurm: false"):
        Trainer("x", ckpt_root_dir=str(tmp_path)).train(cnn(), {"auto_requeue": True, "device": "cpu"}, *loaders())
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(TrainingParamsError, match=r"auto_requeue: got True but scontrol is not on PATH"):
        Trainer("x", ckpt_root_dir=str(tmp_path)).train(cnn(), {"auto_requeue": True, "device": "cpu"}, *loaders())
    assert os.listdir(tmp_path) == []


def test_a_repeated_preemption_signal_is_ignored_and_sigint_stops_at_once():
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGUSR1, signal.SIGTERM)}
    with pytest.raises(KeyboardInterrupt, match="SIGINT received twice"):
        with GracefulStop(["SIGUSR1", "SIGTERM"]) as stop:
            os.kill(os.getpid(), signal.SIGUSR1)
            assert stop.signal == "SIGUSR1"
            os.kill(os.getpid(), signal.SIGUSR1)  # a scheduler and torchrun may both deliver it
            os.kill(os.getpid(), signal.SIGTERM)
            assert stop.signal == "SIGUSR1"
            os.kill(os.getpid(), signal.SIGINT)
    assert {s: signal.getsignal(s) for s in before} == before


def test_resume_auto_starts_fresh_then_continues(tmp_path, capsys):
    params = dict(max_epochs=1, max_train_batches=2, max_valid_batches=1, progress_bar=False, device="cpu",
                  resume="auto")
    died = tmp_path / "auto" / "RUN_20000101_000000_000000"
    died.mkdir(parents=True)
    (died / "metrics.jsonl").write_text("")  # an attempt that died before its first checkpoint
    first = Trainer("auto", ckpt_root_dir=str(tmp_path)).train(cnn(), params, *loaders())
    assert f"resume: auto: no run of {tmp_path / 'auto'} has a checkpoint; starting a fresh run" in \
        capsys.readouterr().out
    assert first["run_dir"] != str(died) and (died / "metrics.jsonl").exists()  # a run folder of its own
    with pytest.warns(UserWarning, match=r"max_epochs: 1 -> 2"):
        result = Trainer("auto", ckpt_root_dir=str(tmp_path)).train(cnn(), dict(params, max_epochs=2), *loaders())
    out = capsys.readouterr().out
    latest = os.path.join(first["run_dir"], "ckpt_latest.pth")
    assert f"resume: auto: continuing from {latest} (optimizer step 2, after epoch 1, written by 1 process(es))" \
        in out
    assert result["final"]["epoch"] == 2 and result["run_dir"] == first["run_dir"]


def _scontrol_stand_in(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "scontrol"
    script.write_text('#!/bin/sh\necho "$@" >> "$SCONTROL_CALLS"\n')
    script.chmod(0o755)
    return bin_dir, tmp_path / "scontrol_calls.txt"


RECIPE = ["training_params.max_epochs=2", "training_params.max_train_batches=4", "training_params.max_valid_batches=1",
          "training_params.progress_bar=false", "dataset_params.image_size=8", "dataset_params.batch_size=16",
          "training_params.device=cpu", "++training_params.resume=auto"]


@pytest.mark.slow
def test_sigusr1_under_slurm_checkpoints_requeues_once_and_exits_75(tmp_path):
    bin_dir, calls = _scontrol_stand_in(tmp_path)
    env = dict(os.environ, SLURM_JOB_ID="4242", SCONTROL_CALLS=str(calls), PATH=f"{bin_dir}:{os.environ['PATH']}",
               PYTHONPATH=os.pathsep.join([HERE] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
               FUSETRAIN_TEST_SIGNAL_STEP="3", OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "fusetrain.train_from_recipe", *RECIPE, f"ckpt_root_dir={tmp_path}",
           "experiment_name=slurm", "++training_params.auto_requeue=true",
           "++training_params.callbacks=[_preemption_helpers.SignalAtStep]"]
    first = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    out = first.stdout + first.stderr
    assert first.returncode == EXIT_PREEMPTED, out
    assert "SIGUSR1 received: stopping after this step" in out and "auto_requeue: requeued Slurm job 4242" in out
    assert calls.read_text() == "requeue 4242\n"  # once, by rank 0, after the checkpoint
    ck = load_checkpoint(str(run_path(tmp_path, "slurm", "ckpt_latest.pth")))
    assert ck["global_step"] == 3 and ck["position"]["batches"] == 3
    # The requeued job runs the same command: it continues from the checkpoint and finishes.
    second = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    out = second.stdout + second.stderr
    assert second.returncode == 0, out
    assert "resume: auto: continuing from" in out and "inside epoch 1" in out
    assert load_checkpoint(str(run_path(tmp_path, "slurm", "ckpt_latest.pth")))["global_step"] == 8
    assert calls.read_text() == "requeue 4242\n"
