"""The launch templates of docs/distributed.md ("Preemptible and elastic
clusters"), run as shipped on this machine (CPU processes, gloo), with
stand-ins for what only a cluster has:

* the sbatch script with Slurm's variables set, ``srun`` and ``scontrol`` as
  scripts on PATH: a SIGUSR1 writes a checkpoint and requeues once, and the
  requeued job (the same script) continues and finishes;
* the Kubeflow Trainer TrainJob's command with the ``PET_*`` variables its
  runtime sets: SIGTERM to torchrun (a pod deleted) writes a checkpoint, and
  the restarted pod (the same command) continues and finishes;
* the torchrun elastic command with ``--max-restarts=1``: a rank killed with
  SIGKILL once, the restarted workers continue from the latest checkpoint and
  the run ends bit-identical to one never killed.
"""

import os
import re
import signal
import socket
import subprocess

import pytest
import torch
import torch.distributed as dist
import yaml

from fusetrain.training.checkpoint.files import load_checkpoint

pytestmark = [pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                 reason="needs torch.distributed with the gloo backend"),
              pytest.mark.dist, pytest.mark.slow]

from _test_helpers import TESTS as HERE  # where the helpers are
from _test_helpers import run_path
DOC = os.path.join(HERE, "..", "..", "docs", "distributed.md")
# A small CPU run: 2 epochs of 4 steps, each step validated on one batch (a "Step: N" line); the ranks agree on
# a stop after every step (log_interval).
TINY = ["training_params.max_epochs=2", "training_params.max_train_batches=4", "training_params.max_valid_batches=1",
        "training_params.progress_bar=false", "dataset_params.image_size=8", "dataset_params.batch_size=16",
        "training_params.device=cpu", "++training_params.log_interval=1", "++training_params.valid_every_n_steps=1"]


