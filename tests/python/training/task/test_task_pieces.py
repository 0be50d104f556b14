"""The pieces that make the Trainer work for any task, without training: batch
splitting and model calls, structural signatures, loss names and outputs, the
metrics against direct computations, callback lists."""

import math

import numpy as np
import pytest
import torch
from torch import nn

import fusetrain
from fusetrain.training.task import batches as B
from fusetrain.training.task import losses as L
from fusetrain.training.task import metrics as M
from fusetrain.training.task.callbacks import HOOKS, Callback, CallbackList, TrainerState, build_callbacks


# ---- batches ------------------------------------------------------------------------------------------------------

def test_split_batch_rules():
    x, y, z = torch.zeros(2, 3), torch.ones(2), torch.arange(2)
    assert B.split_batch((x, y)) == (x, y, ())
    inputs, targets, extras = B.split_batch([x, y, z, "id"])
    assert inputs is x and targets is y and extras == (z, "id")
    inputs, targets, _ = B.split_batch({"image": x, "label": y})
    assert inputs is x and targets is y
    inputs, targets, _ = B.split_batch({"input_ids": x, "mask_2": z, "labels": y})
    assert inputs == {"input_ids": x, "mask_2": z} and targets is y
    # "targets" wins over "labels" (TARGET_KEYS order).
    inputs, targets, _ = B.split_batch({"targets": y, "labels": z, "x": x})
    assert targets is y and inputs == {"labels": z, "x": x}
    assert B.split_batch(x, fn=lambda b: (b, b.sum(1)))[0] is x
    for bad in (x, (x,), {"image": x}, {"label": y}):
        with pytest.raises(B.BatchError, match="cannot split a training batch into inputs and targets"):
            B.split_batch(bad)
    with pytest.raises(B.BatchError, match="split_batch must return"):
        B.split_batch(x, fn=lambda b: b)


def test_call_model_modes():
    seen = []

    def model(*args, **kwargs):
        seen.append((args, kwargs))
        return "out"

    a, b = torch.zeros(1), torch.ones(1)
    B.call_model(model, a, "auto")
    B.call_model(model, [a, b], "auto")  # a list is one argument (a batch of images)
    B.call_model(model, (a, b), "unpack")
    B.call_model(model, {"p": a}, "auto")
    B.call_model(model, {"p": a}, "whole")
    B.call_model(model, [a], "auto", targets=b, with_targets=True)
    B.call_model(model, (a,), "unpack", targets=b, with_targets=True)
    B.call_model(model, {"p": a}, "auto", targets=b, with_targets=True)
    assert [len(s[0]) for s in seen] == [1, 1, 2, 0, 1, 2, 2, 0]
    assert seen[3][1] == {"p": a} and seen[7][1] == {"p": a, "targets": b}
    assert B.call_model(model, a, lambda m, x: ("fn", x)) == ("fn", a)
    assert B.call_model(model, a, lambda m, x, t: ("fn", t), targets=b, with_targets=True) == ("fn", b)


def test_count_samples_and_to_device():
    x = torch.zeros(5, 3)
    assert B.count_samples(x, "auto") == 5
    assert B.count_samples([torch.zeros(3, 8, 8)] * 4, "auto") == 4  # per-image list
    assert B.count_samples((x, torch.zeros(5)), "unpack") == 5
    assert B.count_samples({"a": x}, "auto") == 5
    batch = (x, [{"boxes": torch.zeros(2, 4), "labels": torch.zeros(2, dtype=torch.long), "id": 3}])
    moved = B.to_device(batch, torch.device("cpu"))
    assert type(moved) is tuple and moved[1][0]["id"] == 3 and isinstance(moved[1][0]["boxes"], torch.Tensor)


