"""The backward ops of ``lpmoe::grouped_mlp`` (lpmoe.library.mlp_ops
sequences them):

* ``lpmoe::grouped_mlp_backward``: the whole backward (``part`` "whole",
  small layers), or one of fc2's GEMMs (``part`` "wgrad" or "dgrad"; the
  dgrad returns fc2's input gradient da);
* ``lpmoe::grouped_mlp_backward_act``: the activation backward from da,
  returning d probs and fc1's output gradient flattened for the fc1 ops;
* ``lpmoe::grouped_mlp_backward_fc1``: fc1's weight (and bias) gradients,
  or its input gradient (``part``).

``rows`` is the grouped row count (the token count of an op without
routing).  With routing (lpmoe.library.mlp_route) the output gradient is
the tokens' gradient when the forward summed to tokens (fc2's operands are
then quantized from it through the map), and the input gradient goes back
to the tokens; the map and its inverse come from the saved ROUTE objects.
"""
from __future__ import annotations

import contextlib
from typing import List, Optional, Tuple

import torch

from lpmoe.functional import mlp_backward as mb
from lpmoe.functional.linear_steps import dgrad_first_by_size
from lpmoe.functional.precision import autocast_off
from lpmoe.grouped_tensor import sharing_offsets
from lpmoe.library import fused_main_grads as fused_mg
from lpmoe.library import mlp_route, saved_layout, specs
from lpmoe.library.grouped_codec import symbolic_sizes
from lpmoe.library.layer_common import CALLS, needs_of_list, op_splits
from lpmoe.library.mlp_config import SAVED, mlp_config, wgrad_out

__all__ = ["STAGE_ACT", "SAVED_FOR", "SAVED_FOR_FC2", "fc1_dh", "fc2_parts", "fc2_outputs", "dgrad_first_of",
           "grouped_mlp_backward", "grouped_mlp_backward_act", "grouped_mlp_backward_fc1", "fc2_run", "act_run",
           "fc1_run"]

Tensor = torch.Tensor

# The staged backward (lpmoe.library.mlp_ops): each GEMM and the
# activation backward in its own op, so each op's saved operands die when it
# returns, as eager frees them after their last reader (one op holding
# everything peaked 0.75-1 GiB above eager at DeepSeek-V3 shapes, 8 x 64k
# tokens; fc2's GEMMs and the activation in one op still held fc2's copies
# through the activation backward).  The activation op returns fc1's output
# gradient flattened under the key + "|dh" as four objects, so each fc1 op
# receives only its direction.  The GEMM ops also read the routing.
_ROUTE = tuple(SAVED.index(n) for n in mlp_route.ROUTE)
#: saved objects (indices into SAVED) each op reads
STAGE_ACT = tuple(SAVED.index(n) for n in mb.STAGE_ACT)
SAVED_FOR = {"wgrad": (SAVED.index("x1"),) + _ROUTE, "dgrad": (SAVED.index("w1"),) + _ROUTE}
SAVED_FOR_FC2 = {"wgrad": (SAVED.index("x2"),) + _ROUTE, "dgrad": (SAVED.index("w2"),) + _ROUTE}


def dgrad_first_of(c: dict, key: str, rows, layer: str) -> bool:
    """Whether eager runs ``layer``'s dgrad before its wgrad
    (lpmoe.functional.linear_steps.dgrad_first), from the op configuration
    and the saved layout (a weight copy the backward frees, not a cache's)."""
    w = saved_layout.LAYOUTS[key][SAVED.index("w1" if layer == "fc1" else "w2")]
    cached = c[layer]["cache"] >= 0  # (layer_common.cache_key: a key only for a cache in use)
    # a copy: quantized, or made in the compute dtype from parameters of another (torch.autocast)
    copy = w[0] == "g" or (w[0] == "t" and w[1][0] != "in" and c["pdtype"] != c["dtype"])
    return dgrad_first_by_size(rows, tuple(c[layer]["shape"]), copy and not cached, c[layer]["fuse"] is not None)


def fc2_parts(c: dict, key: str, rows) -> list:
    """fc2's GEMM ops in the order eager runs them (linear_steps.backward_steps;
    with a symbolic row count, a trace with dynamic shapes, wgrad first, as
    dgrad_first_by_size rules).  A bias gradient without either GEMM is a
    "wgrad" op alone."""
    need2 = needs_of_list(c["needs"][1])
    order = ("dgrad", "wgrad") if need2.dgrad and need2.wgrad and dgrad_first_of(c, key, rows, "fc2") else \
        ("wgrad", "dgrad")
    parts = [p for p in order if (need2.dgrad if p == "dgrad" else need2.wgrad)]
    return parts or (["wgrad"] if need2.dbias else [])


