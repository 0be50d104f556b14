"""The Trainer with ``multi_gpu: fsdp`` (FSDP2) on the CPU with gloo, workers
started by the Trainer itself.

* 4 sharded processes reach the weights and EMA of 1 process on the same
  global batches (AdamW with clipping, EMA in the fused step, torch.compile);
  validation on a set whose shards differ in batch count (lockstep);
* the checkpoint is sharded (torch.distributed.checkpoint) and resumes on 2
  processes and on 1, matching the single process resumed the same way;
* the full weights of a sharded checkpoint load in one process;
* bf16 mixed precision (the FSDP2 mixed-precision policy) trains;
* params that a sharded model cannot honour fail before anything runs.
"""

import os
import shutil

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Subset

from fusetrain.training import TrainingParamsError, resolve_training_params
from fusetrain.training.distributed import fsdp
from fusetrain.training.checkpoint.files import load_checkpoint
from fusetrain.training.data import build_dataloaders
from fusetrain.training.checkpoint.sharded import SHARDS, full_state_dict
from fusetrain.training.trainer import Trainer

from _test_helpers import run_path

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="needs torch.distributed with the gloo backend")


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 24), nn.Tanh(), nn.Linear(24, 10))


def _loaders(batch_size):
    train, valid = build_dataloaders({"name": "digits", "batch_size": batch_size, "image_size": 8,
                                      "shuffle": False, "valid_batch_size": 64})
    # 10 validation samples in batches of 2: with 4 processes rank 0 gets 3 samples (2 batches), rank 3 gets 2
    # (1 batch); the sharded forwards must still meet.
    small = DataLoader(Subset(valid.dataset, range(10)), batch_size=2)
    return train, {"full": valid, "small": small}


# Per optimizer step: 4 ranks x 4 samples == 1 process x 16 samples (DistributedSampler(shuffle=False) gives
# rank r samples r, r+4, ...): the same global batches.
COMMON = dict(max_epochs=2, max_train_batches=4, optimizer="AdamW", initial_lr=0.01, clip_grad_norm=0.5,
              ema=True, ema_params={"decay": 0.9, "decay_type": "constant"}, torch_compile=True,
              torch_compile_options={"backend": "aot_eager"}, progress_bar=False, device="cpu",
              metric_to_watch="full_loss", greater_metric_to_watch_is_better=False,
              valid_metrics=["accuracy", "loss"], dist_timeout_s=60.0)


def _close_relative_to_change(a, b, init, rel, what):
    moved = max((b[k] - init[k]).abs().max().item() for k in init)
    assert moved > 1e-3, "training did not move the weights"
    for k in init:
        diff = (a[k] - b[k]).abs().max().item()
        assert diff <= rel * moved, f"{what}{k}: differs by {diff:.3g}, training moved the weights by {moved:.3g}"


@pytest.fixture(scope="module")
def four_vs_one(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("fsdp"))
    model4 = _model()
    init = {k: v.clone() for k, v in model4.state_dict().items()}
    res4 = Trainer("four", ckpt_root_dir=root).train(model4, dict(COMMON, multi_gpu="fsdp", num_processes=4),
                                                      *_loaders(4))
    torch._dynamo.reset()
    res1 = Trainer("one", ckpt_root_dir=root).train(_model(), COMMON, *_loaders(16))
    torch._dynamo.reset()
    return dict(root=root, res4=res4, res1=res1, model4=model4, init=init)


@pytest.mark.dist
def test_four_sharded_processes_match_one_process(four_vs_one):
    r = four_vs_one
    path4 = run_path(r["root"], "four", "ckpt_latest.pth")
    ck4, ck1 = load_checkpoint(path4), load_checkpoint(run_path(r["root"], "one", "ckpt_latest.pth"))
    assert ck4["world_size"] == 4 and ck4["global_step"] == ck1["global_step"] == 8
    # NOTE [sharded checkpoints]: the file names the shard folder; no full tensors in it.
    assert ck4["model"] is None and ck4["optimizer"] is None and "module" not in ck4["ema"]
    run4 = os.path.dirname(path4)
    assert os.path.isfile(os.path.join(run4, SHARDS, ck4["shards"], ".metadata"))
    # Only the folders that checkpoint files name are kept (latest and best; the replaced ones are gone).
    named = {load_checkpoint(os.path.join(run4, f))["shards"] for f in os.listdir(run4) if f.startswith("ckpt_")}
    assert set(os.listdir(os.path.join(run4, SHARDS))) == named
    model = full_state_dict(path4)
    assert set(model) == set(r["init"])
    _close_relative_to_change(model, ck1["model"], r["init"], 1e-3, "model ")
    _close_relative_to_change(full_state_dict(path4, ema=True), ck1["ema"]["module"], r["init"], 1e-3, "ema ")
    for k, v in r["model4"].state_dict().items():  # the caller's model holds the trained weights
        assert torch.equal(v, model[k]), k
    f4, f1 = r["res4"]["final"], r["res1"]["final"]
    for key in ("train_loss", "valid_full_loss", "valid_small_loss", "valid_small_accuracy"):
        assert f4[key] == pytest.approx(f1[key], rel=1e-4), key


