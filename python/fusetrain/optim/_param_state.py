"""Per-param state of the fused optimizers: created at a param's first step
(or up front, ``init_state`` / ``prepare_capture``), checked before each
collected step, the master weights in their group's form (NOTE [lean state]
in csrc/common/lean_state.h) and taken again from a param written outside a
step (NOTE [master re-sync]). A mixin of ``FusedOptimizer`` (_base.py)."""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch
from torch import Tensor

from . import _capture, _int8_state, _sharded
from ._settings import _MASTER_KEYS
from ._state_layout import _LOW, _conform, _fits, _join_remainder, _put_in_form, _same, _split_remainder, _state_dtype


def _is_device_scalar(v: Any, device: torch.device) -> bool:
    return isinstance(v, Tensor) and v.device == device and v.dtype == torch.float32 and v.dim() == 0


class ParamState:
    """The state a step of a param needs, and its master weights."""

    def _new_step_value(self, state: Dict[str, Any]) -> float:
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
                    state[name] = torch.full((), self._initial_state_value(name, group), dtype=torch.float32,
                                             device=p.device)
                elif not _is_device_scalar(state[name], p.device):  # also a Python number (older checkpoints)
                    state[name] = torch.as_tensor(state[name], dtype=torch.float32).to(p.device).reshape(())
            elif name is not None and torch.int8 in (_state_dtype(p, group=group), getattr(state.get(name), "dtype",
                                                                                             None)):
                # NOTE [8-bit state]: made, converted or laid out with its block scales.
                _put_in_form(state, name, p, _state_dtype(p, group=group), group["state_block_size"],
                             self._initial_state_value(name, group))
            elif name is not None and state.get(name) is None:
                state[name] = torch.full_like(p, self._initial_state_value(name, group),
                                              dtype=_state_dtype(p, group=group), memory_format=torch.preserve_format)
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
            if old == mark or _capture.capturing(p.device):
                return
            if old is not None and old[2:] == mark[2:]:
                master.zero_()
            self._master_marks[id(p)] = mark
            return
        if self._master_marks.get(id(p)) == mark or _capture.capturing(p.device):
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
