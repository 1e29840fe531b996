"""FP8 block scaling reference (Float8BlockScaling, 1x128 "1D" and 128x128 "2D"), formats.md §1.

Layouts (GEMM_READY, §1.2-1.3):
  * rowwise data (M, K); columnwise data is stored TRANSPOSED, (K, M).
  * scales are fp32 ``scale_inv`` (= 1/scale), MN-major, the contiguous dim padded to 4:
      1D rowwise  (ceil(K/128), roundup(M,4))            block (m, bx) at [bx, m]
      1D colwise  (ceil(M/128), roundup(K,4))            block (by, k) at [by, k]
      2D rowwise  (ceil(M/128), roundup(ceil(K/128),4))  tile (ty, tx) at [ty, tx]
      2D colwise  (ceil(K/128), roundup(ceil(M/128),4))  tile (ty, tx) at [tx, ty]
  * Padding entries are written as 0.0 (lpmoe policy; TE leaves them unwritten).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from .numerics import (
    cast_to_fp8_satfinite,
    ceil_div,
    check_float_matrix,
    check_fp8_dtype,
    compute_block_scale,
    nan_to_zero_abs,
    round_up,
    zero_pad_2d,
)

__all__ = ["BLOCK", "Fp8BlockQuantized", "block_scale_shape", "quantize_fp8_block",
           "dequantize_fp8_block"]

BLOCK = 128
_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class Fp8BlockQuantized:
    data: Optional[torch.Tensor]                  # (M, K) fp8, or None
    scale_inv: Optional[torch.Tensor]             # fp32, see block_scale_shape(columnwise=False)
    columnwise_data: Optional[torch.Tensor]       # (K, M) fp8 (transposed), or None
    columnwise_scale_inv: Optional[torch.Tensor]  # fp32, see block_scale_shape(columnwise=True)
    fp8_dtype: torch.dtype
    block_dim: int                                # 1 (1x128) or 2 (128x128)


def _check_block_dim(block_dim: int) -> None:
    if block_dim not in (1, 2):
        raise ValueError(f"block_dim must be 1 (1x128 blocks) or 2 (128x128 blocks), got {block_dim}")


def block_scale_shape(M: int, K: int, block_dim: int, columnwise: bool) -> Tuple[int, int]:
    """Shape of the fp32 scale_inv tensor for an (M, K) input (§1.2, §1.3)."""
    _check_block_dim(block_dim)
    if M < 0 or K < 0:
        raise ValueError(f"M and K must be non-negative, got M={M}, K={K}")
    if block_dim == 1:
        return (ceil_div(M, BLOCK), round_up(K, 4)) if columnwise else \
               (ceil_div(K, BLOCK), round_up(M, 4))
    by, bx = ceil_div(M, BLOCK), ceil_div(K, BLOCK)
    return (bx, round_up(by, 4)) if columnwise else (by, round_up(bx, 4))


def _quantize_rows_1x128(xf: torch.Tensor, fp8_dtype, pow2, eps, input_dtype):
    """Quantize each row of fp32 (R, L) in 1x128 blocks -> (q (R, L), scale_inv (R, nb))."""
    rows, length = xf.shape
    nb = ceil_div(length, BLOCK)
    # Partial tail block: zero-fill, zeros never raise the amax (§1.2).
    xb = zero_pad_2d(xf, rows, nb * BLOCK).view(rows, nb, BLOCK)
    amax = nan_to_zero_abs(xb).amax(dim=-1)
    scale, scale_inv = compute_block_scale(amax, fp8_dtype, pow2, eps, input_dtype)
    q = cast_to_fp8_satfinite(xb * scale.unsqueeze(-1), fp8_dtype)  # multiply by scale (§1.1)
    return q.view(rows, nb * BLOCK)[:, :length].contiguous(), scale_inv


def quantize_fp8_block(x: torch.Tensor, fp8_dtype: torch.dtype = torch.float8_e4m3fn,
                       block_dim: int = 1, rowwise: bool = True, columnwise: bool = True,
                       pow2_scales: bool = True, amax_epsilon: float = 0.0) -> Fp8BlockQuantized:
    """Quantize a 2-D (M, K) fp32/bf16/fp16 tensor with FP8 block scaling (§1.1-1.3)."""
    check_float_matrix(x, "x")
    check_fp8_dtype(fp8_dtype)
    _check_block_dim(block_dim)
    if not (rowwise or columnwise):
        raise ValueError("at least one of rowwise / columnwise must be True")
    if amax_epsilon < 0:
        raise ValueError(f"amax_epsilon must be >= 0, got {amax_epsilon}")
    M, K = x.shape
    xf = x.float()
    args = (fp8_dtype, pow2_scales, amax_epsilon, x.dtype)
    out = Fp8BlockQuantized(None, None, None, None, fp8_dtype, block_dim)

    if block_dim == 1:
        if rowwise:
            q, s_inv = _quantize_rows_1x128(xf, *args)               # s_inv: (M, nbK)
            out.data = q
            out.scale_inv = zero_pad_2d(s_inv.T, *block_scale_shape(M, K, 1, False))
        if columnwise:
            q_t, s_inv_t = _quantize_rows_1x128(xf.T, *args)         # 128x1 blocks of x
            out.columnwise_data = q_t                                # (K, M)
            out.columnwise_scale_inv = zero_pad_2d(s_inv_t.T, *block_scale_shape(M, K, 1, True))
        return out

    # 2D: one scale per 128x128 tile; partial edge tiles are zero-filled.
    ty, tx = ceil_div(M, BLOCK), ceil_div(K, BLOCK)
    xt = zero_pad_2d(xf, ty * BLOCK, tx * BLOCK).view(ty, BLOCK, tx, BLOCK)
    amax = nan_to_zero_abs(xt).amax(dim=(1, 3))                      # (ty, tx)
    scale, s_inv = compute_block_scale(amax, *args)
    q = cast_to_fp8_satfinite(xt * scale[:, None, :, None], fp8_dtype)
    q = q.view(ty * BLOCK, tx * BLOCK)[:M, :K]
    if rowwise:
        out.data = q.contiguous()
        out.scale_inv = zero_pad_2d(s_inv, *block_scale_shape(M, K, 2, False))
    if columnwise:
        out.columnwise_data = q.T.contiguous()                       # same scale -> data.T bytewise
        out.columnwise_scale_inv = zero_pad_2d(s_inv.T, *block_scale_shape(M, K, 2, True))
    return out


def _expand(s: torch.Tensor, rep_r: int, rep_c: int, rows: int, cols: int) -> torch.Tensor:
    """Broadcast per-block scales to per-element scales of a (rows, cols) matrix."""
    return s.repeat_interleave(rep_r, dim=0).repeat_interleave(rep_c, dim=1)[:rows, :cols]


def dequantize_fp8_block(q: Fp8BlockQuantized, out_dtype: torch.dtype = torch.float32,
                         M: Optional[int] = None, K: Optional[int] = None) -> torch.Tensor:
    """(M, K) tensor ``(float32(q) * scale_inv).to(out_dtype)`` (§1.4).

    Uses the rowwise copy when present, else the (transposed) columnwise copy.
    ``M`` / ``K`` are optional: they are taken from the data and, when given,
    must agree with it.
    """
    if out_dtype not in _OUT_DTYPES:
        raise TypeError(f"out_dtype must be float32, bfloat16 or float16, got {out_dtype}")
    _check_block_dim(q.block_dim)
    use_rowwise = q.data is not None
    data = q.data if use_rowwise else q.columnwise_data
    s_inv = q.scale_inv if use_rowwise else q.columnwise_scale_inv
    if data is None or s_inv is None:
        raise ValueError("q holds neither rowwise (data, scale_inv) nor columnwise data and scales")
    if data.dim() != 2:
        raise ValueError(f"quantized data must be 2-D, got shape {tuple(data.shape)}")
    dM, dK = data.shape if use_rowwise else data.shape[::-1]
    if (M is not None and M != dM) or (K is not None and K != dK):
        raise ValueError(f"M, K = ({M}, {K}) do not match the quantized data (M={dM}, K={dK})")
    M, K = dM, dK
    expected = block_scale_shape(M, K, q.block_dim, columnwise=not use_rowwise)
    if tuple(s_inv.shape) != expected:
        raise ValueError(f"scale tensor has shape {tuple(s_inv.shape)}, expected {expected}")

    s_inv = s_inv.float()
    nby, nbx = ceil_div(M, BLOCK), ceil_div(K, BLOCK)
    if q.block_dim == 1 and use_rowwise:          # [bx, m] -> (M, nbx) -> per element
        s = _expand(s_inv[:, :M].T, 1, BLOCK, M, K)
    elif q.block_dim == 1:                        # [by, k] -> (K, nby) over the (K, M) data
        s = _expand(s_inv[:, :K].T, 1, BLOCK, K, M)
    elif use_rowwise:                             # [ty, tx]
        s = _expand(s_inv[:, :nbx], BLOCK, BLOCK, M, K)
    else:                                         # [tx, ty] over the (K, M) data
        s = _expand(s_inv[:, :nby], BLOCK, BLOCK, K, M)
    y = data.float() * s                          # one fp32 multiply, one rounding below
    if not use_rowwise:
        y = y.T
    return y.to(out_dtype).contiguous()
