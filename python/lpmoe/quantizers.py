"""Quantizers: descriptions of the low-precision formats lpmoe produces.

A quantizer holds no data; it says which format to produce (FP8 block
scaling, MXFP8, NVFP4), which directions (rowwise, columnwise) and knows the
exact data and scale shapes of ``docs/formats-notes.md`` (which follows the
project spec, formats.md).  Shapes are for one 2-D tensor (M, K); grouped
layouts are built from them in ``lpmoe.grouped_layout``.

The quantizers lpmoe's layers attach to the groups they make are shared
(one object per configuration, :func:`shared_copy`) and frozen: assigning a
field raises; change a copy instead (``q.copy(rowwise=False)``).  Quantizers
you build, or get from a recipe's ``quantizer()``, are ordinary objects.
"""
from __future__ import annotations

from typing import Tuple, Union

import torch

from lpmoe import _sizes
from lpmoe._value_fields import ValueFields, shared

__all__ = [
    "Quantizer",
    "Float8BlockQuantizer",
    "MXFP8Quantizer",
    "NVFP4Quantizer",
    "resolve_fp8_dtype",
]

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_FP8_NAMES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _rup(a: int, b: int) -> int:
    return _cdiv(a, b) * b


def resolve_fp8_dtype(fp8_dtype: Union[str, torch.dtype]) -> torch.dtype:
    """Accept torch FP8 dtypes or the names 'e4m3' / 'e5m2'."""
    if isinstance(fp8_dtype, str):
        key = fp8_dtype.lower().replace("float8_", "").replace("fn", "")
        if key not in _FP8_NAMES:
            raise ValueError(f"fp8_dtype must be 'e4m3' or 'e5m2' (or a torch FP8 dtype), got {fp8_dtype!r}")
        return _FP8_NAMES[key]
    if fp8_dtype not in FP8_DTYPES:
        raise ValueError(
            f"fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {fp8_dtype!r}"
        )
    return fp8_dtype


def _check_shape(shape) -> Tuple[int, int]:
    # SymInts (a dynamic token count while tracing) stay symbolic
    if len(shape) != 2 or any((not isinstance(d, (int, torch.SymInt))) or d < 0 for d in shape):
        raise ValueError(f"shape must be a 2-D (M, K) of non-negative ints, got {tuple(shape)!r}")
    return _sizes.size(shape[0]), _sizes.size(shape[1])


class Quantizer(ValueFields):
    """Base class: direction flags and shape queries."""

    #: format name used in errors and reprs
    format_name = "abstract"
    #: elements per scale along the blocked dim
    block_len = 0

    def __init__(self, rowwise: bool = True, columnwise: bool = True):
        if not isinstance(rowwise, bool) or not isinstance(columnwise, bool):
            raise TypeError("rowwise and columnwise must be bool")
        if not (rowwise or columnwise):
            raise ValueError(f"{type(self).__name__}: at least one of rowwise/columnwise must be True")
        self.rowwise = rowwise
        self.columnwise = columnwise

    def get_data_shape(self, shape, columnwise: bool = False) -> Tuple[int, ...]:
        raise NotImplementedError

    def get_scale_shape(self, shape, columnwise: bool = False) -> Tuple[int, ...]:
        raise NotImplementedError

    def copy(self, **changes) -> "Quantizer":
        """A copy with some fields changed (e.g. ``columnwise=False``)."""
        kwargs = dict(self._fields())
        kwargs.update(changes)
        return type(self)(**kwargs)

    def _fields(self):
        return {"rowwise": self.rowwise, "columnwise": self.columnwise}



