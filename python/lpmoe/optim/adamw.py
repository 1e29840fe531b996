"""``lpmoe.optim.AdamW``: torch.optim.AdamW whose step also writes the FP8
weights of lpmoe's expert layers.

An FP8 layer quantizes its weights in every forward: each step reads every
weight again (4 bytes for fp32 parameters) to write its FP8 copies (2 bytes),
right after the optimizer wrote the weight.  This optimizer steps each
layer's expert weights with one fused kernel (csrc/optim) that also writes
the 128x128 FP8 rowwise and transposed copies of the updated weights into
the layer's :class:`~lpmoe.functional.WeightCache`; the layer's next eager
forward finds them current (:meth:`WeightCache.holds`) and quantizes
nothing.  Numbers: docs/optimizer-notes.md.

Everything else is torch.optim.AdamW: the same hyperparameters, parameter
groups, state layout (``step``, ``exp_avg``, ``exp_avg_sq``) and state
dicts, and the other parameters go through torch's implementation
(``foreach`` / ``fused`` as given).  A layer is stepped by the fused kernel
when its weights are fp32 (torch.autocast trains them in bf16, see
lpmoe.functional.precision), all have gradients, its last forward asked for
FP8 128x128 block weights (the FP8 block recipe), and the group's options
are plain AdamW (no amsgrad, maximize, capturable, differentiable, tensor
lr); otherwise torch steps it and the layer quantizes in its forward, as
without this optimizer.  :func:`stats` counts both outcomes.
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Union

import torch

from lpmoe.library.routing import OPS
from lpmoe.optim.kernels import QUANTIZED_BUFFERS
from lpmoe.optim.units import ExpertWeights, expert_weights_of
from lpmoe.quantize import group_quantize
from lpmoe.quantizers import Float8BlockQuantizer
from lpmoe.reference.optim import adamw_scalars

__all__ = ["AdamW", "stats"]

_STATS = {"fused": 0, "torch": 0}


def stats() -> Dict[str, int]:
    """Layer steps so far: ``fused`` (kernel wrote the FP8 weights) and
    ``torch`` (a registered layer stepped by torch.optim.AdamW instead)."""
    return dict(_STATS)


class AdamW(torch.optim.AdamW):
    """torch.optim.AdamW plus the FP8 weights of lpmoe layers (module docstring).

    Args:
        params, lr, betas, eps, weight_decay, amsgrad, maximize, foreach,
            capturable, differentiable, fused: as torch.optim.AdamW.
        fp8_weights_of: a module (or modules) whose lpmoe GroupedLinear
            layers (also those inside GroupedMLP and MoELayer) get their FP8
            weights written by :meth:`step`.  Their weights must be
            parameters of this optimizer, each layer's in one group.
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, *,
                 fp8_weights_of: Optional[Union[torch.nn.Module, Iterable[torch.nn.Module]]] = None,
                 maximize: bool = False, foreach: Optional[bool] = None, capturable: bool = False,
                 differentiable: bool = False, fused: Optional[bool] = None):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         maximize=maximize, foreach=foreach, capturable=capturable,
                         differentiable=differentiable, fused=fused)
        self._layers: List[ExpertWeights] = expert_weights_of(fp8_weights_of) if fp8_weights_of is not None else []
        group_of = {id(p): i for i, g in enumerate(self.param_groups) for p in g["params"]}
        self._group_index = []
        for unit in self._layers:
            groups = {group_of.get(id(p)) for p in unit.params}
            if None in groups:
                raise ValueError(f"fp8_weights_of: the weights of layer {unit.name!r} are not parameters of this "
                                 "optimizer")
            if len(groups) != 1:
                raise ValueError(f"fp8_weights_of: the weights of layer {unit.name!r} are split across parameter "
                                 "groups; put each layer's weights in one group")
            self._group_index.append(groups.pop())

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        stepped = set()
        for unit, gi in zip(self._layers, self._group_index):
            if self._fused_step(unit, self.param_groups[gi]):
                stepped.update(id(p) for p in unit.params)
            elif all(p.grad is not None for p in unit.params):
                _STATS["torch"] += 1
        if not stepped:
            super().step()
            return loss
        # torch's AdamW steps the rest: the groups without the fused layers'
        # parameters for the length of the call
        kept = [g["params"] for g in self.param_groups]
        try:
            for g in self.param_groups:
                g["params"] = [p for p in g["params"] if id(p) not in stepped]
            super().step()
        finally:
            for g, ps in zip(self.param_groups, kept):
                g["params"] = ps
        return loss

    def _fusable(self, unit: ExpertWeights, group: dict) -> Optional[Float8BlockQuantizer]:
        """The quantizer to write ``unit``'s FP8 weights in, or None (torch steps it)."""
        q = unit.cache.wanted
        if not (isinstance(q, Float8BlockQuantizer) and q.block_dim == 2):
            return None
        if group["amsgrad"] or group["maximize"] or group.get("capturable") or group.get("differentiable"):
            return None
        if any(isinstance(group[k], torch.Tensor) for k in ("lr", "weight_decay", "eps")) or any(
                isinstance(b, torch.Tensor) for b in group["betas"]):
            return None
        for p in unit.params:
            g = p.grad
            if g is None or g.is_sparse or p.dtype != torch.float32 or g.dtype != torch.float32:
                return None
            if not (p.is_contiguous() and g.is_contiguous()) or g.device != p.device:
                return None
        return q.copy(rowwise=True, columnwise=True)

    def _fused_step(self, unit: ExpertWeights, group: dict) -> bool:
        q = self._fusable(unit, group)
        if q is None:
            return False
        params = unit.params
        states = [self.state[p] for p in params]
        for p, st in zip(params, states):
            if len(st) == 0:
                st["step"] = torch.tensor(0.0, dtype=torch.float32)
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            elif st["step"].device.type != "cpu":
                st["step"] = st["step"].cpu()  # a state dict saved by a fused / capturable torch AdamW: once
            st["step"] += 1
        step = int(states[0]["step"].item())  # a CPU tensor: no device sync
        beta1, beta2 = group["betas"]
        scalars = adamw_scalars(group["lr"], beta1, beta2, group["eps"], group["weight_decay"], step)
        g, n, k = unit.shape
        cache = unit.cache
        p0 = params[0]
        if not cache.usable_for(q, g, (g * n, k), p0.dtype, p0.device):
            # the cache's buffers, made once (their values are overwritten below)
            stacked = p0.view(g * n, k) if p0.dim() == 3 else torch.stack(params).view(g * n, k)
            cache.quantized = group_quantize(stacked, q, num_tensors=g)
        members = lambda ts: list(ts[0].unbind(0)) if ts[0].dim() == 3 else list(ts)  # noqa: E731
        OPS["adamw_fp8_block_step"](members(params), members([p.grad for p in params]),
                                    members([st["exp_avg"] for st in states]),
                                    members([st["exp_avg_sq"] for st in states]), scalars, cache.quantized.quantizer,
                                    [getattr(cache.quantized, b) for b in QUANTIZED_BUFFERS])
        cache.record(unit.weights)
        _STATS["fused"] += 1
        return True
