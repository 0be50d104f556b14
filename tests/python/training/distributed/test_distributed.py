"""Distributed training on the CPU with gloo: real worker processes started by
the Trainer itself (``multi_gpu: ddp``, torch's elastic launcher) and by
``torchrun`` (``python -m torch.distributed.run``) on 127.0.0.1.

* 2 processes reach the weights (and the EMA, and the epoch's reduced loss and
  metrics) of 1 process on the same global batches;
* a checkpoint written by 2 processes resumes on 1;
* two single-process "nodes" rendezvous over loopback and train;
* a rank that raises stops the whole run quickly, naming that rank;
* bad distributed params fail before anything is written.
"""

import copy
import json
import os
import socket
import subprocess
import sys
import time
import types

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fusetrain.training import TrainingParamsError, resolve_training_params
from fusetrain.training import distributed as D
from fusetrain.training.distributed import sharding
from fusetrain.training.checkpoint.files import load_checkpoint
from fusetrain.training.data import build_dataloaders
from fusetrain.models import build_model
from fusetrain.training.trainer import Trainer
from _test_helpers import latest_run, run_path

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="needs torch.distributed with the gloo backend")


def _has_cpu_sync_bn() -> bool:
    try:
        from fusetrain.nn import convert_sync_batchnorm  # noqa: F401
    except ImportError:
        return False
    return True


# sync_bn on the CPU needs fusetrain.nn's SyncBatchNorm (torch's runs on GPUs only); without it the
# comparison uses a model without BatchNorm.
SYNC_BN = _has_cpu_sync_bn()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    env.pop("LOCAL_RANK", None)
    return env


def _model(seed=0):
    torch.manual_seed(seed)
    if SYNC_BN:
        return build_model("digits_cnn", num_classes=10, width=8)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 24), nn.Tanh(), nn.Linear(24, 10))


def _loaders(batch_size):
    return build_dataloaders({"name": "digits", "batch_size": batch_size, "image_size": 8, "shuffle": False,
                              "valid_batch_size": 64})


# Per optimizer step: 2 ranks x 2 micro-batches x 8 samples == 1 process x 2 micro-batches x 16 samples, and
# DistributedSampler(shuffle=False) gives rank r samples r, r+2, ...: the same 32 samples per step.
COMMON = dict(max_epochs=2, max_train_batches=4, batch_accumulate=2, optimizer="SGD",
              optimizer_params={"momentum": 0.9}, initial_lr=0.05, mixed_precision="bf16", ema=True,
              ema_params={"decay": 0.9, "decay_type": "constant"}, torch_compile=True,
              torch_compile_options={"backend": "aot_eager"}, sync_bn=SYNC_BN, progress_bar=False, device="cpu",
              valid_metrics=["accuracy", "loss"], train_metrics=["accuracy", "loss"], dist_timeout_s=60.0)


@pytest.fixture(scope="module")
def two_vs_one(tmp_path_factory):
    """One 2-process run started by the Trainer (num_processes=2) and the same
    training in this process; both in the same root."""
    root = str(tmp_path_factory.mktemp("ddp"))
    model2 = _model()
    init = copy.deepcopy(model2.state_dict())
    t0 = time.perf_counter()
    res2 = Trainer("two", ckpt_root_dir=root).train(model2, dict(COMMON, multi_gpu="ddp", num_processes=2),
                                                     *_loaders(8))
    launch_s = time.perf_counter() - t0
    torch._dynamo.reset()
    model1 = _model()
    res1 = Trainer("one", ckpt_root_dir=root).train(model1, dict(COMMON, sync_bn=False), *_loaders(16))
    torch._dynamo.reset()
    return dict(root=root, res2=res2, res1=res1, model1=model1, model2=model2, init=init, launch_s=launch_s)


