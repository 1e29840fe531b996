"""``lpmoe.functional.grouped_linear``: the expert GEMMs of an MoE layer.

    y_t = x_t . W_t^T (+ b_t)        for expert t = 0 .. G-1

``inp`` holds the tokens of all experts as consecutive row blocks
(``m_splits[t]`` rows for expert t, in expert order).

Two ways to give the splits
---------------------------
* **graph-safe path**: ``m_splits`` is an int tensor on the input's CUDA
  device.  Nothing in forward or backward reads it on the host: no sync, so
  the layer can be captured in a CUDA graph and replayed with new routing.
  Checks that need the values (no negatives, sum <= rows) cannot run; bad
  splits are clamped by the kernels (see :func:`lpmoe.grouped_gemm`).
* **host path**: ``m_splits`` is a list of ints or a CPU tensor.  It is
  validated on the host, copied to the device once, and handed to
  :func:`lpmoe.grouped_gemm` (which lets it fall back to cuBLASLt where the
  sync-free kernels do not cover a case, e.g. fp32 or E5M2 gradients).

On the CPU both run lpmoe's fp64 reference GEMMs on the same quantized
operands as the GPU, so CPU results predict GPU numerics.

Capacity tail: rows past ``sum(m_splits)`` belong to no expert.  Their
output rows are 0 and their input-gradient rows are 0.

Recipes (see :mod:`lpmoe.recipe`)
---------------------------------
* none: GEMMs in the input dtype (bf16 / fp16 / fp32; fp32 on CUDA needs
  the host path).
* :class:`~lpmoe.recipe.Float8BlockScaling`: x 1x128, W 128x128, dy 1x128
  FP8 through the grouped FP8 GEMMs; bf16 activations and parameters only
  (the FP8 grouped GEMMs write bf16).  ``Format.HYBRID`` (E5M2 gradients)
  needs the host path on CUDA: the sync-free kernels take E4M3 only, and
  silently changing the gradient format would change the recipe's numerics,
  so the graph-safe path raises instead.
* :class:`~lpmoe.recipe.MXFP8BlockScaling`,
  :class:`~lpmoe.recipe.NVFP4BlockScaling`: **emulated** (Hopper has no
  such tensor cores).  The forward quantizes x and W along K and
  dequantizes them; the backward quantizes dy along N and reuses the saved
  dequantized x and W; every GEMM runs in high precision.  The wgrad
  operands are therefore not re-quantized along the token dim, unlike a
  hardware recipe.  NVFP4 needs every split to be a multiple of 16.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from lpmoe._async_inputs import ready
from lpmoe.autocast import get_autocast_recipe
from lpmoe.functional import saved
from lpmoe.functional.checks import check_main_grads, check_params, check_recipe
from lpmoe.functional.linear_steps import backward_steps, fused_wgrad_results, linear_forward, main_grads_of
from lpmoe.functional.precision import autocast_off, compute_input
from lpmoe.functional.params import (Params, any_requires_grad, as_inputs, from_inputs, grads_for, input_count,
                                     is_stacked)
from lpmoe.functional.splits import Splits, parse_splits, splits_for_checks
from lpmoe.functional.weights import WeightCache, WeightSource, cache_in_use
from lpmoe.grouped_tensor import shares_offsets
from lpmoe.library.routing import OPS, tracing
from lpmoe.policy import LinearPolicy, Needs, Tokens, policy_for
from lpmoe.recipe import Recipe

__all__ = ["grouped_linear", "LinearConfig", "linear_forward_impl", "linear_backward_impl", "needs_of"]


@dataclass
class LinearConfig:
    """Everything static about one call (the op path carries it as JSON)."""
    policy: LinearPolicy
    num: int
    has_bias: bool
    weight_cache: Optional[WeightCache]
    is_first_microbatch: Optional[bool]
    grad_enabled: bool  # read at call time: Function.forward always runs with grad disabled
    need: Needs
    fuse_wgrad_accumulation: bool = False
    stacked: bool = False  # one (G, N, K) weight (+ (G, N) bias) instead of G of each
    save_original_input: bool = False


@shares_offsets
def linear_forward_impl(x2d: torch.Tensor, splits: Splits, weights, biases, cfg: LinearConfig):
    """y and what the backward reads: (y, (saved_x, saved_w))."""
    need = cfg.need
    wsrc = WeightSource(weights, cfg.weight_cache, cfg.is_first_microbatch, cfg.grad_enabled, x2d.dtype)
    out, fw = linear_forward(cfg.policy, Tokens(hp=x2d, save_original=cfg.save_original_input), wsrc, biases,
                             splits, need)
    return out, (fw.saved_x if need.wgrad else None, fw.saved_w if need.dgrad else None)


@shares_offsets
def linear_backward_impl(grad_out: torch.Tensor, saved_x, saved_w, splits: Splits, cfg: LinearConfig,
                         shape: Tuple[int, int, int], dtype: torch.dtype, main_grads=None):
    """(dx or None, weight grads (G, N, K) or None, bias grads (G, N) or None;
    see linear_steps.backward_steps)."""
    need = cfg.need
    dy = grad_out.contiguous()  # e.g. an expanded (stride-0) grad of .sum()
    grad = cfg.policy.grad(dy, splits, need)
    return backward_steps(cfg.policy, grad, saved_x, saved_w, splits, need, shape, dtype=dtype,
                          main_grads=main_grads,
                          weights_cached=cache_in_use(cfg.weight_cache, cfg.is_first_microbatch))


class _GroupedLinear(torch.autograd.Function):
    """Eager autograd: sequences the three GEMMs; what they read and what is
    saved is the recipe policy's business (lpmoe.policy).  Under
    torch.compile the same implementation runs as the custom op
    ``lpmoe::grouped_linear`` (lpmoe.library.layer_ops)."""

    @staticmethod
    def forward(ctx, x2d, splits, cfg: LinearConfig, *params):
        num = input_count(cfg.num, cfg.stacked)
        weights = from_inputs(params[:num], cfg.stacked)
        biases = from_inputs(params[num:], cfg.stacked) if cfg.has_bias else None
        with autocast_off():
            out, (sx, sw) = linear_forward_impl(x2d, splits, weights, biases, cfg)
        saved.save(ctx, sx, sw)
        ctx.cfg, ctx.splits = cfg, splits
        ctx.main_grad_weights = weights if cfg.fuse_wgrad_accumulation else None
        ctx.shape = (cfg.num,) + tuple(params[0].shape[-2:])
        ctx.dtype = params[0].dtype  # the parameters' gradients' (dx comes in x's, the compute dtype)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        cfg = ctx.cfg
        saved_x, saved_w = saved.load(ctx)
        fused = ctx.main_grad_weights
        ctx.main_grad_weights = None
        with autocast_off():
            dgrad, w_grads, b_grads = linear_backward_impl(grad_out, saved_x, saved_w, ctx.splits, cfg, ctx.shape,
                                                           ctx.dtype, None if fused is None else main_grads_of(fused))
        if fused is not None and cfg.need.wgrad:
            w_grads = fused_wgrad_results(fused)
        grads = [dgrad, None, None] + grads_for(w_grads, cfg.num, cfg.stacked)
        if cfg.has_bias:
            grads += grads_for(b_grads, cfg.num, cfg.stacked)
        return tuple(grads)


def needs_of(x: torch.Tensor, weights, biases, grad_enabled: bool) -> Needs:
    """Which gradients a call must produce (what autograd would ask for)."""
    return Needs(dgrad=grad_enabled and x.requires_grad, wgrad=grad_enabled and any_requires_grad(weights),
                 dbias=grad_enabled and any_requires_grad(biases))


# ------------------------------------------------------------------ public
def grouped_linear(inp: torch.Tensor, m_splits, weights: Params, biases: Optional[Params] = None,
                   recipe: Optional[Recipe] = None, *,
                   weight_cache: Optional[WeightCache] = None,
                   is_first_microbatch: Optional[bool] = None,
                   fuse_wgrad_accumulation: bool = False,
                   save_original_input: bool = False) -> torch.Tensor:
    """Grouped linear layer: rows of expert t (in order) times ``W_t^T`` (+ ``b_t``).

    Args:
        inp: (tokens, in_features) or (..., in_features), bf16/fp16/fp32,
            grouped by expert; rows past ``sum(m_splits)`` are a capacity
            tail (output and input-gradient rows there are 0).
        m_splits: tokens per expert: an int tensor on the input's CUDA device
            (graph-safe, never read on the host), or a list of ints / a CPU
            int tensor (host path; validated).  See the module docstring.
        weights: G tensors (out_features, in_features), the input's dtype
            (any float dtype under torch.autocast, whose dtype the layer
            then computes in: lpmoe.functional.precision), or one contiguous (G, out_features, in_features) tensor (a
            stacked parameter: its gradient is one (G, N, K) tensor; see
            lpmoe.functional.params).
        biases: None, G tensors (out_features,), or with a stacked weight
            one (G, out_features) tensor.
        recipe: an :mod:`lpmoe.recipe` recipe; None = the active
            :func:`lpmoe.autocast` recipe (or none: input-dtype GEMMs).  To
            force high precision inside an autocast block, nest
            ``lpmoe.autocast(enabled=False)``.
        weight_cache: a :class:`WeightCache` (layers own one) reused for FP8
            block weights across calls (emulated recipes quantize the
            weights on every call).
        is_first_microbatch: FP8 weight caching.  None: quantize the weights
            on every call, no caching (eager calls read a ``weight_cache``
            that lpmoe.optim.AdamW wrote for exactly these weights: the same
            bits).  True: quantize into ``weight_cache``.
            False: reuse ``weight_cache`` (weights unchanged since the last
            True call, e.g. later micro-batches of a step).
        fuse_wgrad_accumulation: add the weight gradients into each
            weight's fp32 ``main_grad`` (Megatron-style) instead of returning
            them: in the wgrad GEMM's epilogue when the main_grads are
            consecutive pieces of one buffer, else through one fp32 product
            and an add per expert.  As in TransformerEngine, autograd then
            gets a placeholder gradient (and ``grad_added_to_main_grad`` is
            set) for weights that have that attribute, None for the others.
        save_original_input: keep the input itself for the backward
            instead of the copy the recipe made of it (TransformerEngine's
            option of the same name): under FP8 block scaling x's
            transposed FP8 copy (rows x in_features bytes) is not held
            between forward and backward but quantized again before the
            weight-gradient GEMM (one more read of x, the same bits).  It
            saves memory where the caller keeps x anyway (an input that
            other layers also save, or the MoE layer's tokens); modifying x
            in place before the backward is then an error (autograd's
            version check), as in TE.  A non-contiguous input (which is
            copied here) keeps the FP8 copy; so do the other recipes and
            backward_override modes (they keep what they keep already).
    Returns (..., out_features) in the input's dtype (the autocast dtype
    under torch.autocast).

    Errors are raised before any GPU work.  Quantized inputs (GroupedTensor,
    FP8 tensors) raise TypeError: pass the high-precision activations.
    """
    inp, m_splits = ready(inp), ready(m_splits)
    caller_inp = inp
    inp, param_dtype = compute_input(inp, weights)  # under torch.autocast: cast to its dtype (precision.py)
    g, n, k = check_params(inp, weights, biases, param_dtype)
    if recipe is None:
        recipe = get_autocast_recipe()
    x2d = inp.reshape(-1, k)
    if is_first_microbatch not in (None, True, False):
        raise TypeError(f"is_first_microbatch must be None, True or False, got {is_first_microbatch!r}")
    if is_first_microbatch is not None and weight_cache is None:
        raise ValueError("is_first_microbatch needs a weight_cache to keep the quantized weights in")
    if weight_cache is not None and not isinstance(weight_cache, WeightCache):
        raise TypeError(f"weight_cache must be an lpmoe.functional.WeightCache, got {type(weight_cache).__name__}")
    for name, v in (("fuse_wgrad_accumulation", fuse_wgrad_accumulation), ("save_original_input", save_original_input)):
        if not isinstance(v, bool):
            raise TypeError(f"{name} must be a bool, got {v!r}")
    grad_enabled = torch.is_grad_enabled()
    need = needs_of(inp, weights, biases, grad_enabled)
    # (else a copy made here, contiguous or cast, would be kept: not the caller's)
    keep = save_original_input and inp.is_contiguous() and inp is caller_inp
    if tracing():
        check_recipe(recipe, inp.dtype, n, k, splits_for_checks(m_splits, g, x2d.shape[0], inp.device), inp.is_cuda,
                     inp.device)
        if fuse_wgrad_accumulation and grad_enabled:
            check_main_grads(weights)
        out = OPS["grouped_linear"](x2d.contiguous(), m_splits, weights, biases, recipe, weight_cache,
                                    is_first_microbatch, fuse_wgrad_accumulation, need, keep)
        return out.view(*inp.shape[:-1], n)
    splits = parse_splits(m_splits, g, x2d.shape[0], inp.device)
    check_recipe(recipe, inp.dtype, n, k, splits, inp.is_cuda, inp.device)
    if fuse_wgrad_accumulation and grad_enabled:
        check_main_grads(weights)
    cfg = LinearConfig(policy_for(recipe), g, biases is not None, weight_cache, is_first_microbatch, grad_enabled,
                       need, fuse_wgrad_accumulation, is_stacked(weights), keep)
    params = as_inputs(weights) + as_inputs(biases)
    out = _GroupedLinear.apply(x2d.contiguous(), splits, cfg, *params)
    return out.view(*inp.shape[:-1], n)
