"""Whether a CUDA graph is being captured: the one place the fused
optimizers ask (tests stand in for a capture by replacing ``capturing``)."""

from __future__ import annotations

import torch


def capturing(device: torch.device) -> bool:
    """Whether a CUDA graph is being captured on ``device``'s current stream.
    Asked only where a step would create or fill a tensor (never per step in
    steady state); under torch.compile tracing it is False (no capture there)."""
    return (device.type == "cuda" and not torch.compiler.is_compiling()
            and torch.cuda.is_current_stream_capturing())