@pytest.mark.dist
def test_checkpoint_of_four_processes_resumes_on_two_and_on_one(four_vs_one):
    r = four_vs_one
    for name in ("four_to_two", "four_to_one"):
        shutil.copytree(os.path.join(r["root"], "four"), os.path.join(r["root"], name))
    more = dict(COMMON, max_epochs=3, torch_compile=False, resume=True)
    m2, m1, mref = _model(seed=5), _model(seed=6), _model(seed=7)  # the weights come from the checkpoints
    Trainer("four_to_two", ckpt_root_dir=r["root"]).train(m2, dict(more, multi_gpu="fsdp", num_processes=2),
                                                          *_loaders(8))
    Trainer("four_to_one", ckpt_root_dir=r["root"]).train(m1, more, *_loaders(16))
    Trainer("one", ckpt_root_dir=r["root"]).train(mref, more, *_loaders(16))
    ref = mref.state_dict()
    for what, m in (("2 processes ", m2), ("1 process ", m1)):
        _close_relative_to_change(m.state_dict(), ref, r["init"], 1e-3, what)
    ck2 = load_checkpoint(run_path(r["root"], "four_to_two", "ckpt_latest.pth"))
    assert ck2["world_size"] == 2 and ck2["global_step"] == 12 and ck2["shards"] is not None
    ck1 = load_checkpoint(run_path(r["root"], "four_to_one", "ckpt_latest.pth"))
    assert ck1["world_size"] == 1 and ck1["global_step"] == 12 and ck1["shards"] is None
    _close_relative_to_change(full_state_dict(run_path(r["root"], "four_to_two", "ckpt_latest.pth"), ema=True),
                              ck1["ema"]["module"], r["init"], 1e-3, "ema ")


@pytest.mark.dist
def test_bf16_policy_accumulation_and_sync_bn_train(tmp_path):
    from fusetrain.models import build_model

    params = dict(COMMON, max_epochs=1, mixed_precision="bf16", batch_accumulate=2, torch_compile=False,
                  multi_gpu="fsdp", num_processes=2, fsdp_params={"wrap": ["Conv2d", "Linear"]}, sync_bn=True)
    torch.manual_seed(0)
    model = build_model("digits_cnn", num_classes=10, width=8)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    res = Trainer("bf16", ckpt_root_dir=str(tmp_path)).train(model, params, *_loaders(8))
    assert torch.isfinite(torch.tensor(res["final"]["train_loss"]))
    # fp32 weights (bf16 only for compute), and the run moved them.
    assert all(v.dtype == torch.float32 for v in model.state_dict().values() if v.is_floating_point())
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.dist
def test_bfloat16_weights_with_lean_state_train_shard_and_resume(tmp_path):
    # weights_dtype bfloat16 under FSDP2: bf16 shards with int16 remainders and bf16 moments (NOTE [lean
    # state]), BatchNorm units (NOTE [fp32 batch norm]) in bf16 too, a sharded checkpoint that resumes on the
    # same processes into the uninterrupted run's weights.
    from fusetrain.models import build_model

    def cnn():
        torch.manual_seed(0)
        return build_model("digits_cnn", num_classes=10, width=8)

    lean = dict(weights_dtype="bfloat16", mixed_precision="bf16", torch_compile=False, multi_gpu="fsdp",
                num_processes=2, optimizer_params={"master_weights": "remainder", "state_dtype": "bfloat16",
                                                   "weight_decay": 0.01})
    root = str(tmp_path)
    res = Trainer("lean", ckpt_root_dir=root).train(cnn(), dict(COMMON, max_epochs=1, **lean), *_loaders(8))
    assert torch.isfinite(torch.tensor(res["final"]["train_loss"]))
    saved = full_state_dict(run_path(root, "lean", "ckpt_latest.pth"))
    assert saved and all(v.dtype == torch.bfloat16 for v in saved.values() if v.is_floating_point())
    assert os.path.isdir(os.path.join(os.path.dirname(run_path(root, "lean", "ckpt_latest.pth")), SHARDS))
    resumed, whole = cnn(), cnn()
    Trainer("lean", ckpt_root_dir=root).train(resumed, dict(COMMON, max_epochs=2, resume=True, **lean),
                                              *_loaders(8))
    Trainer("lean_whole", ckpt_root_dir=root).train(whole, dict(COMMON, max_epochs=2, **lean), *_loaders(8))
    for (k, a), b in zip(resumed.state_dict().items(), whole.state_dict().values()):
        assert torch.equal(a, b), k
    # The bfloat16 EMA's int16 remainders (NOTE [ema remainder]) are sharded, saved in the shards and resumed:
    # the resumed run's EMA is the uninterrupted one's.
    ck = load_checkpoint(run_path(root, "lean", "ckpt_latest.pth"))
    names = ck["ema"]["sharded_remainders"]
    assert names and "remainders" not in ck["ema"] and "module" not in ck["ema"]
    from torch.distributed.checkpoint import FileSystemReader

    lean_run = os.path.dirname(run_path(root, "lean", "ckpt_latest.pth"))
    saved_keys = FileSystemReader(os.path.join(lean_run, SHARDS, ck["shards"])).read_metadata().state_dict_metadata
    assert all(f"ema_remainders.{n}" in saved_keys for n in names)
    ema_resumed = full_state_dict(run_path(root, "lean", "ckpt_latest.pth"), ema=True)
    ema_whole = full_state_dict(run_path(root, "lean_whole", "ckpt_latest.pth"), ema=True)
    assert ema_resumed.keys() == ema_whole.keys()
    for k, v in ema_whole.items():
        assert torch.equal(ema_resumed[k], v), k


