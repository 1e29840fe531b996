"""``lpmoe::grouped_mlp``: the fused expert MLP as a custom op with
autograd (lpmoe.library.layer_ops says how the layer ops work); its
backward ops live in lpmoe.library.mlp_backward_ops, and routed tokens
(lpmoe.moe.RoutedTokens) cross the op boundary as lpmoe.library.mlp_route
describes.

The backward of a large layer runs as up to five ops, each GEMM and the
activation backward in its own: fc2's wgrad and dgrad (in eager's order,
linear_steps.backward_steps), the activation backward, fc1's weight (and
bias) gradients and its input gradient, each given only the saved tensors
it reads (saved_layout.stage_slots).  A compiled graph holds an op's inputs
until the op returns, so with one op per GEMM every saved copy dies after
its last reader, as in eager.  A small layer runs it as one op (the extra
op calls cost host time that would dominate a launch-bound step)."""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from lpmoe.activation.spec import Activation
from lpmoe.functional import mlp
from lpmoe.functional.checks import check_recipe
from lpmoe.functional.params import as_inputs, grads_for, is_stacked, shape_of
from lpmoe.functional.precision import autocast_off, params_dtype
from lpmoe.library import fused_main_grads as fused_mg
from lpmoe.library import mlp_route, saved_layout, specs
from lpmoe.library.cached_weights import mark_cached
from lpmoe.library.grouped_codec import symbolic_sizes
from lpmoe.library.layer_common import (CALLS, cache_key, cached_slots, fused_weights, needs_of_list, op_splits,
                                         setup_context_of, signature)
from lpmoe.library.mlp_backward_ops import (SAVED_FOR, SAVED_FOR_FC2, STAGE_ACT, act_run, dgrad_first_of, fc1_dh,
                                            fc1_run, fc2_outputs, fc2_parts, fc2_run, grouped_mlp_backward,
                                            grouped_mlp_backward_act, grouped_mlp_backward_fc1)
from lpmoe.library.mlp_config import SAVED, fc1_parts, mlp_config
from lpmoe.library.routing import OPS, tracing

Tensor = torch.Tensor


def _mlp_inputs(x, probs, m_splits, w1, b1, w2, b2, row_map=None, used_rows=None) -> Dict[str, Tensor]:
    d = {"x": x, "p": probs, "s": m_splits, "r": row_map, "u": used_rows}
    for name, ts in (("w1_", w1), ("b1_", b1 or []), ("w2_", w2), ("b2_", b2 or [])):
        d.update({f"{name}{i}": t for i, t in enumerate(ts)})
    return d


def _mlp_forward(x, probs, m_splits, host, w1, b1, w2, b2, config, row_map, used_rows, rows, fake):
    c = specs.parse(config)
    cfg = mlp_config(c, fake, w1, w2)
    route = c["routed"]
    rows = rows if route else x.shape[0]  # grouped rows (x: the tokens when routed)
    splits = op_splits(m_splits, host, c["num"], rows, x.device, fake)
    if not fake:
        CALLS["grouped_mlp"] += 1
        recipe = specs.decode(c["recipe"])
        for n, k in (c["fc1"]["shape"][1:], c["fc2"]["shape"][1:]):
            check_recipe(recipe, x.dtype, n, k, splits, x.is_cuda, x.device)
    params = list(w1) + list(b1 or []) + list(w2) + list(b2 or [])
    source = mlp_route.forward_source(x, row_map, used_rows, rows, m_splits, route) if route else None
    with autocast_off():
        y, objs = mlp.mlp_forward_impl(x, probs, splits, params, cfg, source)
    objs = mlp_route.forward_saved(objs, source, x)
    objs = mark_cached(objs, cached_slots(c, ((SAVED.index("w1"), c["fc1"]["cache"]),
                                              (SAVED.index("w2"), c["fc2"]["cache"]))), cfg.fc1.policy, fake)
    del source
    key = config + "|" + signature(x, m_splits, w1 + w2)
    inputs = _mlp_inputs(x, probs, m_splits, w1, b1, w2, b2, row_map, used_rows)
    return y, saved_layout.flatten(key, objs, inputs, fake, rows)


