"""No recipe: every GEMM in the input dtype (the compute dtype: under
torch.autocast the parameters are cast to it, lpmoe.functional.precision)."""
from __future__ import annotations

from lpmoe.policy.base import Forward, Grad, LinearPolicy, Needs, Tokens, grouped_rows

__all__ = ["HighPrecision"]


class HighPrecision(LinearPolicy):
    """x and W are used as given (W cast to the compute dtype if it has
    another); the backward keeps x (for wgrad) and the parameters (for
    dgrad, cast again there rather than keeping a cast copy) and reads dy
    as it comes."""

    def forward(self, x: Tokens, weights, splits, need: Needs) -> Forward:
        return Forward(x=grouped_rows(x.hp, splits.device), w=weights.operand(),
                       saved_x=x.hp if need.wgrad else None, saved_w=weights.params if need.dgrad else None)

    def grad(self, dy, splits, need: Needs) -> Grad:
        t = grouped_rows(dy, splits.device)
        return Grad(dgrad=t if need.dgrad else None, wgrad=t if need.wgrad else None, hp=dy)
