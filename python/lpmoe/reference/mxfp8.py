"""MXFP8 reference (1x32 rowwise / 32x1 columnwise blocks, E8M0 scales), formats.md §2.1-2.4.

Layouts (§2.2):
  * rowwise and columnwise data are both (M, K) row-major (columnwise is NOT transposed).
  * compact scales (uint8 E8M0):
      rowwise  (roundup(M,128), roundup(ceil(K/32),4))   block (m, kb) at [m, kb]
      colwise  (roundup(ceil(M/32),4), roundup(K,128))   block (mb, k) at [mb, k]
    Every padding byte is 0 (lpmoe policy, matching TE's grouped kernel / swizzled output).
  * swizzled scales (1-D): rowwise = swizzle(compact rowwise); columnwise =
    swizzle(compact colwise TRANSPOSED), i.e. of the (roundup(K,128), roundup(ceil(M/32),4)) matrix.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from .numerics import (
    FP8_MAX,
    cast_to_fp8_satfinite,
    ceil_div,
    check_float_matrix,
    check_fp8_dtype,
    exp2f,
    exp2f_rcp,
    float_to_e8m0,
    fp32_rcp_of,
    nan_to_zero_abs,
    round_up,
    zero_pad_2d,
)
from .swizzle import swizzle_scales, unswizzle_scales

__all__ = ["MX_BLOCK", "MXFP8Quantized", "mxfp8_scale_shape", "quantize_mxfp8", "dequantize_mxfp8"]

MX_BLOCK = 32
_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class MXFP8Quantized:
    data: Optional[torch.Tensor]                  # (M, K) fp8, or None
    scale_inv: Optional[torch.Tensor]             # uint8 E8M0, compact 2-D or swizzled 1-D
    columnwise_data: Optional[torch.Tensor]       # (M, K) fp8 (NOT transposed), or None
    columnwise_scale_inv: Optional[torch.Tensor]  # uint8 E8M0, compact 2-D or swizzled 1-D
    fp8_dtype: torch.dtype
    with_gemm_swizzled_scales: bool


def mxfp8_scale_shape(M: int, K: int, columnwise: bool) -> Tuple[int, int]:
    """Compact (un-swizzled) E8M0 scale shape for an (M, K) input (§2.2)."""
    if M < 0 or K < 0:
        raise ValueError(f"M and K must be non-negative, got M={M}, K={K}")
    if columnwise:
        return round_up(ceil_div(M, MX_BLOCK), 4), round_up(K, 128)
    return round_up(M, 128), round_up(ceil_div(K, MX_BLOCK), 4)


def _quantize_rows_1x32(xf: torch.Tensor, fp8_dtype: torch.dtype):
    """Quantize each row of fp32 (R, L) in 1x32 blocks -> (q (R, L), e8m0 (R, nb))."""
    rows, length = xf.shape
    nb = ceil_div(length, MX_BLOCK)
    # Partial tail block is zero-filled (TMA), so only valid elements count (§2.1).
    xb = zero_pad_2d(xf, rows, nb * MX_BLOCK).view(rows, nb, MX_BLOCK)
    amax = nan_to_zero_abs(xb).amax(dim=-1)
    # e = ceil-pow2 of fl(amax * fl(1/max)): multiply by the fp32 reciprocal (§2.1, §9.1).
    rcp = torch.full_like(amax, fp32_rcp_of(FP8_MAX[fp8_dtype]))
    e = float_to_e8m0(amax * rcp)
    q = cast_to_fp8_satfinite(xb * exp2f_rcp(e).unsqueeze(-1), fp8_dtype)
    return q.view(rows, nb * MX_BLOCK)[:, :length].contiguous(), e


def quantize_mxfp8(x: torch.Tensor, fp8_dtype: torch.dtype = torch.float8_e4m3fn,
                   rowwise: bool = True, columnwise: bool = True,
                   swizzled: bool = False) -> MXFP8Quantized:
    """Quantize a 2-D (M, K) fp32/bf16/fp16 tensor to MXFP8 (§2.1-2.3)."""
    check_float_matrix(x, "x")
    check_fp8_dtype(fp8_dtype)
    if not (rowwise or columnwise):
        raise ValueError("at least one of rowwise / columnwise must be True")
    M, K = x.shape
    xf = x.float()
    out = MXFP8Quantized(None, None, None, None, fp8_dtype, bool(swizzled))
    if rowwise:
        q, e = _quantize_rows_1x32(xf, fp8_dtype)                    # e: (M, ceil(K/32))
        s = zero_pad_2d(e, *mxfp8_scale_shape(M, K, False))
        out.data = q
        out.scale_inv = swizzle_scales(s) if swizzled else s
    if columnwise:
        q_t, e_t = _quantize_rows_1x32(xf.T, fp8_dtype)              # 32x1 blocks; e_t: (K, ceil(M/32))
        s = zero_pad_2d(e_t.T, *mxfp8_scale_shape(M, K, True))       # compact [mb, k]
        out.columnwise_data = q_t.T.contiguous()                     # stored un-transposed (M, K)
        # GEMM order swizzles the transposed (K-major) matrix (§2.3).
        out.columnwise_scale_inv = swizzle_scales(s.T.contiguous()) if swizzled else s
    return out


def dequantize_mxfp8(q: MXFP8Quantized, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``(float(q) * exp2f(e)).to(out_dtype)`` from rowwise data if present, else columnwise (§2.4)."""
    if out_dtype not in _OUT_DTYPES:
        raise TypeError(f"out_dtype must be float32, bfloat16 or float16, got {out_dtype}")
    use_rowwise = q.data is not None
    data = q.data if use_rowwise else q.columnwise_data
    s = q.scale_inv if use_rowwise else q.columnwise_scale_inv
    if data is None or s is None:
        raise ValueError("q holds neither rowwise (data, scale_inv) nor columnwise data and scales")
    if data.dim() != 2:
        raise ValueError(f"quantized data must be 2-D (M, K), got shape {tuple(data.shape)}")
    M, K = data.shape
    shape = mxfp8_scale_shape(M, K, columnwise=not use_rowwise)
    if q.with_gemm_swizzled_scales:
        if use_rowwise:
            s = unswizzle_scales(s, *shape)
        else:
            s = unswizzle_scales(s, shape[1], shape[0]).T
    elif tuple(s.shape) != shape:
        raise ValueError(f"compact scale tensor has shape {tuple(s.shape)}, expected {shape}")

    if use_rowwise:                                   # [m, kb]
        mult = exp2f(s[:M, : ceil_div(K, MX_BLOCK)]).repeat_interleave(MX_BLOCK, dim=1)[:, :K]
    else:                                             # [mb, k]
        mult = exp2f(s[: ceil_div(M, MX_BLOCK), :K]).repeat_interleave(MX_BLOCK, dim=0)[:M, :]
    return (data.float() * mult).to(out_dtype)
