"""``lpmoe.functional.grouped_mlp``: an expert MLP with a fused activation.

    h = fc1(x)           (rows, W)      W = 2F for GLU activations
    a = act(h) * probs   (rows, F)      the fused activation kernel
    y = fc2(a)           (rows, H)

Under ``Float8BlockScaling`` the activation kernel reads h once and writes
fc2's input directly as the FP8 block operands fc2 reads (rowwise for its
fprop GEMM, transposed for its wgrad GEMM); in the backward it reads fc2's
input gradient and h once and writes fc1's output gradient directly as the
FP8 operands of fc1's dgrad and wgrad GEMMs, plus fc1's bias gradient and
d probs.  The forward keeps only what the backward reads: the transposed FP8
copies of x and of a (the GEMM inputs), the transposed FP8 weights, h (once)
and probs; every rowwise copy dies with its fprop GEMM, and the backward
drops each of these copies and h as soon as its last GEMM or kernel has run
(lpmoe.functional.saved.hold; each layer runs its two GEMMs in the order
that holds less, lpmoe.functional.linear_steps.backward_steps; the
backward's stages are in lpmoe.functional.mlp_backward).  Results are
bit-identical to running the layers unfused (GroupedLinear,
lpmoe.activation.activation, GroupedLinear) under the same recipe.  Other
recipes run the same sequence with a high-precision activation in between
(see lpmoe.policy for what each recipe saves).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Tuple, Union

import torch

from lpmoe._async_inputs import ready
from lpmoe.activation import kernels
from lpmoe.activation.spec import Activation, parse_activation
from lpmoe.autocast import get_autocast_recipe
from lpmoe.functional import mlp_backward, saved
from lpmoe.functional.checks import check_params, check_recipe
from lpmoe.functional.mlp_args import LayerParams, check_fc2, check_layer, check_options, check_probs
from lpmoe.functional.linear import needs_of
from lpmoe.functional.linear_steps import fused_wgrad_results, is_weight_copy, linear_forward, main_grads_of
from lpmoe.functional.params import as_inputs, from_inputs, grads_for, input_count, is_stacked
from lpmoe.functional.precision import autocast_off, compute_input
from lpmoe.functional.gathered_rows import GatheredRows
from lpmoe.functional.splits import Splits, parse_splits, splits_for_checks
from lpmoe.functional.weights import WeightCache, WeightSource, cache_in_use
from lpmoe.grouped_tensor import GroupedTensor, shares_offsets
from lpmoe.library.routing import OPS, tracing
from lpmoe.policy import LinearPolicy, Needs, Tokens, policy_for
from lpmoe.recipe import Recipe

__all__ = ["grouped_mlp", "LayerParams", "CALLS"]

#: calls of the fused MLP autograd function (tests prove which path ran)
CALLS = {"grouped_mlp": 0}


@dataclass
class _Layer:
    policy: LinearPolicy
    num: int
    has_bias: bool
    weight_cache: Optional[WeightCache]
    fuse_wgrad_accumulation: bool
    shape: tuple = field(default=())
    stacked: bool = False
    save_original_input: bool = False


@dataclass
class MLPConfig:
    """Everything static about one call (the op path carries it as JSON)."""
    spec: Activation
    fc1: _Layer
    fc2: _Layer
    has_probs: bool
    is_first_microbatch: Optional[bool]
    grad_enabled: bool
    needs: Tuple[Needs, Needs, bool]  # fc1, fc2, probs

    def weights_cached(self, layer: "_Layer") -> bool:
        """The layer's FP8 weights live in its cache (they outlive the backward)."""
        return cache_in_use(layer.weight_cache, self.is_first_microbatch)


def split_params(params, layer: _Layer):
    """(weights, biases or None, inputs used) of ``layer`` at the front of ``params``."""
    n = input_count(layer.num, layer.stacked)
    biases = from_inputs(params[n:2 * n], layer.stacked) if layer.has_bias else None
    return from_inputs(params[:n], layer.stacked), biases, n * (2 if layer.has_bias else 1)


def mlp_needs(x, probs, fc1, fc2, grad_enabled: bool) -> Tuple[Needs, Needs, bool]:
    """(fc1's, fc2's, d probs?) gradients a call must produce."""
    need1 = needs_of(x, fc1.weights, fc1.biases, grad_enabled)
    need_probs = grad_enabled and probs is not None and probs.requires_grad
    need_act = need1.any or need_probs  # anything upstream of the activation trains
    w2 = needs_of(x, fc2.weights, fc2.biases, grad_enabled)
    return need1, Needs(dgrad=need_act, wgrad=w2.wgrad, dbias=w2.dbias), need_probs


