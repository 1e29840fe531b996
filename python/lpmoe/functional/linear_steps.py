"""The GEMM sequence of one grouped linear layer, shared by the autograd
functions of GroupedLinear and GroupedMLP: the policy (lpmoe.policy) says
what each GEMM reads, these functions run the GEMMs in order and free what
is no longer needed as early as possible."""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from lpmoe.functional.gathered_rows import GatheredRows
from lpmoe.gemm import grouped_gemm
from lpmoe.grouped_tensor import GroupedTensor
from lpmoe.policy import Forward, Grad, LinearPolicy, Needs, Tokens, grouped_rows

__all__ = ["linear_forward", "backward_steps", "dgrad_first", "dgrad_first_by_size", "dgrad_step", "wgrad_step",
           "one_gemm_step", "bias_step", "bias_grad", "fused_wgrad_results", "is_weight_copy"]

# Width of the ones operand of the bias-gradient GEMM: the narrowest the
# grouped kernels take (N and K multiples of 16).
_BIAS_ONES_COLS = 16


def linear_forward(policy: LinearPolicy, x: Tokens, weights, biases, splits, need: Needs
                   ) -> Tuple[torch.Tensor, Forward]:
    """fprop of one layer; returns (y, the policy's Forward with what to save)."""
    fw = policy.forward(x, weights, splits, need)
    out = grouped_gemm(fw.x, fw.w, kind="fprop", bias=biases, m_splits=splits.host)
    fw.x = fw.w = None  # rowwise copies die here unless a cache keeps them
    return out, fw


def bias_grad(dy: torch.Tensor, splits) -> torch.Tensor:
    """(G, N) per-expert column sums of dy, deterministic and sync-free: a
    wgrad GEMM against a ones operand (fixed-order fp32 accumulation; no
    atomics, no host read of the splits)."""
    ones = torch.ones((dy.shape[0], _BIAS_ONES_COLS), dtype=dy.dtype, device=dy.device)
    sums = grouped_gemm(grouped_rows(dy, splits.device), grouped_rows(ones, splits.device), kind="wgrad",
                        out_dtype=torch.float32, m_splits=splits.host)
    # contiguous: the layer ops' fakes promise dense (G, N) gradients, and with
    # fp32 parameters bias_step's .to() would hand this strided view on
    return sums[:, :, 0].contiguous()


def dgrad_step(policy: LinearPolicy, grad: Grad, saved_w, splits, shape: Tuple[int, int, int]
               ) -> torch.Tensor:
    """dx = dy . W.  The Grad hands its dgrad operand over (made now if the
    policy quantizes per direction), so that copy dies with this GEMM."""
    g, n, k = shape
    dy = grad.take("dgrad")
    w = policy.dgrad_weights(saved_w, g, n, k, None if dy.is_quantized else dy.dtype)
    return grouped_gemm(dy, w, kind="dgrad", m_splits=splits.host)


def wgrad_step(grad: Grad, wgrad_tokens, splits, need: Needs, *, dtype: torch.dtype, main_grads=None):
    """Weight gradients dy^T . x: a (G, N, K) tensor, or, with ``main_grads``
    (fuse_wgrad_accumulation: the weights' fp32 gradient buffers, see
    :func:`main_grads_of`), added into those and None returned; None also
    when no weight gradient is needed."""
    if not need.wgrad:
        return None
    dy_op = grad.take("wgrad")

    def run(out, accumulate):
        out_dtype = None if out is not None else (torch.float32 if main_grads is not None else dtype)
        return grouped_gemm(dy_op, wgrad_tokens, kind="wgrad", out=out, accumulate=accumulate,
                            out_dtype=out_dtype, m_splits=splits.host)
    if main_grads is not None:
        _accumulate_main_grads(main_grads, run)
        return None
    return run(None, False)


