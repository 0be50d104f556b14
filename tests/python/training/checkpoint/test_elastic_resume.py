"""Resume on another number of processes (gloo, CPU): a run stopped mid-epoch
by SIGUSR1 on 2 processes resumes on 1 and on 3; every sample of each epoch
is trained on exactly once across the stops (the batches' sample indices are
recorded), and the final weights (and EMA) match the uninterrupted
2-process run up to the order of fp32 reductions. Also with DataLoader
workers and per-sample random augmentation, and with ``multi_gpu: fsdp``;
three stops in one epoch on 2, 1 and 3 processes; the global batch kept or
refused."""

import glob
import json
import multiprocessing
import os
import shutil
import signal
from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset

from fusetrain import Callback
from fusetrain.training.checkpoint.files import load_checkpoint
from fusetrain.training.distributed.global_order import GlobalOrderSampler, SeededSamples
from fusetrain.training.trainer import Trainer
from fusetrain.training.distributed.preemption import TrainingInterrupted

from _test_helpers import run_path

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="needs torch.distributed with the gloo backend")

N = 48  # samples; the global batch is 12 (batch 6 x 2 processes): 4 steps per epoch


class Numbered(Dataset):
    """``(x, label, index)``; with ``augment``, noise drawn from torch's global generator is added (a random
    augmentation)."""

    def __init__(self, augment=False):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(N, 8, generator=g)
        self.y = torch.randint(0, 4, (N,), generator=g)
        self.augment = augment

    def __len__(self):
        return N

    def __getitem__(self, i):
        x = self.x[i] + (0.5 * torch.randn(8) if self.augment else 0.0)
        return x, self.y[i], i


class RecordSamples(Callback):
    """Appends each trained batch's sample indices, with the epoch and the process's start method, to
    ``<dir>/<tag>.samples.jsonl``."""

    def __init__(self, directory, tag):
        self.directory, self.tag = directory, tag

    def on_train_batch_end(self, state):
        idx = state.batch[2][0].tolist()
        with open(os.path.join(self.directory, f"{self.tag}.samples.jsonl"), "a") as f:
            f.write(json.dumps({"epoch": state.epoch, "rank": int(os.environ.get("RANK", 0)), "idx": idx,
                                "start_method": multiprocessing.get_start_method(allow_none=True)}) + "\n")


