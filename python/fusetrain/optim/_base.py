"""Shared machinery of fusetrain's fused optimizers.

A step is one call of ``fusetrain::fused_step_``, the C++ core's optimizer
tail: an optional read-only reduction (global norm + non-finite flag, needed for
clipping or loss-scaled steps) and one fused update pass per parameter group
that writes params, optimizer state, master weights and EMA together. These
classes only collect the state tensors and describe the groups (NOTE [group
records] in csrc/ops/fused_step.cpp), by the field and state names of the C++
kind table (NOTE [kind table] in csrc/ops/optim_kind.h); after a first step the lists are kept
in C++ and later steps only re-check them (NOTE [step plan] in
csrc/python/step_plan.cpp). Every changing scalar (lr, step, inverse
scale, found_inf, norm, EMA decay) is a device tensor, so ``step()`` never
synchronises with the host.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Dict, List, Mapping, Optional, Sequence

import torch
from torch import Tensor
from torch.optim import Optimizer

from .. import _C, _ops
from . import _int8_state, _sharded
from ._kinds import KINDS
from ._settings import (_MASTER_CODES, _MASTER_KEYS, _check_block_size, _check_master_weights, _check_range,
                        _check_state_dtype)
from ._state_layout import _LOW, _conform, _fits, _join_remainder, _put_in_form, _same, _split_remainder, _state_dtype

# Complex params are updated as real views (torch.view_as_real), as torch.optim
# does; their state is complex like torch's. NOTE [float64 params] in
# csrc/ops/fused_update.cpp: float64 params keep float64 state.
_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.complex64,
                     torch.complex128)
_SUPPORTED_NAMES = "float32, float16, bfloat16, float64, complex64, complex128"
_KIND_PLANS: Dict[type, Any] = {}  # FusedOptimizer._kind_plan, per class


def _is_device_scalar(v: Any, device: torch.device) -> bool:
    return isinstance(v, Tensor) and v.device == device and v.dtype == torch.float32 and v.dim() == 0


def _capturing(device: torch.device) -> bool:
    """Whether a CUDA graph is being captured on ``device``'s current stream.
    Asked only where a step would create or fill a tensor (never per step in
    steady state); under torch.compile tracing it is False (no capture there)."""
    return (device.type == "cuda" and not torch.compiler.is_compiling()
            and torch.cuda.is_current_stream_capturing())


class FusedOptimizer(Optimizer):
    """Base class: subclasses name their fp32 state tensors and call their op.

    Subclass contract:
      * ``_kind``: the optimizer's kind in the kind table (``KINDS``), which
        names its record's fields and its per-param state;
      * ``_kind_values(group)``: the record fields that are not the group's
        entry of the same name (e.g. ``beta1`` from ``betas``).
    """

    _kind = ""
    # State entries that are 0-d float32 device scalars beside the step (NOTE
    # [tensor scalars] in csrc/common/update_args.h), e.g. NAdam's mu_product.
    _scalar_states: Sequence[str] = ()
    # Whether the update of a tensor is element-wise, so that a DTensor's local
    # shard can be updated alone (NOTE [sharded steps] in _sharded.py).
    _shard_local = True
    _sparse_grads = False  # whether sparse gradients are accepted (NOTE [sparse gradients])

    _opt_name = "FusedOptimizer"

    def __init__(self, params, defaults: Dict[str, Any], max_grad_norm: Optional[float], master_weights: Any,
                 state_dtype: Any = torch.float32, state_block_size: int = _int8_state.DEFAULT_BLOCK):
        if max_grad_norm is not None:
            _check_range(self._opt_name, "max_grad_norm", max_grad_norm, 0.0)
            if max_grad_norm == 0:
                raise ValueError(f"{self._opt_name}: max_grad_norm must be > 0 or None, got {max_grad_norm}")
        lean = KINDS[self._kind]["lean"]
        defaults = dict(defaults, max_grad_norm=max_grad_norm,
                        master_weights=_check_master_weights(self._opt_name, master_weights, lean))
        state_dtype = _check_state_dtype(self._opt_name, state_dtype, lean)
        if lean:  # the others keep float32 state: no such setting in their groups
            defaults["state_dtype"] = state_dtype
            defaults["state_block_size"] = _check_block_size(self._opt_name, state_block_size)
        self._lr_cache: Dict[int, List[Any]] = {}
        self._values_cache: Dict[int, List[Any]] = {}  # NOTE [device values]
        self._snapshots: Dict[int, Dict[str, Any]] = {}  # _compiled_settings
        self._values_outside: Dict[str, bool] = {"compiled": False}
        self._ema_lists: Optional[List[Optional[List[Tensor]]]] = None
        # NOTE [ema remainder]: per group with an EMA, each EMA tensor's int16 remainder (or None).
        self._ema_rem_lists: Optional[List[Optional[List[Optional[Tensor]]]]] = None
        self._ema_decay: Optional[Tensor] = None
        # Written by step(): dicts rather than attributes because torch.compile
        # cannot trace attribute assignment on an optimizer (it can trace item
        # assignment on a dict the optimizer holds). _results holds the tensors
        # every step writes into (NOTE [persistent step results] in
        # training/step.py); _last what the last step left (None: no step yet,
        # or the last one had no gradient to apply).
        self._results: Dict[str, Optional[Tensor]] = {"grad_norm": None, "found_inf": None}
        self._last: Dict[str, Optional[Tensor]] = {"grad_norm": None, "found_inf": None}
        self._amp_pending: Dict[str, Optional[Tensor]] = {"inv_scale": None, "found_inf": None}
        self._warned: Dict[str, bool] = {}
        # Whether any param is a DTensor (NOTE [sharded steps]), known when its group is added.
        self._sharding: Dict[str, Any] = {"any": False}
        self._kept: Dict[str, Any] = {}  # NOTE [step plan] in csrc/python/step_plan.cpp
        self._master_marks: Dict[int, Any] = {}  # NOTE [master re-sync]
        super().__init__(params, defaults)

    @property
    def last_grad_norm(self) -> Optional[Tensor]:
        """Global gradient norm of the last step (0-d device tensor; NaN when
        the step measured none: no clipping and no loss scaling), or None when
        no step has applied a gradient yet. The same tensor from step to step."""
        return self._last["grad_norm"]

    @property
    def last_found_inf(self) -> Optional[Tensor]:
        """Non-finite flag of the last step (0-d device tensor, 1.0 when the
        step was skipped), or None when no step has applied a gradient yet."""
        return self._last["found_inf"]

    # ---- torch.optim compatibility -------------------------------------------------

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        gi = len(self.param_groups) - 1
        self._check_lean_group(gi, group)
        devices = set()
        for i, p in enumerate(group["params"]):
            if p.dtype not in _SUPPORTED_DTYPES:
                raise TypeError(f"{self._opt_name}: param {i} of group {gi} has dtype {p.dtype}; "
                                f"supported: {_SUPPORTED_NAMES}")
            if p.device.type not in ("cpu", "cuda"):
                raise ValueError(f"{self._opt_name}: param {i} of group {gi} is on {p.device}; supported: cpu, cuda")
            devices.add(p.device)
        if any(_sharded.is_sharded(p) for p in group["params"]):
            self._sharding["any"] = True
        if len(devices) > 1:
            raise ValueError(f"{self._opt_name}: params of group {gi} are on different devices "
                             f"{sorted(str(d) for d in devices)}; put each device's params in its own group")
        if devices and self._results["found_inf"] is None:
            # Made here rather than in the first step, which torch.compile may trace.
            self._ensure_results(next(iter(devices)))
        if self._ema_lists is not None:
            self._ema_lists.append(None)
            self._ema_rem_lists.append(None)
        self._forget_lists()

    def _check_lean_group(self, gi: int, group: Dict[str, Any]) -> None:
        """Checks (and normalises) a new group's lean-state settings (NOTE
        [lean state]); the group is removed again when they do not fit."""
        try:
            self._check_lean_group_settings(gi, group)
        except (TypeError, ValueError):
            self.param_groups.pop()
            raise

    def _check_lean_group_settings(self, gi: int, group: Dict[str, Any]) -> None:
        """Checks (and normalises) a group's lean-state settings against its params."""
        lean = KINDS[self._kind]["lean"]
        where = f"{self._opt_name} (param group {gi})"
        group["master_weights"] = _check_master_weights(where, group["master_weights"], lean)
        if lean:
            group["state_dtype"] = _check_state_dtype(where, group["state_dtype"], lean)
        elif "state_dtype" in group:
            _check_state_dtype(where, group["state_dtype"], lean)
        if lean:
            group["state_block_size"] = _check_block_size(where, group.get("state_block_size",
                                                                           _int8_state.DEFAULT_BLOCK))
        lean_state = group.get("state_dtype", "float32")
        for i, p in enumerate(group["params"]):
            if lean_state != "float32" and p.dtype not in _LOW + (torch.float32,):
                raise ValueError(f"{where}: param {i} has dtype {p.dtype}; state_dtype={lean_state} keeps the "
                                 "state of float32, bfloat16 and float16 params (use state_dtype=float32)")
            if p.dtype == torch.float16 and not isinstance(group["master_weights"], bool):
                raise ValueError(f"{where}: param {i} is float16; master_weights={group['master_weights']!r} "
                                 "keeps bfloat16 params (use master_weights=True for float16)")

    def __setstate__(self, state: Dict[str, Any]) -> None:
        # torch.optim.Optimizer.__setstate__ (also run by load_state_dict) adds
        # "differentiable" to the defaults: an optimizer without that setting
        # (Muon, Lion, ...) keeps its defaults and groups without it, so that
        # its state dict round-trips.
        own = "differentiable" in self.__dict__.get("defaults", state.get("defaults", {}))
        super().__setstate__(state)
        if not own:
            self.defaults.pop("differentiable", None)
        # torch's __getstate__ keeps only defaults/state/param_groups: restore
        # the per-instance caches (copy.deepcopy, pickle).
        self.__dict__.setdefault("_lr_cache", {})
        self.__dict__.setdefault("_values_cache", {})
        self.__dict__.setdefault("_snapshots", {})
        self.__dict__.setdefault("_values_outside", {"compiled": False})
        self.__dict__.setdefault("_ema_lists", None)
        self.__dict__.setdefault("_ema_rem_lists", None)
        self.__dict__.setdefault("_ema_decay", None)
        self.__dict__.setdefault("_results", {"grad_norm": None, "found_inf": None})
        self.__dict__.setdefault("_last", {"grad_norm": None, "found_inf": None})
        self.__dict__.setdefault("_amp_pending", {"inv_scale": None, "found_inf": None})
        self.__dict__.setdefault("_warned", {})
        self.__dict__["_kept"] = {}
        self.__dict__["_master_marks"] = {}
        self.__dict__.setdefault("_sharding", {"any": any(_sharded.is_sharded(p) for g in self.param_groups
                                                          for p in g["params"])})
        for group in self.param_groups:
            for k, v in self.defaults.items():
                group.setdefault(k, v)
            for p in group["params"]:
                st = self.state.get(p)
                if st and "step" in st and not isinstance(st["step"], Tensor):
                    # A Python-number step (older torch checkpoints), as torch does.
                    st["step"] = torch.tensor(float(st["step"]), dtype=torch.float32, device=p.device)

    def state_dict(self) -> Dict[str, Any]:
        """torch.optim's state dict; sharded (FSDP2) params' int8 states are
        in it decoded into float32 DTensors (NOTE [sharded 8-bit state] in
        _int8_state.py), which distributed checkpoints reshard."""
        sd = super().state_dict()
        if self._sharding["any"]:
            _int8_state.widen_sharded(sd["state"])
        return sd

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a state dict saved by this optimizer or by the matching
        torch.optim optimizer. Optimizer state is float32 for float32,
        float16 and bfloat16 params (torch would cast it to the param dtype)
        and float64 for float64 params; complex params keep complex state, as
        in torch. Step counters move to the param's device as float32 tensors.

        NOTE [lean state] in csrc/common/lean_state.h: ``master_weights`` and
        ``state_dtype`` say how the state is stored. A group that sets them
        (anything but False / float32) keeps its own, whatever the state dict
        was saved with; the others take the saved ones, as torch takes every
        setting. A float32 state loaded into a group with bfloat16 state is
        rounded to it, a float32 master becomes a remainder (or is dropped
        for "stochastic") at the next step, and the reverse. Moments into or
        out of int8 (NOTE [8-bit state]) are encoded or decoded here, when
        loaded; ``fusetrain.optim.full_precision_state_dict`` turns a lean
        state dict into a float32 one."""
        saved_groups = state_dict["param_groups"]
        saved_state = state_dict["state"]
        own = [{k: g[k] for k, default in (("master_weights", False), ("state_dtype", "float32"),
                                           ("state_block_size", _int8_state.DEFAULT_BLOCK))
                if g.get(k, default) != default} for g in self.param_groups]
        for gi, (saved, group, kept) in enumerate(zip(saved_groups, self.param_groups, own)):
            # Checked before anything is loaded.
            trial = dict(self.defaults, **{k: v for k, v in saved.items() if k != "params"})
            self._check_lean_group_settings(gi, dict(trial, **kept, params=group["params"]))
        super().load_state_dict(state_dict)
        id_to_param, group_of = {}, {}
        for saved, group, kept in zip(saved_groups, self.param_groups, own):
            group.update(kept)
            for pid, p in zip(saved["params"], group["params"]):
                id_to_param[pid] = p
                group_of[pid] = group
        for pid, st in saved_state.items():
            p = id_to_param.get(pid)
            if p is None:
                continue
            for k, v in st.items():
                if isinstance(v, Tensor):
                    if v.is_sparse:  # torch's SGD keeps a sparse momentum buffer for sparse gradients
                        v = v.to_dense()
                    dtype = _state_dtype(p, complex_state=v.is_complex(), group=group_of[pid])
                    if k in self._scalar_states or k == "master_param":
                        dtype = torch.float32
                    elif k == "master_remainder":
                        dtype = torch.int16
                    elif torch.int8 in (v.dtype, dtype) or k.endswith("_scales"):
                        dtype = v.dtype  # NOTE [8-bit state]: put in the group's form below
                    self.state[p][k] = v.detach().to(device=p.device, dtype=dtype, copy=True)
            group = group_of[pid]
            for name in self._state_names(group):
                v = self.state[p].get(name)
                if name is not None and name not in self._scalar_states and isinstance(v, Tensor) and \
                        torch.int8 in (v.dtype, _state_dtype(p, group=group)):
                    _put_in_form(self.state[p], name, p, _state_dtype(p, group=group), group["state_block_size"],
                                 0.0)
        self._lr_cache.clear()
        self._forget_lists()

    # ---- EMA riding in the update pass -----------------------------------------------

    def attach_ema(self, ema_params: Mapping[Tensor, Tensor], decay: Tensor,
                   remainders: Optional[Mapping[Tensor, Tensor]] = None) -> None:
        """Update EMA copies in the same pass as the params:
        ``ema += (1 - decay) * (param_new - ema)`` for every param updated by a
        step. ``ema_params`` maps params of this optimizer to tensors of the
        same shape, dtype and device; ``decay`` is a 0-d float32 device tensor
        (change it in place; it is read on the device). Every param of a group
        needs an EMA tensor, or none of that group's params. ``remainders``
        maps params with a bfloat16 EMA to an int16 tensor of its shape: the
        EMA tensor and its remainder are then the exact float32 EMA (NOTE [ema
        remainder] in csrc/common/lean_state.h; the element-wise optimizers)."""
        if not isinstance(decay, Tensor) or decay.numel() != 1 or decay.dtype != torch.float32:
            raise TypeError(f"{self._opt_name}.attach_ema: decay must be a one-element float32 tensor, got {decay!r}")
        by_id = {id(k): v for k, v in ema_params.items()}
        known = {id(p) for g in self.param_groups for p in g["params"]}
        unknown = [k for k in by_id if k not in known]
        if unknown:
            raise ValueError(f"{self._opt_name}.attach_ema: {len(unknown)} key(s) of ema_params are not params "
                             "of this optimizer")
        rem_by_id = {id(k): v for k, v in (remainders or {}).items()}
        if rem_by_id and not KINDS[self._kind]["lean"]:
            raise ValueError(f"{self._opt_name}.attach_ema: EMA remainders are for the element-wise optimizers "
                             "(NOTE [ema remainder]); keep this optimizer's EMA without them")
        lists: List[Optional[List[Tensor]]] = []
        rem_lists: List[Optional[List[Optional[Tensor]]]] = []
        for gi, group in enumerate(self.param_groups):
            covered = [id(p) in by_id for p in group["params"]]
            if not any(covered):
                lists.append(None)
                rem_lists.append(None)
                continue
            if not all(covered):
                raise ValueError(f"{self._opt_name}.attach_ema: group {gi} has {covered.count(False)} param(s) "
                                 "without an EMA tensor; give every param of the group one, or none")
            emas, rems = [], []
            for i, p in enumerate(group["params"]):
                e = by_id[id(p)]
                if e.shape != p.shape or e.dtype != p.dtype or e.device != p.device:
                    raise ValueError(f"{self._opt_name}.attach_ema: EMA of param {i} of group {gi} has "
                                     f"shape {tuple(e.shape)}, dtype {e.dtype}, device {e.device}; the param has "
                                     f"shape {tuple(p.shape)}, dtype {p.dtype}, device {p.device}")
                r = rem_by_id.get(id(p))
                if rem_by_id and (r is None) != (e.dtype != torch.bfloat16):
                    raise ValueError(f"{self._opt_name}.attach_ema: param {i} of group {gi} ({e.dtype}) "
                                     f"{'needs' if r is None else 'cannot have'} an EMA remainder: remainders "
                                     "go with every bfloat16 EMA tensor and only with those")
                if r is not None and (r.dtype != torch.int16 or r.shape != e.shape or r.device != e.device):
                    raise ValueError(f"{self._opt_name}.attach_ema: the EMA remainder of param {i} of group {gi} "
                                     f"must be an int16 tensor of shape {tuple(e.shape)} on {e.device}, got "
                                     f"{r.dtype} of shape {tuple(r.shape)} on {r.device}")
                emas.append(e)
                rems.append(r)
            lists.append(emas)
            rem_lists.append(rems if rem_by_id else None)
        self._ema_lists = lists
        self._ema_rem_lists = rem_lists
        self._ema_decay = decay
        self._forget_lists()

    def detach_ema(self) -> None:
        """Stop updating EMA copies in the update pass."""
        self._ema_lists = None
        self._ema_rem_lists = None
        self._ema_decay = None
        self._forget_lists()

    # ---- stalled updates ---------------------------------------------------------------

    def track_stalled_updates(self, enabled: bool = True) -> Optional[Tensor]:
        """Count, on the device, the updates that float16/bfloat16 params
        kept without a master (``master_weights`` False or ``"stochastic"``)
        lose: elements whose stored value did not change although the step
        computed a different one (NOTE [stalled updates] in
        csrc/common/lean_state.h). Many of them say the learning rate is too
        small for the weights' precision. Every step adds to the counter it
        returns, a 0-d int64 tensor on the params' device (also
        :attr:`stalled_updates`): read it (``.item()``, one sync) when you
        want the number and ``zero_()`` it to start again; no step waits for
        it. Enable it before compiling or capturing a step. ``False`` stops
        counting."""
        if not enabled:
            self._results.pop("stalled", None)
            self._forget_lists()
            return None
        if not KINDS[self._kind]["lean"]:
            raise ValueError(f"{self._opt_name}.track_stalled_updates: the element-wise optimizers count stalled "
                             "updates; this one does not")
        devices = {p.device for g in self.param_groups for p in g["params"]}
        if len(devices) != 1:
            raise ValueError(f"{self._opt_name}.track_stalled_updates: needs the params on one device, got "
                             f"{sorted(str(d) for d in devices)}")
        device = devices.pop()
        if self._results.get("stalled") is None or self._results["stalled"].device != device:
            self._results["stalled"] = torch.zeros((), dtype=torch.int64, device=device)
        self._forget_lists()
        return self._results["stalled"]

    @property
    def stalled_updates(self) -> Optional[Tensor]:
        """The counter of :meth:`track_stalled_updates` (None when not counting)."""
        return self._results.get("stalled")

    # ---- the step ----------------------------------------------------------------------

    def _kind_values(self, group: Dict[str, Any]) -> Dict[str, Any]:
        """The group's record fields (KINDS[self._kind]["field_names"]) that are
        not its entry of the same name."""
        return {}

    def _kind_plan(self, group: Dict[str, Any]):
        """Per class, made once: the kind's fields as (name, whether ``_kind_values`` gives it), whether
        it gives any, its state rules with the same flag for each condition field (the names
        ``_kind_values`` gives are the same for every group) and its state names when none is
        conditional."""
        plan = _KIND_PLANS.get(type(self))
        if plan is None:
            kind = KINDS[self._kind]
            own = frozenset(self._kind_values(group))
            rules = kind["state_rules"]
            fixed = None  # the state names when no state is conditional
            if all(when is None for _, _, when, _ in rules):
                fixed = [None, None, None]
                for slot, name, _, _ in rules:
                    fixed[slot] = name
                fixed = tuple(fixed[:max(slot for slot, _, _, _ in rules) + 1])
            plan = (tuple((n, n in own) for n in kind["field_names"]), bool(own),
                    tuple((slot, name, when, when_set, when in own) for slot, name, when, when_set in rules), fixed)
            _KIND_PLANS[type(self)] = plan
        return plan

    def _kind_fields(self, group: Dict[str, Any]) -> List[float]:
        """The optimizer's own fields of the group record, in the kind table's order."""
        plan = _KIND_PLANS.get(type(self)) or self._kind_plan(group)
        own = self._kind_values(group) if plan[1] else group
        try:
            return [float(own[n] if o else group[n]) for n, o in plan[0]]
        except KeyError as e:
            raise KeyError(f"{self._opt_name}: a param group has no '{e.args[0]}', a field of the "
                           f"'{self._kind}' record ({', '.join(KINDS[self._kind]['field_names'])})") from None

    def _state_names(self, group: Dict[str, Any]) -> Sequence[Optional[str]]:
        """The per-param state tensors the group keeps, in the slots state1..3
        of its record (None for an unused slot before a used one): the kind
        table's states whose condition field holds."""
        plan = _KIND_PLANS.get(type(self)) or self._kind_plan(group)
        if plan[3] is not None:
            return plan[3]
        names: List[Optional[str]] = [None, None, None]
        for slot, name, when, when_set, from_own in plan[2]:
            if when is not None:
                value = self._kind_values(group)[when] if from_own else group[when]
                if (float(value) != 0.0) != when_set:
                    continue
            names[slot] = name
        while names and names[-1] is None:
            names.pop()
        return tuple(names)

    def _new_step_value(self, state: Dict[str, Any]) -> float:
        return 0.0

    def _initial_state_value(self, name: str) -> float:
        """The value a new state tensor ``name`` starts at (0 unless the optimizer says otherwise)."""
        return 0.0

    def _state_ready(self, group, p: Tensor) -> bool:
        """Whether ``p`` has every state tensor a step needs, on its device."""
        state = self.state.get(p)
        if not state or "step" not in state:
            return False
        step = state["step"]
        if not isinstance(step, Tensor) or step.device != p.device or step.dtype != torch.float32:
            return False
        for name in self._state_names(group):
            if name is not None and state.get(name) is None:
                return False
            if name in self._scalar_states:
                if not _is_device_scalar(state[name], p.device):
                    return False
            elif name is not None:
                dtype = _state_dtype(p, group=group)
                if dtype == torch.int8:
                    if not _int8_state.ready(state, name, p, group["state_block_size"], _fits):
                        return False
                elif not _fits(state[name], p, dtype) or _int8_state.scales_key(name) in state:
                    return False
        key = self._master_key(group, p)
        if key is not None:
            return _fits(state.get(key), p, torch.float32 if key == "master_param" else torch.int16)
        return not any(k in state for k in _MASTER_KEYS.values())

    @staticmethod
    def _master_key(group: Dict[str, Any], p: Tensor) -> Optional[str]:
        """The state entry that keeps ``p``'s full value (NOTE [lean state]), or None."""
        mode = group["master_weights"]
        if mode is True and p.dtype in _LOW:
            return "master_param"
        if mode == "remainder" and p.dtype == torch.bfloat16:
            return "master_remainder"
        return None

    def _ensure_state(self, group, p: Tensor) -> None:
        """Create (or move next to ``p``) the state tensors a step of ``p`` needs."""
        self._forget_lists()
        state = self.state[p]
        if "step" not in state:
            state["step"] = torch.full((), self._new_step_value(state), dtype=torch.float32, device=p.device)
        elif state["step"].device != p.device or state["step"].dtype != torch.float32:
            state["step"] = state["step"].to(device=p.device, dtype=torch.float32)
        for name in self._state_names(group):
            if name in self._scalar_states:
                if name not in state:
                    state[name] = torch.full((), self._initial_state_value(name), dtype=torch.float32,
                                             device=p.device)
                elif not _is_device_scalar(state[name], p.device):  # also a Python number (older checkpoints)
                    state[name] = torch.as_tensor(state[name], dtype=torch.float32).to(p.device).reshape(())
            elif name is not None and torch.int8 in (_state_dtype(p, group=group), getattr(state.get(name), "dtype",
                                                                                             None)):
                # NOTE [8-bit state]: made, converted or laid out with its block scales.
                _put_in_form(state, name, p, _state_dtype(p, group=group), group["state_block_size"],
                             self._initial_state_value(name))
            elif name is not None and state.get(name) is None:
                state[name] = torch.full_like(p, self._initial_state_value(name), dtype=_state_dtype(p, group=group),
                                              memory_format=torch.preserve_format)
            elif name is not None:  # NOTE [state layout]
                state[name] = _conform(state[name], p, _state_dtype(p, group=group))
        self._ensure_master(group, p, state)

    @torch.no_grad()
    def _ensure_master(self, group: Dict[str, Any], p: Tensor, state: Dict[str, Any]) -> None:
        """NOTE [lean state]: the entry that keeps ``p``'s full value in the
        group's form, converted from the other form when a state dict brought
        that one (a float32 master into a remainder and the reverse), and no
        other such entry. A master is kept where it rounds to the param (NOTE
        [master re-sync]); a remainder then holds it exactly, the param
        rounded as the remainder form rounds (an exact tie may move it by an
        ulp)."""
        key = self._master_key(group, p)
        loc = _sharded.local_fn() if self._sharding["any"] else _same
        full = None  # p's full value (local), from the entry the state has
        if key != "master_param" and state.get("master_param") is not None:
            full = loc(_conform(state.pop("master_param"), p, torch.float32))
        if key != "master_remainder" and state.get("master_remainder") is not None:
            rem = loc(_conform(state.pop("master_remainder"), p, torch.int16))
            full = _join_remainder(loc(p.detach()), rem) if p.dtype == torch.bfloat16 else None
        if key is None:
            return
        if state.get(key) is not None:
            state[key] = _conform(state[key], p, torch.float32 if key == "master_param" else torch.int16)
            return
        local = loc(p.detach())
        if key == "master_param":
            state[key] = torch.empty_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
            loc(state[key]).copy_(local if full is None else torch.where(full.to(p.dtype) == local, full,
                                                                         local.float()))
            return
        state[key] = torch.zeros_like(p, dtype=torch.int16, memory_format=torch.preserve_format)
        if full is not None:
            kept = full.to(p.dtype) == local
            hi, r = _split_remainder(full)
            local.copy_(torch.where(kept, hi, local))
            loc(state[key]).copy_(torch.where(kept, r, torch.zeros_like(r)))

    def init_state(self) -> None:
        """Create the state of every parameter that requires grad (what its
        first step would create), e.g. for ``torch.distributed.checkpoint`` to
        load into; existing state is kept."""
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    self._ensure_state(group, p)

    def prepare_capture(self) -> None:
        """Make a following CUDA-graph capture of ``step()`` safe.

        NOTE [state before capture]: whatever a step creates or fills lazily
        (a parameter's first state, an lr tensor made from a Python float)
        would be recorded in a captured graph and re-done on every replay:
        step counters and moments reset, the lr pinned. This creates the
        state of every parameter that requires grad (also of those that had
        no gradient yet) and checks that each group's lr is a tensor on its
        parameters' device. ``fusetrain.TrainStep`` calls it before capturing;
        a step that would still create state or fill an lr while capturing
        raises instead."""
        self.init_state()
        self.sync_hyperparameters()
        for gi, group in enumerate(self.param_groups):
            params = [p for p in group["params"] if p.requires_grad]
            if params:
                self._ensure_results(params[0].device)
            devices = {p.device for p in params}
            lr = group["lr"]
            for dev in devices:
                if not isinstance(lr, Tensor) or lr.device != dev:
                    where = f"a tensor on {lr.device}" if isinstance(lr, Tensor) else f"the Python number {lr!r}"
                    raise ValueError(
                        f"{self._opt_name}: param group {gi}'s lr is {where}, but a captured step reads it on "
                        f"{dev}: a graph would keep the value of the capture forever. Set "
                        f"param_groups[{gi}]['lr'] = torch.tensor(value, device='{dev}') and change it in place "
                        "(lr.fill_(new_value))")

    def _init_group(self, group, params, grads, steps, masters, emas, state1, state2, state3, scales,
                    ema_rems=None):
        # Called with python values by torch.compile (dynamo runs it eagerly),
        # so lazy state creation never lands in a compiled graph.
        if self._sharding["any"]:
            with torch.no_grad():  # DTensor.to_local() is then the local tensor, not an autograd call
                return self._collect_group(group, params, grads, steps, masters, emas, state1, state2, state3,
                                           scales, ema_rems)
        return self._collect_group(group, params, grads, steps, masters, emas, state1, state2, state3, scales,
                                   ema_rems)

    def _forget_lists(self) -> None:
        """Drop the step plan (NOTE [step plan] in csrc/python/step_plan.cpp):
        the next step collects its lists afresh."""
        self._kept.clear()

    def _collect_group(self, group, params, grads, steps, masters, emas, state1, state2, state3, scales,
                       ema_rems=None):
        start = len(params)  # the lists hold the groups before this one too
        names = self._state_names(group)
        outs = (state1, state2, state3)
        # NOTE [group records] in csrc/ops/fused_step.cpp: int8 states' block scales, slot by slot.
        slot_scales: tuple = ([], [], [])
        gi = next(i for i, g in enumerate(self.param_groups) if g is group)
        ema_list = self._ema_lists[gi] if self._ema_lists is not None else None
        rem_list = self._ema_rem_lists[gi] if ema_list is not None and self._ema_rem_lists is not None else None
        # NOTE [sharded steps]: a DTensor's step runs on its local shard; nothing to unwrap otherwise.
        loc = _sharded.local_fn() if self._sharding["any"] else _same
        for i, p in enumerate(group["params"]):
            g = p.grad
            if g is None:
                continue
            if g.is_sparse:
                if not self._sparse_grads:
                    raise RuntimeError(self._sparse_error())
                # NOTE [sparse gradients]: SGD's update of a sparse gradient is
                # its update of the dense form (entries the gradient lacks are
                # zero), so the fused pass runs on g.to_dense(): the same
                # numbers as torch.optim.SGD's sparse path, at the memory of a
                # dense gradient.
                g = g.to_dense()
            cplx = p.is_complex()
            if g.is_complex() != cplx:
                raise RuntimeError(f"{self._opt_name}: param {i} of group {gi} has dtype {p.dtype} but its "
                                   f"gradient has dtype {g.dtype}")
            if not self._state_ready(group, p):
                if _capturing(p.device):
                    raise RuntimeError(
                        f"{self._opt_name}: param {i} of group {gi} has no optimizer state yet and a CUDA graph is "
                        "being captured: the graph would re-initialise its state on every replay. Call "
                        "optimizer.prepare_capture() before capturing (fusetrain.TrainStep does), or run an eager "
                        "step in which it has a gradient first")
                self._ensure_state(group, p)
            state = self.state[p]
            steps.append(state["step"])
            if cplx:  # the op updates real views, as torch.optim does
                params.append(torch.view_as_real(p))
                grads.append(torch.view_as_real(g))
                if ema_list is not None:
                    emas.append(torch.view_as_real(ema_list[i]))
                for out, name in zip(outs, names):
                    if name is not None:
                        out.append(state[name] if name in self._scalar_states else torch.view_as_real(state[name]))
                continue
            params.append(loc(p))
            grads.append(loc(g))
            key = self._master_key(group, p)
            if key is not None:
                self._sync_master(p, loc(p), loc(state[key]))
                masters.append(loc(state[key]))
            if ema_list is not None:
                e = ema_list[i]
                r = rem_list[i] if rem_list is not None else None
                if not self._sharding["any"] and e.device == p.device and not _fits(e, p, e.dtype):
                    # NOTE [state layout]: an attached EMA follows its param's layout too.
                    e.data = _conform(e, p, e.dtype)
                    if r is not None:
                        r.data = _conform(r, p, torch.int16)
                emas.append(loc(e))
                if r is not None and ema_rems is not None:
                    ema_rems.append(loc(r))
            for out, name, sc in zip(outs, names, slot_scales):
                if name is not None:
                    out.append(loc(state[name]))
                    if state[name].dtype == torch.int8:
                        sc.append(state[_int8_state.scales_key(name)])
        for sc in slot_scales:
            scales.extend(sc)
        return len(params) > start

    def _sync_master(self, p: Tensor, local: Tensor, master: Tensor) -> None:
        """NOTE [master re-sync]: the fused step writes a param below autograd,
        so its version counter (and its data pointer) change only when
        something else writes it: ``model.load_state_dict``, copying EMA or
        best weights in, any in-place write, ``p.data = ...``. Then the master
        copy is taken from the param, unless it still rounds to the param in
        every element (weights written together with their master, as a resume
        loads them in either order): that master keeps its extra precision. The
        choice is made on the device (no host sync). Both marks are host-side
        and read where the step collects its lists: in eager steps (the step
        plan checks them in C++ too) and when torch.compile traces the step. A
        compiled or captured step does not read them: ``fusetrain.TrainStep``
        checks them before each call (``_sync_masters``); after writing such
        params outside a step you compiled or captured yourself, rebuild it."""
        mark = (p._version, local.data_ptr())
        if master.dtype == torch.int16:
            # A remainder (NOTE [lean state]) is kept when it was written too
            # (loaded with its param), else zeroed: the param is the value.
            mark += (master._version, master.data_ptr())
            old = self._master_marks.get(id(p))
            if old == mark or _capturing(p.device):
                return
            if old is not None and old[2:] == mark[2:]:
                master.zero_()
            self._master_marks[id(p)] = mark
            return
        if self._master_marks.get(id(p)) == mark or _capturing(p.device):
            return
        kept = (master.to(local.dtype) == local).all()
        master.copy_(torch.where(kept, master, local.float()))
        self._master_marks[id(p)] = mark

    @torch.no_grad()
    def _sync_masters(self) -> None:
        """NOTE [master re-sync] for every param with a master copy, checked on
        the host before a compiled or captured step (which does not collect
        its lists): no host sync, nothing done for params nothing wrote."""
        loc = None
        for group in self.param_groups:
            for p in group["params"]:
                key = self._master_key(group, p)
                st = self.state.get(p) if key is not None else None
                master = st.get(key) if st else None
                if master is not None:
                    loc = loc or (_sharded.local_fn() if self._sharding["any"] else _same)
                    self._sync_master(p, loc(p), loc(master))

    def _lr_tensor(self, gi: int, group: Dict[str, Any], device: torch.device) -> Tensor:
        lr = group["lr"]
        if isinstance(lr, Tensor):
            if lr.device == device and lr.dtype == torch.float32:
                return lr.reshape(())
            self._check_lr_copy(gi, lr, device)
            return lr.detach().to(device=device, dtype=torch.float32).reshape(())
        cached = self._lr_cache.get(gi)
        if cached is None or cached[1].device != device or cached[0] != lr:
            if _capturing(device):
                raise RuntimeError(
                    f"{self._opt_name}: param group {gi}'s lr is the Python number {lr!r} and a CUDA graph is being "
                    "captured: the graph would keep this value on every replay. Use a device tensor lr "
                    "(optimizer.prepare_capture() checks this before capturing)")
        if cached is None or cached[1].device != device:
            t = torch.full((), lr, dtype=torch.float32, device=device)
            self._lr_cache[gi] = [lr, t]
            return t
        if cached[0] != lr:
            cached[1].fill_(lr)
            cached[0] = lr
        return cached[1]

    def _check_lr_copy(self, gi: int, lr: Tensor, device: torch.device) -> None:
        """An lr tensor that must be copied to the params' device each step."""
        if _capturing(device):
            raise RuntimeError(
                f"{self._opt_name}: param group {gi}'s lr is a tensor on {lr.device} but its params are on {device}, "
                f"and a CUDA graph is being captured: the copy would freeze the lr. Create the lr on {device}")
        if lr.device.type == "cpu" and device.type != "cpu" and not self._warned.get("lr_device") \
                and not torch.compiler.is_compiling():
            self._warned["lr_device"] = True
            warnings.warn(
                f"{self._opt_name}: param group {gi}'s lr is a CPU tensor but its params are on {device}: every step "
                f"copies it to the device and waits for the host. Create it on the device, e.g. "
                f"torch.tensor(lr, device='{device}')", stacklevel=4)

    def _ensure_results(self, device: torch.device) -> None:
        """The tensors every step writes its norm and flag into, made once."""
        res = self._results
        if res["found_inf"] is not None and res["found_inf"].device == device:
            return
        if _capturing(device):
            raise RuntimeError(f"{self._opt_name}: the step's result tensors would be created while a CUDA graph is "
                               "being captured; call optimizer.prepare_capture() before capturing")
        res["grad_norm"] = torch.zeros((), dtype=torch.float32, device=device)
        res["found_inf"] = torch.zeros((), dtype=torch.float32, device=device)

    def _sparse_error(self) -> str:
        return f"{self._opt_name} does not support sparse gradients"

    @torch.no_grad()
    def step(self, closure=None):
        """One optimizer step (see the class docstring). ``closure`` re-evaluates
        the model and returns the loss, as in torch.optim."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # A LossScaler hands its inverse scale / found_inf over through this
        # dict (attributes cannot be set on an optimizer inside torch.compile).
        amp = self._amp_pending
        inv_scale, found_inf = amp["inv_scale"], amp["found_inf"]
        amp["inv_scale"] = None
        amp["found_inf"] = None
        self._fused_step(inv_scale, found_inf)
        return loss

    def _set_amp(self, inv_scale: Optional[Tensor], found_inf: Optional[Tensor]) -> None:
        """Make the next ``step()`` unscale by ``inv_scale`` and/or skip on
        ``found_inf`` (used by :class:`fusetrain.amp.LossScaler`)."""
        self._amp_pending["inv_scale"] = inv_scale
        self._amp_pending["found_inf"] = found_inf

    def _fused_step(self, inv_scale: Optional[Tensor] = None, found_inf: Optional[Tensor] = None) -> None:
        """The step with an optional loss-scale tail: ``inv_scale`` (gradients
        are multiplied by it) and ``found_inf`` (when non-zero on the device,
        nothing changes). With ``inv_scale`` and no ``found_inf`` the flag is
        computed in the step. With ``max_grad_norm`` set, gradients are clipped
        to the global norm and a step whose gradients are not finite is skipped."""
        # Checked first: torch.compile then never reads the plan (no guards on it).
        kept = None if torch.compiler.is_compiling() else self._kept.get("plan")
        if kept is not None and self._plan_holds(kept):
            lrs, hyper, values = self._group_records(kept["groups"])
            grad_norm, found_inf = self._sharded_stats(lambda: kept["plan"].local_stats(inv_scale), inv_scale,
                                                       found_inf)
            res = self._results
            kept["plan"].run(lrs, hyper, inv_scale=inv_scale, found_inf=found_inf,
                             ema_decay=self._ema_decay if kept["emas"] else None, grad_norm_out=res["grad_norm"],
                             found_inf_out=res["found_inf"], grad_norm=grad_norm, group_values=values,
                             stalled_out=res.get("stalled"))
            self._last["grad_norm"] = res["grad_norm"]
            self._last["found_inf"] = res["found_inf"]
            return
        params: List[Tensor] = []
        grads: List[Tensor] = []
        steps: List[Tensor] = []
        masters: List[Tensor] = []
        emas: List[Tensor] = []
        s1: List[Tensor] = []
        s2: List[Tensor] = []
        s3: List[Tensor] = []
        scales: List[Tensor] = []
        ema_rems: List[Tensor] = []
        sizes: List[int] = []
        groups: List[Any] = []  # per stepped group: (index, group, device, has_ema)
        for gi, group in enumerate(self.param_groups):
            start, ema_start = len(params), len(emas)
            if not self._init_group(group, params, grads, steps, masters, emas, s1, s2, s3, scales, ema_rems):
                continue
            sizes.append(len(params) - start)
            groups.append((gi, group, params[start].device, len(emas) > ema_start))
        if not params:
            # Nothing to step: no flag from this step (a stale one would make a
            # LossScaler back off or an EMA advance for a step that did nothing).
            self._last["grad_norm"] = None
            self._last["found_inf"] = None
            return
        lrs, hyper, values = self._group_records(groups)
        self._ensure_results(params[0].device)
        res = self._results
        stepped = None
        if self._sharding["any"]:
            stepped = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        grad_norm, found_inf = self._sharded_stats(
            lambda: _sharded.local_stats(stepped, grads, inv_scale, self._sharding.setdefault("copies", {})),
            inv_scale, found_inf)
        _ops.fused_step_(self._kind, params, grads, steps, s1, s2, s3, masters, emas, sizes, lrs, hyper,
                         inv_scale=inv_scale, found_inf=found_inf, ema_decay=self._ema_decay if emas else None,
                         grad_norm_out=res["grad_norm"], found_inf_out=res["found_inf"], grad_norm=grad_norm,
                         group_values=values, state_scales=scales, ema_remainders=ema_rems,
                         stalled_out=res.get("stalled"))
        self._last["grad_norm"] = res["grad_norm"]
        self._last["found_inf"] = res["found_inf"]
        if not torch.compiler.is_compiling() and self._keep_lists:
            self._make_plan(groups, stepped, params, steps, s1, s2, s3, masters, emas, sizes, scales, ema_rems)

    def _group_records(self, groups: Sequence[Any]):
        """Each stepped group's lr tensor, record (NOTE [group records] in
        csrc/ops/fused_step.cpp) and values tensor (NOTE [device values]; none
        when the step's kind has no schedulable fields or a compiled step
        reads the group's numbers itself)."""
        lrs: List[Tensor] = []
        hyper: List[float] = []
        values: List[Tensor] = []
        positions = KINDS[self._kind]["value_positions"]
        compiling = torch.compiler.is_compiling()
        for gi, group, device, has_ema in groups:
            lrs.append(self._lr_tensor(gi, group, device))
            max_norm = group["max_grad_norm"]
            hyper.append(0.0 if max_norm is None else float(max_norm))
            code = _MASTER_CODES.get(group["master_weights"]) if isinstance(group["master_weights"], (bool, str)) \
                else None
            if code is None:
                _check_master_weights(f"{self._opt_name} (param group {gi})", group["master_weights"], True)
            hyper.append(code)
            hyper.append(1.0 if has_ema else 0.0)
            hyper.append(1.0 if group["maximize"] else 0.0)
            fields = self._kind_fields(group)
            hyper.extend(fields)
            if not positions:
                continue
            if not compiling:
                values.append(self._values_tensor(gi, fields, device, checked=True))
            elif self._values_outside["compiled"]:
                # Written by sync_hyperparameters() before the compiled call (NOTE [device values]).
                values.append(self._values_cache[gi][1])
        return lrs, hyper, values

    def sync_hyperparameters(self) -> tuple:
        """Write the schedulable settings of every group (betas, momentum,
        weight_decay, eps, ...: ``optim_kinds()``'s ``value_fields``) into its
        device values tensor, checking new values first. Every eager
        ``step()`` does this itself; :class:`fusetrain.TrainStep` calls it
        before each compiled or captured step, which then follows a schedule
        of these settings without recompiling or capturing again (NOTE
        [device values]). Call it before replaying a CUDA graph of ``step()``
        that you captured yourself. Returns what such a step still reads on
        the host (each group's settings as of its last structural change):
        when that changes, a captured step must be captured again."""
        positions = KINDS[self._kind]["value_positions"]
        key = []
        for gi, group in enumerate(self.param_groups):
            device = next((p.device for p in group["params"] if p.requires_grad), None)
            if device is None:
                continue
            fields = self._kind_fields(group)
            if positions:
                self._values_tensor(gi, fields, device, checked=False)
            key.append(tuple(sorted(self._compiled_settings(gi, group, fields).items())))
        return tuple(key)

    def _values_tensor(self, gi: int, fields: List[float], device: torch.device, checked: bool) -> Tensor:
        """The group's values tensor holding ``fields``' schedulable entries,
        made once per group and device and written in place (a fill per
        changed value, no host sync) when a value changes. ``checked``: the
        step's op checks ``fields`` itself."""
        positions = KINDS[self._kind]["value_positions"]
        fields = tuple(fields)
        cached = self._values_cache.get(gi)  # [fields written, tensor]
        if cached is not None and cached[1].device == device and cached[0] == fields:
            return cached[1]
        if _capturing(device):
            raise RuntimeError(
                f"{self._opt_name}: param group {gi}'s settings changed while a CUDA graph is being captured: the "
                "graph would keep them on every replay. Call optimizer.sync_hyperparameters() before capturing "
                "and before each replay (fusetrain.TrainStep does)")
        if not checked:
            try:
                _C.check_kind_record(self._kind, list(fields))
            except ValueError as e:
                raise ValueError(f"{self._opt_name}: param group {gi}: {e}") from None
        if cached is None or cached[1].device != device:
            # Filled value by value: a copy from host memory would wait for the device.
            t = torch.empty(len(positions), dtype=torch.float64, device=device)
            for k, i in enumerate(positions):
                t[k].fill_(fields[i])
            self._values_cache[gi] = [fields, t]
            return t
        t = cached[1]
        for k, i in enumerate(positions):
            if fields[i] != cached[0][i]:
                t[k].fill_(fields[i])
        cached[0] = fields
        return t

    def _compiled_settings(self, gi: int, group: Dict[str, Any], fields: List[float]) -> Dict[str, Any]:
        """The group's settings a compiled step sees (``compiled_view``): those
        of its last structural change. They are replaced by the current ones
        when anything but schedulable values changed (any other key, a flag,
        max_grad_norm, a schedulable value turning zero or non-zero, which
        decides the states a group keeps)."""
        now = {k: v for k, v in group.items() if k not in ("params", "lr") and not isinstance(v, Tensor)}
        snap = self._snapshots.get(gi)
        if snap is not None and snap != now:
            positions = KINDS[self._kind]["value_positions"]
            was = self._kind_fields(snap)
            keep = snap.keys() == now.keys() and all(
                self._kind_fields(dict(snap, **{k: now[k]})) != was for k in now if now[k] != snap[k])
            keep = keep and all(w == f if i not in positions else (w != 0) == (f != 0)
                                for i, (w, f) in enumerate(zip(was, fields)))
            if not keep:
                snap = None
        if snap is None:
            snap = self._snapshots[gi] = now
        return snap

    @contextlib.contextmanager
    def compiled_view(self):
        """While a compiled step runs (``fusetrain.TrainStep``), each group shows
        the settings of its last structural change, so that the compiled code,
        whose guards cover every setting of the param groups, is not recompiled
        for a new schedulable value: the kernels read those from the values
        tensors that ``sync_hyperparameters()`` wrote (NOTE [device values])."""
        saved = []
        try:
            for gi, group in enumerate(self.param_groups):
                snap = self._snapshots.get(gi)
                if snap is not None and snap.keys() <= group.keys():
                    saved.append((group, {k: group[k] for k in snap}))
                    group.update(snap)
            yield
        finally:
            for group, items in saved:
                group.update(items)

    def _sharded_stats(self, local_stats, inv_scale: Optional[Tensor], found_inf: Optional[Tensor]):
        """The caller-measured global norm and the flag of a step over DTensor
        params (NOTE [sharded steps]): (None, found_inf) for other steps.
        ``local_stats()`` gives this rank's squared-norm share and flag."""
        if not self._sharding["any"]:
            return None, found_inf
        if not self._shard_local:
            raise NotImplementedError(
                f"{self._opt_name}: its update reduces over whole tensors (trust ratio, projection or "
                "orthogonalisation), which sharded (DTensor / fully_shard) parameters hold only in parts; use an "
                "element-wise fusetrain optimizer (AdamW, Adam, SGD, Lion, RMSprop, Adadelta, RAdam, NAdam, "
                "RMSpropTF) on sharded models")
        clips = any(g["max_grad_norm"] is not None for g in self.param_groups)
        if not (clips or inv_scale is not None or found_inf is not None):
            return None, found_inf
        sq, flag = local_stats()
        return _sharded.reduce_stats(sq, flag, found_inf)

    # ---- the step plan (NOTE [step plan] in csrc/python/step_plan.cpp) -------------------

    _keep_lists = True  # False: every step collects its lists (tests compare both ways)

    def _plan_key(self, group: Dict[str, Any]):
        """What a group's lists depend on beyond the params and their state objects."""
        return (tuple(self._state_names(group)), group["master_weights"], group.get("state_dtype"),
                group.get("state_block_size"))

    def _plan_holds(self, kept: Dict[str, Any]) -> bool:
        # EMA attach/detach, added groups, loads and new state drop the plan (_forget_lists).
        for (_, group, _, _), key in zip(kept["groups"], kept["keys"]):
            if self._plan_key(group) != key:
                return False
        return kept["plan"].collect(self.param_groups, self.state)

    def _make_plan(self, groups, stepped, params, steps, s1, s2, s3, masters, emas, sizes, scales,
                   ema_rems) -> None:
        """Keep this step's lists as a plan for the next steps, when they can be
        kept: no complex param (its lists hold views) and no sparse gradient."""
        self._kept.clear()
        if type(self.param_groups) is not list or any(type(g["params"]) is not list for g in self.param_groups):
            return  # kept lists need the groups' own lists; a step over other sequences collects every time
        if stepped is None:
            stepped = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        if any(p.is_complex() or p.grad.is_sparse for p in stepped):
            return
        sds = [self.state[p] for p in stepped]
        if not all(type(sd) is dict for sd in sds) or not isinstance(self.state, dict):
            return
        items = [(sd, k, v) for sd in sds for k, v in sd.items() if isinstance(v, Tensor)]
        dtensor = _sharded._dtensor_class() if self._sharding["any"] else None
        local = [p._local_tensor if dtensor is not None and isinstance(p, dtensor) else None for p in stepped]
        copies = []
        if self._sharding["any"]:  # NOTE [sharded steps]: each param's replica count, for the norm
            if not torch.distributed.is_initialized():
                return
            cache = self._sharding.setdefault("copies", {})
            for p in stepped:
                if id(p) not in cache:
                    cache[id(p)] = _sharded.copies(p)
            copies = [cache[id(p)] for p in stepped]
        # NOTE [master re-sync]: the plan lets go when a param with a master copy is written.
        watched = [i for i, (p, sd) in enumerate(zip(stepped, sds))
                   if p.dtype in _LOW and ("master_param" in sd or "master_remainder" in sd)] if masters else []
        plan = _C.StepPlan(self._kind, self.param_groups, self.state, dtensor, params, steps, s1, s2, s3, masters,
                           emas, sizes, stepped, sds, [i[0] for i in items], [i[1] for i in items],
                           [i[2] for i in items], local, copies, watched, scales, ema_rems)
        self._kept["plan"] = {"plan": plan, "groups": groups, "emas": bool(emas),
                              "keys": [self._plan_key(g[1]) for g in groups]}
