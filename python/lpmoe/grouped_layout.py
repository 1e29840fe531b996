"""Where each member of a grouped tensor lives in the flat buffers.

Rule: a grouped buffer is the concatenation, in member order, of each
member's single-tensor buffer (data, scales) as the quantizer describes it,
with one deliberate difference for FP8 block scaling: the transposed
columnwise copy of a member is padded with zero columns to a multiple of 128
tokens, shape (K, round_up(M_t, 128)), so the weight-gradient GEMM can use
whole 128-token K-blocks (see docs/formats-notes.md).

Because every member size is ``round_up(M_t, a) * c`` for an alignment
a in PADDED_ROW_ALIGNS, the base offsets of every buffer follow from the row
prefix sums ``padded_row_offsets[r][t] = sum_{i<t} round_up(M_i, a_r)``,
which the device computes in one launch (lpmoe.grouped_offsets).
"""
from __future__ import annotations

import enum
from typing import Dict, Optional

import torch

from lpmoe.quantizers import Float8BlockQuantizer, MXFP8Quantizer, NVFP4Quantizer, Quantizer

__all__ = ["ShapeKind", "PADDED_ROW_ALIGNS", "member_sizes", "capacity_sizes", "buffer_dtypes", "BUFFERS", "cdiv",
           "rup"]


class ShapeKind(enum.Enum):
    """Which member dims vary (lpmoe.grouped_tensor's module docstring)."""
    SAME_SHAPE = "same_shape"
    VARYING_FIRST = "varying_first"
    VARYING_LAST = "varying_last"
    VARYING_BOTH = "varying_both"


#: alignments of the rows of padded_row_offsets (row index r -> multiple)
PADDED_ROW_ALIGNS = (1, 4, 64, 128, 512)
#: FP8 block columnwise data pads every member to this many tokens
FP8_BLOCK_COLWISE_TOKEN_PAD = 128

BUFFERS = ("rowwise_data", "columnwise_data", "scale_inv", "columnwise_scale_inv", "amax", "columnwise_amax")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def rup(a: int, b: int) -> int:
    return cdiv(a, b) * b


def _prod(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def member_sizes(quantizer: Optional[Quantizer], m: int, k: int) -> Dict[str, int]:
    """Element count of each buffer for one (m, k) member (0 if not produced)."""
    sizes = {b: 0 for b in BUFFERS}
    if quantizer is None:
        sizes["rowwise_data"] = m * k
        return sizes
    q = quantizer
    if q.rowwise:
        sizes["rowwise_data"] = _prod(q.get_data_shape((m, k)))
        sizes["scale_inv"] = _prod(q.get_scale_shape((m, k)))
    if q.columnwise:
        if isinstance(q, Float8BlockQuantizer):
            sizes["columnwise_data"] = k * rup(m, FP8_BLOCK_COLWISE_TOKEN_PAD)
        else:
            sizes["columnwise_data"] = _prod(q.get_data_shape((m, k), columnwise=True))
        sizes["columnwise_scale_inv"] = _prod(q.get_scale_shape((m, k), columnwise=True))
    if isinstance(q, NVFP4Quantizer):
        # amax is kept even for a columnwise-only tensor (dequantize needs it)
        sizes["amax"] = 1
        sizes["columnwise_amax"] = 1 if q.columnwise else 0
    return sizes


def capacity_sizes(quantizer: Optional[Quantizer], num_tensors: int, rows: int, k: int,
                   uniform: bool) -> Dict[str, int]:
    """Buffer sizes that hold any split of ``rows`` rows into ``num_tensors`` members.

    ``uniform``: every member has rows/num_tensors rows (exact sizes).
    Otherwise an upper bound over all splits with sum <= rows: each member can
    add at most (align - 1) padding rows.
    """
    n = num_tensors
    if uniform:
        one = member_sizes(quantizer, rows // n if n else 0, k)
        return {b: v * n for b, v in one.items()}
    sizes = {b: 0 for b in BUFFERS}
    if quantizer is None:
        sizes["rowwise_data"] = rows * k
        return sizes
    q = quantizer
    if isinstance(q, Float8BlockQuantizer):
        bx = cdiv(k, 128)
        tiles = cdiv(rows, 128) + n  # sum of ceil(M_i / 128)
        if q.rowwise:
            sizes["rowwise_data"] = rows * k
            sizes["scale_inv"] = bx * (rows + 3 * n) if q.block_dim == 1 else rup(bx, 4) * tiles
        if q.columnwise:
            sizes["columnwise_data"] = k * (rows + (FP8_BLOCK_COLWISE_TOKEN_PAD - 1) * n)
            sizes["columnwise_scale_inv"] = rup(k, 4) * tiles if q.block_dim == 1 else bx * (tiles + 3 * n)
        return sizes
    if isinstance(q, MXFP8Quantizer):
        padded_rows = rows + 127 * n
        if q.rowwise:
            sizes["rowwise_data"] = rows * k
            sizes["scale_inv"] = padded_rows * rup(cdiv(k, 32), 4)
        if q.columnwise:
            sizes["columnwise_data"] = rows * k
            sizes["columnwise_scale_inv"] = (padded_rows // 32) * rup(k, 128)
        return sizes
    if isinstance(q, NVFP4Quantizer):
        padded_rows = rows + 127 * n
        if q.rowwise:
            sizes["rowwise_data"] = rows * k // 2
            sizes["scale_inv"] = padded_rows * rup(k // 16, 4)
        if q.columnwise:
            sizes["columnwise_data"] = rows * k // 2
            sizes["columnwise_scale_inv"] = rup(k, 128) * (rup(rows // 16, 4) + 4 * n)
            sizes["columnwise_amax"] = n
        sizes["amax"] = n
        return sizes
    raise TypeError(f"unsupported quantizer {type(q).__name__}")


def output_buffer(numel: int, dtype, device) -> torch.Tensor:
    """A flat output buffer.  On the GPU uninitialised (kernels write what
    the layout defines, padding and capacity tails stay untouched); on the
    CPU zero-filled, so reference results -- padding included -- are
    deterministic (what opcheck compares between eager and traced runs)."""
    dev = torch.device(device)
    return (torch.zeros if dev.type == "cpu" else torch.empty)(numel, dtype=dtype, device=dev)


def buffer_dtypes(quantizer: Optional[Quantizer], dtype: torch.dtype) -> dict:
    """Element type of each buffer a group of ``quantizer`` (None: high
    precision in ``dtype``) holds."""
    if quantizer is None:
        return {b: dtype for b in BUFFERS}
    if isinstance(quantizer, Float8BlockQuantizer):
        d, s = quantizer.fp8_dtype, torch.float32
    elif isinstance(quantizer, MXFP8Quantizer):
        d, s = quantizer.fp8_dtype, torch.uint8
    elif isinstance(quantizer, NVFP4Quantizer):
        d, s = torch.uint8, torch.float8_e4m3fn
    else:
        raise TypeError(f"unsupported quantizer {type(quantizer).__name__}")
    return {"rowwise_data": d, "columnwise_data": d, "scale_inv": s, "columnwise_scale_inv": s,
            "amax": torch.float32, "columnwise_amax": torch.float32}
