"""Host facts about CUDA devices that lpmoe asks on every call."""
from __future__ import annotations

from typing import Dict

import torch

__all__ = ["cuda_major"]

_MAJOR: Dict[int, int] = {}  # device index -> compute capability major


def cuda_major(device: torch.device) -> int:
    """Compute capability major of a CUDA device: a host query, no sync.
    Cached, because torch's lookup costs a few microseconds and every grouped
    GEMM and layer call asks (eager steps of small experts are host-bound)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    major = _MAJOR.get(idx)
    if major is None:
        major = _MAJOR[idx] = torch.cuda.get_device_capability(idx)[0]
    return major
