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
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["RoutingMap", "routing_map"]


@dataclass
class RoutingMap:
    row_map: torch.Tensor            # (T, k) int32: grouped row of slot (t, j), -1 = not routed
    m_splits: torch.Tensor           # (E,) int64 on the device: rows kept per expert
    num_rows: int                    # rows of the grouped buffer (static)
    used_rows: Optional[torch.Tensor]  # device int64 scalar: packed layout's kept total; None = padded
    dropped: torch.Tensor            # device int64 scalar: routed slots dropped by the capacity
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
    e = num_experts
    n = tokens * k
    if n >= 2 ** 31:
        raise ValueError(f"tokens * top_k = {n} slots exceed the int32 row map")
    dev = idx.device
    flat = idx.reshape(-1).to(torch.int64)
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
    if layout == "padded":
        dest = expert * capacity + rank
        num_rows, used = e * capacity, None
    else:
        offsets = torch.cumsum(kept, 0) - kept
        dest = offsets[expert] + rank
        num_rows = n if capacity is None else min(n, e * capacity)
        used = kept.sum().reshape(1)
    row_map = torch.where(keep, dest, -1).to(torch.int32).view(tokens, k)
    dropped = (valid.sum() - kept.sum()).reshape(1)
    return RoutingMap(row_map, kept, num_rows, used, dropped, capacity)