def test_wrap_targets():
    model = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2)))
    inner = model[2]
    assert fsdp.wrap_targets(model) == [inner[1], inner[0], inner, model[0]]  # innermost first, no root
    assert fsdp.wrap_targets(model, ["Linear"]) == [inner[1], inner[0], model[0]]
    assert fsdp.wrap_targets(model, lambda m: m is inner) == [inner]


@pytest.mark.parametrize("bad,match", [
    ({"optimizer": "Lamb"}, r"optimizer: got Lamb with multi_gpu 'fsdp'"),
    ({"export": ["m.pt2"]}, r"export: got \['m.pt2'\] with multi_gpu 'fsdp'"),
    ({"compile_step": "compile"}, r"compile_step: got 'compile' with multi_gpu 'fsdp'; allowed with fsdp: 'off'"),
    ({"fsdp_params": {"wrap": 3}}, r"fsdp_params.wrap: got 3"),
    ({"fsdp_params": {"reshard": True}}, r"fsdp_params"),
])
def test_bad_fsdp_params(bad, match):
    with pytest.raises(TrainingParamsError, match=match):
        resolve_training_params(dict({"multi_gpu": "fsdp"}, **bad))


def test_full_checkpoint_does_not_resume_a_sharded_model(monkeypatch):
    from fusetrain.training.checkpoint.components import ModelState
    model = _model()
    monkeypatch.setattr(fsdp, "is_fsdp", lambda m: m is model)
    with pytest.raises(ValueError, match="holds the full state of a run without multi_gpu 'fsdp'"):
        ModelState(model).load_state_dict(model.state_dict())


def _crash_in_second_save(rank, world, root):
    """Train 2 epochs; the second epoch's sharded save fails on rank 1 after rank 0 wrote its files."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    class DiskFullOnRank1(FileSystemWriter):
        def write_data(self, plan, planner):
            if rank == 1:
                raise OSError("No space left on device")
            return super().write_data(plan, planner)

    real, calls = dcp.save, []

    def save(state, checkpoint_id, **kwargs):
        calls.append(checkpoint_id)
        writer = DiskFullOnRank1(checkpoint_id) if len(calls) == 2 else None
        return real(state, checkpoint_id=checkpoint_id, storage_writer=writer, **kwargs)

    dcp.save = save
    try:
        Trainer("crash", ckpt_root_dir=root).train(_model(), dict(COMMON, torch_compile=False, multi_gpu="fsdp"),
                                                   *_loaders(8))
    except BaseException as exc:  # every rank sees the failed save (CheckpointException is a BaseException)
        assert "CheckpointException" in str(exc), exc
    else:
        raise AssertionError("the second save should have failed")
    finally:
        dcp.save = real


@pytest.mark.dist
def test_a_save_that_fails_midway_leaves_the_previous_checkpoint(tmp_path):
    from _dist_helpers import run_distributed

    root = str(tmp_path)
    run_distributed(_crash_in_second_save, 2, root)
    exp = os.path.dirname(run_path(root, "crash", "ckpt_latest.pth"))  # the run folder
    ck = load_checkpoint(os.path.join(exp, "ckpt_latest.pth"))
    assert ck["epoch"] == 1 and ck["global_step"] == 4  # the first epoch's checkpoint
    folders = os.listdir(os.path.join(exp, SHARDS))
    dead = [f for f in folders if f != ck["shards"]]
    assert len(dead) == 1 and not os.path.exists(os.path.join(exp, SHARDS, dead[0], ".metadata"))
    # It resumes (on one process), and the next save deletes the incomplete folder.
    model = _model(seed=3)
    res = Trainer("crash", ckpt_root_dir=root).train(model, dict(COMMON, torch_compile=False, resume=True),
                                                     *_loaders(16))
    assert res["final"]["epoch"] == 2
    assert dead[0] not in os.listdir(os.path.join(exp, SHARDS))