class Float8BlockQuantizer(Quantizer):
    """FP8 block scaling (DeepSeek-V3 style), formats.md §1.

    ``block_dim=1``: 1x128 blocks along K for rowwise data and 128x1 blocks
    along M for the (transposed) columnwise copy.  ``block_dim=2``: one scale
    per 128x128 tile, shared by both copies.  Scales are fp32 ``scale_inv``
    in the GEMM-ready, MN-major layout; padding entries are written as 0.
    """

    format_name = "fp8_block"
    block_len = 128

    def __init__(
        self,
        fp8_dtype: Union[str, torch.dtype] = torch.float8_e4m3fn,
        block_dim: int = 1,
        rowwise: bool = True,
        columnwise: bool = True,
        pow2_scales: bool = True,
        amax_epsilon: float = 0.0,
    ):
        super().__init__(rowwise, columnwise)
        self.fp8_dtype = resolve_fp8_dtype(fp8_dtype)
        if block_dim not in (1, 2):
            raise ValueError(f"block_dim must be 1 (1x128) or 2 (128x128), got {block_dim!r}")
        self.block_dim = int(block_dim)
        self.pow2_scales = bool(pow2_scales)
        amax_epsilon = float(amax_epsilon)
        if not amax_epsilon >= 0.0:  # also rejects NaN
            raise ValueError(f"amax_epsilon must be >= 0, got {amax_epsilon!r}")
        self.amax_epsilon = amax_epsilon

    def _fields(self):
        f = super()._fields()
        f.update(fp8_dtype=self.fp8_dtype, block_dim=self.block_dim, pow2_scales=self.pow2_scales,
                 amax_epsilon=self.amax_epsilon)
        return f

    def get_data_shape(self, shape, columnwise=False):
        m, k = _check_shape(shape)
        return (k, m) if columnwise else (m, k)  # columnwise copy is transposed

    def get_scale_shape(self, shape, columnwise=False):
        m, k = _check_shape(shape)
        if self.block_dim == 1:
            if columnwise:
                return (_cdiv(m, 128), _rup(k, 4))
            return (_cdiv(k, 128), _rup(m, 4))
        if columnwise:
            return (_cdiv(k, 128), _rup(_cdiv(m, 128), 4))
        return (_cdiv(m, 128), _rup(_cdiv(k, 128), 4))


class MXFP8Quantizer(Quantizer):
    """MXFP8: E8M0 scale per 32 elements (formats.md §2).

    Both data copies are (M, K) row-major (columnwise data is NOT transposed).
    Scales are uint8 E8M0 in the padded compact shape; with
    ``swizzled_scales=True`` the same bytes are stored in the GEMM swizzled
    order (formats.md §2.3).
    """

    format_name = "mxfp8"
    block_len = 32

    def __init__(self, fp8_dtype: Union[str, torch.dtype] = torch.float8_e4m3fn, rowwise: bool = True,
                 columnwise: bool = True, swizzled_scales: bool = False):
        super().__init__(rowwise, columnwise)
        self.fp8_dtype = resolve_fp8_dtype(fp8_dtype)
        self.swizzled_scales = bool(swizzled_scales)

    def _fields(self):
        f = super()._fields()
        f.update(fp8_dtype=self.fp8_dtype, swizzled_scales=self.swizzled_scales)
        return f

    def get_data_shape(self, shape, columnwise=False):
        return _check_shape(shape)

    def get_scale_shape(self, shape, columnwise=False):
        m, k = _check_shape(shape)
        if columnwise:
            return (_rup(_cdiv(m, 32), 4), _rup(k, 128))
        return (_rup(m, 128), _rup(_cdiv(k, 32), 4))


class NVFP4Quantizer(Quantizer):
    """NVFP4: E2M1 data, E4M3 scale per 16 elements, fp32 global amax (formats.md §3).

    Rowwise data is packed (M, K/2) bytes, even element in the low nibble;
    the columnwise copy is the transposed tensor, packed (K, M/2).  Needs
    M % 16 == 0 and K % 16 == 0.
    """

    format_name = "nvfp4"
    block_len = 16

    def __init__(self, rowwise: bool = True, columnwise: bool = True, swizzled_scales: bool = False):
        super().__init__(rowwise, columnwise)
        self.swizzled_scales = bool(swizzled_scales)

    def _fields(self):
        f = super()._fields()
        f.update(swizzled_scales=self.swizzled_scales)
        return f

    def _check(self, m, k):
        if m % 16 or k % 16:
            raise ValueError(f"NVFP4 needs both dims divisible by 16, got shape ({m}, {k})")

    def get_data_shape(self, shape, columnwise=False):
        m, k = _check_shape(shape)
        self._check(m, k)
        return (k, m // 2) if columnwise else (m, k // 2)

    def get_scale_shape(self, shape, columnwise=False):
        m, k = _check_shape(shape)
        self._check(m, k)
        if columnwise:
            return (_rup(k, 128), _rup(m // 16, 4))
        return (_rup(m, 128), _rup(k // 16, 4))


def shared_copy(quantizer: Quantizer, **changes) -> Quantizer:
    """``quantizer.copy(**changes)`` as one shared, frozen object per distinct
    result (lpmoe._value_fields.shared): the layers ask for the same few
    one-direction quantizers at every step (an FP8 MLP step built 13)."""
    return shared(quantizer, tuple(sorted(changes.items())), lambda: quantizer.copy(**changes))
