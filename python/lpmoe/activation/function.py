"""``lpmoe.activation.activation``: the expert-MLP activation as a standalone
autograd op (high precision; the fused FP8 forms live in lpmoe.GroupedMLP)."""
from __future__ import annotations

from typing import Optional, Union

import torch

from lpmoe._async_inputs import ready
from lpmoe.activation import kernels
from lpmoe.activation.spec import Activation, parse_activation

__all__ = ["activation"]


class _ActivationFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h2d, probs, spec: Activation):
        a = kernels.forward(h2d, spec, probs, None, write_hp=True).hp
        ctx.spec = spec
        ctx.save_for_backward(h2d, probs)
        return a

    @staticmethod
    def backward(ctx, da):
        h2d, probs = ctx.saved_tensors
        need_h, need_p = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not (need_h or need_p):
            return None, None, None
        res = kernels.backward(da, h2d, ctx.spec, probs, None, dh_hp=need_h, dprobs=need_p)
        return res.dh, res.dprobs if need_p else None, None


def activation(h: torch.Tensor, activation: Union[str, Activation] = "swiglu",
               probs: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The activation of an expert MLP, with an optional per-row scale.

    Args:
        h: (..., W) bf16/fp16/fp32; W = 2F for GLU activations (gate first).
        activation: a name or :class:`lpmoe.activation.Activation`.
        probs: optional (...) per-row scales multiplied into the output
            (router probabilities); its gradient is returned.
    Returns (..., F) in h's dtype: the fp32 activation rounded once
    (lpmoe.reference.activation gives the exact math).  CUDA bf16/fp16 run
    the fused kernels, everything else the bit-exact reference.
    """
    spec = parse_activation(activation)
    h, probs = ready(h), ready(probs)
    if not isinstance(h, torch.Tensor) or not h.is_floating_point() or h.dim() < 1:
        raise TypeError(f"h must be a floating-point tensor of shape (..., W), got "
                        f"{type(h).__name__ if not isinstance(h, torch.Tensor) else (h.dtype, tuple(h.shape))}")
    if h.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"h must be bf16, fp16 or fp32, got {h.dtype}")
    w = h.shape[-1]
    if spec.is_glu and w % 2:
        raise ValueError(f"{spec.kind} needs an even last dim (gate and value halves), got {w}")
    f = w // 2 if spec.is_glu else w
    if h.is_cuda and h.dtype != torch.float32 and f % 16:
        raise ValueError(f"the activation kernels need F (output features) to be a multiple of 16, got {f}")
    h2d = h.reshape(-1, w).contiguous()
    if probs is not None:
        if not isinstance(probs, torch.Tensor) or tuple(probs.shape) != tuple(h.shape[:-1]):
            raise ValueError(f"probs must have h's leading shape {tuple(h.shape[:-1])}, got "
                             f"{tuple(probs.shape) if isinstance(probs, torch.Tensor) else type(probs).__name__}")
        if probs.device != h.device or not probs.is_floating_point():
            raise TypeError(f"probs must be a floating-point tensor on {h.device}")
        probs = probs.reshape(-1)
    out = _ActivationFn.apply(h2d, probs, spec)
    return out.view(*h.shape[:-1], f)
