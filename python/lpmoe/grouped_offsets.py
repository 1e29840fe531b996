"""Split sizes -> CSR offsets, computed where the splits live.

For CUDA splits this is one kernel launch (``lpmoe._C.splits_to_offsets``)
that writes every requested offset array into one bulk buffer, each array
16-byte aligned; nothing is read back to the host, so it is safe inside CUDA
graph capture and under ``torch.cuda.set_sync_debug_mode("error")``.  CPU
splits use plain PyTorch with the same results in the same layout.  Under
torch.compile the computation is the custom op ``lpmoe::splits_to_offsets``
(lpmoe.library), which returns the bulk buffer; the views are cut here.

Each output j is ``out_j[0] = 0``, ``out_j[t+1] = out_j[t] + round_up(s_t,
align_j) * stride_j`` (times ``second[t]`` when ``times_second[j]``), i.e.
N+1 int64 entries.

``sharing_offsets`` scopes one layer call: groups built over the same dims
tensor inside it share one offsets computation (see its docstring).
"""
from __future__ import annotations

import contextlib
import functools
import threading
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

from lpmoe import _sizes
from lpmoe._async_inputs import ready
from lpmoe._ext import ext
from lpmoe.library.routing import OPS, tracing

__all__ = ["OffsetsResult", "splits_to_offsets", "offsets_bulk_of", "offsets_pitch", "STATUS_NEGATIVE_SPLIT",
           "STATUS_ABOVE_CAPACITY", "sharing_offsets", "shares_offsets", "offsets_memo"]

STATUS_NEGATIVE_SPLIT = 1
STATUS_ABOVE_CAPACITY = 2


@dataclass
class OffsetsResult:
    offsets: List[torch.Tensor]   # each (N+1,) int64, views of ``bulk``
    status: torch.Tensor          # (1,) int64, STATUS_* bits; 0 = consistent
    bulk: Optional[torch.Tensor] = None  # the one buffer holding them all
    pitch: int = 0                # elements between consecutive outputs in ``bulk``

    def check(self) -> None:
        """Raise if the splits were inconsistent.  Reads the status: host sync."""
        s = int(self.status.item())
        if s & STATUS_NEGATIVE_SPLIT:
            raise ValueError("split sizes contain a negative value")
        if s & STATUS_ABOVE_CAPACITY:
            raise ValueError("sum of split sizes exceeds the buffer's rows (capacity)")


def _check_split_tensor(t: torch.Tensor, name: str, n: Optional[int]) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be int32 or int64, got {t.dtype}")
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    if n is not None and t.numel() != n:
        raise ValueError(f"{name} must have {n} entries (one per member), got {t.numel()}")


def splits_to_offsets(
    splits: Optional[torch.Tensor],
    strides: Sequence[int] = (1,),
    aligns: Optional[Sequence[int]] = None,
    *,
    num_splits: Optional[int] = None,
    uniform_split: Optional[int] = None,
    second: Optional[torch.Tensor] = None,
    times_second: Optional[Sequence[bool]] = None,
    capacity_rows: Optional[int] = None,
    device=None,
) -> OffsetsResult:
    """Compute several offset arrays from split sizes in one pass.

    Args:
        splits: (N,) int32/int64 split sizes, or None with ``uniform_split``
            and ``num_splits`` (every member the same size).
        strides: multiplier per output (e.g. 1 for rows, K for elements).
        aligns: round each split up to this multiple first (default 1).
        second: optional (N,) second size multiplied in by outputs whose
            ``times_second`` flag is set (element offsets of M_i x K_i members).
        capacity_rows: when given, the status flags a sum of splits above it
            and members are truncated there, so offsets never exceed buffers
            sized for that many rows.
        device: device for the uniform case (default: CUDA current device).
    """
    bulk = offsets_bulk_of(splits, strides, aligns, num_splits=num_splits, uniform_split=uniform_split,
                           second=second, times_second=times_second, capacity_rows=capacity_rows, device=device)
    return _views(bulk, int(num_splits) if splits is None else splits.numel(), len(strides))


def offsets_bulk_of(
    splits: Optional[torch.Tensor],
    strides: Sequence[int] = (1,),
    aligns: Optional[Sequence[int]] = None,
    *,
    num_splits: Optional[int] = None,
    uniform_split: Optional[int] = None,
    second: Optional[torch.Tensor] = None,
    times_second: Optional[Sequence[bool]] = None,
    capacity_rows: Optional[int] = None,
    device=None,
) -> torch.Tensor:
    """:func:`splits_to_offsets`'s arguments checked and its one buffer
    computed (``bulk_numel`` int64 elements, outputs at ``offsets_pitch``,
    then the status), without cutting the views: callers that need only a
    few of them (GroupedTensor) cut those themselves."""
    splits, second = ready(splits), ready(second)
    strides = [int(s) for s in strides]
    aligns = [1] * len(strides) if aligns is None else [int(a) for a in aligns]
    times_second = [False] * len(strides) if times_second is None else [bool(b) for b in times_second]
    if not (len(strides) == len(aligns) == len(times_second)):
        raise ValueError("strides, aligns and times_second must have the same length")
    if any(a < 1 for a in aligns):
        raise ValueError(f"aligns must be >= 1, got {aligns}")
    if capacity_rows is not None and capacity_rows < 0:
        raise ValueError(f"capacity_rows must be >= 0 (or None for unchecked), got {capacity_rows}")
    if any(times_second) and second is None:
        raise ValueError("times_second is set for an output but `second` is None")

    if splits is None:
        if uniform_split is None or num_splits is None:
            raise ValueError("without `splits`, give both `uniform_split` and `num_splits`")
        if uniform_split < 0 or num_splits < 0:
            raise ValueError("uniform_split and num_splits must be >= 0")
        n = int(num_splits)
        dev = torch.device(device) if device is not None else (
            second.device if second is not None else torch.device("cuda", torch.cuda.current_device()))
    else:
        _check_split_tensor(splits, "splits", num_splits)
        n = splits.numel()
        dev = splits.device
    if second is not None:
        _check_split_tensor(second, "second", n)
        if second.device != dev:
            raise ValueError(f"second is on {second.device} but splits are on {dev}")

    if tracing():
        bulk = OPS["splits_to_offsets"](splits, n, int(uniform_split or 0), strides, aligns, times_second, second,
                                        -1 if capacity_rows is None else _sizes.size(capacity_rows), dev)
    else:
        bulk = offsets_bulk(splits, n, int(uniform_split or 0), strides, aligns, times_second, second,
                            -1 if capacity_rows is None else _sizes.size(capacity_rows), dev)
    return bulk


