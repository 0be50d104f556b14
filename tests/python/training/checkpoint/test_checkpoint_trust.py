"""Checkpoints are data: every load path reads with ``weights_only=True``
and refuses a file whose unpickling would run code (here: create a file)
unless it is trusted explicitly, before anything is changed; fusetrain's
own checkpoints read as data; older ones load when trusted or converted."""

import os

import numpy as np
import pytest
import torch

from fusetrain.export.cli import main as export_cli
from fusetrain.training.checkpoint import files as checkpoints
from fusetrain.training.checkpoint import convert as convert_checkpoint
from fusetrain.training.checkpoint import sharded as sharded_checkpoints
from fusetrain.training.checkpoint.files import UntrustedCheckpointError, load_checkpoint
from fusetrain.training.trainer import Trainer

from _train_helpers import one_thread  # noqa: F401  (fixture)
from _train_helpers import QUICK as FAST, assert_tree_equal, cnn, loaders, train


class CreatesFile:
    """Unpickling this object creates the file ``path`` (code run by the loader)."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def evil_file(tmp_path, payload, name="evil.pth"):
    marker = str(tmp_path / f"{name}.created")
    path = str(tmp_path / name)
    torch.save({**payload, "extra": CreatesFile(marker)}, path)
    return path, marker


def listing(d):
    return {n: os.stat(os.path.join(d, n)).st_mtime_ns for n in sorted(os.listdir(d))}


def test_load_checkpoint_refuses_code_and_names_the_setting(tmp_path):
    path, marker = evil_file(tmp_path, {"x": torch.ones(2)})
    with pytest.raises(UntrustedCheckpointError, match=r"trusted=True.*python -m "
                                                       r"fusetrain.training.checkpoint.convert"):
        load_checkpoint(path)
    assert not os.path.exists(marker)
    assert torch.equal(load_checkpoint(path, trusted=True)["x"], torch.ones(2))
    assert os.path.exists(marker)  # trusted: the pickle ran, as asked


def test_pretrained_weights_refused_unless_trusted(tmp_path):
    model = cnn(seed=3)
    path, marker = evil_file(tmp_path, {"model": model.state_dict()})
    tl, vl = loaders()
    root = tmp_path / "runs"
    with pytest.raises(UntrustedCheckpointError, match=r"pretrained_weights: .*pretrained_params: \{trusted: true\}"):
        Trainer("ft", ckpt_root_dir=str(root)).train(cnn(), {**FAST, "pretrained_weights": path}, tl, vl)
    assert not os.path.exists(marker) and not root.exists()  # refused before anything was written
    result = Trainer("ft", ckpt_root_dir=str(root)).train(
        cnn(), {**FAST, "max_epochs": 1, "pretrained_weights": path, "pretrained_params": {"trusted": True}}, tl, vl)
    assert os.path.exists(marker)
    assert result["pretrained"]["loaded"] == list(model.state_dict())


def test_resume_refused_unless_trusted(tmp_path):
    result, _ = train(tmp_path, max_epochs=1)
    d = result["run_dir"]
    latest = os.path.join(d, "ckpt_latest.pth")
    ck = load_checkpoint(latest)
    _, marker = evil_file(tmp_path, {})
    torch.save({**ck, "extra": CreatesFile(marker)}, latest)
    before = listing(d)
    with pytest.raises(UntrustedCheckpointError, match="training_params.resume_trusted: true"):
        train(tmp_path, max_epochs=2, resume=True)
    assert not os.path.exists(marker) and listing(d) == before  # nothing changed in the folder
    result, _ = train(tmp_path, max_epochs=2, resume=True, resume_trusted=True)
    assert os.path.exists(marker) and result["final"]["epoch"] == 2


def test_export_cli_refused_unless_trusted(tmp_path, capsys):
    from fusetrain.models import build_model
    from fusetrain.train_from_recipe import load_recipe

    arch = dict(load_recipe("default")["arch_params"])
    model = build_model(arch.pop("name"), **arch)
    path, marker = evil_file(tmp_path, {"model": model.state_dict()})
    out = str(tmp_path / "m.pt2")
    assert export_cli(["--checkpoint", path, "--out", out]) == 2
    assert "--trusted" in capsys.readouterr().err
    assert not os.path.exists(marker) and not os.path.exists(out)
    assert export_cli(["--checkpoint", path, "--out", out, "--trusted"]) == 0
    assert os.path.exists(marker) and os.path.exists(out)


def test_full_weights_cli_refused_unless_trusted(tmp_path):
    path, marker = evil_file(tmp_path, {"model": cnn().state_dict(), "shards": None})
    out = str(tmp_path / "weights.pth")
    with pytest.raises(UntrustedCheckpointError, match="--trusted"):
        sharded_checkpoints.main([path, out])
    assert not os.path.exists(marker) and not os.path.exists(out)
    sharded_checkpoints.main([path, out, "--trusted"])
    assert_tree_equal(torch.load(out, weights_only=True), cnn().state_dict())


def test_own_checkpoints_read_as_data(tmp_path):
    """Every file a run writes (epoch end, mid-epoch with its position, EMA, fp16 scaler, the averaged model)
    reads with torch.load(weights_only=True)."""
    result, _ = train(tmp_path, max_epochs=2, ema=True, mixed_precision="fp16", ckpt_every_n_steps=2,
                      keep_last_ckpts=2, save_ckpt_epoch_list=[1], average_best_models=True,
                      number_of_models_to_average=2, metric_to_watch="loss", greater_metric_to_watch_is_better=False)
    d = result["run_dir"]
    files = [n for n in os.listdir(d) if n.endswith(".pth")]
    assert {"ckpt_latest.pth", "ckpt_best.pth", "ckpt_epoch_1.pth", "average_model.pth",
            "average_model_snapshots.pth"} <= set(files)
    for name in files:
        torch.load(os.path.join(d, name), weights_only=True)
    mid = [n for n in files if n.startswith("ckpt_step_")]
    assert any("position" in torch.load(os.path.join(d, n), weights_only=True) for n in mid)


def legacy(ck):
    """A checkpoint as an older fusetrain wrote it: schema version 1 (no schema_version; the best metric, the
    stale epochs and the skipped steps at the top level) and NumPy's random state as a tuple with an array."""
    def old_numpy(state):
        return (state["name"], state["key"].numpy().astype(np.uint32), state["pos"], state["has_gauss"],
                state["gauss"])

    out = {k: v for k, v in ck.items() if k not in ("schema_version", "progress")}
    out.update(ck["progress"], rng=dict(ck["rng"], numpy=old_numpy(ck["rng"]["numpy"])))
    return out


