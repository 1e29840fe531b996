"""Fused activation forward/backward: GPU kernels (csrc/activation) with the
bit-exact reference (lpmoe.reference.activation) as the CPU path.

Each entry point writes the activation (or its gradient) in the form the
next grouped GEMMs read: high precision and/or an FP8 block 1x128
GroupedTensor (rowwise + transposed), bit-identical to computing the
activation in high precision and then calling lpmoe.group_quantize.

Paths, in order of preference (``CALLS`` counts which one ran, so tests can
prove that no silent fallback happened):

* ``fused_*``       one kernel writes every requested output (bf16 with E4M3
                    1x128 FP8 outputs, or bf16/fp16 high precision);
* ``split_*``       a high-precision kernel, then lpmoe.group_quantize for an
                    FP8 output the fused kernel does not write (E5M2, or a
                    GLU gradient with F % 128 != 0, whose 1x128 blocks would
                    straddle the gate/value boundary);
* ``reference_*``   CPU tensors, and fp32 on the GPU (the reference's torch
                    ops run there too, bit-exact).

A bf16 SwiGLU kernel may take its sigmoid from a shared-memory table (same
bits; csrc/activation/sigmoid_table.cuh): the kernels decide per device
(csrc/activation/heuristics.cu: where the device's DRAM bandwidth per SM
cycle makes them issue-bound, e.g. the H200, not the H100).
``SIGMOID_TABLE`` forces it on (True) or off (False) for tests and A/B
timing; ``sigmoid_table_launches()`` counts the table kernels launched.

Graph-safe: nothing reads device values on the host.  The FP8 (grouped)
launches visit member rows only: rows past sum(splits) (capacity tail) are
never read and their FP8 outputs are untouched; a high-precision output of
such a launch leaves them unwritten.  High-precision-only launches process
every row.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from lpmoe._ext import ext
from lpmoe._op_utils import max_row_tiles
from lpmoe.activation.spec import Activation
from lpmoe.grouped_tensor import GroupedTensor
from lpmoe.library.routing import OPS, tracing
from lpmoe.quantize import group_quantize, group_quantize_dbias
from lpmoe.quantizers import Float8BlockQuantizer
from lpmoe.reference import activation as ref

__all__ = ["forward", "backward", "ForwardResult", "BackwardResult", "CALLS", "SIGMOID_TABLE",
           "sigmoid_table_launches"]

# None: the device decides (csrc/activation/heuristics.cu); True / False:
# forced.  Only the bf16 SwiGLU forward and FP8 backward have a table
# variant; other launches ignore it.
SIGMOID_TABLE: Optional[bool] = None


def _table_arg() -> int:
    return -1 if SIGMOID_TABLE is None else int(bool(SIGMOID_TABLE))


def sigmoid_table_launches() -> int:
    """Sigmoid-table kernel launches since the process started (a C++
    counter, counted when a launch is issued: a CUDA graph counts its
    capture, not its replays)."""
    return int(ext().activation_sigmoid_table_launches())


CALLS = {"fused_forward": 0, "fused_backward": 0, "split_forward": 0, "split_backward": 0,
         "reference_forward": 0, "reference_backward": 0}

_TILE = 128


@dataclass
class ForwardResult:
    hp: Optional[torch.Tensor] = None
    quantized: Optional[GroupedTensor] = None


@dataclass
class BackwardResult:
    dh: Optional[torch.Tensor] = None           # high precision (rows, W)
    dh_quantized: Optional[GroupedTensor] = None
    dbias: Optional[torch.Tensor] = None        # (G, W) per-member column sums of dh
    dprobs: Optional[torch.Tensor] = None       # (rows,) in probs' dtype


def _ffn(h: torch.Tensor, spec: Activation) -> int:
    return h.shape[1] // 2 if spec.is_glu else h.shape[1]


def _fused_fp8(q: Optional[Float8BlockQuantizer]) -> bool:
    """The fused kernels write E4M3 1x128 blocks (the grouped GEMM operands)."""
    return q is None or (isinstance(q, Float8BlockQuantizer) and q.block_dim == 1
                         and q.fp8_dtype == torch.float8_e4m3fn)


def _on_kernels(h: torch.Tensor) -> bool:
    return h.is_cuda and h.dtype in (torch.bfloat16, torch.float16)


def _empty_fp8(q: Float8BlockQuantizer, splits: torch.Tensor, rows: int, cols: int, dtype) -> GroupedTensor:
    return GroupedTensor.empty(q, splits.numel(), (rows, cols), dtype=dtype, first_dims=splits, device=splits.device)


def _fp8_bufs(g: GroupedTensor):
    """(rowwise data, scales, columnwise data, scales) the kernel writes; None where not produced."""
    q = g.quantizer
    return [g.rowwise_data if q.rowwise else None, g.scale_inv if q.rowwise else None,
            g.columnwise_data if q.columnwise else None, g.columnwise_scale_inv if q.columnwise else None]


def _probs32(probs: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if probs is None else probs.reshape(-1).to(torch.float32).contiguous()


def _quant_args(q: Optional[Float8BlockQuantizer]):
    return (True, 0.0) if q is None else (q.pow2_scales, q.amax_epsilon)


# ------------------------------------------------------------------ forward
def forward(h: torch.Tensor, spec: Activation, probs: Optional[torch.Tensor], splits: Optional[torch.Tensor], *,
            write_hp: bool, quantizer: Optional[Float8BlockQuantizer] = None) -> ForwardResult:
    """a = act(h) [* probs] as high precision (``write_hp``) and/or quantized
    with ``quantizer`` (an FP8 block GroupedTensor grouped by the device
    ``splits``; not needed without a quantizer)."""
    if tracing():
        return OPS["activation_forward"](h, spec, probs, splits, write_hp, quantizer)
    return forward_impl(h, spec, probs, splits, write_hp=write_hp, quantizer=quantizer)


def forward_impl(h: torch.Tensor, spec: Activation, probs: Optional[torch.Tensor], splits: Optional[torch.Tensor], *,
                 write_hp: bool, quantizer: Optional[Float8BlockQuantizer] = None) -> ForwardResult:
    """The implementation behind :func:`forward` (and ``lpmoe::activation_forward``)."""
    rows, f = h.shape[0], _ffn(h, spec)
    if not _on_kernels(h):
        CALLS["reference_forward"] += 1
        a = ref.activation_forward(h, spec.kind, probs, spec.alpha, spec.limit)
        qa = None if quantizer is None else group_quantize(a, quantizer, splits.numel(), first_dims=splits)
        return ForwardResult(a if write_hp else None, qa)
    if quantizer is not None and not (_fused_fp8(quantizer) and h.dtype == torch.bfloat16):
        CALLS["split_forward"] += 1
        a = _hp_forward(h, spec, probs, f)
        return ForwardResult(a if write_hp else None,
                             group_quantize(a, quantizer, splits.numel(), first_dims=splits))
    if quantizer is None:
        CALLS["fused_forward"] += 1
        return ForwardResult(_hp_forward(h, spec, probs, f), None)
    CALLS["fused_forward"] += 1
    qa = _empty_fp8(quantizer, splits, rows, f, h.dtype)
    hp = torch.empty((rows, f), dtype=h.dtype, device=h.device) if write_hp else None
    pow2, eps = _quant_args(quantizer)
    ext().activation_forward(h, spec.kernel_kind, spec.alpha, spec.limit, f, _probs32(probs), qa.padded_row_offsets,
                             qa.num_tensors, max_row_tiles(qa), hp, *_fp8_bufs(qa), pow2, eps, _table_arg())
    return ForwardResult(hp, qa)


def _hp_forward(h, spec: Activation, probs, f: int) -> torch.Tensor:
    """High precision over every row (a single-member launch)."""
    out = torch.empty((h.shape[0], f), dtype=h.dtype, device=h.device)
    ext().activation_forward(h, spec.kernel_kind, spec.alpha, spec.limit, f, _probs32(probs), None, 1,
                             -(-h.shape[0] // _TILE), out, None, None, None, None, True, 0.0, _table_arg())
    return out


# ----------------------------------------------------------------- backward
def backward(da: torch.Tensor, h: torch.Tensor, spec: Activation, probs: Optional[torch.Tensor],
             splits: Optional[torch.Tensor], *, dh_hp: bool = False,
             dh_quantizer: Optional[Float8BlockQuantizer] = None, dbias: bool = False,
             dprobs: bool = True) -> BackwardResult:
    """dh as high precision (``dh_hp``) and/or quantized with ``dh_quantizer``
    (an FP8 block GroupedTensor grouped by the device ``splits``), with the
    per-member bias gradient of fc1 when ``dbias``, and d probs (when
    ``probs`` and ``dprobs``), from one read of da and h."""
    if tracing():
        return OPS["activation_backward"](da, h, spec, probs, splits, dh_hp, dh_quantizer, dbias, dprobs)
    return backward_impl(da, h, spec, probs, splits, dh_hp=dh_hp, dh_quantizer=dh_quantizer, dbias=dbias,
                         dprobs=dprobs)


def backward_impl(da: torch.Tensor, h: torch.Tensor, spec: Activation, probs: Optional[torch.Tensor],
                  splits: Optional[torch.Tensor], *, dh_hp: bool = False,
                  dh_quantizer: Optional[Float8BlockQuantizer] = None, dbias: bool = False,
                  dprobs: bool = True) -> BackwardResult:
    """The implementation behind :func:`backward` (and ``lpmoe::activation_backward``)."""
    rows, f = h.shape[0], _ffn(h, spec)
    da = da.contiguous()
    grad_probs = probs if dprobs else None  # probs still scale; only the reduction is skipped
    if not _on_kernels(h):
        CALLS["reference_backward"] += 1
        dh, _, dp = ref.activation_backward(da, h, spec.kind, probs, spec.alpha, spec.limit)
        return _finish_unfused(dh, dp if dprobs else None, probs, splits, dh_hp, dh_quantizer, dbias)
    fused_fp8 = _fused_fp8(dh_quantizer) and h.dtype == torch.bfloat16 and (not spec.is_glu or f % _TILE == 0)
    if dh_quantizer is None or not fused_fp8:
        CALLS["fused_backward" if dh_quantizer is None else "split_backward"] += 1
        dh, dp = _hp_backward(da, h, spec, probs, f, grad_probs is not None)
        if dh_quantizer is None and not dbias:
            return BackwardResult(dh=dh if dh_hp else None, dprobs=_cast(dp, probs))
        return _finish_unfused(dh, dp, probs, splits, dh_hp, dh_quantizer, dbias)
    CALLS["fused_backward"] += 1
    w = h.shape[1]
    qdh = _empty_fp8(dh_quantizer, splits, rows, w, h.dtype)
    tiles = max_row_tiles(qdh)
    dev = h.device
    dh_out = torch.empty((rows, w), dtype=h.dtype, device=dev) if dh_hp else None
    ws = torch.empty((max(tiles, 1), w), dtype=torch.float32, device=dev) if dbias else None
    nb = -(-f // _TILE)
    partials = torch.empty((rows, nb), dtype=torch.float32, device=dev) if grad_probs is not None else None
    pow2, eps = _quant_args(dh_quantizer)
    ext().activation_backward(da, h, spec.kernel_kind, spec.alpha, spec.limit, f, _probs32(probs),
                              qdh.padded_row_offsets, qdh.num_tensors, tiles, dh_out, *_fp8_bufs(qdh), ws, partials,
                              pow2, eps, _table_arg())
    res = BackwardResult(dh=dh_out, dh_quantized=qdh)
    if dbias:
        res.dbias = torch.empty((qdh.num_tensors, w), dtype=h.dtype, device=dev)
        if rows == 0 or w == 0:
            res.dbias.zero_()
        else:
            ext().fp8_block_dbias_reduce(ws, qdh.padded_row_offsets, qdh.num_tensors, rows, res.dbias, None)
    if grad_probs is not None:
        dp = torch.empty(rows, dtype=torch.float32, device=dev)
        ext().activation_probs_grad(partials, rows, nb, qdh.padded_row_offsets[0, qdh.num_tensors:], dp)
        res.dprobs = _cast(dp, probs)
    return res


def _hp_backward(da, h, spec: Activation, probs, f: int, want_dprobs: bool):
    """High-precision dh and d probs over every row (single-member launch)."""
    rows, w = h.shape
    dev = h.device
    dh = torch.empty((rows, w), dtype=h.dtype, device=dev)
    nb = -(-f // _TILE)
    partials = torch.empty((rows, nb), dtype=torch.float32, device=dev) if want_dprobs else None
    ext().activation_backward(da, h, spec.kernel_kind, spec.alpha, spec.limit, f, _probs32(probs), None, 1,
                              -(-rows // _TILE), dh, None, None, None, None, None, partials, True, 0.0, _table_arg())
    dp = None
    if want_dprobs:
        dp = torch.empty(rows, dtype=torch.float32, device=dev)
        ext().activation_probs_grad(partials, rows, nb, None, dp)
    return dh, dp


def _cast(dp: Optional[torch.Tensor], probs: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if dp is None else dp.to(probs.dtype).view(probs.shape)


def _member_column_sums(dh: torch.Tensor, splits: torch.Tensor) -> torch.Tensor:
    """Bias gradient of a high-precision dh: the deterministic GEMM-with-ones
    method of lpmoe.functional (sync-free)."""
    from lpmoe.functional.linear_steps import bias_grad
    from lpmoe.functional.splits import Splits
    return bias_grad(dh, Splits(splits, None)).to(dh.dtype)


def _finish_unfused(dh, dp, probs, splits, dh_hp, dh_quantizer, dbias) -> BackwardResult:
    """Quantize a high-precision dh with lpmoe.group_quantize (bit-identical
    to what the fused kernel writes)."""
    num = splits.numel() if splits is not None else 1
    res = BackwardResult(dh=dh if dh_hp else None, dprobs=_cast(dp, probs))
    if dh_quantizer is not None and dbias:
        res.dh_quantized, res.dbias = group_quantize_dbias(dh, dh_quantizer, num, first_dims=splits)
    elif dh_quantizer is not None:
        res.dh_quantized = group_quantize(dh, dh_quantizer, num, first_dims=splits)
    elif dbias:
        res.dbias = _member_column_sums(dh, splits)
    return res
