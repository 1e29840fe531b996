"""Tokens and their routing handed to the experts as they are: the FP8
expert input quantized straight from the tokens.

Under FP8 block scaling an MoE layer would permute bf16 token rows into
expert order (``permute_rows``: read T x H, write k x T x H) and the
experts' fc1 would quantize that copy (read it again, write FP8 rows and
the per-expert transposed copy).  :func:`permute_quantize` does both in
one pass: the FP8 block quantize kernels read grouped row r from token
``row_source[r]`` (the routing map inverted, one small kernel), so the bf16
rows are never made: about a third less DRAM traffic for the expert input,
and the layer's largest activation (k x T x H bf16) never exists.  Same
bits as ``group_quantize(permute_rows(x, rmap))`` by construction (a
permutation is a copy).

:class:`RoutedTokens` is the expert MLP's view of it
(lpmoe.functional.gathered_rows.GatheredRows): ``GroupedMLP(RoutedTokens(x,
rmap))`` quantizes fc1's input this way when the recipe quantizes it
(FP8 block scaling), eager or compiled (the MLP op then takes the tokens
and the map: lpmoe.library.mlp_route); otherwise (bf16, emulated recipes,
a high-precision backward, fp32 tokens on the GPU) it permutes the rows
first, exactly as before.  Tokens not 16-byte aligned are copied first
(the kernels read 16-byte vectors; the copy is T rows, the rows k*T).  The
backward sums the rows' gradient back to the tokens (the permutation's
backward kernel).  ``CALLS`` counts which path ran (real runs only, not
traces).
"""
from __future__ import annotations

import torch

from lpmoe._async_inputs import ready
from lpmoe.fp8_block_ops import GATHER_DTYPES, check_gather_input, gather_quantize
from lpmoe.functional.gathered_rows import GatheredRows
from lpmoe.library.routing import tracing
from lpmoe.moe import kernels
from lpmoe.moe.permute import _check_rows, permute_rows, unpermute
from lpmoe.moe.routing_map import RoutingMap
from lpmoe.quantize import group_quantize
from lpmoe.quantizers import Float8BlockQuantizer

__all__ = ["RoutedTokens", "permute_quantize", "CALLS"]

CALLS = {"kernel_permute_quantize": 0, "reference_permute_quantize": 0}

def _check(x: torch.Tensor, rmap: RoutingMap) -> None:
    _check_rows(x, "x")
    if not isinstance(rmap, RoutingMap):
        raise TypeError(f"rmap must be an lpmoe.moe.RoutingMap, got {type(rmap).__name__}")
    if x.shape[0] != rmap.row_map.shape[0]:
        raise ValueError(f"x has {x.shape[0]} tokens but the routing map has {rmap.row_map.shape[0]}")
    if rmap.used_rows is None:
        raise ValueError("the routing map must have the packed layout (experts' rows back to back); "
                         "the padded layout's members are not contiguous")
    if rmap.row_map.device != x.device:
        raise ValueError(f"the routing map is on {rmap.row_map.device} but x is on {x.device}")


def permute_quantize(x: torch.Tensor, rmap: RoutingMap, quantizer: Float8BlockQuantizer):
    """``group_quantize(permute_rows(x, rmap), quantizer, first_dims=rmap.m_splits)``
    in one pass over the tokens (see the module docstring): a GroupedTensor
    of ``rmap.num_rows`` rows in ``rmap.num_experts`` members.  x (T, H)
    bf16/fp16 on the GPU (any float dtype on CPU,
    through the reference); packed routing map; FP8 block quantizer.  No
    autograd; graph-safe (nothing read on the host).  Traced calls
    (torch.compile) go through the ops ``lpmoe::permute_row_sources`` and
    ``lpmoe::gather_quantize``."""
    x = ready(x)
    _check(x, rmap)
    if not isinstance(quantizer, Float8BlockQuantizer):
        raise TypeError(f"quantizer must be an lpmoe.Float8BlockQuantizer (the format whose kernels gather rows), "
                        f"got {type(quantizer).__name__}")
    return _permute_quantize(x.detach().contiguous(), rmap, quantizer)[0]


