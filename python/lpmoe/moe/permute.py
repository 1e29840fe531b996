"""Token permutation for MoE layers, with autograd: tokens to their
experts' rows (``permute``) and expert outputs back to tokens
(``unpermute``), device-only and graph-safe (the routing may change every
replay of a captured graph), deterministic in both directions (each output
element is written by one thread; sums run in slot order).

    x_grouped, m_splits, row_map = lpmoe.moe.permute(x, topk_indices, num_experts)
    y_grouped = experts(x_grouped, m_splits)
    y = lpmoe.moe.unpermute(y_grouped, row_map, probs)       # sum_j probs[t, j] * y_grouped[row]

Dropped slots (index -1, or over an expert's ``capacity``) contribute
nothing; a token with every slot dropped gets 0 (callers with a residual
keep the token's input).  See lpmoe.moe.routing_map for the layouts.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from lpmoe.moe import kernels
from lpmoe.moe.routing_map import RoutingMap, routing_map

__all__ = ["permute", "permute_rows", "unpermute", "permute_probs", "permute_fp8"]


class _PermuteRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, row_map, num_rows, zero_from):
        ctx.save_for_backward(row_map)
        return kernels.scatter(x, row_map, num_rows, zero_from=zero_from)[0]

    @staticmethod
    def backward(ctx, grad):
        (row_map,) = ctx.saved_tensors
        return kernels.gather(grad.contiguous(), row_map), None, None, None


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, row_map, probs, zero_from):
        ctx.want_dprobs = probs is not None and ctx.needs_input_grad[2]
        ctx.num_rows = y.shape[0]
        ctx.save_for_backward(row_map, probs, zero_from, y if ctx.want_dprobs else None)
        return kernels.gather(y, row_map, scale=probs)

    @staticmethod
    def backward(ctx, grad):
        row_map, probs, zero_from, y = ctx.saved_tensors
        dy, dprobs = kernels.scatter(grad.contiguous(), row_map, ctx.num_rows, scale=probs, zero_from=zero_from,
                                     dot_with=y if ctx.want_dprobs else None)
        return dy, None, dprobs, None


def _as_map(row_map: Union[RoutingMap, torch.Tensor]) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    if isinstance(row_map, RoutingMap):
        return row_map.row_map, row_map.used_rows
    if not isinstance(row_map, torch.Tensor):
        raise TypeError(f"row_map must be a RoutingMap or an int32 tensor, got {type(row_map).__name__}")
    return row_map, None


def _check_rows(x: torch.Tensor, name: str) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"{name} must be a (rows, hidden) tensor, got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {x.dtype}")


def permute_rows(x: torch.Tensor, rmap: RoutingMap) -> torch.Tensor:
    """x (T, H) -> (rmap.num_rows, H) grouped by expert (differentiable)."""
    _check_rows(x, "x")
    if x.shape[0] != rmap.row_map.shape[0]:
        raise ValueError(f"x has {x.shape[0]} tokens but the routing map has {rmap.row_map.shape[0]}")
    return _PermuteRows.apply(x, rmap.row_map, rmap.num_rows, rmap.used_rows)


def permute(x: torch.Tensor, topk_indices: torch.Tensor, num_experts: int, capacity: Optional[int] = None
            ) -> Tuple[torch.Tensor, torch.Tensor, RoutingMap]:
    """(x_grouped, m_splits, row_map): x's rows copied to their experts'
    rows (packed layout), tokens per expert on the device, and the map
    :func:`unpermute` takes (a :class:`RoutingMap`; ``.row_map`` is the
    (T, k) int32 tensor)."""
    rmap = routing_map(topk_indices, num_experts, capacity)
    return permute_rows(x, rmap), rmap.m_splits, rmap


def unpermute(y_grouped: torch.Tensor, row_map: Union[RoutingMap, torch.Tensor],
              probs: Optional[torch.Tensor] = None) -> torch.Tensor:
    """y (T, H): y[t] = sum_j probs[t, j] * y_grouped[row_map[t, j]] (fp32
    sum, slot order; probs default 1), differentiable in y_grouped and
    probs.  Given a :class:`RoutingMap` of the packed layout the backward
    zero-fills only the tail rows; given a bare (T, k) tensor it zeroes the
    whole gradient first."""
    _check_rows(y_grouped, "y_grouped")
    rm, used = _as_map(row_map)
    if probs is not None:
        if probs.shape != rm.shape:
            raise ValueError(f"probs must be shaped like the row map {tuple(rm.shape)}, got {tuple(probs.shape)}")
        probs = probs.float().contiguous()
    return _Unpermute.apply(y_grouped, rm, probs, used)


def permute_probs(probs: torch.Tensor, rmap: RoutingMap) -> torch.Tensor:
    """(num_rows,) fp32: each slot's probability at its grouped row (0 on
    unused rows), differentiable; what GroupedMLP's ``probs`` takes."""
    if probs.shape != rmap.row_map.shape:
        raise ValueError(f"probs must be shaped like the row map {tuple(rmap.row_map.shape)}, "
                         f"got {tuple(probs.shape)}")
    # Each slot as a one-column row with a one-slot map: the row scatter (one
    # launch; its backward one gather) instead of five PyTorch ops.
    slots = probs.reshape(-1, 1).float().contiguous()
    return _PermuteRows.apply(slots, rmap.row_map.reshape(-1, 1), rmap.num_rows, rmap.used_rows).view(-1)


def permute_fp8(data: torch.Tensor, scale_inv: torch.Tensor, rmap: RoutingMap) -> Tuple[torch.Tensor, torch.Tensor]:
    """Already-quantized rows (FP8 ``data`` (T, H) with per-row block scales
    ``scale_inv`` (T, S), e.g. 1x128 blocks) moved to their grouped rows as
    bytes: no dequantize/requantize, half the bytes of bf16.  No autograd."""
    for name, t in (("data", data), ("scale_inv", scale_inv)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.shape[0] != rmap.row_map.shape[0]:
            raise ValueError(f"{name} must be ({rmap.row_map.shape[0]}, cols), got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    if data.element_size() != 1:
        raise TypeError(f"data must hold 1-byte FP8 values, got {data.dtype}")
    n = rmap.num_rows
    d, _ = kernels.scatter(data, rmap.row_map, n, zero_from=rmap.used_rows)
    # scales as raw 4-byte words (the typed path would round-trip them through fp32 anyway)
    s, _ = kernels.scatter(scale_inv.contiguous().view(torch.int32), rmap.row_map, n, zero_from=rmap.used_rows)
    return d, s.view(scale_inv.dtype)
