"""``lpmoe::grouped_mlp`` and its backward ops: the fused expert MLP as
custom ops with autograd (lpmoe.library.layer_ops says how the layer ops
work).

The backward of a large layer runs as three ops, (1) fc2 + the activation,
(2) fc1's weight (and bias) gradients, (3) fc1's input gradient, each given
only the saved tensors it reads (saved_layout.stage_slots): a compiled
graph holds an op's inputs until the op returns, so h and fc2's copies die
before fc1's GEMMs allocate, and x's and dh's transposed copies before
fc1's dgrad, as in eager.  A small layer runs it as one op (the two extra
op calls cost host time that would dominate a launch-bound step)."""
from __future__ import annotations

import contextlib
from typing import Dict, List, Optional, Tuple

import torch

from lpmoe.activation.spec import Activation
from lpmoe.functional import mlp
from lpmoe.functional.checks import check_recipe
from lpmoe.functional.params import as_inputs, grads_for, is_stacked, shape_of
from lpmoe.functional.weights import cache_by_key
from lpmoe.grouped_tensor import sharing_offsets
from lpmoe.library import fused_main_grads as fused_mg
from lpmoe.library import saved_layout, specs
from lpmoe.library.grouped_codec import symbolic_sizes
from lpmoe.library.layer_common import (CALLS, cache_key, fused_weights, needs_of_list, op_splits, setup_context_of,
                                         signature)
from lpmoe.library.routing import OPS, tracing
from lpmoe.policy import Needs, policy_for

Tensor = torch.Tensor


def _mlp_layer(c: dict, name: str, policy, fake: bool) -> mlp._Layer:
    cache = None if fake or c["first"] is None or c[name]["cache"] < 0 else cache_by_key(c[name]["cache"])
    return mlp._Layer(policy, c["num"], c[name]["bias"], cache, False, tuple(c[name]["shape"]), c[name]["stacked"])


def _mlp_config(c: dict, fake: bool) -> mlp.MLPConfig:
    policy = policy_for(specs.decode(c["recipe"]))
    l1, l2 = _mlp_layer(c, "fc1", policy, fake), _mlp_layer(c, "fc2", policy, fake)
    first = None if (l1.weight_cache is None or l2.weight_cache is None) else c["first"]
    need1, need2, need_probs = c["needs"]
    return mlp.MLPConfig(specs.decode(c["act"]), l1, l2, c["probs"], first, c["grad"],
                         (needs_of_list(need1), needs_of_list(need2), need_probs))


def _mlp_inputs(x, probs, m_splits, w1, b1, w2, b2) -> Dict[str, Tensor]:
    d = {"x": x, "p": probs, "s": m_splits}
    for name, ts in (("w1_", w1), ("b1_", b1 or []), ("w2_", w2), ("b2_", b2 or [])):
        d.update({f"{name}{i}": t for i, t in enumerate(ts)})
    return d


def _mlp_forward(x, probs, m_splits, host, w1, b1, w2, b2, config, fake):
    c = specs.parse(config)
    cfg = _mlp_config(c, fake)
    splits = op_splits(m_splits, host, c["num"], x.shape[0], x.device, fake)
    if not fake:
        CALLS["grouped_mlp"] += 1
        recipe = specs.decode(c["recipe"])
        for n, k in (c["fc1"]["shape"][1:], c["fc2"]["shape"][1:]):
            check_recipe(recipe, x.dtype, n, k, splits, x.is_cuda, x.device)
    params = list(w1) + list(b1 or []) + list(w2) + list(b2 or [])
    y, objs = mlp.mlp_forward_impl(x, probs, splits, params, cfg)
    key = config + "|" + signature(x, m_splits, w1 + w2)
    return y, saved_layout.flatten(key, objs, _mlp_inputs(x, probs, m_splits, w1, b1, w2, b2), fake, x.shape[0])


@torch.library.custom_op("lpmoe::grouped_mlp", mutates_args=())
def _grouped_mlp(x: Tensor, probs: Optional[Tensor], m_splits: Optional[Tensor], host_splits: Optional[List[int]],
                 w1: List[Tensor], b1: List[Tensor], w2: List[Tensor], b2: List[Tensor],
                 config: str) -> Tuple[Tensor, List[Tensor]]:
    return _mlp_forward(x, probs, m_splits, host_splits, w1, b1 or None, w2, b2 or None, config, fake=False)


