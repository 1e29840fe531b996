"""How grouped token rows reach the experts that own them.

A dispatcher takes the rows of every routed slot grouped by *global*
expert (the output of lpmoe.moe.permute_rows, with their probabilities)
and returns the rows of the *local* experts, grouped for GroupedMLP; its
``combine`` takes the experts' outputs back to the caller's grouped rows.

* :class:`LocalDispatch`: one process owns every expert; nothing moves.
* :class:`HostSplitAllToAll`: expert parallelism with exact routing.  The
  per-expert counts are exchanged on the device, then read on the host (one
  sync) to size a variable-split ``all_to_all_single``; no slot is dropped.
* :class:`CapacityAllToAll`: graph-safe expert parallelism.  Every rank
  sends a fixed ``capacity`` rows per expert (the padded layout, overflow
  dropped and counted by the routing map), so every split is static: no
  host sync, capturable in CUDA graphs.  Received rows are compacted on the
  device (lpmoe.moe.permute_rows with a map built from the received
  counts).

Both expert-parallel dispatchers use torch.distributed's functional
all-to-all with autograd (the backward is the reverse exchange), and can
send FP8 rows (``fp8=True``: 1x128-block E4M3 data + fp32 scales, about half
of bf16's bytes); the gradient travels back in the rows' dtype.  Rank r owns
global experts [r*E_l, (r+1)*E_l).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List

import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as funcol

from lpmoe.moe.permute import permute_probs, permute_rows, unpermute
from lpmoe.moe.routing_map import RoutingMap
from lpmoe.moe.wire import all_to_all, exchange

__all__ = ["Dispatched", "LocalDispatch", "HostSplitAllToAll", "CapacityAllToAll"]


@dataclass
class Dispatched:
    x: torch.Tensor            # rows of the local experts, grouped
    m_splits: object           # tokens per local expert: device tensor or host list
    probs: torch.Tensor        # (rows,) fp32
    state: object = None       # what combine needs


class LocalDispatch:
    """Every expert is local: the grouped rows go straight to the experts."""

    layout = "packed"

    def dispatch(self, x_g: torch.Tensor, p_g: torch.Tensor, rmap: RoutingMap) -> Dispatched:
        return Dispatched(x_g, rmap.m_splits, p_g)

    def combine(self, y: torch.Tensor, d: Dispatched) -> torch.Tensor:
        return y


class _ExpertParallel:
    def __init__(self, group, num_experts: int, fp8: bool = False):
        self.group = group
        self.world = dist.get_world_size(group)
        if num_experts % self.world:
            raise ValueError(f"num_experts ({num_experts}) must be divisible by the expert-parallel group "
                             f"size ({self.world})")
        self.num_experts = num_experts
        self.local = num_experts // self.world
        self.fp8 = fp8

    def _counts_from_peers(self, counts: torch.Tensor) -> torch.Tensor:
        """(E,) slots this rank sends to each global expert -> (W, E_l) slots
        each rank sends to this rank's experts (device, equal splits)."""
        return funcol.all_to_all_single(counts, None, None, self.group).view(self.world, self.local)


class HostSplitAllToAll(_ExpertParallel):
    """Exact expert parallelism: variable splits read on the host (one sync per step)."""

    layout = "packed"

    def dispatch(self, x_g: torch.Tensor, p_g: torch.Tensor, rmap: RoutingMap) -> Dispatched:
        w, el = self.world, self.local
        recv = self._counts_from_peers(rmap.m_splits)
        host = torch.cat([rmap.m_splits, recv.reshape(-1)]).tolist()  # the path's one host sync
        sent, got = host[:self.num_experts], host[self.num_experts:]
        send_splits = [sum(sent[r * el:(r + 1) * el]) for r in range(w)]
        recv_splits = [sum(got[s * el:(s + 1) * el]) for s in range(w)]
        used = sum(send_splits)
        x_r = exchange(x_g[:used], recv_splits, send_splits, self.group, self.fp8)
        p_r = all_to_all(p_g[:used], recv_splits, send_splits, self.group)
        # received as [source rank][local expert]; the experts want [local expert][source rank]
        order = [s * el + e for e in range(el) for s in range(w)]
        x_e = _reorder(x_r, got, order)
        p_e = _reorder(p_r, got, order)
        m = [sum(got[s * el + e] for s in range(w)) for e in range(el)]
        return Dispatched(x_e, m, p_e, (got, order, send_splits, recv_splits))

    def combine(self, y: torch.Tensor, d: Dispatched) -> torch.Tensor:
        got, order, send_splits, recv_splits = d.state
        back = [0] * len(order)
        for pos, chunk in enumerate(order):
            back[chunk] = pos
        y_r = _reorder(y, [got[c] for c in order], back)
        return all_to_all(y_r, send_splits, recv_splits, self.group)


def _reorder(x: torch.Tensor, sizes: List[int], order: List[int]) -> torch.Tensor:
    """Chunks of ``x`` (sizes along dim 0) concatenated in ``order``."""
    chunks = x.split(sizes)
    return torch.cat([chunks[i] for i in order]) if chunks else x


class CapacityAllToAll(_ExpertParallel):
    """Graph-safe expert parallelism: ``capacity`` rows per (rank, expert),
    equal splits, counts exchanged and compaction done on the device."""

    layout = "padded"

    def __init__(self, group, num_experts: int, capacity: int, fp8: bool = False):
        super().__init__(group, num_experts, fp8)
        self.capacity = capacity

    def dispatch(self, x_g: torch.Tensor, p_g: torch.Tensor, rmap: RoutingMap) -> Dispatched:
        recv = self._counts_from_peers(rmap.m_splits)                       # (W, E_l)
        x_r = exchange(x_g, None, None, self.group, self.fp8)               # (W*E_l*C, H): [src][expert][slot]
        p_r = all_to_all(p_g, None, None, self.group)
        cmap = compaction_map(recv, self.capacity)
        x_e = permute_rows(x_r, cmap)
        p_e = permute_probs(p_r.view(-1, 1), cmap)
        return Dispatched(x_e, cmap.m_splits, p_e, cmap)

    def combine(self, y: torch.Tensor, d: Dispatched) -> torch.Tensor:
        y_r = unpermute(y, d.state)                                         # back to [src][expert][slot]
        return all_to_all(y_r, None, None, self.group)


def compaction_map(recv: torch.Tensor, capacity: int) -> RoutingMap:
    """Map of received padded rows [source][expert][slot] (slot < count
    valid) onto rows grouped by local expert, sources in rank order."""
    w, el = recv.shape
    slot = torch.arange(capacity, device=recv.device)
    per_expert = recv.sum(0)                                               # (E_l,)
    first = torch.cumsum(per_expert, 0) - per_expert                       # expert's first row
    before = torch.cumsum(recv, 0) - recv                                  # rows from lower ranks
    dest = first.view(1, el, 1) + before.view(w, el, 1) + slot.view(1, 1, capacity)
    valid = slot.view(1, 1, capacity) < recv.view(w, el, 1)
    row_map = torch.where(valid, dest, -1).to(torch.int32).view(-1, 1)
    zero = torch.zeros(1, dtype=torch.int64, device=recv.device)
    return RoutingMap(row_map, per_expert, w * el * capacity, per_expert.sum().reshape(1), zero)
