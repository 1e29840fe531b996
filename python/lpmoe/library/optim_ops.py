"""Custom op of the fused optimizer step.

``lpmoe::adamw_fp8_block_step``  AdamW on G same-shape weights (fp32, or
                                 bf16 / fp16 with fp32 masters) plus the
                                 128x128 FP8 copies of the updated weights;
                                 mutates the weights, masters, moments and
                                 the four quantized buffers, returns nothing
"""
from __future__ import annotations

from typing import List

import torch

from lpmoe.library import specs
from lpmoe.library._define import define
from lpmoe.library.routing import OPS, tracing
from lpmoe.optim.kernels import adamw_fp8_block_step_impl
from lpmoe.reference.optim import AdamWScalars

Tensor = torch.Tensor


def _step_fake(params, grads, masters, exp_avgs, exp_avg_sqs, scalars, quantizer, out):
    return None


@define("adamw_fp8_block_step", _step_fake, mutates_args=("params", "masters", "exp_avgs", "exp_avg_sqs", "out"))
def _step(params: List[Tensor], grads: List[Tensor], masters: List[Tensor], exp_avgs: List[Tensor],
          exp_avg_sqs: List[Tensor], scalars: List[float], quantizer: str, out: List[Tensor]) -> None:
    adamw_fp8_block_step_impl(params, grads, masters, exp_avgs, exp_avg_sqs, AdamWScalars(*scalars),
                              specs.decode(quantizer), out)


def adamw_fp8_block_step(params, grads, masters, exp_avgs, exp_avg_sqs, scalars: AdamWScalars, quantizer, out,
                         validate: bool = True) -> None:
    """Eager calls run the implementation directly (lpmoe.library.routing).
    ``validate=False``: the caller (lpmoe.optim.AdamW) made the inputs, so
    only the binding's own checks run (the host cost of many experts)."""
    if tracing():
        _step(list(params), list(grads), list(masters), list(exp_avgs), list(exp_avg_sqs),
              [float(s) for s in scalars], specs.encode(quantizer), list(out))
    else:
        adamw_fp8_block_step_impl(params, grads, masters, exp_avgs, exp_avg_sqs, scalars, quantizer, out, validate)


OPS["adamw_fp8_block_step"] = adamw_fp8_block_step
