"""GPU path of FP8 block scaling: allocation, validation, kernel launches.

Layouts: lpmoe.grouped_layout / csrc/fp8_block/fp8_block.h.  Nothing here
reads device memory on the host.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from lpmoe._ext import ext
from lpmoe._op_utils import adopt_metadata, check_noop, max_row_tiles, row_tiles_bound
from lpmoe.grouped_layout import buffer_dtypes, capacity_sizes, cdiv
from lpmoe.grouped_tensor import GroupedTensor, ShapeKind
from lpmoe.library.routing import OPS, tracing
from lpmoe.quantizers import Float8BlockQuantizer
from lpmoe.reference.fp8_block import Fp8BlockQuantized, block_scale_shape

_BUFS = ("rowwise_data", "columnwise_data", "scale_inv", "columnwise_scale_inv")


def _check_k(k: int) -> None:
    if k % 16:
        raise ValueError(f"FP8 block scaling needs the last dim K to be a multiple of 16, got K={k}")


def check_output(output: GroupedTensor, q: Float8BlockQuantizer, g: GroupedTensor) -> None:
    """An ``output=`` GroupedTensor must be of this format and large enough."""
    if not isinstance(output, GroupedTensor):
        raise TypeError(f"output must be a GroupedTensor, got {type(output).__name__}")
    oq = output.quantizer
    if type(oq) is not type(q) or any(getattr(oq, f) != getattr(q, f) for f in
                                       ("fp8_dtype", "block_dim", "pow2_scales", "amax_epsilon")):
        raise ValueError(f"output was made for {oq!r}, not {q!r}")
    if output.device != g.device:
        raise ValueError(f"output is on {output.device}, input on {g.device}")
    rows, k = g.logical_shape
    need = capacity_sizes(q, g.num_tensors, rows, k, uniform=g.shape_kind is ShapeKind.SAME_SHAPE)
    want_dtype = buffer_dtypes(q, g.dtype)
    for name in _BUFS:
        wanted = (q.rowwise if name in ("rowwise_data", "scale_inv") else q.columnwise) and need[name] > 0
        buf = getattr(output, name)
        if buf is not None and buf.dtype != want_dtype[name]:
            raise TypeError(f"output.{name} has dtype {buf.dtype}, expected {want_dtype[name]}")
        if wanted and (buf is None or buf.numel() < need[name]):
            have = None if buf is None else buf.numel()
            raise ValueError(f"output.{name} holds {have} elements, needs {need[name]} for this input")


def _buffers(q: Float8BlockQuantizer, num_tensors: int, rows, k: int, uniform: bool, device) -> dict:
    """Uninitialised output buffers by name (None for a direction ``q`` does
    not write), sized from the layout (capacity_sizes) for any split of
    ``rows`` rows into the members (``uniform``: equal members, exact sizes)."""
    sizes = capacity_sizes(q, num_tensors, rows, k, uniform=uniform)
    dtypes = buffer_dtypes(q, None)
    mk = lambda name, wanted: torch.empty(sizes[name], dtype=dtypes[name], device=device) if wanted else None  # noqa: E731
    return {"rowwise_data": mk("rowwise_data", q.rowwise), "scale_inv": mk("scale_inv", q.rowwise),
            "columnwise_data": mk("columnwise_data", q.columnwise),
            "columnwise_scale_inv": mk("columnwise_scale_inv", q.columnwise)}


def _with_layout(q: Float8BlockQuantizer, g: GroupedTensor, bufs: dict) -> GroupedTensor:
    """Quantized buffers with g's metadata.  Built without the constructor's
    checks: the buffers were sized from g's layout and g was validated when
    it was made."""
    return GroupedTensor._rebuild(
        (g.num_tensors, g.logical_shape, g.dtype, q, False),
        dict(bufs, first_dims=g.first_dims, tensor_offsets=g.tensor_offsets, padded_row_offsets=g.padded_row_offsets,
             offsets_status=g.offsets_status))


def allocate(q: Float8BlockQuantizer, g: GroupedTensor) -> GroupedTensor:
    """Uninitialised output buffers for the members of ``g``, carrying g's metadata."""
    rows, k = g.logical_shape
    return _with_layout(q, g, _buffers(q, g.num_tensors, rows, k, g.shape_kind is ShapeKind.SAME_SHAPE, g.device))


