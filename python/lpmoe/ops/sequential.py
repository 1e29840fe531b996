"""A chain of ops sharing one routing (m_splits)."""
from __future__ import annotations

from typing import Optional

import torch

from lpmoe.ops.base import BasicOperation

__all__ = ["Sequential"]


class Sequential(torch.nn.Sequential):
    """Run ops in order; ops that group by expert (``takes_m_splits``) get
    ``m_splits``, elementwise ops get the tensor only.

    ``is_first_microbatch`` is forwarded to the ops that take m_splits."""

    def __init__(self, *ops: BasicOperation):
        for i, op in enumerate(ops):
            if not isinstance(op, BasicOperation):
                raise TypeError(f"ops[{i}] must be an lpmoe.ops.BasicOperation, got {type(op).__name__}")
        super().__init__(*ops)

    def forward(self, x: torch.Tensor, m_splits, is_first_microbatch: Optional[bool] = None) -> torch.Tensor:
        for op in self:
            if op.takes_m_splits:
                x = op(x, m_splits, is_first_microbatch=is_first_microbatch)
            else:
                x = op(x)
        return x
