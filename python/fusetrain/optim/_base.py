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

``FusedOptimizer`` is this module (groups, collecting the lists, the step,
the step plan) and five mixins: _table_class.py (what a class takes from its
entry in the optimizer table: defaults, checks, records), _param_state.py (a
param's state and its master weights), _group_values.py (each group's lr,
record and device values), _update_riders.py (EMA copies, the stalled-update
counter) and _state_dicts.py.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch
from torch import Tensor
from torch.optim import Optimizer

from .. import _C, _ops
from .._checks import check_number
from . import _capture, _int8_state, _sharded
from ._group_values import GroupValues
from ._kinds import KINDS, SHARD_LOCAL_CLASSES
from ._param_state import ParamState
from ._settings import _check_block_size, _check_master_weights, _check_state_dtype
from ._state_dicts import StateDicts
from ._state_layout import _LOW, _conform, _fits, _same
from ._table_class import _PLANS, TableClass
from ._update_riders import UpdateRiders

# Complex params are updated as real views (torch.view_as_real), as torch.optim
# does; their state is complex like torch's. NOTE [float64 params] in
# csrc/ops/fused_update.cpp: float64 params keep float64 state.
_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.complex64,
                     torch.complex128)
_SUPPORTED_NAMES = "float32, float16, bfloat16, float64, complex64, complex128"
_STATE_PLANS: Dict[type, Any] = {}  # FusedOptimizer._state_plan, per class


