"""Helpers shared by the Trainer and TrainStep tests."""


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
