"""``lpmoe::grouped_linear`` / ``lpmoe::grouped_linear_backward``: the
grouped linear layer as custom ops with autograd (lpmoe.library.layer_ops
says how the layer ops work)."""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from lpmoe.functional import linear as lin
from lpmoe.functional.checks import check_recipe
from lpmoe.functional.precision import autocast_off, params_dtype
from lpmoe.functional.params import as_inputs, from_inputs, grads_for, is_stacked, shape_of
from lpmoe.library import fused_main_grads as fused_mg
from lpmoe.library import saved_layout, specs
from lpmoe.library.cached_weights import mark_cached
from lpmoe.library.grouped_codec import symbolic_sizes
from lpmoe.library.layer_common import (CALLS, cache_key, cached_slots, fused_weights, needs_of_list, op_cache,
                                         op_splits, setup_context_of, signature)
from lpmoe.library.routing import OPS, tracing
from lpmoe.policy import Needs, policy_for

Tensor = torch.Tensor


def _linear_config(c: dict, fake: bool, weights=None) -> lin.LinearConfig:
    cache = op_cache(c["cache"], c["first"], fake, weights)
    first = None if cache is None else c["first"]
    return lin.LinearConfig(policy_for(specs.decode(c["recipe"])), c["num"], c["bias"], cache, first, c["grad"],
                            needs_of_list(c["need"]), False, c["stacked"], c["keep"])


def _linear_inputs(x, m_splits, weights, biases) -> Dict[str, Tensor]:
    d = {"x": x, "s": m_splits}
    d.update({f"w{i}": w for i, w in enumerate(weights)})
    d.update({f"b{i}": b for i, b in enumerate(biases or [])})
    return d


def _linear_forward(x, m_splits, host, weights, biases, config, fake):
    """``weights`` / ``biases``: the op's tensor lists (one entry each for
    stacked parameters)."""
    c = specs.parse(config)
    cfg = _linear_config(c, fake, weights)
    splits = op_splits(m_splits, host, c["num"], x.shape[0], x.device, fake)
    if not fake:
        CALLS["grouped_linear"] += 1
        _, n, k = c["shape"]
        check_recipe(specs.decode(c["recipe"]), x.dtype, n, k, splits, x.is_cuda, x.device)
    with autocast_off():
        out, objs = lin.linear_forward_impl(x, splits, from_inputs(weights, cfg.stacked),
                                            from_inputs(biases, cfg.stacked) if biases else None, cfg)
    objs = mark_cached(objs, cached_slots(c, ((1, c["cache"]),)), cfg.policy, fake)
    key = config + "|" + signature(x, m_splits, weights)
    return out, saved_layout.flatten(key, objs, _linear_inputs(x, m_splits, weights, biases), fake, x.shape[0])


@torch.library.custom_op("lpmoe::grouped_linear", mutates_args=())
def _grouped_linear(x: Tensor, m_splits: Optional[Tensor], host_splits: Optional[List[int]], weights: List[Tensor],
                    biases: List[Tensor], config: str) -> Tuple[Tensor, List[Tensor]]:
    return _linear_forward(x, m_splits, host_splits, weights, biases or None, config, fake=False)


@_grouped_linear.register_fake
def _(x, m_splits, host_splits, weights, biases, config):
    with symbolic_sizes():
        return _linear_forward(x, m_splits, host_splits, weights, biases or None, config, fake=True)


def _linear_backward_run(grad, saved, m_splits, host, fused, config, key, num_inputs, fake):
    c = specs.parse(config)
    g, n, k = c["shape"]
    need = needs_of_list(c["need"])
    wgrad_out = need.wgrad and c["fuse"] is None  # fused: added into main_grad instead
    # dx in the compute dtype, parameter gradients in the parameters' (torch.autocast: precision.py)
    dtype, pdtype = specs.dtype_from_name(c["dtype"]), specs.dtype_from_name(c["pdtype"])
    if fake:
        out = [torch.empty((grad.shape[0], k), dtype=dtype, device=grad.device)] if need.dgrad else []
        out += [torch.empty((g, n, k), dtype=pdtype, device=grad.device)] if wgrad_out else []
        return out + ([torch.empty((g, n), dtype=pdtype, device=grad.device)] if need.dbias else [])
    CALLS["grouped_linear_backward"] += 1
    main_grads = fused_mg.main_grads(fused, c["fuse"], c["stacked"])
    sx, sw = saved_layout.rebuild(key, saved, num_inputs, grad.shape[0])
    splits = op_splits(m_splits, host, g, grad.shape[0], grad.device, False)
    with autocast_off():
        dx, w_grads, b_grads = lin.linear_backward_impl(grad, sx, sw, splits, _linear_config(c, False), (g, n, k),
                                                        pdtype, main_grads)
    return ([dx] if need.dgrad else []) + ([w_grads] if wgrad_out else []) + ([b_grads] if need.dbias else [])