def bias_step(grad: Grad, splits, need: Needs, dtype: torch.dtype) -> Optional[torch.Tensor]:
    """Bias gradients (G, N): the ones a quantization pass or the activation
    backward fused (``grad.dbias``), else a GEMM against ones.  Runs after
    the layer's GEMMs, so whichever pass ran first may have fused them."""
    if not need.dbias:
        return None
    dbias = grad.dbias if grad.dbias is not None else bias_grad(grad.hp, splits)
    return dbias.to(dtype)


def one_gemm_step(policy: LinearPolicy, grad: Grad, saved, splits, need: Needs, shape: Tuple[int, int, int],
                  *, dtype: torch.dtype, main_grads=None):
    """One of a layer's backward GEMMs alone, the one ``need`` asks for
    (a staged backward runs each in its own op): (dx or weight grads, bias
    grads).  ``saved`` is what that GEMM reads: the saved weights for dgrad,
    the saved input for wgrad (or either, unused, for a bias gradient alone)."""
    if need.dgrad:
        out = dgrad_step(policy, grad, saved, splits, shape)
    else:
        tokens = policy.wgrad_tokens(saved, splits) if need.wgrad else None
        del saved
        out = wgrad_step(grad, tokens, splits, need, dtype=dtype, main_grads=main_grads)
    return out, bias_step(grad, splits, need, dtype)


def dgrad_first(saved_x, saved_w, shape: Tuple[int, int, int], main_grads, weights_cached: bool = False,
                param_dtype: Optional[torch.dtype] = None) -> bool:
    """Whether a layer's dgrad runs before its wgrad.  Run first, wgrad
    frees x's transposed copy (rows x K) before dx (2 bytes each) is made;
    run first, dgrad frees W's transposed copy (G x N x K) before the weight
    gradient (2 bytes each) is made.  Counting what is alive in each order,
    dgrad first holds less exactly when the weights have more rows than the
    input, G*N > rows (few tokens per expert: fc1 of 64 DeepSeek-V3 experts
    at 8k tokens, top-8, holds 1.3 GB less); never when the weight
    gradient is added into main_grad (nothing is allocated for it), dgrad
    reads the weights themselves, or the copy is a weight cache's (no copy
    that dies with dgrad).  A copy is a quantized one, or the weights made
    in the compute dtype from parameters of another (``param_dtype``,
    torch.autocast)."""
    if saved_x is None:
        return False
    rows = saved_x.num_rows if isinstance(saved_x, GatheredRows) else (
        saved_x.logical_shape[0] if isinstance(saved_x, GroupedTensor) else saved_x.shape[0])
    copy = is_weight_copy(saved_w, param_dtype)
    return dgrad_first_by_size(rows, shape, copy and not weights_cached, main_grads is not None)


def is_weight_copy(saved_w, param_dtype: Optional[torch.dtype]) -> bool:
    """Whether a layer's saved weight operand is a copy it made, which dies
    with dgrad: a quantized one, or the weights made in the compute dtype
    from parameters of another (``param_dtype``, torch.autocast); not the
    parameters themselves."""
    return isinstance(saved_w, GroupedTensor) or (
        isinstance(saved_w, torch.Tensor) and param_dtype is not None and saved_w.dtype != param_dtype)


def dgrad_first_by_size(rows, shape: Tuple[int, int, int], frees_weight_copy: bool, into_main_grad: bool) -> bool:
    """:func:`dgrad_first` from sizes and flags (the compiled backward
    decides the order of its fc1 ops from its configuration).  A symbolic
    row count (a trace with dynamic shapes) counts as unknown: wgrad first."""
    if into_main_grad or not frees_weight_copy or not isinstance(rows, int):
        return False
    g, n, _ = shape
    return g * n > rows


