"""Custom ops of the offsets and quantization entry points.

``lpmoe::splits_to_offsets``    split sizes -> the bulk offsets buffer
``lpmoe::group_quantize``       FP8 block / MXFP8 / NVFP4, optional fused dbias
``lpmoe::group_quantize_into``  the same into a caller's buffers (``output=``,
                                ``noop_flag``): declared as mutating them
``lpmoe::group_dequantize``     any format back to high precision

Ops return only buffers they allocate; the metadata of a grouped result
(dims, offsets) is the input's, re-attached by the adapters below, so no
output aliases an input.
"""
from __future__ import annotations

from typing import List, Optional

import torch

from lpmoe import fp8_block_ops, mx_ops
from lpmoe.quantize import check_output_for, group_dequantize_grouped, group_quantize_grouped
from lpmoe.grouped_layout import BUFFERS
from lpmoe.grouped_offsets import bulk_numel, offsets_bulk
from lpmoe.grouped_tensor import GroupedTensor
from lpmoe.library import specs
from lpmoe.library._define import define
from lpmoe.library.grouped_codec import pack, unpack
from lpmoe.library.routing import OPS
from lpmoe.quantizers import Float8BlockQuantizer, NVFP4Quantizer, Quantizer

__all__ = ["produced_buffers"]

Tensor = torch.Tensor


def produced_buffers(q: Quantizer) -> List[str]:
    """The buffers a grouped quantization in format ``q`` writes, in BUFFERS order."""
    names = []
    if q.rowwise:
        names += ["rowwise_data", "scale_inv"]
    if q.columnwise:
        names += ["columnwise_data", "columnwise_scale_inv"]
    if isinstance(q, NVFP4Quantizer):
        names += ["amax"] + (["columnwise_amax"] if q.columnwise else [])
    return [b for b in BUFFERS if b in names]


def with_buffers(g: GroupedTensor, q: Quantizer, bufs: List[Tensor]) -> GroupedTensor:
    """A quantized group: ``bufs`` (produced_buffers order) with g's metadata."""
    named = dict(zip(produced_buffers(q), bufs))
    return GroupedTensor(num_tensors=g.num_tensors, logical_shape=g.logical_shape, dtype=g.dtype, quantizer=q,
                         first_dims=g.first_dims, last_dims=g.last_dims, tensor_offsets=g.tensor_offsets,
                         padded_row_offsets=g.padded_row_offsets, _trusted_offsets=True,
                         with_gemm_swizzled_scales=bool(getattr(q, "swizzled_scales", False)), **named)


# ------------------------------------------------------------------ offsets
def _offsets_fake(splits, num_splits, uniform_split, strides, aligns, times_second, second, capacity_rows, device):
    return torch.empty(bulk_numel(num_splits, len(strides)), dtype=torch.int64, device=device)


@define("splits_to_offsets", _offsets_fake)
def _splits_to_offsets(splits: Optional[Tensor], num_splits: int, uniform_split: int, strides: List[int],
                       aligns: List[int], times_second: List[bool], second: Optional[Tensor], capacity_rows: int,
                       device: torch.device) -> Tensor:
    return offsets_bulk(splits, num_splits, uniform_split, strides, aligns, times_second, second, capacity_rows,
                        device)


OPS["splits_to_offsets"] = _splits_to_offsets


# ----------------------------------------------------------- group quantize
def _allocated(g: GroupedTensor, q: Quantizer) -> List[Tensor]:
    out = fp8_block_ops.allocate(q, g) if isinstance(q, Float8BlockQuantizer) else mx_ops.allocate(q, g)
    return [getattr(out, n) for n in produced_buffers(q)]


def _group_quantize_fake(x_fields, x_meta, quantizer, noop, with_dbias):
    g, q = unpack(x_fields, x_meta), specs.decode(quantizer)
    dbias = [torch.empty((g.num_tensors, g.logical_shape[1]), dtype=g.dtype, device=g.device)] if with_dbias else []
    return _allocated(g, q) + dbias


@define("group_quantize", _group_quantize_fake)
def _group_quantize(x_fields: List[Optional[Tensor]], x_meta: str, quantizer: str, noop: Optional[Tensor],
                    with_dbias: bool) -> List[Tensor]:
    g, q = unpack(x_fields, x_meta), specs.decode(quantizer)
    out, dbias = group_quantize_grouped(g, q, noop, None, with_dbias)
    return [getattr(out, n) for n in produced_buffers(q)] + ([dbias] if with_dbias else [])


def _group_quantize_into_fake(x_fields, x_meta, quantizer, noop, out):
    return None


@define("group_quantize_into", _group_quantize_into_fake, mutates_args=("out",))
def _group_quantize_into(x_fields: List[Optional[Tensor]], x_meta: str, quantizer: str, noop: Optional[Tensor],
                         out: List[Tensor]) -> None:
    g, q = unpack(x_fields, x_meta), specs.decode(quantizer)
    group_quantize_grouped(g, q, noop, with_buffers(g, q, out), False)


def group_quantize(g: GroupedTensor, q: Quantizer, noop: Optional[Tensor], output: Optional[GroupedTensor],
                   with_dbias: bool):
    """Adapter of :func:`lpmoe.quantize.group_quantize_grouped` (same
    arguments and results) through the ops."""
    fields, meta = pack(g)
    if output is None:
        res = _group_quantize(fields, meta, specs.encode(q), noop, with_dbias)
        dbias = res.pop() if with_dbias else None
        return with_buffers(g, q, res), dbias
    check_output_for(output, q, g)
    if with_dbias:
        raise NotImplementedError("group_quantize_dbias with output= is not available under torch.compile")
    _group_quantize_into(fields, meta, specs.encode(q), noop, [getattr(output, n) for n in produced_buffers(q)])
    return with_buffers(g, q, [getattr(output, n) for n in produced_buffers(q)]), None


OPS["group_quantize"] = group_quantize


# --------------------------------------------------------- group dequantize
def _group_dequantize_fake(fields, meta, dtype):
    g = unpack(fields, meta)
    return torch.empty(g.logical_shape[0] * g.logical_shape[1], dtype=dtype, device=g.device)


@define("group_dequantize", _group_dequantize_fake)
def _group_dequantize(fields: List[Optional[Tensor]], meta: str, dtype: torch.dtype) -> Tensor:
    return group_dequantize_grouped(unpack(fields, meta), dtype).rowwise_data


def group_dequantize(grouped: GroupedTensor, dtype: torch.dtype) -> GroupedTensor:
    fields, meta = pack(grouped)
    out = _group_dequantize(fields, meta, dtype)
    return GroupedTensor(num_tensors=grouped.num_tensors, logical_shape=grouped.logical_shape, dtype=dtype,
                         rowwise_data=out, first_dims=grouped.first_dims, last_dims=grouped.last_dims,
                         tensor_offsets=grouped.tensor_offsets, padded_row_offsets=grouped.padded_row_offsets,
                         _trusted_offsets=True)


OPS["group_dequantize"] = group_dequantize
