"""Routed tokens through the ``lpmoe::grouped_mlp`` ops.

Eager ``GroupedMLP(RoutedTokens(tokens, rmap))`` quantizes fc1's input as it
gathers it from the tokens (and, with ``sum_to_tokens``, fc2's output
gradient from the tokens' gradient), so the bf16 grouped rows never exist
(lpmoe.moe.routed_tokens).  A compiled call does the same inside the layer
op: the op takes the tokens as ``x`` plus the map's tensors (``row_map``,
``used_rows``) and the grouped row count ``rows``, and its configuration
says ``{"sum": sum_to_tokens}`` (whether fc1 keeps the tokens is fc1's
``"keep"``).  The
forward saves three more objects for the backward (:data:`ROUTE`): the map
and its kept total (op inputs, saved by reference) and the inverse map the
forward computed (fresh), so no backward stage recomputes it.

Nothing here runs a kernel of its own: these helpers rebuild the
lpmoe.moe.RoutedTokens object the eager path uses from what crosses the op
boundary, so both paths run the same code and give the same bits.
"""
from __future__ import annotations

from typing import Optional

import torch

from lpmoe.functional.gathered_rows import GatheredRows
from lpmoe.moe.routed_tokens import RoutedTokens, RoutingOnly
from lpmoe.moe.routing_map import RoutingMap

__all__ = ["ROUTE", "route_config", "route_args", "forward_source", "forward_saved", "backward_source", "tokens_of"]

#: the saved objects a routed op appends to lpmoe.functional.mlp.SAVED
#: (None for an op without routing: no tensors, same layout machinery)
ROUTE = ("route_map", "route_used", "route_src")


def route_config(routed: Optional[GatheredRows]) -> Optional[dict]:
    """The configuration entry of a call given routed tokens (None: plain rows)."""
    if routed is None:
        return None
    return {"sum": bool(routed.sum_to_tokens)}


def route_args(routed: Optional[GatheredRows]) -> tuple:
    """(row_map, used_rows, rows) of the op call; (None, None, -1) without routing."""
    if routed is None:
        return None, None, -1
    if not isinstance(routed, RoutedTokens):
        raise TypeError(f"a traced GroupedMLP takes lpmoe.moe.RoutedTokens, got {type(routed).__name__}")
    return routed.rmap.row_map, routed.rmap.used_rows, routed.rmap.num_rows


def _map(row_map, used_rows, rows, m_splits) -> RoutingMap:
    # (dropped slots and the capacity are the layer's business; the MLP never reads them)
    return RoutingMap(row_map, m_splits, rows, used_rows, dropped=None)


def forward_source(tokens, row_map, used_rows, rows, m_splits, route: dict) -> RoutedTokens:
    """The op forward's RoutedTokens: the eager path's object around the op's
    inputs (fc1's config, not the object, says whether the tokens are kept)."""
    return RoutedTokens(tokens, _map(row_map, used_rows, rows, m_splits), sum_to_tokens=route["sum"])


def forward_saved(objs: tuple, source: Optional[RoutedTokens], tokens: torch.Tensor) -> tuple:
    """The op's saved objects: the forward's (a GatheredRows kept for fc1's
    wgrad becomes the tokens, an op input) plus :data:`ROUTE`."""
    if source is None:
        return tuple(objs) + (None,) * len(ROUTE)
    objs = tuple(tokens if isinstance(o, GatheredRows) else o for o in objs)
    back = source.for_backward()
    return objs + (back.rmap.row_map, back.rmap.used_rows, back.row_source)


def tokens_of(back, rows):
    """The token count of an input gradient: the map's (routed), else the rows'."""
    return back.rmap.row_map.shape[0] if back is not None else rows


def backward_source(route_objs, m_splits, rows):
    """The backward's view of the routing (``rows_to_tokens``,
    ``with_tokens``) from the :data:`ROUTE` objects, or None for an op
    without routing."""
    row_map, used_rows, row_source = route_objs
    if row_map is None:
        return None
    return RoutingOnly(_map(row_map, used_rows, rows, m_splits), row_source)