@_grouped_mlp.register_fake
def _(x, probs, m_splits, host_splits, w1, b1, w2, b2, config):
    with symbolic_sizes():
        return _mlp_forward(x, probs, m_splits, host_splits, w1, b1 or None, w2, b2 or None, config, fake=True)


# The three-op backward (module docstring; one op holding everything
# peaked 0.75-1 GiB above eager at DeepSeek-V3 shapes, 8 x 64k tokens): the
# first op returns fc1's output gradient flattened under the key + "|dh" as
# four objects, so each fc1 op receives only its direction.
_STAGE_FC2 = tuple(mlp.SAVED.index(n) for n in mlp.STAGE_FC2)
_SAVED_FOR = {"wgrad": (mlp.SAVED.index("x1"),), "dgrad": (mlp.SAVED.index("w1"),)}
_DH_FOR = {"wgrad": (0, 2, 3), "dgrad": (1, 2)}  # of (wgrad operand, dgrad operand, hp, fused dbias)


def _wgrad_out(c: dict, need: Needs, layer: str) -> bool:
    return need.wgrad and c[layer]["fuse"] is None  # fused: added into main_grad instead


def _fc1_parts(need1: Needs) -> Tuple[str, ...]:
    return (("wgrad",) if need1.wgrad or need1.dbias else ()) + (("dgrad",) if need1.dgrad else ())


def _mlp_backward_whole(grad, saved, m_splits, host, fused1, fused2, c, cfg, key, fake):
    """The whole backward in one op (small layers): [dx] [dprobs] [w1 grads]
    [b1 grads] [w2 grads] [b2 grads]."""
    dtype = specs.dtype_from_name(c["dtype"])
    need1, need2, need_probs = cfg.needs
    wgrad1, wgrad2 = _wgrad_out(c, need1, "fc1"), _wgrad_out(c, need2, "fc2")
    g, t = c["num"], grad.shape[0]
    if fake:
        (_, w, hidden), (_, _, ffn), dev = c["fc1"]["shape"], c["fc2"]["shape"], grad.device
        out = [torch.empty((t, hidden), dtype=dtype, device=dev)] if need1.dgrad else []
        out += [torch.empty((t,), dtype=specs.dtype_from_name(c["probs_dtype"]), device=dev)] if need_probs else []
        for need, wgrad, (n, k) in ((need1, wgrad1, (w, hidden)), (need2, wgrad2, (hidden, ffn))):
            out += [torch.empty((g, n, k), dtype=dtype, device=dev)] if wgrad else []
            out += [torch.empty((g, n), dtype=dtype, device=dev)] if need.dbias else []
        return out
    main_grads = (fused_mg.main_grads(fused1, c["fc1"]["fuse"], c["fc1"]["stacked"]),
                  fused_mg.main_grads(fused2, c["fc2"]["fuse"], c["fc2"]["stacked"]))
    objs = dict(zip(mlp.SAVED, saved_layout.rebuild(key, saved, 0, t, range(len(mlp.SAVED)))))
    del saved
    splits = op_splits(m_splits, host, g, t, grad.device, False)
    dx, dprobs, w1g, b1g, w2g, b2g = mlp.mlp_backward_impl(grad, objs.pop, splits, cfg, dtype, main_grads)
    out = ([dx] if need1.dgrad else []) + ([dprobs] if need_probs else [])
    out += ([w1g] if wgrad1 else []) + ([b1g] if need1.dbias else [])
    return out + ([w2g] if wgrad2 else []) + ([b2g] if need2.dbias else [])


def _mlp_backward_fc2_run(grad, saved, m_splits, host, fused1, fused2, config, key, whole, fake):
    c = specs.parse(config)
    cfg = _mlp_config(c, fake)
    if not fake:
        CALLS["grouped_mlp_backward"] += 1
    if whole:
        return _mlp_backward_whole(grad, saved, m_splits, host, fused1, fused2, c, cfg, key, fake)
    dtype = specs.dtype_from_name(c["dtype"])
    need1, need2, need_probs = cfg.needs
    tokens = grad.shape[0]
    main2 = None if fake else fused_mg.main_grads(fused2, c["fc2"]["fuse"], c["fc2"]["stacked"])
    objs = dict(zip(mlp.STAGE_FC2, saved_layout.rebuild(key, saved, 0, tokens, _STAGE_FC2)))
    splits = op_splits(m_splits, host, c["num"], tokens, grad.device, fake)
    with sharing_offsets(), (symbolic_sizes() if fake else contextlib.nullcontext()):
        dh, dprobs, w2g, b2g = mlp.mlp_backward_fc2(grad, objs.pop, splits, cfg, dtype, main2)
        q = dh.quantized if dh is not None else None
        dh_objs = (None, None, None, None) if dh is None else (
            q.direction_view(columnwise=True) if q is not None and need1.wgrad else None,
            q.direction_view(columnwise=False) if q is not None and need1.dgrad else None, dh.hp, dh.dbias)
        del dh, q
        dh_flat = saved_layout.flatten(key + "|dh", dh_objs, {}, fake, tokens, foreign=[grad, *saved])
    out = ([dprobs] if need_probs else []) + ([w2g] if _wgrad_out(c, need2, "fc2") else [])
    return out + ([b2g] if need2.dbias else []) + dh_flat


