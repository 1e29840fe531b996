"""What the grouped layers keep for their backward.

Everything goes through ``ctx.save_for_backward``: tensors, lists of tensors
and GroupedTensors (flattened into their buffers and metadata tensors).  So
autograd catches in-place changes to saved parameters (an optimizer step
before the backward), and saved-tensor hooks (activation offloading,
``torch.autograd.graph.saved_tensors_hooks``) see every saved byte.
"""
from __future__ import annotations

from typing import List

import torch

from lpmoe.grouped_tensor import GroupedTensor

__all__ = ["save", "load"]


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
            out.append(GroupedTensor.unflatten(part, meta))
    return out
