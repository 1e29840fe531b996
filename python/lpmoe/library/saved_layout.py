"""What a layer op's forward keeps for its backward, across the op boundary.

Inside a layer the saved objects are Python objects (tensors, lists of
parameters, GroupedTensors).  A custom op can only return fresh tensors
that alias neither its inputs nor each other, so :func:`flatten` splits the
saved objects into

* references to the op's inputs (x, the splits, the parameters, probs),
  saved by ``setup_context`` from the inputs themselves;
* fresh tensors, returned by the op (a tensor sharing storage with one
  already returned, e.g. two offset arrays cut from one buffer, is cloned:
  a few hundred bytes);
* a layout (static: structure and GroupedTensor metadata) that rebuilds the
  objects in the backward.

The layout follows from the static arguments and the inputs' metadata, so it
is kept in a table under a key made of them (the layer ops build it): the fake implementation (at trace time) and the real one
(at run time) produce the same layout, and the backward reads it.  When the
real forward holds a quantized copy with more directions than the layout
(e.g. a weight cache kept both), only the layout's buffers are saved.
"""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch

from lpmoe.grouped_tensor import GroupedTensor
from lpmoe.library.grouped_codec import FIELDS, grouped_from_meta, meta_of

__all__ = ["flatten", "inputs_to_save", "rebuild", "LAYOUTS"]

#: layout key -> layout (a tuple of entries, see flatten)
LAYOUTS: Dict[str, tuple] = {}


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class _Flattener:
    def __init__(self, inputs: Dict[str, torch.Tensor]):
        self.by_id = {id(t): path for path, t in inputs.items() if t is not None}
        self.input_storages = {_storage(t) for t in inputs.values() if t is not None}
        self.fresh: List[torch.Tensor] = []
        self.fresh_ids: Dict[int, int] = {}
        self.storages = set()

    def ref(self, t: torch.Tensor):
        path = self.by_id.get(id(t))
        if path is not None:
            return ("in", path)
        idx = self.fresh_ids.get(id(t))
        if idx is not None:
            return ("out", idx)
        st = _storage(t)
        keep = t.clone() if (st in self.storages or st in self.input_storages) else t
        self.storages.add(_storage(keep))
        self.fresh_ids[id(t)] = len(self.fresh)
        self.fresh.append(keep)
        return ("out", len(self.fresh) - 1)

    def entry(self, obj, want=None):
        if obj is None:
            return ("none",)
        if isinstance(obj, torch.Tensor):
            return ("t", self.ref(obj))
        if isinstance(obj, (list, tuple)):
            return ("l", tuple(self.ref(t) for t in obj))
        if isinstance(obj, GroupedTensor):
            present = [getattr(obj, f) is not None for f in FIELDS] if want is None else want
            refs = []
            for f, keep in zip(FIELDS, present):
                t = getattr(obj, f)
                if keep and t is None:
                    raise RuntimeError(f"lpmoe: saved GroupedTensor lacks {f} that the traced layout has")
                refs.append(self.ref(t) if keep else None)
            return ("g", tuple(refs), meta_of(obj))
        raise TypeError(f"cannot save a {type(obj).__name__} for backward")


def flatten(key: str, objs: Sequence, inputs: Dict[str, torch.Tensor]) -> List[torch.Tensor]:
    """Fresh tensors of ``objs``; records (or follows) the layout under ``key``."""
    known = LAYOUTS.get(key)
    fl = _Flattener(inputs)
    entries = []
    for i, obj in enumerate(objs):
        want = None
        if known is not None and known[i][0] == "g" and isinstance(obj, GroupedTensor):
            want = [r is not None for r in known[i][1]]
        entries.append(fl.entry(obj, want))
    layout = tuple(entries)
    if known is None:
        LAYOUTS[key] = layout
    elif known != layout:
        raise RuntimeError("lpmoe: the saved tensors of this call differ from the traced ones "
                           f"({layout} vs {known}); please report this")
    return fl.fresh


def _input_paths(layout) -> List[str]:
    paths: List[str] = []
    for e in layout:
        refs = () if e[0] == "none" else ((e[1],) if e[0] == "t" else e[1])
        for r in refs:
            if r is not None and r[0] == "in" and r[1] not in paths:
                paths.append(r[1])
    return paths


def inputs_to_save(key: str, inputs: Dict[str, torch.Tensor]) -> Tuple[List[torch.Tensor], int]:
    """(the op inputs the backward reads, how many) in the layout's order."""
    paths = _input_paths(LAYOUTS[key])
    return [inputs[p] for p in paths], len(paths)


def rebuild(key: str, saved: Sequence[torch.Tensor], num_inputs: int) -> list:
    """The saved objects from ``inputs_to_save`` + the op's fresh tensors."""
    layout = LAYOUTS[key]
    env = dict(zip(_input_paths(layout), saved[:num_inputs]))
    fresh = saved[num_inputs:]

    def get(r):
        return None if r is None else (env[r[1]] if r[0] == "in" else fresh[r[1]])

    out = []
    for e in layout:
        if e[0] == "none":
            out.append(None)
        elif e[0] == "t":
            out.append(get(e[1]))
        elif e[0] == "l":
            out.append([get(r) for r in e[1]])
        else:
            out.append(grouped_from_meta({f: get(r) for f, r in zip(FIELDS, e[1]) if r is not None}, e[2]))
    return out
