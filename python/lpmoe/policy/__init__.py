"""Recipe policies: how each recipe feeds a grouped linear layer's GEMMs
(see lpmoe.policy.base)."""
from __future__ import annotations

from typing import Optional

from lpmoe.policy.base import Forward, Grad, LinearPolicy, Needs, Tokens, grouped_rows
from lpmoe.policy.emulated import Emulated
from lpmoe.policy.fp8_block import Fp8Block, Fp8BlockDequantizedBackward, Fp8BlockHighPrecisionBackward
from lpmoe.policy.high_precision import HighPrecision
from lpmoe.recipe import Float8BlockScaling, Recipe

__all__ = ["policy_for", "LinearPolicy", "Needs", "Tokens", "Forward", "Grad", "grouped_rows", "HighPrecision",
           "Fp8Block", "Fp8BlockHighPrecisionBackward", "Fp8BlockDequantizedBackward", "Emulated"]

_FP8_OVERRIDES = {None: Fp8Block, "high_precision": Fp8BlockHighPrecisionBackward,
                  "dequantized": Fp8BlockDequantizedBackward}


def policy_for(recipe: Optional[Recipe]) -> LinearPolicy:
    """The policy of a (validated) recipe; None = high precision."""
    if recipe is None:
        return HighPrecision()
    if isinstance(recipe, Float8BlockScaling):
        return _FP8_OVERRIDES[recipe.backward_override](recipe)
    return Emulated(recipe)
