"""GroupedTensor across the custom-op boundary and through torch.compile.

A GroupedTensor is tensors (data, scales, amax, device metadata) plus static
metadata (member count, logical shape, dtype, quantizer, scale layout).

* :func:`pack` / :func:`unpack` turn it into op arguments: a ``Tensor?[]`` of
  its fields in a fixed order and a JSON string of the static part.
* It is registered as a pytree node with the same split, so compiled
  functions can take and return GroupedTensors and Dynamo guards only on the
  static part (new routing = new tensor values = no recompilation).
"""
from __future__ import annotations

import contextlib
from typing import List, Optional, Tuple

import torch
import torch.utils._pytree as pytree

from lpmoe.grouped_tensor import GroupedTensor
from lpmoe.library import specs

__all__ = ["FIELDS", "pack", "unpack", "meta_of", "grouped_from_meta", "symbolic_sizes"]

#: tensor fields in op-argument order (offsets_status last: optional metadata)
FIELDS = ("rowwise_data", "columnwise_data", "scale_inv", "columnwise_scale_inv", "amax", "columnwise_amax",
          "first_dims", "last_dims", "tensor_offsets", "padded_row_offsets", "offsets_status")


#: symbolic sizes of the open :func:`symbolic_sizes` scopes ("$i" in a meta string is entry i)
_SYMBOLS: List[list] = []


@contextlib.contextmanager
def symbolic_sizes():
    """Scope of a layer op's fake implementation: GroupedTensors handed to
    inner ops may have a symbolic row count (a dynamic token count).  Meta
    strings then name such a size by its index in this scope's table
    instead of its value, and :func:`grouped_from_meta` resolves it, so the
    inner ops' fakes keep it symbolic.  These strings exist only while the
    scope is open (inner ops run their fakes, never kernels, inside it);
    elsewhere a symbolic size is specialized, as any Python int of a shape
    would be."""
    _SYMBOLS.append([])
    try:
        yield
    finally:
        _SYMBOLS.pop()


def _dim(d):
    if isinstance(d, torch.SymInt):
        if not _SYMBOLS:
            return int(d)  # a compiled caller's shape: specialize (guard on the value)
        _SYMBOLS[-1].append(d)
        return f"${len(_SYMBOLS[-1]) - 1}"
    return d


def _size_from_meta(d):
    return _SYMBOLS[-1][int(d[1:])] if isinstance(d, str) else d


def meta_of(g: GroupedTensor, shape=None) -> str:
    """g's static part as a string; ``shape`` replaces its logical shape (the
    saved layout writes the token count as a marker)."""
    shape = [_dim(d) for d in g.logical_shape] if shape is None else list(shape)
    return specs.json_constant({"n": g.num_tensors, "shape": shape, "dtype": specs.dtype_name(g.dtype),
                                "q": specs.encode(g.quantizer), "swz": g.with_gemm_swizzled_scales})


def pack(g: GroupedTensor) -> Tuple[List[Optional[torch.Tensor]], str]:
    return [getattr(g, f) for f in FIELDS], meta_of(g)


def grouped_from_meta(fields, meta: str) -> GroupedTensor:
    """Rebuild a GroupedTensor from its fields (a list in FIELDS order, or a
    dict by name) and :func:`meta_of`'s string; no launch (the offsets come
    along)."""
    m = specs.parse(meta)
    named = dict(zip(FIELDS, fields)) if not isinstance(fields, dict) else dict(fields)
    status = named.pop("offsets_status", None)
    g = GroupedTensor(num_tensors=m["n"], logical_shape=tuple(_size_from_meta(d) for d in m["shape"]),
                      dtype=specs.dtype_from_name(m["dtype"]),
                      quantizer=specs.decode(m["q"]), with_gemm_swizzled_scales=m["swz"], _trusted_offsets=True,
                      **named)
    g.offsets_status = status
    return g


unpack = grouped_from_meta


def _unflatten(children, meta: str) -> GroupedTensor:
    return grouped_from_meta(list(children), meta)


def _flatten_with_keys(g: GroupedTensor):
    return [(pytree.GetAttrKey(f), getattr(g, f)) for f in FIELDS], meta_of(g)


# The pytree split is the op-argument split: pack's fields are the children.
pytree.register_pytree_node(GroupedTensor, pack, _unflatten, serialized_type_name="lpmoe.GroupedTensor",
                            flatten_with_keys_fn=_flatten_with_keys)