def _bias_part(need2) -> str:
    """The fc2 op that returns fc2's bias gradient: the wgrad op's dy pass
    fuses it, or the dgrad op's without a weight gradient.  The row count
    does not enter, so the traced and the run op agree on their outputs
    with dynamic shapes too.  Eager fuses it into whichever pass runs first;
    the bits do not depend on the pass's direction (tests/test_backward_order.py),
    so they are eager's in either order."""
    return "wgrad" if need2.wgrad or not need2.dgrad else "dgrad"


def fc2_outputs(c: dict, part: str) -> Tuple[bool, bool, bool]:
    """Which of (fc2's weight grads, its bias grads, da) the fc2 op ``part``
    returns: its GEMM's result (weight grads or da), then the bias grads."""
    need2 = needs_of_list(c["needs"][1])
    return (part == "wgrad" and wgrad_out(c, need2, "fc2"), need2.dbias and part == _bias_part(need2),
            part == "dgrad" and need2.dgrad)


_DH_FOR = {"wgrad": (0, 2, 3), "dgrad": (1, 2)}  # of (wgrad operand, dgrad operand, hp, fused dbias)


def _route_of(objs: dict, m_splits, rows):
    """The routing's backward view, popped from the rebuilt objects."""
    return mlp_route.backward_source([objs.pop(n) for n in mlp_route.ROUTE], m_splits, rows)


def _grad_in(grad: Tensor, back, c: dict):
    """fc2's output gradient: the tokens' gradient read through the map when
    the forward summed the rows to the tokens, else the rows' gradient."""
    return back.with_tokens(grad) if back is not None and c["routed"]["sum"] else grad


def _x1_in(x1, back, c: dict):
    """fc1's saved input: routed tokens the forward kept (fc1's "keep"), not
    a copy, are read through the map again."""
    return back.with_tokens(x1) if back is not None and c["fc1"]["keep"] and x1 is not None else x1


def _whole(grad, saved, m_splits, host, fused1, fused2, c, cfg, key, rows, fake):
    """The whole backward in one op (small layers): [dx] [dprobs] [w1 grads]
    [b1 grads] [w2 grads] [b2 grads]."""
    dtype, pdtype = specs.dtype_from_name(c["dtype"]), specs.dtype_from_name(c["pdtype"])
    need1, need2, need_probs = cfg.needs
    wgrad1, wgrad2 = wgrad_out(c, need1, "fc1"), wgrad_out(c, need2, "fc2")
    g = c["num"]
    objs = dict(zip(SAVED, saved_layout.rebuild(key, saved, 0, rows, range(len(SAVED)))))
    del saved
    back = _route_of(objs, m_splits, rows)
    if fake:
        (_, w, hidden), (_, _, ffn), dev = c["fc1"]["shape"], c["fc2"]["shape"], grad.device
        out = [torch.empty((mlp_route.tokens_of(back, rows), hidden), dtype=dtype, device=dev)] if need1.dgrad else []
        out += [torch.empty((rows,), dtype=specs.dtype_from_name(c["probs_dtype"]), device=dev)] if need_probs else []
        for need, wgrad, (n, k) in ((need1, wgrad1, (w, hidden)), (need2, wgrad2, (hidden, ffn))):
            out += [torch.empty((g, n, k), dtype=pdtype, device=dev)] if wgrad else []
            out += [torch.empty((g, n), dtype=pdtype, device=dev)] if need.dbias else []
        return out
    main_grads = (fused_mg.main_grads(fused1, c["fc1"]["fuse"], c["fc1"]["stacked"]),
                  fused_mg.main_grads(fused2, c["fc2"]["fuse"], c["fc2"]["stacked"]))
    splits = op_splits(m_splits, host, g, rows, grad.device, False)
    objs["x1"] = _x1_in(objs["x1"], back, c)
    grad = _grad_in(grad, back, c)
    with autocast_off():
        dx, dprobs, w1g, b1g, w2g, b2g = mb.mlp_backward_impl(grad, objs.pop, splits, cfg, pdtype, main_grads, back)
    out = ([dx] if need1.dgrad else []) + ([dprobs] if need_probs else [])
    out += ([w1g] if wgrad1 else []) + ([b1g] if need1.dbias else [])
    return out + ([w2g] if wgrad2 else []) + ([b2g] if need2.dbias else [])


