"""Standalone GEMM scale swizzle / unswizzle (formats.md §2.3), single tensor
and grouped, on CPU or GPU.

The swizzle is a fixed permutation of bytes, so it is written with PyTorch
tensor ops (an index computation and one gather/scatter): no host sync, CUDA
graph capturable.  Grouped tensors swizzle each member's padded scale matrix
(MXFP8 columnwise: of the transposed matrix), exactly the layout the
quantize kernels write with ``swizzled_scales=True``.
"""
from __future__ import annotations

import torch

from lpmoe.grouped_layout import cdiv, rup
from lpmoe.grouped_tensor import GroupedTensor, ShapeKind
from lpmoe.quantizers import MXFP8Quantizer, NVFP4Quantizer
from lpmoe.reference.swizzle import swizzle_scales as _swizzle_2d
from lpmoe.reference.swizzle import unswizzle_scales as _unswizzle_2d

__all__ = ["swizzle_scales", "unswizzle_scales"]


def _swz(i, j, n_tiles_x):
    return ((i // 128) * n_tiles_x + j // 4) * 512 + (i % 32) * 16 + ((i % 128) // 32) * 4 + (j % 4)


def _member_maps(g: GroupedTensor, columnwise: bool):
    """Per byte of a grouped scale buffer: (member base, row i, col j, n_tiles_x,
    valid) of the compact matrix it belongs to, as device tensors."""
    q = g.quantizer
    buf = g.columnwise_scale_inv if columnwise else g.scale_inv
    dev = buf.device
    n_bytes = buf.numel()
    p = torch.arange(n_bytes, device=dev, dtype=torch.int64)
    rows, cols = g.logical_shape
    by_elements = g.shape_kind not in (ShapeKind.SAME_SHAPE, ShapeKind.VARYING_FIRST)
    if by_elements:  # MXFP8 varying dims: member t at offsets[t] / 32
        base = g.tensor_offsets // 32
        m = g.first_dims if g.first_dims is not None else torch.full_like(base[:-1], rows)
        k = g.last_dims
        width = k if columnwise else k // 32   # compact (M_t/32, K_t) or (M_t, K_t/32)
        height_tiles = m // 128
    else:
        pr = g.padded_row_offsets
        pad128, pad64 = pr[3], pr[2]
        m_pad = pad128[1:] - pad128[:-1]
        if isinstance(q, MXFP8Quantizer):
            kp, sx = rup(cols, 128), rup(cdiv(cols, 32), 4)
            base = pad128 // 32 * kp if columnwise else pad128 * sx
            width = torch.full_like(m_pad, kp if columnwise else sx)
        else:  # NVFP4
            kp, sx = rup(cols, 128), rup(cols // 16, 4)
            base = kp * (pad64 // 16) if columnwise else pad128 * sx
            width = (pad64[1:] - pad64[:-1]) // 16 if columnwise else torch.full_like(m_pad, sx)
        height_tiles = m_pad // 128
    t = torch.searchsorted(base[1:], p, right=True).clamp_max(g.num_tensors - 1)
    local = p - base[t]
    valid = (p < base[-1]) & (local >= 0)
    w = width[t].clamp_min(1)
    i, j = local // w, local % w
    if isinstance(q, MXFP8Quantizer) and columnwise:
        # compact (mb, k) -> swizzle of the transposed (k, mb) matrix
        dst = _swz(j, i, height_tiles[t])
    else:
        dst = _swz(i, j, w // 4)
    return base[t] + dst, valid


def _grouped(g: GroupedTensor, to_swizzled: bool) -> GroupedTensor:
    q = g.quantizer
    if not isinstance(q, (MXFP8Quantizer, NVFP4Quantizer)):
        raise TypeError("swizzle_scales applies to MXFP8 and NVFP4 grouped tensors")
    if g.with_gemm_swizzled_scales == to_swizzled:
        raise ValueError(f"scales are already {'swizzled' if to_swizzled else 'compact'}")
    out = GroupedTensor(num_tensors=g.num_tensors, logical_shape=g.logical_shape, dtype=g.dtype,
                        quantizer=q.copy(swizzled_scales=to_swizzled), rowwise_data=g.rowwise_data,
                        columnwise_data=g.columnwise_data, amax=g.amax, columnwise_amax=g.columnwise_amax,
                        first_dims=g.first_dims, last_dims=g.last_dims, tensor_offsets=g.tensor_offsets,
                        padded_row_offsets=g.padded_row_offsets, with_gemm_swizzled_scales=to_swizzled,
                        _trusted_offsets=True)
    for columnwise, name in ((False, "scale_inv"), (True, "columnwise_scale_inv")):
        buf = getattr(g, name)
        if buf is None:
            continue
        dst, valid = _member_maps(g, columnwise)
        src_pos = torch.arange(buf.numel(), device=buf.device)
        dst = torch.where(valid, dst, src_pos)  # bytes past the members map to themselves
        raw = buf.view(torch.uint8)
        new = raw.clone()
        if to_swizzled:
            new.scatter_(0, dst, raw)
        else:
            new = raw.gather(0, dst)
        setattr(out, name, new.view(buf.dtype))
    return out


def swizzle_scales(s, rows: int = None, cols: int = None):
    """Compact -> GEMM-swizzled scales.

    * a 2-D (R, C) tensor with R % 128 == 0 and C % 4 == 0 -> 1-D swizzled;
    * an MXFP8/NVFP4 GroupedTensor with compact scales -> a GroupedTensor
      sharing the data, with per-member swizzled scales (both directions).
    """
    if isinstance(s, GroupedTensor):
        return _grouped(s, True)
    return _swizzle_2d(s)


def unswizzle_scales(s, rows: int = None, cols: int = None):
    """GEMM-swizzled -> compact: ``unswizzle_scales(flat, rows, cols)`` for
    one matrix, or a GroupedTensor with swizzled scales."""
    if isinstance(s, GroupedTensor):
        return _grouped(s, False)
    if rows is None or cols is None:
        raise ValueError("unswizzle_scales(flat, rows, cols) needs the compact shape")
    return _unswizzle_2d(s, rows, cols)
