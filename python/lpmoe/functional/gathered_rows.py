"""Expert rows that are not materialised: what an expert MLP reads when it
is handed the tokens and their routing instead of the permuted rows.

An MoE layer's experts read the tokens in expert order.  Copying them into
that order first (a bf16 (rows, hidden) buffer, k times the tokens) and then
quantizing the copy moves every byte three times; an FP8 recipe can instead
quantize straight from the tokens, gathering each grouped row as it goes
(lpmoe.moe.RoutedTokens: the FP8 block quantize kernels read row r from
token ``row_source[r]``).  The bf16 rows then never exist, neither in memory nor
in DRAM traffic.

:class:`GatheredRows` is the interface lpmoe.functional.grouped_mlp uses; the
implementation lives with the routing code (lpmoe.moe.routed_tokens), which
depends on this package and not the other way round.
"""
from __future__ import annotations

import torch

__all__ = ["GatheredRows"]


class GatheredRows:
    """Grouped expert rows defined by a token matrix and a map.

    ``tokens`` (T, hidden) is what autograd differentiates; ``num_rows``
    and ``m_splits`` (device int64, rows per expert) describe the grouped
    rows; rows past sum(m_splits) are a capacity tail."""

    tokens: torch.Tensor
    num_rows: int
    m_splits: torch.Tensor
    #: the MLP returns each token's sum over its rows' outputs, (T, hidden)
    #: (:meth:`sum_rows`), instead of the rows' outputs; its backward then
    #: receives the tokens' gradient and reads fc2's output gradient from it
    #: through the same map
    sum_to_tokens: bool = False
    #: the caller keeps ``tokens`` alive anyway: fc1 may keep them for its
    #: weight gradient instead of a quantized copy of the rows
    save_original: bool = False

    def rows(self) -> torch.Tensor:
        """The grouped rows as a (num_rows, hidden) tensor, differentiable
        in ``tokens`` (the unfused path)."""
        raise NotImplementedError

    def on_tokens(self, tokens: torch.Tensor) -> "GatheredRows":
        """These rows, with the same options, gathered from ``tokens``
        instead (same shape and routing; e.g. the tokens cast to
        torch.autocast's dtype, differentiable in the original ones)."""
        raise NotImplementedError

    def can_quantize(self, quantizer) -> bool:
        """Whether :meth:`quantize` takes this quantizer for these tokens."""
        raise NotImplementedError

    def gathered_by(self, policy, need, traced: bool) -> bool:
        """Whether a layer under ``policy`` (lpmoe.policy.LinearPolicy) with
        gradient needs ``need`` reads these rows through the map, else the
        caller makes them first.  Traced code asks without making a
        quantizer (its construction is not traceable)."""
        if traced:
            return policy.gathers_input(need) and self.gathers_tokens()
        q = policy.input_quantizer(need)
        return q is not None and self.can_quantize(q)

    def gathers_tokens(self) -> bool:
        """Whether a recipe that gathers (FP8 block scaling) reads these
        tokens through the map, from what a trace knows of them (device,
        dtype): what traced code asks instead of :meth:`can_quantize`."""
        raise NotImplementedError

    def quantize(self, quantizer):
        """The grouped rows quantized (a GroupedTensor with members
        ``m_splits``), bit-identical to quantizing :meth:`rows`, without
        making the rows.  No autograd."""
        raise NotImplementedError

    def rows_to_tokens(self, rows: torch.Tensor) -> torch.Tensor:
        """(T, hidden): each token's sum over its rows of ``rows``, no
        autograd (the backward of :meth:`rows`; the forward of
        ``sum_to_tokens``)."""
        raise NotImplementedError

    def sum_rows(self, y_rows: torch.Tensor) -> torch.Tensor:
        """(T, hidden): each token's sum over its rows of ``y_rows``,
        differentiable (the unfused path of ``sum_to_tokens``)."""
        raise NotImplementedError

    def for_backward(self):
        """What a backward keeps besides autograd's saved tensors: the map
        without the tokens, with :meth:`rows_to_tokens` and
        ``with_tokens(tokens)`` (this object again around other tokens of
        the same routing: the tokens the backward unpacked, which went
        through save_for_backward so that saved-tensor hooks and version
        checks see them, or, with ``sum_to_tokens``, the tokens' gradient,
        whose rows are fc2's output gradient)."""
        raise NotImplementedError
