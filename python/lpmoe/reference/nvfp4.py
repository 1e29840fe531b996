"""NVFP4 reference (E2M1 data, 1x16 E4M3 block scales, fp32 global amax), formats.md §3.1-3.3, §8.

Layouts (§3.1):
  * rowwise data: uint8 (M, K/2), element (m, k) in byte [m, k//2], low nibble if k is even.
  * columnwise data: the quantization of x.T, i.e. uint8 (K, M/2) (transposed, packed along M).
  * scales: float8_e4m3fn, compact rowwise (roundup(M,128), roundup(K/16,4)), columnwise
    (roundup(K,128), roundup(M/16,4)) = the rowwise shape of x.T; padding entries are 0.
    Swizzled: the rowwise-style swizzle of either compact matrix (§2.3).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch

from .numerics import (
    FLT_MAX,
    cast_to_fp8_satfinite,
    check_float_matrix,
    e2m1_decode,
    e2m1_encode,
    fp32_div,
    nan_ignoring_amax,
    nan_to_zero_abs,
    pack_e2m1,
    round_up,
    unpack_e2m1,
    zero_pad_2d,
)
from .swizzle import swizzle_scales, unswizzle_scales

__all__ = ["NVFP4_BLOCK", "NVFP4Quantized", "nvfp4_scale_shape", "nvfp4_global_encode_scale",
           "quantize_nvfp4", "dequantize_nvfp4"]

NVFP4_BLOCK = 16
_E4M3 = torch.float8_e4m3fn
_FP4_X_E4M3_MAX = 2688.0  # fl(6 * 448), exact
_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class NVFP4Quantized:
    data: Optional[torch.Tensor]                  # uint8 (M, K/2), or None
    scale_inv: Optional[torch.Tensor]             # float8_e4m3fn, compact 2-D or swizzled 1-D
    amax: Optional[torch.Tensor]                  # fp32 (1,) global amax (rowwise)
    columnwise_data: Optional[torch.Tensor]       # uint8 (K, M/2), or None
    columnwise_scale_inv: Optional[torch.Tensor]  # float8_e4m3fn, compact 2-D or swizzled 1-D
    columnwise_amax: Optional[torch.Tensor]       # fp32 (1,), same value as amax
    with_gemm_swizzled_scales: bool


def _check_dims(M: int, K: int) -> None:
    if M < 0 or K < 0 or M % NVFP4_BLOCK or K % NVFP4_BLOCK:
        raise ValueError(f"NVFP4 needs M and K to be non-negative multiples of 16, got M={M}, K={K}")


def nvfp4_scale_shape(M: int, K: int, columnwise: bool) -> Tuple[int, int]:
    """Compact E4M3 scale shape for an (M, K) input (§3.1)."""
    _check_dims(M, K)
    if columnwise:
        M, K = K, M
    return round_up(M, 128), round_up(K // NVFP4_BLOCK, 4)


def _f32(value: float, like: torch.Tensor) -> torch.Tensor:
    return torch.full(like.shape, value, dtype=torch.float32, device=like.device)


def nvfp4_global_encode_scale(amax: torch.Tensor) -> torch.Tensor:
    """S_enc = fl(2688 / amax), capped at FLT_MAX; 1 when amax == 0 or S_enc == 0 (§3.2)."""
    s_enc = fp32_div(_f32(_FP4_X_E4M3_MAX, amax), amax)
    s_enc = torch.fmin(s_enc, _f32(FLT_MAX, s_enc))          # C fminf: a NaN operand loses
    one = _f32(1.0, s_enc)
    return torch.where((amax == 0) | (s_enc == 0), one, s_enc)


def _quantize_rows(xf: torch.Tensor, amax: torch.Tensor):
    """Quantize fp32 (R, L) in 1x16 blocks with global amax -> (packed (R, L/2), sf (R, L/16))."""
    rows, length = xf.shape
    xb = xf.reshape(rows, length // NVFP4_BLOCK, NVFP4_BLOCK)
    s_enc = nvfp4_global_encode_scale(amax)                   # (1,)
    s_dec = fp32_div(_f32(1.0, s_enc), s_enc)
    # Association matters (§3.2, §9.7): bamax * fl(S_enc * fl(1/6)).
    rcp6 = fp32_div(_f32(1.0, s_enc), _f32(6.0, s_enc))       # 0x3E2AAAAB
    mult = s_enc * rcp6
    bamax = nan_to_zero_abs(xb).amax(dim=-1)                  # (R, L/16)
    y = bamax * mult
    sf = cast_to_fp8_satfinite(torch.fmin(y, _f32(FLT_MAX, y)), _E4M3)
    # enc_b is rebuilt from the *quantized* scale; sf == 0 gives 1/0 = inf -> FLT_MAX
    # (the scale-underflow trap: nonzero x then saturate to ±6 but dequantize to 0).
    den = sf.float() * s_dec
    enc = fp32_div(_f32(1.0, den), den)
    enc = torch.fmin(enc, _f32(FLT_MAX, enc))
    codes = e2m1_encode(xb * enc.unsqueeze(-1)).reshape(rows, length)
    return pack_e2m1(codes), sf


def quantize_nvfp4(x: torch.Tensor, rowwise: bool = True, columnwise: bool = True,
                   swizzled: bool = False,
                   amax: Optional[Union[torch.Tensor, float]] = None) -> NVFP4Quantized:
    """Quantize a 2-D (M, K) fp32/bf16/fp16 tensor to NVFP4 (§3.1-3.2, default RN path).

    ``amax`` is the global (per-tensor) amax; computed NaN-ignoring from x when None.
    """
    check_float_matrix(x, "x")
    M, K = x.shape
    _check_dims(M, K)
    if not (rowwise or columnwise):
        raise ValueError("at least one of rowwise / columnwise must be True")
    xf = x.float()
    if amax is None:
        amax_t = nan_ignoring_amax(xf)
    else:
        amax_t = torch.as_tensor(amax, dtype=torch.float32, device=x.device).reshape(-1).clone()
        if amax_t.numel() != 1:
            raise ValueError(f"amax must be a single value (shape (1,)), got {amax_t.numel()} values")
        if bool((amax_t < 0).any()):
            raise ValueError(f"amax must be >= 0, got {amax_t.item()}")
    out = NVFP4Quantized(None, None, amax_t, None, None, None, bool(swizzled))

    def finish(sf: torch.Tensor, shape: Tuple[int, int]) -> torch.Tensor:
        s = zero_pad_2d(sf, *shape)
        return swizzle_scales(s) if swizzled else s

    if rowwise:
        out.data, sf = _quantize_rows(xf, amax_t)
        out.scale_inv = finish(sf, nvfp4_scale_shape(M, K, False))
    if columnwise:
        # No RHT in this reference: the columnwise amax is the same global amax.
        out.columnwise_data, sf_t = _quantize_rows(xf.T, amax_t)
        out.columnwise_scale_inv = finish(sf_t, nvfp4_scale_shape(M, K, True))
        out.columnwise_amax = amax_t.clone()
    return out


def dequantize_nvfp4(q: NVFP4Quantized, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rowwise dequantize (§3.3): y = (e2m1 * fl(fl(sf * amax) * fl(1/2688))).to(out_dtype)."""
    if out_dtype not in _OUT_DTYPES:
        raise TypeError(f"out_dtype must be float32, bfloat16 or float16, got {out_dtype}")
    if q.data is None or q.scale_inv is None or q.amax is None:
        raise ValueError("dequantize_nvfp4 needs rowwise data, scale_inv and amax "
                         "(columnwise-only NVFP4 cannot be dequantized)")
    if q.data.dtype != torch.uint8 or q.data.dim() != 2:
        raise ValueError(f"q.data must be 2-D uint8 (M, K/2), got {q.data.dtype} {tuple(q.data.shape)}")
    M, K = q.data.shape[0], q.data.shape[1] * 2
    shape = nvfp4_scale_shape(M, K, False)
    s = q.scale_inv
    if q.with_gemm_swizzled_scales:
        s = unswizzle_scales(s, *shape)
    elif tuple(s.shape) != shape:
        raise ValueError(f"compact scale tensor has shape {tuple(s.shape)}, expected {shape}")
    sf = s[:M, : K // NVFP4_BLOCK].float()
    amax = q.amax.float().reshape(1, 1)
    rcp = fp32_div(_f32(1.0, amax), _f32(_FP4_X_E4M3_MAX, amax))   # fl(1/2688)
    final = (sf * amax) * rcp                                       # left to right, two roundings
    vals = e2m1_decode(unpack_e2m1(q.data))
    return (vals * final.repeat_interleave(NVFP4_BLOCK, dim=1)).to(out_dtype)
