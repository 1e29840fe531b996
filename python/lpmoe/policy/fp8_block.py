"""Float8BlockScaling (x 1x128, W 128x128, dy 1x128) through the FP8 GEMMs."""
from __future__ import annotations

from typing import Optional

import torch

from lpmoe.functional.gathered_rows import GatheredRows
from lpmoe.grouped_tensor import GroupedTensor
from lpmoe.policy.base import (Forward, Grad, LinearPolicy, Needs, Tokens, dequantized_rows, grouped_rows,
                               recipe_quantizer, saved_weight_view)
from lpmoe.quantize import group_quantize, group_quantize_dbias
from lpmoe.quantizers import Float8BlockQuantizer
from lpmoe.recipe import Float8BlockScaling

__all__ = ["Fp8Block", "Fp8BlockHighPrecisionBackward", "Fp8BlockDequantizedBackward"]


class _Fp8Forward(LinearPolicy):
    """The FP8 forward shared by every backward_override: x quantized 1x128
    (or handed over quantized by a fused activation), W 128x128."""

    #: what the forward keeps of the quantized weights for dgrad (saved_weight_view)
    saved_weight = "rowwise"

    def __init__(self, recipe: Float8BlockScaling):
        self.recipe = recipe

    def quantizer(self, role: str, rowwise: bool, columnwise: bool) -> Float8BlockQuantizer:
        return recipe_quantizer(self.recipe, role, rowwise, columnwise)

    def _quantized_x(self, x: Tokens, splits, columnwise: bool):
        if x.quantized is not None:
            return x.quantized
        q = self.quantizer("input", True, columnwise)
        if x.gathered is not None:  # quantized straight from the tokens (same bits)
            return x.gathered.quantize(q)
        return group_quantize(x.hp, q, num_tensors=splits.num, first_dims=splits.device)

    def input_quantizer(self, need: Needs) -> Optional[Float8BlockQuantizer]:
        return self.quantizer("input", True, need.wgrad)

    def gathers_input(self, need: Needs) -> bool:
        return True

    def _quantized_w(self, weights, columnwise: bool):
        return weights.quantized(self.quantizer("weight", True, columnwise))


class Fp8Block(_Fp8Forward):
    """Quantized backward.  The forward keeps only what the backward reads:
    the transposed copy of x (wgrad) and of W (dgrad); rowwise copies die
    with the fprop GEMM.  dy is quantized per direction when its GEMM asks
    for it (transposed for wgrad, rowwise for dgrad), each copy dying with
    its GEMM, with the bias gradient fused into the first pass.

    Why two passes: one pass writing both copies holds 2 bytes per dy
    element at once, which set the step's memory peak (fc2's backward in the
    expert MLP, docs/grouped-mlp-notes.md); two passes read dy twice, the
    bits are the same."""

    saved_weight = "transposed"

    def forward(self, x: Tokens, weights, splits, need: Needs) -> Forward:
        # save_original: keep the caller's input (or the tokens it is
        # gathered from) instead of x's transposed FP8 copy, and quantize
        # that copy again right before wgrad (wgrad_tokens): x's rows x K
        # bytes are not held between forward and backward, for one more
        # read of x.  Same bits (each direction of a 1x128 quantization is
        # its own computation, whichever pass writes it).
        keep = x.save_original and need.wgrad and x.quantized is None
        qx = self._quantized_x(x, splits, columnwise=need.wgrad and not keep)
        # The cache keeps the transposed copy whenever grads may be asked
        # for, so micro-batches with and without dgrad share one cache.
        qw = self._quantized_w(weights, columnwise=weights.grad_enabled)
        if keep:
            saved_x = x.gathered if x.gathered is not None else x.hp
        else:
            saved_x = qx.direction_view(columnwise=True) if need.wgrad and qx.columnwise_data is not None else None
        saved_w = saved_weight_view(qw, self.saved_weight) if need.dgrad else None
        return Forward(x=qx, w=qw, saved_x=saved_x, saved_w=saved_w)

    def wgrad_tokens(self, saved_x, splits):
        if saved_x is None or isinstance(saved_x, GroupedTensor):
            return saved_x
        q = self.quantizer("input", False, True)  # the original input kept (save_original): its transposed copy now
        if isinstance(saved_x, torch.Tensor):
            return group_quantize(saved_x, q, num_tensors=splits.num, first_dims=splits.device)
        return saved_x.quantize(q)  # a GatheredRows

    def takes_gathered_grad(self, need: Needs) -> bool:
        # (a bias gradient is not fused into the gathering quantize)
        return (need.dgrad or need.wgrad) and not need.dbias

    def grad(self, dy, splits, need: Needs) -> Grad:
        if isinstance(dy, GatheredRows):  # each direction quantized straight from the tokens' gradient
            return Grad(make=lambda grad, which: dy.quantize(
                self.quantizer("grad", rowwise=which == "dgrad", columnwise=which == "wgrad")))
        if not (need.dgrad or need.wgrad):
            return Grad(hp=dy)
        def make(grad: Grad, which: str):
            q = self.quantizer("grad", rowwise=which == "dgrad", columnwise=which == "wgrad")
            if need.dbias and grad.dbias is None:  # the first pass also writes the bias gradient
                qdy, grad.dbias = group_quantize_dbias(dy, q, num_tensors=splits.num, first_dims=splits.device)
                return qdy
            return group_quantize(dy, q, num_tensors=splits.num, first_dims=splits.device)
        return Grad(hp=dy, make=make)

    # fused expert MLP: the activation kernel writes fc2's input as its FP8
    # operands (rowwise for fprop, transposed for wgrad), and the activation
    # backward writes fc1's output gradient quantized.
    def activation_output(self, need: Needs):
        return False, self.quantizer("input", True, need.wgrad)

    def grad_quantizer(self, need: Needs) -> Optional[Float8BlockQuantizer]:
        if not (need.dgrad or need.wgrad):
            return None
        return self.quantizer("grad", need.dgrad, need.wgrad)


