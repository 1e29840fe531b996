"""The fused router scoring kernel (csrc/router) behind router_scores on
the GPU, with autograd.

One launch computes the scores, the top-k experts and probabilities, the
per-token logsumexp (z-loss) and the per-expert affinity sums over tokens
(load-balancing loss).  PyTorch's softmax + topk + sum + divide sequence
was measured at ~55x this computation's memory floor at T=64k, E=64, k=8
(benchmarks/bench_moe.py); the kernel reads the logits once.  The backward
recomputes the scores from the saved logits with PyTorch ops and lets
autograd differentiate them (the selection is fixed by the saved indices),
which is cheap next to the forward and needs no second kernel.

``CALLS`` counts the fused and the PyTorch paths.
"""
from __future__ import annotations

from typing import List, Tuple

import torch

from lpmoe._ext import ext, has_extension
from lpmoe.library._define import define
from lpmoe.library.routing import tracing

__all__ = ["fused_available", "fused_scores", "CALLS"]

CALLS = {"fused_router": 0, "torch_router": 0}

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
    if not logits.is_cuda:  # the op on CPU tensors: the same formulas in PyTorch ops
        l = logits.float()
        s = _scores(l, sigmoid)
        top, idx = torch.topk(s, k, dim=-1)
        probs = top / top.sum(-1, keepdim=True) if normalize else top
        aff = (s / s.sum(-1, keepdim=True) if sigmoid else s).sum(0)
        counts = torch.zeros(e, dtype=torch.int64).scatter_add_(0, idx.reshape(-1), torch.ones(idx.numel(),
                                                                                             dtype=torch.int64))
        return [probs, idx, torch.logsumexp(l, dim=-1), aff, counts]
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
        ctx.sigmoid, ctx.normalize = sigmoid, normalize
        ctx.save_for_backward(logits, idx)
        return probs, idx, lse, aff, counts

    @staticmethod
    def backward(ctx, g_probs, _g_idx, g_lse, g_aff, _g_counts):
        logits, idx = ctx.saved_tensors
        with torch.enable_grad():
            l = logits.detach().float().requires_grad_()
            s = _scores(l, ctx.sigmoid)
            v = s.gather(1, idx)
            outs, grads = [v / v.sum(-1, keepdim=True) if ctx.normalize else v], [g_probs]
            if g_lse is not None:
                outs.append(torch.logsumexp(l, dim=-1))
                grads.append(g_lse)
            if g_aff is not None:
                outs.append((s / s.sum(-1, keepdim=True) if ctx.sigmoid else s).sum(0))
                grads.append(g_aff)
            keep = [i for i, g in enumerate(grads) if g is not None]
            torch.autograd.backward([outs[i] for i in keep], [grads[i] for i in keep])
        return l.grad.to(logits.dtype), None, None, None


def fused_scores(logits: torch.Tensor, top_k: int, sigmoid: bool, normalize: bool
                 ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(probs (T, k) fp32, indices (T, k) int64, logsumexp (T,) fp32,
    affinity sums over tokens (E,) fp32, slots per expert (E,) int64) from
    one kernel launch."""
    CALLS["fused_router"] += 1
    return _FusedScores.apply(logits, top_k, sigmoid, normalize)
