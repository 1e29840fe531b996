"""``lpmoe.GroupedMLP``: the expert MLP of an MoE block, activation fused."""
from __future__ import annotations

from typing import Callable, Optional, Union

import torch

from lpmoe.activation.spec import Activation, parse_activation
from lpmoe.autocast import get_autocast_recipe
from lpmoe.functional.mlp import LayerParams, grouped_mlp
from lpmoe.module.grouped_linear import GroupedLinear

__all__ = ["GroupedMLP"]


def layer_params(linear: GroupedLinear) -> LayerParams:
    """A GroupedLinear's parameters and options, for lpmoe.functional.grouped_mlp."""
    weights, biases = linear.functional_params()
    return LayerParams(weights, biases, linear.weight_cache, linear.fuse_wgrad_accumulation,
                       linear.save_original_input)


class GroupedMLP(torch.nn.Module):
    """G expert MLPs ``fc2(act(fc1(x)) * probs)`` over G consecutive row blocks.

    Two :class:`lpmoe.GroupedLinear` named ``linear_fc1`` (hidden -> ffn, or
    2*ffn for GLU activations with the gate rows first) and ``linear_fc2``
    (ffn -> hidden): state-dict keys ``linear_fc1.weight{i}``,
    ``linear_fc2.weight{i}`` (+ ``bias{i}``), as Megatron-style grouped MLPs
    built from TransformerEngine's GroupedLinear.  The activation between
    them is fused (lpmoe.functional.grouped_mlp): under FP8 block scaling it
    reads fc1's output once and writes fc2's FP8 input directly, and in the
    backward writes fc1's FP8 gradient operands directly.

    Args:
        num_experts, hidden_size, ffn_hidden_size: G, H, F.
        activation: "swiglu" (default), "geglu", "gelu", "relu",
            "clamped_swiglu", or an :class:`lpmoe.activation.Activation`.
        bias: per-expert biases in both layers.
        params_dtype, device: as GroupedLinear.
        init_method / output_layer_init_method: initialise fc1 / fc2
            weights in place (default: GroupedLinear's).
        fuse_wgrad_accumulation: add weight gradients into ``main_grad``
            (see GroupedLinear).
        single_grouped_parameter: each layer holds one stacked (G, out, in)
            weight parameter instead of G (see GroupedLinear); state dicts
            keep the per-expert keys.
        save_original_input: fc1 keeps its input itself (or, given
            lpmoe.moe.RoutedTokens, the tokens) for the backward instead of
            the FP8 copy (see GroupedLinear); fc2's input is made inside.
    """

    def __init__(self, num_experts: int, hidden_size: int, ffn_hidden_size: int,
                 activation: Union[str, Activation] = "swiglu", bias: bool = False,
                 params_dtype: Optional[torch.dtype] = None, device: Union[str, torch.device] = "cuda",
                 init_method: Optional[Callable[[torch.Tensor], None]] = None,
                 output_layer_init_method: Optional[Callable[[torch.Tensor], None]] = None,
                 fuse_wgrad_accumulation: bool = False, single_grouped_parameter: bool = False,
                 save_original_input: bool = False):
        super().__init__()
        self.activation = parse_activation(activation)
        for name, v in (("num_experts", num_experts), ("hidden_size", hidden_size),
                        ("ffn_hidden_size", ffn_hidden_size)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.ffn_hidden_size = ffn_hidden_size
        kw = dict(bias=bias, params_dtype=params_dtype, device=device, fuse_wgrad_accumulation=fuse_wgrad_accumulation,
                  single_grouped_parameter=single_grouped_parameter)
        self.linear_fc1 = GroupedLinear(num_experts, hidden_size, self.activation.input_width(ffn_hidden_size),
                                        init_method=init_method, save_original_input=save_original_input, **kw)
        self.linear_fc2 = GroupedLinear(num_experts, ffn_hidden_size, hidden_size,
                                        init_method=output_layer_init_method, **kw)

    def forward(self, x, m_splits=None, probs: Optional[torch.Tensor] = None,
                is_first_microbatch: Optional[bool] = None) -> torch.Tensor:
        """``x`` (..., hidden) grouped by expert; ``m_splits`` tokens per
        expert (CUDA int tensor: graph-safe; list: host path); ``probs``
        optional per-token scales (x's leading shape).  Returns (..., hidden).
        Or ``x`` = lpmoe.moe.RoutedTokens(tokens, routing_map) with
        ``m_splits`` None: the grouped rows read from the tokens through the
        map (FP8 block scaling quantizes them as it gathers); ``probs`` and
        the result are then per grouped row."""
        return grouped_mlp(x, m_splits, layer_params(self.linear_fc1), layer_params(self.linear_fc2),
                           activation=self.activation, probs=probs, recipe=get_autocast_recipe(),
                           is_first_microbatch=is_first_microbatch)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
                f"ffn_hidden_size={self.ffn_hidden_size}, activation={self.activation!r}")