class FusedOptimizer(TableClass, ParamState, GroupValues, UpdateRiders, StateDicts, Optimizer):
    """Base class of the fused optimizers. A class named in the optimizer
    table (_table.py) takes its kind, defaults, checks and records from its
    entry (_table_class.py); its ``__init__`` keeps torch's signature and calls
    ``self._from_table(params, locals())``."""

    _kind = ""
    # State entries that are 0-d float32 device scalars beside the step (NOTE
    # [tensor scalars] in csrc/common/update_launch.h), e.g. NAdam's mu_product.
    _scalar_states: Sequence[str] = ()
    # Whether the update of a tensor is element-wise, so that a DTensor's local
    # shard can be updated alone (NOTE [sharded steps] in _sharded.py).
    _shard_local = True
    _sparse_grads = False  # whether sparse gradients are accepted (NOTE [sparse gradients])

    _opt_name = "FusedOptimizer"

    def __init__(self, params, defaults: Dict[str, Any], max_grad_norm: Optional[float], master_weights: Any,
                 state_dtype: Any = torch.float32, state_block_size: int = _int8_state.DEFAULT_BLOCK):
        self._init_fused(params, defaults, max_grad_norm, master_weights, state_dtype, state_block_size)

    def _init_fused(self, params, defaults: Dict[str, Any], max_grad_norm: Optional[float] = None,
                    master_weights: Any = False, state_dtype: Any = torch.float32,
                    state_block_size: int = _int8_state.DEFAULT_BLOCK) -> None:
        check_number(self._opt_name, "max_grad_norm", max_grad_norm, 0.0, low_open=True, tensor=True, optional=True)
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
        self._view: Dict[str, bool] = {"active": False}  # NOTE [compiled settings]
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
        try:
            devices = self._check_new_group(gi, group)
        except (TypeError, ValueError):
            self.param_groups.pop()  # a group refused leaves the optimizer as it was
            raise
        if any(_sharded.is_sharded(p) for p in group["params"]):
            self._sharding["any"] = True
        if devices and self._results["found_inf"] is None:
            # Made here rather than in the first step, which torch.compile may trace.
            self._ensure_results(next(iter(devices)))
        if self._ema_lists is not None:
            self._ema_lists.append(None)
            self._ema_rem_lists.append(None)
        self._forget_lists()

    def _check_new_group(self, gi: int, group: Dict[str, Any]) -> set:
        """Checks (and normalises) a new group's settings (NOTE [lean state]) and params; returns their
        devices."""
        where = f"{self._opt_name} (param group {gi})"
        self._check_group_options(where, group)
        check_number(where, "max_grad_norm", group.get("max_grad_norm"), 0.0, low_open=True, tensor=True,
                     optional=True)
        self._check_lean_group_settings(gi, group)
        devices = set()
        for i, p in enumerate(group["params"]):
            if p.dtype not in _SUPPORTED_DTYPES:
                raise TypeError(f"{self._opt_name}: param {i} of group {gi} has dtype {p.dtype}; "
                                f"supported: {_SUPPORTED_NAMES}")
            if p.device.type not in ("cpu", "cuda"):
                raise ValueError(f"{self._opt_name}: param {i} of group {gi} is on {p.device}; supported: cpu, cuda")
            devices.add(p.device)
        if len(devices) > 1:
            raise ValueError(f"{self._opt_name}: params of group {gi} are on different devices "
                             f"{sorted(str(d) for d in devices)}; put each device's params in its own group")
        return devices

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
        self.__dict__.setdefault("_view", {"active": False})
        if self._decl is not None:
            self.__dict__.setdefault("_initial_lr", float(self.defaults["lr"]))
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
        fixed = self._decl.fixed if self._decl is not None else {}
        for group in self.param_groups:
            for k, v in self.defaults.items():
                group.setdefault(k, v)
            for k, v in fixed.items():
                if k in group:  # torch's AdamW keeps decoupled weight decay whatever state it loads
                    group[k] = v
            for p in group["params"]:
                st = self.state.get(p)
                if st and "step" in st and not isinstance(st["step"], Tensor):
                    # A Python-number step (older torch checkpoints), as torch does.
                    st["step"] = torch.tensor(float(st["step"]), dtype=torch.float32, device=p.device)

    # ---- the kind's record and states -------------------------------------------------

    def _kind_fields(self, group: Dict[str, Any]) -> List[float]:
        """The optimizer's own fields of the group record, in the table's order."""
        plan = _PLANS.get(type(self)) or self._record_plan()
        own = self._kind_values(group) if self._own_fields else None
        try:
            return [float(get(self, group, own)) for get in plan]
        except KeyError as e:
            raise KeyError(f"{self._opt_name}: a param group has no '{e.args[0]}', an option of the "
                           f"'{self._kind}' record ({', '.join(KINDS[self._kind]['field_names'])})") from None

    def _state_plan(self):
        """Per class, made once: the state names when no state is conditional (else None), and each state as
        (slot, name, the getter of its condition field or None, when_set)."""
        plan = _STATE_PLANS.get(type(self))
        if plan is None:
            kind = KINDS[self._kind]
            getters = _PLANS.get(type(self)) or self._record_plan()
            rules = tuple((slot, name, None if when is None else getters[kind["field_names"].index(when)], when_set)
                          for slot, name, when, when_set in kind["state_rules"])
            fixed = None
            if all(when is None for _, _, when, _ in rules):
                names: List[Optional[str]] = [None, None, None]
                for slot, name, _, _ in rules:
                    names[slot] = name
                fixed = tuple(names[:max(slot for slot, _, _, _ in rules) + 1])
            plan = _STATE_PLANS[type(self)] = (fixed, rules)
        return plan

    def _state_names(self, group: Dict[str, Any]) -> Sequence[Optional[str]]:
        """The per-param state tensors the group keeps, in the slots state1..3
        of its record (None for an unused slot before a used one): the kind
        table's states whose condition field holds."""
        fixed, rules = _STATE_PLANS.get(type(self)) or self._state_plan()
        if fixed is not None:
            return fixed
        own = self._kind_values(group) if self._own_fields else None
        names: List[Optional[str]] = [None, None, None]
        for slot, name, when, when_set in rules:
            if when is not None and (when(self, group, own) != 0) != when_set:
                continue
            names[slot] = name
        while names and names[-1] is None:
            names.pop()
        return tuple(names)

    def _initial_state_value(self, name: str, group: Dict[str, Any]) -> float:
        """The value a new state tensor ``name`` of a group starts at (the table's ``initial``)."""
        st = next(s for s in KINDS[self._kind]["states"] if s["name"] == name)
        if st["initial_when"] is None:
            return st["initial"]
        on = self._record_of(group)[KINDS[self._kind]["field_names"].index(st["initial_when"])]
        return st["initial"] if on != 0 else 0.0

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
                if _capture.capturing(p.device):
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

    def _ensure_results(self, device: torch.device) -> None:
        """The tensors every step writes its norm and flag into, made once."""
        res = self._results
        if res["found_inf"] is not None and res["found_inf"].device == device:
            return
        if _capture.capturing(device):
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
                f"element-wise fusetrain optimizer ({', '.join(SHARD_LOCAL_CLASSES)}) on sharded models")
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