@torch.library.custom_op("lpmoe::grouped_mlp", mutates_args=())
def _grouped_mlp(x: Tensor, probs: Optional[Tensor], m_splits: Optional[Tensor], host_splits: Optional[List[int]],
                 w1: List[Tensor], b1: List[Tensor], w2: List[Tensor], b2: List[Tensor],
                 config: str, row_map: Optional[Tensor], used_rows: Optional[Tensor],
                 rows: int) -> Tuple[Tensor, List[Tensor]]:
    return _mlp_forward(x, probs, m_splits, host_splits, w1, b1 or None, w2, b2 or None, config, row_map, used_rows,
                        rows, fake=False)


@_grouped_mlp.register_fake
def _(x, probs, m_splits, host_splits, w1, b1, w2, b2, config, row_map, used_rows, rows):
    with symbolic_sizes():
        return _mlp_forward(x, probs, m_splits, host_splits, w1, b1 or None, w2, b2 or None, config, row_map,
                            used_rows, rows, fake=True)


def _mlp_setup(ctx, inputs, output):
    x, probs, m_splits, host, w1, b1, w2, b2, config, row_map, used_rows, rows = inputs
    b1, b2 = b1 or None, b2 or None
    key = config + "|" + signature(x, m_splits, w1 + w2)
    tensors, k = saved_layout.inputs_to_save(key, _mlp_inputs(x, probs, m_splits, w1, b1, w2, b2, row_map, used_rows))
    c = specs.parse(config)
    fused1, fused2 = fused_weights(w1, c["fc1"]), fused_weights(w2, c["fc2"])
    ctx.save_for_backward(m_splits, *fused1, *fused2, *tensors, *output[1])
    ctx.meta = (host, config, key, k, b1 is not None, b2 is not None, (len(fused1), len(fused2)),
                rows if c["routed"] else x.shape[0])


def mlp_backward_stages(grad, saved, m_splits, host, fused1, fused2, config: str, key: str, rows) -> list:
    """The backward ops in order (or their implementations, when not
    tracing): [dx] [dprobs] [w1 grads] [b1 grads] [w2 grads] [b2 grads], each
    present when the configuration asks for it.  ``rows``: the grouped rows."""
    c = specs.parse(config)
    need1 = needs_of_list(c["needs"][0])
    op = tracing()
    args = (grad, saved, m_splits, host, fused1, fused2, config, key, rows)
    del saved, grad
    if not split_backward(config, rows):
        args = _whole_args(*args)
        return grouped_mlp_backward(*args) if op else fc2_run(*args, False)
    fc2, act_args, parts = _split_args(*args)
    del args
    w2g, b2g, da = [], [], []
    for part in fc2_parts(c, key, rows):
        part_args = fc2.pop(part)  # (a direct call then drops this GEMM's operands when it returns)
        res = grouped_mlp_backward(*part_args) if op else fc2_run(*part_args, False)
        del part_args
        has_w, has_b, has_da = fc2_outputs(c, part)
        b2g += [res.pop()] if has_b else []
        da += [res.pop()] if has_da else []
        w2g += [res.pop()] if has_w else []
        del res
    del fc2
    act_out = []
    if da:  # fc2's input gradient: the activation backward runs
        act_args = (da.pop(),) + act_args
        act_out = grouped_mlp_backward_act(*act_args) if op else act_run(*act_args, False)
    del da, act_args
    n_probs = int(c["needs"][2])
    dprobs, dh_flat = act_out[:n_probs], act_out[n_probs:]
    del act_out
    out = {}
    if need1.any and dh_flat:
        for part in _fc1_order(config, key, rows, parts):
            dh = fc1_dh(dh_flat, key, part)
            out[part] = grouped_mlp_backward_fc1(dh, *parts[part]) if op else fc1_run(dh, *parts[part], False)
            del dh
    del dh_flat, parts
    return out.get("dgrad", []) + dprobs + out.get("wgrad", []) + w2g + b2g


