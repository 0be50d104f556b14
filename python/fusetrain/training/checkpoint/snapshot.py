"""The host copy of a checkpoint written in the background (NOTE [asynchronous checkpoints])."""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch
from torch import nn

__all__ = ["HostSnapshot"]


class HostSnapshot:
    """NOTE [pinned snapshot]: the host copy of an asynchronous checkpoint. A
    dense CUDA tensor goes to a page-locked buffer kept for the same place of
    the next checkpoint, by a copy queued on its device's current stream: the
    training thread does not wait for it (a copy to pageable memory waits for
    the GPU and runs at a fraction of the bus's speed), and the next steps'
    kernels, queued behind it, cannot change what it reads. ``ready()`` (on
    the writer thread) waits for the copies before the state is written. The
    buffers are reused only after the write that read them (one write in
    flight, NOTE [asynchronous checkpoints]). Other tensors are copied
    synchronously."""

    def __init__(self) -> None:
        self._buffers: Dict[Tuple[Any, ...], torch.Tensor] = {}
        self._events: List[Any] = []

    def take(self, obj: Any) -> Any:
        """``obj`` with its tensors copied (or being copied) to host memory."""
        buffers, self._buffers = self._buffers, {}
        devices: Dict[torch.device, None] = {}
        out = self._copy(obj, (), buffers, devices)
        self._events = []
        for device in devices:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            self._events.append(event)
        return out

    def ready(self) -> None:
        """Wait until the last ``take``'s copies have landed."""
        for event in self._events:
            event.synchronize()

    def _copy(self, obj: Any, key: Tuple[Any, ...], buffers: Dict[Tuple[Any, ...], torch.Tensor],
              devices: Dict[torch.device, None]) -> Any:
        if isinstance(obj, torch.Tensor):
            t = obj.detach()
            if not (t.is_cuda and t.layout == torch.strided and type(t) in (torch.Tensor, nn.Parameter)):
                return t.to("cpu", copy=True)
            buf = buffers.get(key)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self._buffers[key] = buf
            devices[t.device] = None
            return buf.copy_(t, non_blocking=True)
        if isinstance(obj, dict):
            out = obj.copy()  # keeps OrderedDict and the like
            for k, v in obj.items():
                out[k] = self._copy(v, key + (k,), buffers, devices)
            return out
        if isinstance(obj, (list, tuple)):
            items = [self._copy(v, key + (i,), buffers, devices) for i, v in enumerate(obj)]
            if isinstance(obj, list):
                return items
            return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
        return obj
