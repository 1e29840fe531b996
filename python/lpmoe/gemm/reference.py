"""Reference grouped GEMM: fp64 products of the dequantized operands.

This is the CPU path of :func:`lpmoe.grouped_gemm` and the accuracy target
of both GPU backends.  Quantized operands are dequantized from exactly the
copy the GPU GEMM reads (rowwise for fprop/dgrad, the transposed columnwise
copies for wgrad), so the only difference to a GPU result is the order and
precision of accumulation.  Reads member sizes on the host.
"""
from __future__ import annotations

from typing import List, Optional

import torch

from lpmoe.gemm.operands import GemmOperands, host_splits

__all__ = ["reference_grouped_gemm", "dequantized_members"]


def _dequantize_grouped(g, columnwise: bool) -> torch.Tensor:
    """(rows, K) float64 values of a token- or weight-grouped operand."""
    from lpmoe.quantize import group_dequantize

    if not g.is_quantized:
        return g.rowwise_data.view(g.logical_shape).to(torch.float64)
    view = g.direction_view(columnwise)
    deq = group_dequantize(view, torch.float32)
    return deq.rowwise_data.view(g.logical_shape).to(torch.float64)


def dequantized_members(ops: GemmOperands, splits: List[int]):
    """Per-group fp64 (A_t, B_t) as the math sees them: fprop A (M_t,K) B
    (N,K); dgrad A (M_t,N) B (N,K); wgrad A (M_t,N) B (M_t,K)."""
    wgrad = ops.kind == "wgrad"
    a = _dequantize_grouped(ops.a, columnwise=wgrad)
    if wgrad:
        b = _dequantize_grouped(ops.b_grouped, columnwise=True)
    elif ops.b_grouped is not None:
        w = _dequantize_grouped(ops.b_grouped, columnwise=ops.kind == "dgrad")
        b = w.view(ops.num_groups, ops.n, ops.k)
    elif ops.b_stacked is not None:
        b = ops.b_stacked.to(torch.float64)
    else:
        b = None
    out = []
    row = 0
    for t, m in enumerate(splits):
        a_t = a[row:row + m]
        if wgrad:
            b_t = b[row:row + m]
        elif b is not None:
            b_t = b[t]
        else:
            b_t = ops.b_list[t].to(torch.float64)
        out.append((a_t, b_t))
        row += m
    return out


def reference_grouped_gemm(ops: GemmOperands, out: Optional[torch.Tensor], accumulate: bool,
                           bias: Optional[torch.Tensor], out_dtype: torch.dtype) -> torch.Tensor:
    splits = host_splits(ops)
    members = dequantized_members(ops, splits)
    if ops.kind == "wgrad":
        res = out if out is not None else torch.zeros((ops.num_groups, ops.n, ops.k), dtype=out_dtype,
                                                      device=ops.device)
        for t, (a_t, b_t) in enumerate(members):
            prod = a_t.t() @ b_t  # (N, K)
            if accumulate:
                res[t] = (res[t].to(torch.float64) + prod).to(res.dtype)
            else:
                res[t] = prod.to(res.dtype)
        return res
    cols = ops.n if ops.kind == "fprop" else ops.k
    res = out if out is not None else torch.zeros((ops.rows, cols), dtype=out_dtype, device=ops.device)
    row = 0
    for t, (a_t, b_t) in enumerate(members):
        m = a_t.shape[0]
        prod = a_t @ b_t.t() if ops.kind == "fprop" else a_t @ b_t
        if bias is not None:
            prod = prod + bias[t].to(torch.float64)
        res[row:row + m] = prod.to(res.dtype)
        row += m
    return res
