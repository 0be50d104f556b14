"""The whole training step as one callable: forward, loss, backward and the
optimizer tail (loss scaling, fused update with clipping, attached EMA, scale
update, gradient reset), run eagerly, compiled with ``torch.compile`` or
captured as CUDA graphs and replayed for every batch.

fusetrain's step never asks the host anything (lr, step counters, loss scale,
non-finite flag and EMA decay are device tensors), which is what makes the
step compilable as a whole and capturable.

Modes
-----
``"off"``
    Plain eager execution (the Trainer's loop).
``"compile"``
    ``torch.compile`` of the step. Dynamo stops at ``loss.backward()`` (see
    NOTE [compile split] below), so a step is a compiled forward/loss graph
    whose backward is compiled by AOTAutograd, plus a compiled tail graph:
    ``scaler.step(opt)``, ``scaler.update()``, the EMA and ``zero_grad``
    trace with no break. With a ``torch.optim`` optimizer only the
    forward/backward part is compiled; its tail (which reads the non-finite
    flag on the host) runs eagerly.
``"cuda_graph"``
    CUDA graphs (fusetrain optimizers on CUDA only). The first
    ``warmup_steps`` optimizer steps run eagerly on a side stream (they are
    ordinary training steps; they create the optimizer state, the loss scale
    and the gradients), then the step is captured and replayed: the batch is
    copied into static input buffers, gradients live in persistent ``.grad``
    tensors (zeroed in place rather than set to None). With ``accumulate > 1``
    two graphs share one memory pool: a micro-step (forward + backward
    accumulating into ``.grad``) and a full step (the same + tail).

Batches of any structure
------------------------
A step takes ``(inputs, targets)`` of any structure (tensors, tuples, lists,
dicts, nested: per-image lists of box dicts, say); the model is called with
the inputs by ``model_input`` (``fusetrain.training.task.batches.call_model``),
and the loss may return a scalar, ``(loss, {name: component})`` or a dict with
a ``"loss"`` entry (``fusetrain.training.task.losses.split_loss``). With
``loss_fn=None`` the model computes its own loss from the targets. Under
``"cuda_graph"`` every tensor leaf of the batch gets a static buffer.

Batches whose shape differs from the first one
----------------------------------------------
The compiled/captured step is built for the structure, shapes, dtypes and
devices of the first batch (and the values of its non-tensor leaves). A *smaller last batch* (same trailing dims, fewer samples, e.g. the
end of an epoch without ``drop_last``) runs eagerly with the same step
semantics: exact, no sample dropped, one eager step per epoch, nothing
recompiled or recaptured. Any other mismatch (a different image size, dtype
or device, a list of another length, or a smaller batch not followed by a
full one) also runs eagerly, with a one-time warning that names the expected
and received batch and why they differ.
``compile_options={"dynamic": True}`` sends every shape through the compiled
step instead.

What stays fixed after compilation/capture
------------------------------------------
Device tensors may change freely: fill the optimizer's lr tensor in place
between calls (an LR schedule); the EMA decay and the loss scale change on the
device. A fusetrain optimizer's schedulable settings (betas, momentum,
weight_decay, eps, ...: the ``value_fields`` of ``fusetrain._ops.optim_kinds()``)
may change through ``param_groups`` as in torch (``OneCycleLR(cycle_momentum=True)``,
a weight-decay schedule): before each step the TrainStep writes them into the
optimizer's device values (``sync_hyperparameters()``), which the kernels read,
so nothing recompiles or recaptures (NOTE [device values]). A change of what the
step still reads on the host (max_grad_norm, a flag such as nesterov or amsgrad, a
setting of Lamb, AdamP or Muon, a schedulable value turning zero or non-zero)
recompiles a compiled step and makes a captured one capture again (with a
warning). Anything else read on the host when the step was built stays fixed: the
loss-scaler factors, the model's train/eval mode and its structure. After
``load_state_dict`` of the model/optimizer/scaler or any structural change,
call :meth:`TrainStep.invalidate` (or build a new step).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

import torch
from torch import Tensor, nn

from ..._checks import check_flag, check_number
from ..._warnings import warn
from ...amp import LossScaler, Precision
from ...ema import ModelEMA
from ...optim._base import FusedOptimizer
from ..task.batches import Signature, call_model, detach, to_channels_last
from ..task.losses import split_loss
from .cuda_graph import CudaGraphMode

__all__ = ["TrainStep", "MODES"]

#: The step modes, in order of increasing capture.
MODES = ("off", "compile", "cuda_graph")
_COMPILE_KEYS = ("mode", "fullgraph", "dynamic", "backend", "options", "disable")


class TrainStep(CudaGraphMode):
    """One training step (forward, loss, backward, optimizer tail), run
    eagerly, compiled or captured as CUDA graphs; see the module docstring.

    Args:
      model: the model being trained (in train mode).
      loss_fn: ``loss_fn(outputs, targets)`` returning a scalar tensor,
        ``(loss, {name: component})`` or a dict with a ``"loss"`` entry; None:
        the model computes its own loss when called with the targets (a dict
        of components without ``"loss"`` is summed).
      optimizer: a fusetrain optimizer (any mode) or a ``torch.optim``
        optimizer (modes ``"off"`` and ``"compile"``).
      scaler: a :class:`fusetrain.LossScaler` (default: a disabled one).
      precision: a :class:`fusetrain.Precision` (default: fp32 on the model's
        device type).
      mode: ``"off"``, ``"compile"`` or ``"cuda_graph"``.
      accumulate: micro-batches per optimizer step; each loss is divided by it
        (``accumulate_reduction="mean"``) or not (``"sum"``: the step sees the
        sum of the micro-batches' gradients).
      ema: a :class:`fusetrain.ModelEMA`. With a fusetrain optimizer it is
        attached to it (its update rides in the fused pass); otherwise it is
        updated after each step, skipped on non-finite fp16 steps.
      compile_options: ``torch.compile`` keyword arguments (``mode``,
        ``fullgraph``, ``dynamic``, ``backend``, ``options``, ``disable``) for
        mode ``"compile"``.
      warmup_steps: eager optimizer steps before capture (``"cuda_graph"``).
      channels_last: convert 4-d inputs to the channels-last memory format.
      clip_grad_norm: global gradient-norm clipping for a ``torch.optim``
        optimizer (unscaled gradients, eager tail; a step with non-finite
        gradients is skipped). fusetrain optimizers clip in their fused step
        (their ``max_grad_norm``).
      model_input: how the inputs reach the model: ``"auto"``, ``"unpack"``,
        ``"whole"`` or a function ``fn(model, inputs)`` (see
        :func:`fusetrain.training.task.batches.call_model`).

    Call ``step(x, y)`` with one micro-batch (inputs and targets, any
    structure) already on the device; the tail runs on every ``accumulate``-th
    call, or when ``last=True`` (the end of an epoch whose micro-batch count is
    not a multiple). Returns the detached outputs and (undivided) loss;
    :attr:`components` holds the loss components of the call (detached). In
    ``"cuda_graph"`` mode these are the graph's static buffers, overwritten by
    the next call: use them before it, or clone them. No call synchronises
    with the host (with a fusetrain optimizer).
    """

    def __init__(self, model: nn.Module, loss_fn: Callable[[Any, Any], Tensor], optimizer: torch.optim.Optimizer,
                 scaler: Optional[LossScaler] = None, precision: Optional[Precision] = None, *, mode: str = "off",
                 accumulate: int = 1, ema: Optional[ModelEMA] = None, compile_options: Optional[Dict[str, Any]] = None,
                 warmup_steps: int = 3, channels_last: bool = False, clip_grad_norm: Optional[float] = None,
                 model_input: Any = "auto", accumulate_reduction: str = "mean") -> None:
        if not isinstance(mode, str) or mode not in MODES:
            raise ValueError(f"TrainStep: mode must be one of {', '.join(repr(m) for m in MODES)}, got {mode!r}")
        if not isinstance(model, nn.Module):
            raise TypeError(f"TrainStep: model must be an nn.Module, got {type(model).__name__}")
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"TrainStep: loss_fn must be callable (outputs, targets) -> loss, or None (the model "
                            f"computes its own loss), got {type(loss_fn).__name__}")
        if not callable(model_input) and model_input not in ("auto", "unpack", "whole"):
            raise ValueError(f"TrainStep: model_input must be 'auto', 'unpack', 'whole' or a function "
                             f"(model, inputs) -> outputs, got {model_input!r}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"TrainStep: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        check_number("TrainStep", "accumulate", accumulate, 1, integer=True)
        if accumulate_reduction not in ("mean", "sum"):
            raise ValueError(f"TrainStep: accumulate_reduction must be 'mean' or 'sum', got {accumulate_reduction!r}")
        check_number("TrainStep", "warmup_steps", warmup_steps, 1, integer=True)
        check_flag("TrainStep", "channels_last", channels_last)
        if scaler is not None and not isinstance(scaler, LossScaler):
            raise TypeError(f"TrainStep: scaler must be a fusetrain.LossScaler or None, got {type(scaler).__name__}")
        if ema is not None and not isinstance(ema, ModelEMA):
            raise TypeError(f"TrainStep: ema must be a fusetrain.ModelEMA or None, got {type(ema).__name__}")
        compile_options = dict(compile_options or {})
        bad = sorted(k for k in compile_options if k not in _COMPILE_KEYS)
        if bad:
            raise ValueError(f"TrainStep: compile_options has unknown key(s) {bad}; allowed: {list(_COMPILE_KEYS)}")
        self.fused = isinstance(optimizer, FusedOptimizer)
        if clip_grad_norm is not None:
            if self.fused:
                raise ValueError("TrainStep: clip_grad_norm is for torch.optim optimizers; a fusetrain optimizer "
                                 "clips inside its fused step (construct it with max_grad_norm=...)")
            check_number("TrainStep", "clip_grad_norm", clip_grad_norm, 0.0, low_open=True, optional=True)
        first = next(model.parameters(), None)
        self.device = first.device if first is not None else torch.device("cpu")
        if mode == "cuda_graph":
            self._check_capturable(optimizer)
        if mode == "compile" and self.fused and any(not isinstance(g["lr"], Tensor) for g in optimizer.param_groups):
            warn("TrainStep(mode='compile'): the optimizer's lr is a Python number, so every new value "
                 "recompiles the step; pass lr=torch.tensor(value, device=...) and change it in place "
                 "(lr.fill_(v))")

        self.model = model
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.precision = precision if precision is not None else Precision("fp32", self.device.type)
        self.scaler = scaler if scaler is not None else LossScaler(enabled=False)
        self.ema = ema
        if ema is not None and self.fused and ema._optimizer is not optimizer:
            ema.attach(optimizer)
        self.accumulate = accumulate
        self.accumulate_reduction = accumulate_reduction
        self.compile_options = compile_options
        self.warmup_steps = warmup_steps
        self.channels_last = channels_last
        self.clip_grad_norm = None if clip_grad_norm is None else float(clip_grad_norm)
        self.model_input = model_input
        self.components: Dict[str, Tensor] = {}
        self._mode = mode
        self._micro = 0  # micro-batches since the last optimizer step
        self.invalidate()

    def _check_capturable(self, optimizer) -> None:
        if self.device.type != "cuda":
            raise ValueError(f"TrainStep: compile_step='cuda_graph' needs the model on a CUDA device, found "
                             f"{self.device}; CUDA graphs need a GPU. Use compile_step='compile' or 'off' here")
        if not isinstance(optimizer, FusedOptimizer):
            raise ValueError(f"TrainStep: compile_step='cuda_graph' needs a fusetrain optimizer (lr, step counters "
                             f"and loss scale in device memory, no host sync), got {type(optimizer).__name__}; "
                             "use a fusetrain.optim optimizer, or compile_step='compile' or 'off'")
        for gi, g in enumerate(optimizer.param_groups):
            lr = g["lr"]
            if not isinstance(lr, Tensor) or lr.device != self.device:
                raise ValueError(f"TrainStep: compile_step='cuda_graph' needs each param group's lr as a tensor on "
                                 f"{self.device} (a captured graph cannot see a new Python float); group {gi} has "
                                 f"lr={lr!r}. Construct the optimizer with lr=torch.tensor(value, device='cuda') and "
                                 "change it with lr.fill_(new_value)")

    # ---- introspection -------------------------------------------------------------

    @property
    def mode(self) -> str:
        return self._mode

    @property
    def captured(self) -> bool:
        """Whether a compiled or captured step exists (and runs the matching batches)."""
        if self._mode == "cuda_graph":
            return bool(self._graphs)
        return self._mode == "compile" and self._compiled_used

    def will_step(self, last: bool = False) -> bool:
        """Whether the next call (with this ``last``) runs the optimizer tail."""
        return last or self._micro + 1 >= self.accumulate

    # ---- building --------------------------------------------------------------------

    def invalidate(self) -> None:
        """Drop compiled/captured state; the next calls rebuild it (after
        load_state_dict, a resume, or a change of the model or optimizer). For
        ``"cuda_graph"`` the warm-up steps run again."""
        self._graphs: Dict[bool, Any] = {}
        self._outs: Dict[bool, Tuple[Any, Tensor, Dict[str, Tensor]]] = {}
        self._pool = None
        self._static: Optional[Tuple[Any, Any]] = None  # a buffer per tensor leaf of (inputs, targets)
        self._side_stream = None
        self._warm = 0  # eager optimizer steps done towards the warm-up
        self._sig: Optional[Signature] = None
        self._prev_mismatch = False
        self._warned_shape = False
        self._compiled_used = False
        self._host_settings: Any = None  # NOTE [device values]: what a captured step read on the host
        self.__dict__.setdefault("_warned_recapture", False)
        self._dynamic = self._mode == "compile" and self.compile_options.get("dynamic") is True
        if self.fused and self._mode == "compile":
            self.optimizer._values_outside["compiled"] = True
        self._build()

    def _build(self) -> None:
        model, loss_fn, opt, scaler, precision = self.model, self.loss_fn, self.optimizer, self.scaler, self.precision
        acc, ema, model_input = self.accumulate, self.ema, self.model_input
        if self.accumulate_reduction == "sum":
            acc = 1  # the loss is not divided: the gradients of the micro-batches add up
        own_loss = loss_fn is None
        # Persistent .grad tensors under capture: the graph reads them at fixed addresses.
        set_to_none = self._mode != "cuda_graph"

        def forward_loss(x, y):
            out = call_model(model, x, model_input, y, with_targets=own_loss)
            loss, comps = split_loss(out if own_loss else loss_fn(out, y), sum_dict=own_loss,
                                     where="the model's loss" if own_loss else "the loss")
            return out, loss, comps

        # The outputs are detached before backward(): only detached tensors live
        # across dynamo's graph break there.
        def fwd_bwd(x, y):
            with precision.autocast():
                out, loss, comps = forward_loss(x, y)
            res = (detach(out), loss.detach(), detach(comps))
            scaler.scale(loss / acc if acc > 1 else loss).backward()
            return res

        if self.fused:
            def tail():
                scaler.step(opt)
                scaler.update()
                opt.zero_grad(set_to_none=set_to_none)

            def step_no_zero(x, y):
                # fwd_bwd and tail written out, not called: one frame for dynamo.
                # Optimizer.zero_grad is on dynamo's skip list (a graph break), so
                # the compiled step calls it after the compiled function.
                with precision.autocast():
                    out, loss, comps = forward_loss(x, y)
                res = (detach(out), loss.detach(), detach(comps))
                scaler.scale(loss / acc if acc > 1 else loss).backward()
                scaler.step(opt)
                scaler.update()
                return res

            def full(x, y):
                res = step_no_zero(x, y)
                opt.zero_grad(set_to_none=set_to_none)
                return res
        else:
            clip = self.clip_grad_norm

            def tail():
                skip = False
                if clip is not None:
                    scaler.unscale_(opt)
                    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                    # As in the fused step: with clipping on, a step whose gradients
                    # are not finite is skipped (under fp16 the scaler skips it).
                    # One host read, on the torch-optimizer path only.
                    skip = not scaler.is_enabled() and not bool(torch.isfinite(norm))
                if not skip:
                    scaler.step(opt)
                    scaler.update()
                    if ema is not None:
                        ema.update(model, found_inf=scaler.last_step_skipped if scaler.is_enabled() else None)
                opt.zero_grad(set_to_none=True)

            def full(x, y):
                res = fwd_bwd(x, y)
                tail()
                return res

        self._fwd_bwd, self._tail, self._full = fwd_bwd, tail, full
        if self._mode == "compile":
            self._build_compiled(fwd_bwd, step_no_zero if self.fused else None, tail)
        elif self._mode == "cuda_graph":
            self._run = self._run_graphed
        else:
            self._run = self._run_eager

    # ---- calling ---------------------------------------------------------------------

    def __call__(self, x: Any, y: Any, last: bool = False) -> Tuple[Any, Tensor]:
        self._micro += 1
        do_step = last or self._micro >= self.accumulate
        if do_step:
            self._micro = 0
        if self.channels_last:
            x = to_channels_last(x)
        out, loss, self.components = self._run(x, y, do_step)
        return out, loss

    def _run_eager(self, x, y, do_step: bool):
        res = self._fwd_bwd(x, y)
        if do_step:
            self._tail()
        return res