@torch.library.custom_op("lpmoe::grouped_linear_backward", mutates_args=())
def _grouped_linear_backward(grad: Tensor, saved: List[Tensor], m_splits: Optional[Tensor],
                             host_splits: Optional[List[int]], fused: List[Tensor], config: str, key: str,
                             num_inputs: int) -> List[Tensor]:
    return _linear_backward_run(grad, saved, m_splits, host_splits, fused, config, key, num_inputs, False)


@_grouped_linear_backward.register_fake
def _(grad, saved, m_splits, host_splits, fused, config, key, num_inputs):
    return _linear_backward_run(grad, saved, m_splits, host_splits, fused, config, key, num_inputs, True)


def _linear_setup(ctx, inputs, output):
    x, m_splits, host, weights, biases, config = inputs
    biases = biases or None
    key = config + "|" + signature(x, m_splits, weights)
    tensors, k = saved_layout.inputs_to_save(key, _linear_inputs(x, m_splits, weights, biases))
    fused = fused_weights(weights, specs.parse(config))
    ctx.save_for_backward(m_splits, *fused, *tensors, *output[1])
    ctx.meta = (host, config, key, k, biases is not None, len(fused))


def _linear_backward(ctx, grad_out, _grad_saved):
    host, config, key, k, has_bias, num_fused = ctx.meta
    m_splits, *saved = ctx.saved_tensors
    fused, saved = saved[:num_fused], saved[num_fused:]
    args = (grad_out.contiguous(), saved, m_splits, host, fused, config, key, k)
    res = _grouped_linear_backward(*args) if tracing() else _linear_backward_run(*args, False)
    c = specs.parse(config)
    need, g, stacked = needs_of_list(c["need"]), c["num"], c["stacked"]
    dx = res.pop(0) if need.dgrad else None
    # list inputs get a list back (autograd checks the structure): Nones where not needed
    if c["fuse"] is not None:
        dw = fused_mg.placeholders(c["fuse"], c["shape"], stacked, grad_out.device)
    else:
        dw = grads_for(res.pop(0) if need.wgrad else None, g, stacked)
    db = grads_for(res.pop(0) if need.dbias else None, g, stacked) if has_bias else []
    return dx, None, None, dw, db, None


_grouped_linear.register_autograd(_linear_backward, setup_context=_linear_setup)
fused_mg.register_side_effects(_grouped_linear_backward)


def linear_op_args(x2d, m_splits, weights, biases, recipe, weight_cache, is_first_microbatch, need: Needs,
                   fuse_wgrad_accumulation: bool = False, keep: bool = False) -> tuple:
    """Arguments of ``lpmoe::grouped_linear`` for one call (``keep``: the
    layer keeps x for its weight gradient, save_original_input)."""
    tensor = isinstance(m_splits, torch.Tensor)
    g, n, k = shape_of(weights)
    config = specs.json_constant({
        "format": saved_layout.FORMAT, "recipe": specs.encode(recipe), "num": g, "bias": biases is not None,
        "stacked": is_stacked(weights), "cache": cache_key(weight_cache, is_first_microbatch),
        "first": is_first_microbatch, "grad": torch.is_grad_enabled(), "need": [need.dgrad, need.wgrad, need.dbias],
        "shape": [g, n, k], "dtype": specs.dtype_name(x2d.dtype), "pdtype": specs.dtype_name(params_dtype(weights)),
        "fuse": fused_mg.config_entry(weights, fuse_wgrad_accumulation, need.wgrad), "keep": bool(keep)})
    return (x2d, m_splits if tensor else None, None if tensor else [int(v) for v in m_splits], as_inputs(weights),
            as_inputs(biases), config)


def grouped_linear(x2d, m_splits, weights, biases, recipe, weight_cache, is_first_microbatch,
                   fuse_wgrad_accumulation: bool, need: Needs, keep: bool = False) -> Tensor:
    """lpmoe.functional.grouped_linear while tracing (arguments validated)."""
    out, _ = _grouped_linear(*linear_op_args(x2d, m_splits, weights, biases, recipe, weight_cache,
                                             is_first_microbatch, need, fuse_wgrad_accumulation, keep))
    return out


OPS["grouped_linear"] = grouped_linear


def linear_backward_args(fwd_args: tuple, fwd_out, grad: Tensor) -> tuple:
    """Arguments of ``lpmoe::grouped_linear_backward`` after a forward with
    ``fwd_args`` returned ``fwd_out``, as the autograd formula passes them
    (tests, opcheck)."""
    ctx = setup_context_of(_linear_setup, fwd_args, fwd_out)
    host, config, key, k, _, n = ctx.meta
    return (grad, list(ctx.saved_tensors[1 + n:]), ctx.saved_tensors[0], host, list(ctx.saved_tensors[1:1 + n]),
            config, key, k)
