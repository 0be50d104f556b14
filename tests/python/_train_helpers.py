"""Helpers shared by the Trainer and TrainStep tests."""

import pytest
import torch


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
