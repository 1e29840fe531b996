"""GEMM scale-factor swizzle ("128x4 tiles", formats.md §2.3).

A compact scale matrix S of shape (R, C), R % 128 == 0, C % 4 == 0, is stored as
128x4 tiles in tile-row-major order; inside a tile the 512 entries are laid out
as [row % 32][row // 32 (within the tile)][col % 4]:

    swz(i, j) = ((i // 128) * (C // 4) + j // 4) * 512
                + (i % 32) * 16 + ((i % 128) // 32) * 4 + j % 4

MXFP8 rowwise and both NVFP4 directions swizzle their compact matrix directly;
MXFP8 columnwise swizzles the TRANSPOSED compact matrix (§2.3, §9 item 5).
"""
from __future__ import annotations

from typing import Union

import torch

__all__ = ["swizzle_scales", "unswizzle_scales", "swizzled_index"]

IntOrTensor = Union[int, torch.Tensor]


def _check_padded(rows: int, cols: int, name: str) -> None:
    if rows % 128 != 0 or cols % 4 != 0:
        raise ValueError(
            f"{name} must be padded to rows % 128 == 0 and cols % 4 == 0, got ({rows}, {cols})")


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    # float8 tensors are moved around as raw bytes: only the order changes.
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t


def swizzled_index(i: IntOrTensor, j: IntOrTensor, cols: int) -> IntOrTensor:
    """Flat position of compact entry (i, j) of a (R, cols) matrix after swizzling."""
    if cols % 4 != 0:
        raise ValueError(f"cols must be a multiple of 4, got {cols}")
    n_tiles_x = cols // 4
    return (((i // 128) * n_tiles_x + j // 4) * 512
            + (i % 32) * 16 + ((i % 128) // 32) * 4 + j % 4)


def swizzle_scales(s: torch.Tensor) -> torch.Tensor:
    """Compact (R, C) scale matrix -> 1-D tensor of R*C entries in GEMM order."""
    if not isinstance(s, torch.Tensor):
        raise TypeError(f"s must be a torch.Tensor, got {type(s).__name__}")
    if s.dim() != 2:
        raise ValueError(f"s must be a 2-D (R, C) scale matrix, got shape {tuple(s.shape)}")
    rows, cols = s.shape
    _check_padded(rows, cols, "s")
    b = _as_bytes(s)
    # (tile_y, sub-block of 32 rows, row % 32, tile_x, col % 4)
    #   -> (tile_y, tile_x, row % 32, sub-block, col % 4)
    out = b.reshape(rows // 128, 4, 32, cols // 4, 4).permute(0, 3, 2, 1, 4).reshape(-1)
    return out.view(s.dtype) if b.dtype != s.dtype else out


def unswizzle_scales(flat: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of :func:`swizzle_scales`: 1-D swizzled scales -> compact (rows, cols)."""
    if not isinstance(flat, torch.Tensor):
        raise TypeError(f"flat must be a torch.Tensor, got {type(flat).__name__}")
    if flat.dim() != 1:
        raise ValueError(f"flat must be a 1-D swizzled scale tensor, got shape {tuple(flat.shape)}")
    _check_padded(rows, cols, "unswizzled shape (rows, cols)")
    if flat.numel() != rows * cols:
        raise ValueError(f"flat has {flat.numel()} entries, expected rows*cols = {rows * cols}")
    b = _as_bytes(flat)
    out = b.reshape(rows // 128, cols // 4, 32, 4, 4).permute(0, 3, 2, 1, 4).reshape(rows, cols)
    return out.view(flat.dtype) if b.dtype != flat.dtype else out
