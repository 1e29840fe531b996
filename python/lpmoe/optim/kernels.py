"""The fused AdamW + FP8 128x128 weight quantization step of one layer's
expert weights (csrc/optim): the CUDA kernel, or on the CPU the reference
(lpmoe.reference.optim) followed by lpmoe's reference quantizer, with the
same bits.

Called through :data:`lpmoe.library.routing.OPS` (``adamw_fp8_block_step``),
so torch.compile sees the custom op ``lpmoe::adamw_fp8_block_step``."""
from __future__ import annotations

from typing import List, Sequence

import torch

from lpmoe._ext import ext
from lpmoe.quantizers import Float8BlockQuantizer
from lpmoe.reference.optim import AdamWScalars, adamw_step_

__all__ = ["adamw_fp8_block_step_impl", "fused_launches"]

Tensor = torch.Tensor

#: the buffers of the 128x128 GroupedTensor the step writes, in argument order
QUANTIZED_BUFFERS = ("rowwise_data", "scale_inv", "columnwise_data", "columnwise_scale_inv")


def fused_launches() -> int:
    """Launches of the fused CUDA kernel in this process (tests prove the path)."""
    return int(ext().adamw_fp8_block_launches())


def check_members(params: Sequence[Tensor], grads: Sequence[Tensor], exp_avgs: Sequence[Tensor],
                  exp_avg_sqs: Sequence[Tensor]) -> None:
    """Same-shape 2-D fp32 tensors on one device, four lists of one length."""
    if not params:
        raise ValueError("the fused AdamW step needs at least one parameter")
    lists = (("params", params), ("grads", grads), ("exp_avgs", exp_avgs), ("exp_avg_sqs", exp_avg_sqs))
    ref = params[0]
    if ref.dim() != 2:
        raise ValueError(f"params[0] must be 2-D (out, in), got shape {tuple(ref.shape)}")
    if ref.shape[1] % 16:
        raise ValueError(f"FP8 block scaling needs in_features to be a multiple of 16, got {ref.shape[1]}")
    for name, lst in lists:
        if len(lst) != len(params):
            raise ValueError(f"{name} has {len(lst)} tensors, params has {len(params)}")
        for i, t in enumerate(lst):
            if t.dtype != torch.float32 or t.shape != ref.shape or t.device != ref.device:
                raise TypeError(f"{name}[{i}] must be a float32 tensor of shape {tuple(ref.shape)} on {ref.device}, "
                                f"got {t.dtype} {tuple(t.shape)} on {t.device}")


def adamw_fp8_block_step_impl(params: List[Tensor], grads: List[Tensor], exp_avgs: List[Tensor],
                              exp_avg_sqs: List[Tensor], scalars: AdamWScalars, quantizer: Float8BlockQuantizer,
                              out: List[Tensor], validate: bool = True) -> None:
    """One AdamW step in place on the G (N, K) fp32 ``params`` and their
    moments, and the 128x128 FP8 rowwise + columnwise copies of the updated
    weights, as ``group_quantize(stack(params), quantizer, num_tensors=G)``
    lays them out, written into ``out`` (:data:`QUANTIZED_BUFFERS` order)."""
    if validate or not params[0].is_cuda:
        check_members(params, grads, exp_avgs, exp_avg_sqs)
        if not (isinstance(quantizer, Float8BlockQuantizer) and quantizer.block_dim == 2):
            raise ValueError(f"the fused AdamW step writes 128x128 FP8 block weights, got {quantizer!r}")
    if params[0].is_cuda:
        ext().adamw_fp8_block_step(params, grads, exp_avgs, exp_avg_sqs, list(scalars),
                                   quantizer.fp8_dtype == torch.float8_e5m2, quantizer.pow2_scales,
                                   quantizer.amax_epsilon, *out)
        # The kernel wrote them behind autograd's back: bump their version
        # counters as an in-place PyTorch op would (autograd's saved-tensor
        # check, WeightCache.holds).
        torch.autograd.graph.increment_version([*params, *exp_avgs, *exp_avg_sqs])
        return
    from lpmoe.functional.weights import stack_weights
    from lpmoe.quantize import group_quantize
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs):
        adamw_step_(p, g, m, v, scalars)
    q = group_quantize(stack_weights(params), quantizer.copy(rowwise=True, columnwise=True), num_tensors=len(params))
    for name, dst in zip(QUANTIZED_BUFFERS, out):
        src = getattr(q, name).reshape(-1)
        dst.view(-1)[: src.numel()].copy_(src)
