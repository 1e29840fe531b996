"""Top-k token router with the Switch / DeepSeek load-balancing losses.

For tokens x (T, H) and router weight W (E, H):

    logits  l = x W^T, then fp32
    scores  s = softmax(l)            (score="softmax")
            s = sigmoid(l)            (score="sigmoid", DeepSeek-V3)
    top-k   (v, idx) = topk(s, k)     (per token, largest first)
    probs   p = v / sum(v)            (normalize=True, the default for k > 1;
                                       for softmax this is the softmax of the
                                       k selected logits)

Auxiliary losses (scalars on the device, added into ``aux_loss``):

    load balancing  aux_loss_coeff * E / (T k) * sum_e count_e * mean_t s'_{t,e}
                    count_e = slots routed to e; s' = s for softmax, and
                    s / sum_e s for sigmoid (DeepSeek-V3's normalised
                    affinities).  With k = 1 this is Switch Transformer's
                    E * sum_e f_e P_e; for k > 1 it is DeepSeek's
                    sequence-wise form taken over the whole batch.
    router z-loss   z_loss_coeff * mean_t logsumexp(l_t)^2       (ST-MoE)

Everything stays on the device (no host sync), captures in CUDA graphs and
compiles.  On the GPU one fused kernel computes the scores, the top-k and
the loss statistics (lpmoe.moe.router_kernel, up to 512 experts and k <=
32); elsewhere the same formulas run as PyTorch ops.  Ties between equal
scores go to the lower expert index in the kernel (PyTorch's topk does
not specify); a token whose logits are all NaN gets no valid expert (its
slots are dropped by the routing map).
"""
from __future__ import annotations

import math
from typing import Callable, NamedTuple, Optional, Union

import torch

from lpmoe._async_inputs import ready
from lpmoe.library.routing import tracing
from lpmoe.moe import router_kernel

__all__ = ["TopKRouter", "RouterOutput", "router_scores"]


class RouterOutput(NamedTuple):
    probs: torch.Tensor             # (T, k) fp32
    indices: torch.Tensor           # (T, k) int64 expert of each slot
    aux_loss: torch.Tensor          # () fp32: coefficient-weighted load-balancing + z-loss
    tokens_per_expert: torch.Tensor  # (E,) int64 slots routed to each expert (before any capacity)


def router_scores(logits: torch.Tensor, top_k: int, score: str = "softmax", normalize: bool = True,
                  aux_loss_coeff: float = 0.0, z_loss_coeff: float = 0.0) -> RouterOutput:
    """The routing decision for fp32-able ``logits`` (T, E); see the module
    docstring for the formulas."""
    if score not in ("softmax", "sigmoid"):
        raise ValueError(f"score must be 'softmax' or 'sigmoid', got {score!r}")
    logits = ready(logits)
    t, e = logits.shape
    sigmoid = score == "sigmoid"
    if router_kernel.fused_available(logits, top_k):
        probs, idx, lse, affinity_sum, counts = router_kernel.fused_scores(logits, top_k, sigmoid, normalize)
    else:
        if not tracing():  # a counter bumped in compiled code is a guard that fails on every call
            router_kernel.CALLS["torch_router"] += 1
        logits = logits.float()
        scores = torch.sigmoid(logits) if sigmoid else torch.softmax(logits, dim=-1)
        top, idx = torch.topk(scores, top_k, dim=-1)
        probs = top / top.sum(-1, keepdim=True) if normalize else top
        lse = torch.logsumexp(logits, dim=-1)
        affinity_sum = (scores / scores.sum(-1, keepdim=True) if sigmoid else scores).sum(0)
        counts = torch.zeros(e, dtype=torch.int64, device=logits.device).scatter_add_(
            0, idx.reshape(-1), torch.ones(idx.numel(), dtype=torch.int64, device=logits.device))
    aux = torch.zeros((), dtype=torch.float32, device=logits.device)
    if aux_loss_coeff and t > 0:
        aux = aux + aux_loss_coeff * e / (t * top_k) * (counts.float() * affinity_sum / t).sum()
    if z_loss_coeff and t > 0:
        aux = aux + z_loss_coeff * lse.square().mean()
    return RouterOutput(probs, idx, aux, counts)


class TopKRouter(torch.nn.Module):
    """``weight`` (E, H): state-dict key ``weight`` (as Megatron's router).

    Args:
        hidden_size, num_experts, top_k: H, E, k (1 <= k <= E).
        score: "softmax" or "sigmoid".
        aux_loss_coeff, z_loss_coeff: weights of the losses in ``aux_loss``.
        normalize: renormalise the k probabilities to sum to 1 (default:
            True for k > 1).
        params_dtype, device: of the weight (default: torch's default dtype).
        init_method: initialises the weight in place (default: normal, std
            0.02 scaled like nn.Linear's fan-in bound).
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, score: str = "softmax",
                 aux_loss_coeff: float = 0.0, z_loss_coeff: float = 0.0, normalize: Optional[bool] = None,
                 params_dtype: Optional[torch.dtype] = None, device: Union[str, torch.device] = "cuda",
                 init_method: Optional[Callable[[torch.Tensor], None]] = None):
        super().__init__()
        for name, v in (("hidden_size", hidden_size), ("num_experts", num_experts), ("top_k", top_k)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if top_k > num_experts:
            raise ValueError(f"top_k ({top_k}) must not exceed num_experts ({num_experts})")
        if score not in ("softmax", "sigmoid"):
            raise ValueError(f"score must be 'softmax' or 'sigmoid', got {score!r}")
        for name, v in (("aux_loss_coeff", aux_loss_coeff), ("z_loss_coeff", z_loss_coeff)):
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
                raise ValueError(f"{name} must be a finite non-negative number, got {v!r}")
        self.hidden_size, self.num_experts, self.top_k, self.score = hidden_size, num_experts, top_k, score
        self.aux_loss_coeff, self.z_loss_coeff = float(aux_loss_coeff), float(z_loss_coeff)
        self.normalize = top_k > 1 if normalize is None else bool(normalize)
        self.weight = torch.nn.Parameter(torch.empty(num_experts, hidden_size, dtype=params_dtype, device=device))
        with torch.no_grad():
            (init_method or (lambda w: torch.nn.init.normal_(w, std=hidden_size ** -0.5)))(self.weight)

    def forward(self, x: torch.Tensor) -> RouterOutput:
        """``x`` (T, H) -> :class:`RouterOutput`."""
        if x.dim() != 2 or x.shape[1] != self.hidden_size:
            raise ValueError(f"x must be (tokens, {self.hidden_size}), got shape {tuple(x.shape)}")
        if x.device != self.weight.device:
            raise ValueError(f"x is on {x.device} but the router weight is on {self.weight.device}")
        logits = torch.nn.functional.linear(x.to(self.weight.dtype), self.weight)
        return router_scores(logits, self.top_k, self.score, self.normalize, self.aux_loss_coeff, self.z_loss_coeff)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_experts={self.num_experts}, top_k={self.top_k}, "
                f"score={self.score!r}, aux_loss_coeff={self.aux_loss_coeff}, z_loss_coeff={self.z_loss_coeff}")
