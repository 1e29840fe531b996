"""MoE layer building blocks: routing, token permutation, expert parallelism.

* :class:`TopKRouter` / :func:`router_scores`   scores, top-k, aux and z losses
* :func:`routing_map` / :class:`RoutingMap`      where each slot's row goes
* :func:`permute`, :func:`permute_rows`, :func:`unpermute`,
  :func:`permute_probs`, :func:`permute_fp8`     row movement (CUDA kernels
                                                 in csrc/permute, CPU reference)
* :func:`permute_quantize`, :class:`RoutedTokens`  FP8 expert rows quantized
                                                 straight from the tokens
* :class:`MoELayer`                              the whole layer, optionally
                                                 expert-parallel over a
                                                 torch.distributed group
Design and measurements: docs/moe-notes.md.
"""
from lpmoe.moe.routing_map import RoutingMap, routing_map  # noqa: F401
from lpmoe.moe.permute import permute, permute_fp8, permute_probs, permute_rows, unpermute  # noqa: F401
from lpmoe.moe.routed_tokens import RoutedTokens, permute_quantize  # noqa: F401
from lpmoe.moe.router import RouterOutput, TopKRouter, router_scores  # noqa: F401
from lpmoe.moe.layer import MoELayer, attach_aux_loss  # noqa: F401

__all__ = ["RoutingMap", "routing_map", "permute", "permute_fp8", "permute_probs", "permute_rows", "unpermute",
           "permute_quantize", "RoutedTokens",
           "RouterOutput", "TopKRouter", "router_scores", "MoELayer", "attach_aux_loss"]