def _mlp_backward_fc1_run(dh_flat, saved, m_splits, host, fused1, config, key, tokens, part, fake):
    c = specs.parse(config)
    dtype = specs.dtype_from_name(c["dtype"])
    need1 = needs_of_list(c["needs"][0])
    wgrad1 = _wgrad_out(c, need1, "fc1")
    if fake:
        (g, w, hidden), dev = c["fc1"]["shape"], dh_flat[0].device
        if part == "dgrad":
            return [torch.empty((tokens, hidden), dtype=dtype, device=dev)]
        out = [torch.empty((g, w, hidden), dtype=dtype, device=dev)] if wgrad1 else []
        return out + ([torch.empty((g, w), dtype=dtype, device=dev)] if need1.dbias else [])
    CALLS["grouped_mlp_backward_fc1"] += 1
    cfg = _mlp_config(c, False)
    (saved_obj,) = saved_layout.rebuild(key, saved, 0, tokens, _SAVED_FOR[part])
    dh_objs = saved_layout.rebuild(key + "|dh", dh_flat, 0, tokens, _DH_FOR[part])
    del dh_flat, saved
    splits = op_splits(m_splits, host, c["num"], tokens, saved_obj.device if isinstance(saved_obj, Tensor) else
                     (m_splits.device if m_splits is not None else dh_objs[-1].device), False)
    with sharing_offsets():
        if part == "dgrad":
            qrow, hp = dh_objs
            del dh_objs
            return [mlp.mlp_backward_fc1_dgrad(mlp.Dh(qrow, hp, None), saved_obj, splits, cfg)]
        qcol, hp, dbias = dh_objs
        del dh_objs
        main1 = fused_mg.main_grads(fused1, c["fc1"]["fuse"], c["fc1"]["stacked"])
        w1g, b1g = mlp.mlp_backward_fc1_wgrad(mlp.Dh(qcol, hp, dbias), saved_obj, splits, cfg, dtype, main1)
    if b1g is not None and b1g is dbias:  # the activation's fused bias gradient, already in dtype: an input
        b1g = b1g.clone()
    return ([w1g] if wgrad1 else []) + ([b1g] if need1.dbias else [])


@torch.library.custom_op("lpmoe::grouped_mlp_backward", mutates_args=())
def _grouped_mlp_backward(grad: Tensor, saved: List[Tensor], m_splits: Optional[Tensor],
                          host_splits: Optional[List[int]], fused1: List[Tensor], fused2: List[Tensor], config: str,
                          key: str, whole: bool) -> List[Tensor]:
    return _mlp_backward_fc2_run(grad, saved, m_splits, host_splits, fused1, fused2, config, key, whole, False)


@_grouped_mlp_backward.register_fake
def _(grad, saved, m_splits, host_splits, fused1, fused2, config, key, whole):
    return _mlp_backward_fc2_run(grad, saved, m_splits, host_splits, fused1, fused2, config, key, whole, True)


@torch.library.custom_op("lpmoe::grouped_mlp_backward_fc1", mutates_args=())
def _grouped_mlp_backward_fc1(dh: List[Tensor], saved: List[Tensor], m_splits: Optional[Tensor],
                              host_splits: Optional[List[int]], fused1: List[Tensor], config: str, key: str,
                              tokens: int, part: str) -> List[Tensor]:
    return _mlp_backward_fc1_run(dh, saved, m_splits, host_splits, fused1, config, key, tokens, part, False)


@_grouped_mlp_backward_fc1.register_fake
def _(dh, saved, m_splits, host_splits, fused1, config, key, tokens, part):
    return _mlp_backward_fc1_run(dh, saved, m_splits, host_splits, fused1, config, key, tokens, part, True)


