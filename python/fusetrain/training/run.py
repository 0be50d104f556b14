"""The state of one training run: everything the Trainer's loop phases read
and update, in one object instead of long parameter lists."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import torch
from torch import Tensor, nn

from ..amp import LossScaler, Precision
from .callbacks import CallbackList, TrainerState
from .distributed import DistContext
from .metrics import MetricSet
from .params import TrainingParams
from .schedules import LRSchedule
from .step import TrainStep

__all__ = ["Run", "LossSums", "component_key"]


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
        self.loss += loss.double() * n
        for k, v in components.items():
            acc = self.components.get(k)
            if acc is None:
                acc = self.components[k] = torch.zeros((), dtype=torch.float64, device=self.device)
            acc += v.double() * n

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


@dataclass
class Run:
    """One training run (one process of it). Built by ``Trainer._setup``."""

    p: TrainingParams
    ctx: DistContext
    device: torch.device
    model: nn.Module  # the plain module on the device (what checkpoints store)
    train_step: TrainStep
    eval_model: nn.Module  # the EMA module or the model, compiled with torch_compile
    opt: torch.optim.Optimizer
    fused: bool
    scaler: LossScaler
    precision: Precision
    ema: Any
    loss_fn: Optional[Callable[..., Any]]  # None: the model computes its own loss
    schedule: LRSchedule
    steps_per_epoch: int
    train_loader: Any
    valid_loaders: Dict[str, Any]  # name -> loader; the name "" for a single loader
    test_loaders: Dict[str, Any]
    train_metrics: MetricSet
    valid_metrics: Dict[str, MetricSet]
    callbacks: CallbackList
    state: TrainerState
    logger: Any
    watch_key: str  # the row key of metric_to_watch
    split_fn: Optional[Callable[[Any], Any]] = None
    model_input: Any = "auto"
    sums: Optional[LossSums] = None
    start_epoch: int = 0
    global_step: int = 0
    best: Dict[str, Any] = field(default_factory=dict)
    stale_epochs: int = 0
    skipped_before: float = 0.0  # steps skipped by the loss scaler in earlier sessions of a resumed run
    skipped_seen: float = 0.0  # the skipped-step count at the end of the previous epoch (host value)
    frozen_bn: List[nn.Module] = field(default_factory=list)  # kept in eval mode (freeze_bn_stats)
    step_log: Any = None  # StepLog: per-step scalars to training_params.loggers
    triggers: Any = None  # StepTriggers: validation, checkpoints and a graceful stop inside epochs
    resume_position: Optional[Dict[str, Any]] = None  # this rank's part of a mid-epoch checkpoint's position
    epoch_start: Dict[str, Any] = field(default_factory=dict)  # the epoch's random states before its iterator
