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
(lpmoe.functional.saved.hold; each layer runs wgrad before dgrad, see
lpmoe.functional.linear_steps.backward_steps).  Results are
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
from lpmoe.functional import saved
from lpmoe.functional.checks import check_params, check_recipe
from lpmoe.functional.mlp_args import LayerParams, check_fc2, check_layer, check_options, check_probs
from lpmoe.functional.linear import needs_of
from lpmoe.functional.linear_steps import (backward_steps, bias_step, dgrad_step, fused_wgrad_results, linear_forward,
                                           main_grads_of, wgrad_step)
from lpmoe.functional.params import as_inputs, from_inputs, grads_for, input_count, is_stacked
from lpmoe.functional.gathered_rows import GatheredRows
from lpmoe.functional.splits import Splits, parse_splits, splits_for_checks
from lpmoe.functional.weights import WeightCache, WeightSource, cache_in_use
from lpmoe.grouped_tensor import GroupedTensor, shares_offsets
from lpmoe.library.routing import OPS, tracing
from lpmoe.policy import Grad, LinearPolicy, Needs, Tokens, policy_for
from lpmoe.policy.fp8_block import grad_views
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
    ws1 = WeightSource(w1, cfg.fc1.weight_cache, cfg.is_first_microbatch, cfg.grad_enabled)
    keep = cfg.fc1.save_original_input
    x1 = Tokens(gathered=source, save_original=keep) if source is not None else Tokens(hp=x2d, save_original=keep)
    h, fw1 = linear_forward(cfg.fc1.policy, x1, ws1, b1, splits, need1)
    del x1
    write_hp, q_act = cfg.fc2.policy.activation_output(need2)
    act = kernels.forward(h, spec, probs, splits.device, write_hp=write_hp or q_act is None, quantizer=q_act)
    ws2 = WeightSource(w2, cfg.fc2.weight_cache, cfg.is_first_microbatch, cfg.grad_enabled)
    y, fw2 = linear_forward(cfg.fc2.policy, Tokens(hp=act.hp, quantized=act.quantized), ws2, b2, splits, need2)
    del act
    if source is not None and source.sum_to_tokens:  # the unpermute, inside the function
        y = source.rows_to_tokens(y)
    return y, (fw1.saved_x if need1.wgrad else None, fw1.saved_w if need1.dgrad else None,
               probs if need_act else None, fw2.saved_w if need2.dgrad else None, h if need_act else None,
               fw2.saved_x if need2.wgrad else None)


@dataclass
class Dh:
    """fc1's output gradient as the activation backward wrote it: the FP8
    operands of fc1's GEMMs (both directions, with fc1's fused bias
    gradient) or the high-precision dh its policy prepares.  The compiled
    backward hands it from the activation op to fc1's ops."""
    quantized: Optional[GroupedTensor] = None
    hp: Optional[torch.Tensor] = None
    dbias: Optional[torch.Tensor] = None

    def grad(self, policy: LinearPolicy, splits: Splits, need: Needs) -> Grad:
        if self.quantized is not None:
            return grad_views(self.quantized, need, self.dbias)
        if need.dgrad or need.wgrad:
            return policy.grad(self.hp, splits, need)
        return Grad(hp=self.hp, dbias=self.dbias)  # (a bias gradient alone: the activation backward fused it)


#: the saved objects the activation stage reads (the compiled backward of
#: a large layer runs each GEMM and the activation as separate ops, so each
#: one's inputs die when it returns; fc2's wgrad reads "x2", its dgrad
#: "w2", fc1's "x1" and "w1"; lpmoe.library.mlp_backward_ops)
STAGE_ACT = ("probs", "h")


def mlp_backward_fc2(grad_out, take, splits: Splits, cfg: MLPConfig, dtype, main_grads=None):
    """fc2's backward: (da or None, fc2's weight grads, fc2's bias grads).
    ``take(name)`` hands the saved objects over one at a time (each can be
    dropped after its last reader)."""
    need2 = cfg.needs[1]
    pol2 = cfg.fc2.policy
    if isinstance(grad_out, GatheredRows):  # fc2's output gradient as rows of the tokens' gradient
        if not pol2.takes_gathered_grad(need2) or not grad_out.can_quantize(pol2.grad_quantizer(need2)):
            grad_out = grad_out.rows()  # this policy reads the rows themselves
    grad2 = pol2.grad(grad_out if isinstance(grad_out, GatheredRows) else grad_out.contiguous(), splits, need2)
    del grad_out
    return backward_steps(pol2, grad2, take("x2"), take("w2"), splits, need2, cfg.fc2.shape,
                          weights_cached=cfg.weights_cached(cfg.fc2), dtype=dtype, main_grads=main_grads)


