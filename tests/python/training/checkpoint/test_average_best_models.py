"""average_best_models: the weight average of the k best models by the
watched metric, written to average_model.pth, against hand-computed values."""

import math
import os

import pytest
import torch

from fusetrain import Callback
from fusetrain.training import TrainingParamsError, resolve_training_params
from fusetrain.training.checkpoint.average import BestModels, average_state_dicts

from _train_helpers import one_thread  # noqa: F401  (fixture)
from _train_helpers import assert_tree_equal, train


def test_average_of_floats_and_integer_counts():
    a = {"w": torch.tensor([1.0, 2.0]), "bn.running_var": torch.tensor([0.5]),
         "bn.num_batches_tracked": torch.tensor(3)}
    b = {"w": torch.tensor([2.0, 4.0]), "bn.running_var": torch.tensor([1.5]),
         "bn.num_batches_tracked": torch.tensor(4)}
    c = {"w": torch.tensor([6.0, 0.0]), "bn.running_var": torch.tensor([1.0]),
         "bn.num_batches_tracked": torch.tensor(6)}
    avg = average_state_dicts([a, b, c])
    assert torch.equal(avg["w"], torch.tensor([3.0, 2.0]))
    assert torch.equal(avg["bn.running_var"], torch.tensor([1.0]))
    assert avg["bn.num_batches_tracked"].dtype == torch.int64 and avg["bn.num_batches_tracked"].item() == 4  # 13 // 3
    half = average_state_dicts([{"h": torch.tensor([1.0], dtype=torch.float16)},
                                {"h": torch.tensor([2.0], dtype=torch.float16)}])["h"]
    assert half.dtype == torch.float16 and half.item() == 1.5


def _sd(v):
    return {"w": torch.tensor([float(v)])}


def test_the_k_best_are_kept():
    best = BestModels(2, greater_is_better=True)
    assert best.offer(1, 0.5, _sd(1)) and best.offer(2, 0.7, _sd(2))
    assert best.offer(3, 0.6, _sd(3))  # beats the worst kept (0.5)
    assert not best.offer(4, 0.6, _sd(4))  # a tie with the worst kept keeps the earlier model
    assert not best.offer(5, float("nan"), _sd(5)) and not best.offer(6, math.inf, _sd(6))
    assert sorted(e["epoch"] for e in best.summary()) == [2, 3]
    assert best.average()["w"].item() == 2.5
    low = BestModels(2, greater_is_better=False)
    for epoch, value in enumerate([0.9, 0.3, 0.5, 0.4], 1):
        low.offer(epoch, value, _sd(epoch))
    assert sorted(e["epoch"] for e in low.summary()) == [2, 4] and low.average()["w"].item() == 3.0


class Snapshots(Callback):
    """The model's weights and the epoch's row at each epoch end."""

    def __init__(self):
        self.epochs = []

    def on_epoch_end(self, state):
        self.epochs.append((state.metrics["valid_loss"], {k: v.clone() for k, v in state.model.state_dict().items()}))


PARAMS = dict(max_epochs=4, average_best_models=True, number_of_models_to_average=2, metric_to_watch="loss",
              greater_metric_to_watch_is_better=False, initial_lr=0.05)


def test_trainer_writes_the_average_of_the_best(tmp_path):
    snaps = Snapshots()
    result, model = train(tmp_path, callbacks=[snaps], **PARAMS)
    d = result["run_dir"]
    losses = [loss for loss, _ in snaps.epochs]
    assert len(set(losses)) == len(losses)
    best_two = sorted(range(4), key=lambda i: losses[i])[:2]
    a, b = (snaps.epochs[i][1] for i in best_two)
    expected = {}
    for k in a:  # by hand: floats averaged, integer counts floor-averaged
        if a[k].is_floating_point():
            expected[k] = ((a[k].double() + b[k].double()) / 2).to(a[k].dtype)
        else:
            expected[k] = (a[k] + b[k]) // 2
    saved = torch.load(os.path.join(d, "average_model.pth"), weights_only=True)
    assert_tree_equal(saved["model"], expected)
    assert sorted(e["epoch"] for e in saved["averaged"]) == sorted(i + 1 for i in best_two)
    avg = result["average_model"]
    assert avg["path"] == os.path.join(d, "average_model.pth") and set(avg["valid"]) >= {"valid_loss",
                                                                                         "valid_accuracy"}


def test_a_resumed_run_continues_the_average(tmp_path):
    straight, _ = train(tmp_path, "straight", **PARAMS)
    train(tmp_path, "cut", **dict(PARAMS, max_epochs=2))
    resumed, _ = train(tmp_path, "cut", resume=True, **PARAMS)
    want = torch.load(os.path.join(straight["run_dir"], "average_model.pth"), weights_only=True)
    got = torch.load(os.path.join(resumed["run_dir"], "average_model.pth"), weights_only=True)
    assert_tree_equal(got["model"], want["model"])
    assert got["averaged"] == want["averaged"]


def test_refusals():
    with pytest.raises(TrainingParamsError, match="average_best_models: got True with multi_gpu 'fsdp'"):
        resolve_training_params({"multi_gpu": "fsdp", "average_best_models": True})
    with pytest.raises(TrainingParamsError, match="number_of_models_to_average"):
        resolve_training_params({"number_of_models_to_average": 0})