def _mlp_setup(ctx, inputs, output):
    x, probs, m_splits, host, w1, b1, w2, b2, config = inputs
    b1, b2 = b1 or None, b2 or None
    key = config + "|" + signature(x, m_splits, w1 + w2)
    tensors, k = saved_layout.inputs_to_save(key, _mlp_inputs(x, probs, m_splits, w1, b1, w2, b2))
    c = specs.parse(config)
    fused1, fused2 = fused_weights(w1, c["fc1"]), fused_weights(w2, c["fc2"])
    ctx.save_for_backward(m_splits, *fused1, *fused2, *tensors, *output[1])
    ctx.meta = (host, config, key, k, b1 is not None, b2 is not None, (len(fused1), len(fused2)))


def mlp_backward_stages(grad, saved, m_splits, host, fused1, fused2, config: str, key: str) -> list:
    """The backward ops in order (or their implementations, when not
    tracing): [dx] [dprobs] [w1 grads] [b1 grads] [w2 grads] [b2 grads], each
    present when the configuration asks for it."""
    need1 = needs_of_list(specs.parse(config)["needs"][0])
    op = tracing()
    args = (grad, saved, m_splits, host, fused1, fused2, config, key)
    del saved, grad
    if not split_backward(config, args[0].shape[0]):
        args = _whole_args(*args)
        return _grouped_mlp_backward(*args) if op else _mlp_backward_fc2_run(*args, False)
    fc2_args, parts = _split_args(*args)
    del args
    res = _grouped_mlp_backward(*fc2_args) if op else _mlp_backward_fc2_run(*fc2_args, False)
    del fc2_args
    n2 = mlp_grad_count(config)
    fc2_part, dh_flat = res[:n2], res[n2:]
    del res
    out = {}
    if need1.any and dh_flat:
        for part, rest in parts.items():
            dh = fc1_dh(dh_flat, key, part)
            out[part] = _grouped_mlp_backward_fc1(dh, *rest) if op else _mlp_backward_fc1_run(dh, *rest, False)
            del dh
    del dh_flat, parts
    n_probs = int(specs.parse(config)["needs"][2])
    return out.get("dgrad", []) + fc2_part[:n_probs] + out.get("wgrad", []) + fc2_part[n_probs:]


#: h's bytes from which the MLP backward runs as three ops: below, the
#: memory an op boundary would free is small and the two extra op calls'
#: host time (0.24-0.33 ms each, tools/probe_compiled_mlp.py host, H200 machine)
#: would dominate a launch-bound step
SPLIT_BACKWARD_BYTES = 64 << 20


def split_backward(config: str, tokens) -> bool:
    """Whether the compiled MLP backward runs in three ops (large layers) or one."""
    c = specs.parse(config)
    w = c["fc1"]["shape"][1]
    return bool(tokens * w * specs.dtype_from_name(c["dtype"]).itemsize >= SPLIT_BACKWARD_BYTES)


def _whole_args(grad, saved, m_splits, host, fused1, fused2, config: str, key: str) -> tuple:
    """Arguments of the backward op in its one-op form (small layers)."""
    return (grad, saved, m_splits, host, fused1, fused2, config, key, True)


def _split_args(grad, saved, m_splits, host, fused1, fused2, config: str, key: str):
    """(the first op's arguments, {fc1 part: that op's arguments but its
    first}) of the three-op form: each op gets only the saved tensors it reads."""
    fc2 = (grad, [saved[i] for i in saved_layout.stage_slots(key, _STAGE_FC2)], m_splits, host, [], fused2, config,
           key, False)
    need1 = needs_of_list(specs.parse(config)["needs"][0])
    parts = {part: ([saved[i] for i in saved_layout.stage_slots(key, _SAVED_FOR[part])], m_splits, host,
                    fused1 if part == "wgrad" else [], config, key, grad.shape[0], part)
             for part in _fc1_parts(need1)}
    return fc2, parts


def _saved_of(ctx):
    """(m_splits, host, fused1, fused2, saved, config, key) from _mlp_setup's context."""
    host, config, key, _, _, _, (n1, n2) = ctx.meta
    m_splits, *saved = ctx.saved_tensors
    return m_splits, host, saved[:n1], saved[n1:n1 + n2], saved[n1 + n2:], config, key


