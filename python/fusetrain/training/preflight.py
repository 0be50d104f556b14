"""What the Trainer checks before it writes anything (a trainable model,
loaders that have batches, a known number of steps per epoch), and the plain
cause of a batch that fails (inputs of another dtype than the model, class
targets out of range)."""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
from torch import Tensor, nn

from .params import TrainingParams, TrainingParamsError

__all__ = ["loader_length", "check_trainable", "check_not_empty", "steps_per_epoch", "class_loss", "target_range",
           "targets_out_of_range", "explain_batch_error"]


def loader_length(loader) -> Optional[int]:
    """``len(loader)``, or None for a loader without one (a DataLoader over an
    IterableDataset without ``__len__`` raises TypeError)."""
    try:
        return len(loader)
    except (TypeError, NotImplementedError):
        return None


def check_trainable(model: nn.Module) -> None:
    if not any(q.requires_grad for q in model.parameters()):
        n = sum(1 for _ in model.parameters())
        raise ValueError(f"Trainer.train: the model has no trainable parameters ({n} parameter(s), all with "
                         f"requires_grad=False); unfreeze the ones to train (p.requires_grad_(True))")


def check_not_empty(loader, what: str) -> None:
    if loader_length(loader) == 0:
        raise ValueError(f"Trainer: {what} is empty (len 0); it must yield at least one batch")


def steps_per_epoch(loader, p: TrainingParams) -> int:
    """Optimizer steps per epoch, for the schedule and the EMA's total_steps."""
    n = loader_length(loader)
    if n is None:
        if not p.max_train_batches:
            raise TrainingParamsError([
                "training_params.max_train_batches: got None but the train loader has no length (an iterable "
                "dataset), so the steps per epoch that the lr schedule, its warmup and the EMA's total_steps count "
                "in are unknown; allowed here: the number of batches of an epoch (an int >= 1); the epoch then "
                "ends after that many batches or when the loader ends"])
        n = p.max_train_batches
    elif p.max_train_batches:
        n = min(n, p.max_train_batches)
    return max(1, -(-n // p.batch_accumulate))


def class_loss(p: TrainingParams) -> bool:
    """Whether the loss is a built-in cross-entropy/NLL (whose targets are class indices)."""
    return isinstance(p.loss, str) and p.loss.lower().replace("_", "") in (
        "crossentropy", "crossentropyloss", "nll", "nllloss")


def target_range(y: Any) -> Optional[Tuple[int, int]]:
    """(min, max) of integer targets, else None. One host read: the Trainer
    calls it once per session, before the first step (on a GPU a target out
    of range fails inside a kernel, where no cause can be named)."""
    if isinstance(y, Tensor) and y.numel() and not y.is_floating_point() and not y.is_complex() \
            and y.dtype != torch.bool:
        lo, hi = torch.aminmax(y.detach())
        return int(lo), int(hi)
    return None


def targets_out_of_range(out: Any, y: Any, rng: Optional[Tuple[int, int]], ignore_index: int) -> Optional[str]:
    """The cause when class targets (shape of the output without dim 1) fall
    outside ``[0, classes)`` (``ignore_index`` aside); None when fine or not classes."""
    if rng is None or not isinstance(out, Tensor) or not isinstance(y, Tensor) or out.dim() < 2 \
            or tuple(y.shape) != tuple(out.shape[:1]) + tuple(out.shape[2:]):
        return None
    classes, (lo, hi) = out.shape[1], rng
    if hi >= classes or (lo < 0 and lo != ignore_index):
        return (f"the batch's class targets range over [{lo}, {hi}] but the model outputs {classes} classes "
                f"(allowed targets: 0 to {classes - 1}, or ignore_index {ignore_index}); check the labels or the "
                f"model's num_classes")
    return None


def explain_batch_error(model: nn.Module, x: Any, y: Any, rng: Optional[Tuple[int, int]], ignore_index: int,
                        call) -> Optional[str]:
    """The cause of a failing step when it is one of the usual ones; ``call(x)``
    runs the model (again, without gradients) to find the number of classes."""
    dtypes = {q.dtype for q in model.parameters() if q.is_floating_point()}
    leaves = [t for t in _tensors(x) if t.is_floating_point() and t.dtype not in dtypes]
    if leaves and len(dtypes) == 1:
        return (f"the batch's inputs are {str(leaves[0].dtype)[6:]} but the model's parameters are "
                f"{str(next(iter(dtypes)))[6:]}; convert the inputs (in the dataset, the collate_fn or split_batch) "
                f"or the model to one dtype")
    if rng is None:
        return None
    try:
        with torch.no_grad():
            out = call(x)
    except Exception:
        return None
    return targets_out_of_range(out, y, rng, ignore_index)


def _tensors(x: Any):
    if isinstance(x, Tensor):
        yield x
    elif isinstance(x, dict):
        for v in x.values():
            yield from _tensors(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _tensors(v)
