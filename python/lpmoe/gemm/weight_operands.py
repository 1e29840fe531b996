"""The FP8 and discrete weights as the GEMM kernels read them: 128x128
weight scales in the layout each GEMM wants (rebuilt from the other copy by a
tiny transpose when only one was produced), and the device address table of
a list of weight tensors."""
from __future__ import annotations

from typing import Dict, Tuple

import torch

from lpmoe._persistent import persistent
from lpmoe.gemm.operands import GemmOperands
from lpmoe.reference.numerics import ceil_div as _cdiv, round_up as _rup

__all__ = ["fp8_weight_operand", "prepare_weight_list", "ptr_table"]

_ptr_tables: Dict[Tuple[int, ...], torch.Tensor] = {}


def _weight_scales(ops: GemmOperands, layout: str) -> Tuple[torch.Tensor, int]:
    """The 128x128 weight scales in the layout a GEMM reads, and elements per
    member.  ``"rowwise"``: (ceil(N/128), round_up(ceil(K/128),4)) per member
    (W's rowwise scale buffer); ``"colwise"``: (ceil(K/128),
    round_up(ceil(N/128),4)) (W's columnwise buffer).  Both hold the same
    numbers; when the wanted buffer was not produced it is rebuilt from the
    other with a tiny transpose (no sync)."""
    w = ops.b_grouped
    g, n, k = ops.num_groups, ops.n, ops.k
    bn, bk = _cdiv(n, 128), _cdiv(k, 128)
    row_member, col_member = bn * _rup(bk, 4), bk * _rup(bn, 4)
    if layout == "rowwise" and w.scale_inv is not None:
        return w.scale_inv, row_member
    if layout == "colwise" and w.columnwise_scale_inv is not None:
        return w.columnwise_scale_inv, col_member
    if layout == "rowwise":
        src = w.columnwise_scale_inv[:g * col_member].view(g, bk, _rup(bn, 4))[:, :, :bn]
        dst = torch.zeros((g, bn, _rup(bk, 4)), dtype=torch.float32, device=ops.device)
        dst[:, :, :bk] = src.transpose(1, 2)
        return dst.view(-1), row_member
    src = w.scale_inv[:g * row_member].view(g, bn, _rup(bk, 4))[:, :, :bk]
    dst = torch.zeros((g, bk, _rup(bn, 4)), dtype=torch.float32, device=ops.device)
    dst[:, :, :bn] = src.transpose(1, 2)
    return dst.view(-1), col_member


def fp8_weight_operand(ops: GemmOperands, scale_layout: str):
    """FP8 weights as a GEMM reads them: (data, elements per member, scales,
    scale elements per member).  fprop reads the rowwise (N, K) copy, dgrad
    the transposed (K, round_up(N,128)) copy; the scale layout is the
    backend's choice (see _weight_scales)."""
    b, n, k = ops.b_grouped, ops.n, ops.k
    if ops.kind == "fprop":
        data, member = b.rowwise_data, n * k
    else:
        data, member = b.columnwise_data, k * _rup(n, 128)
    return (data, member) + _weight_scales(ops, scale_layout)


def prepare_weight_list(weights) -> None:
    """Make the device address table of a list of weights now (outside any
    capture), as the first grouped call with them would."""
    key = tuple(w.data_ptr() for w in weights) + (weights[0].device.index or 0,)
    if key not in _ptr_tables:
        _ptr_tables[key] = _address_table(key, weights[0].device)


def _address_table(key: Tuple[int, ...], device: torch.device) -> torch.Tensor:
    # kept across calls, so made outside any CUDA-graph pool (lpmoe._persistent)
    return persistent(lambda: torch.tensor(list(key[:-1]), dtype=torch.int64, device=device), device)


def ptr_table(ops: GemmOperands) -> torch.Tensor:
    """Device array of the discrete weights' addresses, cached per address
    tuple (parameters do not move, so a step builds it once, outside any
    graph capture)."""
    key = tuple(w.data_ptr() for w in ops.b_list) + (ops.device.index or 0,)
    t = _ptr_tables.get(key)
    if t is None:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("lpmoe.grouped_gemm: a new list of weight tensors was first seen inside CUDA graph "
                               "capture; run the call once eagerly (warm-up) before capturing")
        t = _ptr_tables[key] = _address_table(key, ops.device)
    return t