def _fc1_order(config: str, key: str, rows, parts) -> list:
    """fc1's backward ops in the order eager runs its GEMMs
    (lpmoe.functional.linear_steps.dgrad_first).  Backends that keep the
    program order follow it; Inductor orders independent ops by its own
    peak-memory pass (it chose the same order on the shapes tried)."""
    first = dgrad_first_of(specs.parse(config), key, rows, "fc1")
    return sorted(parts, key=lambda p: p != ("dgrad" if first else "wgrad"))


#: h's bytes from which the MLP backward runs in stages: below, the
#: memory an op boundary would free is small and the extra op calls'
#: host time (0.24-0.33 ms each, tools/probe_compiled_mlp.py host, H200 machine)
#: would dominate a launch-bound step
SPLIT_BACKWARD_BYTES = 64 << 20


def split_backward(config: str, rows) -> bool:
    """Whether the compiled MLP backward runs in stages (large layers) or one op."""
    c = specs.parse(config)
    w = c["fc1"]["shape"][1]
    return bool(rows * w * specs.dtype_from_name(c["dtype"]).itemsize >= SPLIT_BACKWARD_BYTES)


def _whole_args(grad, saved, m_splits, host, fused1, fused2, config: str, key: str, rows) -> tuple:
    """Arguments of the backward op in its one-op form (small layers)."""
    return (grad, saved, m_splits, host, fused1, fused2, config, key, "whole", rows)


def _split_args(grad, saved, m_splits, host, fused1, fused2, config: str, key: str, rows):
    """({fc2 part: that op's arguments}, the activation op's arguments but
    its first, {fc1 part: that op's arguments but its first}) of the staged
    form: each op gets only the saved tensors it reads."""
    c = specs.parse(config)
    fc2 = {part: (grad, [saved[i] for i in saved_layout.stage_slots(key, SAVED_FOR_FC2[part])], m_splits, host, [],
                  fused2 if part != "dgrad" else [], config, key, part, rows)
           for part in fc2_parts(c, key, rows)}
    act = ([saved[i] for i in saved_layout.stage_slots(key, STAGE_ACT)], m_splits, host, config, key, rows)
    need1 = needs_of_list(c["needs"][0])
    parts = {part: ([saved[i] for i in saved_layout.stage_slots(key, SAVED_FOR[part])], m_splits, host,
                    fused1 if part == "wgrad" else [], config, key, rows, part)
             for part in fc1_parts(need1)}
    return fc2, act, parts


def _saved_of(ctx):
    """(m_splits, host, fused1, fused2, saved, config, key, rows) from _mlp_setup's context."""
    host, config, key, _, _, _, (n1, n2), rows = ctx.meta
    m_splits, *saved = ctx.saved_tensors
    return m_splits, host, saved[:n1], saved[n1:n1 + n2], saved[n1 + n2:], config, key, rows


def _mlp_backward(ctx, grad_out, _grad_saved):
    m_splits, host, fused1, fused2, saved, config, key, rows = _saved_of(ctx)
    has_b1, has_b2 = ctx.meta[4], ctx.meta[5]
    res = mlp_backward_stages(grad_out.contiguous(), saved, m_splits, host, fused1, fused2, config, key, rows)
    del saved
    c = specs.parse(config)
    need1, need2, need_probs = (needs_of_list(v) if isinstance(v, list) else v for v in c["needs"])
    g = c["num"]

    def take(flag, layer):  # list inputs get a list back (autograd checks the structure)
        return grads_for(res.pop(0) if flag else None, g, c[layer]["stacked"])

    def weight_grads(flag, layer):  # fused layers: eager's placeholders (their gradients went into main_grad)
        lc = c[layer]
        if lc["fuse"] is None:
            return take(flag, layer)
        return fused_mg.placeholders(lc["fuse"], lc["shape"], lc["stacked"], grad_out.device)
    dx = res.pop(0) if need1.dgrad else None
    dprobs = res.pop(0) if need_probs else None
    w1g = weight_grads(need1.wgrad, "fc1")
    b1g = take(need1.dbias, "fc1") if has_b1 else []
    w2g = weight_grads(need2.wgrad, "fc2")
    b2g = take(need2.dbias, "fc2") if has_b2 else []
    return (dx, dprobs, None, None, w1g, b1g, w2g, b2g, None, None, None, None)


