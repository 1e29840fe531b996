"""GroupedTensor: N tensors in flat buffers, metadata on the device.

Members are 2-D (M_t, K_t).  Four shape kinds:

* SAME_SHAPE     every member (M, K); logical shape (N*M, K)
* VARYING_FIRST  members (M_t, K);   logical shape (rows, K), rows >= sum M_t
                 (rows past the sum are a capacity tail, ignored by kernels)
* VARYING_LAST   members (M, K_t);   logical shape (M, sum K_t)
* VARYING_BOTH   members (M_t, K_t); logical shape (1, sum M_t*K_t)

``first_dims`` / ``last_dims`` (int64, on the data's device) exist only for
the dims that vary; ``tensor_offsets`` holds N+1 int64 element offsets (CSR).
For VARYING_FIRST / SAME_SHAPE tensors, ``padded_row_offsets`` (5, N+1) holds
the row prefix sums rounded per member to 1, 4, 64, 128 and 512 rows, from which
every quantized buffer's member base offset follows (lpmoe.grouped_layout).
All offsets are computed on the device in one launch: nothing here syncs,
except the methods documented as host-syncing (``split``, ``members``,
``member_shapes``, ``check_device_metadata``).
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from lpmoe import _sizes, grouped_members
from lpmoe._async_inputs import ready
from lpmoe.grouped_checks import as_dims, check_buffers, check_host_sums, check_tensor_offsets
from lpmoe.grouped_layout import PADDED_ROW_ALIGNS, ShapeKind, buffer_dtypes, capacity_sizes, output_buffer
from lpmoe.grouped_offsets import (offsets_bulk_of, offsets_memo, offsets_pitch, shares_offsets, sharing_offsets,
                                   splits_to_offsets)
from lpmoe.library.routing import tracing
from lpmoe.quantizers import Quantizer, shared_copy
from lpmoe.reference.numerics import check_float_matrix

__all__ = ["GroupedTensor", "ShapeKind", "sharing_offsets", "shares_offsets"]

_HP_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


_TENSOR_FIELDS = ("rowwise_data", "columnwise_data", "scale_inv", "columnwise_scale_inv", "amax", "columnwise_amax",
                  "first_dims", "last_dims", "tensor_offsets", "padded_row_offsets")


# derived element offsets are the align-1 row offsets times the width
_ALIGN_ONE = PADDED_ROW_ALIGNS.index(1)


class GroupedTensor:
    """N tensors in one set of flat buffers (see module docstring)."""

    def __init__(
        self,
        *,
        num_tensors: int,
        logical_shape: Sequence[int],
        dtype: torch.dtype,
        quantizer: Optional[Quantizer] = None,
        rowwise_data: Optional[torch.Tensor] = None,
        columnwise_data: Optional[torch.Tensor] = None,
        scale_inv: Optional[torch.Tensor] = None,
        columnwise_scale_inv: Optional[torch.Tensor] = None,
        amax: Optional[torch.Tensor] = None,
        columnwise_amax: Optional[torch.Tensor] = None,
        first_dims: Optional[torch.Tensor] = None,
        last_dims: Optional[torch.Tensor] = None,
        tensor_offsets: Optional[torch.Tensor] = None,
        padded_row_offsets: Optional[torch.Tensor] = None,
        with_gemm_swizzled_scales: bool = False,
        _trusted_offsets: bool = False,
    ):
        """``padded_row_offsets`` is derived data (the kernels index scale
        and transposed buffers with it): a value passed by the caller is
        ignored and recomputed from the dims, unless ``_trusted_offsets``
        (library-internal: it was produced by lpmoe's offsets kernel for
        exactly these dims)."""
        rowwise_data, columnwise_data, scale_inv, columnwise_scale_inv = map(
            ready, (rowwise_data, columnwise_data, scale_inv, columnwise_scale_inv))
        amax, columnwise_amax, first_dims, last_dims, tensor_offsets = map(
            ready, (amax, columnwise_amax, first_dims, last_dims, tensor_offsets))
        if isinstance(num_tensors, torch.SymInt):  # traced with dynamic shapes: member counts are static
            num_tensors = int(num_tensors)
        if not isinstance(num_tensors, int) or num_tensors < 1:
            raise ValueError(f"num_tensors must be a positive int, got {num_tensors!r}")
        logical_shape = tuple(_sizes.size(d) for d in logical_shape)
        if len(logical_shape) != 2 or any(d < 0 for d in logical_shape):
            raise ValueError(f"logical_shape must be 2-D and non-negative, got {logical_shape}")
        if dtype not in _HP_DTYPES:
            raise TypeError(f"dtype (the high-precision dtype) must be one of {_HP_DTYPES}, got {dtype}")
        if quantizer is not None and not isinstance(quantizer, Quantizer):
            raise TypeError(f"quantizer must be an lpmoe Quantizer or None, got {type(quantizer).__name__}")
        buffers = [rowwise_data, columnwise_data]
        if all(b is None for b in buffers):
            raise ValueError("a GroupedTensor needs rowwise_data or columnwise_data")
        device = next(b for b in buffers if b is not None).device
        for name, b in (("rowwise_data", rowwise_data), ("columnwise_data", columnwise_data),
                        ("scale_inv", scale_inv), ("columnwise_scale_inv", columnwise_scale_inv),
                        ("amax", amax), ("columnwise_amax", columnwise_amax)):
            if b is not None and b.device != device:
                raise ValueError(f"{name} is on {b.device}, expected {device} like the data")
        n = num_tensors
        self.num_tensors = n
        self.logical_shape = logical_shape
        self.dtype = dtype
        self.quantizer = quantizer
        self.rowwise_data = rowwise_data
        self.columnwise_data = columnwise_data
        self.scale_inv = scale_inv
        self.columnwise_scale_inv = columnwise_scale_inv
        self.amax = amax
        self.columnwise_amax = columnwise_amax
        self.first_dims = None if first_dims is None else as_dims(first_dims, "first_dims", n, device)
        self.last_dims = None if last_dims is None else as_dims(last_dims, "last_dims", n, device)
        self.with_gemm_swizzled_scales = bool(with_gemm_swizzled_scales)

        rows, cols = logical_shape
        kind = self.shape_kind
        check_buffers(self)
        if kind is ShapeKind.SAME_SHAPE and rows % n:
            raise ValueError(f"same-shape group: logical rows {rows} not divisible by num_tensors {n}")
        if kind is ShapeKind.VARYING_BOTH and rows != 1:
            raise ValueError(f"varying-both groups have logical shape (1, total elements), got {logical_shape}")
        if device.type == "cpu" and not tracing():  # (traced: fake tensors hold no values)
            check_host_sums(self)  # host-visible: check sums now (no sync involved)

        if tensor_offsets is not None:
            check_tensor_offsets(tensor_offsets, n, device)
        if not _trusted_offsets:
            padded_row_offsets = None
        if padded_row_offsets is not None and tuple(padded_row_offsets.shape) != (len(PADDED_ROW_ALIGNS), n + 1):
            raise ValueError(f"padded_row_offsets must have shape {(len(PADDED_ROW_ALIGNS), n + 1)}, "
                             f"got {tuple(padded_row_offsets.shape)}")
        self.tensor_offsets = tensor_offsets
        self.padded_row_offsets = padded_row_offsets
        self.offsets_status: Optional[torch.Tensor] = None
        needs_rows = kind in (ShapeKind.SAME_SHAPE, ShapeKind.VARYING_FIRST) and padded_row_offsets is None
        if self.tensor_offsets is None or needs_rows:
            # Caller-provided tensor_offsets are kept as given; the padded row
            # prefix sums still come from the dims (same single launch).
            given = self.tensor_offsets
            self._compute_offsets(element_offsets=given is None)
            if given is not None:
                self.tensor_offsets = given

    # ------------------------------------------------------------------ shape
    @property
    def shape_kind(self) -> ShapeKind:
        if self.first_dims is None and self.last_dims is None:
            return ShapeKind.SAME_SHAPE
        if self.last_dims is None:
            return ShapeKind.VARYING_FIRST
        if self.first_dims is None:
            return ShapeKind.VARYING_LAST
        return ShapeKind.VARYING_BOTH

    @property
    def device(self) -> torch.device:
        return (self.rowwise_data if self.rowwise_data is not None else self.columnwise_data).device

    @property
    def is_quantized(self) -> bool:
        return self.quantizer is not None

    @property
    def common_first_dim(self) -> Optional[int]:
        kind = self.shape_kind
        if kind is ShapeKind.SAME_SHAPE:
            return self.logical_shape[0] // self.num_tensors
        if kind is ShapeKind.VARYING_LAST:
            return self.logical_shape[0]
        return None

    @property
    def common_last_dim(self) -> Optional[int]:
        kind = self.shape_kind
        if kind in (ShapeKind.SAME_SHAPE, ShapeKind.VARYING_FIRST):
            return self.logical_shape[1]
        return None

    # ---------------------------------------------------------------- offsets
    def _compute_offsets(self, element_offsets: bool = True) -> None:
        """Fill tensor_offsets (+ padded_row_offsets) in one device launch,
        or take them from a group made earlier over the same dims in the same
        :func:`sharing_offsets` scope (``element_offsets=False``: the caller
        brings its own tensor_offsets).

        A VARYING_FIRST group of another width over the same dims and rows
        shares the row offsets and status, and takes its element offsets as
        the align-1 row offsets times its width (capacity truncation and the
        status depend on the rows alone): a small elementwise launch, once per
        width in the scope, instead of the offsets kernel (~40 us of host time
        on the H100 machine).  So the first width of a scope holds views of
        the kernel's buffer and later widths hold derived tensors; a traced
        call runs the same code in the same order, so its saved layout is
        the real one's."""
        n = self.num_tensors
        rows, cols = self.logical_shape
        kind = self.shape_kind
        dev = self.device
        by_rows = kind is ShapeKind.VARYING_FIRST
        memo = offsets_memo()
        hit = key = None
        if memo is not None:
            # Keyed by the dims' identity, so built only inside a scope (the layer
            # ops' implementations): Dynamo in torch 2.11 cannot take id() of a
            # tensor made inside a compiled region, which user code may do.
            key = (kind, n, _sizes.key(rows), None if by_rows else _sizes.key(cols), id(self.first_dims),
                   id(self.last_dims), dev)
            hit = memo.get(key)
        if hit is not None:
            self.padded_row_offsets, self.offsets_status, by_width = hit[:3]
            width = _sizes.key(cols)
            offsets = by_width.get(width)
            if offsets is None and element_offsets:
                offsets = by_width[width] = self.padded_row_offsets[_ALIGN_ONE] * cols
            self.tensor_offsets = offsets
            return
        self._launch_offsets(n, rows, cols, kind, dev)
        if memo is not None:
            # the dims stay referenced by the memo, so their ids stay unique in the scope
            memo[key] = (self.padded_row_offsets, self.offsets_status, {_sizes.key(cols): self.tensor_offsets},
                         self.first_dims, self.last_dims)

    def _launch_offsets(self, n: int, rows: int, cols: int, kind: ShapeKind, dev: torch.device) -> None:
        if kind in (ShapeKind.SAME_SHAPE, ShapeKind.VARYING_FIRST):
            strides = [cols] + [1] * len(PADDED_ROW_ALIGNS)
            aligns = [1] + list(PADDED_ROW_ALIGNS)
            if kind is ShapeKind.SAME_SHAPE:
                bulk = offsets_bulk_of(None, strides, aligns, num_splits=n, uniform_split=rows // n, device=dev)
            else:
                bulk = offsets_bulk_of(self.first_dims, strides, aligns, capacity_rows=rows)
            # The arrays sit at a fixed pitch in one buffer: the element
            # offsets, then one strided (5, N+1) view of the padded row
            # offsets (no copy; same layout on CPU and GPU), then the status.
            pitch = offsets_pitch(n)
            self.tensor_offsets = bulk[:n + 1]
            self.padded_row_offsets = bulk[pitch:].as_strided((len(PADDED_ROW_ALIGNS), n + 1), (pitch, 1))
            self.offsets_status = bulk[pitch * len(strides):pitch * len(strides) + 1]
            return
        if kind is ShapeKind.VARYING_LAST:
            res = splits_to_offsets(self.last_dims, [rows], [1])
        else:
            res = splits_to_offsets(self.first_dims, [1], [1], second=self.last_dims, times_second=[True])
        self.tensor_offsets = res.offsets[0]
        self.offsets_status = res.status

    def check_device_metadata(self) -> None:
        """Raise if the device-side dims were inconsistent (negative, or sum
        above the buffer's capacity).  Reads a device flag: **host sync**.
        Graph-safe paths never call this; kernels clamp to the buffer so bad
        dims cannot write out of bounds."""
        if self.offsets_status is not None:
            s = int(self.offsets_status.item())
            if s & 1:
                raise ValueError("first_dims/last_dims contain a negative value")
            if s & 2:
                raise ValueError("sum of first_dims exceeds the buffer's rows")

    # ---------------------------------------------------------- constructors
    @classmethod
    def from_dense(cls, x: torch.Tensor, num_tensors: Optional[int] = None,
                   first_dims: Optional[torch.Tensor] = None) -> "GroupedTensor":
        """Wrap a dense 2-D tensor without copying.

        With ``first_dims`` (int tensor on x's device; a CUDA tensor is never
        read on the host) members are consecutive row blocks; rows past
        sum(first_dims) are a capacity tail.  Without it, x splits into
        ``num_tensors`` equal row blocks."""
        check_float_matrix(x, "x")
        if not x.is_contiguous():
            raise ValueError("x must be contiguous (it is wrapped without copying)")
        if first_dims is not None:
            n = first_dims.numel() if num_tensors is None else num_tensors
        elif num_tensors is None:
            raise ValueError("give num_tensors or first_dims")
        else:
            n = num_tensors
        return cls(num_tensors=int(n), logical_shape=tuple(x.shape), dtype=x.dtype, rowwise_data=x.view(-1),
                   first_dims=first_dims)

    @classmethod
    def from_flat(cls, data: torch.Tensor, num_tensors: int, *, first_dims: Optional[torch.Tensor] = None,
                  last_dims: Optional[torch.Tensor] = None, first_dim: Optional[int] = None,
                  total_last: Optional[int] = None) -> "GroupedTensor":
        """Wrap a flat 1-D buffer of members with varying last dims (common
        ``first_dim``) or varying both dims, without copying."""
        if data.dim() != 1:
            raise ValueError(f"data must be 1-D (flat), got shape {tuple(data.shape)}")
        if last_dims is None:
            raise ValueError("from_flat is for varying last dims: give last_dims (use from_dense otherwise)")
        if first_dims is None:
            if first_dim is None or first_dim < 0:
                raise ValueError("varying-last groups need the common first_dim")
            if data.numel() % max(first_dim, 1):
                raise ValueError(f"flat buffer of {data.numel()} elements is not a multiple of first_dim {first_dim}")
            shape = (first_dim, total_last if total_last is not None else data.numel() // max(first_dim, 1))
        else:
            shape = (1, data.numel())
        return cls(num_tensors=num_tensors, logical_shape=shape, dtype=data.dtype, rowwise_data=data,
                   first_dims=first_dims, last_dims=last_dims)

    @classmethod
    def from_tensors(cls, tensors: Sequence[torch.Tensor]) -> "GroupedTensor":
        """Copy a list of 2-D tensors (same dtype and device) into one buffer.
        The shape kind follows from which dims differ."""
        if len(tensors) == 0:
            raise ValueError("tensors must be a non-empty list")
        t0 = tensors[0]
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor) or t.dim() != 2:
                raise ValueError(f"tensors[{i}] must be a 2-D tensor")
            if t.dtype != t0.dtype or t.device != t0.device:
                raise ValueError(f"tensors[{i}] has dtype/device {t.dtype}/{t.device}, expected {t0.dtype}/{t0.device}")
        ms = [t.shape[0] for t in tensors]
        ks = [t.shape[1] for t in tensors]
        same_m, same_k = len(set(ms)) == 1, len(set(ks)) == 1
        flat = torch.cat([t.reshape(-1) for t in tensors]) if sum(t.numel() for t in tensors) else \
            torch.empty(0, dtype=t0.dtype, device=t0.device)
        n = len(tensors)
        dims = lambda v: torch.tensor(v, dtype=torch.int64).to(t0.device)  # noqa: E731
        if same_k:
            fd = None if same_m else dims(ms)
            return cls(num_tensors=n, logical_shape=(sum(ms), ks[0]), dtype=t0.dtype, rowwise_data=flat,
                       first_dims=fd)
        if same_m:
            return cls._varying_last_from_list(tensors)
        return cls(num_tensors=n, logical_shape=(1, flat.numel()), dtype=t0.dtype, rowwise_data=flat,
                   first_dims=dims(ms), last_dims=dims(ks))

    @classmethod
    def _varying_last_from_list(cls, tensors):
        # Members stay contiguous one after another (member t at offsets[t]),
        # not interleaved as columns of one (M, sum K) matrix.
        t0 = tensors[0]
        flat = torch.cat([t.reshape(-1) for t in tensors])
        last = torch.tensor([t.shape[1] for t in tensors], dtype=torch.int64).to(t0.device)
        return cls.from_flat(flat, len(tensors), last_dims=last, first_dim=t0.shape[0],
                             total_last=sum(t.shape[1] for t in tensors))

    @classmethod
    def empty(cls, quantizer: Optional[Quantizer], num_tensors: int, logical_shape: Sequence[int], *,
              dtype: torch.dtype = torch.bfloat16, first_dims: Optional[torch.Tensor] = None,
              device=None) -> "GroupedTensor":
        """Allocate buffers for ``quantizer`` (None = high precision) able to
        hold any split of ``logical_shape[0]`` rows among the members (same
        shape when ``first_dims`` is None).  Contents are uninitialised."""
        rows, k = (_sizes.size(d) for d in logical_shape)
        if device is None:
            device = first_dims.device if first_dims is not None else torch.device("cuda")
        device = torch.device(device)
        sizes = capacity_sizes(quantizer, num_tensors, rows, k, uniform=first_dims is None)
        buf_dtype = buffer_dtypes(quantizer, dtype)
        bufs = {}
        for name, size in sizes.items():
            if quantizer is None:
                wanted = name == "rowwise_data"
            elif name in ("rowwise_data", "scale_inv"):
                wanted = quantizer.rowwise
            elif name in ("columnwise_data", "columnwise_scale_inv"):
                wanted = quantizer.columnwise
            else:  # amax buffers exist only where the format sizes them
                wanted = size > 0
            # Buffers a format produces exist even when empty, so shapes stay defined.
            bufs[name] = output_buffer(size, buf_dtype[name], device) if wanted else None
        swz = bool(getattr(quantizer, "swizzled_scales", False))
        return cls(num_tensors=num_tensors, logical_shape=(rows, k), dtype=dtype, quantizer=quantizer,
                   first_dims=first_dims, with_gemm_swizzled_scales=swz, **bufs)

    def direction_view(self, columnwise: bool, keep_other_scales: bool = False) -> "GroupedTensor":
        """The same quantized group holding only its rowwise or only its
        columnwise copy (shared buffers and metadata, no copy, no launch):
        what consumers pass on when they need exactly one direction.
        ``keep_other_scales`` keeps the other copy's scale buffer too (FP8
        128x128 weights: the dgrad GEMM reads the transposed data with the
        scales in the rowwise layout, which it would otherwise rebuild from
        the columnwise ones at every call; a few KB per layer)."""
        if not self.is_quantized:
            raise TypeError("direction_view needs a quantized GroupedTensor")
        have = self.columnwise_data if columnwise else self.rowwise_data
        if have is None:
            raise ValueError(f"this group has no {'columnwise' if columnwise else 'rowwise'} copy")
        bufs = ({"columnwise_data": self.columnwise_data, "columnwise_scale_inv": self.columnwise_scale_inv,
                 "columnwise_amax": self.columnwise_amax} if columnwise else
                {"rowwise_data": self.rowwise_data, "scale_inv": self.scale_inv})
        if keep_other_scales:
            other = "scale_inv" if columnwise else "columnwise_scale_inv"
            bufs[other] = getattr(self, other)
        # this group's buffers and metadata were validated when it was made:
        # the view is rebuilt without the constructor's checks (~30 us of host
        # time each; a layer step takes several views)
        return GroupedTensor._rebuild(
            (self.num_tensors, self.logical_shape, self.dtype,
             shared_copy(self.quantizer, rowwise=not columnwise, columnwise=columnwise),
             self.with_gemm_swizzled_scales),
            dict(bufs, amax=self.amax, first_dims=self.first_dims, last_dims=self.last_dims,
                 tensor_offsets=self.tensor_offsets, padded_row_offsets=self.padded_row_offsets,
                 offsets_status=self.offsets_status))

    # ------------------------------------------------------------- flatten
    def flatten(self) -> Tuple[List[torch.Tensor], tuple]:
        """(tensors, static metadata): every tensor this group holds and what
        :meth:`unflatten` needs to rebuild it, without copying (for saving
        through autograd's ``save_for_backward``)."""
        names = tuple(f for f in _TENSOR_FIELDS if getattr(self, f) is not None)
        meta = (names, self.num_tensors, self.logical_shape, self.dtype, self.quantizer,
                self.with_gemm_swizzled_scales)
        return [getattr(self, f) for f in names], meta

    @classmethod
    def unflatten(cls, tensors: Sequence[torch.Tensor], meta: tuple) -> "GroupedTensor":
        """Inverse of :meth:`flatten` (no launch: the offsets travel along)."""
        names, n, shape, dtype, quantizer, swizzled = meta
        return cls(num_tensors=n, logical_shape=shape, dtype=dtype, quantizer=quantizer,
                   with_gemm_swizzled_scales=swizzled, _trusted_offsets=True, **dict(zip(names, tensors)))

    @classmethod
    def _rebuild(cls, static: tuple, fields: dict) -> "GroupedTensor":
        """Library-internal inverse of :meth:`flatten` for a group lpmoe made
        and saved itself (a layer's backward), and the trusted constructor of
        groups lpmoe derives from validated ones (direction views, quantize
        outputs).  Its buffers and offsets were validated when it was made,
        so nothing is checked or recomputed here:
        a backward rebuilds several groups per call, and at launch-bound
        sizes the checks cost more host time than the kernels they feed.
        ``static``: (num_tensors, logical_shape, dtype, quantizer,
        with_gemm_swizzled_scales); ``fields``: tensors by field name
        (``offsets_status`` included), absent = None."""
        g = cls.__new__(cls)
        g.num_tensors, g.logical_shape, g.dtype, g.quantizer, g.with_gemm_swizzled_scales = static
        for f in _TENSOR_FIELDS:
            setattr(g, f, fields.get(f))
        g.offsets_status = fields.get("offsets_status")
        return g

    # ------------------------------------------------------------ host views
    def member_shapes(self) -> List[Tuple[int, int]]:
        """Per-member (M_t, K_t).  Reads device dims: **host sync**."""
        return grouped_members.member_shapes(self)

    def split(self) -> list:
        """Per-member views (no copies).  **Host sync** (reads dims); see
        :func:`lpmoe.grouped_members.split_members`."""
        return grouped_members.split_members(self)

    members = split

    def __repr__(self):
        return (f"GroupedTensor(num_tensors={self.num_tensors}, kind={self.shape_kind.value}, "
                f"logical_shape={self.logical_shape}, dtype={self.dtype}, quantizer={self.quantizer!r}, "
                f"device={self.device})")