def mlp_backward_fc2_part(grad_out, saved, splits: Splits, cfg: MLPConfig, dtype, part: str, with_dbias: bool,
                          main_grads=None):
    """One of fc2's GEMMs alone: ``part`` "wgrad" -> (weight grads, bias
    grads), "dgrad" -> (da, bias grads); ``saved`` is the operand that GEMM
    reads (x2 or w2).  The bias gradient comes with ``with_dbias``, fused
    into this GEMM's dy pass as eager fuses it into its first pass (the bits
    do not depend on the pass's direction; lpmoe.library.mlp_backward_ops
    says which op takes it)."""
    need2 = cfg.needs[1]
    pol2 = cfg.fc2.policy
    need = Needs(dgrad=part == "dgrad" and need2.dgrad, wgrad=part == "wgrad" and need2.wgrad,
                 dbias=with_dbias and need2.dbias)
    if isinstance(grad_out, GatheredRows):
        if not pol2.takes_gathered_grad(need) or not grad_out.can_quantize(pol2.grad_quantizer(need)):
            grad_out = grad_out.rows()
    grad2 = pol2.grad(grad_out if isinstance(grad_out, GatheredRows) else grad_out.contiguous(), splits, need)
    del grad_out
    if part == "dgrad":
        out = dgrad_step(pol2, grad2, saved, splits, cfg.fc2.shape) if need.dgrad else None
    else:
        tokens = pol2.wgrad_tokens(saved, splits) if need.wgrad else None
        del saved
        out = wgrad_step(grad2, tokens, splits, need, dtype=dtype, main_grads=main_grads)
    return out, bias_step(grad2, splits, need, dtype)


def mlp_backward_activation(da: Optional[torch.Tensor], take, splits: Splits, cfg: MLPConfig):
    """The activation backward from fc2's input gradient: (Dh or None,
    dprobs).  Call it with the only reference to ``da``: one pass over (da,
    h) writes fc1's output gradient in the form fc1's GEMMs read (with
    fc1's bias gradient when fused) and d probs, then both inputs die."""
    need1, need2, need_probs = cfg.needs
    probs, h = take("probs"), take("h")
    if not need2.dgrad:
        return None, None
    q1 = cfg.fc1.policy.grad_quantizer(need1)
    res = kernels.backward(da, h, cfg.spec, probs, splits.device, dh_hp=need1.any and q1 is None,
                           dh_quantizer=q1, dbias=need1.dbias and q1 is not None, dprobs=need_probs)
    del da, h
    dh = None
    if need1.any:
        dh = Dh(res.dh_quantized, None, res.dbias) if q1 is not None else Dh(None, res.dh, None)
    return dh, res.dprobs


def mlp_backward_fc1(dh: Optional[Dh], take, splits: Splits, cfg: MLPConfig, dtype, main_grads=None, dx_to=None):
    """fc1's backward from the activation stage's Dh: (dx, weight grads, bias grads)
    (``dx_to``: see backward_steps).  Call it with the only reference to
    ``dh`` (no decorator frame either: each FP8 copy of dh must die with the
    GEMM that reads it)."""
    need1 = cfg.needs[0]
    if dh is None:
        return None, None, None
    grad1 = dh.grad(cfg.fc1.policy, splits, need1)
    del dh
    return backward_steps(cfg.fc1.policy, grad1, take("x1"), take("w1"), splits, need1, cfg.fc1.shape,
                          dtype=dtype, main_grads=main_grads, dx_to=dx_to, weights_cached=cfg.weights_cached(cfg.fc1))