def test_signatures_partial_and_mismatch():
    full = B.signature(torch.zeros(8, 3), [torch.zeros(8), torch.zeros(8, 2)])
    assert full == B.signature(torch.ones(8, 3), [torch.ones(8), torch.ones(8, 2)])
    part = B.signature(torch.zeros(5, 3), [torch.zeros(5), torch.zeros(5, 2)])
    assert part != full and part.partial_of(full) and not full.partial_of(part)
    longer = B.signature(torch.zeros(8, 3), [torch.zeros(8), torch.zeros(8, 2), torch.zeros(8)])
    assert not longer.partial_of(full) and "structure differs" in longer.mismatch(full)
    other = B.signature(torch.zeros(8, 3), [torch.zeros(8), torch.zeros(8, 3)])
    assert "leaf 2 is (8, 3)" in other.mismatch(full)
    pair = B.signature(torch.zeros(8, 1, 4, 4), torch.zeros(8, dtype=torch.long))
    assert pair.text() == "x (8, 1, 4, 4) torch.float32 on cpu, y (8,) torch.int64 on cpu"
    assert B.signature(torch.zeros(8), {"id": 1}) != B.signature(torch.zeros(8), {"id": 2})


def test_describe():
    text = B.describe([{"boxes": torch.zeros(2, 4), "labels": torch.zeros(2, dtype=torch.long)}] * 6)
    assert text == "list of 6 dict{boxes: Tensor[2, 4] float32, labels: Tensor[2] int64}"
    assert B.describe((torch.zeros(3), 7)) == "tuple(Tensor[3] float32, int 7)"


# ---- losses -------------------------------------------------------------------------------------------------------

def test_loss_names():
    assert L.loss_factory("CrossEntropyLoss") is nn.CrossEntropyLoss
    assert L.loss_factory("cross_entropy") is nn.CrossEntropyLoss
    assert L.loss_factory("HuberLoss") is nn.HuberLoss
    assert L.loss_factory("model") is None
    assert L.loss_factory("fusetrain.models.DenseDetectionLoss") is fusetrain.models.DenseDetectionLoss
    with pytest.raises(ValueError, match=r"unknown loss 'CrossEntropy'; did you mean 'CrossEntropyLoss'\?"):
        L.loss_factory("CrossEntropy")
    with pytest.raises(ValueError, match=r"unknown loss 'crossentropyloss'; did you mean 'CrossEntropyLoss'\?"):
        L.loss_factory("crossentropyloss")
    with pytest.raises(ValueError, match="cannot import 'nowhere.Loss'"):
        L.loss_factory("nowhere.Loss")


def test_register_loss():
    @fusetrain.register_loss("test_twice_mse")
    def twice(scale=2.0):
        return lambda out, y: scale * ((out - y) ** 2).mean()

    try:
        fn = L.build_loss("test_twice_mse", {"scale": 3.0})
        assert float(fn(torch.ones(2), torch.zeros(2))) == 3.0
        with pytest.raises(ValueError, match="already registered"):
            fusetrain.register_loss("test_twice_mse", twice)
        with pytest.raises(ValueError, match="built-in loss name"):
            fusetrain.register_loss("MSELoss", twice)
        p = fusetrain.training.resolve_training_params({"loss": "test_twice_mse", "loss_params": {"scale": 1.5}})
        assert p.loss == "test_twice_mse"
        with pytest.raises(fusetrain.training.TrainingParamsError, match="unknown key 'scal'; did you mean 'scale'"):
            fusetrain.training.resolve_training_params({"loss": "test_twice_mse", "loss_params": {"scal": 1.5}})
    finally:
        L._REGISTERED.pop("test_twice_mse", None)


def test_named_torch_losses_read_the_prediction():
    loss = L.build_loss("CrossEntropyLoss", {})
    logits, y = torch.randn(4, 3, 5, 5), torch.randint(0, 3, (4, 5, 5))
    ref = nn.functional.cross_entropy(logits, y)
    for out in (logits, {"out": logits, "aux": logits * 0}, (logits, "extra")):
        torch.testing.assert_close(loss(out, y), ref)


def test_class_weights_from_a_recipe_become_tensors():
    loss = L.build_loss("CrossEntropyLoss", {"weight": [0.5, 1.0, 2.0]})
    logits, y = torch.randn(6, 3), torch.tensor([0, 1, 2, 2, 1, 0])
    ref = nn.functional.cross_entropy(logits, y, weight=torch.tensor([0.5, 1.0, 2.0]))
    torch.testing.assert_close(loss(logits, y), ref)
    assert isinstance(L.build_loss("BCEWithLogitsLoss", {"pos_weight": [3.0]}).loss.pos_weight, torch.Tensor)


