"""Public quantize / dequantize entry points (single tensor and grouped).

CUDA tensors run lpmoe's kernels; CPU tensors run lpmoe.reference with the
same API and bit-identical results.  Grouped CUDA paths never read
``first_dims`` on the host: no sync, capturable in CUDA graphs.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from lpmoe import fp8_block_ops, mx_ops
from lpmoe._async_inputs import ready
from lpmoe._op_utils import adopt_metadata
from lpmoe.grouped_layout import output_buffer
from lpmoe.grouped_tensor import GroupedTensor, ShapeKind
from lpmoe.library.routing import OPS, tracing
from lpmoe.quantizers import Float8BlockQuantizer, MXFP8Quantizer, NVFP4Quantizer, Quantizer
from lpmoe.reference import grouped as ref_grouped
from lpmoe.reference.numerics import check_float_matrix

__all__ = ["quantize", "dequantize", "group_quantize", "group_quantize_dbias", "group_dequantize"]

_HP = (torch.float32, torch.bfloat16, torch.float16)


def _check_quantizer(quantizer) -> None:
    if not isinstance(quantizer, Quantizer):
        raise TypeError(f"quantizer must be an lpmoe quantizer, got {type(quantizer).__name__}")


_check_input = check_float_matrix  # one rule for every 2-D high-precision input


def _check_format_shape(quantizer, k: int) -> None:
    """Shape rules of each format, checked identically for CPU and GPU."""
    if isinstance(quantizer, Float8BlockQuantizer) and k % 16:
        raise ValueError(f"FP8 block scaling needs the last dim K to be a multiple of 16, got K={k}")
    if isinstance(quantizer, NVFP4Quantizer) and k % 16:
        raise ValueError(f"NVFP4 needs the last dim K to be a multiple of 16, got K={k}")
    if isinstance(quantizer, MXFP8Quantizer) and k % 16:
        raise ValueError(f"MXFP8 needs the last dim K to be a multiple of 16, got K={k}")


def quantize(x: torch.Tensor, quantizer: Quantizer):
    """Quantize one 2-D tensor.  Returns the format's single-tensor container
    (``lpmoe.reference.Fp8BlockQuantized`` / ``MXFP8Quantized`` / ``NVFP4Quantized``)."""
    x = ready(x)
    _check_quantizer(quantizer)
    _check_input(x)
    _check_format_shape(quantizer, x.shape[1])
    if tracing():
        return OPS["quantize"](x, quantizer)
    return quantize_impl(x, quantizer)


def quantize_impl(x: torch.Tensor, quantizer: Quantizer):
    """The implementation behind :func:`quantize` (and ``lpmoe::quantize``)."""
    if x.device.type == "cpu":
        return ref_grouped.quantize_member(x, quantizer)
    if isinstance(quantizer, Float8BlockQuantizer):
        return fp8_block_ops.quantize_single(x, quantizer)
    if isinstance(quantizer, MXFP8Quantizer):
        return mx_ops.mxfp8_quantize_single(x, quantizer)
    return mx_ops.nvfp4_quantize_single(x, quantizer)


def dequantize(t, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dequantize a single-tensor container returned by :func:`quantize`."""
    from lpmoe.reference import Fp8BlockQuantized, MXFP8Quantized, NVFP4Quantized
    if dtype not in _HP:
        raise TypeError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
    if isinstance(t, (Fp8BlockQuantized, MXFP8Quantized, NVFP4Quantized)) and \
            t.data is None and t.columnwise_data is None:
        raise ValueError("quantized tensor holds neither rowwise nor columnwise data")
    if tracing() and isinstance(t, (Fp8BlockQuantized, MXFP8Quantized, NVFP4Quantized)):
        return OPS["dequantize"](t, dtype)
    return dequantize_impl(t, dtype)


