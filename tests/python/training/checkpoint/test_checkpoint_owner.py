"""The checkpoint's one owner (CheckpointManager): components take part by the Stateful protocol (a user
callback with a state registers itself and is restored), the manager keeps its record and refuses what cannot
be a component, and a file of an older schema reads through the converter while a newer one is refused."""

import os

import pytest
import torch

from fusetrain import Callback
from fusetrain.training.checkpoint.manager import CheckpointManager, CheckpointSettings
from fusetrain.training.checkpoint.schema import SCHEMA_VERSION, upgrade

from _train_helpers import ckpt, one_thread, train  # noqa: F401  (fixture)


class CountSteps(Callback):
    """A callback with a state: the optimizer steps it has seen, over every session of the run."""

    def __init__(self):
        self.steps = 0
        self.restored = None

    def on_step_end(self, state):
        self.steps += 1

    def state_dict(self):
        return {"steps": self.steps}

    def load_state_dict(self, state):
        self.steps = self.restored = state["steps"]


def test_a_callback_with_a_state_is_checkpointed_and_restored(tmp_path):
    first = CountSteps()
    result, _ = train(tmp_path, max_epochs=1, callbacks=[first])
    assert first.steps == 3 and ckpt(result["run_dir"])["callbacks.CountSteps"] == {"steps": 3}
    again = CountSteps()
    resumed, _ = train(tmp_path, max_epochs=2, resume=True, callbacks=[again])
    assert again.restored == 3 and again.steps == 6
    assert ckpt(resumed["run_dir"])["callbacks.CountSteps"] == {"steps": 6}
    # Two of one class keep their own states.
    a, b = CountSteps(), CountSteps()
    twice, _ = train(tmp_path, "twice", max_epochs=1, callbacks=[a, b])
    saved = ckpt(twice["run_dir"])
    assert saved["callbacks.CountSteps"] == saved["callbacks.CountSteps_2"] == {"steps": 3}


def test_the_manager_takes_only_stateful_components_under_free_names(tmp_path):
    manager = CheckpointManager(str(tmp_path), CheckpointSettings(training_params={}))
    with pytest.raises(TypeError, match=r"register\('x'\): got int; allowed: an object with state_dict\(\) and "
                                        r"load_state_dict\(\)"):
        manager.register("x", 3)
    module = torch.nn.Linear(2, 2)
    manager.register("model", module)
    for taken in ("model", "epoch", "global_step", "training_params"):
        with pytest.raises(ValueError, match=rf"register: {taken!r} is taken"):
            manager.register(taken, module)
    manager.save(1, 5)
    manager.close()
    saved = torch.load(os.path.join(str(tmp_path), "ckpt_latest.pth"), weights_only=True)
    assert saved["schema_version"] == SCHEMA_VERSION and saved["epoch"] == 1 and saved["global_step"] == 5
    assert set(saved["model"]) == {"weight", "bias"}


def test_an_older_schema_is_converted_and_a_newer_one_refused():
    v1 = {"epoch": 2, "global_step": 8, "best": {"metric": "accuracy", "value": 0.5, "epoch": 1},
          "stale_epochs": 1, "skipped_steps": 3.0, "model": {}}
    ck = upgrade(dict(v1), "old.pth")
    assert ck["schema_version"] == SCHEMA_VERSION and ck["progress"] == {
        "best": v1["best"], "stale_epochs": 1, "skipped_steps": 3.0}
    assert "best" not in ck and ck["global_step"] == 8
    with pytest.raises(ValueError, match=r"new.pth was written by a newer fusetrain \(checkpoint schema 99"):
        upgrade({"schema_version": 99}, "new.pth")
