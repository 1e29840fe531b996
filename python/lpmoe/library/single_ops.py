"""Custom ops of the single-tensor entry points.

``lpmoe::quantize``    one (M, K) tensor -> the format's container fields
``lpmoe::dequantize``  a container back to high precision

Which fields a container holds follows from the quantizer (rowwise /
columnwise; NVFP4 keeps its amax even for a columnwise-only tensor), and
their shapes from the quantizer's shape rules, so the fakes need no kernel.
"""
from __future__ import annotations

from typing import List, Optional

import torch

from lpmoe.library import specs
from lpmoe.library._define import define
from lpmoe.library.routing import OPS
from lpmoe.quantize import dequantize_impl, quantize_impl
from lpmoe.quantizers import Float8BlockQuantizer, MXFP8Quantizer, NVFP4Quantizer, Quantizer
from lpmoe.reference import Fp8BlockQuantized, MXFP8Quantized, NVFP4Quantized

Tensor = torch.Tensor
_FIELDS = ("data", "scale_inv", "columnwise_data", "columnwise_scale_inv", "amax", "columnwise_amax")


def _field_names(nvfp4: bool, rowwise: bool, columnwise: bool) -> List[str]:
    names = (["data", "scale_inv"] if rowwise else []) + \
        (["columnwise_data", "columnwise_scale_inv"] if columnwise else [])
    if nvfp4:
        names += ["amax"] + (["columnwise_amax"] if columnwise else [])
    return [f for f in _FIELDS if f in names]


def _fields(q: Quantizer) -> List[str]:
    return _field_names(isinstance(q, NVFP4Quantizer), q.rowwise, q.columnwise)


def _shape(q: Quantizer, name: str, m: int, k: int):
    colwise = name.startswith("columnwise")
    if name.endswith("amax"):
        return (1,)
    if name.endswith("data"):
        if isinstance(q, Float8BlockQuantizer) and colwise:
            return (k, m)  # the single-tensor transposed copy is not token-padded
        return tuple(q.get_data_shape((m, k), columnwise=colwise))
    shape = tuple(q.get_scale_shape((m, k), columnwise=colwise))
    return (-1,) if getattr(q, "swizzled_scales", False) else shape


def _dtype(q: Quantizer, name: str):
    if name.endswith("amax"):
        return torch.float32
    if isinstance(q, Float8BlockQuantizer):
        return q.fp8_dtype if name.endswith("data") else torch.float32
    if isinstance(q, MXFP8Quantizer):
        return q.fp8_dtype if name.endswith("data") else torch.uint8
    return torch.uint8 if name.endswith("data") else torch.float8_e4m3fn


def _quantize_fake(x, quantizer):
    q = specs.decode(quantizer)
    m, k = (int(d) for d in x.shape)  # the format's shape rules take ints (a traced size specializes)
    out = []
    for name in _fields(q):
        shape = _shape(q, name, m, k)
        if shape == (-1,):
            shape = (_numel(q.get_scale_shape((m, k), columnwise=name.startswith("columnwise"))),)
        out.append(torch.empty(shape, dtype=_dtype(q, name), device=x.device))
    return out


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@define("quantize", _quantize_fake)
def _quantize(x: Tensor, quantizer: str) -> List[Tensor]:
    q = specs.decode(quantizer)
    t = quantize_impl(x, q)
    # contiguous like the GPU path's buffers (the CPU reference's transposed
    # FP8 block copy is a transposed view)
    return [getattr(t, f).contiguous() for f in _fields(q)]


def container(q: Quantizer, named: dict):
    """The format's single-tensor container from its fields."""
    if isinstance(q, Float8BlockQuantizer):
        return Fp8BlockQuantized(fp8_dtype=q.fp8_dtype, block_dim=q.block_dim,
                                 **{f: named.get(f) for f in _FIELDS[:4]})
    if isinstance(q, NVFP4Quantizer):
        return NVFP4Quantized(with_gemm_swizzled_scales=q.swizzled_scales, **{f: named.get(f) for f in _FIELDS})
    return MXFP8Quantized(fp8_dtype=q.fp8_dtype, with_gemm_swizzled_scales=q.swizzled_scales,
                          **{f: named.get(f) for f in _FIELDS[:4]})


def quantize(x: Tensor, q: Quantizer):
    """Adapter of lpmoe.quantize through ``lpmoe::quantize``."""
    return container(q, dict(zip(_fields(q), _quantize(x, specs.encode(q)))))


OPS["quantize"] = quantize


def describe(t) -> tuple:
    """A container's static description as op arguments: (format,
    fp8 dtype, block dim, rowwise, columnwise, swizzled scales).  Plain
    values, so traced code builds no Python objects here."""
    row, col = t.data is not None, t.columnwise_data is not None
    if isinstance(t, Fp8BlockQuantized):
        return "fp8_block", t.fp8_dtype, t.block_dim, row, col, False
    if isinstance(t, NVFP4Quantized):
        return "nvfp4", None, 0, row, col, t.with_gemm_swizzled_scales
    return "mxfp8", t.fp8_dtype, 0, row, col, t.with_gemm_swizzled_scales


def quantizer_from(fmt: str, fp8_dtype, block_dim: int, rowwise: bool, columnwise: bool, swizzled: bool) -> Quantizer:
    if fmt == "fp8_block":
        return Float8BlockQuantizer(fp8_dtype=fp8_dtype, block_dim=block_dim, rowwise=rowwise, columnwise=columnwise)
    if fmt == "nvfp4":
        return NVFP4Quantizer(rowwise=rowwise, columnwise=columnwise, swizzled_scales=swizzled)
    return MXFP8Quantizer(fp8_dtype=fp8_dtype, rowwise=rowwise, columnwise=columnwise, swizzled_scales=swizzled)


def quantizer_of(t) -> Quantizer:
    """The quantizer that made a container (directions from its fields)."""
    return quantizer_from(*describe(t))


def _dequantize_fake(tensors, fmt, fp8_dtype, block_dim, rowwise, columnwise, swizzled, dtype):
    q = quantizer_from(fmt, fp8_dtype, block_dim, rowwise, columnwise, swizzled)
    named = dict(zip(_fields(q), tensors))
    if "data" in named:
        m, k = named["data"].shape
        k = k * 2 if isinstance(q, NVFP4Quantizer) else k
    else:
        c = named["columnwise_data"]
        m, k = (c.shape[1], c.shape[0]) if isinstance(q, Float8BlockQuantizer) else tuple(c.shape)
    return torch.empty((m, k), dtype=dtype, device=tensors[0].device)


@define("dequantize", _dequantize_fake)
def _dequantize(tensors: List[Tensor], fmt: str, fp8_dtype: Optional[torch.dtype], block_dim: int, rowwise: bool,
                columnwise: bool, swizzled: bool, dtype: torch.dtype) -> Tensor:
    q = quantizer_from(fmt, fp8_dtype, block_dim, rowwise, columnwise, swizzled)
    return dequantize_impl(container(q, dict(zip(_fields(q), tensors))), dtype)


def dequantize(t, dtype: torch.dtype) -> Tensor:
    """Adapter of lpmoe.dequantize through ``lpmoe::dequantize``."""
    d = describe(t)
    names = _field_names(d[0] == "nvfp4", d[3], d[4])
    return _dequantize([getattr(t, f) for f in names], *d, dtype)


OPS["dequantize"] = dequantize
