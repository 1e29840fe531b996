"""Shared pieces of the layer ops (lpmoe.library.linear_ops, .mlp_ops):
call counters, splits and needs decoding, weight-cache keys and the
signature that keys a saved layout."""
from __future__ import annotations

from typing import List, Optional

import torch

from lpmoe.functional.splits import Splits, parse_splits
from lpmoe.functional.weights import WeightCache, cache_by_key, cache_in_use, optimizer_cache_of
from lpmoe.policy import Needs

Tensor = torch.Tensor

#: calls of the layer ops' real implementations (tests prove the op ran)
CALLS = {"grouped_linear": 0, "grouped_linear_backward": 0, "grouped_mlp": 0, "grouped_mlp_backward": 0,
         "grouped_mlp_backward_act": 0, "grouped_mlp_backward_fc1": 0}


#: cache_key of a default call (is_first_microbatch=None) of a layer that
#: has a cache: the op reads the optimizer-written cache of the weights it
#: is given, if any (lpmoe.functional.weights.optimizer_cache_of)
OPTIMIZER_CACHE = -2


def cache_key(cache: Optional[WeightCache], is_first_microbatch) -> int:
    # Weight caches travel as integer keys (a custom op cannot take a Python
    # object).  is_first_microbatch True/False names its cache; with None no
    # key goes into the (constant) configuration, so identical layers share
    # one compiled graph instead of recompiling per instance, only whether
    # the layer has a cache at all (-1: none, as for a functional call
    # without one).
    if cache_in_use(cache, is_first_microbatch):
        return cache.key
    return -1 if cache is None else OPTIMIZER_CACHE


def op_cache(key: int, first: Optional[bool], fake: bool, weights=None) -> Optional[WeightCache]:
    """The cache a layer op's call uses, from its configuration's key (see
    :func:`cache_key`): the keyed cache for is_first_microbatch True/False;
    for None the cache lpmoe.optim.AdamW wrote for ``weights`` (the forward's
    weights; the backward passes none), read while current, as an eager
    call does (never under capture, weights.optimizer_cache_of).  Without a
    cache a default call quantizes and keeps nothing (under CUDA-graph trees
    anything a call keeps alive outside its outputs would break the graph
    pool).  None for fake (shape-only) calls."""
    if fake:
        return None
    if first is None:
        return optimizer_cache_of(weights) if weights is not None and key == OPTIMIZER_CACHE else None
    return cache_by_key(key)


def cached_slots(c: dict, slots):
    """The (position, cache key) pairs of ``slots`` whose layer reads its
    weight cache in this configuration (is_first_microbatch True/False and
    a cache key): their saved weights go to the backward as references
    (lpmoe.library.cached_weights)."""
    if c["first"] is None:
        return ()
    return tuple((i, key) for i, key in slots if key >= 0)


def op_splits(m_splits: Optional[Tensor], host: Optional[List[int]], num: int, rows: int, device, fake: bool) -> Splits:
    if fake:  # shapes only: values are never read; fresh exactly where parse_splits makes a new tensor
        if m_splits is None:
            return Splits(torch.empty(num, dtype=torch.int64, device=device), host)
        if m_splits.device.type == "cpu":  # parse_splits reads it: the host path (values unknown here)
            return Splits(torch.empty(num, dtype=torch.int64, device=device), [0] * num)
        return Splits(m_splits.to(torch.int64), host)
    return parse_splits(m_splits if m_splits is not None else host, num, rows, device)


def needs_of_list(v) -> Needs:
    return Needs(*v)


def signature(x: Tensor, m_splits: Optional[Tensor], params: List[Tensor]) -> str:
    # No token count: one saved layout serves every count (dynamic shapes).
    s = "host" if m_splits is None else f"{m_splits.dtype}@{m_splits.device.type}"
    return f"{tuple(x.shape[1:])}|{x.dtype}|{x.device.type}|{s}|{len(params)}|{tuple(params[0].shape)}"


def fused_weights(weights: List[Tensor], config: dict) -> List[Tensor]:
    """The weights whose main_grad a layer's backward op adds into: all of
    them when the layer is fused, else none."""
    return list(weights) if config["fuse"] is not None else []


def setup_context_of(setup, fwd_args: tuple, fwd_out):
    """The context ``setup`` (a layer op's setup_context) fills after a
    forward with ``fwd_args`` returned ``fwd_out``: how tests and opcheck
    get the backward ops' arguments without autograd."""
    class _Ctx:
        def save_for_backward(self, *t):
            self.saved_tensors = t
    ctx = _Ctx()
    setup(ctx, fwd_args, fwd_out)
    return ctx
