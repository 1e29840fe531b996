"""The grouped expert GEMM as an op."""
from __future__ import annotations

from typing import Optional

import torch

from lpmoe.functional import grouped_linear
from lpmoe.module.grouped_linear import GroupedLinear as _GroupedLinearModule
from lpmoe.ops.base import BasicOperation

__all__ = ["GroupedLinear"]


class GroupedLinear(BasicOperation, _GroupedLinearModule):
    """:class:`lpmoe.GroupedLinear` as an op: same arguments, parameters and
    state-dict keys; forward(x, m_splits) runs :func:`lpmoe.functional.grouped_linear`
    with the active recipe (FP8 block scaling natively)."""

    supports_float8_block_scaling = True
    takes_m_splits = True

    def forward(self, inp: torch.Tensor, m_splits, is_first_microbatch: Optional[bool] = None) -> torch.Tensor:
        weights, biases = self.functional_params()
        return grouped_linear(inp, m_splits, weights, biases, self.active_recipe(),
                              weight_cache=self.weight_cache, is_first_microbatch=is_first_microbatch,
                              fuse_wgrad_accumulation=self.fuse_wgrad_accumulation,
                              save_original_input=self.save_original_input)