def grad_views(qdy, need: Needs, dbias) -> Grad:
    """One-direction views of a dy quantized in one pass (the fused
    activation backward writes both), so each copy can be freed right after
    the GEMM that reads it."""
    return Grad(dgrad=qdy.direction_view(columnwise=False) if need.dgrad else None,
                wgrad=qdy.direction_view(columnwise=True) if need.wgrad else None, dbias=dbias)


class Fp8BlockHighPrecisionBackward(_Fp8Forward):
    """backward_override="high_precision": FP8 forward, the original x and W
    kept, backward GEMMs in high precision."""

    def forward(self, x: Tokens, weights, splits, need: Needs) -> Forward:
        qx = self._quantized_x(x, splits, columnwise=False)
        qw = self._quantized_w(weights, columnwise=False)
        return Forward(x=qx, w=qw, saved_x=x.hp if need.wgrad else None,
                       saved_w=weights.params if need.dgrad else None)

    def grad(self, dy, splits, need: Needs) -> Grad:
        t = grouped_rows(dy, splits.device)
        return Grad(dgrad=t if need.dgrad else None, wgrad=t if need.wgrad else None, hp=dy)

    def input_quantizer(self, need: Needs) -> None:
        return None  # the backward keeps the high-precision rows

    def gathers_input(self, need: Needs) -> bool:
        return False

    def activation_output(self, need: Needs):
        return need.wgrad, self.quantizer("input", True, False)


class Fp8BlockDequantizedBackward(_Fp8Forward):
    """backward_override="dequantized": FP8 forward, its quantized x and W
    kept and dequantized for high-precision backward GEMMs."""

    def forward(self, x: Tokens, weights, splits, need: Needs) -> Forward:
        qx = self._quantized_x(x, splits, columnwise=False)
        qw = self._quantized_w(weights, columnwise=False)
        return Forward(x=qx, w=qw, saved_x=qx if need.wgrad else None,
                       saved_w=saved_weight_view(qw, self.saved_weight) if need.dgrad else None)

    def grad(self, dy, splits, need: Needs) -> Grad:
        t = grouped_rows(dy, splits.device)
        return Grad(dgrad=t if need.dgrad else None, wgrad=t if need.wgrad else None, hp=dy)

    def input_quantizer(self, need: Needs) -> Float8BlockQuantizer:
        return self.quantizer("input", True, False)

    def dgrad_weights(self, saved_w, num: int, n: int, k: int, dtype=None):
        return dequantized_rows(saved_w, dtype).view(num, n, k)  # (straight into the compute dtype)

    def wgrad_tokens(self, saved_x, splits):
        return grouped_rows(dequantized_rows(saved_x), splits.device)

    def activation_output(self, need: Needs):
        return False, self.quantizer("input", True, False)
