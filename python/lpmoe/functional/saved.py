"""What the grouped layers keep for their backward.

:func:`save` / :func:`load` go through ``ctx.save_for_backward``: tensors,
lists of tensors and GroupedTensors (flattened into their buffers and
metadata tensors).  So autograd catches in-place changes to saved parameters
(an optimizer step before the backward), and saved-tensor hooks (activation
offloading, ``torch.autograd.graph.saved_tensors_hooks``) see those bytes.

Autograd frees saved tensors only when the whole backward of the function
returns.  Intermediates that the function itself created and that die in
the middle of its backward (the fused MLP's h and fc2's operands) are
therefore kept with :func:`hold` / :func:`take` instead, so the backward can
drop them right after their last reader; :func:`held_bytes` reports them.
"""
from __future__ import annotations

from typing import List

import torch

from lpmoe.grouped_tensor import GroupedTensor

__all__ = ["save", "load", "hold", "take", "held_bytes"]


def save(ctx, *objs) -> None:
    """Save ``objs`` (each None, a tensor, a list of tensors or a
    GroupedTensor) for :func:`load`."""
    tensors: List[torch.Tensor] = []
    layout = []
    for obj in objs:
        if obj is None:
            layout.append(("none", 0, None))
        elif isinstance(obj, torch.Tensor):
            layout.append(("tensor", 1, None))
            tensors.append(obj)
        elif isinstance(obj, list):
            layout.append(("list", len(obj), None))
            tensors += obj
        elif isinstance(obj, GroupedTensor):
            parts, meta = obj.flatten()
            layout.append(("grouped", len(parts), meta))
            tensors += parts
        else:
            raise TypeError(f"cannot save a {type(obj).__name__} for backward")
    ctx.save_for_backward(*tensors)
    ctx.saved_layout = layout


def load(ctx) -> list:
    """The objects given to :func:`save`, in order."""
    tensors, out, i = ctx.saved_tensors, [], 0
    for kind, count, meta in ctx.saved_layout:
        part = list(tensors[i:i + count])
        i += count
        if kind == "none":
            out.append(None)
        elif kind == "tensor":
            out.append(part[0])
        elif kind == "list":
            out.append(part)
        else:
            out.append(GroupedTensor._rebuild(meta[1:], dict(zip(meta[0], part))))  # made by lpmoe: trusted
    return out


def hold(ctx, **objs) -> None:
    """Keep internal intermediates (None, tensors, lists, GroupedTensors) for
    the backward outside save_for_backward, so it can release them early.
    Their version counters are recorded and checked by :func:`take`, as
    autograd checks saved tensors: a held object need not be the function's
    own (the FP8 weights a layer read from its cache belong to the cache,
    which an optimizer step rewrites in place)."""
    ctx.held = dict(objs)
    ctx.held_versions = {k: _versions(o) for k, o in objs.items()}


def take(ctx, name: str):
    """Hand over a held object and drop the function's reference to it (a
    second backward through the same graph cannot have it again)."""
    if name not in ctx.held:
        raise RuntimeError("this backward already released its activations: running it twice "
                           "(retain_graph=True) is not supported by lpmoe's fused MLP")
    obj = ctx.held.pop(name)
    if _versions(obj) != ctx.held_versions.pop(name):
        raise RuntimeError(f"one of the variables needed for gradient computation has been modified by an inplace "
                           f"operation: lpmoe's fused MLP kept {name!r} for its backward and it changed since the "
                           "forward (an optimizer step between a forward and its backward rewrites the FP8 weight "
                           "copies the forward read)")
    return obj


def _tensors(obj) -> List[torch.Tensor]:
    if obj is None:
        return []
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, list):
        return list(obj)
    return obj.flatten()[0]


def _versions(obj) -> List[int]:
    """Version counters of ``obj``'s tensors (-1 for an inference tensor,
    which has none)."""
    out = []
    for t in _tensors(obj):
        if t is not None:
            out.append(-1 if t.is_inference() else t._version)
    return out


def held_bytes(ctx) -> int:
    """Bytes of the distinct storages currently held by :func:`hold`."""
    seen = {}
    for obj in getattr(ctx, "held", {}).values():
        for t in _tensors(obj):
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())
