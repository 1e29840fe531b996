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
(``foreach`` / ``fused`` as given).  With ``master_weights=True`` every
bf16 / fp16 parameter is trained through an fp32 master copy in its state
(lpmoe.optim.masters).  A layer is stepped by the fused kernel when its
weights are fp32 (torch.autocast trains them in bf16, see
lpmoe.functional.precision) or 16-bit with master weights, all have
gradients of the weights' dtype, its last forward asked for
FP8 128x128 block weights (the FP8 block recipe), and the group's options
are plain AdamW (no amsgrad, maximize, capturable, differentiable,
non-decoupled decay, tensor hyperparameters; no GradScaler with
``fused=True``); otherwise torch steps it and the layer quantizes in its
forward, as without this optimizer.  :func:`stats` counts both outcomes.
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Union

import torch

from lpmoe.functional.weights import quantize_new_cache, register_optimizer_cache, stack_weights
from lpmoe.library.routing import OPS
from lpmoe.optim.kernels import MASTER_DTYPES, QUANTIZED_BUFFERS
from lpmoe.optim.masters import Masters, keep_fp32_state, masters_in_place_of
from lpmoe.optim.units import ExpertWeights, expert_weights_of
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
            weights written by :meth:`step`: those whose weights are
            parameters of this optimizer, each layer's all in one group
            (layers this optimizer does not step are left alone).
        master_weights: keep an fp32 master copy of every bf16 / fp16
            parameter (state ``master_param``), step the master and write
            the parameter as the master rounded to its dtype
            (TransformerEngine FusedAdam's ``master_weights``); the moments
            of such parameters are fp32.  fp32 parameters are stepped in
            place either way.
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, *,
                 fp8_weights_of: Optional[Union[torch.nn.Module, Iterable[torch.nn.Module]]] = None,
                 master_weights: bool = False, maximize: bool = False, foreach: Optional[bool] = None,
                 capturable: bool = False, differentiable: bool = False, fused: Optional[bool] = None):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         maximize=maximize, foreach=foreach, capturable=capturable,
                         differentiable=differentiable, fused=fused)
        self.master_weights = bool(master_weights)
        self._masters = Masters(self.state)
        found = expert_weights_of(fp8_weights_of) if fp8_weights_of is not None else []
        group_of = self._group_of()
        self._layers: List[ExpertWeights] = []
        claimed = set()
        for unit in found:
            groups = _groups_of(unit, group_of)
            if groups == {None}:
                continue  # another optimizer's (or frozen) layer
            if any(id(p) in claimed for p in unit.params):
                # weights shared with a layer found before (tied layers): the
                # first layer's unit steps them (once); this layer's cache is
                # never recorded, so its forward quantizes them itself
                continue
            claimed.update(id(p) for p in unit.params)
            if None in groups:
                raise ValueError(f"fp8_weights_of: only some of the weights of layer {unit.name!r} are parameters "
                                 "of this optimizer; give it all of a layer's weights or none")
            if len(groups) != 1:
                raise ValueError(f"fp8_weights_of: the weights of layer {unit.name!r} are split across parameter "
                                 "groups; put each layer's weights in one group")
            self._layers.append(unit)
            # a compiled default call finds the cache by its weights (and records what it wants)
            register_optimizer_cache(unit.cache, unit.weights)
        if fp8_weights_of is not None and not self._layers:
            raise ValueError("fp8_weights_of: none of its lpmoe GroupedLinear layers has its weights in this "
                             "optimizer")
        self._rest_cache = None
        self._groups_cache = None

    def _group_of(self) -> Dict[int, int]:
        return {id(p): i for i, g in enumerate(self.param_groups) for p in g["params"]}

    def _layer_groups(self) -> List[Optional[dict]]:
        """Each layer's parameter group now (None: no longer stepped here),
        found again whenever the groups change (add_param_group, reordering)."""
        key = tuple((id(g["params"]), len(g["params"])) for g in self.param_groups)
        if self._groups_cache is None or self._groups_cache[0] != key:
            group_of = self._group_of()
            found = []
            for unit in self._layers:
                gs = _groups_of(unit, group_of)
                found.append(self.param_groups[gs.pop()] if len(gs) == 1 and None not in gs else None)
            self._groups_cache = (key, found)
        return self._groups_cache[1]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.master_weights and self._masters.unverified:
            self._masters.verify([p for g in self.param_groups for p in g["params"]])
        stepped = []
        for unit, group in zip(self._layers, self._layer_groups()):
            if group is not None and self._fused_step(unit, group):
                stepped.append(unit)
            elif group is not None:
                self._hand_to_torch(unit, group)
        if not stepped:
            self._step_rest()
            return loss
        # torch's AdamW steps the rest: the groups without the fused layers'
        # parameters for the length of the call
        kept = [g["params"] for g in self.param_groups]
        try:
            rest = self._rest_of(stepped)
            for g, ps in zip(self.param_groups, rest):
                g["params"] = ps
            if any(rest):
                self._step_rest()
        finally:
            for g, ps in zip(self.param_groups, kept):
                g["params"] = ps
        return loss

    def _step_rest(self) -> None:
        """torch's AdamW over the groups' parameters as they are now (for
        master weights: over the masters in the 16-bit parameters' place)."""
        if self.master_weights:
            with masters_in_place_of(self._masters, self.param_groups):
                _torch_step(self)
        else:
            _torch_step(self)

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._masters = Masters(self.state)  # torch's load made a new state dict
        if self.master_weights:
            keep_fp32_state(self, state_dict)
            self._masters.unverified = True

    def _hand_to_torch(self, unit: ExpertWeights, group: dict) -> None:
        """``unit`` goes through torch's AdamW this step: its step counts
        are taken over again before the next fused step (torch may step
        only some experts), and a fused / capturable group gets them back
        on the parameters' device, where torch keeps them."""
        if any(p.grad is not None for p in unit.params):
            _STATS["torch"] += 1
        unit.counts = None
        if group.get("fused") or group.get("capturable"):
            for p in unit.params:
                st = self.state.get(p)
                if st and st["step"].device != p.device:
                    st["step"] = st["step"].to(p.device, torch.float32, copy=True)

    def _rest_of(self, stepped: List[ExpertWeights]) -> List[list]:
        """Each group's parameters without those of the ``stepped`` layers
        (kept from the last step while the groups and the set are the same:
        the host cost of a step with many experts)."""
        key = (tuple(id(u) for u in stepped), tuple((id(g["params"]), len(g["params"])) for g in self.param_groups))
        if self._rest_cache is None or self._rest_cache[0] != key:
            ids = {id(p) for u in stepped for p in u.params}
            self._rest_cache = (key, [[p for p in g["params"] if id(p) not in ids] for g in self.param_groups])
        return self._rest_cache[1]

    def _fusable(self, unit: ExpertWeights, group: dict):
        """(quantizer to write ``unit``'s FP8 weights in, the gradients), or
        None (torch steps it).  Checked per step, in host-cheap order; the
        binding checks devices, shapes and alignment."""
        wanted = unit.cache.wanted
        if not (isinstance(wanted, Float8BlockQuantizer) and wanted.block_dim == 2):
            return None
        if group["amsgrad"] or group["maximize"] or group.get("capturable") or group.get("differentiable") \
                or not group.get("decoupled_weight_decay", True):
            return None
        if any(isinstance(group[k], torch.Tensor) for k in ("lr", "weight_decay", "eps")) or any(
                isinstance(b, torch.Tensor) for b in group["betas"]):
            return None
        # GradScaler hands a fused optimizer its scale and inf flag to apply
        # itself (torch's fused kernels do); the fused layer step does not:
        # torch steps these layers then.
        if getattr(self, "grad_scale", None) is not None or getattr(self, "found_inf", None) is not None:
            return None
        params = unit.params
        grads = [p.grad for p in params]
        dtype = params[0].dtype
        if not (dtype == torch.float32 or (self.master_weights and dtype in MASTER_DTYPES)):
            return None
        for p, g in zip(params, grads):
            if g is None or p.dtype != dtype or g.dtype != dtype or g.layout != torch.strided \
                    or not g.is_contiguous():
                return None
        if getattr(params[0], "grad_added_to_main_grad", False):
            return None  # .grad is a placeholder (the gradient went to main_grad): as torch would, torch steps it
        if unit.quantizer is None or unit.quantizer[0] is not wanted:
            unit.quantizer = (wanted, wanted.copy(rowwise=True, columnwise=True))
            unit.buffers_of = None  # another format: check the cache's buffers again
        return unit.quantizer[1], grads

    def _fused_step(self, unit: ExpertWeights, group: dict) -> bool:
        fusable = self._fusable(unit, group)
        if fusable is None:
            return False
        q, grads = fusable
        params = unit.params
        states = [self.state[p] for p in params]
        counts = unit.counts
        if counts is None or any(st.get("step") is None or st["step"]._base is not counts for st in states):
            counts = self._adopt_steps(unit, params, states)
            if counts is None:
                return False
        step = int(counts[0]) + 1
        beta1, beta2 = group["betas"]
        scalars = adamw_scalars(group["lr"], beta1, beta2, group["eps"], group["weight_decay"], step)
        cache = unit.cache
        members = (lambda ts: list(ts[0].unbind(0))) if params[0].dim() == 3 else list
        weights = members(params)
        masters = members([self._masters.master(p) for p in params]) if params[0].dtype in MASTER_DTYPES else []
        if cache.quantized is None or unit.buffers_of is not cache.quantized:
            g, n, k = unit.shape
            p0 = params[0]
            if not cache.usable_for(q, g, (g * n, k), p0.dtype, p0.device):
                # the cache's buffers, made once (their values are overwritten below)
                cache.quantized = quantize_new_cache(stack_weights(weights), q, g)
            unit.buffers_of = cache.quantized
        OPS["adamw_fp8_block_step"](weights, members(grads), masters, members([st["exp_avg"] for st in states]),
                                    members([st["exp_avg_sq"] for st in states]), scalars, cache.quantized.quantizer,
                                    [getattr(cache.quantized, b) for b in QUANTIZED_BUFFERS], validate=False)
        counts.add_(1.0)  # every expert's step count, one op (after the launch: a refused launch counts nothing)
        if masters:
            self._masters.written(params)
        cache.record(unit.weights)
        _STATS["fused"] += 1
        return True

    def _adopt_steps(self, unit: ExpertWeights, params, states) -> Optional[torch.Tensor]:
        """Make (first step) or take over (a loaded state dict, a step by
        torch) the layer's state, its step counts as 0-dim views of one CPU
        tensor so a step adds 1 to all of them in one op; torch's AdamW
        reads and writes such views as its own.  None when the experts'
        counts differ (torch steps the layer)."""
        fresh = ["step" not in st for st in states]
        if any(fresh) and not all(fresh):
            return None  # some experts were stepped before, some never: torch's per-expert counts
        for p, st in zip(params, states):
            w = self._masters.master(p) if p.dtype in MASTER_DTYPES else p
            if "step" not in st:
                st["step"] = torch.tensor(0.0, dtype=torch.float32)
                st["exp_avg"] = torch.zeros_like(w, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(w, memory_format=torch.preserve_format)
        counts = torch.stack([st["step"].detach().to("cpu", torch.float32).reshape(()) for st in states])
        first = float(counts[0])  # once per layer and adoption (a device step from torch's fused AdamW: a sync)
        if not bool((counts == first).all()):
            return None
        for i, st in enumerate(states):
            st["step"] = counts[i]
        unit.counts = counts
        return counts


def _groups_of(unit: ExpertWeights, group_of: Dict[int, int]) -> set:
    """Indices of the parameter groups holding ``unit``'s weights (None for
    a weight in none)."""
    return {group_of.get(id(p)) for p in unit.params}


def _torch_step(opt: AdamW) -> None:
    """torch.optim.AdamW's step on ``opt`` without a second round of the
    optimizer-step hooks (torch wraps each class's step with them once an
    instance exists; ours already ran them)."""
    base = torch.optim.AdamW.step
    if getattr(base, "hooked", False):
        base = base.__wrapped__
    base(opt)
