"""async_checkpoints (NOTE [asynchronous checkpoints]): the files a run
writes in the background are the files it writes in the foreground, their
callbacks run on the training thread with the progress they saved, a failed
write raises, and a resumed run continues from them."""

import os
import threading

import pytest
import torch

from fusetrain import Callback
from fusetrain.training.checkpoint import manager as checkpoint_manager
from fusetrain.training.checkpoint.snapshot import HostSnapshot
from fusetrain.training.checkpoint.files import load_checkpoint

from _test_helpers import CUDA
from _train_helpers import one_thread  # noqa: F401  (fixture)
from _train_helpers import assert_tree_equal, train
from _test_helpers import run_path

FAST = dict(max_epochs=3, max_train_batches=6, max_valid_batches=2, ckpt_every_n_steps=4, keep_last_ckpts=2,
            save_ckpt_epoch_list=[2])
SAVED = ("model", "optimizer", "scaler", "ema", "global_step", "epoch", "best", "schedule", "position")


class Saved(Callback):
    def __init__(self):
        self.calls = []

    def on_checkpoint_saved(self, state, path):
        self.calls.append((state.global_step, os.path.basename(path), threading.current_thread().name,
                           os.path.exists(path)))


def files(d):
    return sorted(n for n in os.listdir(d) if n.endswith(".pth"))


def test_background_writes_are_the_foreground_files(tmp_path, monkeypatch):
    real, writers = checkpoint_manager.atomic_save, []

    def recorded(obj, path):
        writers.append(threading.current_thread().name)
        real(obj, path)

    monkeypatch.setattr(checkpoint_manager, "atomic_save", recorded)
    runs = {}
    for mode in (False, True):
        saved = Saved()
        result, _ = train(tmp_path / str(mode), "exp", callbacks=[saved], async_checkpoints=mode, **FAST)
        runs[mode] = (result["run_dir"], saved.calls)
    (d_sync, calls_sync), (d_async, calls_async) = runs[False], runs[True]
    half = len(writers) // 2  # the foreground run's writes, then the background run's
    assert half > 3 and writers[:half] == [threading.main_thread().name] * half
    assert set(writers[half:]) == {checkpoint_manager.WRITER_THREAD + os.path.basename(d_async) + "_0"} and len(calls_async) > half
    assert files(d_sync) == files(d_async) and "ckpt_epoch_2.pth" in files(d_async)
    for name in files(d_sync):
        a, b = load_checkpoint(os.path.join(d_sync, name)), load_checkpoint(os.path.join(d_async, name))
        for key in SAVED:
            assert_tree_equal(a.get(key), b.get(key))
    # The same callbacks, in order, with the step each file saved, on the training thread, the file there.
    assert [c[:2] for c in calls_async] == [c[:2] for c in calls_sync]
    assert all(c[2] == threading.main_thread().name and c[3] for c in calls_async)


def test_a_failed_background_write_raises_and_keeps_the_last_file(tmp_path, monkeypatch):
    real, writes = checkpoint_manager.atomic_save, []

    def flaky(obj, path):
        writes.append(path)
        if len(writes) == 2:
            raise OSError("disk full")
        real(obj, path)

    monkeypatch.setattr(checkpoint_manager, "atomic_save", flaky)
    with pytest.raises(OSError, match="disk full"):
        train(tmp_path, "exp", async_checkpoints=True, **dict(FAST, keep_last_ckpts=0))
    ck = load_checkpoint(run_path(tmp_path, "exp", "ckpt_latest.pth"))
    assert ck["global_step"] == 4  # the first write, whole


def test_resume_continues_from_background_checkpoints(tmp_path):
    straight, _ = train(tmp_path / "a", "exp", async_checkpoints=True, **FAST)
    train(tmp_path / "b", "exp", async_checkpoints=True, **dict(FAST, max_epochs=2))
    resumed, _ = train(tmp_path / "b", "exp", async_checkpoints=True, resume=True, **FAST)
    for key in ("model", "optimizer"):
        assert_tree_equal(load_checkpoint(os.path.join(straight["run_dir"], "ckpt_latest.pth"))[key],
                          load_checkpoint(os.path.join(resumed["run_dir"], "ckpt_latest.pth"))[key])


def test_the_snapshot_is_a_host_copy():
    t = torch.ones(3)
    state = {"a": [t, (t, 2)], "b": {"c": t}}
    host = HostSnapshot()
    snap = host.take(state)
    host.ready()
    t.add_(1)
    assert torch.equal(snap["a"][0], torch.ones(3)) and snap["a"][1][1] == 2
    assert torch.equal(snap["b"]["c"], torch.ones(3)) and snap["a"][0].data_ptr() != t.data_ptr()


@CUDA
def test_a_cuda_snapshot_is_pinned_queued_and_reused():
    """NOTE [pinned snapshot]: dense CUDA tensors land in page-locked buffers kept for the next snapshot; a
    change queued after the snapshot does not reach it; a tensor whose shape changed gets a new buffer."""
    w = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
    odd = torch.ones(6, 4, device="cuda").t()  # not contiguous
    state = {"model": {"w": w, "odd": odd}, "step": torch.tensor(3), "sizes": [w[:5]]}
    host = HostSnapshot()
    snap = host.take(state)
    w.mul_(-1)  # queued behind the copies
    host.ready()
    assert snap["model"]["w"].is_pinned() and snap["model"]["w"].device.type == "cpu"
    assert torch.equal(snap["model"]["w"], torch.arange(1 << 20, dtype=torch.float32))
    assert torch.equal(snap["model"]["odd"], torch.ones(4, 6)) and torch.equal(snap["step"], torch.tensor(3))
    assert torch.equal(snap["sizes"][0], torch.arange(5, dtype=torch.float32))
    first = snap["model"]["w"].data_ptr()
    state["sizes"] = [w[:7]]
    again = host.take(state)
    host.ready()
    assert again["model"]["w"].data_ptr() == first, "the buffer is reused"
    assert torch.equal(again["model"]["w"], -torch.arange(1 << 20, dtype=torch.float32))
    assert again["sizes"][0].shape == (7,)
