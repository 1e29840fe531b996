"""nn.Module front-ends: GroupedLinear (one expert layer), GroupedMLP (fc1 ->
fused activation -> fc2)."""
from lpmoe.module.grouped_linear import GroupedLinear
from lpmoe.module.grouped_mlp import GroupedMLP

__all__ = ["GroupedLinear", "GroupedMLP"]
