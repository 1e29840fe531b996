"""Per-member host views of a GroupedTensor.

Everything here reads the members' sizes on the host, so every function
**syncs** when the dims live on the GPU: for inspection, tests and the CPU
path, never for graph-safe code (the kernels take the device offsets).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, List, Tuple

from lpmoe.grouped_layout import ShapeKind, member_sizes
from lpmoe.quantizers import Float8BlockQuantizer, Quantizer

if TYPE_CHECKING:
    from lpmoe.grouped_tensor import GroupedTensor

__all__ = ["member_shapes", "split_members"]


def member_shapes(g: "GroupedTensor") -> List[Tuple[int, int]]:
    """Per-member (M_t, K_t)."""
    n = g.num_tensors
    m = [g.common_first_dim] * n if g.first_dims is None else g.first_dims.tolist()
    k = [g.common_last_dim] * n if g.last_dims is None else g.last_dims.tolist()
    if g.shape_kind is ShapeKind.VARYING_LAST:
        m = [g.logical_shape[0]] * n
    return list(zip(m, k))


def split_members(g: "GroupedTensor") -> list:
    """Per-member views (no copies).

    High precision: a list of (M_t, K_t) tensors.  Quantized: a list of
    dicts with the member's buffers as single-tensor views, shaped as the
    quantizer's single-tensor layout (FP8-block columnwise data keeps its
    128-token padding: shape (K, round_up(M_t, 128)))."""
    out = []
    base = {}
    for m, k in member_shapes(g):
        if g.quantizer is None:
            off = base.get("rowwise_data", 0)
            out.append(g.rowwise_data[off:off + m * k].view(m, k))
            base["rowwise_data"] = off + m * k
            continue
        out.append(_member_views(g, m, k, base))
    return out


def _member_views(g: "GroupedTensor", m: int, k: int, base: dict) -> dict:
    """One member's buffers; ``base`` carries each buffer's running offset."""
    q = g.quantizer
    view = {"shape": (m, k)}
    for name, size in member_sizes(q, m, k).items():
        buf = getattr(g, name)
        off = base.get(name, 0)
        if buf is None or size == 0:
            view[name] = None
            continue
        view[name] = buf[off:off + size].view(_member_view_shape(q, name, m, k, g.with_gemm_swizzled_scales))
        base[name] = off + size
    return view


def _member_view_shape(q: Quantizer, name: str, m: int, k: int, swizzled: bool):
    if name in ("amax", "columnwise_amax"):
        return (1,)
    colwise = name.startswith("columnwise")
    if name.endswith("data"):
        if isinstance(q, Float8BlockQuantizer) and colwise:
            return (k, -(-m // 128) * 128)
        return q.get_data_shape((m, k), columnwise=colwise)
    if swizzled:
        return (-1,)
    return q.get_scale_shape((m, k), columnwise=colwise)
