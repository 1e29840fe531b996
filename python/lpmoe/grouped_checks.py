"""Validation of what a GroupedTensor is built from.

Run by the checking constructor before any kernel sees the buffers, so a
wrong dtype, a short buffer or malformed dims is a clear error naming the
argument, never an out-of-bounds access.  Nothing here reads a GPU value
on the host: device dims are checked for type and shape only (their values
are the offsets kernel's status, `GroupedTensor.check_device_metadata`);
CPU dims and sums are checked fully.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from lpmoe.grouped_layout import ShapeKind, buffer_dtypes, capacity_sizes
from lpmoe.library.routing import tracing
from lpmoe.quantizers import MXFP8Quantizer

if TYPE_CHECKING:
    from lpmoe.grouped_tensor import GroupedTensor

__all__ = ["as_dims", "check_buffers", "check_host_sums", "check_tensor_offsets"]


def as_dims(dims, name: str, n: int, device: torch.device) -> torch.Tensor:
    """Validate a per-member dims tensor; convert to int64 (device op, no sync)."""
    if not isinstance(dims, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of int32/int64, got {type(dims).__name__}")
    if dims.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be int32 or int64, got {dims.dtype}")
    if dims.dim() != 1 or dims.numel() != n:
        raise ValueError(f"{name} must be 1-D with num_tensors={n} entries, got shape {tuple(dims.shape)}")
    if dims.device != device:
        raise ValueError(f"{name} must be on {device} (the data's device), got {dims.device}")
    if dims.device.type == "cpu" and not tracing() and bool((dims < 0).any()):
        raise ValueError(f"{name} must be non-negative, got {dims.tolist()}")
    return dims.to(torch.int64).contiguous()


def check_tensor_offsets(tensor_offsets: torch.Tensor, n: int, device: torch.device) -> None:
    """Caller-provided CSR element offsets: N+1 int64 entries on the data's device."""
    if tensor_offsets.dtype != torch.int64 or tensor_offsets.dim() != 1:
        raise TypeError(f"tensor_offsets must be 1-D int64, got {tensor_offsets.dtype} "
                        f"shape {tuple(tensor_offsets.shape)}")
    if tensor_offsets.numel() != n + 1:
        raise ValueError(f"tensor_offsets must have num_tensors+1 = {n + 1} entries (CSR), "
                         f"got {tensor_offsets.numel()}")
    if tensor_offsets.device != device:
        raise ValueError(f"tensor_offsets must be on {device}, got {tensor_offsets.device}")


def check_buffers(g: "GroupedTensor") -> None:
    """Every buffer has the dtype of its format and at least the size the
    layout needs, so no kernel can read or write past it."""
    rows, cols = g.logical_shape
    q = g.quantizer
    if q is None:
        for name in ("rowwise_data", "columnwise_data"):
            b = getattr(g, name)
            if b is None:
                continue
            if b.dtype != g.dtype:
                raise TypeError(f"{name} has dtype {b.dtype}, expected {g.dtype} (the group's dtype)")
            if b.numel() < rows * cols:
                raise ValueError(f"{name} holds {b.numel()} elements, the logical shape {g.logical_shape} "
                                 f"needs {rows * cols}")
        return
    dtypes = buffer_dtypes(q, g.dtype)
    if g.shape_kind in (ShapeKind.SAME_SHAPE, ShapeKind.VARYING_FIRST):
        need = capacity_sizes(q, g.num_tensors, rows, cols, uniform=g.shape_kind is ShapeKind.SAME_SHAPE)
    else:
        per = 32 if isinstance(q, MXFP8Quantizer) else 1
        need = {"rowwise_data": rows * cols, "columnwise_data": rows * cols, "scale_inv": rows * cols // per,
                "columnwise_scale_inv": rows * cols // per, "amax": 0, "columnwise_amax": 0}
    for name, size in need.items():
        b = getattr(g, name)
        if b is None:
            continue
        if b.dtype != dtypes[name]:
            raise TypeError(f"{name} has dtype {b.dtype}, expected {dtypes[name]} for {type(q).__name__}")
        if b.numel() < size:
            raise ValueError(f"{name} holds {b.numel()} elements, this layout needs {size}")


def check_host_sums(g: "GroupedTensor") -> None:
    """The members fit the buffer (CPU dims: read without a device sync)."""
    rows, cols = g.logical_shape
    kind = g.shape_kind
    if kind is ShapeKind.VARYING_FIRST and int(g.first_dims.sum()) > rows:
        raise ValueError(f"sum of first_dims ({int(g.first_dims.sum())}) exceeds the buffer's rows ({rows})")
    if kind is ShapeKind.VARYING_LAST and int(g.last_dims.sum()) > cols:
        raise ValueError(f"sum of last_dims ({int(g.last_dims.sum())}) exceeds the logical columns ({cols})")
    if kind is ShapeKind.VARYING_BOTH and int((g.first_dims * g.last_dims).sum()) > cols:
        raise ValueError("sum of first_dims*last_dims exceeds the buffer's elements")
