"""A layer op's saved FP8 weights, when they are a view of the layer's weight
cache (``is_first_microbatch`` True or False), go to the backward as a
reference to the cache instead of as the cache's buffers.

A custom op's outputs must be memory the op made: Inductor treats them as
fresh, and CUDA-graph trees (``mode="reduce-overhead"``) require every graph
output that is not an input to live in the graph's pool.  The cache's
buffers are neither (they outlive the call and are made outside any pool,
lpmoe._persistent), so returning them stopped the first recorded step ("These
storage data ptrs are not allocated in pool").  So the forward, fake and
real alike (the traced layout must hold), saves a :class:`CachedWeight`
(the cache's key, the policy's view, lpmoe.policy.base.saved_weight_view,
and the view's static description) in place of the view, and the backward
takes that view from the cache (lpmoe.library.saved_layout resolves it
when it rebuilds the objects; a traced backward gets an empty fake view of
that description).

The backward reads the cache as it is when the backward runs: the buffers
the forward read unless the cache was rewritten in between.  Eager
autograd refuses such a backward (the saved buffers' versions moved).
Here one record per cache stands in for that: each forward that reads the
cache notes its buffers' versions (lpmoe.optim.AdamW's step bumps them),
and a backward that finds them moved raises.  It catches a rewrite after
the latest such forward (a step between a micro-batch's forward and its
backward), not one followed by another micro-batch's forward before the
first backward: per-forward state cannot cross a compiled graph's op
boundary except as tensors.  A forward recorded into a CUDA graph leaves no
record (its replays run no Python), and neither checks a replayed
backward: captured reads of the cache are never checked.

Default calls (``is_first_microbatch=None``) that read lpmoe.optim.AdamW's
cache still hand its buffers out as saved tensors: whether the cache holds
the weights is known only when the call runs, and the saved layout is fixed
when the graph is traced.  Under capture such a call quantizes instead
(functional.weights.optimizer_cache_of), and a compiled backward of lpmoe's
layers is its own ops, in which Inductor allocates nothing that could reuse
a saved buffer (checked in the generated code on the CPU).
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from lpmoe.functional.weights import cache_by_key
from lpmoe.grouped_tensor import GroupedTensor
from lpmoe.library import specs
from lpmoe.library.grouped_codec import meta_of
from lpmoe.library.routing import tracing
from lpmoe.policy.base import saved_weight_view

__all__ = ["CachedWeight", "mark_cached", "resolve"]

#: saved weights taken from a cache by a backward (tests prove the path ran)
CALLS = {"resolved": 0}

_BUFFERS = ("rowwise_data", "columnwise_data", "scale_inv", "columnwise_scale_inv")


class CachedWeight:
    """Stands for ``saved_weight_view(cache(key).quantized, view)``, a
    GroupedTensor described by ``meta`` (grouped_codec.meta_of) on
    ``device`` (its string, index included)."""
    __slots__ = ("key", "view", "meta", "device")

    def __init__(self, key: int, view: str, meta: str, device: str):
        self.key, self.view, self.meta, self.device = key, view, meta, device

    def static(self) -> tuple:
        return (self.key, self.view, self.meta, self.device)


def _versions(q: GroupedTensor) -> tuple:
    return tuple(getattr(q, f)._version for f in _BUFFERS if getattr(q, f) is not None)


def mark_cached(objs: Sequence, slots: Sequence[Tuple[int, int]], policy, fake: bool) -> tuple:
    """``objs`` with the quantized weights at the ``slots`` ((position, cache
    key) of each layer whose call uses its cache) replaced by
    :class:`CachedWeight`.  A real call checks that they are the cache's and
    records the cache buffers' versions for :func:`resolve`."""
    objs = list(objs)
    for i, key in slots:
        obj = objs[i]
        if not isinstance(obj, GroupedTensor):  # e.g. a high-precision backward keeps the parameters
            continue
        if not fake:
            cache = cache_by_key(key)
            q = None if cache is None else cache.quantized
            if q is None or any(getattr(obj, f) is not None and getattr(obj, f).data_ptr() != getattr(q, f).data_ptr()
                                for f in _BUFFERS):
                raise RuntimeError("lpmoe: a layer call with is_first_microbatch True/False did not read its "
                                   "weight cache; please report this")
            captured = obj.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
            cache.forward_versions = None if captured else _versions(q)
        objs[i] = CachedWeight(key, policy.saved_weight, meta_of(obj), str(obj.device))
    return tuple(objs)


def _fake_view(view: str, meta: str, device: str) -> GroupedTensor:
    # what the traced backward reads: empty buffers of the view's structure
    m = specs.parse(meta)
    q = specs.decode(m["q"]).copy(rowwise=True, columnwise=True)
    full = GroupedTensor.empty(q, m["n"], tuple(m["shape"]), dtype=specs.dtype_from_name(m["dtype"]),
                               device=torch.device(device))
    return saved_weight_view(full, view)


def resolve(key: int, view: str, meta: str, device: str) -> GroupedTensor:
    """The saved weights a :class:`CachedWeight` stands for, from the cache
    as it is now (while tracing: a fake view of the same structure)."""
    if tracing():
        return _fake_view(view, meta, device)
    cache = cache_by_key(key)
    q: Optional[GroupedTensor] = None if cache is None else cache.quantized
    if q is None:
        raise RuntimeError("lpmoe: the backward of a layer call with is_first_microbatch True/False found no "
                           "weight cache (the layer was freed or its cache cleared after the forward)")
    seen = cache.forward_versions
    if seen is not None and _versions(q) != seen:
        raise RuntimeError("lpmoe: the cached FP8 weights a compiled layer's forward read were rewritten before "
                           "its backward (an optimizer step or another quantization in between); run the "
                           "backward first")
    out = saved_weight_view(q, view)
    if meta_of(out) != meta:
        raise RuntimeError("lpmoe: the weight cache changed format between a compiled layer's forward and its "
                           "backward")
    CALLS["resolved"] += 1
    return out
