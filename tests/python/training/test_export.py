"""fusetrain.export: torch.export and ONNX files of a trained model, checked
against the eager model; the command line from a recipe and a checkpoint."""

import os

import pytest
import torch
from torch import nn

import fusetrain.export as fx
from fusetrain.export.cli import main as export_cli
from fusetrain.models import build_model
from fusetrain.train_from_recipe import load_recipe

from _train_helpers import one_thread  # noqa: F401  (fixture)
from _test_helpers import run_path


def cnn():
    torch.manual_seed(0)
    return build_model("digits_cnn", num_classes=10, width=8)


class DictOut(nn.Module):
    """Segmentation-style outputs: a dict of tensors."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 3, 3, padding=1)

    def forward(self, x):
        y = self.conv(x)
        return {"out": y, "aux": y.mean(dim=(2, 3))}


def test_torch_export_file_matches_and_takes_other_batch_sizes(tmp_path):
    model, x = cnn(), torch.randn(4, 1, 28, 28)
    r = fx.export_model(model, x, str(tmp_path / "m.pt2"))
    assert r["format"] == "torch_export" and r["checked"] and r["dynamic_batch"] and r["max_abs_diff"] < 1e-5
    program = torch.export.load(str(tmp_path / "m.pt2")).module()
    x7 = torch.randn(7, 1, 28, 28)
    torch.testing.assert_close(program(x7), model(x7), rtol=1e-5, atol=1e-6)
    assert sorted(os.listdir(tmp_path)) == ["m.pt2"]  # no temporary file left


def test_dict_outputs_and_a_batch_of_one(tmp_path):
    r = fx.export_model(DictOut(), torch.randn(1, 1, 9, 9), str(tmp_path / "seg.pt2"))
    assert r["checked"] and not r["dynamic_batch"]  # a batch of one exports static shapes


def test_onnx_file_matches_through_onnxruntime(tmp_path):
    pytest.importorskip("onnxscript")
    pytest.importorskip("onnxruntime")
    import onnxruntime

    model, x = cnn(), torch.randn(3, 1, 28, 28)
    r = fx.export_model(model, x, str(tmp_path / "m.onnx"))
    assert r["format"] == "onnx" and r["checked"] and r["max_abs_diff"] < 1e-4
    session = onnxruntime.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    x5 = torch.randn(5, 1, 28, 28)
    (y,) = session.run(None, {session.get_inputs()[0].name: x5.numpy()})
    torch.testing.assert_close(torch.from_numpy(y), model(x5).detach(), rtol=1e-4, atol=1e-5)


def test_errors(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"allowed: a path ending in \.pt2 or \.onnx"):
        fx.export_model(cnn(), torch.randn(2, 1, 28, 28), str(tmp_path / "m.pth"))
    monkeypatch.setattr(fx, "_importable", lambda name: name != "onnxscript")
    with pytest.raises(ValueError, match=r"ONNX needs the package\(s\) onnxscript"):
        fx.export_model(cnn(), torch.randn(2, 1, 28, 28), str(tmp_path / "m.onnx"))
    monkeypatch.undo()
    # An exported file whose outputs differ is an error and is not kept.
    monkeypatch.setattr(fx, "_run_saved", lambda fmt, path, args: [torch.zeros(2, 10)])
    with pytest.raises(ValueError, match="output 0 differs from the eager model"):
        fx.export_model(cnn(), torch.randn(2, 1, 28, 28), str(tmp_path / "bad.pt2"))
    assert os.listdir(tmp_path) == []


def test_command_line_from_a_recipe_and_a_checkpoint(tmp_path, capsys):
    recipe = load_recipe("default")
    arch = dict(recipe["arch_params"])
    torch.manual_seed(1)
    model = build_model(arch.pop("name"), **arch)
    ema = build_model(recipe["arch_params"]["name"], **arch)
    path = str(tmp_path / "ckpt_best.pth")
    torch.save({"model": model.state_dict(), "ema": {"module": ema.state_dict(), "step": 3}}, path)
    out = str(tmp_path / "model.pt2")
    assert export_cli(["--checkpoint", path, "--ema", "--out", out]) == 0
    assert "outputs match the eager model" in capsys.readouterr().out
    program = torch.export.load(out).module()
    x = torch.randn(2, 1, 28, 28)  # digits_cnn on the 28x28 digits of the default recipe
    torch.testing.assert_close(program(x), ema.eval()(x), rtol=1e-5, atol=1e-6)
    assert export_cli(["--checkpoint", str(tmp_path / "missing.pth"), "--out", out]) == 2
    assert "checkpoint not found" in capsys.readouterr().err


def test_trainer_exports_the_final_ema_weights(tmp_path):
    pytest.importorskip("onnxscript")
    from fusetrain.training.data import build_dataloaders
    from fusetrain.training.trainer import Trainer

    model = cnn()
    tl, vl = build_dataloaders({"name": "digits", "batch_size": 16, "image_size": 28})
    params = dict(max_epochs=1, max_train_batches=2, max_valid_batches=1, progress_bar=False, device="cpu",
                  ema=True, export=["model.pt2", "model.onnx"])
    result = Trainer("exp", ckpt_root_dir=str(tmp_path)).train(model, params, tl, vl)
    assert [(r["format"], r["checked"]) for r in result["export"]] == [("torch_export", True), ("onnx", True)]
    ema_sd = torch.load(run_path(tmp_path, "exp", "ckpt_latest.pth"), weights_only=True)["ema"]["module"]
    ref = cnn()
    ref.load_state_dict(ema_sd)
    x = torch.randn(3, 1, 28, 28)
    program = torch.export.load(str(run_path(tmp_path, "exp", "model.pt2"))).module()
    torch.testing.assert_close(program(x), ref.eval()(x), rtol=1e-5, atol=1e-6)


def test_trainer_refuses_onnx_export_without_the_packages_before_writing(tmp_path, monkeypatch):
    from fusetrain.training.data import build_dataloaders
    from fusetrain.training.trainer import Trainer

    monkeypatch.setattr(fx, "_importable", lambda name: name not in ("onnx", "onnxscript"))
    tl, vl = build_dataloaders({"name": "digits", "batch_size": 16, "image_size": 28})
    with pytest.raises(ValueError, match=r"ONNX needs the package\(s\) onnx, onnxscript"):
        Trainer("exp", ckpt_root_dir=str(tmp_path)).train(cnn(), dict(max_epochs=1, device="cpu",
                                                                      export=["m.onnx"]), tl, vl)
    assert os.listdir(tmp_path) == []