def bulk_numel(num_splits: int, num_outputs: int) -> int:
    """Elements of the one int64 buffer holding every output: each output
    padded to an even count (16-byte aligned views), then a 2-slot status
    block (the layout csrc/binding/grouped_offsets.cpp allocates)."""
    return offsets_pitch(num_splits) * num_outputs + 2


def offsets_pitch(num_splits: int) -> int:
    """Elements between consecutive outputs in the bulk buffer."""
    return (num_splits + 2) // 2 * 2


def _views(bulk: torch.Tensor, n: int, num_outputs: int) -> OffsetsResult:
    pitch = offsets_pitch(n)
    outs = [bulk.narrow(0, j * pitch, n + 1) for j in range(num_outputs)]
    return OffsetsResult(offsets=outs, status=bulk.narrow(0, pitch * num_outputs, 1), bulk=bulk, pitch=pitch)


def offsets_bulk(splits, n: int, uniform_split: int, strides: List[int], aligns: List[int],
                 times_second: List[bool], second, capacity_rows: int, device: torch.device) -> torch.Tensor:
    """The offsets computation itself (validated arguments): the bulk buffer
    of :func:`bulk_numel` elements, on ``device``.  CUDA: one launch; CPU:
    the same arithmetic with torch ops, written in the same layout."""
    if device.type == "cuda":
        return ext().splits_to_offsets(
            None if splits is None else splits.contiguous(), n, uniform_split, strides, aligns, times_second,
            None if second is None else second.contiguous(), capacity_rows,
            device.index if device.index is not None else torch.cuda.current_device())
    bulk = torch.zeros(bulk_numel(n, len(strides)), dtype=torch.int64, device=device)
    pitch = offsets_pitch(n)
    if splits is None:
        s = torch.full((n,), uniform_split, dtype=torch.int64, device=device)
    else:
        s = splits.to(torch.int64)
    status = 0
    if bool((s < 0).any()) or (second is not None and bool((second < 0).any())):
        status |= STATUS_NEGATIVE_SPLIT
    s = s.clamp_min(0)
    sec = None if second is None else second.to(torch.int64).clamp_min(0)
    if capacity_rows >= 0:
        if int(s.sum()) > capacity_rows:
            status |= STATUS_ABOVE_CAPACITY
        # Truncate members at the capacity, like the device kernel.
        end = torch.cumsum(s, 0).clamp_max(capacity_rows)
        s = end - torch.cat([end.new_zeros(1), end[:-1]])
    for j, (stride, align, ts) in enumerate(zip(strides, aligns, times_second)):
        v = (s + (align - 1)) // align * align * stride
        if ts:
            v = v * sec
        torch.cumsum(v, 0, out=bulk[j * pitch + 1:j * pitch + n + 1])
    bulk[pitch * len(strides)] = status
    return bulk


# --------------------------------------------------- sharing within one call
class _Scopes(threading.local):
    def __init__(self):
        #: offsets memos of this thread's active sharing_offsets scopes (innermost last)
        self.stack: List[dict] = []


# Per thread: a buffer made for later calls on a helper thread
# (lpmoe._persistent) must not take offsets its caller's scope made.
_OFFSET_SCOPES = _Scopes()


@contextlib.contextmanager
def sharing_offsets():
    """Inside this scope, groups made with the same dims tensor (the same
    object) and the same logical shape share one offsets computation, and
    token-row groups of another width over the same dims and rows share its
    row offsets (their element offsets derived, see
    lpmoe.grouped_tensor.GroupedTensor._compute_offsets).  A layer call builds several groups over
    one routing (x, the activation, the gradients, each weight twice); at
    launch-bound sizes each launch costs more host time than its kernel.  Scoped to one call, so the dims
    cannot change in between and a CUDA-graph capture of the call records
    every offsets launch it reads (new routing per replay stays correct);
    the same objects are shared on fake tensors, so traced and real saved
    layouts agree."""
    stack = _OFFSET_SCOPES.stack
    stack.append({})
    try:
        yield
    finally:
        stack.pop()


def shares_offsets(fn):
    """Run ``fn`` in a :func:`sharing_offsets` scope."""
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with sharing_offsets():
            return fn(*args, **kwargs)
    return wrapped


def offsets_memo() -> Optional[dict]:
    """The innermost :func:`sharing_offsets` scope's memo on this thread, or
    None outside every scope."""
    stack = _OFFSET_SCOPES.stack
    return stack[-1] if stack else None