def fc2_run(grad, saved, m_splits, host, fused1, fused2, config, key, part, rows, fake):
    """``lpmoe::grouped_mlp_backward``'s implementation (and fake): the
    whole backward (``part`` "whole"), or one of fc2's GEMMs: [w2 grads or
    da] [b2 grads], as :func:`fc2_outputs` says."""
    c = specs.parse(config)
    cfg = mlp_config(c, fake)
    if not fake:
        CALLS["grouped_mlp_backward"] += 1
    if part == "whole":
        return _whole(grad, saved, m_splits, host, fused1, fused2, c, cfg, key, rows, fake)
    pdtype = specs.dtype_from_name(c["pdtype"])  # the parameters' gradients' (da: the compute dtype)
    has_w, has_b, has_da = fc2_outputs(c, part)
    main2 = None if fake or part == "dgrad" else fused_mg.main_grads(fused2, c["fc2"]["fuse"], c["fc2"]["stacked"])
    objs = dict(zip([SAVED[i] for i in SAVED_FOR_FC2[part]],
                    saved_layout.rebuild(key, saved, 0, rows, SAVED_FOR_FC2[part])))
    del saved
    back = _route_of(objs, m_splits, rows)
    (saved_obj,) = objs.values()
    del objs
    splits = op_splits(m_splits, host, c["num"], rows, grad.device, fake)
    with sharing_offsets(), (symbolic_sizes() if fake else contextlib.nullcontext()), autocast_off():
        out, b2g = mb.mlp_backward_fc2_part(_grad_in(grad, back, c), saved_obj, splits, cfg, pdtype, part, has_b,
                                             main2)
    return ([out] if has_w or has_da else []) + ([b2g] if has_b else [])


def act_run(da, saved, m_splits, host, config, key, rows, fake):
    """``lpmoe::grouped_mlp_backward_act``'s implementation (and fake):
    [dprobs] + fc1's output gradient flattened under key + "|dh"."""
    c = specs.parse(config)
    cfg = mlp_config(c, fake)
    if not fake:
        CALLS["grouped_mlp_backward_act"] += 1
    need1, _, need_probs = cfg.needs
    objs = dict(zip([SAVED[i] for i in STAGE_ACT], saved_layout.rebuild(key, saved, 0, rows, STAGE_ACT)))
    # (m_splits too: dh's group holds the device splits as its first_dims,
    # and an op may not return its input; fc2's op got it among the saved
    # tensors, its operands' first_dims, so it was cloned there as well)
    foreign = [da, m_splits, *saved]
    del saved
    splits = op_splits(m_splits, host, c["num"], rows, da.device, fake)
    with sharing_offsets(), (symbolic_sizes() if fake else contextlib.nullcontext()), autocast_off():
        dh, dprobs = mb.mlp_backward_activation(da, objs.pop, splits, cfg)
        q = dh.quantized if dh is not None else None
        dh_objs = (None, None, None, None) if dh is None else (
            q.direction_view(columnwise=True) if q is not None and need1.wgrad else None,
            q.direction_view(columnwise=False) if q is not None and need1.dgrad else None, dh.hp, dh.dbias)
        del dh, q
        dh_flat = saved_layout.flatten(key + "|dh", dh_objs, {}, fake, rows, foreign=foreign)
        del foreign
    return ([dprobs] if need_probs else []) + dh_flat


def _device_of(*objs) -> torch.device:
    """The device of the first of ``objs`` that has one (a tensor, a
    GroupedTensor or a non-empty list of tensors): with host splits the
    dgrad part of fc1 holds only the weights (a copy or the parameters)
    and dh's rowwise operands."""
    for o in objs:
        if isinstance(o, (list, tuple)):
            o = o[0] if o else None
        if o is not None:
            return o.device
    raise RuntimeError("lpmoe: a backward op without any tensor to place its work")