class SignalAtStep(Callback):
    """Rank 0 sends itself ``SIGUSR1`` at the end of optimizer step ``step``."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, state):
        if state.global_step == self.step and os.environ.get("RANK", "0") == "0":
            os.kill(os.getpid(), signal.SIGUSR1)


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def loader(batch_size=6, augment=False, workers=0):
    return DataLoader(Numbered(augment), batch_size=batch_size, shuffle=True, num_workers=workers)


BASE = dict(max_epochs=2, optimizer="SGD", optimizer_params={"momentum": 0.9}, initial_lr=0.1, ema=True,
            ema_params={"decay": 0.9, "decay_type": "constant"}, progress_bar=False, device="cpu",
            log_interval=1, train_metrics=["loss"], dist_timeout_s=60.0)


def train(root, name, processes, tag, params, batch_size=6, augment=False, workers=0, callbacks=()):
    p = dict(BASE, **params, callbacks=[RecordSamples(root, tag), *callbacks])
    if processes > 1:
        p.update(multi_gpu=params.get("multi_gpu", "ddp"), num_processes=processes)
    return Trainer(name, ckpt_root_dir=root).train(model(), p, loader(batch_size, augment, workers))


def samples(root, tags):
    seen = {}
    for tag in tags:
        with open(os.path.join(root, f"{tag}.samples.jsonl")) as f:
            for line in f:
                row = json.loads(line)
                seen.setdefault(row["epoch"], []).extend(row["idx"])
                if row["rank"] > 0:
                    # NOTE [worker start method]: a launched worker starts its loader's workers as this process would.
                    assert row["start_method"] == (multiprocessing.get_start_method(allow_none=True)
                                                   or multiprocessing.get_all_start_methods()[0]), row
    return seen


def final(root, name):
    from fusetrain.training.checkpoint.sharded import full_state_dict

    path = run_path(root, name, "ckpt_latest.pth")
    return full_state_dict(path), full_state_dict(path, ema=True), load_checkpoint(path)


def assert_close(a, b, what):
    for k in a:
        assert torch.allclose(a[k].float(), b[k].float(), rtol=1e-4, atol=1e-5), \
            f"{what} {k}: differs by {(a[k].float() - b[k].float()).abs().max().item():.3g}"


def copy_experiment(root, src, dst):
    shutil.copytree(os.path.join(root, src), os.path.join(root, dst), ignore=shutil.ignore_patterns(".lock"))


# DDP with loader workers and random augmentation (their streams resume too),
# FSDP with the data loaded in the training process.
VARIANTS = {
    "ddp_workers_augment": dict(params={}, data=dict(augment=True, workers=2)),
    "fsdp": dict(params={"multi_gpu": "fsdp"}, data={}),
}


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_sigusr1_on_two_processes_resumes_on_one_and_on_three(tmp_path, variant):
    root, v = str(tmp_path), VARIANTS[variant]
    params, data = v["params"], v["data"]
    train(root, "whole", 2, "whole", params, **data)
    with pytest.raises(TrainingInterrupted, match="stopped on SIGUSR1 after optimizer step 2"):
        train(root, "cut", 2, "cut", params, callbacks=[SignalAtStep(2)], **data)
    ck = load_checkpoint(run_path(root, "cut", "ckpt_latest.pth"))
    assert ck["position"]["batches"] == 2 and ck["data_order"]["world_size"] == 2 and ck["global_step"] == 2
    copy_experiment(root, "cut", "cut_on_3")
    one_params = dict(params, multi_gpu="off") if variant == "fsdp" else params
    with pytest.warns(UserWarning, match="num_processes: 2 -> None"):  # the run's other settings are reported
        train(root, "cut", 1, "on_1", dict(one_params, resume="auto"), **data)
    train(root, "cut_on_3", 3, "on_3", dict(params, resume="auto"), **data)
    whole = final(root, "whole")
    assert whole[2]["global_step"] == 8
    for name, tags in (("cut", ["cut", "on_1"]), ("cut_on_3", ["cut", "on_3"])):
        seen = samples(root, tags)
        assert sorted(seen) == [0, 1]
        for epoch in (0, 1):  # every sample once per epoch, none skipped or repeated across the stop
            assert sorted(seen[epoch]) == list(range(N)), (name, epoch)
        got = final(root, name)
        assert got[2]["global_step"] == 8 and got[2]["epoch"] == 2
        assert_close(whole[0], got[0], f"{name} model")
        assert_close(whole[1], got[1], f"{name} ema")
    # The kept global batch: 1 process accumulates 2 batches of 6; 3 processes take batches of 4.
    assert load_checkpoint(run_path(root, "cut", "ckpt_latest.pth"))["data_order"]["batch_accumulate"] == 2
    assert load_checkpoint(run_path(root, "cut_on_3", "ckpt_latest.pth"))["data_order"]["batch_size"] == 4



@pytest.mark.dist
@pytest.mark.slow
def test_three_stops_in_one_epoch_each_resumed_on_another_number_of_processes(tmp_path):
    root = str(tmp_path)
    params = dict(max_epochs=1, resume="auto")
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    train(root, "whole", 2, "whole", params)
    # Steps 1, 2 and 3 of the epoch's 4 end in a stop: on 2, then 1, then 3 processes; 2 finish it.
    for part, (processes, stop) in enumerate([(2, 1), (1, 2), (3, 3)]):
        # In this process the run's other settings are reported (a warning); launched workers report theirs.
        with pytest.raises(TrainingInterrupted, match=f"stopped on SIGUSR1 after optimizer step {stop};"), \
                pytest.warns(UserWarning, match="num_processes: 2 -> None") if processes == 1 else nullcontext():
            train(root, "cut", processes, f"part{part}", params, callbacks=[SignalAtStep(stop)])
        assert load_checkpoint(run_path(root, "cut", "ckpt_latest.pth"))["world_size"] == processes
    train(root, "cut", 2, "part3", params)
    seen = samples(root, [f"part{k}" for k in range(4)])
    assert list(seen) == [0] and sorted(seen[0]) == list(range(N))
    whole, got = final(root, "whole"), final(root, "cut")
    assert got[2]["global_step"] == whole[2]["global_step"] == 4
    assert_close(whole[0], got[0], "model")
    assert_close(whole[1], got[1], "ema")
    # The caller's signal handlers are back after the launches and the stops.
    assert {s: signal.getsignal(s) for s in handlers} == handlers

# ---- the global order, the kept global batch ----------------------------------------------------------------

def test_the_global_order_is_the_same_on_any_number_of_processes():
    for drop_last, n in ((False, 50), (True, 50), (False, 48)):
        orders = {}
        for world in (1, 2, 3, 4, 6):
            shards = [GlobalOrderSampler(n, world, r, True, 3, drop_last, 12) for r in range(world)]
            for s in shards:
                s.set_epoch(2)
            keys = [list(s) for s in shards]
            assert len({len(k) for k in keys}) == 1  # every rank as many samples
            assert all(e == 2 for k in keys for e, _ in k)
            # Position k * world + r of the global order is sample keys[r][k].
            orders[world] = [keys[r][k][1] for k in range(len(keys[0])) for r in range(world)]
        full = orders[1]
        if drop_last:
            assert len(full) == 48 and len(set(full)) == 48
        for world, order in orders.items():
            assert order[:48] == full[:48], world  # the same global batches of 12 on any number of processes
            if n == 48:
                assert order == full and sorted(order) == list(range(48))
            elif not drop_last:  # padded with the first samples to a multiple of the process count
                assert sorted(set(order)) == list(range(50)) and len(order) == -(-50 // world) * world
    other_epoch = GlobalOrderSampler(48, 1, 0, True, 3, False, 12)
    assert other_epoch.order(0) != other_epoch.order(1) and sorted(other_epoch.order(1)) == list(range(48))


def test_augmentation_is_seeded_per_sample_and_leaves_the_training_rng_alone():
    data = SeededSamples(Numbered(augment=True), seed=5)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    a = data[(1, 7)][0]
    assert torch.equal(torch.get_rng_state(), before)
    torch.manual_seed(123)
    assert torch.equal(data[(1, 7)][0], a)  # whoever loads it, whenever
    assert not torch.equal(data[(2, 7)][0], a) and not torch.equal(data[(1, 8)][0], data[(1, 7)][0])
    workers = DataLoader(data, batch_size=4, num_workers=2, sampler=[(1, i) for i in range(8)])
    main = DataLoader(data, batch_size=4, sampler=[(1, i) for i in range(8)])
    for (xw, _, iw), (xm, _, im) in zip(workers, main):
        assert torch.equal(iw, im) and torch.equal(xw, xm)


def _checkpoint(position=True):
    ck = {"world_size": 2, "data_order": {"global": True, "seed": 3, "batch_size": 6, "batch_accumulate": 1,
                                          "world_size": 2}}
    if position:
        ck["position"] = {"epoch": 0, "batches": 2, "step0": 0, "skipped_seen": 0.0, "ranks": [{}, {}]}
    return ck


def test_the_global_batch_is_kept_or_refused():
    from fusetrain.training import resolve_training_params
    from fusetrain.training.checkpoint import elastic as elastic_resume
    p = resolve_training_params({"max_train_batches": 4})
    one = elastic_resume.plan(_checkpoint(), "c.pth", p, loader(6), 1)
    assert one.params.batch_accumulate == 2 and one.params.max_train_batches == 8 and one.batch_size is None
    assert one.seed == 3 and one.changed == ("batch_accumulate", "max_train_batches")
    assert "batch_accumulate 2 keeps it" in one.note
    three = elastic_resume.plan(_checkpoint(), "c.pth", p, loader(6), 3)
    assert three.params.batch_accumulate == 1 and three.batch_size == 4 and "batch_size 4 per process" in three.note
    same = elastic_resume.plan(_checkpoint(), "c.pth", p, loader(6), 2)
    assert same.params is p and same.batch_size is None and same.note == ""
    with pytest.raises(ValueError, match=r"resume on 5 process\(es\): c.pth was trained with batch_size 6 x "
                                         r"batch_accumulate 1 x 2 process\(es\) = global batch 12, which neither"):
        elastic_resume.plan(_checkpoint(), "c.pth", p, loader(6), 5)
    with pytest.warns(UserWarning, match="training goes on with the global batch 30"):
        kept = elastic_resume.plan(_checkpoint(position=False), "c.pth", p, loader(6), 5)
    assert kept.params is p and kept.batch_size is None
    shard_order = dict(_checkpoint(), data_order=dict(_checkpoint()["data_order"], **{"global": False}))
    with pytest.raises(ValueError, match=r"middle of epoch 1 by 2 process\(es\) and its train loader did not read"):
        elastic_resume.plan(shard_order, "c.pth", p, loader(6), 1)


@pytest.mark.slow
def test_an_unkeepable_global_batch_is_refused_before_anything_is_written(tmp_path):
    root = str(tmp_path)
    params = dict(batch_accumulate=2, max_epochs=1)
    with pytest.raises(TrainingInterrupted):
        train(root, "one", 1, "one", params, callbacks=[SignalAtStep(2)])
    before = sorted(os.listdir(os.path.join(root, "one")))
    with pytest.raises(ValueError, match=r"global batch 12, which neither .* on 5 process\(es\)"):
        train(root, "one", 5, "five", dict(params, resume=True))
    assert sorted(os.listdir(os.path.join(root, "one"))) == before and not glob.glob(f"{root}/five.samples*")
