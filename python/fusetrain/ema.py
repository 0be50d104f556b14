"""Exponential moving average of a model's weights, updated on the device.

``ema = decay * ema + (1 - decay) * weights`` after every optimizer step, with
the decay following a schedule of the update count. The step counter and the
decay are device tensors: the schedule is evaluated on the device, changing it
never recompiles, and a skipped (non-finite) step leaves the EMA and its
counter untouched without asking the host.
"""

from __future__ import annotations

import copy
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

from . import _ops
from ._checks import check_flag, check_number
from .optim import _sharded

__all__ = ["ModelEMA", "unwrap_model"]

DECAY_TYPES = ("constant", "threshold", "exp")
#: The numeric settings of ModelEMA and their ranges (``check_number``'s keywords): checked at construction, by
#: load_state_dict and on every assignment (``ema.decay = 0.999``).
_NUMBERS: Dict[str, Dict[str, Any]] = {
    "decay": dict(low=0.0, high=1.0, low_open=True), "beta": dict(low=0.0, low_open=True),
    "warmup_gamma": dict(low=0.0, low_open=True), "warmup_power": dict(low=0.0, low_open=True)}


def _checked_settings(owner: str, values: Dict[str, Any]) -> Dict[str, Any]:
    """``values`` (some of ModelEMA's settings by name) checked and normalised, or a clear error naming the
    first bad one; nothing is changed."""
    out = {}
    for name, v in values.items():
        if name in _NUMBERS:
            out[name] = float(check_number(owner, name, v, **_NUMBERS[name]))
        elif name == "decay_type":
            if not isinstance(v, str) or v not in DECAY_TYPES:
                raise ValueError(f"{owner}: decay_type must be one of {DECAY_TYPES}, got {v!r}")
            out[name] = v
        elif name == "total_steps":
            out[name] = check_number(owner, "total_steps", v, 1, integer=True, optional=True)
        else:  # warmup, include_buffers
            out[name] = check_flag(owner, name, v)
    return out


def _setting(name: str) -> property:
    """A ModelEMA setting checked on every assignment (NOTE [ema settings]): ``ema.decay = nan`` is a clear
    error, not a NaN decay. Kept in the EMA's ``_settings`` dict (a property torch.compile traces)."""

    def get(self: "ModelEMA") -> Any:
        return self._settings[name]

    def set_(self: "ModelEMA", value: Any) -> None:
        self._settings[name] = _checked_settings("ModelEMA", {name: value})[name]

    return property(get, set_, doc=f"The EMA's {name} setting (checked on assignment).")


def unwrap_model(model: nn.Module) -> nn.Module:
    """The module under ``torch.compile`` (``_orig_mod``) and DDP/DataParallel
    (``module``) wrappers, so state-dict keys carry no wrapper prefixes."""
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    while True:
        if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
            model = model._orig_mod
        elif isinstance(model, (DistributedDataParallel, DataParallel)):
            model = model.module
        else:
            return model


# NOTE [ema locators]: an attached EMA reads the live model's buffers (and
# non-float params) after every step. Walking the model for them
# (named_buffers) costs about as much host time as the update pass itself on
# a model of many small layers, so attach() walks once: each name is kept as
# (its module's ``_buffers`` or ``_parameters`` table, leaf name) and read
# from the table at each step, which still sees a tensor the module replaced.
# A name the table no longer holds falls back to a walk and locates again; a
# submodule replaced by another object after attach() is found by attaching
# again.
def _locate(base: nn.Module, names: List[str]) -> List[Tuple[Dict[str, Any], str]]:
    found = []
    for n in names:
        prefix, _, leaf = n.rpartition(".")
        module = base.get_submodule(prefix)
        found.append((module._parameters if leaf in module._parameters else module._buffers, leaf))
    return found


# NOTE [ema post-step lists]: the attached EMA's post-step call takes the same
# tensors at every step, so its argument lists are built once and reused while
# each located source is still the tensor its module's table holds (one
# identity check a tensor). Lists holding a DTensor or a tensor that requires
# grad are built at every step instead: their local shard or detached view is
# taken anew.
class _PostStepLists:
    def __init__(self, tables: List[Tuple[Dict[str, Any], str]], sources: List[Tensor], args: Tuple) -> None:
        self.tables = tables
        self.sources = sources
        self.args = args  # ema_step_'s lists: ema, src, copy_dst, copy_src, remainders

    def current(self) -> bool:
        """Whether every module table still holds the source it held."""
        for (table, leaf), t in zip(self.tables, self.sources):
            if table.get(leaf) is not t:
                return False
        return True


