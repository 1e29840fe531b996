"""The fused AdamW + FP8 128x128 weight quantization step of one layer's
expert weights (csrc/optim): the CUDA kernel, or on the CPU the reference
(lpmoe.reference.optim) followed by lpmoe's reference quantizer, with the
same bits.  fp32 weights are stepped in place; bf16 / fp16 weights through
fp32 master copies, the weight then written as its master rounded to
nearest even, and quantized as written.

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


#: parameter dtypes stepped through fp32 master weights
MASTER_DTYPES = (torch.bfloat16, torch.float16)


def check_members(params: Sequence[Tensor], grads: Sequence[Tensor], masters: Sequence[Tensor],
                  exp_avgs: Sequence[Tensor], exp_avg_sqs: Sequence[Tensor]) -> None:
    """Same-shape 2-D tensors on one device, lists of one length: fp32
    params and grads without masters, or bf16 / fp16 params and grads of
    their dtype with fp32 masters; fp32 moments."""
    if not params:
        raise ValueError("the fused AdamW step needs at least one parameter")
    ref = params[0]
    if ref.dtype == torch.float32:
        if masters:
            raise ValueError(f"masters: float32 params are stepped in place and take no masters, got {len(masters)}")
    elif ref.dtype in MASTER_DTYPES:
        if len(masters) != len(params):
            raise ValueError(f"masters: {ref.dtype} params need one float32 master each, got {len(masters)} for "
                             f"{len(params)} params")
    else:
        raise TypeError(f"params[0] must be float32, bfloat16 or float16, got {ref.dtype}")
    if ref.dim() != 2:
        raise ValueError(f"params[0] must be 2-D (out, in), got shape {tuple(ref.shape)}")
    if ref.shape[1] % 16:
        raise ValueError(f"FP8 block scaling needs in_features to be a multiple of 16, got {ref.shape[1]}")
    lists = [("params", params, ref.dtype), ("grads", grads, ref.dtype), ("exp_avgs", exp_avgs, torch.float32),
             ("exp_avg_sqs", exp_avg_sqs, torch.float32)]
    if masters:
        lists.append(("masters", masters, torch.float32))
    for name, lst, dtype in lists:
        if len(lst) != len(params):
            raise ValueError(f"{name} has {len(lst)} tensors, params has {len(params)}")
        for i, t in enumerate(lst):
            if t.dtype != dtype or t.shape != ref.shape or t.device != ref.device:
                raise TypeError(f"{name}[{i}] must be a {str(dtype)[6:]} tensor of shape {tuple(ref.shape)} on "
                                f"{ref.device}, got {t.dtype} {tuple(t.shape)} on {t.device}")


def adamw_fp8_block_step_impl(params: List[Tensor], grads: List[Tensor], masters: List[Tensor],
                              exp_avgs: List[Tensor], exp_avg_sqs: List[Tensor], scalars: AdamWScalars,
                              quantizer: Float8BlockQuantizer, out: List[Tensor], validate: bool = True) -> None:
    """One AdamW step in place on the G (N, K) ``params`` (fp32, ``masters``
    empty; or bf16 / fp16 with their fp32 ``masters``, which are stepped and
    then rounded into the params) and their moments, and the 128x128 FP8
    rowwise + columnwise copies of the updated params, as
    ``group_quantize(stack(params), quantizer, num_tensors=G)`` lays them
    out, written into ``out`` (:data:`QUANTIZED_BUFFERS` order)."""
    if validate or not params[0].is_cuda:
        check_members(params, grads, masters, exp_avgs, exp_avg_sqs)
        if not (isinstance(quantizer, Float8BlockQuantizer) and quantizer.block_dim == 2):
            raise ValueError(f"the fused AdamW step writes 128x128 FP8 block weights, got {quantizer!r}")
    if params[0].is_cuda:
        ext().adamw_fp8_block_step(params, grads, masters, exp_avgs, exp_avg_sqs, list(scalars),
                                   quantizer.fp8_dtype == torch.float8_e5m2, quantizer.pow2_scales,
                                   quantizer.amax_epsilon, *out)
        # The kernel wrote them behind autograd's back: bump their version
        # counters as an in-place PyTorch op would (autograd's saved-tensor
        # check, WeightCache.holds), the FP8 buffers' too: a forward that
        # read them may have saved them for its backward.
        torch.autograd.graph.increment_version([*params, *masters, *exp_avgs, *exp_avg_sqs, *out])
        return
    from lpmoe.functional.weights import stack_weights
    from lpmoe.quantize import group_quantize
    if masters:
        for p, g, w, m, v in zip(params, grads, masters, exp_avgs, exp_avg_sqs):
            adamw_step_(w, g.float(), m, v, scalars)  # 16-bit gradients widen exactly
            p.copy_(w)  # round to nearest even, as the kernel does
    else:
        for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs):
            adamw_step_(p, g, m, v, scalars)
    q = group_quantize(stack_weights(params), quantizer.copy(rowwise=True, columnwise=True), num_tensors=len(params))
    for name, dst in zip(QUANTIZED_BUFFERS, out):
        src = getattr(q, name).reshape(-1)
        dst.view(-1)[: src.numel()].copy_(src)
