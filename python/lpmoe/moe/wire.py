"""Rows on the wire of the expert-parallel all-to-all, optionally as FP8.

``exchange(x, out_splits, in_splits, group, fp8)`` is
``all_to_all_single`` with autograd (torch.distributed's functional
collectives).  Results are waited on before they are returned: the
functional collectives hand out an ``AsyncCollectiveTensor`` whose data
pointer stays 0 until a PyTorch op waits on it, and the next consumer here
is an lpmoe kernel (see lpmoe._async_inputs).  With ``fp8=True`` the forward sends E4M3 data with one fp32
scale per 1x128 block of each row (lpmoe's FP8 block quantizer, pow2
scales) and the receiver dequantizes to the rows' dtype: (H + H/32) bytes
per row instead of 2H.  The backward sends the gradient in the rows' dtype
unchanged (a straight-through estimator: quantization is treated as the
identity, as DeepSeek-V3's FP8 dispatch does).
"""
from __future__ import annotations

from typing import List, Optional

import torch
from torch.distributed import _functional_collectives as funcol

__all__ = ["all_to_all", "exchange", "quantize_rows", "dequantize_rows"]

_BLOCK = 128


def quantize_rows(x: torch.Tensor):
    """(rows, H) -> (E4M3 data (rows, H), fp32 scale_inv (rows, H/128) row-major)."""
    from lpmoe.quantize import quantize
    from lpmoe.quantizers import Float8BlockQuantizer

    q = quantize(x, Float8BlockQuantizer(block_dim=1, rowwise=True, columnwise=False))
    rows = x.shape[0]
    return q.data, q.scale_inv[:, :rows].t().contiguous()


def dequantize_rows(data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`quantize_rows`: data * scale in fp32, rounded to
    ``dtype``, by lpmoe's FP8 block dequantize: one pass over the rows (the
    PyTorch-op form made fp32 copies of data and scales) after the small
    re-layout of the scales (H/128 floats per row)."""
    from lpmoe.quantize import dequantize
    from lpmoe.reference import Fp8BlockQuantized

    rows = data.shape[0]
    # the quantizer's rowwise scale layout: (H/128, rows rounded up to 4)
    scale = scale_inv.new_empty((scale_inv.shape[1], (rows + 3) // 4 * 4))
    scale[:, :rows] = scale_inv.t()
    scale[:, rows:] = 0
    return dequantize(Fp8BlockQuantized(data=data, scale_inv=scale, columnwise_data=None, columnwise_scale_inv=None,
                                        fp8_dtype=data.dtype, block_dim=1), dtype)


class _Fp8Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.args = (out_splits, in_splits, group)
        data, scale = quantize_rows(x)
        data = funcol.all_to_all_single(data.view(torch.uint8), out_splits, in_splits, group)
        scale = funcol.all_to_all_single(scale, out_splits, in_splits, group)
        return dequantize_rows(funcol.wait_tensor(data).view(torch.float8_e4m3fn), funcol.wait_tensor(scale),
                               x.dtype)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits, group = ctx.args
        g = funcol.all_to_all_single(grad.contiguous(), in_splits, out_splits, group)
        return funcol.wait_tensor(g), None, None, None


def all_to_all(x: torch.Tensor, out_splits: Optional[List[int]], in_splits: Optional[List[int]], group
               ) -> torch.Tensor:
    """``all_to_all_single`` with autograd, waited (a plain tensor)."""
    return funcol.wait_tensor(funcol.all_to_all_single_autograd(x.contiguous(), out_splits, in_splits, group))


def exchange(x: torch.Tensor, out_splits: Optional[List[int]], in_splits: Optional[List[int]], group,
             fp8: bool = False) -> torch.Tensor:
    if not fp8:
        return all_to_all(x, out_splits, in_splits, group)
    if x.shape[1] % _BLOCK:
        raise ValueError(f"FP8 dispatch needs hidden_size % {_BLOCK} == 0, got {x.shape[1]}")
    return _Fp8Exchange.apply(x.contiguous(), out_splits, in_splits, group)