#: names of the saved objects of mlp_forward_impl, in order
SAVED = ("x1", "w1", "probs", "w2", "h", "x2")


@shares_offsets
def mlp_forward_impl(x2d, probs, splits: Splits, params, cfg: MLPConfig, source: Optional[GatheredRows] = None):
    """y and the saved objects (SAVED order).  With ``source`` fc1's input
    is quantized from ``source``'s tokens (x2d) as it is gathered, and with
    its ``sum_to_tokens`` y is each token's sum over its rows."""
    w1, b1, used = split_params(params, cfg.fc1)
    w2, b2, _ = split_params(params[used:], cfg.fc2)
    need1, need2, need_probs = cfg.needs
    need_act = need2.dgrad
    spec = cfg.spec
    ws1 = WeightSource(w1, cfg.fc1.weight_cache, cfg.is_first_microbatch, cfg.grad_enabled, x2d.dtype)
    keep = cfg.fc1.save_original_input
    x1 = Tokens(gathered=source, save_original=keep) if source is not None else Tokens(hp=x2d, save_original=keep)
    h, fw1 = linear_forward(cfg.fc1.policy, x1, ws1, b1, splits, need1)
    del x1
    write_hp, q_act = cfg.fc2.policy.activation_output(need2)
    act = kernels.forward(h, spec, probs, splits.device, write_hp=write_hp or q_act is None, quantizer=q_act)
    ws2 = WeightSource(w2, cfg.fc2.weight_cache, cfg.is_first_microbatch, cfg.grad_enabled, x2d.dtype)
    y, fw2 = linear_forward(cfg.fc2.policy, Tokens(hp=act.hp, quantized=act.quantized), ws2, b2, splits, need2)
    del act
    if source is not None and source.sum_to_tokens:  # the unpermute, inside the function
        y = source.rows_to_tokens(y)
    return y, (fw1.saved_x if need1.wgrad else None, fw1.saved_w if need1.dgrad else None,
               probs if need_act else None, fw2.saved_w if need2.dgrad else None, h if need_act else None,
               fw2.saved_x if need2.wgrad else None)


class _GroupedMLP(torch.autograd.Function):
    """Eager autograd of the fused MLP (torch.compile runs the same
    implementation as the op ``lpmoe::grouped_mlp``, lpmoe.library.layer_ops)."""

    @staticmethod
    def forward(ctx, x2d, probs, splits, cfg: MLPConfig, source: Optional[GatheredRows], *params):
        with autocast_off():
            y, objs = mlp_forward_impl(x2d, probs, splits, params, cfg, source)
        x1, w1s, p, sw2, h, sx2 = objs
        # Parameters and the caller's tensors go through save_for_backward;
        # what this function made (h, the quantized copies) is held, so the
        # backward drops each right after its last reader.  Routed tokens
        # kept for fc1's wgrad (save_original_input: the source itself) are
        # saved as the tokens; the map is ctx.source.
        ctx.x1_from_source = isinstance(x1, GatheredRows)
        x1 = x1.tokens if ctx.x1_from_source else x1
        w1, _, used = split_params(params, cfg.fc1)
        w2, _, _ = split_params(params[used:], cfg.fc2)
        # copies: x's quantized one, and the weights' (linear_steps.is_weight_copy)
        copies = {k: o for k, o in (("x1", x1), ("w1", w1s), ("w2", sw2))
                  if (isinstance(o, GroupedTensor) if k == "x1" else is_weight_copy(o, params[0].dtype))}
        saved.save(ctx, *(None if k in copies else o for k, o in (("x1", x1), ("w1", w1s), ("p", p), ("w2", sw2))))
        saved.hold(ctx, h=h, x2=sx2, **{k: copies.get(k) for k in ("x1", "w1", "w2")})
        ctx.cfg, ctx.splits = cfg, splits
        ctx.main_grads = (w1 if cfg.fc1.fuse_wgrad_accumulation else None,
                          w2 if cfg.fc2.fuse_wgrad_accumulation else None)
        ctx.dtype = params[0].dtype  # the parameters' gradients' (dx comes in x's, the compute dtype)
        ctx.source = source.for_backward() if source is not None else None  # the map, not the tokens
        ctx.sum_to_tokens = source is not None and source.sum_to_tokens
        return y

    @staticmethod
    def backward(ctx, grad_out):
        cfg = ctx.cfg
        x1, w1s, probs, w2s = saved.load(ctx)
        if ctx.x1_from_source and x1 is not None:
            x1 = ctx.source.with_tokens(x1)
        kept = {"x1": x1, "w1": w1s, "probs": probs, "w2": w2s}
        del x1, w1s, probs, w2s

        def take(name):
            held = saved.take(ctx, name) if name != "probs" else None  # raises on a second backward
            return held if held is not None else kept.pop(name, None)

        fused1, fused2 = ctx.main_grads
        ctx.main_grads = (None, None)
        if ctx.sum_to_tokens:  # the rows' gradient is the tokens' gradient through the map
            grad_out = ctx.source.with_tokens(grad_out.contiguous())
        with autocast_off():
            dx, dprobs, w1_grads, b1_grads, w2_grads, b2_grads = mlp_backward.mlp_backward_impl(
                grad_out, take, ctx.splits, cfg, ctx.dtype, tuple(None if w is None else main_grads_of(w)
                                                                  for w in (fused1, fused2)), ctx.source)
        ctx.source = None
        need1, need2, _ = cfg.needs
        if fused1 is not None and need1.wgrad:
            w1_grads = fused_wgrad_results(fused1)
        if fused2 is not None and need2.wgrad:
            w2_grads = fused_wgrad_results(fused2)
        return tuple(mlp_grads_list(cfg, dx, dprobs, w1_grads, b1_grads, w2_grads, b2_grads, extra_none=3))


