"""Tensors that a collective has not finished writing.

torch.distributed's functional collectives (``_functional_collectives``,
which lpmoe.moe's expert-parallel exchange and most hand-written EP code
use) return an ``AsyncCollectiveTensor``: a wrapper whose own data pointer
is 0 until something waits on it.  PyTorch's ops wait by themselves;
lpmoe's kernels read raw device pointers, so the public entry points pass
the tensors they hand to kernels through :func:`ready` first (a kernel fed
the wrapper would read near address 0): the layers and their functional
forms, the MoE permutation and router, the activation, quantize /
group_quantize, grouped_gemm (weights included), splits_to_offsets, and
every buffer a GroupedTensor is built from.  The binding refuses any
remaining wrapper by name.  ``wait_tensor`` orders the current
stream after the collective and keeps autograd connected.
"""
from __future__ import annotations

import torch

try:
    from torch.distributed._functional_collectives import AsyncCollectiveTensor as _Async
    from torch.distributed._functional_collectives import wait_tensor as _wait
except ImportError:  # pragma: no cover - torch built without distributed
    _Async = None

__all__ = ["ready", "CALLS"]

CALLS = {"waited": 0}   # pending results waited on here (tests prove the entry points wait)


def ready(t):
    """``t`` itself, or for a pending collective result the waited tensor."""
    if _Async is not None and isinstance(t, _Async):
        CALLS["waited"] += 1
        return _wait(t)
    return t
