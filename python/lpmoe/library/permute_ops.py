"""Custom ops of the MoE row permutation kernels (lpmoe.moe.kernels).

``lpmoe::permute_scatter``  dst[row_map[t, j]] = scale * src[t] (+ dot products)
``lpmoe::permute_gather``   dst[t] = sum_j scale * src[row_map[t, j]]
``lpmoe::permute_row_sources``  the inverse map: row -> token (-1: no slot)
``lpmoe::gather_quantize``  FP8 block quantize of rows read from the tokens
                            through the inverse map (lpmoe.moe.permute_quantize)
"""
from __future__ import annotations

from typing import List, Optional

import torch

from lpmoe import fp8_block_ops
from lpmoe.grouped_tensor import GroupedTensor
from lpmoe.library import specs
from lpmoe.library._define import define
from lpmoe.library.routing import OPS
from lpmoe.moe import kernels

Tensor = torch.Tensor


def _scatter_fake(src, row_map, out_rows, scale, zero_from, dot_with):
    out = [src.new_empty((out_rows, src.shape[1]))]
    if dot_with is not None:
        out.append(torch.empty(row_map.shape, dtype=torch.float32, device=src.device))
    return out


@define("permute_scatter", _scatter_fake)
def _scatter(src: Tensor, row_map: Tensor, out_rows: int, scale: Optional[Tensor], zero_from: Optional[Tensor],
             dot_with: Optional[Tensor]) -> List[Tensor]:
    dst, dot = kernels.scatter_impl(src, row_map, out_rows, scale, zero_from, dot_with)
    return [dst] if dot is None else [dst, dot]


def scatter(src, row_map, out_rows, scale, zero_from, dot_with):
    res = _scatter(src, row_map, out_rows, scale, zero_from, dot_with)
    return res[0], (res[1] if dot_with is not None else None)


OPS["permute_scatter"] = scatter


def _gather_fake(src, row_map, scale):
    return src.new_empty((row_map.shape[0], src.shape[1]))


@define("permute_gather", _gather_fake)
def _gather(src: Tensor, row_map: Tensor, scale: Optional[Tensor]) -> Tensor:
    return kernels.gather_impl(src, row_map, scale)


OPS["permute_gather"] = _gather


def _row_sources_fake(row_map, num_rows):
    return torch.empty(num_rows, dtype=torch.int32, device=row_map.device)


@define("permute_row_sources", _row_sources_fake)
def _row_sources(row_map: Tensor, num_rows: int) -> Tensor:
    return kernels.row_sources_impl(row_map, num_rows)


OPS["permute_row_sources"] = _row_sources


# The kernel reads the members' padded row offsets; the caller's layout
# (lpmoe.fp8_block_ops.gather_layout) carries the rest of the metadata.
# CPU tensors run the reference: the rows made, then quantized.
def _gather_quantize_fake(tokens, row_source, first_dims, padded_row_offsets, quantizer):
    return fp8_block_ops.gather_buffers(tokens, row_source.shape[0], first_dims.numel(), specs.decode(quantizer))


@define("gather_quantize", _gather_quantize_fake)
def _gather_quantize(tokens: Tensor, row_source: Tensor, first_dims: Tensor, padded_row_offsets: Tensor,
                     quantizer: str) -> List[Tensor]:
    q = specs.decode(quantizer)
    if tokens.device.type == "cuda":
        return fp8_block_ops.gather_quantize_impl(tokens, row_source, padded_row_offsets, first_dims.numel(), q)
    from lpmoe.quantize import group_quantize_grouped
    src = row_source.long()
    rows = torch.where((src >= 0).unsqueeze(1), tokens[src.clamp(min=0)], torch.zeros((), dtype=tokens.dtype))
    g = GroupedTensor(num_tensors=first_dims.numel(), logical_shape=tuple(rows.shape), dtype=rows.dtype,
                      rowwise_data=rows.reshape(-1), first_dims=first_dims)
    out, _ = group_quantize_grouped(g, q, None, None, False)
    return [getattr(out, n) for n in fp8_block_ops.produced(q)]


OPS["gather_quantize"] = lambda tokens, row_source, layout, q: _gather_quantize(
    tokens, row_source, layout.first_dims, layout.padded_row_offsets, specs.encode(q))