def mlp_grads_list(cfg: MLPConfig, dx, dprobs, w1_grads, b1_grads, w2_grads, b2_grads, extra_none: int) -> list:
    """Gradients in the order (x, probs, <extra_none Nones>, fc1 weights,
    fc1 biases, fc2 weights, fc2 biases)."""
    l1, l2 = cfg.fc1, cfg.fc2
    grads = [dx, dprobs] + [None] * extra_none + grads_for(w1_grads, l1.num, l1.stacked)
    if l1.has_bias:
        grads += grads_for(b1_grads, l1.num, l1.stacked)
    grads += grads_for(w2_grads, l2.num, l2.stacked)
    if l2.has_bias:
        grads += grads_for(b2_grads, l2.num, l2.stacked)
    return grads


def grouped_mlp(inp: Union[torch.Tensor, GatheredRows], m_splits, fc1: LayerParams, fc2: LayerParams, *,
                activation: Union[str, Activation] = "swiglu", probs: Optional[torch.Tensor] = None,
                recipe: Optional[Recipe] = None, is_first_microbatch: Optional[bool] = None) -> torch.Tensor:
    """Expert MLP ``fc2(act(fc1(x)) * probs)`` with the activation fused (see
    the module docstring).

    Args:
        inp: (tokens, hidden) or (..., hidden) grouped by expert, as for
            :func:`lpmoe.functional.grouped_linear` (rows past sum(m_splits)
            are a capacity tail: output and input-gradient rows there are 0).
            Or a GatheredRows (lpmoe.moe.RoutedTokens: tokens plus their
            routing map) standing for those rows: under FP8 block scaling
            fc1's input is then quantized as it is gathered from the tokens
            (the rows are never made), else the rows are made first; the
            gradient goes to the tokens and the output is the rows'
            (num_rows, hidden), or with its ``sum_to_tokens`` each token's
            sum over its rows (T, hidden), fc2's output gradient then also
            quantized from the tokens' gradient through the map.
        m_splits: tokens per expert (CUDA int tensor: graph-safe; list / CPU
            tensor: host path).  None with a GatheredRows (its counts).
        fc1: G weights (W, hidden) with W = 2*ffn for GLU activations (gate
            rows first), biases optional.  fc2: G weights (hidden, ffn).
        activation: "swiglu" (default), "geglu", "gelu", "relu",
            "clamped_swiglu", or an :class:`lpmoe.activation.Activation`.
        probs: optional per-token scales (router probabilities) multiplied
            into the activation output; their gradient is returned.
        recipe: as for grouped_linear (None: the active lpmoe.autocast recipe).
        is_first_microbatch: FP8 weight caching of both layers (needs their
            weight caches; see grouped_linear).
    Returns (..., hidden) in the input's dtype ((num_rows, hidden) for a
    GatheredRows).  Errors are raised before any GPU work.
    """
    source = None
    # a GatheredRows: the output is the rows' (num_rows, hidden), or with
    # sum_to_tokens the tokens' (T, hidden)
    routed = inp if isinstance(inp, GatheredRows) else None
    if routed is not None:
        source, inp = inp, inp.tokens
        if m_splits is not None:
            raise ValueError("with routed tokens (a GatheredRows) m_splits must be None: the rows per expert are "
                             "the routing map's")
        m_splits = source.m_splits
    inp, m_splits, probs = ready(inp), ready(m_splits), ready(probs)
    fc1, fc2 = check_layer(fc1, "fc1"), check_layer(fc2, "fc2")
    caller_inp = inp
    inp, param_dtype = compute_input(inp, fc1.weights)  # under torch.autocast: cast to its dtype (precision.py)
    cast = inp is not caller_inp  # a copy of the caller's tokens: never the "original" fc1 may keep
    if routed is not None and cast:
        routed = source = routed.on_tokens(inp)
    spec = parse_activation(activation)
    g, w, hidden = check_params(inp, fc1.weights, fc1.biases, param_dtype)
    if spec.is_glu and w % 2:
        raise ValueError(f"{spec.kind} needs fc1's out_features to be even (gate and value halves), got {w}")
    ffn = w // 2 if spec.is_glu else w
    check_fc2(inp, fc2, g, hidden, ffn, param_dtype)
    if recipe is None:
        recipe = get_autocast_recipe()
    x2d = inp.reshape(-1, hidden)
    rows = source.num_rows if source is not None else x2d.shape[0]
    p = check_probs(probs, inp, (rows,) if source is not None else tuple(inp.shape[:-1]))
    splits = (splits_for_checks if tracing() else parse_splits)(m_splits, g, rows, inp.device)
    check_recipe(recipe, inp.dtype, w, hidden, splits, inp.is_cuda, inp.device)
    check_recipe(recipe, inp.dtype, hidden, ffn, splits, inp.is_cuda, inp.device)
    if inp.is_cuda and inp.dtype != torch.float32 and ffn % 16:
        raise ValueError(f"the activation kernels need ffn to be a multiple of 16, got {ffn}")
    check_options(fc1, fc2, is_first_microbatch)
    grad_enabled = torch.is_grad_enabled()
    needs = mlp_needs(inp, p, fc1, fc2, grad_enabled)
    policy, traced = policy_for(recipe), tracing()
    if source is not None and not source.gathered_by(policy, needs[0], traced):
        x2d, source = source.rows(), None  # this recipe reads the rows themselves
    # fc1 keeps its input itself only where the caller holds it anyway: a
    # contiguous tensor input, or routed tokens read as they are gathered
    # (rows made here for a recipe that does not gather, or a copy of a
    # non-contiguous input, would cost more than the FP8 copy they replace)
    if routed is not None:
        keep1 = source is not None and (fc1.save_original_input or routed.save_original) and not cast
    else:
        keep1 = fc1.save_original_input and inp.is_contiguous() and not cast
    if traced:  # (the op counts its own runs: lpmoe.library.layer_ops.CALLS)
        out = OPS["grouped_mlp"](x2d.contiguous(), p, m_splits, fc1, fc2, spec, recipe, is_first_microbatch, needs,
                                 source, keep1)
        return _result(out, routed, source is not None, inp, hidden)
    l1 = _Layer(policy, g, fc1.biases is not None, fc1.weight_cache, fc1.fuse_wgrad_accumulation,
                (g, w, hidden), is_stacked(fc1.weights), keep1)
    l2 = _Layer(policy, g, fc2.biases is not None, fc2.weight_cache, fc2.fuse_wgrad_accumulation,
                (g, hidden, ffn), is_stacked(fc2.weights))
    cfg = MLPConfig(spec, l1, l2, p is not None, is_first_microbatch, grad_enabled, needs)
    CALLS["grouped_mlp"] += 1
    params: List[torch.Tensor] = (as_inputs(fc1.weights) + as_inputs(fc1.biases) + as_inputs(fc2.weights)
                                  + as_inputs(fc2.biases))
    out = _GroupedMLP.apply(x2d.contiguous(), p, splits, cfg, source, *params)
    return _result(out, routed, source is not None, inp, hidden)


def _result(out: torch.Tensor, routed: Optional[GatheredRows], fused: bool, inp: torch.Tensor, hidden: int):
    """grouped_mlp's return value from the MLP's output ``out``: rows, or
    with routed tokens and sum_to_tokens the tokens' sums (the fused
    function returns those itself; the rows path sums them here)."""
    if routed is None:
        return out.view(*inp.shape[:-1], hidden)
    return routed.sum_rows(out) if routed.sum_to_tokens and not fused else out