def backward_steps(policy: LinearPolicy, grad: Grad, saved_x, saved_w, splits, need: Needs,
                   shape: Tuple[int, int, int], *, dtype: torch.dtype, main_grads=None, dx_to=None,
                   weights_cached: bool = False):
    """One layer's backward from an output gradient its policy prepared:
    (dx, weight grads, bias grads).  The two GEMMs run in the order that
    holds less at once (:func:`dgrad_first`; ``weights_cached``: the weight
    copy is a cache's): an operand whose only reference the caller handed
    over (the fused MLP's held copies) dies right after its GEMM, and a
    policy that quantizes dy per direction holds one copy at a time.
    ``dx_to``: applied to dx as soon as it is made (routed rows summed back
    to their tokens: the rows' gradient then dies before a wgrad that runs
    second)."""
    first = need.dgrad and need.wgrad and dgrad_first(saved_x, saved_w, shape, main_grads, weights_cached, dtype)
    dx = None
    if first:
        dx = dgrad_step(policy, grad, saved_w, splits, shape)
        dx = dx_to(dx) if dx_to is not None else dx
        saved_w = None
    tokens = policy.wgrad_tokens(saved_x, splits) if need.wgrad else None
    del saved_x
    w_grads = wgrad_step(grad, tokens, splits, need, dtype=dtype, main_grads=main_grads)
    del tokens
    if need.dgrad and not first:
        dx = dgrad_step(policy, grad, saved_w, splits, shape)
        dx = dx_to(dx) if dx_to is not None else dx
    return dx, w_grads, bias_step(grad, splits, need, dtype)


def main_grads_of(weights):
    """The weights' fp32 gradient buffers: one (G, N, K) tensor for a stacked
    weight, else a list of G (N, K) tensors."""
    if isinstance(weights, torch.Tensor):
        return weights.main_grad
    return [w.main_grad for w in weights]


def _stacked_main_grads(mgs: List[torch.Tensor]) -> Optional[torch.Tensor]:
    """The G main_grads as one (G, N, K) view when they are consecutive,
    contiguous pieces of one buffer (as a training framework's flat gradient
    buffer lays them out), else None."""
    m0 = mgs[0]
    step = m0.numel()
    for i, m in enumerate(mgs):
        if (not m.is_contiguous() or m.untyped_storage().data_ptr() != m0.untyped_storage().data_ptr()
                or m.storage_offset() != m0.storage_offset() + i * step):
            return None
    n, k = m0.shape
    return m0.as_strided((len(mgs), n, k), (step, k, 1))


def _accumulate_main_grads(main_grads, wgrad_into) -> None:
    """Adds the weight gradients into the weights' main_grads (fp32): in the
    wgrad GEMM's epilogue when the main_grads form one buffer (always, for a
    stacked weight), else through one fp32 product and G adds.  On the GPU
    both add the same fp32 product with one rounding (bitwise equal); the CPU
    reference rounds its fp64 product only once in the fused case."""
    if isinstance(main_grads, torch.Tensor):
        wgrad_into(main_grads, True)
        return
    stacked = _stacked_main_grads(main_grads)
    if stacked is not None:
        wgrad_into(stacked, True)
        return
    tmp = wgrad_into(None, False)
    for m, t in zip(main_grads, tmp.unbind(0)):
        m.add_(t)


def mark_added_to_main_grad(w: torch.Tensor):
    """TransformerEngine's convention for a weight whose gradient went into
    main_grad, which Megatron relies on: where the weight has
    ``grad_added_to_main_grad``, sets it and returns how its placeholder
    gradient is made (``torch.empty``, or ``torch.zeros`` with
    ``zero_out_wgrad``; autograd still runs its hooks); else None (autograd
    gets None)."""
    if not hasattr(w, "grad_added_to_main_grad"):
        return None
    w.grad_added_to_main_grad = True
    return torch.zeros if getattr(w, "zero_out_wgrad", False) else torch.empty


def fused_wgrad_results(weights):
    """What autograd gets for fused weights (:func:`mark_added_to_main_grad`):
    a list for per-expert weights, one entry for a stacked weight."""
    if isinstance(weights, torch.Tensor):
        return fused_wgrad_results([weights])[0]
    out: List[Optional[torch.Tensor]] = []
    for w in weights:
        make = mark_added_to_main_grad(w)
        out.append(None if make is None else make(w.shape, dtype=w.dtype, device=w.device))
    return out