def dequantize_impl(t, dtype: torch.dtype) -> torch.Tensor:
    """The implementation behind :func:`dequantize` (and ``lpmoe::dequantize``)."""
    from lpmoe.reference import Fp8BlockQuantized, MXFP8Quantized, NVFP4Quantized, dequantize_fp8_block
    from lpmoe.reference import dequantize_mxfp8, dequantize_nvfp4
    if isinstance(t, Fp8BlockQuantized):
        src = t.data if t.data is not None else t.columnwise_data
        if src is None:
            raise ValueError("quantized tensor holds neither rowwise nor columnwise data")
        if src.device.type == "cpu":
            return dequantize_fp8_block(t, dtype)
        return fp8_block_ops.dequantize_single(t, dtype)
    if isinstance(t, (MXFP8Quantized, NVFP4Quantized)):
        src = t.data if t.data is not None else t.columnwise_data
        if src.device.type == "cpu":
            return dequantize_mxfp8(t, dtype) if isinstance(t, MXFP8Quantized) else dequantize_nvfp4(t, dtype)
        if isinstance(t, MXFP8Quantized):
            return mx_ops.mxfp8_dequantize_single(t, dtype)
        return mx_ops.nvfp4_dequantize_single(t, dtype)
    raise TypeError(f"t must be a quantized tensor returned by lpmoe.quantize, got {type(t).__name__}")


def _as_grouped_input(x, num_tensors, first_dims, tensor_offsets, last_dims=None) -> GroupedTensor:
    if isinstance(x, GroupedTensor):
        if x.is_quantized:
            raise TypeError("x is already quantized; pass the high-precision tensor")
        if num_tensors is not None and num_tensors != x.num_tensors:
            raise ValueError(f"num_tensors={num_tensors} but x has {x.num_tensors} members")
        return x
    if isinstance(num_tensors, torch.SymInt):  # traced: member counts are static
        num_tensors = int(num_tensors)
    if not isinstance(num_tensors, int) or num_tensors < 1:
        raise ValueError(f"num_tensors must be a positive int, got {num_tensors!r}")
    for name, d in (("first_dims", first_dims), ("last_dims", last_dims)):
        if d is not None and isinstance(x, torch.Tensor) and d.device != x.device:
            raise ValueError(f"{name} must be on {x.device} like x, got {d.device}")
    if last_dims is not None:
        # Varying last dims: x holds the members back to back (M_t x K_t each).
        if not isinstance(x, torch.Tensor) or not x.is_contiguous():
            raise ValueError("x must be a contiguous tensor")
        if first_dims is None:
            _check_input(x)
            return GroupedTensor.from_flat(x.view(-1), num_tensors, last_dims=last_dims, first_dim=x.shape[0])
        return GroupedTensor.from_flat(x.reshape(-1), num_tensors, first_dims=first_dims, last_dims=last_dims)
    _check_input(x)
    if not x.is_contiguous():
        raise ValueError("x must be contiguous")
    return GroupedTensor(num_tensors=num_tensors, logical_shape=tuple(x.shape), dtype=x.dtype,
                         rowwise_data=x.view(-1), first_dims=first_dims, tensor_offsets=tensor_offsets,
                         padded_row_offsets=None)


def _check_kind(quantizer, g: GroupedTensor) -> None:
    if isinstance(quantizer, Float8BlockQuantizer):
        if g.shape_kind not in (ShapeKind.SAME_SHAPE, ShapeKind.VARYING_FIRST):
            raise NotImplementedError(
                f"FP8 block scaling groups members along the first dim; got {g.shape_kind.value}")
        _check_format_shape(quantizer, g.logical_shape[1])
    else:
        mx_ops.check_layout(quantizer, g)