def template(heading, language):
    """The first ``language`` code block after ``heading`` in docs/distributed.md."""
    with open(DOC) as f:
        text = f.read()
    after = text[text.index(heading):]
    return re.search(rf"```{language}\n(.*?)```", after, re.S).group(1)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def environment(tmp_path, **extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([HERE] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    for k in [k for k in env if k.startswith(("SLURM_", "PET_", "TORCHELASTIC_")) or k in (
            "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")]:
        env.pop(k)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run(cmd, env, timeout=240, **kw):
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, **kw)
    return done.returncode, done.stdout + done.stderr


def step_of(path):
    return load_checkpoint(str(path))["global_step"]


def test_slurm_sbatch_template(tmp_path):
    script = tmp_path / "train.sbatch"
    script.write_text(template("### Slurm", "bash"))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # srun: run the command on this node (its options dropped); scontrol: the node list, and requeue recorded.
    (bin_dir / "srun").write_text('#!/bin/bash\nwhile [ "${1#-}" != "$1" ]; do shift; done\nexec "$@"\n')
    (bin_dir / "scontrol").write_text('#!/bin/bash\nif [ "$1" = show ]; then echo 127.0.0.1; exit 0; fi\n'
                                      'echo "$@" >> "$SCONTROL_CALLS"\n')
    for f in ("srun", "scontrol"):
        (bin_dir / f).chmod(0o755)
    calls = tmp_path / "calls.txt"
    env = environment(tmp_path, PATH=f"{bin_dir}:{os.environ['PATH']}", SCONTROL_CALLS=calls, SLURM_JOB_ID=77,
                      SLURM_JOB_NODELIST="node001", SLURM_JOB_NUM_NODES=1, SLURM_GPUS_ON_NODE=2, SLURM_NODEID=0,
                      SLURM_PROCID=0, RDZV_PORT=free_port(), PET_LOCAL_ADDR="127.0.0.1", EXPERIMENT="slurm",
                      FUSETRAIN_TEST_SIGNAL_STEP=3)
    args = ["bash", str(script), *TINY, f"ckpt_root_dir={tmp_path}",
            "++training_params.callbacks=[_preemption_helpers.SignalAtStep]"]
    code, out = run(args, env)
    assert code != 0 and "SIGUSR1 received: stopping after this step" in out, out  # torchrun reports the stop
    assert calls.read_text() == "requeue 77\n", out
    latest = run_path(tmp_path, "slurm", "ckpt_latest.pth")
    ck = load_checkpoint(str(latest))
    assert ck["global_step"] == 3 and ck["world_size"] == 2 and ck["position"]["batches"] == 3
    code, out = run(args, env)  # the requeued job: the same script
    assert code == 0, out
    assert "resume: auto: continuing from" in out and step_of(latest) == 8
    assert calls.read_text() == "requeue 77\n"


def test_kubeflow_trainjob_template(tmp_path):
    manifest = yaml.safe_load(template("### Kubernetes", "yaml"))
    assert manifest["kind"] == "TrainJob" and manifest["spec"]["runtimeRef"]["name"] == "torch-distributed"
    trainer = manifest["spec"]["trainer"]
    args = [f"ckpt_root_dir={tmp_path}" if a.startswith("ckpt_root_dir=") else a for a in trainer["args"]]
    cmd = [*trainer["command"], *args, *TINY, "++training_params.callbacks=[_preemption_helpers.SlowSteps]"]
    env = environment(tmp_path, PET_NNODES=1, PET_NPROC_PER_NODE=2, PET_NODE_RANK=0, PET_MASTER_ADDR="127.0.0.1",
                      PET_MASTER_PORT=free_port(), FUSETRAIN_TEST_STEP_SLEEP=0.3)
    # The pod is deleted: SIGTERM to torchrun (the container's command), which passes it on.
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("step 2 |"):
                proc.send_signal(signal.SIGTERM)
                break
        lines.append(proc.communicate(timeout=120)[0])
    finally:
        proc.kill()
    out = "".join(lines)
    assert "SIGTERM received: stopping after this step" in out, out
    latest = run_path(tmp_path, "digits_cnn", "ckpt_latest.pth")  # the run folder it made; the restart continues it
    ck = load_checkpoint(str(latest))
    assert ck["world_size"] == 2 and ck["position"] is not None and 2 <= ck["global_step"] < 8
    env["FUSETRAIN_TEST_STEP_SLEEP"] = "0"
    code, out = run(cmd, env)  # the pod restarted: the same command
    assert code == 0, out
    assert "resume: auto: continuing from" in out and step_of(latest) == 8


def test_torchrun_max_restarts_template_survives_a_killed_rank(tmp_path):
    command = template("### torchrun elastic restarts", "bash").replace("\\\n", " ").strip()
    command = (command.replace("--nnodes=1:4", "--nnodes=1").replace("--nproc_per_node=8", "--nproc_per_node=2")
               .replace("--max-restarts=3", "--max-restarts=1"))
    assert command.startswith("TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun ") and "resume=auto" in command
    tiny = " ".join([*TINY[:-1], "++training_params.ckpt_every_n_steps=2"])
    env = environment(tmp_path, RDZV_HOST="127.0.0.1", PET_LOCAL_ADDR="127.0.0.1", FUSETRAIN_TEST_KILL_RANK=1,
                      FUSETRAIN_TEST_KILL_STEP=7)
    kill = "'++training_params.callbacks=[_preemption_helpers.KillOnce]'"
    # The template as shipped, and plain `torchrun --standalone --nproc_per_node=2 --max-restarts=1` (one node:
    # fusetrain keeps the restarted round's store apart, NOTE [restart store]); rank 1 is killed at step 7.
    head, tail = command.split(" --rdzv-backend")[0], command.split("--no-python fusetrain-train ")[1]
    plain = (f"{head.replace('TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 ', '').replace(' --nnodes=1', '')} --standalone "
             f"--no-python fusetrain-train {tail}")
    runs = {"template": command.replace("29400", str(free_port())), "plain": plain}
    for name, cmd in runs.items():
        code, out = run(["bash", "-c", f"{cmd} ckpt_root_dir={tmp_path}/{name} {tiny} {kill}"], env)
        assert code == 0, out
        assert "rank 1: SIGKILL at step 7" in out and "resume: auto: continuing from" in out, out
        assert "(optimizer step 6, inside epoch 2, written by 2 process(es))" in out, out
    # The same run never killed: each restart continued the mid-epoch checkpoint of step 6 bit-exactly.
    whole = command.replace("29400", str(free_port()))
    code, out = run(["bash", "-c", f"{whole} ckpt_root_dir={tmp_path}/whole {tiny}"], env)
    assert code == 0, out
    b = load_checkpoint(run_path(tmp_path / "whole", "digits_cnn", "ckpt_latest.pth"))
    assert b["global_step"] == 8
    for name in runs:
        a = load_checkpoint(run_path(tmp_path / name, "digits_cnn", "ckpt_latest.pth"))
        assert a["global_step"] == 8
        for k in b["model"]:
            assert torch.equal(a["model"][k], b["model"][k]), (name, k)
