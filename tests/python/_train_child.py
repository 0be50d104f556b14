"""A small digits training run in its own process, for the tests that kill a
run or start two at once (test_trainer_reliability.py).

``python _train_child.py ROOT NAME MODE PARAMS_JSON``. MODE:
  run           train and exit
  hold          write ROOT/NAME.ready at on_train_start, then wait for ROOT/NAME.go
  kill_jsonl    SIGKILL itself halfway through appending epoch 2's metrics line
  kill_csv      SIGKILL itself while writing metrics.csv after epoch 2
  kill_ckpt     SIGKILL itself while writing epoch 2's ckpt_latest.pth
  kill_step:N   SIGKILL itself at the end of optimizer step N
  kill_ckpt_step:N  SIGKILL itself while writing the mid-epoch checkpoint of step N
PARAMS_JSON may hold ``_model``: extra keyword arguments of digits_cnn, and
``_step_sleep``: seconds to sleep after each optimizer step (a slower run).
"""

import json
import os
import signal
import sys
import time

import torch

from fusetrain.models import build_model
from fusetrain import Callback
from fusetrain.training.checkpoint import files as checkpoints
from fusetrain.training.logging import experiment_log
from fusetrain.training.data import build_dataloaders
from fusetrain.training.trainer import Trainer

FAST = dict(max_epochs=3, max_train_batches=2, max_valid_batches=1, progress_bar=False, device="cpu")


def die():
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


class Hold(Callback):
    def __init__(self, root, name):
        self.ready, self.go = os.path.join(root, name + ".ready"), os.path.join(root, name + ".go")

    def on_train_start(self, state):
        open(self.ready, "w").close()
        deadline = time.monotonic() + 60
        while not os.path.exists(self.go) and time.monotonic() < deadline:
            time.sleep(0.05)


class Sleep(Callback):
    def __init__(self, seconds):
        self.seconds = seconds

    def on_step_end(self, state):
        time.sleep(self.seconds)


class KillAtStep(Callback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, state):
        if state.global_step == self.step:
            die()


def patch(mode):
    if mode.startswith("kill_ckpt_step:"):
        step, original_save = int(mode.split(":")[1]), torch.save

        def save_or_die(obj, f, *args, **kwargs):
            if obj.get("global_step") == step and obj.get("position") is not None:
                f.write(b"PK\x03\x04" + b"\0" * 65536)
                f.flush()
                die()
            original_save(obj, f, *args, **kwargs)

        checkpoints.torch.save = save_or_die
    elif mode == "kill_jsonl":
        original = experiment_log.ExperimentLogger.log_epoch

        def log_epoch(self, row):
            if row["epoch"] == 2:
                line = json.dumps(row) + "\n"
                with open(self._jsonl, "a") as f:
                    f.write(line[: len(line) // 2])
                    f.flush()
                    os.fsync(f.fileno())
                die()
            original(self, row)

        experiment_log.ExperimentLogger.log_epoch = log_epoch
    elif mode == "kill_csv":
        original_write = experiment_log.ExperimentLogger._write_csv

        def write_csv(self):
            if len(self.rows) == 2:  # after the header and one row of epoch 2's rewrite

                class Dying(experiment_log.csv.DictWriter):
                    def writerow(self, r):
                        super().writerow(r)
                        die()

                experiment_log.csv.DictWriter = Dying
            original_write(self)

        experiment_log.ExperimentLogger._write_csv = write_csv
    elif mode == "kill_ckpt":
        original_save = torch.save

        def save(obj, f, *args, **kwargs):
            if obj.get("epoch") == 2:
                f.write(b"PK\x03\x04" + b"\0" * 65536)
                f.flush()
                die()
            original_save(obj, f, *args, **kwargs)

        checkpoints.torch.save = save


def main():
    root, name, mode, params = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    torch.set_num_threads(1)
    patch(mode)
    callbacks = [Hold(root, name)] if mode == "hold" else []
    if mode.startswith("kill_step:"):
        callbacks.append(KillAtStep(int(mode.split(":")[1])))
    if params.get("_step_sleep"):
        callbacks.append(Sleep(params.pop("_step_sleep")))
    params.pop("_step_sleep", None)
    tl, vl = build_dataloaders({"name": "digits", "batch_size": 32, "image_size": 12})
    torch.manual_seed(0)
    model = build_model("digits_cnn", num_classes=10, width=8, **params.pop("_model", {}))
    result = Trainer(name, ckpt_root_dir=root).train(model, {**FAST, "callbacks": callbacks, **params}, tl, vl)
    print("RESULT", json.dumps({"epochs": result["final"]["epoch"]}), flush=True)


if __name__ == "__main__":
    main()
