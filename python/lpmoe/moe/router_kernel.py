"""The fused router scoring kernel (csrc/router) behind router_scores on
the GPU, with autograd.

One launch computes the scores, the top-k experts and probabilities, the
per-token logsumexp (z-loss) and the per-expert affinity sums over tokens
(load-balancing loss).  PyTorch's softmax + topk + sum + divide sequence
was measured at ~55x this computation's memory floor at T=64k, E=64, k=8
(benchmarks/bench_moe.py); the kernel reads the logits once.

The backward is a second kernel (csrc/router/router_backward.cu): it
recomputes the scores from the saved logits and applies the closed-form
gradient (the selection is fixed by the saved indices).  It used to
recompute the scores with PyTorch ops and run autograd over them inside
the backward: cheap on the GPU, but a nested autograd pass of ~15 ops
took a quarter of a launch-bound MoE layer step's host time
(docs/moe-notes.md).  :func:`backward_reference` is the kernel's closed
form in PyTorch ops: the path off the GPU and the tests' reference (the
tests check it against autograd over the forward's formulas).

``CALLS`` counts the fused and the PyTorch paths.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from lpmoe._ext import ext, has_extension
from lpmoe.library._define import define
from lpmoe.library.routing import tracing

__all__ = ["fused_available", "fused_scores", "CALLS"]

CALLS = {"fused_router": 0, "torch_router": 0, "fused_router_backward": 0, "torch_router_backward": 0}

MAX_EXPERTS, MAX_TOP_K = 512, 32


def fused_available(logits: torch.Tensor, top_k: int) -> bool:
    return (logits.is_cuda and has_extension() and logits.dim() == 2 and logits.shape[1] <= MAX_EXPERTS
            and top_k <= MAX_TOP_K and logits.dtype in (torch.float32, torch.bfloat16, torch.float16))


def _fake(logits, k, sigmoid, normalize):
    t, e = logits.shape
    f = dict(dtype=torch.float32, device=logits.device)
    return [torch.empty(t, k, **f), torch.empty(t, k, dtype=torch.int64, device=logits.device),
            torch.empty(t, **f), torch.empty(e, **f), torch.empty(e, dtype=torch.int64, device=logits.device)]


@define("router_topk", _fake)
def _router_topk(logits: torch.Tensor, k: int, sigmoid: bool, normalize: bool) -> List[torch.Tensor]:
    return _impl(logits, k, sigmoid, normalize)


def _impl(logits, k, sigmoid, normalize):
    t, e = logits.shape
    if not logits.is_cuda:  # the op on CPU tensors: the same formulas in PyTorch ops (opcheck)
        l = logits.float()
        s = _scores(l, sigmoid)
        top, idx = torch.topk(s, k, dim=-1)
        probs = top / top.sum(-1, keepdim=True) if normalize else top
        aff = (s / s.sum(-1, keepdim=True) if sigmoid else s).sum(0)
        counts = torch.zeros(e, dtype=torch.int64).scatter_add_(0, idx.reshape(-1), torch.ones(idx.numel(),
                                                                                             dtype=torch.int64))
        return [probs, idx, torch.logsumexp(l, dim=-1), aff, counts]
    CALLS["fused_router"] += 1  # here, where the kernel runs: not in traced code (see router.py)
    logits = logits.contiguous()
    f = dict(dtype=torch.float32, device=logits.device)
    probs, idx = torch.empty(t, k, **f), torch.empty(t, k, dtype=torch.int64, device=logits.device)
    lse = torch.empty(t, **f)
    grid = ext().router_grid_size(t)
    partial = torch.empty(grid, e, **f)
    counts = torch.empty(grid, e, dtype=torch.int32, device=logits.device)
    ext().router_topk(logits, k, sigmoid, normalize, probs, idx, lse, partial, counts)
    # fixed-order reductions of the per-CTA partials: deterministic
    return [probs, idx, lse, partial.sum(0), counts.sum(0, dtype=torch.int64)]


def _scores(logits: torch.Tensor, sigmoid: bool) -> torch.Tensor:
    return torch.sigmoid(logits) if sigmoid else torch.softmax(logits, dim=-1)


class _FusedScores(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, k, sigmoid, normalize):
        probs, idx, lse, aff, counts = (_router_topk(logits, k, sigmoid, normalize) if tracing()
                                        else _impl(logits, k, sigmoid, normalize))
        ctx.mark_non_differentiable(idx, counts)
        # unused outputs' gradients stay None (the kernel reads them as 0)
        # instead of zero tensors made and filled for each
        ctx.set_materialize_grads(False)
        ctx.sigmoid, ctx.normalize = sigmoid, normalize
        ctx.save_for_backward(logits, idx)
        return probs, idx, lse, aff, counts

    @staticmethod
    def backward(ctx, g_probs, _g_idx, g_lse, g_aff, _g_counts):
        logits, idx = ctx.saved_tensors
        args = (logits, idx, g_probs, g_lse, g_aff, ctx.sigmoid, ctx.normalize)
        return (_router_backward(*args) if tracing() else _backward_impl(*args)), None, None, None


def _backward_fake(logits, indices, grad_probs, grad_lse, grad_affinity, sigmoid, normalize):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


@define("router_backward", _backward_fake)
def _router_backward(logits: torch.Tensor, indices: torch.Tensor, grad_probs: Optional[torch.Tensor],
                     grad_lse: Optional[torch.Tensor], grad_affinity: Optional[torch.Tensor], sigmoid: bool,
                     normalize: bool) -> torch.Tensor:
    return _backward_impl(logits, indices, grad_probs, grad_lse, grad_affinity, sigmoid, normalize)


def _backward_impl(logits, indices, grad_probs, grad_lse, grad_affinity, sigmoid, normalize):
    if not logits.is_cuda:
        CALLS["torch_router_backward"] += 1
        return backward_reference(logits, indices, grad_probs, grad_lse, grad_affinity, sigmoid, normalize)
    CALLS["fused_router_backward"] += 1
    logits = logits.contiguous()
    grad = torch.empty_like(logits)
    opt = lambda g: None if g is None else g.float().contiguous()  # noqa: E731  (an expanded ones, say)
    ext().router_backward(logits, indices.contiguous(), opt(grad_probs), opt(grad_lse), opt(grad_affinity), sigmoid,
                          normalize, grad)
    return grad


def backward_reference(logits: torch.Tensor, idx: torch.Tensor, g_probs: Optional[torch.Tensor],
                       g_lse: Optional[torch.Tensor], g_aff: Optional[torch.Tensor], sigmoid: bool, normalize: bool
                       ) -> torch.Tensor:
    """The kernel's closed form (csrc/router/topk_router.h) in PyTorch ops,
    fp32: the op off the GPU (an op's body runs below autograd, so it
    cannot differentiate the forward again) and the tests' reference, which
    they check against autograd over the forward's formulas."""
    l = logits.float()
    p = torch.softmax(l, dim=-1)
    s = torch.sigmoid(l) if sigmoid else p
    sel = torch.zeros_like(s).scatter_(1, idx, 1.0)
    g = torch.zeros_like(s) if g_probs is None else torch.zeros_like(s).scatter_(1, idx, g_probs.float())
    if normalize:
        picked = (s * sel).sum(-1, keepdim=True)
        ds = sel * (g - (g * s * sel).sum(-1, keepdim=True) / picked) / picked
    else:
        ds = sel * g
    if g_aff is not None:
        ga = g_aff.float()
        if sigmoid:
            z = s.sum(-1, keepdim=True)
            ds = ds + (ga - (ga * s).sum(-1, keepdim=True) / z) / z
        else:
            ds = ds + ga
    dl = ds * s * (1 - s) if sigmoid else s * (ds - (ds * s).sum(-1, keepdim=True))
    if g_lse is not None:
        dl = dl + g_lse.float()[:, None] * p
    return dl.to(logits.dtype)


def fused_scores(logits: torch.Tensor, top_k: int, sigmoid: bool, normalize: bool
                 ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(probs (T, k) fp32, indices (T, k) int64, logsumexp (T,) fp32,
    affinity sums over tokens (E,) fp32, slots per expert (E,) int64) from
    one kernel launch."""
    return _FusedScores.apply(logits, top_k, sigmoid, normalize)
