"""The Trainer on tasks other than classification, on the CPU with tiny models
and data: batches and outputs of any structure, loss components, models that
compute their own loss, metrics, callbacks, several validation loaders and a
test loader, the errors for bad input (raised before anything is written),
and the compiled step on nested structures."""

import json
import os

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import fusetrain
from fusetrain.training.logging.experiment_log import wait_for_plots
from fusetrain import Callback, Trainer, TrainStep
from fusetrain.models import build_model
from fusetrain.training import TrainingParamsError
from fusetrain.training.task.batches import BatchError
from fusetrain.training.data import build_dataloaders
from fusetrain.training.task.losses import LossOutputError
from fusetrain.training.task.metrics import MetricInputError

from _train_helpers import one_thread  # noqa: F401  (fixture)

FAST = dict(max_epochs=1, progress_bar=False, device="cpu")




class PairDataset(Dataset):
    """Items {"a": [4], "b": [2], "label": class, "id": int}: two inputs by name."""

    def __init__(self, n=24, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.a, self.b = torch.randn(n, 4, generator=g), torch.randn(n, 2, generator=g)
        self.y = (self.a[:, 0] + self.b[:, 0] > 0).long()

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {"a": self.a[i], "b": self.b[i], "label": self.y[i], "id": i}


class TwoInputNet(nn.Module):
    """forward(a, b) -> {"logits": [N, 2], "embedding": [N, 8]}."""

    def __init__(self):
        super().__init__()
        self.fa, self.fb, self.head = nn.Linear(4, 8), nn.Linear(2, 8), nn.Linear(8, 2)

    def forward(self, a, b):
        e = torch.tanh(self.fa(a) + self.fb(b))
        return {"logits": self.head(e), "embedding": e}


def forward_ab(model, inputs):
    """model_input: the dict batch's inputs hold an "id" the model does not take."""
    return model(inputs["a"], inputs["b"])


def loss_with_components(out, y):
    ce = nn.functional.cross_entropy(out["logits"], y)
    reg = 0.01 * out["embedding"].square().mean()
    return ce + reg, {"ce": ce, "reg": reg}


def pair_loaders(batch_size=8):
    return (DataLoader(PairDataset(24, 0), batch_size=batch_size, shuffle=True,
                       generator=torch.Generator().manual_seed(0)),
            DataLoader(PairDataset(16, 1), batch_size=batch_size))


def rows_of(d):
    with open(os.path.join(d, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


class Recorder(Callback):
    def __init__(self):
        self.calls, self.step_losses = [], []

    def _rec(name):
        def hook(self, state, *args):
            self.calls.append(name)
        return hook

    on_train_start, on_epoch_start, on_train_epoch_end, on_epoch_end, on_train_end = (
        _rec("train_start"), _rec("epoch_start"), _rec("train_epoch_end"), _rec("epoch_end"), _rec("train_end"))

    def on_step_end(self, state):
        assert state.loss.device.type == "cpu" and state.loss.dim() == 0  # a device tensor, not a float
        assert set(state.loss_components) == {"ce", "reg"}
        self.step_losses.append(state.loss.clone())
        self.calls.append("step")

    def on_validation_end(self, state, name, results):
        self.calls.append(f"valid:{name}:{sorted(results)}")

    def on_checkpoint_saved(self, state, path):
        self.calls.append(f"saved:{os.path.basename(path)}")

    def on_test_end(self, state, name, results):
        self.calls.append(f"test:{name}")


def test_dict_batches_components_callbacks_and_several_loaders(tmp_path):
    torch.manual_seed(0)
    train, valid = pair_loaders()
    rec = Recorder()
    params = dict(FAST, max_epochs=2, model_input=forward_ab, loss=loss_with_components, callbacks=[rec],
                  train_metrics=["accuracy"], valid_metrics=["accuracy"], metric_to_watch="other_accuracy")
    result = Trainer("pairs", ckpt_root_dir=str(tmp_path)).train(
        TwoInputNet(), params, train, {"main": valid, "other": pair_loaders()[1]}, test_loader=valid)
    row = result["final"]
    for k in ("train_loss", "train_loss_ce", "train_loss_reg", "train_accuracy", "valid_main_loss",
              "valid_main_loss_ce", "valid_main_accuracy", "valid_other_accuracy"):
        assert k in row, k
    assert row["train_loss"] == pytest.approx(row["train_loss_ce"] + row["train_loss_reg"], rel=1e-6)
    assert result["best"]["metric"] == "other_accuracy" and result["best"]["value"] == row["valid_other_accuracy"]
    assert set(result["test"]) == {"test_loss", "test_loss_ce", "test_loss_reg", "test_accuracy"}
    assert result["test"]["test_accuracy"] == row["valid_main_accuracy"]  # same weights, same data
    with open(os.path.join(result["run_dir"], "test_metrics.json")) as f:
        assert json.load(f) == result["test"]
    assert len(rec.step_losses) == 2 * 3
    epoch = ["epoch_start"] + ["step"] * 3 + ["train_epoch_end", "valid:main:['accuracy', 'loss', 'loss_ce', "
                                              "'loss_reg']", "valid:other:['accuracy', 'loss', 'loss_ce', 'loss_reg']",
                                              "epoch_end"]
    assert rec.calls[0] == "train_start" and rec.calls[1:1 + len(epoch)] == epoch
    assert "saved:ckpt_latest.pth" in rec.calls and rec.calls[-2:] == ["train_end", "test:"]
    # The components reach every log: CSV, JSONL, TensorBoard and the plot.
    with open(os.path.join(result["run_dir"], "metrics.csv")) as f:
        assert "train_loss_ce" in f.readline()
    assert rows_of(result["run_dir"])[-1]["valid_main_loss_reg"] == row["valid_main_loss_reg"]
    wait_for_plots(result["run_dir"])  # drawn after the call returns (NOTE [metrics plot])
    assert os.path.isfile(os.path.join(result["run_dir"], "metrics.png"))


class StopAfterFirstStep(Callback):
    def on_step_end(self, state):
        state.request_stop("one step is enough")


def test_a_callback_stops_training(tmp_path, capsys):
    train, valid = pair_loaders()
    result = Trainer("stop", ckpt_root_dir=str(tmp_path)).train(
        TwoInputNet(), dict(FAST, max_epochs=5, model_input=forward_ab, loss=loss_with_components,
                            callbacks=[StopAfterFirstStep()]), train, valid)
    assert [r["epoch"] for r in rows_of(result["run_dir"])] == [1]
    assert "Stopping after epoch 1: one step is enough" in capsys.readouterr().out


class OwnLoss(nn.Module):
    """Computes its own loss in train mode when given targets (as torchvision's
    detection models do) and returns scores in eval mode."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x, targets=None):
        out = self.lin(x)
        if self.training:
            return {"loss_ce": nn.functional.cross_entropy(out, targets), "loss_l2": 1e-3 * out.square().mean()}
        return out


def test_model_computing_its_own_loss(tmp_path):
    torch.manual_seed(0)
    x, y = torch.randn(32, 4), torch.randint(0, 3, (32,))
    loader = DataLoader(list(zip(x, y)), batch_size=8)
    result = Trainer("own", ckpt_root_dir=str(tmp_path)).train(
        OwnLoss(), dict(FAST, loss="model", train_metrics=[], valid_metrics=["accuracy"]), loader, loader)
    row = result["final"]
    assert row["train_loss"] == pytest.approx(row["train_loss_ce"] + row["train_loss_l2"], rel=1e-6)
    assert "valid_accuracy" in row and "valid_loss" not in row
    with pytest.raises(TrainingParamsError, match="metric_to_watch: got 'loss' with loss 'model'"):
        Trainer("own2", ckpt_root_dir=str(tmp_path)).train(OwnLoss(), dict(FAST, loss="model",
                                                                             metric_to_watch="loss"), loader)


@pytest.mark.parametrize("case", ["unsplittable_batch", "non_scalar_loss", "metric_cannot_handle_outputs",
                                  "unknown_loss", "unknown_metric", "unknown_callback", "unknown_watch"])
def test_bad_input_fails_before_anything_is_written(tmp_path, case):
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    model, loader, params = nn.Linear(4, 3), DataLoader(list(zip(x, y)), batch_size=8), dict(FAST)
    expected = {
        "unsplittable_batch": (BatchError, r"cannot split a training batch into inputs and targets: got Tensor\[8, 4\]"),
        "non_scalar_loss": (LossOutputError, r"the loss must be a scalar floating-point tensor \(reduce it, e.g. "
                                             r"reduction='mean'\); got Tensor\[8\] float32"),
        "metric_cannot_handle_outputs": (MetricInputError, r"train metric 'mean_iou' cannot handle the model's "
                                                           r"outputs: .*Outputs: Tensor\[8, 3\]"),
        "unknown_loss": (TrainingParamsError, r"unknown loss 'CrossEntropyLos'; did you mean 'CrossEntropyLoss'\?"),
        "unknown_metric": (TrainingParamsError, r"unknown metric 'acurracy'; did you mean 'accuracy'\?"),
        "unknown_callback": (TrainingParamsError, r"unknown callback 'ThresholdStp'; did you mean 'ThresholdStop'\?"),
        "unknown_watch": (TrainingParamsError, r"metric_to_watch: got 'mean_iou'"),
    }[case]
    if case == "unsplittable_batch":
        loader = DataLoader(x, batch_size=8)
    elif case == "non_scalar_loss":
        params["loss_params"] = {"reduction": "none"}
    elif case == "metric_cannot_handle_outputs":
        params["train_metrics"] = ["mean_iou"]  # [N, C] scores and [N] targets: fine; [N] targets needed per pixel
        y2 = torch.randint(0, 3, (16, 2))
        loader = DataLoader(list(zip(x, y2)), batch_size=8)
        params["loss"] = lambda out, t: out.mean()
    elif case == "unknown_loss":
        params["loss"] = "CrossEntropyLos"
    elif case == "unknown_metric":
        params["valid_metrics"] = ["acurracy"]
    elif case == "unknown_callback":
        params["callbacks"] = ["ThresholdStp"]
    else:
        params["metric_to_watch"] = "mean_iou"
    with pytest.raises(expected[0], match=expected[1]):
        Trainer("bad", ckpt_root_dir=str(tmp_path)).train(model, params, loader, loader)
    assert not os.path.exists(tmp_path / "bad")


# ---- the compiled step on structures ------------------------------------------------------------------------------

def pair_steps(mode, n, device="cpu", **kw):
    """``n`` steps of TwoInputNet on one batch of dict items split into a tuple
    of inputs; returns (per-step (logits, loss, components), parameters, step)."""
    batch = next(iter(pair_loaders()[0]))
    torch.manual_seed(0)
    model = TwoInputNet().to(device)
    opt = fusetrain.optim.AdamW(model.parameters(), lr=torch.tensor(0.01, device=device))
    step = TrainStep(model, loss_with_components, opt, mode=mode, model_input="unpack", **kw)
    outs = []
    for _ in range(n):
        out, loss = step((batch["a"].to(device), batch["b"].to(device)), batch["label"].to(device))
        outs.append((out["logits"].clone(), loss.clone(), {k: v.clone() for k, v in step.components.items()}))
    return outs, [p.detach().clone() for p in model.parameters()], step


def test_compiled_step_on_nested_structures_matches_eager():
    eager, compiled = pair_steps("off", 3), pair_steps("compile", 3, compile_options={"backend": "aot_eager"})
    for (o1, l1, c1), (o2, l2, c2) in zip(eager[0], compiled[0]):
        torch.testing.assert_close(o1, o2)
        torch.testing.assert_close(l1, l2)
        assert set(c1) == set(c2) == {"ce", "reg"}
    for p1, p2 in zip(eager[1], compiled[1]):
        torch.testing.assert_close(p1, p2)


def test_a_list_of_another_length_runs_eagerly_with_a_warning():
    def per_image_loss(out, targets):
        return sum(o.sum() * t for o, t in zip(out, targets)) / len(targets)

    model = nn.Linear(3, 1)
    step = TrainStep(model, lambda out, t: per_image_loss(out.unbind(0), t),
                     fusetrain.optim.SGD(model.parameters(), lr=torch.tensor(0.1)), mode="compile",
                     compile_options={"backend": "eager"})
    step(torch.ones(2, 3), [torch.tensor(1.0), torch.tensor(2.0)])
    with pytest.warns(UserWarning, match=r"its structure differs \(a list of another length"):
        step(torch.ones(2, 3), [torch.tensor(1.0), torch.tensor(2.0), torch.tensor(3.0)])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_keeps_a_static_buffer_per_tensor_leaf():
    eager, graphed = pair_steps("off", 6, "cuda"), pair_steps("cuda_graph", 6, "cuda", warmup_steps=2)
    assert graphed[2].captured and len(graphed[2]._static[0]) == 2  # (a, b) inputs: a buffer each
    for p1, p2 in zip(eager[1], graphed[1]):
        torch.testing.assert_close(p1, p2)


# ---- the package's detection and segmentation models on the digit canvases ----------------------------------------

def test_yolo_csp_and_pplite_seg_train_on_digit_canvases(tmp_path):
    common = {"batch_size": 4, "num_train": 8, "num_valid": 4}
    tl, vl = build_dataloaders({"name": "digits_detection", "dense_targets": True, **common})
    torch.manual_seed(0)
    det = Trainer("det", ckpt_root_dir=str(tmp_path)).train(
        build_model("yolo_csp", num_classes=10, width=4), dict(
            FAST, loss="fusetrain.models.DenseDetectionLoss", loss_params={"components": True}, train_metrics=[],
            valid_metrics=["map"], metric_to_watch="map_50"), tl, vl)
    row = det["final"]
    for k in ("train_loss_obj", "train_loss_box", "train_loss_cls", "valid_loss", "valid_map", "valid_map_50"):
        assert k in row, k
    assert 0.0 <= row["valid_map"] <= 1.0
    tl, vl = build_dataloaders({"name": "digits_segmentation", **common})
    seg = Trainer("seg", ckpt_root_dir=str(tmp_path)).train(
        build_model("pplite_seg", num_classes=11, width=4, blocks_per_stage=(1, 1, 1)), dict(
            FAST, loss="CrossEntropyLoss", train_metrics=["pixel_accuracy"],
            valid_metrics=["mean_iou", "pixel_accuracy"], metric_to_watch="mean_iou"), tl, vl)
    assert {"train_pixel_accuracy", "valid_mean_iou", "valid_pixel_accuracy"} <= set(seg["final"])
