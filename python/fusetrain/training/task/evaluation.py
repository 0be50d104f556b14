"""Evaluation: the loss (and its components) and metrics of a model over a
loader, in eval mode under ``torch.inference_mode()``; the running sums of the
loss that training and evaluation keep in device tensors."""

from __future__ import annotations

import itertools
from typing import Any, Dict, List, Optional

import torch
from torch import Tensor

from ...amp import Precision
from .batches import call_model, count_samples, split_batch, to_channels_last, to_device
from .losses import split_loss
from .metrics import MetricSet
from .registry import import_path

__all__ = ["LossSums", "batch_rules", "component_key", "evaluate", "prefixed", "resolve_fn"]


def resolve_fn(value: Any) -> Any:
    """A function given by its path in a recipe (``package.module.function``)."""
    if isinstance(value, str) and "." in value:
        return import_path(value, "training_params")
    return value


def batch_rules(p: Any) -> Dict[str, Any]:
    """How a batch reaches the model under training params ``p`` (``split_batch``, ``model_input``,
    ``channels_last``), as :func:`evaluate`'s keyword arguments."""
    return {"split_fn": resolve_fn(p.split_batch), "model_input": resolve_fn(p.model_input),
            "channels_last": p.channels_last}


def prefixed(phase: str, name: str, results: Dict[str, float]) -> Dict[str, float]:
    """``results`` keyed ``<phase>_<key>``, or ``<phase>_<name>_<key>`` for a named loader."""
    prefix = f"{phase}_{name}_" if name else f"{phase}_"
    return {prefix + k: v for k, v in results.items()}


def component_key(name: str) -> str:
    """How a loss component is logged: its name when it starts with ``loss``,
    else ``loss_<name>`` (``train_loss_box``, ``valid_loss_classifier``)."""
    return name if name.startswith("loss") else f"loss_{name}"


class LossSums:
    """Sample-weighted running sums of the loss and its components, in float64
    device tensors (never read per step)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.loss = torch.zeros((), dtype=torch.float64, device=device)
        self.components: Dict[str, Tensor] = {}

    def reset(self) -> None:
        self.loss.zero_()
        for t in self.components.values():
            t.zero_()

    def add(self, loss: Tensor, components: Dict[str, Tensor], n: int) -> None:
        self.loss.add_(loss, alpha=n)  # in float64: the float32 loss times n is exact
        for k, v in components.items():
            acc = self.components.get(k)
            if acc is None:
                acc = self.components[k] = torch.zeros((), dtype=torch.float64, device=self.device)
            acc.add_(v, alpha=n)

    def tensors(self) -> List[Tensor]:
        """The sums in a fixed order (for a cross-rank reduction)."""
        return [self.loss] + [self.components[k] for k in sorted(self.components)]

    def state_dict(self) -> Dict[str, Any]:
        """The sums as CPU tensors (for a mid-epoch checkpoint)."""
        return {"loss": self.loss.cpu(), "components": {k: v.cpu() for k, v in self.components.items()}}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.reset()
        self.loss.copy_(state["loss"])
        for k, v in state["components"].items():
            self.components.setdefault(k, torch.zeros((), dtype=torch.float64, device=self.device)).copy_(v)

    def means(self, samples: float) -> Dict[str, float]:
        """``{"loss": mean, "loss_<component>": mean, ...}`` (one host read)."""
        n = max(1.0, samples)
        out = {"loss": float(self.loss.item()) / n}
        out.update({component_key(k): float(v.item()) / n for k, v in sorted(self.components.items())})
        return out


def evaluate(model, loader, loss_fn, precision: Precision, metrics: MetricSet, device, *,
             max_batches: Optional[int] = None, ctx: Any = None, split_fn: Any = None, model_input: Any = "auto",
             channels_last: bool = False, what: str = "the loader") -> Dict[str, float]:
    """Loss (unless the model computes its own) and metrics over ``loader``,
    in eval mode under ``inference_mode``; the model is called without
    targets (``split_fn``, ``model_input``: how a batch reaches it). A
    distributed run (``ctx``) sums every rank's shard."""
    was_training = model.training
    model.eval()
    metrics.reset()
    sums = LossSums(device)
    n = 0
    split_fn, model_input = resolve_fn(split_fn), resolve_fn(model_input)
    batches = itertools.islice(loader, max_batches) if max_batches else loader
    # A sharded model's forward is a collective: every rank runs as many as the rank with the most batches.
    pairs = ctx.lockstep(batches, device, f"Trainer: {what}") if ctx is not None else ((b, True) for b in batches)
    with torch.inference_mode(), precision.autocast():
        for batch, real in pairs:
            x, y, _ = split_batch(to_device(batch, device), split_fn)
            if channels_last:
                x = to_channels_last(x)
            out = call_model(model, x, model_input)
            if not real:
                continue
            b = count_samples(x, model_input)
            loss = None
            if loss_fn is not None:
                loss, comps = split_loss(loss_fn(out, y))
                sums.add(loss, comps, b)
            n += b
            metrics.update(out, y, loss)
    model.train(was_training)
    if ctx is not None and ctx.enabled:  # each rank evaluated its shard
        n = ctx.sum_(sums.tensors() + metrics.state_tensors(), [n])[0]
    if n == 0:  # a loss of 0.0 over no samples would pass for a perfect score
        raise ValueError(f"Trainer: {what} yielded no samples; it must yield at least one batch")
    res = sums.means(n) if loss_fn is not None else {}
    res.update({k: v for k, v in metrics.compute().items() if k not in res})
    return res
