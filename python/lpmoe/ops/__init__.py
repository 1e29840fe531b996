"""Composable operations for building expert MLPs.

    mlp = lpmoe.ops.Sequential(
        lpmoe.ops.GroupedLinear(num_experts, hidden, 2 * ffn),
        lpmoe.ops.SwiGLU(),
        lpmoe.ops.GroupedLinear(num_experts, ffn, hidden),
    )
    y = mlp(x, m_splits)          # runs fused, as lpmoe.GroupedMLP

Every op derives from :class:`BasicOperation`, which checks at call time
that the op supports the active :func:`lpmoe.autocast` recipe.
"""
from lpmoe.ops.activation import GELU, ClampedSwiGLU, GeGLU, ReLU, SwiGLU
from lpmoe.ops.base import BasicOperation
from lpmoe.ops.grouped_linear import GroupedLinear
from lpmoe.ops.sequential import Sequential

__all__ = ["BasicOperation", "GroupedLinear", "SwiGLU", "GeGLU", "GELU", "ReLU", "ClampedSwiGLU", "Sequential"]