def group_quantize(x: Union[torch.Tensor, GroupedTensor], quantizer: Quantizer, num_tensors: Optional[int] = None,
                   first_dims: Optional[torch.Tensor] = None, tensor_offsets: Optional[torch.Tensor] = None,
                   noop_flag: Optional[torch.Tensor] = None, output: Optional[GroupedTensor] = None,
                   last_dims: Optional[torch.Tensor] = None) -> GroupedTensor:
    """Quantize the members of a group in one pass.

    Args:
        x: (rows, K) tensor holding the members as consecutive row blocks (or
            a high-precision GroupedTensor).  Rows past sum(first_dims) are a
            capacity tail: ignored, and their outputs untouched.
        quantizer: the format (Float8BlockQuantizer on GPU today).
        num_tensors: number of members N.
        first_dims: (N,) int32/int64 rows per member, on x's device (never
            read on the host); None = N equal members.
        tensor_offsets: optional precomputed (N+1,) int64 element offsets
            (K * row prefix sums); must match first_dims (not checked on GPU).
        noop_flag: float32 CUDA tensor; when it holds 1.0 no output is written
            (weight caches inside CUDA graphs).
        last_dims: (N,) int tensor of per-member last dims (MXFP8 only):
            varying-last (x is (M, sum K_t) holding the members back to back)
            or, with first_dims, varying-both (x flat).  Members need
            M_t % 128 == 0 and K_t % 128 == 0 (see mx_ops.check_layout).
        output: a GroupedTensor of this quantizer whose buffers are reused in
            place (same pointers); its metadata is updated.
    """
    x, first_dims, tensor_offsets, last_dims, noop_flag = map(ready, (x, first_dims, tensor_offsets, last_dims,
                                                                      noop_flag))
    _check_quantizer(quantizer)
    g = _as_grouped_input(x, num_tensors, first_dims, tensor_offsets, last_dims)
    _check_kind(quantizer, g)
    return _run_group_quantize(g, quantizer, noop_flag, output, False)[0]


def group_quantize_buffers(x: torch.Tensor, quantizer: Quantizer, num_tensors: int) -> GroupedTensor:
    """Uninitialised buffers of what ``group_quantize(x, quantizer,
    num_tensors)`` returns for ``num_tensors`` equal members (weights), to
    pass as its ``output=``: for callers that must choose where the memory
    comes from (lpmoe._persistent).  No launch."""
    _check_quantizer(quantizer)
    g = _as_grouped_input(x, num_tensors, None, None)
    _check_kind(quantizer, g)
    if isinstance(quantizer, Float8BlockQuantizer):
        return fp8_block_ops.allocate(quantizer, g)
    return mx_ops.allocate(quantizer, g)


def _run_group_quantize(g, quantizer, noop_flag, output, with_dbias):
    if tracing():
        return OPS["group_quantize"](g, quantizer, noop_flag, output, with_dbias)
    return group_quantize_grouped(g, quantizer, noop_flag, output, with_dbias)


def group_quantize_grouped(g: GroupedTensor, quantizer: Quantizer, noop_flag: Optional[torch.Tensor],
                           output: Optional[GroupedTensor], with_dbias: bool
                           ) -> Tuple[GroupedTensor, Optional[torch.Tensor]]:
    """The implementation behind group_quantize / group_quantize_dbias (and
    the op ``lpmoe::group_quantize``) on a validated high-precision group:
    (quantized group, dbias or None)."""
    if g.device.type == "cpu":
        out = _group_quantize_reference(g, quantizer, output, noop_flag)
        return out, (_dbias_reference(g) if with_dbias else None)
    if isinstance(quantizer, Float8BlockQuantizer):
        return fp8_block_ops.group_quantize(g, quantizer, noop_flag=noop_flag, output=output, with_dbias=with_dbias)
    if isinstance(quantizer, MXFP8Quantizer):
        return mx_ops.mxfp8_group_quantize(g, quantizer, noop_flag=noop_flag, output=output), None
    return mx_ops.nvfp4_group_quantize(g, quantizer, noop_flag=noop_flag, output=output), None


def check_output_for(output: GroupedTensor, quantizer: Quantizer, g: GroupedTensor) -> None:
    """An ``output=`` group fits this quantizer and input (metadata only)."""
    if isinstance(quantizer, Float8BlockQuantizer):
        fp8_block_ops.check_output(output, quantizer, g)
    else:
        mx_ops.check_output(output, quantizer, g)


