"""training_params.weights_dtype with the optimizers' lean state (NOTE [lean state] in
csrc/common/lean_state.h): a Trainer run keeps bfloat16 weights with int16 remainders and bfloat16
moments, resumes from its checkpoint exactly, and a weights_dtype its precision cannot feed is refused
before the experiment folder is written."""

import math
import os

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fusetrain import Trainer
from fusetrain.training.params import TrainingParamsError

from _test_helpers import run_path

LEAN = dict(weights_dtype="bfloat16", mixed_precision="bf16",
            optimizer_params={"master_weights": "remainder", "state_dtype": "bfloat16", "weight_decay": 0.01})


def _data():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 6, generator=g), torch.randint(0, 3, (64,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=8), DataLoader(TensorDataset(x, y), batch_size=32)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


def _train(tmp_path, name, **params):
    train, valid = _data()
    model = _model()
    trainer = Trainer(name, ckpt_root_dir=str(tmp_path))
    result = trainer.train(model, dict(dict(max_epochs=2, progress_bar=False, device="cpu", initial_lr=1e-2,
                                            valid_metrics=["accuracy"]), **params), train, valid)
    return result, model, trainer


def test_a_lean_run_keeps_bfloat16_weights_remainders_and_moments(tmp_path):
    result, model, _ = _train(tmp_path, "lean", **LEAN)
    assert math.isfinite(result["final"]["train_loss"])
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    ck = torch.load(run_path(str(tmp_path), "lean", "ckpt_latest.pth"), weights_only=True)
    states = ck["optimizer"]["state"].values()
    assert all(st["master_remainder"].dtype == torch.int16 and st["exp_avg_sq"].dtype == torch.bfloat16
               for st in states)
    # A resume for one more epoch continues the same run as an uninterrupted 3-epoch run.
    resumed, model_r, _ = _train(tmp_path, "lean", max_epochs=3, resume=True, **LEAN)
    whole, model_w, _ = _train(tmp_path, "lean_whole", max_epochs=3, **LEAN)
    for a, b in zip(model_r.parameters(), model_w.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("precision", [False, "fp16"])
def test_bfloat16_weights_need_bf16_autocast(tmp_path, precision):
    with pytest.raises(TrainingParamsError, match="weights_dtype: got 'bfloat16' with mixed_precision"):
        _train(tmp_path, "refused", weights_dtype="bfloat16", mixed_precision=precision)
    assert not os.path.exists(os.path.join(str(tmp_path), "refused"))


def test_an_ema_of_bfloat16_weights_keeps_remainders_and_resumes_exactly(tmp_path):
    # NOTE [ema remainder]: the EMA of bfloat16 weights holds int16 remainders, saved with the checkpoint;
    # a resumed run's EMA equals an uninterrupted one's.
    ema = dict(ema=True, ema_params={"decay": 0.999, "decay_type": "constant"})
    result, _, _ = _train(tmp_path, "lean_ema", **ema, **LEAN)
    assert math.isfinite(result["final"]["train_loss"])
    ck = torch.load(run_path(str(tmp_path), "lean_ema", "ckpt_latest.pth"), weights_only=True)
    rems = ck["ema"]["remainders"]
    assert rems and all(r.dtype == torch.int16 for r in rems.values()) and any(r.any() for r in rems.values())
    _train(tmp_path, "lean_ema", max_epochs=3, resume=True, **ema, **LEAN)
    _train(tmp_path, "lean_ema_whole", max_epochs=3, **ema, **LEAN)
    a, b = [torch.load(run_path(str(tmp_path), name, "ckpt_latest.pth"), weights_only=True)["ema"]
            for name in ("lean_ema", "lean_ema_whole")]
    for k, v in b["module"].items():
        assert torch.equal(a["module"][k], v), k
    for k, v in b["remainders"].items():
        assert torch.equal(a["remainders"][k], v), k


def test_an_ema_without_remainders_of_bfloat16_weights_is_warned_about(tmp_path):
    with pytest.warns(UserWarning, match="remainder false with weights_dtype bfloat16"):
        result, _, _ = _train(tmp_path, "lean_ema", max_epochs=1, ema=True, ema_params={"remainder": False},
                              **LEAN)
    assert math.isfinite(result["final"]["train_loss"])


def test_int8_moments_from_optimizer_params_resume_exactly(tmp_path):
    # A model with a weight above the small-tensor rule (4096 elements): its moments are int8 codes with
    # block scales in the checkpoint; the small ones keep float32 moments.
    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 3))

    lean = dict(LEAN, optimizer_params={"master_weights": "stochastic", "state_dtype": "int8",
                                        "state_block_size": 128})
    train, valid = _data()
    base = dict(progress_bar=False, device="cpu", initial_lr=1e-2, valid_metrics=["accuracy"], **lean)
    Trainer("q8", ckpt_root_dir=str(tmp_path)).train(model(), dict(base, max_epochs=2), train, valid)
    ck = torch.load(run_path(str(tmp_path), "q8", "ckpt_latest.pth"), weights_only=True)
    kinds = [(st["exp_avg"].dtype, st.get("exp_avg_scales") is not None) for st in ck["optimizer"]["state"].values()]
    assert kinds.count((torch.int8, True)) == 1 and kinds.count((torch.float32, False)) == 5
    resumed, whole = model(), model()
    Trainer("q8", ckpt_root_dir=str(tmp_path)).train(resumed, dict(base, max_epochs=3, resume=True), train, valid)
    Trainer("q8_whole", ckpt_root_dir=str(tmp_path)).train(whole, dict(base, max_epochs=3), train, valid)
    for a, b in zip(resumed.parameters(), whole.parameters()):
        assert torch.equal(a, b)


def test_bfloat16_weights_without_a_master_report_stalled_updates(tmp_path):
    # NOTE [stalled updates]: an lr too small for bfloat16 weights shows in the epoch row.
    lean = dict(LEAN, optimizer_params={"master_weights": "stochastic", "state_dtype": "bfloat16"}, initial_lr=1e-6)
    result, _, _ = _train(tmp_path, "stalled", max_epochs=1, **lean)
    assert result["final"]["stalled_updates"] > 0
    result, _, _ = _train(tmp_path, "kept", max_epochs=1, **LEAN)  # a remainder loses nothing: not counted
    assert "stalled_updates" not in result["final"]
