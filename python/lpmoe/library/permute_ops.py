"""Custom ops of the MoE row permutation kernels (lpmoe.moe.kernels).

``lpmoe::permute_scatter``  dst[row_map[t, j]] = scale * src[t] (+ dot products)
``lpmoe::permute_gather``   dst[t] = sum_j scale * src[row_map[t, j]]
"""
from __future__ import annotations

from typing import List, Optional

import torch

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
