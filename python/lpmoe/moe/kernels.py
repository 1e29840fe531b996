"""Row scatter / gather of the MoE token permutation: the CUDA kernels
(csrc/permute) on the GPU, the reference (lpmoe.reference.permute) on CPU.

``CALLS`` counts which path ran, so tests can prove no silent fallback.
Both entry points are graph-safe: sizes come from shapes, the only device
value read is ``zero_from``, and the kernels read it themselves.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from lpmoe._async_inputs import ready
from lpmoe._ext import ext
from lpmoe.library.routing import OPS, tracing
from lpmoe.reference import permute as ref

__all__ = ["scatter", "gather", "row_sources", "CALLS"]

CALLS = {"kernel_scatter": 0, "kernel_gather": 0, "reference_scatter": 0, "reference_gather": 0,
         "kernel_row_sources": 0, "reference_row_sources": 0}

_TYPED = (torch.float32, torch.bfloat16, torch.float16)


def _check_map(row_map: torch.Tensor, tokens: int, scale: Optional[torch.Tensor], device) -> None:
    if row_map.dtype != torch.int32 or row_map.dim() != 2 or row_map.shape[0] != tokens:
        raise ValueError(f"row_map must be an int32 (tokens={tokens}, k) tensor, got {row_map.dtype} "
                         f"{tuple(row_map.shape)}")
    if not 1 <= row_map.shape[1] <= 256:
        raise ValueError(f"row_map must have 1..256 slots per token, got {row_map.shape[1]}")
    if row_map.device != device:
        raise ValueError(f"row_map is on {row_map.device} but the rows are on {device}")
    if scale is not None and (scale.dtype != torch.float32 or scale.shape != row_map.shape
                              or scale.device != device):
        raise ValueError(f"scale must be fp32 shaped like row_map {tuple(row_map.shape)} on {device}, got "
                         f"{scale.dtype} {tuple(scale.shape)} on {scale.device}")


def scatter(src: torch.Tensor, row_map: torch.Tensor, out_rows: int, *, scale: Optional[torch.Tensor] = None,
            zero_from: Optional[torch.Tensor] = None, dot_with: Optional[torch.Tensor] = None
            ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """dst (out_rows, cols) with dst[row_map[t, j]] = scale[t, j] * src[t].

    Rows no slot maps to are 0: with ``zero_from`` (a device int64 scalar)
    the caller promises every row below it is mapped (the packed layout) and
    only rows from it on are zero-filled; without it the whole buffer is
    zeroed first.  ``dot_with`` (shaped like dst) also returns the fp32
    products <src[t], dot_with[row_map[t, j]]> as (tokens, k).  FP8 rows
    (1-byte floats) and other non-float rows move as bytes (no scale, no dot).
    ``row_map`` must not repeat a row."""
    src, row_map, scale, dot_with = ready(src), ready(row_map), ready(scale), ready(dot_with)
    if src.dim() != 2:
        raise ValueError(f"src must be (tokens, cols), got shape {tuple(src.shape)}")
    _check_map(row_map, src.shape[0], scale, src.device)
    raw = src.dtype not in _TYPED
    if raw and (scale is not None or dot_with is not None):
        raise ValueError(f"scale and dot_with need float32/bfloat16/float16 rows, got {src.dtype}")
    if dot_with is not None and (dot_with.shape != (out_rows, src.shape[1]) or dot_with.dtype != src.dtype):
        raise ValueError(f"dot_with must be {src.dtype} ({out_rows}, {src.shape[1]}), got {dot_with.dtype} "
                         f"{tuple(dot_with.shape)}")
    if tracing():
        return OPS["permute_scatter"](src, row_map, out_rows, scale, zero_from, dot_with)
    return scatter_impl(src, row_map, out_rows, scale, zero_from, dot_with)


def scatter_impl(src, row_map, out_rows, scale, zero_from, dot_with):
    if src.device.type != "cuda":
        CALLS["reference_scatter"] += 1
        return ref.scatter(src, row_map, out_rows, scale, dot_with)
    CALLS["kernel_scatter"] += 1
    src = src.contiguous()
    alloc = torch.empty if zero_from is not None else torch.zeros
    dst = alloc((out_rows, src.shape[1]), dtype=src.dtype, device=src.device)
    dot = None
    if dot_with is not None:
        dot = torch.empty(row_map.shape, dtype=torch.float32, device=src.device)
        dot_with = dot_with.contiguous()
    ext().permute_scatter(src, row_map, scale, dst, zero_from, dot_with, dot, src.dtype not in _TYPED)
    return dst, dot


def gather(src: torch.Tensor, row_map: torch.Tensor, *, scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """dst (tokens, cols), dst[t] = sum_j scale[t, j] * src[row_map[t, j]]
    (fp32 sum in slot order; unrouted slots skipped; a token with none is 0)."""
    src, row_map, scale = ready(src), ready(row_map), ready(scale)
    if src.dim() != 2 or src.dtype not in _TYPED:
        raise ValueError(f"src must be a float32/bfloat16/float16 (rows, cols) tensor, got {src.dtype} "
                         f"{tuple(src.shape)}")
    _check_map(row_map, row_map.shape[0], scale, src.device)
    if tracing():
        return OPS["permute_gather"](src, row_map, scale)
    return gather_impl(src, row_map, scale)


def gather_impl(src, row_map, scale):
    if src.device.type != "cuda":
        CALLS["reference_gather"] += 1
        return ref.gather(src, row_map, scale)
    CALLS["kernel_gather"] += 1
    src = src.contiguous()
    dst = torch.empty((row_map.shape[0], src.shape[1]), dtype=src.dtype, device=src.device)
    ext().permute_gather(src, row_map, scale, dst)
    return dst


def row_sources(row_map: torch.Tensor, num_rows: int) -> torch.Tensor:
    """(num_rows,) int32: the token whose slot row_map sends to each row, -1
    for rows no slot names (the inverse map; ``row_map`` must not repeat a
    row)."""
    row_map = ready(row_map)
    _check_map(row_map, row_map.shape[0], None, row_map.device)
    if isinstance(num_rows, bool) or not isinstance(num_rows, (int, torch.SymInt)) or num_rows < 0:
        raise ValueError(f"num_rows must be a non-negative int, got {num_rows!r}")
    if tracing():
        return OPS["permute_row_sources"](row_map, num_rows)
    return row_sources_impl(row_map, num_rows)


def row_sources_impl(row_map, num_rows):
    if row_map.device.type != "cuda":
        CALLS["reference_row_sources"] += 1
        return ref.row_sources(row_map, num_rows)
    CALLS["kernel_row_sources"] += 1
    out = torch.empty(num_rows, dtype=torch.int32, device=row_map.device)
    ext().permute_row_sources(row_map.contiguous(), out)
    return out
