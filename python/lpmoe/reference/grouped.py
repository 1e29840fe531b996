"""Grouped reference: quantize/dequantize every member of a group with the
single-tensor reference and lay the results out exactly as lpmoe's grouped
buffers (lpmoe.grouped_layout): each buffer is the concatenation of the
members' single-tensor buffers, FP8-block columnwise data padded per member
to (K, round_up(M_t, 128)) with zero tokens.

This is the CPU path of lpmoe.group_quantize / group_dequantize and the
bit-exact target of the GPU kernels.  It reads member sizes on the host.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from lpmoe.grouped_layout import FP8_BLOCK_COLWISE_TOKEN_PAD, member_sizes, rup
from lpmoe.quantizers import Float8BlockQuantizer, MXFP8Quantizer, NVFP4Quantizer, Quantizer

from .fp8_block import Fp8BlockQuantized, dequantize_fp8_block, quantize_fp8_block
from .mxfp8 import MXFP8Quantized, dequantize_mxfp8, quantize_mxfp8
from .nvfp4 import NVFP4Quantized, dequantize_nvfp4, quantize_nvfp4

__all__ = ["quantize_member", "dequantize_member", "group_quantize_into", "group_dequantize_into",
           "pad_fp8_block_columnwise"]


def quantize_member(x: torch.Tensor, q: Quantizer):
    """Single-tensor reference quantization of one (M, K) member."""
    if isinstance(q, Float8BlockQuantizer):
        return quantize_fp8_block(x, q.fp8_dtype, q.block_dim, q.rowwise, q.columnwise, q.pow2_scales,
                                  q.amax_epsilon)
    if isinstance(q, MXFP8Quantizer):
        return quantize_mxfp8(x, q.fp8_dtype, q.rowwise, q.columnwise, q.swizzled_scales)
    if isinstance(q, NVFP4Quantizer):
        return quantize_nvfp4(x, q.rowwise, q.columnwise, q.swizzled_scales)
    raise TypeError(f"unsupported quantizer {type(q).__name__}")


def pad_fp8_block_columnwise(col: torch.Tensor, m: int) -> torch.Tensor:
    """(K, M) transposed FP8 data -> (K, round_up(M,128)) with zero tokens."""
    k = col.shape[0]
    out = torch.zeros((k, rup(m, FP8_BLOCK_COLWISE_TOKEN_PAD)), dtype=torch.uint8, device=col.device)
    out[:, :m] = col.view(torch.uint8)
    return out.view(col.dtype)


def _member_buffers(res, q: Quantizer, m: int) -> dict:
    bufs = {"rowwise_data": res.data, "scale_inv": res.scale_inv,
            "columnwise_data": res.columnwise_data, "columnwise_scale_inv": res.columnwise_scale_inv}
    if isinstance(q, Float8BlockQuantizer) and res.columnwise_data is not None:
        bufs["columnwise_data"] = pad_fp8_block_columnwise(res.columnwise_data, m)
    if isinstance(q, NVFP4Quantizer):
        bufs["amax"] = res.amax if res.amax is not None else res.columnwise_amax
        bufs["columnwise_amax"] = res.columnwise_amax if q.columnwise else None
    return bufs


def group_quantize_into(members, quantizer: Quantizer, out: dict) -> None:
    """Quantize ``members`` (list of (M_t, K_t) tensors) into the flat
    buffers of ``out`` (name -> 1-D tensor) at concatenated offsets.
    Untouched: everything past the last member (capacity tail)."""
    base = {}
    for x in members:
        m, k = x.shape
        sizes = member_sizes(quantizer, m, k)
        res = quantize_member(x, quantizer) if x.numel() else None
        bufs = _member_buffers(res, quantizer, m) if res is not None else {}
        for name, size in sizes.items():
            off = base.get(name, 0)
            if size:
                src = bufs.get(name)
                dst = out[name]
                if src is None:  # empty member with padded layout: scale padding stays 0
                    dst.view(torch.uint8)[off * dst.element_size():(off + size) * dst.element_size()] = 0
                else:
                    flat = src.reshape(-1)
                    assert flat.numel() == size, (name, flat.numel(), size)
                    dst[off:off + size].view(torch.uint8).copy_(flat.view(torch.uint8).to(dst.device))
            base[name] = off + size


def dequantize_member(view: dict, q: Quantizer, out_dtype: torch.dtype, columnwise: bool) -> torch.Tensor:
    """Dequantize one member's views (as returned by GroupedTensor.split())."""
    m, k = view["shape"]
    if m * k == 0:
        return torch.empty((m, k), dtype=out_dtype)
    if isinstance(q, Float8BlockQuantizer):
        col = view["columnwise_data"]
        r = Fp8BlockQuantized(
            data=None if columnwise else view["rowwise_data"],
            scale_inv=None if columnwise else view["scale_inv"],
            columnwise_data=col[:, :m] if columnwise else None,
            columnwise_scale_inv=view["columnwise_scale_inv"] if columnwise else None,
            fp8_dtype=q.fp8_dtype, block_dim=q.block_dim)
        return dequantize_fp8_block(r, out_dtype, M=m, K=k)
    if isinstance(q, MXFP8Quantizer):
        r = MXFP8Quantized(
            data=None if columnwise else view["rowwise_data"],
            scale_inv=None if columnwise else view["scale_inv"],
            columnwise_data=view["columnwise_data"] if columnwise else None,
            columnwise_scale_inv=view["columnwise_scale_inv"] if columnwise else None,
            fp8_dtype=q.fp8_dtype, with_gemm_swizzled_scales=q.swizzled_scales)
        return dequantize_mxfp8(r, out_dtype)
    if isinstance(q, NVFP4Quantizer):
        if columnwise:
            raise ValueError("NVFP4 dequantize needs the rowwise copy")
        r = NVFP4Quantized(data=view["rowwise_data"], scale_inv=view["scale_inv"], amax=view["amax"],
                           columnwise_data=None, columnwise_scale_inv=None, columnwise_amax=None,
                           with_gemm_swizzled_scales=q.swizzled_scales)
        return dequantize_nvfp4(r, out_dtype)
    raise TypeError(f"unsupported quantizer {type(q).__name__}")


def group_dequantize_into(views, q: Quantizer, out_dtype: torch.dtype, columnwise: bool,
                          out_flat: torch.Tensor) -> None:
    off = 0
    for v in views:
        y = dequantize_member(v, q, out_dtype, columnwise)
        out_flat[off:off + y.numel()] = y.reshape(-1).to(out_flat.device)
        off += y.numel()
