"""Callbacks: code that runs at fixed points of the Trainer's loop.

A callback subclasses :class:`Callback` and overrides the hooks it needs;
each hook receives the :class:`TrainerState`. The loop calls only the hooks
a callback overrides, so an unused hook costs nothing per step.

Hooks, in the order a run calls them::

    on_train_start
      on_epoch_start                      (each epoch)
        on_train_batch_end                (each batch, after its step)
        on_step_end                       (each optimizer step)
      on_train_epoch_end                  (training part done; state.metrics has the train_ row)
        on_validation_end                 (each validation loader; state.metrics has its valid_ values)
      on_epoch_end                        (the epoch's row is complete, before it is logged and saved)
        on_checkpoint_saved               (each checkpoint file written)
    on_train_end                          (also after an exception or a stop)
    on_test_end                           (each test loader, after training)

Per-step state (``state.outputs``, ``state.loss``, ``state.loss_components``,
``state.batch``) holds *device* tensors: the loop never reads them on the
host, and a hook that calls ``.item()`` or ``float()`` on them makes that step
wait for the device (its choice). To stop training, a hook calls
``state.request_stop(reason)``: the run stops after the current epoch is
validated, logged and saved (from ``on_step_end`` / ``on_train_batch_end``,
after the current batch).

Callbacks are given in ``training_params.callbacks`` as objects, or (from a
recipe) as a registered name or class path, optionally with constructor
arguments: ``[{"ThresholdStop": {"metric": "valid_accuracy", "value": 0.9}}]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import torch
from torch import Tensor, nn

from .registry import build_named, registrar

__all__ = ["Callback", "TrainerState", "ThresholdStop", "CALLBACKS", "HOOKS", "register_callback",
           "build_callbacks", "CallbackList"]

HOOKS = ("on_train_start", "on_epoch_start", "on_train_batch_end", "on_step_end", "on_train_epoch_end",
         "on_validation_end", "on_epoch_end", "on_checkpoint_saved", "on_train_end", "on_test_end")


@dataclass
class TrainerState:
    """The state of a run: what the loop knows, kept here only, for callbacks
    to read (and ``request_stop``); checkpoints save its progress.

    Run: ``params`` (the resolved TrainingParams), ``model`` (the module being
    trained, unwrapped), ``optimizer``, ``scaler``, ``ema`` (or None),
    ``device``, ``experiment_dir``, ``is_main`` (rank 0, which writes files),
    ``world_size``. Progress: ``epoch`` (0-based, the epoch in progress),
    ``global_step`` (optimizer steps done), ``batch_idx``. Per batch (device
    tensors): ``batch`` (``(inputs, targets, extras)`` on the device),
    ``outputs`` (detached), ``loss`` (the undivided batch loss, detached),
    ``loss_components``. Per epoch: ``metrics`` (the row being built:
    ``train_loss``, ``train_<metric>``, ``valid_<metric>``, ..., host floats),
    ``best`` (``{"metric", "value", "epoch"}``), ``stale_epochs`` (validations
    without improvement, for ``early_stopping``). Hooks with an argument get
    it as well: ``on_validation_end(state, name, results)``,
    ``on_checkpoint_saved(state, path)``, ``on_test_end(state, name,
    results)``."""

    params: Any = None
    model: Optional[nn.Module] = None
    optimizer: Optional[torch.optim.Optimizer] = None
    scaler: Any = None
    ema: Any = None
    device: Optional[torch.device] = None
    experiment_dir: str = ""
    is_main: bool = True
    world_size: int = 1
    epoch: int = 0
    global_step: int = 0
    batch_idx: int = 0
    batch: Any = None
    outputs: Any = None
    loss: Optional[Tensor] = None
    loss_components: Dict[str, Tensor] = field(default_factory=dict)
    metrics: Dict[str, Any] = field(default_factory=dict)
    best: Dict[str, Any] = field(default_factory=dict)
    stale_epochs: int = 0
    stop_training: bool = False
    stop_reason: str = ""
    skipped_before: float = 0.0  # optimizer steps the loss scaler skipped in earlier sessions of a resumed run

    def request_stop(self, reason: str = "a callback asked to stop") -> None:
        """Stop after the current epoch (validated, logged and checkpointed)."""
        self.stop_training = True
        self.stop_reason = reason

    def skipped_steps(self) -> float:
        """Optimizer steps the loss scaler skipped over the whole run (one host read)."""
        scaler = self.scaler
        live = scaler.skipped_steps if scaler is not None and scaler.is_enabled() else None
        return self.skipped_before + (float(live.item()) if live is not None else 0.0)

    def state_dict(self) -> Dict[str, Any]:
        """The progress a checkpoint keeps (besides its epoch and step): the best value of the watched metric,
        the validations without improvement and the skipped steps."""
        return {"best": dict(self.best), "stale_epochs": self.stale_epochs, "skipped_steps": self.skipped_steps()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.best = dict(state.get("best") or self.best)
        self.stale_epochs = int(state.get("stale_epochs", 0))
        self.skipped_before = float(state.get("skipped_steps", 0.0))


class Callback:
    """Base class: override any of the hooks in :data:`HOOKS`."""

    def on_train_start(self, state: TrainerState) -> None: ...
    def on_epoch_start(self, state: TrainerState) -> None: ...
    def on_train_batch_end(self, state: TrainerState) -> None: ...
    def on_step_end(self, state: TrainerState) -> None: ...
    def on_train_epoch_end(self, state: TrainerState) -> None: ...
    def on_validation_end(self, state: TrainerState, name: str, results: Dict[str, float]) -> None: ...
    def on_epoch_end(self, state: TrainerState) -> None: ...
    def on_checkpoint_saved(self, state: TrainerState, path: str) -> None: ...
    def on_train_end(self, state: TrainerState) -> None: ...
    def on_test_end(self, state: TrainerState, name: str, results: Dict[str, float]) -> None: ...


class ThresholdStop(Callback):
    """Stop when ``metric`` (a key of the epoch's row, e.g. ``valid_accuracy``)
    reaches ``value`` (``mode`` ``"max"``: at least, ``"min"``: at most)."""

    def __init__(self, metric: str, value: float, mode: str = "max") -> None:
        if mode not in ("max", "min"):
            raise ValueError(f"ThresholdStop: mode must be 'max' or 'min', got {mode!r}")
        self.metric, self.value, self.mode = metric, float(value), mode

    def on_epoch_end(self, state: TrainerState) -> None:
        v = state.metrics.get(self.metric)
        if v is not None and (v >= self.value if self.mode == "max" else v <= self.value):
            state.request_stop(f"{self.metric} reached {v:.4g} ({'>=' if self.mode == 'max' else '<='} "
                               f"{self.value:g})")


#: Callbacks by name (extended by :func:`register_callback`).
CALLBACKS: Dict[str, Any] = {"ThresholdStop": ThresholdStop}
_BUILTIN = frozenset(CALLBACKS)


#: ``register_callback(name, factory=None, *, replace=False)``: name a
#: :class:`Callback` class (or factory) for training params and recipes;
#: usable as a decorator.
register_callback = registrar("callback", CALLBACKS, lambda n: n in _BUILTIN)


def build_callback(spec: Any, where: str) -> Callback:
    obj = build_named(spec, CALLBACKS, where, "callback")
    if not isinstance(obj, Callback):
        raise TypeError(f"{where}: got {type(obj).__name__}; allowed: a fusetrain Callback (subclass "
                        f"fusetrain.Callback and override its hooks)")
    return obj


def build_callbacks(specs: Sequence[Any]) -> List[Callback]:
    return [build_callback(s, f"training_params.callbacks[{i}]") for i, s in enumerate(specs)]


class CallbackList:
    """Calls each hook on the callbacks that override it (bound methods
    collected once, so hooks nobody overrides cost nothing per step)."""

    def __init__(self, callbacks: Sequence[Callback]) -> None:
        self.callbacks = list(callbacks)
        self._hooks: Dict[str, List[Any]] = {}
        for hook in HOOKS:
            base = getattr(Callback, hook)
            self._hooks[hook] = [getattr(cb, hook) for cb in self.callbacks
                                 if getattr(type(cb), hook, base) is not base]

    def has(self, hook: str) -> bool:
        return bool(self._hooks[hook])

    def __call__(self, hook: str, state: TrainerState, *args: Any) -> None:
        for fn in self._hooks[hook]:
            fn(state, *args)