def _rows(exp_dir):
    with open(os.path.join(latest_run(exp_dir), "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def _assert_close_relative_to_change(a, b, init, rel=0.01, what=""):
    """``a`` and ``b`` agree to ``rel`` of how far training moved the weights
    (bf16 forward passes of 8 vs 16 samples round differently)."""
    moved = max((b[k].float() - init[k].float()).abs().max().item() for k in init if init[k].is_floating_point())
    assert moved > 1e-3, "training did not move the weights"
    for k in a:
        if a[k].is_floating_point():
            diff = (a[k].float() - b[k].float()).abs().max().item()
            assert diff <= rel * moved, f"{what}{k}: differs by {diff:.3g}, training moved weights by {moved:.3g}"


@pytest.mark.dist
def test_two_processes_match_one_process_on_the_same_global_batches(two_vs_one):
    r = two_vs_one
    exp2 = latest_run(os.path.join(r["root"], "two"))
    ck2 = load_checkpoint(os.path.join(exp2, "ckpt_latest.pth"))
    ck1 = load_checkpoint(run_path(r["root"], "one", "ckpt_latest.pth"))
    assert ck2["world_size"] == 2 and ck1["world_size"] == 1
    assert ck2["global_step"] == ck1["global_step"] == 4  # 2 epochs x 2 steps
    # The checkpoint holds the plain model (no "module." / "_orig_mod." prefixes).
    assert set(ck2["model"]) == set(r["model1"].state_dict())
    _assert_close_relative_to_change(ck2["model"], ck1["model"], r["init"], what="model ")
    _assert_close_relative_to_change(ck2["ema"]["module"], ck1["ema"]["module"], r["init"], what="ema ")
    # The caller's model holds the trained weights after the workers finish.
    for k, v in r["model2"].state_dict().items():
        assert torch.equal(v, ck2["model"][k]), k
    # Loss and metrics are reduced over both ranks' shards: the rows match the single process's.
    f2, f1 = r["res2"]["final"], r["res1"]["final"]
    for key in ("train_loss", "valid_loss"):
        assert f2[key] == pytest.approx(f1[key], rel=1e-3), key
    for key in ("train_accuracy", "valid_accuracy"):  # bf16 rounding may flip one prediction
        assert f2[key] == pytest.approx(f1[key], abs=0.02), key
    # Logging on rank 0 only: one row per epoch.
    assert [row["epoch"] for row in _rows(exp2)] == [1, 2]
    assert r["launch_s"] < 120  # both workers started, trained and stopped


@pytest.mark.dist
def test_two_process_checkpoint_resumes_on_one_process(two_vs_one):
    r = two_vs_one
    params = dict(COMMON, max_epochs=3, torch_compile=False, sync_bn=False, resume=True)
    # Resume the 2-process run and the 1-process run on one process each, for one more epoch.
    m2, m1 = _model(seed=5), _model(seed=6)  # weights come from the checkpoints
    res2 = Trainer("two", ckpt_root_dir=r["root"]).train(m2, params, *_loaders(16))
    res1 = Trainer("one", ckpt_root_dir=r["root"]).train(m1, params, *_loaders(16))
    ck = load_checkpoint(run_path(r["root"], "two", "ckpt_latest.pth"))
    assert ck["world_size"] == 1 and ck["global_step"] == 6 and ck["epoch"] == 3
    assert [row["epoch"] for row in _rows(os.path.join(r["root"], "two"))] == [1, 2, 3]
    assert res2["final"]["epoch"] == 3
    _assert_close_relative_to_change(m2.state_dict(), m1.state_dict(), r["init"], what="resumed ")


def _torchrun(args, timeout=90, **kw):
    cmd = [sys.executable, "-m", "torch.distributed.run", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env(), **kw)


RECIPE_FAST = ["training_params.max_epochs=1", "training_params.max_train_batches=2",
               "training_params.max_valid_batches=1", "training_params.progress_bar=false",
               "dataset_params.image_size=8", "dataset_params.batch_size=16", "training_params.device=cpu"]


@pytest.mark.dist
def test_two_nodes_on_loopback(tmp_path):
    port = _free_port()
    procs = []
    for node in range(2):
        args = ["--nnodes=2", "--nproc_per_node=1", f"--node_rank={node}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=loopback", "--local-addr=127.0.0.1",
                "-m", "fusetrain.train_from_recipe", *RECIPE_FAST, f"ckpt_root_dir={tmp_path}",
                "experiment_name=nodes"]
        procs.append(subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *args], env=_env(),
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = []
    for proc in procs:
        try:
            outs.append(proc.communicate(timeout=120)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    assert all(p.returncode == 0 for p in procs), "\n----\n".join(outs)
    ck = load_checkpoint(str(run_path(tmp_path, "nodes", "ckpt_latest.pth")))
    assert ck["world_size"] == 2 and ck["epoch"] == 1
    assert [row["epoch"] for row in _rows(str(tmp_path / "nodes"))] == [1]
    # Exactly one process (global rank 0) printed the epoch line and the result.
    text = "".join(outs)
    assert text.count("epoch 1/1 |") == 1 and text.count('"experiment_dir"') == 1


FAILING_SCRIPT = '''
import os, sys
import torch.nn.functional as F
from torch import nn
from fusetrain.training.data import build_dataloaders
from fusetrain.models import build_model
from fusetrain.training.trainer import Trainer



class FailOnRankOne(nn.Module):
    """Cross-entropy that raises on rank 1 at its STEP-th call."""

    def __init__(self, step):
        super().__init__()
        self.step, self.calls = step, 0

    def forward(self, out, y):
        self.calls += 1
        if os.environ.get("RANK") == "1" and self.calls == self.step:
            raise RuntimeError(f"injected failure at step {self.step}")
        return F.cross_entropy(out, y)


if __name__ == "__main__":
    loaders = build_dataloaders({"name": "digits", "batch_size": 16, "image_size": 8})
    params = {"max_epochs": 3, "max_train_batches": 4, "progress_bar": False, "device": "cpu",
              "loss": FailOnRankOne(3), "dist_timeout_s": 30.0}
    Trainer("failing", ckpt_root_dir=sys.argv[1]).train(build_model("digits_cnn", width=8), params, *loaders)
'''


@pytest.mark.dist
def test_failing_rank_stops_the_run_and_is_named(tmp_path):
    script = tmp_path / "failing_rank.py"
    script.write_text(FAILING_SCRIPT)
    t0 = time.perf_counter()
    proc = _torchrun(["--standalone", "--nproc_per_node=2", str(script), str(tmp_path)], timeout=120)
    elapsed = time.perf_counter() - t0
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert elapsed < 60, f"took {elapsed:.1f}s"
    assert "injected failure at step 3" in out, out
    assert "rank 1 (local rank 1) of 2 failed during training" in out, out
    # torchrun's failure summary names rank 1 as a failed worker.
    assert "rank      : 1" in out or "rank: 1" in out, out


class FailingLoss(nn.Module):
    """Raises on rank 1 at its 2nd call (picklable: a module-level class)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, out, y):
        self.calls += 1
        if os.environ.get("RANK") == "1" and self.calls == 2:
            raise RuntimeError("injected failure in the loss")
        return nn.functional.cross_entropy(out, y)


@pytest.mark.dist
def test_failing_worker_raises_an_error_naming_its_rank(tmp_path):
    t0 = time.perf_counter()
    with pytest.raises(D.DistributedTrainingError, match=r"rank 1 .*failed first: .*injected failure") as info:
        Trainer("fail", ckpt_root_dir=str(tmp_path)).train(
            _model(), dict(progress_bar=False, device="cpu", max_epochs=2, max_train_batches=3, loss=FailingLoss(),
                           multi_gpu="ddp", num_processes=2, dist_timeout_s=30.0), *_loaders(8))
    assert info.value.rank == 1
    assert time.perf_counter() - t0 < 60


# ---- validation and the building blocks (no processes started) ---------------------------------------------------


def test_more_gpus_than_available_is_an_error(tmp_path):
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(TrainingParamsError, match=rf"num_gpus: got {n + 1} but only {n} CUDA device"):
        Trainer("x", ckpt_root_dir=str(tmp_path)).train(_model(), {"multi_gpu": "ddp", "num_gpus": n + 1},
                                                         *_loaders(8))
    assert not os.path.exists(tmp_path / "x")


@pytest.mark.parametrize("bad,match", [
    ({"multi_gpu": "nccl"}, r"training_params.multi_gpu: got 'nccl' \(str\); allowed: one of 'off', 'auto', 'ddp'"),
    ({"num_gpus": 0}, r"training_params.num_gpus: got 0 \(int\); allowed: an int >= 1 or None"),
    ({"num_processes": -1}, r"training_params.num_processes: got -1"),
    ({"num_gpus": 2, "num_processes": 2}, r"num_gpus / num_processes: got 2 and 2"),
    ({"num_gpus": 2, "device": "cpu"}, r"training_params.num_gpus: got 2 with device 'cpu'"),
    ({"num_processes": 2, "device": "cuda"}, r"training_params.num_processes: got 2 with device 'cuda'"),
    ({"num_processes": 2, "multi_gpu": "off"}, r"training_params.num_processes: got 2 with multi_gpu 'off'"),
    ({"dist_backend": "nccl", "device": "cpu"}, r"training_params.dist_backend: got 'nccl' with device 'cpu'"),
    ({"dist_timeout_s": -5}, r"training_params.dist_timeout_s: got -5 \(int\); allowed: a float > 0"),
    ({"find_unused_parameters": 1}, r"training_params.find_unused_parameters: got 1 \(int\)"),
])
def test_bad_distributed_params(tmp_path, bad, match):
    with pytest.raises(TrainingParamsError, match=match):
        Trainer("x", ckpt_root_dir=str(tmp_path)).train(_model(), bad, *_loaders(8))
    assert not os.path.exists(tmp_path / "x")


def test_multi_gpu_values_are_normalised():
    assert resolve_training_params({"multi_gpu": "DDP"}).multi_gpu == "ddp"
    assert resolve_training_params({"multi_gpu": False}).multi_gpu == "off"  # YAML's bare `off`
    assert resolve_training_params({"multi_gpu": True}).multi_gpu == "ddp"


def test_workers_to_launch(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    p = resolve_training_params
    assert D.workers_to_launch(p({"device": "cpu"})) == 1
    assert D.workers_to_launch(p({"device": "cpu", "multi_gpu": "ddp", "num_processes": 3})) == 3
    assert D.workers_to_launch(p({"device": "cpu", "num_processes": 2})) == 2  # 'auto' with 2 processes asked
    assert D.workers_to_launch(p({"device": "cpu", "multi_gpu": "ddp", "num_processes": 1})) == 1
    if not torch.cuda.is_available():
        with pytest.raises(TrainingParamsError, match="multi_gpu: got 'ddp' on the CPU .* without num_processes"):
            D.workers_to_launch(p({"multi_gpu": "ddp"}))
    # Under a launcher the launcher has started the processes: nothing more to start.
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert D.env_world() == (1, 2, 1)
    assert D.workers_to_launch(p({"device": "cpu", "multi_gpu": "ddp", "num_processes": 4})) == 1
    with pytest.raises(TrainingParamsError, match="multi_gpu: got 'off' but this process is rank 1 of 2"):
        D.setup(p({"multi_gpu": "off", "device": "cpu"}))
    with pytest.raises(TrainingParamsError, match="compile_step: got 'cuda_graph' in a distributed run"):
        D.setup(types.SimpleNamespace(multi_gpu="auto", device="cuda", dist_backend="auto", dist_timeout_s=5.0,
                                      compile_step="cuda_graph"))  # (a CUDA-only combination; checked first)


def test_unpicklable_payload_names_the_problem_and_the_recipe_path(tmp_path):
    with pytest.raises(TypeError, match=r"sends them training_params by pickling.*recipe"):
        Trainer("x", ckpt_root_dir=str(tmp_path)).train(
            _model(), {"device": "cpu", "multi_gpu": "ddp", "num_processes": 2,
                       "loss": lambda out, y: nn.functional.cross_entropy(out, y)}, *_loaders(8))


def test_shard_sampler_covers_the_dataset_once():
    data = list(range(11))
    shards = [list(sharding.ShardSampler(data, 3, r)) for r in range(3)]
    assert sorted(i for s in shards for i in s) == data
    assert [len(sharding.ShardSampler(data, 3, r)) for r in range(3)] == [len(s) for s in shards] == [4, 4, 3]


def test_train_loader_is_rewrapped_keeping_its_settings():
    from torch.utils.data import DataLoader, TensorDataset

    from fusetrain.training.distributed.global_order import GlobalOrderSampler

    ds = TensorDataset(torch.arange(20.0).view(20, 1), torch.arange(20))

    def collate(batch):
        return torch.stack([b[0] for b in batch]) * 2, torch.stack([b[1] for b in batch])

    state = D.DistContext(rank=1, world_size=2)
    for shuffle in (False, True):
        loader = DataLoader(ds, batch_size=3, shuffle=shuffle, drop_last=True, collate_fn=collate)
        sharded = sharding.shard_train_loader(loader, state, seed=7)
        assert isinstance(sharded.sampler, GlobalOrderSampler) and sharded.sampler.shuffle == shuffle
        assert sharded.sampler.drop_last and sharded.sampler.global_batch == 6
        assert (sharded.batch_size, sharded.collate_fn) == (3, collate)
        sharding.set_epoch(sharded, 1)
        seen = torch.cat([y for _, y in sharded])
        assert len(seen) == 9  # 18 samples in whole global batches of 6: 9 for rank 1, batches of 3
        if not shuffle:
            assert seen.tolist() == list(range(1, 19, 2))
            assert torch.equal(next(iter(sharded))[0].view(-1), torch.tensor([2.0, 6.0, 10.0]))  # collate kept
        else:  # rank 1's share of the epoch's permutation of the whole dataset (seed + epoch)
            order = torch.randperm(20, generator=torch.Generator().manual_seed(8)).tolist()[:18]
            assert seen.tolist() == order[1::2]
    single = sharding.shard_train_loader(loader, D.SINGLE, seed=0, batch_size=6)
    assert single.batch_size == 6 and single.sampler.world_size == 1 and len(single) == 3


def test_epoch_seeds_differ_per_rank_and_epoch():
    seeds = {D.epoch_seed(42, r, e) for r in range(4) for e in range(4)}
    assert len(seeds) == 16
    assert D.epoch_seed(42, 1, 0) == D.epoch_seed(42, 1, 0) != D.epoch_seed(43, 1, 0)


def test_recipes_expose_multi_gpu():
    from fusetrain.train_from_recipe import load_recipe

    recipe = load_recipe("default", ["training_params.multi_gpu=ddp", "training_params.num_gpus=2"])
    assert recipe["training_params"]["multi_gpu"] == "ddp" and recipe["training_params"]["num_gpus"] == 2
