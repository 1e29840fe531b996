"""Elementwise activations of an expert MLP.

They compute in the input's (high-precision) dtype under every recipe (the
quantization of a recipe applies to GEMM operands only), with lpmoe's exact
activation math (lpmoe.activation): on CUDA bf16/fp16 through the fused
kernels.  Between two GroupedLinear ops in :class:`lpmoe.ops.Sequential` they
are fused into the expert MLP (lpmoe.functional.grouped_mlp).  ``forward(x,
probs=None)``: optional per-row scales (router probabilities).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from lpmoe.activation import Activation, activation
from lpmoe.ops.base import BasicOperation

__all__ = ["SwiGLU", "GeGLU", "GELU", "ReLU", "ClampedSwiGLU"]


class _FusableActivation(BasicOperation):
    """An activation lpmoe's fused MLP kernels implement (``self.spec``)."""

    supports_float8_block_scaling = True
    takes_probs = True
    spec: Activation

    def forward(self, x: torch.Tensor, probs: Optional[torch.Tensor] = None) -> torch.Tensor:
        return activation(x, self.spec, probs)

    def extra_repr(self) -> str:
        return repr(self.spec)


class SwiGLU(_FusableActivation):
    """``silu(gate) * value`` where gate, value are the first and second
    halves of the last dim (gate first, as TransformerEngine's SwiGLU):
    (..., 2F) -> (..., F)."""

    def __init__(self):
        super().__init__()
        self.spec = Activation("swiglu")


class GeGLU(_FusableActivation):
    """``gelu_tanh(gate) * value`` (gate first): (..., 2F) -> (..., F)."""

    def __init__(self):
        super().__init__()
        self.spec = Activation("geglu")


class ReLU(_FusableActivation):
    def __init__(self):
        super().__init__()
        self.spec = Activation("relu")


class ClampedSwiGLU(_FusableActivation):
    """gpt-oss's SwiGLU on the gate-first layout: ``(g * sigmoid(alpha g)) *
    (v + 1)`` with g clamped above at ``limit`` and v to [-limit, limit]."""

    def __init__(self, alpha: float = 1.702, limit: float = 7.0):
        super().__init__()
        self.spec = Activation("clamped_swiglu", alpha=alpha, limit=limit)


class GELU(_FusableActivation):
    """GELU.  ``approximate="tanh"`` (default, the usual choice in transformer
    MLPs) is lpmoe's fused activation; ``"none"`` (erf) runs PyTorch's
    F.gelu and is not fused."""

    def __init__(self, approximate: str = "tanh"):
        super().__init__()
        if approximate not in ("tanh", "none"):
            raise ValueError(f"approximate must be 'tanh' or 'none', got {approximate!r}")
        self.approximate = approximate
        self.spec = Activation("gelu") if approximate == "tanh" else None

    def forward(self, x: torch.Tensor, probs: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.spec is not None:
            return super().forward(x, probs)
        y = F.gelu(x, approximate="none")
        return y if probs is None else y * probs.unsqueeze(-1).to(y.dtype)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"