def test_split_loss_forms_and_errors():
    a, b = torch.tensor(1.5), torch.tensor(0.5)
    assert L.split_loss(a) == (a, {})
    loss, comps = L.split_loss((a, {"box": b}))
    assert loss is a and comps == {"box": b}
    loss, comps = L.split_loss({"loss": a, "cls": b})
    assert loss is a and comps == {"cls": b}
    loss, comps = L.split_loss({"loss_x": a, "loss_y": b}, sum_dict=True)
    assert float(loss) == 2.0 and set(comps) == {"loss_x", "loss_y"}
    with pytest.raises(L.LossOutputError, match=r"must be a scalar floating-point tensor.*Tensor\[4\] float32"):
        L.split_loss(torch.ones(4))
    with pytest.raises(L.LossOutputError, match="or a dict with a 'loss' entry; got dict"):
        L.split_loss({"loss_x": a})
    with pytest.raises(L.LossOutputError, match="component 'box' must be a scalar tensor"):
        L.split_loss((a, {"box": torch.ones(3)}))
    with pytest.raises(L.LossOutputError, match="scalar floating-point"):
        L.split_loss(torch.tensor(3))


# ---- metrics ------------------------------------------------------------------------------------------------------

def _confusion(t, p, c, ignore=255):
    keep = (t != ignore) & (t >= 0) & (t < c)
    cm = np.zeros((c, c))
    np.add.at(cm, (t[keep], p[keep]), 1)
    return cm


def test_mean_iou_and_pixel_accuracy_match_a_direct_computation():
    torch.manual_seed(0)
    c = 5
    mi, pa = M.MeanIoU(ignore_index=255), M.PixelAccuracy(ignore_index=255)
    cm = np.zeros((c, c))
    for _ in range(3):
        logits = torch.randn(2, c, 7, 9)
        t = torch.randint(0, c, (2, 7, 9))
        t[0, :2] = 255
        mi.update({"out": logits}, t)
        pa.update((logits,), t)
        cm += _confusion(t.numpy().ravel(), logits.argmax(1).numpy().ravel(), c)
    inter = np.diag(cm)
    union = cm.sum(0) + cm.sum(1) - inter
    assert mi.compute() == pytest.approx(np.mean(inter[union > 0] / union[union > 0]), rel=1e-12)
    assert pa.compute() == pytest.approx(inter.sum() / cm.sum(), rel=1e-12)
    torch.testing.assert_close(mi.matrix(), torch.from_numpy(cm))
    with pytest.raises(M.MetricInputError, match=r"targets of shape \(2, 7, 9\)"):
        mi.update(torch.randn(2, c, 7, 9), torch.zeros(2, 7, dtype=torch.long))
    with pytest.raises(M.MetricInputError, match="built for 5 classes but the scores have 4"):
        mi.update(torch.randn(2, 4, 7, 9), torch.zeros(2, 7, 9, dtype=torch.long))


def test_accuracy_per_pixel_and_top_k():
    acc, top2 = M.Accuracy(), M.Accuracy(k=2)
    scores = torch.tensor([[0.1, 0.7, 0.2], [0.5, 0.3, 0.2], [0.1, 0.2, 0.7]])
    y = torch.tensor([1, 1, 0])
    acc.update(scores, y)
    top2.update(scores, y)
    assert acc.compute() == pytest.approx(1 / 3) and top2.compute() == pytest.approx(2 / 3)
    seg = M.Accuracy(ignore_index=255)
    logits = torch.zeros(1, 2, 2, 2)
    logits[0, 1, 0, 0] = 1.0
    seg.update(logits, torch.tensor([[[1, 1], [255, 0]]]))
    assert seg.compute() == pytest.approx(2 / 3)
    with pytest.raises(M.MetricInputError, match="integer class indices"):
        acc.update(scores, torch.zeros(3))