def mlp_backward_fc1_wgrad(dh: Dh, x1, splits: Splits, cfg: MLPConfig, dtype, main_grads=None):
    """fc1's weight and bias gradients alone (the compiled backward's third
    stage runs the dgrad): the same steps as :func:`mlp_backward_fc1`."""
    need1 = cfg.needs[0]
    need = Needs(dgrad=False, wgrad=need1.wgrad, dbias=need1.dbias)
    grad1 = dh.grad(cfg.fc1.policy, splits, need)
    del dh
    tokens = cfg.fc1.policy.wgrad_tokens(x1, splits) if need.wgrad else None
    del x1
    w_grads = wgrad_step(grad1, tokens, splits, need, dtype=dtype, main_grads=main_grads)
    return w_grads, bias_step(grad1, splits, need, dtype)


def mlp_backward_fc1_dgrad(dh: Dh, w1, splits: Splits, cfg: MLPConfig) -> torch.Tensor:
    """fc1's input gradient alone (see :func:`mlp_backward_fc1_wgrad`)."""
    grad1 = dh.grad(cfg.fc1.policy, splits, Needs(dgrad=True, wgrad=False, dbias=False))
    del dh
    return dgrad_step(cfg.fc1.policy, grad1, w1, splits, cfg.fc1.shape)


@shares_offsets
def mlp_backward_impl(grad_out, take, splits: Splits, cfg: MLPConfig, dtype, main_grads=(None, None), source=None):
    """Gradients (dx, dprobs, w1, b1, w2, b2 lists or None): both stages;
    with ``source`` (routed tokens' backward view) dx is the tokens'."""
    fc2 = list(mlp_backward_fc2(grad_out, take, splits, cfg, dtype, main_grads[1]))
    w2_grads, b2_grads = fc2[1:]
    # pop: the next stage holds the only reference, so da dies with the
    # activation backward and each FP8 copy of dh with the GEMM that reads it
    act = list(mlp_backward_activation(fc2.pop(0), take, splits, cfg))
    dprobs = act[1]
    dx, w1_grads, b1_grads = mlp_backward_fc1(act.pop(0), take, splits, cfg, dtype, main_grads[0],
                                              source.rows_to_tokens if source is not None else None)
    return dx, dprobs, w1_grads, b1_grads, w2_grads, b2_grads


class _GroupedMLP(torch.autograd.Function):
    """Eager autograd of the fused MLP (torch.compile runs the same
    implementation as the op ``lpmoe::grouped_mlp``, lpmoe.library.layer_ops)."""

    @staticmethod
    def forward(ctx, x2d, probs, splits, cfg: MLPConfig, source: Optional[GatheredRows], *params):
        y, objs = mlp_forward_impl(x2d, probs, splits, params, cfg, source)
        x1, w1s, p, sw2, h, sx2 = objs
        # Parameters and the caller's tensors go through save_for_backward;
        # what this function made (h, the quantized copies) is held, so the
        # backward drops each right after its last reader.  Routed tokens
        # kept for fc1's wgrad (save_original_input: the source itself) are
        # saved as the tokens; the map is ctx.source.
        ctx.x1_from_source = isinstance(x1, GatheredRows)
        x1 = x1.tokens if ctx.x1_from_source else x1
        copies = {k: o for k, o in (("x1", x1), ("w1", w1s), ("w2", sw2)) if isinstance(o, GroupedTensor)}
        saved.save(ctx, *(None if k in copies else o for k, o in (("x1", x1), ("w1", w1s), ("p", p), ("w2", sw2))))
        saved.hold(ctx, h=h, x2=sx2, **{k: copies.get(k) for k in ("x1", "w1", "w2")})
        ctx.cfg, ctx.splits = cfg, splits
        w1, _, used = split_params(params, cfg.fc1)
        w2, _, _ = split_params(params[used:], cfg.fc2)
        ctx.main_grads = (w1 if cfg.fc1.fuse_wgrad_accumulation else None,
                          w2 if cfg.fc2.fuse_wgrad_accumulation else None)
        ctx.dtype = x2d.dtype
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
        dx, dprobs, w1_grads, b1_grads, w2_grads, b2_grads = mlp_backward_impl(
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
    spec = parse_activation(activation)
    g, w, hidden = check_params(inp, fc1.weights, fc1.biases)
    if spec.is_glu and w % 2:
        raise ValueError(f"{spec.kind} needs fc1's out_features to be even (gate and value halves), got {w}")
    ffn = w // 2 if spec.is_glu else w
    check_fc2(inp, fc2, g, hidden, ffn)
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
        keep1 = source is not None and (fc1.save_original_input or routed.save_original)
    else:
        keep1 = fc1.save_original_input and inp.is_contiguous()
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