def fc1_run(dh_flat, saved, m_splits, host, fused1, config, key, rows, part, fake):
    """``lpmoe::grouped_mlp_backward_fc1``'s implementation (and fake)."""
    c = specs.parse(config)
    dtype, pdtype = specs.dtype_from_name(c["dtype"]), specs.dtype_from_name(c["pdtype"])
    need1 = needs_of_list(c["needs"][0])
    wgrad1 = wgrad_out(c, need1, "fc1")
    objs = dict(zip([SAVED[i] for i in SAVED_FOR[part]], saved_layout.rebuild(key, saved, 0, rows, SAVED_FOR[part])))
    del saved
    back = _route_of(objs, m_splits, rows)
    (saved_obj,) = objs.values()
    del objs
    if fake:
        (g, w, hidden), dev = c["fc1"]["shape"], dh_flat[0].device
        if part == "dgrad":
            return [torch.empty((mlp_route.tokens_of(back, rows), hidden), dtype=dtype, device=dev)]
        out = [torch.empty((g, w, hidden), dtype=pdtype, device=dev)] if wgrad1 else []
        return out + ([torch.empty((g, w), dtype=pdtype, device=dev)] if need1.dbias else [])
    CALLS["grouped_mlp_backward_fc1"] += 1
    cfg = mlp_config(c, False)
    dh_objs = saved_layout.rebuild(key + "|dh", dh_flat, 0, rows, _DH_FOR[part])
    del dh_flat
    splits = op_splits(m_splits, host, c["num"], rows, _device_of(saved_obj, m_splits, *dh_objs), False)
    with sharing_offsets(), autocast_off():
        if part == "dgrad":
            qrow, hp = dh_objs
            del dh_objs
            dx = mb.mlp_backward_fc1_dgrad(mb.Dh(qrow, hp, None), saved_obj, splits, cfg)
            return [back.rows_to_tokens(dx) if back is not None else dx]
        qcol, hp, dbias = dh_objs
        del dh_objs
        main1 = fused_mg.main_grads(fused1, c["fc1"]["fuse"], c["fc1"]["stacked"])
        w1g, b1g = mb.mlp_backward_fc1_wgrad(mb.Dh(qcol, hp, dbias), _x1_in(saved_obj, back, c), splits, cfg,
                                              pdtype, main1)
    if b1g is not None and b1g is dbias:  # the activation's fused bias gradient, already in pdtype: an input
        b1g = b1g.clone()
    return ([w1g] if wgrad1 else []) + ([b1g] if need1.dbias else [])


@torch.library.custom_op("lpmoe::grouped_mlp_backward", mutates_args=())
def grouped_mlp_backward(grad: Tensor, saved: List[Tensor], m_splits: Optional[Tensor],
                         host_splits: Optional[List[int]], fused1: List[Tensor], fused2: List[Tensor], config: str,
                         key: str, part: str, rows: int) -> List[Tensor]:
    return fc2_run(grad, saved, m_splits, host_splits, fused1, fused2, config, key, part, rows, False)


@grouped_mlp_backward.register_fake
def _(grad, saved, m_splits, host_splits, fused1, fused2, config, key, part, rows):
    return fc2_run(grad, saved, m_splits, host_splits, fused1, fused2, config, key, part, rows, True)


@torch.library.custom_op("lpmoe::grouped_mlp_backward_act", mutates_args=())
def grouped_mlp_backward_act(da: Tensor, saved: List[Tensor], m_splits: Optional[Tensor],
                             host_splits: Optional[List[int]], config: str, key: str, rows: int) -> List[Tensor]:
    return act_run(da, saved, m_splits, host_splits, config, key, rows, False)


@grouped_mlp_backward_act.register_fake
def _(da, saved, m_splits, host_splits, config, key, rows):
    return act_run(da, saved, m_splits, host_splits, config, key, rows, True)


@torch.library.custom_op("lpmoe::grouped_mlp_backward_fc1", mutates_args=())
def grouped_mlp_backward_fc1(dh: List[Tensor], saved: List[Tensor], m_splits: Optional[Tensor],
                             host_splits: Optional[List[int]], fused1: List[Tensor], config: str, key: str,
                             rows: int, part: str) -> List[Tensor]:
    return fc1_run(dh, saved, m_splits, host_splits, fused1, config, key, rows, part, False)


@grouped_mlp_backward_fc1.register_fake
def _(dh, saved, m_splits, host_splits, fused1, config, key, rows, part):
    return fc1_run(dh, saved, m_splits, host_splits, fused1, config, key, rows, part, True)


fused_mg.register_side_effects(grouped_mlp_backward, grouped_mlp_backward_fc1)


def fc1_dh(dh_flat: List[Tensor], key: str, part: str) -> List[Tensor]:
    """The first argument of the fc1 op ``part`` from the activation op's
    dh outputs (its outputs past d probs)."""
    return [dh_flat[i] for i in saved_layout.stage_slots(key + "|dh", _DH_FOR[part])]