def test_older_checkpoints_load_trusted_or_converted(tmp_path):
    straight, straight_model = train(tmp_path, "straight", max_epochs=2)
    half, _ = train(tmp_path, "half", max_epochs=1)
    latest = os.path.join(half["run_dir"], "ckpt_latest.pth")
    torch.save(legacy(load_checkpoint(latest)), latest)
    with pytest.raises(UntrustedCheckpointError, match=r"resume_trusted: true.*python -m fusetrain.training.checkpoint.convert"):
        train(tmp_path, "half", max_epochs=2, resume=True)
    # Converted once, it reads as data and the resumed run ends as the uninterrupted one.
    convert_checkpoint.main([latest])
    assert isinstance(torch.load(latest, weights_only=True)["rng"]["numpy"], dict)
    _, resumed = train(tmp_path, "half", model=cnn(seed=7), max_epochs=2, resume=True)
    assert_tree_equal(straight_model.state_dict(), resumed.state_dict())
    # Trusted as it is, an older file resumes too.
    again, _ = train(tmp_path, "again", max_epochs=1)
    latest = os.path.join(again["run_dir"], "ckpt_latest.pth")
    torch.save(legacy(load_checkpoint(latest)), latest)
    _, trusted = train(tmp_path, "again", model=cnn(seed=7), max_epochs=2, resume=True, resume_trusted=True)
    assert_tree_equal(straight_model.state_dict(), trusted.state_dict())


def test_sharded_state_reads_as_data(tmp_path):
    """A sharded checkpoint's folder (torch.distributed.checkpoint): weights and optimizer state load, in one
    process; a metadata file whose unpickling would run code is refused by both readers."""
    import pickle

    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    exp = str(tmp_path / "exp")
    folder = sharded_checkpoints.folder(os.path.join(exp, "ckpt_latest.pth"), "s1")
    with pytest.warns(UserWarning, match="single process"):
        sharded_checkpoints.ShardedState(model, opt).save(folder)
    path = os.path.join(exp, "ckpt_latest.pth")
    checkpoints.atomic_save({"shards": "s1", "model": None, "optimizer": None, "ema": None}, path)
    assert_tree_equal(sharded_checkpoints.full_state_dict(path), model.state_dict())
    other = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    other_opt = torch.optim.AdamW(other.parameters(), lr=0.1)
    sharded_checkpoints.ShardedState(other, other_opt).load(folder, path)
    assert_tree_equal(other.state_dict(), model.state_dict())
    assert_tree_equal(other_opt.state_dict()["state"], opt.state_dict()["state"])
    marker = str(tmp_path / "created")
    with open(os.path.join(exp, "shards", "s1", ".metadata"), "wb") as f:
        pickle.dump(CreatesFile(marker), f)
    with pytest.raises(UntrustedCheckpointError, match=r"\.metadata: .*names io\.open, which is not data"):
        sharded_checkpoints.full_state_dict(path)
    with pytest.raises(UntrustedCheckpointError, match=r"\.metadata: .*names io\.open"):
        sharded_checkpoints.ShardedState(other, other_opt).load(folder, path)
    assert not os.path.exists(marker)


def test_convert_refuses_a_missing_or_non_checkpoint_file_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "out.pth"
    out.write_bytes(b"kept")
    text = tmp_path / "notes.pth"
    text.write_text("not a checkpoint\n")
    tensor = tmp_path / "tensor.pth"
    torch.save(torch.ones(2), tensor)
    cases = [(tmp_path / "missing.pth", "checkpoint not found"),
             (text, "not a file torch.save wrote, or a truncated one"),
             (tensor, "holds a Tensor, not a checkpoint")]
    for path, expected in cases:
        for argv in ([str(path)], [str(path), "--out", str(out)]):
            before = listing(tmp_path)
            assert convert_checkpoint.main(argv) == 2
            err = capsys.readouterr().err
            assert err.startswith("error: ") and str(path) in err and expected in err, err
            assert listing(tmp_path) == before
    assert out.read_bytes() == b"kept" and text.read_text() == "not a checkpoint\n"
    # --out a directory: refused before anything is read.
    ck = tmp_path / "ck.pth"
    torch.save({"model": {"w": torch.ones(1)}}, ck)
    assert convert_checkpoint.main([str(ck), "--out", str(tmp_path)]) == 2
    assert f"out {tmp_path} is a directory" in capsys.readouterr().err
    assert convert_checkpoint.main([str(ck), "--out", str(out)]) == 0
    assert torch.equal(torch.load(out, weights_only=True)["model"]["w"], torch.ones(1))