_grouped_mlp.register_autograd(_mlp_backward, setup_context=_mlp_setup)


def mlp_op_args(x2d, probs, m_splits, fc1, fc2, spec: Activation, recipe, is_first_microbatch, needs,
                routed=None, keep1: bool = False) -> tuple:
    """Arguments of ``lpmoe::grouped_mlp`` for one call (fc1/fc2 are
    lpmoe.functional.LayerParams).  ``routed``: lpmoe.moe.RoutedTokens
    whose tokens are ``x2d`` (lpmoe.library.mlp_route); ``keep1``: fc1
    keeps its input (or the routed tokens) for its weight gradient."""
    tensor = isinstance(m_splits, torch.Tensor)
    g = shape_of(fc1.weights)[0]
    need1, need2, need_probs = needs

    def layer(lp, need, keep):
        return {"cache": cache_key(lp.weight_cache, is_first_microbatch), "bias": lp.biases is not None,
                "shape": list(shape_of(lp.weights)), "stacked": is_stacked(lp.weights),
                "fuse": fused_mg.config_entry(lp.weights, lp.fuse_wgrad_accumulation, need.wgrad), "keep": keep}

    config = specs.json_constant({
        "format": saved_layout.FORMAT, "recipe": specs.encode(recipe), "act": specs.encode(spec), "num": g,
        "fc1": layer(fc1, need1, bool(keep1)), "fc2": layer(fc2, need2, False), "probs": probs is not None,
        "probs_dtype": specs.dtype_name(probs.dtype) if probs is not None else None,
        "first": is_first_microbatch, "grad": torch.is_grad_enabled(),
        "needs": [[need1.dgrad, need1.wgrad, need1.dbias], [need2.dgrad, need2.wgrad, need2.dbias], need_probs],
        "dtype": specs.dtype_name(x2d.dtype), "pdtype": specs.dtype_name(params_dtype(fc1.weights)),
        "routed": mlp_route.route_config(routed)})
    return (x2d, probs, m_splits if tensor else None, None if tensor else [int(v) for v in m_splits],
            as_inputs(fc1.weights), as_inputs(fc1.biases), as_inputs(fc2.weights), as_inputs(fc2.biases), config,
            *mlp_route.route_args(routed))


def grouped_mlp(x2d, probs, m_splits, fc1, fc2, spec: Activation, recipe, is_first_microbatch, needs,
                routed=None, keep1: bool = False) -> Tensor:
    """lpmoe.functional.grouped_mlp while tracing (arguments validated; see mlp_op_args)."""
    y, _ = _grouped_mlp(*mlp_op_args(x2d, probs, m_splits, fc1, fc2, spec, recipe, is_first_microbatch, needs,
                                     routed, keep1))
    return y


OPS["grouped_mlp"] = grouped_mlp


def mlp_backward_args(fwd_args: tuple, fwd_out, grad: Tensor) -> tuple:
    """({fc2 part: that op's arguments}, the activation op's arguments
    without its first, {fc1 part: that op's arguments without its first})
    of the staged form after a forward with ``fwd_args`` returned
    ``fwd_out`` (tests, opcheck).  The activation op's first argument is
    the first output of fc2's "dgrad" op (da); the fc1 ops' first is
    :func:`fc1_dh` of the activation op's outputs past d probs."""
    return _split_args(grad, *_saved_args(fwd_args, fwd_out))


def whole_backward_args(fwd_args: tuple, fwd_out, grad: Tensor) -> tuple:
    """Arguments of the MLP backward op in its one-op form (small layers)."""
    return _whole_args(grad, *_saved_args(fwd_args, fwd_out))


def _saved_args(fwd_args: tuple, fwd_out) -> tuple:
    m_splits, host, fused1, fused2, saved, config, key, rows = _saved_of(setup_context_of(_mlp_setup, fwd_args,
                                                                                          fwd_out))
    return saved, m_splits, host, fused1, fused2, config, key, rows