def group_quantize_dbias(x, quantizer: Quantizer, num_tensors: Optional[int] = None,
                         first_dims: Optional[torch.Tensor] = None, tensor_offsets: Optional[torch.Tensor] = None,
                         noop_flag: Optional[torch.Tensor] = None,
                         output: Optional[GroupedTensor] = None) -> Tuple[GroupedTensor, torch.Tensor]:
    """:func:`group_quantize` plus the bias gradient: per-member column sums
    of x, shape (N, K), x's dtype, fp32 accumulation in a fixed order
    (bitwise deterministic), zeros for empty members.  With ``noop_flag`` = 1
    nothing is written (dbias is returned uninitialised)."""
    _check_quantizer(quantizer)
    if not isinstance(quantizer, Float8BlockQuantizer):
        raise NotImplementedError("group_quantize_dbias is implemented for Float8BlockQuantizer")
    x, first_dims, tensor_offsets, noop_flag = map(ready, (x, first_dims, tensor_offsets, noop_flag))
    g = _as_grouped_input(x, num_tensors, first_dims, tensor_offsets)
    _check_kind(quantizer, g)
    return _run_group_quantize(g, quantizer, noop_flag, output, True)


def group_dequantize(grouped: GroupedTensor, dtype: torch.dtype = torch.bfloat16) -> GroupedTensor:
    """Dequantize every member into a (rows, K) high-precision GroupedTensor
    with the input's metadata (first_dims, tensor_offsets, logical shape).
    Uses the rowwise copy when present, else the columnwise copy (written
    untransposed).  Capacity-tail rows of the output are left uninitialised."""
    if not isinstance(grouped, GroupedTensor) or not grouped.is_quantized:
        raise TypeError("grouped must be a quantized GroupedTensor")
    if dtype not in _HP:
        raise TypeError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
    if tracing():
        return OPS["group_dequantize"](grouped, dtype)
    return group_dequantize_grouped(grouped, dtype)


def group_dequantize_grouped(grouped: GroupedTensor, dtype: torch.dtype) -> GroupedTensor:
    """The implementation behind group_dequantize (and ``lpmoe::group_dequantize``)."""
    q = grouped.quantizer
    if grouped.device.type == "cpu":
        return _group_dequantize_reference(grouped, dtype)
    if isinstance(q, Float8BlockQuantizer):
        return fp8_block_ops.group_dequantize(grouped, dtype)
    if isinstance(q, MXFP8Quantizer):
        return mx_ops.mxfp8_group_dequantize(grouped, dtype)
    return mx_ops.nvfp4_group_dequantize(grouped, dtype)


# ----------------------------------------------------------------- CPU paths
def _group_quantize_reference(g: GroupedTensor, quantizer, output, noop_flag) -> GroupedTensor:
    if isinstance(quantizer, Float8BlockQuantizer):
        out = output if output is not None else GroupedTensor.empty(
            quantizer, g.num_tensors, g.logical_shape, dtype=g.dtype, first_dims=g.first_dims, device=g.device)
        if output is not None:
            fp8_block_ops.check_output(output, quantizer, g)
    else:
        out = output if output is not None else mx_ops.allocate(quantizer, g)
        if output is not None:
            mx_ops.check_output(output, quantizer, g)
    adopt_metadata(out, g)
    if noop_flag is not None and float(noop_flag.reshape(-1)[0]) == 1.0:
        return out
    bufs = {name: getattr(out, name) for name in ("rowwise_data", "columnwise_data", "scale_inv",
                                                  "columnwise_scale_inv", "amax", "columnwise_amax")}
    ref_grouped.group_quantize_into(g.split(), quantizer, bufs)
    adopt_metadata(out, g)
    return out


def _dbias_reference(g: GroupedTensor) -> torch.Tensor:
    k = g.logical_shape[1]
    rows = [m.float().sum(0) if m.shape[0] else torch.zeros(k) for m in g.split()]
    return torch.stack(rows).to(g.dtype)


def _group_dequantize_reference(grouped: GroupedTensor, dtype) -> GroupedTensor:
    rows, k = grouped.logical_shape
    out = output_buffer(rows * k, dtype, grouped.device)
    ref_grouped.group_dequantize_into(grouped.split(), grouped.quantizer, dtype,
                                      grouped.rowwise_data is None, out)
    res = GroupedTensor(num_tensors=grouped.num_tensors, logical_shape=grouped.logical_shape, dtype=dtype,
                        rowwise_data=out, first_dims=grouped.first_dims, last_dims=grouped.last_dims,
                        tensor_offsets=grouped.tensor_offsets, padded_row_offsets=grouped.padded_row_offsets, _trusted_offsets=True)
    return res
