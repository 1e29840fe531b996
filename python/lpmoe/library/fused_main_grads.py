"""``fuse_wgrad_accumulation`` inside the compiled layer ops.

Eager lpmoe adds the weight gradients into each weight's fp32 ``main_grad``
(lpmoe.functional.linear_steps) and hands autograd a placeholder.  The
compiled backward op does the same at run time, reading ``main_grad`` from
the weight tensors themselves: the layer op saves its weight inputs for the
backward, and AOTAutograd saves graph inputs as they are, so the backward op
receives the Parameter objects, attributes included (a weight that arrives
without ``main_grad`` raises the eager error).  Compiled graphs are shared by
identical layers, and the weights are the graph's inputs, so each call reads
its own layer's buffers.

The accumulation is invisible to the compiler: the backward ops are
registered as side-effecting (``torch.fx.node.has_side_effect``) so that no
dead-code pass drops them when autograd uses none of their outputs (a layer
whose input needs no gradient, no bias, weights fused without Megatron's
marker).  Nothing inside the compiled graphs reads a main_grad, so no
ordering is lost.

Why not the functional form, main_grads as inputs of the forward op that the
backward op declares mutated: tried in stop 32.  On torch 2.11 (the GPU
machine's) AOTAutograd writes such backward mutations back wrongly when the
main_grads are views of one buffer (Megatron's layout: garbage in some
experts' buffers), and a graph compiled for aliased views was then reused
for separate tensors; torch 2.14 got both right.  It would also have copied
aliased buffers before mutating them.

Megatron's ``grad_added_to_main_grad`` is set while Dynamo traces the
forward, so Dynamo replays the attribute write with every run of the graph,
CUDA-graph replays (mode="reduce-overhead") included, where the backward
op's Python does not run; eager sets it in the backward.  A CUDA graph bakes
the main_grad addresses in: the buffers must stay the same tensors across
replays (as with eager graph capture).
"""
from __future__ import annotations

from typing import List, Optional

import torch

from lpmoe.functional.checks import check_main_grads
from lpmoe.functional.linear_steps import main_grads_of, mark_added_to_main_grad
from lpmoe.functional.params import from_inputs
from lpmoe.library import specs

Tensor = torch.Tensor

#: what autograd gets for a fused weight, as eager makes it
#: (linear_steps.mark_added_to_main_grad): None without Megatron's marker,
#: else an uninitialised placeholder, or zeros with ``zero_out_wgrad``
NONE, EMPTY, ZEROS = 0, 1, 2
_KIND = {None: NONE, torch.empty: EMPTY, torch.zeros: ZEROS}
_MAKE = {EMPTY: torch.empty, ZEROS: torch.zeros}


def config_entry(weights, fuse: bool, need_wgrad: bool) -> Optional[dict]:
    """The layer config's "fuse" entry of one call (None: gradients go to
    autograd).  Runs while Dynamo traces: marker writes here are replayed
    with every run of the compiled graph."""
    if not (fuse and need_wgrad):
        return None
    ws = [weights] if isinstance(weights, Tensor) else list(weights)
    return {"ph": [_KIND[mark_added_to_main_grad(w)] for w in ws], "dtype": specs.dtype_name(ws[0].dtype)}


def main_grads(weights: List[Tensor], entry: Optional[dict], stacked: bool):
    """The buffers the backward op adds into (linear_steps.main_grads_of's
    form), None when the layer is not fused; checks that each weight still
    carries a valid main_grad."""
    if entry is None:
        return None
    params = from_inputs(weights, stacked)
    check_main_grads(params)
    return main_grads_of(params)


def placeholders(entry: dict, shape, stacked: bool, device) -> List[Optional[Tensor]]:
    """Autograd's gradients of the fused weights, one per weight input."""
    g, n, k = shape
    wshape, dtype = ((g, n, k) if stacked else (n, k)), specs.dtype_from_name(entry["dtype"])
    return [None if kind == NONE else _MAKE[kind](wshape, dtype=dtype, device=device) for kind in entry["ph"]]


def register_side_effects(*ops) -> None:
    """Keeps the backward ops out of dead-code elimination (see above)."""
    for op in ops:
        torch.fx.node.has_side_effect(op._opoverload)
