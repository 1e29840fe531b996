"""Reference of the MoE row permutation kernels (csrc/permute), pure PyTorch.

``scatter``: dst[row_map[t, j]] = scale[t, j] * src[t] (fp32 product rounded
to the row dtype), rows no slot maps to are 0; optional dot products
<src[t], dot_with[row_map[t, j]]> in fp32 (0 for unrouted slots).
``gather``: dst[t] = sum_j scale[t, j] * src[row_map[t, j]], an fp32 sum in
j order starting from +0 (multiply, then add: no fused multiply-add), then
rounded to the row dtype.  Unrouted slots (-1, or outside the rows) are
skipped.  ``row_sources``: the inverse map, row -> token (-1 for rows no
slot names).  The GPU kernels give the same bits for scatter and gather; the
dot products agree to fp32 rounding (their summation order is the
kernel's reduction tree).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

__all__ = ["scatter", "gather", "row_sources"]


def _valid(row_map: torch.Tensor, rows: int) -> torch.Tensor:
    return (row_map >= 0) & (row_map < rows)


def scatter(src: torch.Tensor, row_map: torch.Tensor, out_rows: int, scale: Optional[torch.Tensor] = None,
            dot_with: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    tokens, k = row_map.shape
    valid = _valid(row_map, out_rows)
    t_idx = torch.arange(tokens, device=src.device).unsqueeze(1).expand(tokens, k)[valid]
    rows = row_map[valid].long()
    if src.dtype.is_floating_point and src.element_size() == 1:
        work = src.view(torch.uint8)  # FP8 bytes move unchanged
    else:
        work = src
    dst = torch.zeros((out_rows,) + tuple(src.shape[1:]), dtype=work.dtype, device=src.device)
    vals = work[t_idx]
    if scale is not None:
        vals = (vals.float() * scale.float()[valid].unsqueeze(1)).to(src.dtype)
    dst[rows] = vals
    dot = None
    if dot_with is not None:
        dot = torch.zeros((tokens, k), dtype=torch.float32, device=src.device)
        dot[valid] = (src[t_idx].float() * dot_with[rows].float()).sum(1)
    return dst.view(src.dtype) if work is not src else dst, dot


def gather(src: torch.Tensor, row_map: torch.Tensor, scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    tokens, k = row_map.shape
    acc = torch.zeros((tokens,) + tuple(src.shape[1:]), dtype=torch.float32, device=src.device)
    for j in range(k):
        valid = _valid(row_map[:, j], src.shape[0])
        contrib = src[row_map[:, j].long().clamp(0, max(src.shape[0] - 1, 0))].float() if src.shape[0] else acc
        if scale is not None:
            contrib = contrib * scale[:, j].float().unsqueeze(1)
        acc = torch.where(valid.unsqueeze(1), acc + contrib, acc)
    return acc.to(src.dtype)


def row_sources(row_map: torch.Tensor, rows: int) -> torch.Tensor:
    tokens, k = row_map.shape
    valid = _valid(row_map, rows)
    out = torch.full((rows,), -1, dtype=torch.int32, device=row_map.device)
    t_idx = torch.arange(tokens, device=row_map.device).unsqueeze(1).expand(tokens, k)[valid]
    out[row_map[valid].long()] = t_idx.to(torch.int32)
    return out
