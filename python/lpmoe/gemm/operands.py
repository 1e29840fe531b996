"""Validation and normalisation of grouped GEMM operands.

Everything here runs on host-visible metadata only (shapes, dtypes, devices,
quantizer descriptions): no device value is read, so the checks are free in
graph-safe code.  What cannot be checked without a host sync (per-member
sizes on the GPU, equality of two device split tensors) is documented in
:func:`lpmoe.grouped_gemm`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

from lpmoe import _sizes
from lpmoe._async_inputs import ready
from lpmoe.grouped_tensor import GroupedTensor, ShapeKind
from lpmoe.quantizers import Float8BlockQuantizer

__all__ = ["GemmOperands", "KINDS", "parse_operands", "host_splits"]

KINDS = ("fprop", "dgrad", "wgrad")
_HP = (torch.bfloat16, torch.float16, torch.float32)


@dataclass
class GemmOperands:
    kind: str
    a: GroupedTensor                    # token-grouped
    b_grouped: Optional[GroupedTensor]  # weights (fprop/dgrad) or tokens (wgrad)
    b_list: Optional[List[torch.Tensor]]  # discrete high-precision weights
    num_groups: int
    n: int                               # out_features
    k: int                               # in_features
    rows: int                            # token rows of the grouped operands (incl. capacity tail)
    fp8: bool
    dtype: torch.dtype                   # 16/32-bit operand dtype, or the quantized tensors' hp dtype
    device: torch.device
    m_splits: Optional[List[int]] = None  # host copy of the splits when the caller has it
    # weights given as one (G, N, K) tensor: used as is (wrapping them in a
    # GroupedTensor costs an offsets launch and its host time on every call)
    b_stacked: Optional[torch.Tensor] = None


def _check_tokens(g, name: str) -> None:
    if not isinstance(g, GroupedTensor):
        raise TypeError(f"`{name}` must be an lpmoe.GroupedTensor grouped by tokens, got {type(g).__name__}")
    if g.shape_kind not in (ShapeKind.SAME_SHAPE, ShapeKind.VARYING_FIRST):
        raise ValueError(f"`{name}` must be grouped along its first (token) dim, got {g.shape_kind.value}")


def _fp8_role(g: GroupedTensor, name: str, block_dim: int, need: str) -> None:
    q = g.quantizer
    if not isinstance(q, Float8BlockQuantizer):
        raise TypeError(f"`{name}`: quantized GEMM operands must use FP8 block scaling "
                        f"(Float8BlockQuantizer), got {type(q).__name__}")
    if q.block_dim != block_dim:
        want = "1x128 (block_dim=1)" if block_dim == 1 else "128x128 (block_dim=2)"
        raise ValueError(f"`{name}` must be quantized {want}, got block_dim={q.block_dim}")
    data = g.rowwise_data if need == "rowwise" else g.columnwise_data
    if data is None:
        raise ValueError(f"`{name}` needs its {need} quantized data for this GEMM; quantize it with "
                         f"{need}=True")


def _weights(b, g: int, name: str = "b"):
    """-> (grouped, list, stacked, n, k)."""
    if isinstance(b, GroupedTensor):
        if b.shape_kind is not ShapeKind.SAME_SHAPE or b.num_tensors != g:
            raise ValueError(f"`{name}` (weights) must be a same-shape group of {g} members, got "
                             f"{b.shape_kind.value} with {b.num_tensors} members")
        rows, k = b.logical_shape
        return b, None, None, rows // g, k
    if isinstance(b, torch.Tensor):
        b = ready(b)
        if b.dim() != 3 or b.shape[0] != g:
            raise ValueError(f"`{name}` (weights) as a tensor must be (G={g}, N, K), got {tuple(b.shape)}")
        if not b.is_contiguous():
            raise ValueError(f"`{name}` (weights) must be contiguous")
        return None, None, b, b.shape[1], b.shape[2]
    if isinstance(b, (list, tuple)):
        if len(b) != g:
            raise ValueError(f"`{name}` (weights) list has {len(b)} tensors, `a` has {g} groups")
        b = [ready(w) for w in b]   # the kernels get these addresses as integers: no binding check
        shape0 = tuple(b[0].shape)  # compared, not hashed: dims may be symbolic under torch.compile
        if len(shape0) != 2 or any(tuple(w.shape) != shape0 for w in b):
            raise ValueError(f"`{name}` (weights) must be {g} tensors of one 2-D (N, K) shape, got "
                             f"{[tuple(w.shape) for w in b]}")
        dts = {w.dtype for w in b}
        devs = {w.device for w in b}
        if len(dts) != 1 or len(devs) != 1:
            raise ValueError(f"`{name}` (weights) must share one dtype and device, got {dts} / {devs}")
        for i, w in enumerate(b):
            if not w.is_contiguous():
                raise ValueError(f"`{name}[{i}]` must be contiguous")
        n, k = shape0
        return None, list(b), None, n, k
    raise TypeError(f"`{name}` (weights) must be a GroupedTensor, a (G, N, K) tensor or a list of (N, K) "
                    f"tensors, got {type(b).__name__}")


def parse_operands(a, b, kind: str, m_splits: Optional[Sequence[int]] = None) -> GemmOperands:
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    _check_tokens(a, "a")
    g = a.num_tensors
    rows, a_cols = a.logical_shape
    if kind == "wgrad":
        _check_tokens(b, "b")
        if b.num_tensors != g:
            raise ValueError(f"wgrad: `a` has {g} groups but `b` has {b.num_tensors}")
        if b.logical_shape[0] != rows:
            raise ValueError(f"wgrad: `a` and `b` must hold the same token rows, got {rows} and "
                             f"{b.logical_shape[0]}")
        bg, bl, bs, n, k = b, None, None, a_cols, b.logical_shape[1]
    else:
        bg, bl, bs, n, k = _weights(b, g)
        want = k if kind == "fprop" else n
        if a_cols != want:
            what = "K (in_features)" if kind == "fprop" else "N (out_features)"
            raise ValueError(f"{kind}: `a` has {a_cols} columns but the weights' {what} is {want}")

    dev = a.device
    if bg is not None and bg.device != dev:
        raise ValueError(f"`b` is on {bg.device} but `a` is on {dev}")
    if bl is not None and bl[0].device != dev:
        raise ValueError(f"`b` is on {bl[0].device} but `a` is on {dev}")
    if bs is not None and bs.device != dev:
        raise ValueError(f"`b` is on {bs.device} but `a` is on {dev}")

    fp8 = a.is_quantized
    b_quant = bg is not None and bg.is_quantized
    if fp8 != b_quant:
        raise TypeError("`a` and `b` must both be FP8-block quantized or both high precision "
                        f"(a quantized: {fp8}, b quantized: {b_quant})")
    if fp8:
        if kind == "fprop":
            _fp8_role(a, "a", 1, "rowwise")
            _fp8_role(bg, "b", 2, "rowwise")
        elif kind == "dgrad":
            _fp8_role(a, "a", 1, "rowwise")
            _fp8_role(bg, "b", 2, "columnwise")
        else:
            _fp8_role(a, "a", 1, "columnwise")
            _fp8_role(bg, "b", 1, "columnwise")
        dtype = a.dtype
    else:
        dtype = a.rowwise_data.dtype
        bdt = bg.rowwise_data.dtype if bg is not None else bs.dtype if bs is not None else bl[0].dtype
        if dtype not in _HP or bdt != dtype:
            raise TypeError(f"high-precision operands must share one of {_HP}; got a {dtype}, b {bdt}")
    if m_splits is not None:
        m_splits = [int(s) for s in m_splits]
        if len(m_splits) != g or min(m_splits, default=0) < 0 or sum(m_splits) > rows:
            raise ValueError(f"m_splits must be {g} non-negative ints summing to at most {rows}, got {m_splits}")
    return GemmOperands(kind, a, bg, bl, g, int(n), int(k), _sizes.size(rows), fp8, dtype, dev, m_splits, bs)


def host_splits(ops: GemmOperands) -> List[int]:
    """Host list of the token splits (reads the device dims: a host sync)."""
    if ops.m_splits is not None:
        return ops.m_splits
    a = ops.a
    if a.first_dims is None:
        return [ops.rows // ops.num_groups] * ops.num_groups
    return [int(v) for v in a.first_dims.tolist()]
