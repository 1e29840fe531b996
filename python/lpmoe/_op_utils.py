"""Helpers shared by the per-format GPU paths (fp8_block_ops, mx_ops) and the
CPU reference path of lpmoe.quantize."""
from __future__ import annotations

from typing import Optional

import torch

from lpmoe.grouped_layout import cdiv
from lpmoe.grouped_tensor import GroupedTensor, ShapeKind


def check_noop(noop_flag: Optional[torch.Tensor], device: torch.device) -> None:
    if noop_flag is None:
        return
    if not isinstance(noop_flag, torch.Tensor) or noop_flag.dtype != torch.float32 or noop_flag.numel() != 1:
        raise TypeError("noop_flag must be a float32 tensor with one element")
    if noop_flag.device != device:
        raise ValueError(f"noop_flag must be on {device}, got {noop_flag.device}")


def max_row_tiles(g: GroupedTensor) -> int:
    """Grid bound: 128-row tiles in pad128 space over all members (each
    member of M_t rows owns ceil(M_t/128) tiles)."""
    rows = g.logical_shape[0]
    n = g.num_tensors
    if g.shape_kind is ShapeKind.SAME_SHAPE:
        return n * cdiv(rows // n, 128)
    return row_tiles_bound(rows, n)


def row_tiles_bound(rows: int, n: int) -> int:
    """Grid bound for any split of ``rows`` rows into ``n`` members: each
    member's last tile may be partial, so at most one tile more per member."""
    return cdiv(rows, 128) + n


def adopt_metadata(out: GroupedTensor, g: GroupedTensor) -> None:
    """Point an output GroupedTensor (reused in place) at the input's metadata."""
    out.first_dims, out.last_dims = g.first_dims, g.last_dims
    out.tensor_offsets, out.padded_row_offsets = g.tensor_offsets, g.padded_row_offsets
    out.offsets_status = g.offsets_status
    out.logical_shape, out.num_tensors, out.dtype = g.logical_shape, g.num_tensors, g.dtype