def _detached(t: Tensor) -> Tensor:
    return t.detach() if t.requires_grad else t


def _capturing(t: Tensor) -> bool:
    """Whether work on ``t``'s device is being recorded into a CUDA graph rather than run."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()

class ModelEMA:
    """EMA of ``model`` (built from the unwrapped model; ``ema.module`` is a
    plain module for evaluation, and can itself be compiled).

    Args:
      decay: the target decay, in (0, 1).
      decay_type: ``"constant"`` (always ``decay``), ``"threshold"``
        (``min(decay, (1 + t) / (10 + t))``) or ``"exp"``
        (``decay * (1 - exp(-beta * t / total_steps))``), where ``t`` is the
        1-based number of the update.
      beta: steepness of the ``exp`` schedule.
      total_steps: the run's number of optimizer steps (needed by ``exp``; can
        be set later with :meth:`set_total_steps`).
      warmup: also cap the decay at ``1 - (1 + t / warmup_gamma) ** -warmup_power``.
      include_buffers: average floating-point buffers (e.g. BatchNorm running
        stats) too; other buffers are always copied.
      remainder: keep an int16 remainder beside each bfloat16 tensor of the
        EMA copy; the pair is then the exact float32 EMA (2 more bytes per
        value; NOTE [ema remainder] in csrc/common/lean_state.h), while
        ``ema.module`` stays in bfloat16. Without it a bfloat16 EMA with a
        decay close to 1 hardly moves: its updates round away. ``None`` (the
        default): whenever the EMA copy has bfloat16 tensors. The remainders
        belong to the values the EMA itself wrote: after writing
        ``ema.module``'s tensors directly, call :meth:`reset_remainders`.

    Use :meth:`update` after each optimizer step, or :meth:`attach` once to a
    fusetrain optimizer: the parameter EMA then rides in the optimizer's update
    pass (no extra read of the weights) and buffers follow after the step.

    NOTE [ema settings]: the settings (``decay``, ``decay_type``, ``beta``,
    ``warmup``, ``warmup_gamma``, ``warmup_power``) may be changed by
    assignment between updates; each assignment is checked, as the
    constructor and :meth:`load_state_dict` check them.
    """

    decay = _setting("decay")
    decay_type = _setting("decay_type")
    beta = _setting("beta")
    warmup = _setting("warmup")
    warmup_gamma = _setting("warmup_gamma")
    warmup_power = _setting("warmup_power")

    def __init__(self, model: nn.Module, decay: float = 0.9999, decay_type: str = "exp", beta: float = 15.0,
                 total_steps: Optional[int] = None, warmup: bool = False, warmup_gamma: float = 1.0,
                 warmup_power: float = 2.0 / 3.0, include_buffers: bool = True,
                 remainder: Optional[bool] = None) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"ModelEMA: model must be an nn.Module, got {type(model).__name__}")
        settings = _checked_settings("ModelEMA", dict(
            decay=decay, decay_type=decay_type, beta=beta, total_steps=total_steps, warmup=warmup,
            warmup_gamma=warmup_gamma, warmup_power=warmup_power, include_buffers=include_buffers))
        if remainder is not None and not isinstance(remainder, bool):
            raise ValueError(f"ModelEMA: remainder must be True, False or None (when the EMA has bfloat16 "
                             f"tensors), got {remainder!r}")
        base = unwrap_model(model)
        if not any(p.is_floating_point() for p in base.parameters()):
            raise ValueError("ModelEMA: the model has no floating-point parameters to average")
        self._settings = {k: v for k, v in settings.items() if k not in ("total_steps", "include_buffers")}
        self.total_steps: Optional[int] = settings["total_steps"]
        self.include_buffers = settings["include_buffers"]
        self._remainder_setting = remainder
        self._remainders: Dict[str, Tensor] = {}  # NOTE [ema remainder]: per bfloat16 averaged tensor

        self.module = copy.deepcopy(base).eval()
        for p in self.module.parameters():
            p.requires_grad_(False)
        device = next(self.module.parameters()).device
        # Updates done so far, and the decay the next update uses.
        self._step = torch.zeros((), dtype=torch.float32, device=device)
        self._decay = torch.zeros((), dtype=torch.float32, device=device)
        self._total = torch.full((), float(self.total_steps or 1), dtype=torch.float32, device=device)
        self._hooks: List[Any] = []
        self._optimizer = None
        self._model = model  # the live model, for attach()'s buffer updates
        self._locators: Optional[Tuple[Tuple[str, ...], List[Tuple[Dict[str, Any], str]]]] = None
        self._post_lists: Optional[_PostStepLists] = None  # NOTE [ema post-step lists]
        self._decay_written: Optional[Tuple] = None  # the constant schedule's settings in _decay
        self._build_index(base)

    # ---- bookkeeping -----------------------------------------------------------------

    def rebuild_index(self) -> None:
        """Find the EMA copy's tensors again after something replaced its
        parameters (``fully_shard`` turns them into DTensor shards)."""
        self._build_index(self.module)

    def _build_index(self, base: nn.Module) -> None:
        ema_params = dict(self.module.named_parameters())
        ema_buffers = dict(self.module.named_buffers())
        self._avg_names = [n for n, p in ema_params.items() if p.is_floating_point()]
        self._copy_names = [n for n, p in ema_params.items() if not p.is_floating_point()]
        self._buf_avg_names = [n for n, b in ema_buffers.items() if b.is_floating_point() and self.include_buffers]
        self._buf_copy_names = [n for n, b in ema_buffers.items() if n not in self._buf_avg_names]
        self._ema_tensors = {**ema_params, **ema_buffers}
        self._post_lists = None
        self._build_remainders()

    @property
    def remainder(self) -> bool:
        """Whether bfloat16 tensors of the EMA copy keep int16 remainders."""
        return bool(self._remainders)

    def _build_remainders(self) -> None:
        """An int16 remainder (zero: the bfloat16 value is the EMA) for each
        averaged bfloat16 tensor, keeping those already there. The remainder
        of a sharded (FSDP2) tensor is a DTensor sharded like it; a tensor
        that changed shape, device or form (sharded by ``fully_shard``)
        restarts from a zero remainder."""
        names = [n for n in self._avg_names + self._buf_avg_names
                 if self._ema_tensors[n].dtype == torch.bfloat16]
        if self._remainder_setting is False or not names:
            self._remainders = {}
            return
        old = self._remainders
        self._remainders = {}
        for n in names:
            t = self._ema_tensors[n]
            r = old.get(n)
            if r is None or r.shape != t.shape or r.device != t.device or type(r) is not type(t):
                r = torch.zeros_like(t, dtype=torch.int16)
            self._remainders[n] = r

    @torch.no_grad()
    def reset_remainders(self) -> None:
        """Take the bfloat16 values of the EMA copy as its EMA (zero the
        remainders), e.g. after writing ``ema.module``'s tensors directly."""
        for r in self._remainders.values():
            r.zero_()

    def remainder_tensors(self) -> Dict[str, Tensor]:
        """The int16 remainders by the name of their bfloat16 tensor (the live
        tensors: DTensors for a sharded EMA copy)."""
        return dict(self._remainders)

    def buffer_remainders(self) -> List[Tensor]:
        """The remainders of the averaged buffers: a distributed run that gives
        every rank rank 0's buffers gives them these with them, so that each
        pair stays one value."""
        return self._remainders_of(self._buf_avg_names)

    def _remainders_of(self, names: List[str]) -> List[Tensor]:
        return [self._remainders[n] for n in names if n in self._remainders]

    def set_total_steps(self, total_steps: Optional[int]) -> None:
        """Set the run length used by the ``exp`` schedule."""
        self.total_steps = _checked_settings("ModelEMA.set_total_steps", {"total_steps": total_steps})["total_steps"]
        if hasattr(self, "_total") and total_steps is not None:
            self._total.fill_(float(total_steps))

    @property
    def step_tensor(self) -> Tensor:
        """Device tensor: number of EMA updates done (skipped steps excluded)."""
        return self._step

    @property
    def decay_tensor(self) -> Tensor:
        """Device tensor: the decay of the most recent (or next attached) update."""
        return self._decay

    def _compute_decay(self) -> Tensor:
        """Evaluate the schedule for update number ``step + 1`` into the decay
        tensor (``fusetrain::ema_decay_``, on the device). A constant schedule
        (no warmup) does not depend on the step: it is written again only when
        its settings change."""
        constant = (self.decay,) if self.decay_type == "constant" and not self.warmup else None
        if constant is not None and constant == self._decay_written:
            return self._decay
        total = self._total if self.total_steps is not None else None
        _ops.ema_decay_(self._decay, self._step, total, self.decay_type, self.decay, self.beta, self.warmup,
                        self.warmup_gamma, self.warmup_power)
        # NOTE [decay written under capture]: a write recorded into a CUDA graph capture has not run (and never
        # runs if the capture is abandoned), so it counts as written only outside a capture.
        self._decay_written = None if _capturing(self._decay) else constant
        return self._decay

    def _sources(self, model: nn.Module) -> Dict[str, Tensor]:
        """The model's current params and buffers by name (looked up at each
        update: a module may replace a buffer tensor)."""
        base = unwrap_model(model)
        return {**dict(base.named_parameters()), **dict(base.named_buffers())}

    # ---- updates -------------------------------------------------------------------

    @torch.no_grad()
    def update(self, model: nn.Module, found_inf: Optional[Tensor] = None) -> None:
        """One EMA update from ``model`` (wrapped or not): floating-point
        tensors averaged in one fused multi-tensor pass, the rest copied, the
        counter advanced (``fusetrain::ema_step_``). With ``found_inf`` (a
        device flag, e.g. from the optimizer's ``last_found_inf``) a non-zero
        value skips it on the device."""
        src = self._sources(model)
        decay = self._compute_decay()
        self._check_sources(src, self._avg_names + self._buf_avg_names + self._copy_names + self._buf_copy_names)
        self._step_tensors(src, self._avg_names + self._buf_avg_names, decay, found_inf)

    def _step_tensors(self, src: Dict[str, Tensor], avg_names: List[str], decay: Tensor,
                      found_inf: Optional[Tensor]) -> None:
        """Average ``avg_names``, copy the non-averaged tensors, advance the counter."""
        args = self._step_args(src, avg_names)
        _ops.ema_step_(args[0], args[1], args[2], args[3], decay, self._step, found_inf, args[4])

    def _step_args(self, src: Dict[str, Tensor], avg_names: List[str]) -> Tuple:
        """``ema_step_``'s lists for averaging ``avg_names`` and copying the non-averaged tensors."""
        copy_names = self._copy_names + self._buf_copy_names
        # NOTE [sharded steps]: a sharded EMA tensor averages its local shard with the model's.
        loc = _sharded.local_fn()
        return ([loc(self._ema_tensors[n]) for n in avg_names], [loc(_detached(src[n])) for n in avg_names],
                [loc(self._ema_tensors[n]) for n in copy_names], [loc(_detached(src[n])) for n in copy_names],
                [loc(r) for r in self._remainders_of(avg_names)])

    def _attached_step(self, avg_names: List[str], found_inf: Tensor) -> None:
        """The attached EMA's update after a step: ``avg_names`` averaged, the
        rest copied, from the live model's located tensors."""
        lists = self._post_lists
        args = lists.args if lists is not None and lists.current() else self._post_step_args(avg_names)
        _ops.ema_step_(args[0], args[1], args[2], args[3], self._decay, self._step, found_inf, args[4])

    def _post_step_args(self, avg_names: List[str]) -> Tuple:
        """``ema_step_``'s lists for the attached EMA's update, from the tensors
        located anew; kept for the next steps where they can be (NOTE [ema
        post-step lists])."""
        names = avg_names + self._copy_names + self._buf_copy_names
        src = self._located_sources(names)
        args = self._step_args(src, avg_names)
        self._post_lists = None
        if self._locators is not None and self._locators[0] == tuple(names):
            tensors = [src[n] for n in names] + [self._ema_tensors[n] for n in names] + args[4]
            if not any(t.requires_grad or _sharded.is_sharded(t) for t in tensors):
                self._post_lists = _PostStepLists(self._locators[1], [src[n] for n in names], args)
        return args

    def _located_sources(self, names: List[str]) -> Dict[str, Tensor]:
        """The live model's tensors of ``names``, read from the module tables
        that hold them (NOTE [ema locators])."""
        key = tuple(names)
        if self._locators is None or self._locators[0] != key:
            self._locators = (key, _locate(unwrap_model(self._model), names))
        src = {}
        for n, (table, leaf) in zip(names, self._locators[1]):
            t = table.get(leaf)
            if t is None:  # the model's structure changed: walk it again
                self._locators = None
                return self._sources(self._model)
            src[n] = t
        return src

    def _check_sources(self, src: Dict[str, Tensor], names: List[str]) -> None:
        missing = [n for n in names if n not in src]
        if missing:
            raise ValueError(f"ModelEMA: the model lacks {len(missing)} tensor(s) of the EMA copy, e.g. "
                             f"{missing[:3]}; update() needs the model the EMA was built from")

    def attach(self, optimizer) -> "ModelEMA":
        """Ride the parameter EMA in a fusetrain optimizer's update pass.

        Before each step the decay is evaluated on the device; the update pass
        writes the EMA of every param it updates; after the step buffers are
        averaged/copied and the counter advances, all gated on the step's
        non-finite flag. Only params updated by the step move their EMA (a
        param without a gradient keeps its EMA). The model's buffers are
        located now (NOTE [ema locators]): after replacing one of its
        submodules, attach again. An EMA with remainders rides
        in the update pass of the element-wise optimizers; with the others
        (Lamb, AdamP, Muon) its params are averaged after the step instead."""
        from .optim._base import FusedOptimizer
        from .optim._kinds import KINDS

        if not isinstance(optimizer, FusedOptimizer):
            raise TypeError(f"ModelEMA.attach: needs a fusetrain optimizer, got {type(optimizer).__name__}; "
                            "call ema.update(model) after optimizer.step() instead")
        self.detach()
        self._locators = None
        self._post_lists = None
        by_id, rems = {}, {}
        model_params: Dict[int, Tensor] = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                model_params[id(p)] = p
        rides = not self._remainders or KINDS[optimizer._kind]["lean"]
        # Match the optimizer's params to EMA params by name in the live model.
        for name, p in self._sources(self._model).items():
            if rides and id(p) in model_params and name in self._ema_tensors:
                by_id[p] = self._ema_tensors[name]
                if name in self._remainders:
                    rems[p] = self._remainders[name]
        optimizer.attach_ema(by_id, self._decay, rems or None)

        def pre_hook(opt, args, kwargs):
            self._compute_decay()

        def averaged() -> List[str]:
            # Params rode in the update pass (unless `rides` is false); buffers and non-float params follow.
            return self._buf_avg_names if rides else self._avg_names + self._buf_avg_names

        def post_hook(opt, args, kwargs):
            if opt.last_found_inf is None:
                return  # the step applied no gradient: no EMA update
            self._attached_step(averaged(), opt.last_found_inf)

        # Located now, outside any compiled step: a compiled tail reads them without recompiling.
        self._post_step_args(averaged())

        self._hooks = [optimizer.register_step_pre_hook(pre_hook), optimizer.register_step_post_hook(post_hook)]
        self._optimizer = optimizer
        return self

    def detach(self) -> None:
        """Undo :meth:`attach`."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._optimizer is not None:
            self._optimizer.detach_ema()
            self._optimizer = None

    # ---- state -----------------------------------------------------------------------

    def state_dict(self, sharded: bool = False) -> Dict[str, Any]:
        """The EMA's state: its module's weights, its step, its settings and the remainders of its bfloat16
        tensors. ``sharded``: without the tensors a sharded checkpoint keeps in its shards (the module and the
        remainders, whose names ``sharded_remainders`` lists; NOTE [sharded checkpoints])."""
        state = {"step": self._step.detach().clone(), "decay": self.decay,
                 "decay_type": self.decay_type, "beta": self.beta, "total_steps": self.total_steps,
                 "warmup": self.warmup, "warmup_gamma": self.warmup_gamma, "warmup_power": self.warmup_power,
                 "include_buffers": self.include_buffers}
        if sharded:
            return {**state, "sharded_remainders": sorted(self._remainders)}
        return {"module": self.module.state_dict(), **state,
                "remainders": {n: r.detach().clone() for n, r in self._remainders.items()}}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load :meth:`state_dict`'s state; a sharded one (``sharded_remainders``, no ``module``) leaves the
        module and the listed remainders as they are (loaded in place from the shards)."""
        sharded = "sharded_remainders" in state_dict
        for k in ("step", "decay", "decay_type") + (() if sharded else ("module",)):
            if k not in state_dict:
                raise KeyError(f"ModelEMA.load_state_dict: missing key {k!r}")
        # Every setting checked before anything changes.
        names = ("decay", "decay_type", "beta", "total_steps", "warmup", "warmup_gamma", "warmup_power",
                 "include_buffers")
        settings = _checked_settings("ModelEMA.load_state_dict",
                                     {k: state_dict.get(k, getattr(self, k)) for k in names})
        step = state_dict["step"]
        step_value = step.item() if isinstance(step, Tensor) and step.numel() == 1 else step  # read once, on load
        check_number("ModelEMA.load_state_dict", "step", step_value, 0.0)
        if not sharded:
            self.module.load_state_dict(state_dict["module"])
        self._step.fill_(float(step_value))
        self._settings.update({k: settings[k] for k in names[:3] + names[4:7]})
        self.set_total_steps(settings["total_steps"])
        include_buffers = settings["include_buffers"]
        if include_buffers != self.include_buffers:
            self.include_buffers = include_buffers
            self._build_index(self.module)
        # NOTE [ema remainder]: a state without a tensor's remainder (saved without
        # remainders) makes its bfloat16 value the EMA.
        saved = state_dict.get("remainders") or {}
        in_place = set(state_dict.get("sharded_remainders", ()))
        with torch.no_grad():
            for n, r in self._remainders.items():
                if n in saved:
                    r.copy_(saved[n])
                elif n not in in_place:
                    r.zero_()