def group_quantize(g: GroupedTensor, q: Float8BlockQuantizer, *, noop_flag=None, output=None,
                   with_dbias: bool) -> Tuple[GroupedTensor, Optional[torch.Tensor]]:
    rows, k = g.logical_shape
    _check_k(k)
    check_noop(noop_flag, g.device)
    x = g.rowwise_data
    if x.data_ptr() % 16:
        raise ValueError("x must be 16-byte aligned")
    if output is not None:
        check_output(output, q, g)
        out = output
        adopt_metadata(out, g)
    else:
        out = allocate(q, g)
    tiles = max_row_tiles(g)
    ws = dbias = None
    if with_dbias:
        ws = torch.empty((max(tiles, 1), k), dtype=torch.float32, device=g.device)
        dbias = torch.empty((g.num_tensors, k), dtype=g.dtype, device=g.device)
    _launch_grouped(x.view(rows, k), g, q, out, noop_flag=noop_flag, dbias_workspace=ws, tiles=tiles)
    if with_dbias:
        if rows == 0 or k == 0:
            dbias.zero_()
        else:
            ext().fp8_block_dbias_reduce(ws, g.padded_row_offsets, g.num_tensors, rows, dbias, noop_flag)
    return out, dbias


def _launch_grouped(x: torch.Tensor, g: GroupedTensor, q: Float8BlockQuantizer, out: GroupedTensor, *,
                    noop_flag=None, dbias_workspace=None, tiles: int) -> None:
    """The grouped quantize kernel over the members of ``g`` into ``out``."""
    _launch(x, g.padded_row_offsets, g.num_tensors, q, {n: getattr(out, n) for n in _BUFS}, noop_flag=noop_flag,
            dbias_workspace=dbias_workspace, tiles=tiles)


def _launch(x: torch.Tensor, padded_row_offsets, num_tensors: int, q: Float8BlockQuantizer, bufs: dict, *,
            noop_flag=None, dbias_workspace=None, tiles: int, row_source=None) -> None:
    """x: the (rows, K) input, or with ``row_source`` the token matrix the
    rows are gathered from; ``bufs``: the output buffers by name (those of
    a direction ``q`` does not write are not passed)."""
    row, col = (lambda n: bufs[n] if q.rowwise else None), (lambda n: bufs[n] if q.columnwise else None)
    ext().fp8_block_quantize(
        x, padded_row_offsets, num_tensors, q.fp8_dtype == torch.float8_e5m2, q.block_dim, q.pow2_scales,
        q.amax_epsilon, row("rowwise_data"), row("scale_inv"), col("columnwise_data"), col("columnwise_scale_inv"),
        True, noop_flag, dbias_workspace, tiles, row_source)


#: token dtypes the gathering kernels read
GATHER_DTYPES = (torch.bfloat16, torch.float16)


def check_gather_input(tokens: torch.Tensor) -> None:
    """What :func:`gather_quantize` needs of the tokens (checked before any launch)."""
    _check_k(tokens.shape[1])
    if tokens.dtype not in GATHER_DTYPES:
        raise TypeError(f"tokens must be bfloat16 or float16 to be quantized as they are gathered, got "
                        f"{tokens.dtype}")
    if not tokens.is_contiguous():
        raise ValueError("tokens must be contiguous to be quantized as they are gathered")


def gather_layout(tokens: torch.Tensor, rows, first_dims: torch.Tensor) -> GroupedTensor:
    """The members and offsets of ``rows`` grouped rows of ``tokens``' width
    (``first_dims`` rows per member), without data of their own: a
    zero-stride placeholder stands in for the (rows, K) input they describe."""
    k = tokens.shape[1]
    return GroupedTensor(num_tensors=first_dims.numel(), logical_shape=(rows, k), dtype=tokens.dtype,
                         rowwise_data=tokens.new_empty(1).expand(rows * k), first_dims=first_dims)


def produced(q: Float8BlockQuantizer):
    """The buffers a quantization with ``q`` writes, in the order the gathering entry points return them."""
    return (["rowwise_data", "scale_inv"] if q.rowwise else []) + \
        (["columnwise_data", "columnwise_scale_inv"] if q.columnwise else [])


def gather_buffers(tokens: torch.Tensor, rows, num_tensors: int, q: Float8BlockQuantizer):
    """Uninitialised buffers of a gathered quantization (:func:`produced`
    order), sized for any split of ``rows`` rows."""
    bufs = _buffers(q, num_tensors, rows, tokens.shape[1], False, tokens.device)
    return [bufs[n] for n in produced(q)]


def gather_quantize_impl(tokens: torch.Tensor, row_source: torch.Tensor, padded_row_offsets: torch.Tensor,
                         num_tensors: int, q: Float8BlockQuantizer):
    """The kernel launch of :func:`gather_quantize` (arguments checked
    there): its buffers, in :func:`produced` order."""
    if tokens.data_ptr() % 16:  # (the kernels read 16-byte vectors; a copy of T rows beats making the k*T rows)
        tokens = tokens.clone()
    rows = row_source.shape[0]
    bufs = gather_buffers(tokens, rows, num_tensors, q)
    _launch(tokens, padded_row_offsets, num_tensors, q, dict(zip(produced(q), bufs)),
            tiles=row_tiles_bound(rows, num_tensors), row_source=row_source)
    return bufs


