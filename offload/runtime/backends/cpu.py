"""CPUBackend: the executor's schedule on a machine without a GPU; the "gpu" tier is tracked host memory."""

from __future__ import annotations

import torch

from offload.runtime.backends.base import Backend
from offload.profile.timeline import Span, Timeline


class CPUBackend(Backend):
    """Copies happen at once (synchronously); every ordering rule is still logged and checked."""

    name = "cpu"

    def __init__(self, timeline: Timeline | None = None):
        super().__init__(timeline)
        self.device = torch.device("cpu")

    def copy_h2d(self, dst: torch.Tensor, src: torch.Tensor, unit: str, phase: str, not_before: float = 0.0):
        start = Timeline.now()
        dst[: src.numel()].copy_(src)
        self.timeline.add(Span("h2d_copy", phase, unit, start, Timeline.now(), n_bytes=src.numel()))
        return None
