"""MXFP8BlockScaling / NVFP4BlockScaling on Hopper: numerics emulation.

Hopper has no MXFP8/NVFP4 tensor cores.  The forward quantizes x and W along
K and dequantizes them; the backward quantizes dy along N and reuses the
saved dequantized x and W; every GEMM runs in high precision.  The wgrad
operands are therefore not re-quantized along the token dim, unlike a
hardware recipe.
"""
from __future__ import annotations

import torch

from lpmoe.policy.base import (Forward, Grad, LinearPolicy, Needs, Tokens, dequantized_rows, grouped_rows,
                               recipe_quantizer)
from lpmoe.quantize import group_quantize

__all__ = ["Emulated"]


def fake_quantize(x2d: torch.Tensor, quantizer, splits, num: int, dtype=None) -> torch.Tensor:
    """Quantize then dequantize (into ``dtype``, default x2d's).  Rows past
    the splits are left uninitialised: no GEMM reads them."""
    return dequantized_rows(group_quantize(x2d, quantizer, num_tensors=num, first_dims=splits), dtype)


class Emulated(LinearPolicy):
    def __init__(self, recipe):
        self.recipe = recipe
        self.quantized_backward = recipe.backward_override is None

    def forward(self, x: Tokens, weights, splits, need: Needs) -> Forward:
        g, n, k = weights.shape
        x_hat = fake_quantize(x.hp, recipe_quantizer(self.recipe, "input", True, False), splits.device, g)
        # (quantized from the parameters' own dtype, dequantized into the compute dtype)
        w_hat = fake_quantize(weights.stacked(), recipe_quantizer(self.recipe, "weight", True, False),
                              None, g, x.hp.dtype).view(g, n, k)
        hp = self.recipe.backward_override == "high_precision"
        saved_x, saved_w = (x.hp, weights.params) if hp else (x_hat, w_hat)
        return Forward(x=grouped_rows(x_hat, splits.device), w=w_hat, saved_x=saved_x if need.wgrad else None,
                       saved_w=saved_w if need.dgrad else None)

    def grad(self, dy, splits, need: Needs) -> Grad:
        dy_q = dy
        if self.quantized_backward and (need.dgrad or need.wgrad):
            dy_q = fake_quantize(dy, recipe_quantizer(self.recipe, "grad", True, False), splits.device,
                                 splits.num)
        t = grouped_rows(dy_q, splits.device)
        return Grad(dgrad=t if need.dgrad else None, wgrad=t if need.wgrad else None, hp=dy)