def _permute_quantize(x, rmap, quantizer, source=None):
    """permute_quantize on checked arguments; ``source``: the map's row
    sources if already computed (the GPU path returns them for reuse).
    Traced calls go through the ops (lpmoe::permute_row_sources,
    lpmoe::gather_quantize)."""
    if x.device.type != "cuda":
        if not tracing():
            CALLS["reference_permute_quantize"] += 1
        rows = permute_rows(x, rmap)
        return group_quantize(rows, quantizer, num_tensors=rmap.num_experts, first_dims=rmap.m_splits), None
    check_gather_input(x)  # before any launch
    if not tracing():
        CALLS["kernel_permute_quantize"] += 1
    if source is None:
        source = kernels.row_sources(rmap.row_map, rmap.num_rows)
    return gather_quantize(x, source, rmap.m_splits, quantizer), source


class RoutingOnly:
    """The part of RoutedTokens a backward keeps: the map (and its row
    sources, once computed), not the tokens."""

    def __init__(self, rmap: RoutingMap, row_source):
        self.rmap, self.row_source = rmap, row_source

    def rows_to_tokens(self, rows: torch.Tensor) -> torch.Tensor:
        return kernels.gather(rows.contiguous(), self.rmap.row_map)

    def with_tokens(self, tokens: torch.Tensor) -> "RoutedTokens":
        out = RoutedTokens(tokens, self.rmap)
        out._row_source = self.row_source
        return out


class RoutedTokens(GatheredRows):
    """Tokens x (T, H) and the routing map that sends them to the experts'
    rows: what ``GroupedMLP`` takes in place of ``permute_rows(x, rmap)``
    (then with ``m_splits=None``; the map's counts are the splits).  The
    MLP returns the grouped rows' outputs, (rmap.num_rows, H), as before, or
    with ``sum_to_tokens`` their sums per token, (T, H), as
    ``unpermute(rows_out, rmap)`` would give them (without probabilities:
    the MLP applies those): its backward then quantizes fc2's output
    gradient straight from the tokens' gradient too, so no (rows, H)
    gradient buffer is made either.  ``save_original``: the caller keeps the
    tokens anyway (an MoE layer's router does), so the MLP may keep them for
    fc1's weight gradient instead of an FP8 copy of the rows (the
    MLP's save_original_input, for these tokens only)."""

    def __init__(self, tokens: torch.Tensor, rmap: RoutingMap, sum_to_tokens: bool = False,
                 save_original: bool = False):
        tokens = ready(tokens)
        _check(tokens, rmap)
        for name, v in (("sum_to_tokens", sum_to_tokens), ("save_original", save_original)):
            if not isinstance(v, bool):
                raise TypeError(f"{name} must be a bool, got {v!r}")
        self.tokens = tokens.contiguous()  # (once: the gathers and the autograd input share it)
        self.rmap = rmap
        self.sum_to_tokens = sum_to_tokens
        self.save_original = save_original
        self._row_source = None  # the inverse map, made by the first gathering quantize

    @property
    def num_rows(self) -> int:
        return self.rmap.num_rows

    @property
    def m_splits(self) -> torch.Tensor:
        return self.rmap.m_splits

    def rows(self) -> torch.Tensor:
        return permute_rows(self.tokens, self.rmap)

    def can_quantize(self, quantizer) -> bool:
        return isinstance(quantizer, Float8BlockQuantizer) and self.gathers_tokens()

    def gathers_tokens(self) -> bool:
        t = self.tokens
        return t.device.type != "cuda" or t.dtype in GATHER_DTYPES

    def quantize(self, quantizer):
        out, self._row_source = _permute_quantize(self.tokens.detach(), self.rmap, quantizer,
                                                  self._row_source)  # (checked when made)
        return out

    def rows_to_tokens(self, rows: torch.Tensor) -> torch.Tensor:
        return self.for_backward().rows_to_tokens(rows)

    def sum_rows(self, y_rows: torch.Tensor) -> torch.Tensor:
        return unpermute(y_rows, self.rmap)

    def on_tokens(self, tokens: torch.Tensor) -> "RoutedTokens":
        out = RoutedTokens(tokens, self.rmap, self.sum_to_tokens, self.save_original)
        out._row_source = self._row_source
        return out

    def for_backward(self) -> RoutingOnly:
        return RoutingOnly(self.rmap, self._row_source)
