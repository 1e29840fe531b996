"""torch.nn modules of lpmoe."""
from lpmoe.module.grouped_linear import GroupedLinear

__all__ = ["GroupedLinear"]
