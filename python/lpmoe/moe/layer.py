"""``lpmoe.moe.MoELayer``: router -> permute -> (expert-parallel dispatch)
-> GroupedMLP -> (combine) -> unpermute, as one module."""
from __future__ import annotations

import fractions
import math
from typing import Optional, Union

import torch

from lpmoe.activation.spec import Activation
from lpmoe.autocast import get_autocast_recipe
from lpmoe.functional.precision import compute_input
from lpmoe.module.grouped_mlp import GroupedMLP
from lpmoe.moe.dispatch import CapacityAllToAll, HostSplitAllToAll, LocalDispatch
from lpmoe.moe.expert_numbering import register_global_expert_numbering
from lpmoe.moe.permute import permute_probs, permute_rows, unpermute
from lpmoe.moe.routed_tokens import RoutedTokens
from lpmoe.moe.router import TopKRouter
from lpmoe.moe.routing_map import routing_map
from lpmoe.policy import Needs, policy_for

__all__ = ["MoELayer", "attach_aux_loss"]

#: largest denominator of the capacity factor taken as a fraction (MoELayer.capacity)
_CAPACITY_DENOMINATOR = 10 ** 6


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on ``y`` whose backward also sends the gradient ``scale``
    into ``aux``: the auxiliary loss trains without the caller adding it,
    as if ``scale * aux`` were part of the loss."""

    @staticmethod
    def forward(ctx, y, aux, scale):
        ctx.scale = scale
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full((), ctx.scale, dtype=torch.float32, device=grad.device), None


def attach_aux_loss(y: torch.Tensor, aux: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``y`` unchanged; its backward also trains ``aux`` with gradient ``scale``."""
    return _AttachAuxLoss.apply(y, aux, float(scale)) if aux.requires_grad else y


