"""A chain of ops sharing one routing (m_splits)."""
from __future__ import annotations

from typing import List, Optional

import torch

from lpmoe.ops.base import BasicOperation

__all__ = ["Sequential"]


class Sequential(torch.nn.Sequential):
    """Run ops in order; ops that group by expert (``takes_m_splits``) get
    ``m_splits``, elementwise ops get the tensor only.

    ``GroupedLinear -> fusable activation -> GroupedLinear`` runs as one fused
    expert MLP (lpmoe.functional.grouped_mlp, the path of lpmoe.GroupedMLP),
    with bit-identical results.  ``probs`` (optional per-token scales) goes
    to the chain's activation, which must then be the only one.
    ``is_first_microbatch`` is forwarded to the ops that take m_splits."""

    def __init__(self, *ops: BasicOperation):
        for i, op in enumerate(ops):
            if not isinstance(op, BasicOperation):
                raise TypeError(f"ops[{i}] must be an lpmoe.ops.BasicOperation, got {type(op).__name__}")
        super().__init__(*ops)

    def _mlp_starts(self) -> List[int]:
        """Indices i where ops i, i+1, i+2 form a fusable expert MLP."""
        ops, starts, i = list(self), [], 0
        while i + 2 < len(ops):
            a, act, b = ops[i:i + 3]
            # (an fc2 that keeps its own input needs that input made: not fused)
            if (a.takes_m_splits and b.takes_m_splits and getattr(act, "spec", None) is not None
                    and not getattr(b, "save_original_input", False)):
                starts.append(i)
                i += 3
            else:
                i += 1
        return starts

    def forward(self, x: torch.Tensor, m_splits, probs: Optional[torch.Tensor] = None,
                is_first_microbatch: Optional[bool] = None) -> torch.Tensor:
        ops = list(self)
        if probs is not None:
            acts = [op for op in ops if getattr(op, "takes_probs", False)]
            if len(acts) != 1:
                raise ValueError(f"probs needs exactly one activation op in the chain, found {len(acts)}")
        starts = set(self._mlp_starts())
        i = 0
        while i < len(ops):
            op = ops[i]
            if i in starts:
                x = _fused_mlp(ops[i], ops[i + 1], ops[i + 2], x, m_splits, probs, is_first_microbatch)
                i += 3
                continue
            if op.takes_m_splits:
                x = op(x, m_splits, is_first_microbatch=is_first_microbatch)
            elif getattr(op, "takes_probs", False):
                x = op(x, probs)
            else:
                x = op(x)
            i += 1
        return x


def _fused_mlp(fc1, act, fc2, x, m_splits, probs, is_first_microbatch):
    from lpmoe.functional.mlp import grouped_mlp
    from lpmoe.module.grouped_mlp import layer_params

    recipe = fc1.active_recipe()  # gates the recipe for all three ops
    act.active_recipe()
    fc2.active_recipe()
    return grouped_mlp(x, m_splits, layer_params(fc1), layer_params(fc2), activation=act.spec, probs=probs,
                       recipe=recipe, is_first_microbatch=is_first_microbatch)
