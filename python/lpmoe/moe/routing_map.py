"""Where each routed token slot goes: the map the permutation kernels move
rows by, computed on the device with PyTorch ops (no host sync, capturable,
compilable; a stable sort is the one non-trivial step and PyTorch's is the
right tool for it).

Slot (t, j) of ``topk_indices`` (T, k) names expert e = topk_indices[t, j];
a value outside [0, num_experts) (conventionally -1) marks a slot the
router dropped.  Within an expert, slots keep token order (t, then j).

Layouts of the grouped rows:

* ``packed`` (default): experts' rows back to back, expert e's block starts
  at the sum of the earlier experts' kept counts; ``num_rows`` = T*k (or
  E*capacity if smaller) so shapes are static; rows past the kept total are
  a capacity tail (zeros), which GroupedLinear/GroupedMLP accept.
* ``padded``: a fixed ``capacity`` rows per expert (row e*capacity + rank);
  ``num_rows`` = E*capacity.  Unused rows are zeros.  This is the layout of
  the graph-safe expert-parallel exchange (equal split sizes).

With ``capacity`` C, an expert keeps its first C slots (token order) and the
rest are dropped: ``dropped`` counts them (a device scalar), and their
``row_map`` entries are -1, so they contribute nothing to the output.

On the GPU (up to 1024 experts) one custom op, ``lpmoe::routing_map``, runs
three small kernels (csrc/routing_map: per-chunk counts, their scan over
chunks, per-slot ranks); elsewhere, and as the tests' reference, the same
map comes from PyTorch ops (:func:`routing_map_torch`: a stable sort,
searchsorted and scatters, ~15 launches).  Integer arithmetic only: both
give the same map.  ``CALLS`` counts which one ran.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from lpmoe._ext import ext, has_extension
from lpmoe.library._define import define
from lpmoe.library.routing import tracing

__all__ = ["RoutingMap", "routing_map", "routing_map_torch", "CALLS"]

CALLS = {"kernel_routing_map": 0, "torch_routing_map": 0}

#: experts the routing map kernel takes (a running count per expert and warp in shared memory)
KERNEL_MAX_EXPERTS = 1024


@dataclass
class RoutingMap:
    row_map: torch.Tensor            # (T, k) int32: grouped row of slot (t, j), -1 = not routed
    m_splits: torch.Tensor           # (E,) int64 on the device: rows kept per expert
    num_rows: int                    # rows of the grouped buffer (static)
    used_rows: Optional[torch.Tensor]  # device int64 scalar: packed layout's kept total; None = padded
    dropped: Optional[torch.Tensor]  # device int64 scalar: routed slots dropped by the capacity (None: not counted)
    capacity: Optional[int] = None

    @property
    def num_experts(self) -> int:
        return self.m_splits.numel()

    @property
    def top_k(self) -> int:
        return self.row_map.shape[1]


def routing_map(topk_indices: torch.Tensor, num_experts: int, capacity: Optional[int] = None,
                layout: str = "packed") -> RoutingMap:
    """The :class:`RoutingMap` of ``topk_indices`` ((T, k) or (T,), integer)."""
    if not isinstance(topk_indices, torch.Tensor) or topk_indices.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_indices must be an int32/int64 tensor, got "
                        f"{getattr(topk_indices, 'dtype', type(topk_indices).__name__)}")
    if topk_indices.dim() not in (1, 2):
        raise ValueError(f"topk_indices must be (tokens, k) or (tokens,), got shape {tuple(topk_indices.shape)}")
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
    if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0):
        raise ValueError(f"capacity must be a non-negative int or None, got {capacity!r}")
    if layout not in ("packed", "padded"):
        raise ValueError(f"layout must be 'packed' or 'padded', got {layout!r}")
    if layout == "padded" and capacity is None:
        raise ValueError("layout='padded' needs a capacity (rows per expert)")
    idx = topk_indices if topk_indices.dim() == 2 else topk_indices.unsqueeze(1)
    tokens, k = idx.shape
    n = tokens * k
    if n >= 2 ** 31:
        raise ValueError(f"tokens * top_k = {n} slots exceed the int32 row map")
    padded = layout == "padded"
    if padded and capacity > 2 ** 31 // num_experts - 1:  # (the binding's bound)
        raise ValueError(f"num_experts * capacity = {num_experts * capacity} rows exceed the int32 row map")
    args = (idx.reshape(-1), num_experts, -1 if capacity is None else capacity, padded)
    if tracing():
        row_map, kept, used, dropped = _routing_map_op(*args)
    else:
        row_map, kept, used, dropped = _routing_map_impl(*args)
    num_rows = num_experts * capacity if padded else (n if capacity is None else min(n, num_experts * capacity))
    return RoutingMap(row_map.view(tokens, k), kept, num_rows, None if padded else used, dropped, capacity)


def _fake(indices, num_experts, capacity, padded):
    i64 = dict(dtype=torch.int64, device=indices.device)
    return (torch.empty(indices.shape, dtype=torch.int32, device=indices.device), torch.empty(num_experts, **i64),
            torch.empty(1, **i64), torch.empty(1, **i64))


@define("routing_map", _fake)
def _routing_map_op(indices: torch.Tensor, num_experts: int, capacity: int, padded: bool
                    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _routing_map_impl(indices, num_experts, capacity, padded)


def _routing_map_impl(flat, num_experts, capacity, padded):
    """(row_map (slots,) int32, m_splits (E,) int64, kept total (1,) int64,
    dropped (1,) int64); ``capacity`` -1 = none."""
    if flat.is_cuda and num_experts <= KERNEL_MAX_EXPERTS and has_extension():
        CALLS["kernel_routing_map"] += 1
        dev, n = flat.device, flat.numel()
        i32, i64 = dict(dtype=torch.int32, device=dev), dict(dtype=torch.int64, device=dev)
        scratch = torch.empty((ext().routing_map_chunks(n) + 1) * num_experts, **i32)  # counts, then totals
        counts, totals = scratch[:-num_experts], scratch[-num_experts:]
        row_map, kept = torch.empty(n, **i32), torch.empty(num_experts, **i64)
        used, dropped = torch.empty(1, **i64), torch.empty(1, **i64)
        ext().routing_map(flat.contiguous(), num_experts, capacity, padded, counts, totals, row_map, kept, used,
                          dropped)
        return row_map, kept, used, dropped
    CALLS["torch_routing_map"] += 1
    return routing_map_torch(flat, num_experts, None if capacity < 0 else capacity, padded)


def routing_map_torch(flat: torch.Tensor, num_experts: int, capacity: Optional[int], padded: bool
                      ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The map from PyTorch ops (any device, any expert count): the
    formulation the kernels are tested against.  ``flat``: (slots,) expert
    ids; returns what ``lpmoe::routing_map`` returns (``used`` is the kept
    total in either layout)."""
    e = num_experts
    n = flat.numel()
    dev = flat.device
    flat = flat.to(torch.int64)
    valid = (flat >= 0) & (flat < e)
    key = torch.where(valid, flat, e)                      # dropped slots sort last
    sorted_key, order = torch.sort(key, stable=True)
    # expert boundaries in the sorted keys: counts without atomics (a histogram of
    # T*k slots into E bins by atomics serialises on the hot bins)
    bounds = torch.searchsorted(sorted_key, torch.arange(e + 2, dtype=torch.int64, device=dev))
    starts, counts_all = bounds[:-1], bounds[1:] - bounds[:-1]
    pos = torch.empty_like(key).scatter_(0, order, torch.arange(n, dtype=torch.int64, device=dev))
    rank = pos - starts[key]                               # slot's place within its expert, token order
    counts = counts_all[:e]
    expert = key.clamp(max=e - 1)
    if capacity is None:
        kept, keep = counts, valid
    else:
        kept, keep = counts.clamp(max=capacity), valid & (rank < capacity)
    if padded:
        dest = expert * capacity + rank
    else:
        offsets = torch.cumsum(kept, 0) - kept
        dest = offsets[expert] + rank
    row_map = torch.where(keep, dest, -1).to(torch.int32)
    dropped = (valid.sum() - kept.sum()).reshape(1)
    return row_map, kept, kept.sum().reshape(1), dropped