def gather_quantize(tokens: torch.Tensor, row_source: torch.Tensor, first_dims: torch.Tensor,
                    q: Float8BlockQuantizer) -> GroupedTensor:
    """group_quantize of the grouped rows ``tokens[row_source[r]]`` (a zero
    row where row_source[r] is -1), members ``first_dims``, read straight
    from ``tokens`` (the kernels' QuantizeArgs::row_source): the rows are
    never made.  Tokens as :func:`check_gather_input` requires (the
    caller checks, before its own launches; misaligned tokens are copied
    first).  Traced calls go through ``lpmoe::gather_quantize``."""
    layout = gather_layout(tokens, row_source.shape[0], first_dims)
    if tracing():
        bufs = OPS["gather_quantize"](tokens, row_source, layout, q)
    else:
        bufs = gather_quantize_impl(tokens, row_source, layout.padded_row_offsets, layout.num_tensors, q)
    return _with_layout(q, layout, dict(dict.fromkeys(_BUFS), **dict(zip(produced(q), bufs))))


def group_dequantize(grouped: GroupedTensor, dtype: torch.dtype) -> GroupedTensor:
    q = grouped.quantizer
    rows, k = grouped.logical_shape
    _check_k(k)
    columnwise = grouped.rowwise_data is None
    data = grouped.columnwise_data if columnwise else grouped.rowwise_data
    scale = grouped.columnwise_scale_inv if columnwise else grouped.scale_inv
    if data is None or scale is None:
        raise ValueError("grouped holds no FP8 data to dequantize")
    out = torch.empty(rows * k, dtype=dtype, device=grouped.device)
    ext().fp8_block_dequantize(data, scale, columnwise, True, q.fp8_dtype == torch.float8_e5m2, q.block_dim,
                               rows, k, grouped.padded_row_offsets, grouped.num_tensors, out,
                               max_row_tiles(grouped))
    return GroupedTensor(num_tensors=grouped.num_tensors, logical_shape=grouped.logical_shape, dtype=dtype,
                         rowwise_data=out, first_dims=grouped.first_dims, tensor_offsets=grouped.tensor_offsets,
                         padded_row_offsets=grouped.padded_row_offsets, _trusted_offsets=True)


def quantize_single(x: torch.Tensor, q: Float8BlockQuantizer) -> Fp8BlockQuantized:
    m, k = x.shape
    _check_k(k)
    x = x.contiguous()
    if x.data_ptr() % 16:
        x = x.clone()
    dev = x.device
    data = torch.empty((m, k), dtype=q.fp8_dtype, device=dev) if q.rowwise else None
    scale = torch.empty(q.get_scale_shape((m, k)), dtype=torch.float32, device=dev) if q.rowwise else None
    cdata = torch.empty((k, m), dtype=q.fp8_dtype, device=dev) if q.columnwise else None
    cscale = torch.empty(q.get_scale_shape((m, k), columnwise=True), dtype=torch.float32, device=dev) \
        if q.columnwise else None
    if m and k:
        ext().fp8_block_quantize(x, None, 1, q.fp8_dtype == torch.float8_e5m2, q.block_dim, q.pow2_scales,
                                 q.amax_epsilon, data, scale, cdata, cscale, False, None, None, cdiv(m, 128), None)
    elif scale is not None:
        scale.zero_()  # only padding entries exist (e.g. M=0 < round_up(M,4) is 0; K=0 has none)
    return Fp8BlockQuantized(data=data, scale_inv=scale, columnwise_data=cdata, columnwise_scale_inv=cscale,
                             fp8_dtype=q.fp8_dtype, block_dim=q.block_dim)


def dequantize_single(t: Fp8BlockQuantized, dtype: torch.dtype) -> torch.Tensor:
    columnwise = t.data is None
    data = t.columnwise_data if columnwise else t.data
    scale = t.columnwise_scale_inv if columnwise else t.scale_inv
    m, k = (data.shape[1], data.shape[0]) if columnwise else tuple(data.shape)
    _check_k(k)
    if scale is None or scale.dtype != torch.float32:
        raise TypeError("FP8 block scale_inv must be a float32 tensor")
    need = block_scale_shape(m, k, t.block_dim, columnwise)
    if scale.numel() < need[0] * need[1] or data.dtype != t.fp8_dtype:
        raise ValueError(f"scale_inv must hold the {need} GEMM-ready layout and data must be {t.fp8_dtype}; "
                         f"got {tuple(scale.shape)} and {data.dtype}")
    out = torch.empty((m, k), dtype=dtype, device=data.device)
    if m and k:
        ext().fp8_block_dequantize(data.contiguous(), scale.contiguous(), columnwise, False,
                                   t.fp8_dtype == torch.float8_e5m2, t.block_dim, m, k, None, 1, out, cdiv(m, 128))
    return out