class MoELayer(torch.nn.Module):
    """A complete MoE layer over tokens x (..., hidden).

    Args:
        hidden_size, ffn_hidden_size, num_experts, top_k: H, F, E, k.
        activation, bias, params_dtype, device, init_method,
            output_layer_init_method: the experts' (lpmoe.GroupedMLP).
        score, aux_loss_coeff, z_loss_coeff, normalize: the router's
            (lpmoe.moe.TopKRouter).  The auxiliary loss trains through the
            output's backward (nothing to add to the loss); its last value
            is ``self.aux_loss`` (detached, for logging).  The gradient
            enters as if ``aux_loss_scale * aux_loss`` were added to the
            loss: set ``aux_loss_scale`` to the factor the loss is scaled
            by (e.g. 1/gradient-accumulation steps; DDP's gradient
            averaging applies to it as to everything else).
        capacity_factor: None (default) keeps every routed slot; a number c
            caps each expert at ceil(c * T * k / E) slots per step (c taken
            as the nearest fraction with a denominator up to 10^6, e.g. 0.6
            as 3/5, and the ceiling in integer arithmetic, so compiled code
            with a dynamic token count computes the same sizes; per
            source rank with expert parallelism), the overflow is dropped
            (its contribution is 0) and counted in ``self.tokens_dropped``.
        ep_group: a torch.distributed process group to split the experts
            over (E divisible by its size; rank r owns experts
            [r*E/W, (r+1)*E/W)).  Without capacity_factor the exchange is
            exact with one host sync per step; with it, every size is
            static and the step is graph-safe.
        dispatch_fp8: send the dispatched rows as FP8 (1x128 blocks, about
            half the bytes; needs expert parallelism and H % 128 == 0).
        single_grouped_parameter: the experts' layers hold one stacked
            (E_local, out, in) weight each instead of E_local (less host
            work per step; see lpmoe.GroupedLinear); the state dict is the
            same.
        save_original_input: under FP8 block scaling the experts keep the
            tokens (which the router's backward keeps anyway when its weight
            has the tokens' dtype) for fc1's weight gradient instead of an
            FP8 copy of their rows (see below).  No effect with expert
            parallelism, whose rows are made by the exchange (keeping them
            would cost more than the FP8 copy).

    Without expert parallelism, under FP8 block scaling, the experts
    receive the tokens and the routing map (``lpmoe.moe.RoutedTokens`` with
    ``sum_to_tokens``, ``m_splits`` None) instead of permuted rows and
    return the tokens' outputs: fc1's input and fc2's output gradient are
    quantized as they are gathered from the tokens (and their gradient), so
    the bf16 grouped rows are never made (forward hooks on ``self.experts``
    then see that object; ``.rows()`` gives the rows).  Other recipes, and replaced expert modules, get the
    permuted rows.  With ``save_original_input=True`` the experts keep no copy of
    their input for the backward either: fc1's weight-gradient GEMM reads a
    transposed FP8 copy gathered from the tokens again (which the router
    keeps anyway), one more pass over the tokens for k x T x H bytes less
    held between forward and backward.

    The state dict numbers experts globally (``experts.linear_fc1.weight{e}``
    for global expert e) on every rank, so a single-GPU state dict loads on
    each expert-parallel rank (each keeps its experts) and the ranks'
    dicts together are the single-GPU dict.  Without ``ep_group`` the layer
    is graph-safe: routing stays on the device.
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, num_experts: int, top_k: int,
                 activation: Union[str, Activation] = "swiglu", ep_group=None, *, score: str = "softmax",
                 aux_loss_coeff: float = 0.0, z_loss_coeff: float = 0.0, normalize: Optional[bool] = None,
                 capacity_factor: Optional[float] = None, dispatch_fp8: bool = False, bias: bool = False,
                 params_dtype: Optional[torch.dtype] = None, device: Union[str, torch.device] = "cuda",
                 init_method=None, output_layer_init_method=None, single_grouped_parameter: bool = False,
                 save_original_input: bool = False):
        super().__init__()
        if dispatch_fp8 and ep_group is None:
            raise ValueError("dispatch_fp8 needs expert parallelism (an ep_group)")
        if dispatch_fp8 and hidden_size % 128:
            raise ValueError(f"dispatch_fp8 needs hidden_size % 128 == 0, got {hidden_size}")
        self.hidden_size, self.num_experts, self.top_k = hidden_size, num_experts, top_k
        self.capacity_factor = capacity_factor
        self.ep_group = ep_group
        self.router = TopKRouter(hidden_size, num_experts, top_k, score=score, aux_loss_coeff=aux_loss_coeff,
                                 z_loss_coeff=z_loss_coeff, normalize=normalize, params_dtype=params_dtype,
                                 device=device)
        if ep_group is None:
            self.ep_rank, self.ep_size = 0, 1
        else:
            import torch.distributed as dist
            self.ep_rank, self.ep_size = dist.get_rank(ep_group), dist.get_world_size(ep_group)
            if num_experts % self.ep_size:
                raise ValueError(f"num_experts ({num_experts}) must be divisible by the ep_group size "
                                 f"({self.ep_size})")
        self.num_local_experts = num_experts // self.ep_size
        self.experts = GroupedMLP(self.num_local_experts, hidden_size, ffn_hidden_size, activation=activation,
                                  bias=bias, params_dtype=params_dtype, device=device, init_method=init_method,
                                  output_layer_init_method=output_layer_init_method,
                                  single_grouped_parameter=single_grouped_parameter)
        if not isinstance(save_original_input, bool):
            raise TypeError(f"save_original_input must be a bool, got {save_original_input!r}")
        self.save_original_input = save_original_input
        self.dispatch_fp8 = bool(dispatch_fp8)
        self.aux_loss_scale = 1.0
        self.aux_loss: Optional[torch.Tensor] = None
        self.tokens_dropped: Optional[torch.Tensor] = None
        if self.ep_size > 1:
            register_global_expert_numbering(self, "experts.", self.ep_rank * self.num_local_experts,
                                             self.num_local_experts)

    @property
    def capacity_factor(self) -> Optional[float]:
        return self._capacity_factor

    @capacity_factor.setter
    def capacity_factor(self, value: Optional[float]) -> None:
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or
                                  not math.isfinite(value) or value <= 0):
            raise ValueError(f"capacity_factor must be a positive number or None, got {value!r}")
        self._capacity_factor = value
        # c as a small fraction (0.6 is 3/5, 1.1 is 11/10: what the decimal
        # says, not its binary neighbour): sizes from integers only.  A float
        # read in traced code becomes a symbolic input under dynamic shapes,
        # and sizes derived from it have no source Dynamo can lift; small
        # terms keep c * T * k within int64 wherever a compiler inlines it.
        f = None if value is None else fractions.Fraction(value).limit_denominator(_CAPACITY_DENOMINATOR)
        self._capacity_ratio = None if f is None else (f.numerator, f.denominator)

    def capacity(self, tokens: int) -> Optional[int]:
        """Slots kept per expert (per source rank) for ``tokens`` tokens, or
        None: ceil(c * tokens * k / E) in integer arithmetic."""
        if self._capacity_ratio is None:
            return None
        num, den = self._capacity_ratio
        return max(1, -(-(num * tokens * self.top_k) // (den * self.num_experts)))

    def _dispatcher(self, cap: Optional[int]):
        if self.ep_group is None:
            return LocalDispatch()
        if cap is None:
            return HostSplitAllToAll(self.ep_group, self.num_experts, self.dispatch_fp8)
        return CapacityAllToAll(self.ep_group, self.num_experts, cap, self.dispatch_fp8)

    def forward(self, x: torch.Tensor, is_first_microbatch: Optional[bool] = None) -> torch.Tensor:
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"x must be (..., {self.hidden_size}), got shape {tuple(x.shape)}")
        # under torch.autocast the tokens are cast once here (the experts
        # would cast them, or their k-times larger permuted rows, anyway)
        tokens, _ = compute_input(x.reshape(-1, self.hidden_size), None)
        cast = tokens.dtype != x.dtype  # the layer's own copy: not an original fc1 may keep
        routed = self.router(tokens)
        cap = self.capacity(tokens.shape[0])
        disp = self._dispatcher(cap)
        rmap = routing_map(routed.indices, self.num_experts, cap, layout=disp.layout)
        probs = permute_probs(routed.probs, rmap)
        if isinstance(disp, LocalDispatch) and self._experts_gather():
            # The experts read the tokens through the map and sum their rows'
            # outputs back to the tokens: under FP8 block scaling fc1's input
            # and fc2's output gradient are quantized as they are gathered,
            # so neither bf16 (rows, H) buffer is made (lpmoe.moe.routed_tokens).
            out = self.experts(RoutedTokens(tokens, rmap, sum_to_tokens=True,
                                            save_original=self.save_original_input and not cast),
                               None, probs=probs, is_first_microbatch=is_first_microbatch)
        else:
            grouped = disp.dispatch(permute_rows(tokens, rmap), probs, rmap)
            y = disp.combine(self.experts(grouped.x, grouped.m_splits, probs=grouped.probs,
                                          is_first_microbatch=is_first_microbatch), grouped)
            out = unpermute(y, rmap)
        # (probabilities were applied inside the experts, fused with the activation)
        if not torch.compiler.is_compiling():
            self.aux_loss, self.tokens_dropped = routed.aux_loss.detach(), rmap.dropped
        return attach_aux_loss(out, routed.aux_loss, self.aux_loss_scale).view(x.shape)

    def _experts_gather(self) -> bool:
        """Hand the experts RoutedTokens: they are lpmoe's GroupedMLP and
        the active recipe quantizes their input as it gathers it (FP8 block
        scaling; eager or compiled alike).  Otherwise the plain call with
        permuted rows, so other recipes, replaced expert modules and hooks
        see what they always saw."""
        if not isinstance(self.experts, GroupedMLP):
            return False
        return policy_for(get_autocast_recipe()).gathers_input(Needs(dgrad=True, wgrad=True, dbias=False))

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, top_k={self.top_k}, ep_size={self.ep_size}, "
                f"capacity_factor={self.capacity_factor}, dispatch_fp8={self.dispatch_fp8}")
