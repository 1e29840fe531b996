"""No recipe: every GEMM in the input dtype (the compute dtype: under
torch.autocast the parameters are cast to it, lpmoe.functional.precision)."""
from __future__ import annotations

from lpmoe.policy.base import Forward, Grad, LinearPolicy, Needs, Tokens, grouped_rows

__all__ = ["HighPrecision"]


class HighPrecision(LinearPolicy):
    """x and W are used as given (W cast to the compute dtype if it has
    another); the backward keeps x (for wgrad) and W as fprop read it (for
    dgrad: the parameters, or their cast copy, which the fused MLP drops
    after dgrad; casting again there would cost a pass over the fp32
    weights, ~2 ms of a 13 ms step at 32 DeepSeek-V3 experts) and reads dy
    as it comes."""

    def forward(self, x: Tokens, weights, splits, need: Needs) -> Forward:
        w = weights.operand()
        return Forward(x=grouped_rows(x.hp, splits.device), w=w, saved_x=x.hp if need.wgrad else None,
                       saved_w=w if need.dgrad else None)

    def grad(self, dy, splits, need: Needs) -> Grad:
        t = grouped_rows(dy, splits.device)
        return Grad(dgrad=t if need.dgrad else None, wgrad=t if need.wgrad else None, hp=dy)
