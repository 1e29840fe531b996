"""Elementwise activations of an expert MLP.

They compute in the input's (high-precision) dtype under every recipe: the
quantization of a recipe applies to GEMM operands only, so the activations
are correct under FP8 block scaling and declare it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from lpmoe.ops.base import BasicOperation

__all__ = ["SwiGLU", "GELU"]


class SwiGLU(BasicOperation):
    """``silu(a) * b`` where ``a, b`` are the first and second halves of the
    last dim (gate first, as TransformerEngine's SwiGLU): (..., 2F) -> (..., F)."""

    supports_float8_block_scaling = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.active_recipe()
        if x.shape[-1] % 2:
            raise ValueError(f"SwiGLU needs an even last dim (gate and value halves), got {x.shape[-1]}")
        gate, value = x.chunk(2, dim=-1)
        return F.silu(gate) * value


class GELU(BasicOperation):
    """GELU with the tanh approximation (the usual choice in transformer MLPs)."""

    supports_float8_block_scaling = True

    def __init__(self, approximate: str = "tanh"):
        super().__init__()
        if approximate not in ("tanh", "none"):
            raise ValueError(f"approximate must be 'tanh' or 'none', got {approximate!r}")
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.active_recipe()
        return F.gelu(x, approximate=self.approximate)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"