def _mlp_backward(ctx, grad_out, _grad_saved):
    m_splits, host, fused1, fused2, saved, config, key = _saved_of(ctx)
    has_b1, has_b2 = ctx.meta[4], ctx.meta[5]
    res = mlp_backward_stages(grad_out.contiguous(), saved, m_splits, host, fused1, fused2, config, key)
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
    return (dx, dprobs, None, None, w1g, b1g, w2g, b2g, None)


_grouped_mlp.register_autograd(_mlp_backward, setup_context=_mlp_setup)
fused_mg.register_side_effects(_grouped_mlp_backward, _grouped_mlp_backward_fc1)


def mlp_op_args(x2d, probs, m_splits, fc1, fc2, spec: Activation, recipe, is_first_microbatch, needs) -> tuple:
    """Arguments of ``lpmoe::grouped_mlp`` for one call (fc1/fc2 are
    lpmoe.functional.LayerParams)."""
    tensor = isinstance(m_splits, torch.Tensor)
    g = shape_of(fc1.weights)[0]
    need1, need2, need_probs = needs

    def layer(lp, need):
        return {"cache": cache_key(lp.weight_cache, is_first_microbatch), "bias": lp.biases is not None,
                "shape": list(shape_of(lp.weights)), "stacked": is_stacked(lp.weights),
                "fuse": fused_mg.config_entry(lp.weights, lp.fuse_wgrad_accumulation, need.wgrad)}

    config = specs.json_constant({
        "format": saved_layout.FORMAT, "recipe": specs.encode(recipe), "act": specs.encode(spec), "num": g,
        "fc1": layer(fc1, need1), "fc2": layer(fc2, need2), "probs": probs is not None,
        "probs_dtype": specs.dtype_name(probs.dtype) if probs is not None else None,
        "first": is_first_microbatch, "grad": torch.is_grad_enabled(),
        "needs": [[need1.dgrad, need1.wgrad, need1.dbias], [need2.dgrad, need2.wgrad, need2.dbias], need_probs],
        "dtype": specs.dtype_name(x2d.dtype)})
    return (x2d, probs, m_splits if tensor else None, None if tensor else [int(v) for v in m_splits],
            as_inputs(fc1.weights), as_inputs(fc1.biases), as_inputs(fc2.weights), as_inputs(fc2.biases), config)


def grouped_mlp(x2d, probs, m_splits, fc1, fc2, spec: Activation, recipe, is_first_microbatch, needs) -> Tensor:
    """lpmoe.functional.grouped_mlp while tracing (arguments validated)."""
    y, _ = _grouped_mlp(*mlp_op_args(x2d, probs, m_splits, fc1, fc2, spec, recipe, is_first_microbatch, needs))
    return y


OPS["grouped_mlp"] = grouped_mlp


def mlp_backward_args(fwd_args: tuple, fwd_out, grad: Tensor) -> tuple:
    """(the first backward op's arguments in its three-op form, {fc1 part:
    that op's arguments without its first}) after a forward with
    ``fwd_args`` returned ``fwd_out`` (tests, opcheck); the fc1 ops' first
    argument is :func:`fc1_dh` of the first op's outputs past its
    :func:`mlp_grad_count` gradients."""
    m_splits, host, fused1, fused2, saved, config, key = _saved_of(setup_context_of(_mlp_setup, fwd_args, fwd_out))
    return _split_args(grad, saved, m_splits, host, fused1, fused2, config, key)


def whole_backward_args(fwd_args: tuple, fwd_out, grad: Tensor) -> tuple:
    """Arguments of the MLP backward op in its one-op form (small layers)."""
    m_splits, host, fused1, fused2, saved, config, key = _saved_of(setup_context_of(_mlp_setup, fwd_args, fwd_out))
    return _whole_args(grad, saved, m_splits, host, fused1, fused2, config, key)


def fc1_dh(dh_flat: List[Tensor], key: str, part: str) -> List[Tensor]:
    """The first argument of the fc1 op ``part`` from the first op's dh outputs."""
    return [dh_flat[i] for i in saved_layout.stage_slots(key + "|dh", _DH_FOR[part])]


def mlp_grad_count(config: str) -> int:
    """How many gradients lead the MLP's first backward op's outputs (the
    flattened fc1 output gradient follows them)."""
    c = specs.parse(config)
    need2 = needs_of_list(c["needs"][1])
    return int(c["needs"][2]) + int(_wgrad_out(c, need2, "fc2")) + int(need2.dbias)