def test_detection_map_perfect_and_wrong():
    boxes = torch.tensor([[2.0, 3.0, 20.0, 30.0], [30.0, 30.0, 50.0, 60.0]])
    labels = torch.tensor([1, 4])
    m = M.DetectionMAP()
    m.update([{"boxes": boxes, "scores": torch.tensor([0.9, 0.8]), "labels": labels}],
             [{"boxes": boxes, "labels": labels}])
    assert m.compute() == {"": pytest.approx(1.0), "50": pytest.approx(1.0), "75": pytest.approx(1.0)}
    m.reset()
    m.update({"detections": [{"boxes": boxes + 40, "scores": torch.tensor([0.9, 0.8]), "labels": labels}]},
             {"boxes": [boxes], "labels": [labels]})
    assert m.compute()[""] == 0.0
    with pytest.raises(M.MetricInputError, match="it needs detections"):
        m.update(torch.zeros(1, 3), [{"boxes": boxes, "labels": labels}])


def test_torchmetrics_objects_and_metric_sets():
    torchmetrics = pytest.importorskip("torchmetrics")
    ms = M.MetricSet([torchmetrics.classification.MulticlassAccuracy(num_classes=3, average="micro"),
                      {"accuracy": {"k": 2}}], "valid")
    assert [m.name for m in ms.metrics] == ["multiclass_accuracy", "top2"]
    scores = torch.tensor([[0.1, 0.7, 0.2], [0.5, 0.3, 0.2], [0.1, 0.2, 0.7]])
    ms.update(scores, torch.tensor([1, 1, 0]), None)
    res = ms.compute()
    assert res["multiclass_accuracy"] == pytest.approx(1 / 3) and res["top2"] == pytest.approx(2 / 3)
    bad = M.MetricSet(["mean_iou"], "train")
    with pytest.raises(M.MetricInputError, match=r"train metric 'mean_iou' cannot handle the model's outputs: .*"
                                                 r"Outputs: list of 5 dict"):
        bad.update([{"boxes": torch.zeros(1, 4)}] * 5, torch.zeros(5), None)
    with pytest.raises(ValueError, match=r"unknown metric 'mean_io'; did you mean 'mean_iou'\?"):
        M.build_metric("mean_io")
    with pytest.raises(ValueError, match="two metrics are named"):
        M.MetricSet(["accuracy", {"accuracy": {}}], "valid")


def test_register_metric():
    class Count(M.SumMetric):
        name = "count"

        def update(self, outputs, targets, loss=None):
            self._sum += 1
            self._count += 1

    fusetrain.register_metric("test_count", Count)
    try:
        assert isinstance(M.build_metric("test_count"), Count)
        with pytest.raises(ValueError, match="built-in metric name"):
            fusetrain.register_metric("accuracy", Count)
    finally:
        M.METRICS.pop("test_count", None)


# ---- callbacks ----------------------------------------------------------------------------------------------------

def test_callback_list_calls_only_overridden_hooks():
    calls = []

    class A(Callback):
        def on_step_end(self, state):
            calls.append("a")

    class Bc(Callback):
        def on_step_end(self, state):
            calls.append("b")
            state.request_stop("enough")

    cbs = CallbackList([A(), Bc(), Callback()])
    assert cbs.has("on_step_end") and not cbs.has("on_epoch_end")
    state = TrainerState()
    cbs("on_step_end", state)
    cbs("on_epoch_end", state)
    assert calls == ["a", "b"] and state.stop_training and state.stop_reason == "enough"
    assert set(HOOKS) == {n for n in dir(Callback) if n.startswith("on_")}
    built = build_callbacks(["ThresholdStop" if False else {"ThresholdStop": {"metric": "valid_accuracy",
                                                                               "value": 0.5}}])
    assert built[0].metric == "valid_accuracy"
    with pytest.raises(ValueError, match=r"unknown callback 'Threshold'; did you mean 'ThresholdStop'\?"):
        build_callbacks(["Threshold"])
    with pytest.raises(TypeError, match="allowed: a fusetrain Callback"):
        build_callbacks([object()])
    assert math.isclose(build_callbacks([{"ThresholdStop": {"metric": "m", "value": 1}}])[0].value, 1.0)
