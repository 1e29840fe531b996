"""MXFP8 and NVFP4: output allocation (shared with the CPU reference path),
validation, and the GPU kernel launches.  Layouts: csrc/mxfp8/mxfp8.h,
csrc/nvfp4/nvfp4.h, docs/formats-notes.md.  Nothing here reads device memory
on the host.
"""
from __future__ import annotations

import torch

from lpmoe._ext import ext
from lpmoe._op_utils import adopt_metadata, check_noop, max_row_tiles
from lpmoe.grouped_layout import buffer_dtypes, capacity_sizes, cdiv, output_buffer
from lpmoe.grouped_tensor import GroupedTensor, ShapeKind
from lpmoe.library.routing import tracing
from lpmoe.quantizers import MXFP8Quantizer, NVFP4Quantizer
from lpmoe.reference.mxfp8 import MXFP8Quantized
from lpmoe.reference.nvfp4 import NVFP4Quantized

_ROWS_KINDS = (ShapeKind.SAME_SHAPE, ShapeKind.VARYING_FIRST)
_TILE_ELEMS = 128 * 128


def by_elements(g: GroupedTensor) -> bool:
    return g.shape_kind not in _ROWS_KINDS


def check_layout(q, g: GroupedTensor) -> None:
    """Alignment each layout needs, checked wherever the dims are host-visible.

    MXFP8 varying-last / varying-both members need M_t and K_t multiples of
    128 (their scales are addressed by element offset / 32, formats.md §2.5).
    Device dims cannot be checked without a sync: misaligned members are
    skipped by the kernels (outputs untouched) and documented as such.
    NVFP4 needs K % 16 and every member's rows % 16; grouped NVFP4 supports
    same-shape and varying-first groups.
    """
    rows, cols = g.logical_shape
    if isinstance(q, MXFP8Quantizer):
        if not by_elements(g):
            if cols % 16:
                raise ValueError(f"MXFP8 needs the last dim K to be a multiple of 16, got K={cols}")
            return
        if g.shape_kind is ShapeKind.VARYING_LAST and rows % 128:
            raise ValueError(f"MXFP8 varying-last groups need the common first dim to be a multiple of 128, "
                             f"got {rows}")
        for name in ("first_dims", "last_dims"):
            d = getattr(g, name)
            if d is not None and d.device.type == "cpu" and not tracing() and bool((d % 128 != 0).any()):
                raise ValueError(f"MXFP8 varying-dims groups need every {name} entry to be a multiple of 128, "
                                 f"got {d.tolist()}")
        return
    if isinstance(q, NVFP4Quantizer):
        if by_elements(g):
            raise NotImplementedError("NVFP4 groups support same-shape and varying-first members")
        if cols % 16:
            raise ValueError(f"NVFP4 needs the last dim K to be a multiple of 16, got K={cols}")
        if g.shape_kind is ShapeKind.SAME_SHAPE and (rows // g.num_tensors) % 16:
            raise ValueError(f"NVFP4 needs every member's rows to be a multiple of 16, got {rows // g.num_tensors}")
        d = g.first_dims
        if d is not None and d.device.type == "cpu" and not tracing() and bool((d % 16 != 0).any()):
            raise ValueError(f"NVFP4 needs every first_dims entry to be a multiple of 16, got {d.tolist()}")


def _check_single_scale(scale, data_dtype, want_data, shape_fn, m, k, columnwise, swizzled, name):
    if scale is None:
        raise ValueError(f"{name}: missing scales")
    need = shape_fn(m, k, columnwise)
    if scale.numel() < need[0] * need[1] or scale.element_size() != 1 or data_dtype != want_data:
        raise ValueError(f"{name}: scales must hold the padded {need} layout (1-byte elements, "
                         f"{'swizzled' if swizzled else 'compact'}) and data must be {want_data}; got "
                         f"{tuple(scale.shape)} {scale.dtype} and {data_dtype}")


def allocate(q, g: GroupedTensor) -> GroupedTensor:
    """Uninitialised output buffers of format ``q`` for the members of ``g``
    (capacity for any split of its rows), carrying g's metadata."""
    rows, cols = g.logical_shape
    dev = g.device
    if by_elements(g):
        numel = rows * cols
        sizes = {"rowwise_data": numel, "columnwise_data": numel, "scale_inv": numel // 32,
                 "columnwise_scale_inv": numel // 32, "amax": 0, "columnwise_amax": 0}
    else:
        sizes = capacity_sizes(q, g.num_tensors, rows, cols, uniform=g.shape_kind is ShapeKind.SAME_SHAPE)
    dt = buffer_dtypes(q, g.dtype)
    if isinstance(q, NVFP4Quantizer):
        sizes["amax"] = g.num_tensors  # kept even when only the columnwise copy is produced
        sizes["columnwise_amax"] = g.num_tensors if q.columnwise else 0
    bufs = {}
    for name, size in sizes.items():
        wanted = q.rowwise if name in ("rowwise_data", "scale_inv") else q.columnwise
        if name == "amax":
            wanted = isinstance(q, NVFP4Quantizer)
        elif name == "columnwise_amax":
            wanted = isinstance(q, NVFP4Quantizer) and q.columnwise
        # Empty members still get (empty) buffers: shapes stay well defined.
        bufs[name] = output_buffer(size, dt[name], dev) if wanted else None
    return GroupedTensor(num_tensors=g.num_tensors, logical_shape=g.logical_shape, dtype=g.dtype, quantizer=q,
                         first_dims=g.first_dims, last_dims=g.last_dims, tensor_offsets=g.tensor_offsets,
                         padded_row_offsets=g.padded_row_offsets, _trusted_offsets=True,
                         with_gemm_swizzled_scales=bool(q.swizzled_scales), **bufs)


def check_output(output: GroupedTensor, q, g: GroupedTensor) -> None:
    if not isinstance(output, GroupedTensor):
        raise TypeError(f"output must be a GroupedTensor, got {type(output).__name__}")
    if output.quantizer != q:
        raise ValueError(f"output was made for {output.quantizer!r}, not {q!r}")
    if output.device != g.device:
        raise ValueError(f"output is on {output.device}, input on {g.device}")
    ref = _sizes(q, g)
    want = buffer_dtypes(q, g.dtype)
    for name, size in ref.items():
        buf = getattr(output, name)
        if buf is not None and buf.dtype != want[name]:
            raise TypeError(f"output.{name} has dtype {buf.dtype}, expected {want[name]}")
        if size and (buf is None or buf.numel() < size):
            raise ValueError(f"output.{name} holds {None if buf is None else buf.numel()} elements, "
                             f"needs {size} for this input")


def _sizes(q, g: GroupedTensor) -> dict:
    rows, cols = g.logical_shape
    if by_elements(g):
        n = rows * cols
        s = {"rowwise_data": n, "scale_inv": n // 32, "columnwise_data": n, "columnwise_scale_inv": n // 32}
    else:
        s = capacity_sizes(q, g.num_tensors, rows, cols, uniform=g.shape_kind is ShapeKind.SAME_SHAPE)
    for name in list(s):
        if not (q.rowwise if name in ("rowwise_data", "scale_inv", "amax") else q.columnwise):
            s[name] = 0
    return s


def _members(g: GroupedTensor) -> list:
    """Binding arguments that locate the members: (padded_row_offsets,
    num_tensors, by_elements, offsets, first_dims, last_dims, common_first,
    common_last)."""
    if not by_elements(g):
        return [g.padded_row_offsets, g.num_tensors, False, None, None, None, 0, 0]
    return [None, g.num_tensors, True, g.tensor_offsets, g.first_dims, g.last_dims, g.common_first_dim or 0,
            g.common_last_dim or 0]


def _num_tiles(g: GroupedTensor) -> int:
    rows, cols = g.logical_shape
    if by_elements(g):
        return cdiv(rows * cols, _TILE_ELEMS)
    return max_row_tiles(g) * cdiv(cols, 128)


def _prepare_output(q, g: GroupedTensor, noop_flag, output) -> GroupedTensor:
    """Validate noop/output= and return the buffers the kernel writes."""
    check_noop(noop_flag, g.device)
    if output is None:
        return allocate(q, g)
    check_output(output, q, g)
    adopt_metadata(output, g)
    return output


# ----------------------------------------------------------------- MXFP8 GPU
def mxfp8_group_quantize(g: GroupedTensor, q: MXFP8Quantizer, noop_flag=None, output=None) -> GroupedTensor:
    out = _prepare_output(q, g, noop_flag, output)
    x = g.rowwise_data
    rows, cols = g.logical_shape
    if x.data_ptr() % 16:
        raise ValueError("x must be 16-byte aligned")
    if rows * cols:
        ext().mxfp8_quantize(
            x, *_members(g), rows, cols, q.fp8_dtype == torch.float8_e5m2, q.swizzled_scales,
            out.rowwise_data if q.rowwise else None, out.scale_inv if q.rowwise else None,
            out.columnwise_data if q.columnwise else None, out.columnwise_scale_inv if q.columnwise else None,
            noop_flag, _num_tiles(g))
    return out


def mxfp8_group_dequantize(grouped: GroupedTensor, dtype: torch.dtype) -> GroupedTensor:
    q = grouped.quantizer
    columnwise = grouped.rowwise_data is None
    data = grouped.columnwise_data if columnwise else grouped.rowwise_data
    scale = grouped.columnwise_scale_inv if columnwise else grouped.scale_inv
    rows, cols = grouped.logical_shape
    out = torch.empty(rows * cols, dtype=dtype, device=grouped.device)
    if rows * cols:
        ext().mxfp8_dequantize(data, scale, columnwise, grouped.with_gemm_swizzled_scales,
                               q.fp8_dtype == torch.float8_e5m2, *_members(grouped), rows, cols, out,
                               _num_tiles(grouped))
    return GroupedTensor(num_tensors=grouped.num_tensors, logical_shape=grouped.logical_shape, dtype=dtype,
                         rowwise_data=out, first_dims=grouped.first_dims, last_dims=grouped.last_dims,
                         tensor_offsets=grouped.tensor_offsets, padded_row_offsets=grouped.padded_row_offsets, _trusted_offsets=True)


# ----------------------------------------------------------------- NVFP4 GPU
def nvfp4_group_quantize(g: GroupedTensor, q: NVFP4Quantizer, noop_flag=None, output=None) -> GroupedTensor:
    out = _prepare_output(q, g, noop_flag, output)
    rows, cols = g.logical_shape
    x = g.rowwise_data.view(rows, cols)
    if x.data_ptr() % 16:
        raise ValueError("x must be 16-byte aligned")
    ext().nvfp4_quantize(
        x, g.padded_row_offsets, g.num_tensors, q.swizzled_scales,
        out.rowwise_data if q.rowwise else None, out.scale_inv.view(torch.uint8) if q.rowwise else None,
        out.columnwise_data if q.columnwise else None,
        out.columnwise_scale_inv.view(torch.uint8) if q.columnwise else None,
        out.amax, out.columnwise_amax if q.columnwise else None, noop_flag, max_row_tiles(g))
    return out


def nvfp4_group_dequantize(grouped: GroupedTensor, dtype: torch.dtype) -> GroupedTensor:
    if grouped.rowwise_data is None:
        raise ValueError("NVFP4 dequantize needs the rowwise copy (the columnwise copy is transposed and packed)")
    rows, cols = grouped.logical_shape
    out = torch.empty(rows * cols, dtype=dtype, device=grouped.device)
    ext().nvfp4_dequantize(grouped.rowwise_data, grouped.scale_inv.view(torch.uint8), grouped.amax,
                           grouped.with_gemm_swizzled_scales, grouped.padded_row_offsets, grouped.num_tensors,
                           rows, cols, out, max_row_tiles(grouped))
    return GroupedTensor(num_tensors=grouped.num_tensors, logical_shape=grouped.logical_shape, dtype=dtype,
                         rowwise_data=out, first_dims=grouped.first_dims, tensor_offsets=grouped.tensor_offsets,
                         padded_row_offsets=grouped.padded_row_offsets, _trusted_offsets=True)


# ------------------------------------------------------------ single tensor
def _single_group(x: torch.Tensor) -> GroupedTensor:
    # A single tensor is a one-member group; kernels get no offsets at all
    # (one member spanning every row), so nothing extra is launched.
    g = GroupedTensor(num_tensors=1, logical_shape=tuple(x.shape), dtype=x.dtype, rowwise_data=x.reshape(-1),
                      tensor_offsets=torch.zeros(2, dtype=torch.int64, device=x.device),
                      padded_row_offsets=torch.zeros((5, 2), dtype=torch.int64, device=x.device),
                      _trusted_offsets=True)
    g.padded_row_offsets = None
    return g


def _view(buf, shape):
    if buf is None:
        return None
    n = 1
    for d in shape:
        n *= d
    return buf[:n].view(shape)


def _scale_view(buf, q, m, k, columnwise):
    shape = q.get_scale_shape((m, k), columnwise=columnwise)
    v = _view(buf, shape)
    return None if v is None else (v.reshape(-1) if q.swizzled_scales else v)


def _zero_scales(out) -> None:
    # Empty tensor: no kernel runs; scale buffers hold only (zero) padding.
    for b in (out.scale_inv, out.columnwise_scale_inv):
        if b is not None:
            b.view(torch.uint8).zero_()


def mxfp8_quantize_single(x: torch.Tensor, q: MXFP8Quantizer) -> MXFP8Quantized:
    m, k = x.shape
    if k % 16:
        raise ValueError(f"MXFP8 needs the last dim K to be a multiple of 16, got K={k}")
    g = _single_group(x.contiguous())
    out = allocate(q, g)
    if m * k:
        ext().mxfp8_quantize(g.rowwise_data, None, 1, False, None, None, None, 0, 0, m, k,
                             q.fp8_dtype == torch.float8_e5m2, q.swizzled_scales,
                             out.rowwise_data if q.rowwise else None, out.scale_inv if q.rowwise else None,
                             out.columnwise_data if q.columnwise else None,
                             out.columnwise_scale_inv if q.columnwise else None, None, cdiv(m, 128) * cdiv(k, 128))
    else:
        _zero_scales(out)
    return MXFP8Quantized(
        data=_view(out.rowwise_data, (m, k)), scale_inv=_scale_view(out.scale_inv, q, m, k, False),
        columnwise_data=_view(out.columnwise_data, (m, k)),
        columnwise_scale_inv=_scale_view(out.columnwise_scale_inv, q, m, k, True),
        fp8_dtype=q.fp8_dtype, with_gemm_swizzled_scales=q.swizzled_scales)


def mxfp8_dequantize_single(t: MXFP8Quantized, dtype: torch.dtype) -> torch.Tensor:
    columnwise = t.data is None
    data = t.columnwise_data if columnwise else t.data
    scale = t.columnwise_scale_inv if columnwise else t.scale_inv
    m, k = data.shape
    from lpmoe.reference.mxfp8 import mxfp8_scale_shape
    _check_single_scale(scale, data.dtype, t.fp8_dtype, mxfp8_scale_shape, m, k, columnwise,
                        t.with_gemm_swizzled_scales, "MXFP8 dequantize")
    out = torch.empty((m, k), dtype=dtype, device=data.device)
    if m * k:
        if k % 16:
            raise ValueError(f"MXFP8 GPU dequantize needs K % 16 == 0, got K={k}")
        ext().mxfp8_dequantize(data.contiguous(), scale.contiguous().view(torch.uint8).reshape(-1), columnwise,
                               t.with_gemm_swizzled_scales, t.fp8_dtype == torch.float8_e5m2, None, 1, False, None,
                               None, None, 0, 0, m, k, out, cdiv(m, 128) * cdiv(k, 128))
    return out


def nvfp4_quantize_single(x: torch.Tensor, q: NVFP4Quantizer) -> NVFP4Quantized:
    m, k = x.shape
    if m % 16 or k % 16:
        raise ValueError(f"NVFP4 needs both dims divisible by 16, got shape ({m}, {k})")
    g = _single_group(x.contiguous())
    out = allocate(q, g)
    if m * k:
        ext().nvfp4_quantize(g.rowwise_data.view(m, k), None, 1, q.swizzled_scales,
                             out.rowwise_data if q.rowwise else None,
                             out.scale_inv.view(torch.uint8) if q.rowwise else None,
                             out.columnwise_data if q.columnwise else None,
                             out.columnwise_scale_inv.view(torch.uint8) if q.columnwise else None,
                             out.amax, out.columnwise_amax if q.columnwise else None, None, cdiv(m, 128))
    else:  # no lpmoe kernel for an empty tensor; its amax is 0
        _zero_scales(out)
        for b in (out.amax, out.columnwise_amax):
            if b is not None:
                b.zero_()
    return NVFP4Quantized(
        data=_view(out.rowwise_data, (m, k // 2)), scale_inv=_scale_view(out.scale_inv, q, m, k, False),
        amax=out.amax[:1],  # kept for a columnwise-only tensor too, like the reference
        columnwise_data=_view(out.columnwise_data, (k, m // 2)),
        columnwise_scale_inv=_scale_view(out.columnwise_scale_inv, q, m, k, True),
        columnwise_amax=out.columnwise_amax[:1] if q.columnwise else None,
        with_gemm_swizzled_scales=q.swizzled_scales)


def nvfp4_dequantize_single(t: NVFP4Quantized, dtype: torch.dtype) -> torch.Tensor:
    if t.data is None:
        raise ValueError("NVFP4 dequantize needs the rowwise copy (the columnwise copy is transposed and packed)")
    m, k = t.data.shape[0], t.data.shape[1] * 2
    from lpmoe.reference.nvfp4 import nvfp4_scale_shape
    if m % 16 or k % 16:
        raise ValueError(f"NVFP4 needs both dims divisible by 16, got ({m}, {k})")
    _check_single_scale(t.scale_inv, t.data.dtype, torch.uint8, nvfp4_scale_shape, m, k, False,
                        t.with_gemm_swizzled_scales, "NVFP4 dequantize")
    if t.amax is None or t.amax.numel() < 1:
        raise ValueError("NVFP4 dequantize needs the tensor's amax")
    out = torch.empty((m, k), dtype=dtype, device=t.data.device)
    if m * k:
        ext().nvfp4_dequantize(t.data.contiguous(), t.scale_inv.contiguous().view(torch.uint8).reshape(-1),
                               t.amax.float().contiguous(), t.with_gemm_swizzled_scales, None, 1, m, k, out,
                               cdiv(m, 128))
    return out
