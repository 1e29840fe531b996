"""Tensors that a collective has not finished writing.

torch.distributed's functional collectives (``_functional_collectives``,
which lpmoe.moe's expert-parallel exchange and most hand-written EP code
use) return an ``AsyncCollectiveTensor``: a wrapper whose own data pointer
is 0 until something waits on it.  PyTorch's ops wait by themselves;
lpmoe's kernels read raw device pointers, so each public entry point that
hands a tensor to a kernel passes it through :func:`ready` first (a kernel
fed the wrapper would read address 0).  ``wait_tensor`` orders the current
stream after the collective and keeps autograd connected.
"""
from __future__ import annotations

import torch

try:
    from torch.distributed._functional_collectives import AsyncCollectiveTensor as _Async
    from torch.distributed._functional_collectives import wait_tensor as _wait
except ImportError:  # pragma: no cover - torch built without distributed
    _Async = None

__all__ = ["ready"]


def ready(t):
    """``t`` itself, or for a pending collective result the waited tensor."""
    if _Async is not None and isinstance(t, _Async):
        return _wait(t)
    return t
