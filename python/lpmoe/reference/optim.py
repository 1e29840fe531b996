"""Pure-PyTorch reference of the fused AdamW step (csrc/optim/adamw_fp8_block.h).

The fused kernel and this reference compute the same sequence of IEEE fp32
operations, each rounded to nearest, with the same fp32 scalars, so they
agree bit for bit (docs/optimizer-notes.md).  The scalars are made on the
host from the hyperparameters in double precision, as torch.optim's
single-tensor AdamW makes its own, then rounded once to fp32.  The result
equals torch.optim.AdamW's up to the rounding order (torch's three
implementations differ from one another in the same way).
"""
from __future__ import annotations

import math
import struct
from typing import NamedTuple

import torch

__all__ = ["AdamWScalars", "adamw_scalars", "adamw_step_"]


def _f32(x: float) -> float:
    """x rounded to the nearest fp32 value (as a Python float)."""
    return struct.unpack("f", struct.pack("f", float(x)))[0]


class AdamWScalars(NamedTuple):
    """The eight fp32 scalars of one step, in the kernel's argument order."""
    decay: float
    beta1: float
    one_minus_beta1: float
    beta2: float
    one_minus_beta2: float
    step_size: float
    bias_correction2_sqrt: float
    eps: float


def adamw_scalars(lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                  step: int) -> AdamWScalars:
    """Step ``step`` (1-based) of AdamW with these hyperparameters."""
    bias_correction1 = 1.0 - beta1 ** step
    bias_correction2 = 1.0 - beta2 ** step
    return AdamWScalars(_f32(1.0 - lr * weight_decay), _f32(beta1), _f32(1.0 - beta1), _f32(beta2),
                        _f32(1.0 - beta2), _f32(lr / bias_correction1), _f32(math.sqrt(bias_correction2)),
                        _f32(eps))


def _full(t: torch.Tensor, value: float) -> torch.Tensor:
    # A stride-0 tensor rather than a Python scalar: CUDA divides by a host
    # scalar as a multiplication by its reciprocal, which is not the
    # correctly rounded quotient the kernel computes.
    return torch.tensor(value, dtype=torch.float32, device=t.device).expand_as(t)


@torch.no_grad()
def adamw_step_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                s: AdamWScalars) -> None:
    """One AdamW step in place on fp32 ``param``, ``exp_avg``, ``exp_avg_sq``."""
    for name, t in (("param", param), ("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if t.dtype != torch.float32:
            raise TypeError(f"{name} must be float32, got {t.dtype}")
    decayed = param * _full(param, s.decay)
    exp_avg.copy_(exp_avg * _full(exp_avg, s.beta1) + grad * _full(grad, s.one_minus_beta1))
    exp_avg_sq.copy_(exp_avg_sq * _full(exp_avg_sq, s.beta2) + (grad * grad) * _full(grad, s.one_minus_beta2))
    denom = exp_avg_sq.sqrt() / _full(exp_avg_sq, s.bias_correction2_sqrt) + _full(exp_avg_sq, s.eps)
    param.copy_(decayed - (exp_avg * _full(exp_avg, s.step_size)) / denom)
