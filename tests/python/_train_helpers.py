"""Helpers shared by the Trainer and TrainStep tests: small models and loaders, a short Trainer run, reading
a run's files, and a training child process (``_train_child.py``)."""

import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from fusetrain.models import build_model
from fusetrain.training.checkpoint.files import load_checkpoint
from fusetrain.training.data import build_dataloaders
from fusetrain.training.trainer import Trainer

from _test_helpers import TESTS, latest_run

#: A short run: 2 epochs of 3 batches, one validation batch.
QUICK = dict(max_epochs=2, max_train_batches=3, max_valid_batches=1, progress_bar=False, device="cpu")
CHILD = os.path.join(TESTS, "_train_child.py")


def loaders(batch_size=32, image_size=12, **kw):
    """Fresh digits loaders: the train loader's shuffling generator is part of the loader, so each run needs its
    own to see the same batches."""
    return build_dataloaders({"name": "digits", "batch_size": batch_size, "image_size": image_size, **kw})


def cnn(width=8, seed=0, **kw):
    """``digits_cnn`` (with BatchNorm), seeded."""
    torch.manual_seed(seed)
    return build_model("digits_cnn", num_classes=10, width=width, **kw)


def mlp(image_size=8, seed=0):
    """A model without BatchNorm (for exact gradient-accumulation checks)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Flatten(), nn.Linear(image_size * image_size, 24), nn.Tanh(), nn.Linear(24, 10))


def train(tmp_path, name="exp", model=None, data=None, **params):
    """``Trainer(name).train`` of ``model`` (default :func:`cnn`) on ``data`` (default :func:`loaders`) with
    :data:`QUICK` and ``params``; returns ``(result, model)``."""
    tl, vl = loaders() if data is None else data
    model = cnn() if model is None else model
    return Trainer(name, ckpt_root_dir=str(tmp_path)).train(model, {**QUICK, **params}, tl, vl), model


def rows_of(run_dir):
    """The rows of a run's metrics.jsonl (of an experiment folder: of its newest run)."""
    with open(os.path.join(latest_run(run_dir), "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def ckpt(run_dir, name="ckpt_latest.pth"):
    """A run's checkpoint file (of an experiment folder: of its newest run)."""
    return load_checkpoint(os.path.join(latest_run(run_dir), name))


def assert_tree_equal(a, b, path="root"):
    """torch.equal on every tensor of two nested containers, == on the rest."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a, b), f"{path}: max |diff| {(a.double() - b.double()).abs().max().item()}"
    elif isinstance(a, dict):
        assert set(a) == set(b), f"{path}: keys {set(a) ^ set(b)}"
        for k in a:
            assert_tree_equal(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_tree_equal(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def child(tmp_path, name, mode, **params):
    """A training child process (``_train_child.py``): ``mode`` says how it runs and where it stops."""
    return subprocess.Popen([sys.executable, CHILD, str(tmp_path), name, mode, json.dumps(params)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc, timeout=120):
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The models are tiny: one intra-op thread is as fast, and much steadier on
    a busy 2-core machine (no OpenMP threads spinning on a preempted sibling).
    Import it into a test module to use it there."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


class InterruptingLoader:
    """A train loader that raises after ``after`` batches of epoch ``epoch``
    (1-based), like a Ctrl-C in the middle of an epoch."""

    def __init__(self, loader, epoch=None, after=0, exc=KeyboardInterrupt):
        self.loader, self.epoch, self.after, self.exc = loader, epoch, after, exc
        self.epochs_started = 0

    @property
    def generator(self):
        return self.loader.generator

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        self.epochs_started += 1
        for i, batch in enumerate(self.loader):
            if self.epochs_started == self.epoch and i == self.after:
                raise self.exc("interrupted")
            yield batch
