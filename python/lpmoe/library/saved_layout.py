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
  objects in the backward;
* references to a layer's weight cache (lpmoe.library.cached_weights), for
  saved weights that are a view of it.

The layout follows from the static arguments and the inputs' metadata, so it
is kept in a table under a key made of them (the layer ops build it): the fake implementation (at trace time) and the real one
(at run time) produce the same layout, and the backward reads it.  When the
real forward holds a quantized copy with more directions than the layout
(e.g. a weight cache kept both), only the layout's buffers are saved.

Host cost: the first real call per key walks the objects generically and
checks them against the traced layout; it then records a plan (which
attribute holds which output, which ones need a clone), so later calls
only gather tensors with identity and static-metadata checks, and the
backward rebuilds GroupedTensors without re-validating them (lpmoe made
them).  A call that deviates from the plan takes the generic walk again,
which raises if the layout really differs.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from lpmoe.grouped_tensor import GroupedTensor
from lpmoe.library import specs
from lpmoe.library.cached_weights import CachedWeight, resolve
from lpmoe.library.grouped_codec import FIELDS, meta_of

__all__ = ["flatten", "inputs_to_save", "rebuild", "stage_slots", "LAYOUTS", "CALLS", "FORMAT"]

#: Version of what the layer ops return for their backward.  It is part of
#: every layer op's configuration string, a constant of the compiled graph,
#: so compiled artifacts cached on disk by an lpmoe with another saved
#: layout miss the cache instead of failing Inductor's output checks
#: (3: layout keys without the token count; a cached backward with an old
#: key raised KeyError in LAYOUTS; 4: the backward ops take the fused
#: weights, fuse_wgrad_accumulation under compile; 5: the MLP backward runs
#: as two ops, fc2 + activation, then fc1; 6: a saved FP8 weight keeps its
#: rowwise scales beside the transposed copy, and token-row groups of
#: another width carry derived element offsets instead of views; 7: the MLP
#: op saves the map of routed tokens, and fc1 may keep its input; 8: a
#: large MLP's backward runs each of fc2's GEMMs and the activation as its
#: own op, and the backward op takes a part name instead of ``whole``; 9:
#: the configurations carry the parameters' dtype, and a high-precision
#: layer under torch.autocast saves its weights' cast copy; 10: weights
#: read from the layer's cache are saved as a reference to it).
FORMAT = 10

#: layout key -> layout (a tuple of entries, see flatten)
LAYOUTS: Dict[str, tuple] = {}
#: layout key -> _Plan recorded on the first real call (fast path of later calls)
_PLANS: Dict[str, "_Plan"] = {}
#: layout key -> (input paths in save order, rebuild steps)
_REBUILD: Dict[str, tuple] = {}
#: which flatten path ran (tests prove the planned path is taken)
CALLS = {"walked": 0, "planned": 0}


#: views into buffers up to this size go out as the whole buffer (see _Flattener.ref)
_SMALL_BUFFER = 1 << 16


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _small_view(t: torch.Tensor) -> bool:
    """t is part of a storage of at most _SMALL_BUFFER bytes.  Only int64
    buffers (offset arrays: sized by the member count, never by the token
    count) qualify, so the layout stays the same for every token count."""
    if t.dtype != torch.int64:
        return False
    nbytes = t.untyped_storage().nbytes()
    return nbytes <= _SMALL_BUFFER and not (t.storage_offset() == 0 and t.is_contiguous() and
                                            t.numel() * t.element_size() == nbytes)


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A 1-D view of t's dtype spanning t's entire storage."""
    return t.as_strided((t.untyped_storage().nbytes() // t.element_size(),), (1,), 0)


#: the token-count marker in a layout's GroupedTensor shapes
TOKENS = "T"


def _same_size(a, b) -> bool:
    # Symbolic sizes compare by expression (no guard is added); ints by value.
    if isinstance(a, torch.SymInt) or isinstance(b, torch.SymInt):
        return isinstance(a, torch.SymInt) and isinstance(b, torch.SymInt) and str(a) == str(b)
    return a == b


def _canonical_shape(g: GroupedTensor, tokens) -> tuple:
    """g's logical shape with the call's token count written as TOKENS for a
    group of token rows (split by routing: it has first_dims), so one layout
    serves every token count (torch.compile with dynamic shapes traces the
    layer once for all of them)."""
    rows, cols = g.logical_shape
    if g.first_dims is not None and tokens is not None and _same_size(rows, tokens):
        rows = TOKENS
    # Any other symbolic size is specialized (a guard on its value): correct
    # for every call, recompiled when it changes.
    return (rows if rows == TOKENS else int(rows), int(cols))


class _Flattener:
    def __init__(self, inputs: Dict[str, torch.Tensor], tokens=None, foreign: Sequence[torch.Tensor] = ()):
        self.tokens = tokens
        self.by_id = {id(t): path for path, t in inputs.items() if t is not None}
        # foreign: the op's other inputs; tensors sharing their storage are cloned
        self.input_storages = {_storage(t) for t in list(inputs.values()) + list(foreign) if t is not None}
        self.fresh: List[torch.Tensor] = []
        self.originals: List[torch.Tensor] = []  # fresh[i] before any clone
        self.fresh_ids: Dict[int, int] = {}
        self.storages = set()
        self.whole_ids: Dict[int, int] = {}  # storage -> fresh index of the view spanning it

    def ref(self, t: torch.Tensor):
        path = self.by_id.get(id(t))
        if path is not None:
            return ("in", path)
        idx = self.fresh_ids.get(id(t))
        if idx is not None:
            return ("out", idx)
        st = _storage(t)
        if st not in self.input_storages:
            w = self.whole_ids.get(st)
            if w is None and st not in self.storages and _small_view(t):
                # A view into a small buffer lpmoe allocated (the offset
                # arrays of one launch): the whole buffer goes out once, as
                # a view spanning it (no copy), and the backward cuts the
                # views from it again; cloning each view would cost a launch.
                w = self._add(_whole(t), st)
                self.whole_ids[st] = w
            if w is not None and self.fresh[w].dtype == t.dtype:
                return ("view", w, tuple(t.shape), tuple(t.stride()), t.storage_offset())
        keep = t.clone() if (st in self.storages or st in self.input_storages) else t
        return ("out", self._add(keep, _storage(keep), t))

    def _add(self, keep: torch.Tensor, st: int, original: Optional[torch.Tensor] = None) -> int:
        self.storages.add(st)
        if original is not None:
            self.fresh_ids[id(original)] = len(self.fresh)
        self.fresh.append(keep)
        self.originals.append(keep if original is None else original)
        return len(self.fresh) - 1

    def entry(self, obj, want=None):
        if obj is None:
            return ("none",)
        if isinstance(obj, CachedWeight):
            return ("c",) + obj.static()
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
            return ("g", tuple(refs), meta_of(obj, _canonical_shape(obj, self.tokens)))
        raise TypeError(f"cannot save a {type(obj).__name__} for backward")


def flatten(key: str, objs: Sequence, inputs: Dict[str, torch.Tensor], fake: bool = False,
            tokens=None, foreign: Sequence[torch.Tensor] = ()) -> List[torch.Tensor]:
    """Fresh tensors of ``objs``; records (or follows) the layout under
    ``key``.  ``fake``: the call runs on fake tensors (tracing): no plan is
    recorded from it.  ``tokens``: the call's token count (an int, or a
    SymInt while tracing with dynamic shapes); token-row groups record it
    as TOKENS, and ``key`` must not contain it.  ``foreign``: inputs of the
    op that the layout must not refer to (anything sharing their storage is
    cloned)."""
    plan = _PLANS.get(key)
    if plan is not None and not fake:
        fresh = plan.gather(objs, inputs, tokens)
        if fresh is not None:
            CALLS["planned"] += 1
            return fresh
    CALLS["walked"] += 1
    known = LAYOUTS.get(key)
    fl = _Flattener(inputs, tokens, foreign)
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
    if not fake and plan is None:
        _PLANS[key] = _Plan(layout, objs, fl, tokens)
    return fl.fresh


def _static_of(g: GroupedTensor, tokens) -> tuple:
    # What a layout entry's meta_of encodes, compared without writing JSON (quantizers
    # carry their JSON from construction: lpmoe._value_fields).
    return (g.num_tensors, _canonical_shape(g, tokens), g.dtype, specs.encode(g.quantizer),
            g.with_gemm_swizzled_scales)


class _Plan:
    """A recorded flatten: per object, where each tensor goes.  Refs are
    (0, path) an op input, (1, clone) a new output (cloned when it shared
    storage on the recording call), (2, index) a tensor already taken,
    (3, buffer ref, shape, stride, offset) a view into a small buffer that
    goes out whole."""

    def __init__(self, layout: tuple, objs: Sequence, fl: _Flattener, tokens):
        cloned = [f is not t for f, t in zip(fl.fresh, fl.originals)]
        self._seen_new = set()
        self.steps = []
        for e, obj in zip(layout, objs):
            if e[0] in ("none", "c"):
                self.steps.append((e[0], e[1:], None))
            elif e[0] == "t":
                self.steps.append(("t", self._ref(e[1], cloned), None))
            elif e[0] == "l":
                self.steps.append(("l", tuple(self._ref(r, cloned) for r in e[1]), None))
            else:
                refs = tuple((f, self._ref(r, cloned)) for f, r in zip(FIELDS, e[1]) if r is not None)
                self.steps.append(("g", refs, _static_of(obj, tokens)))

    def _ref(self, r, cloned):
        if r[0] == "in":
            return (0, r[1])
        if r[0] == "view":
            return (3, self._ref(("out", r[1]), cloned), r[2], r[3], r[4])
        idx = r[1]
        if idx in self._seen_new:
            return (2, idx)
        self._seen_new.add(idx)
        return (1, cloned[idx])

    def gather(self, objs: Sequence, inputs: Dict[str, torch.Tensor], tokens) -> Optional[List[torch.Tensor]]:
        """The fresh tensors, or None where this call deviates from the plan."""
        if len(objs) != len(self.steps):
            return None
        fresh: List[torch.Tensor] = []
        originals: List[torch.Tensor] = []
        wholes: Dict[int, int] = {}  # storage -> fresh index of the view spanning it

        def take(t, ref) -> bool:
            kind, v = ref[0], ref[1]
            if t is None:
                return False
            if kind == 3:  # (3, buffer ref, shape, stride, offset)
                if tuple(t.shape) != ref[2] or t.stride() != ref[3] or t.storage_offset() != ref[4]:
                    return False
                st = _storage(t)
                if v[0] == 1:  # the buffer's first view: the whole buffer goes out
                    wholes[st] = len(fresh)
                    whole = _whole(t)
                    originals.append(whole)
                    fresh.append(whole)
                    return True
                return wholes.get(st) == v[1]
            if kind == 0:
                return t is inputs.get(v)
            if kind == 1:
                originals.append(t)
                fresh.append(t.clone() if v else t)
                return True
            return v < len(originals) and t is originals[v]

        for (kind, refs, static), obj in zip(self.steps, objs):
            if kind == "none":
                ok = obj is None
            elif kind == "c":
                ok = isinstance(obj, CachedWeight) and obj.static() == refs
            elif kind == "t":
                ok = isinstance(obj, torch.Tensor) and take(obj, refs)
            elif kind == "l":
                ok = isinstance(obj, (list, tuple)) and len(obj) == len(refs) and \
                    all(take(t, r) for t, r in zip(obj, refs))
            else:
                ok = isinstance(obj, GroupedTensor) and _static_of(obj, tokens) == static and \
                    all(take(getattr(obj, f), r) for f, r in refs)
            if not ok:
                return None
        return fresh


def _input_paths(layout) -> List[str]:
    paths: List[str] = []
    for e in layout:
        refs = () if e[0] in ("none", "c") else ((e[1],) if e[0] == "t" else e[1])
        for r in refs:
            if r is not None and r[0] == "in" and r[1] not in paths:
                paths.append(r[1])
    return paths


def _rebuild_plan(key: str) -> tuple:
    plan = _REBUILD.get(key)
    if plan is None:
        layout = LAYOUTS[key]
        paths = _input_paths(layout)
        where = {p: i for i, p in enumerate(paths)}

        def slot(r):  # index into inputs-then-fresh (+ the geometry of a view)
            if r is None:
                return None
            if r[0] == "view":  # (buffer slot, shape, stride, offset)
                return (len(paths) + r[1], r[2], r[3], r[4])
            return where[r[1]] if r[0] == "in" else len(paths) + r[1]
        steps = []
        for e in layout:
            if e[0] in ("none", "c"):
                steps.append((e[0], e[1:], None))
            elif e[0] == "t":
                steps.append(("t", slot(e[1]), None))
            elif e[0] == "l":
                steps.append(("l", tuple(slot(r) for r in e[1]), None))
            else:
                m = specs.parse(e[2])
                static = (m["n"], tuple(m["shape"]), specs.dtype_from_name(m["dtype"]), specs.decode(m["q"]), m["swz"])
                steps.append(("g", tuple((f, slot(r)) for f, r in zip(FIELDS, e[1]) if r is not None), static))
        plan = _REBUILD[key] = (paths, tuple(steps))
    return plan


def inputs_to_save(key: str, inputs: Dict[str, torch.Tensor]) -> Tuple[List[torch.Tensor], int]:
    """(the op inputs the backward reads, how many) in the layout's order."""
    paths = _rebuild_plan(key)[0]
    return [inputs[p] for p in paths], len(paths)


def stage_slots(key: str, objects: Sequence[int]) -> List[int]:
    """Positions, in ``inputs_to_save`` + the op's fresh tensors, of what
    the saved objects at indices ``objects`` read (ascending): a backward run
    in stages hands each stage only its tensors, so the rest can die."""
    _, steps = _rebuild_plan(key)
    slots = set()
    for i in objects:
        kind, ref, _ = steps[i]
        if kind in ("none", "c"):  # nothing saved (a cache reference reads no tensor)
            continue
        refs = (ref,) if kind == "t" else (ref if kind == "l" else [r for _, r in ref])
        slots.update(r if isinstance(r, int) else r[0] for r in refs if r is not None)
    return sorted(slots)


def rebuild(key: str, saved: Sequence[torch.Tensor], num_inputs: int, tokens: int,
            objects: Optional[Sequence[int]] = None) -> list:
    """The saved objects from ``inputs_to_save`` + the op's fresh tensors;
    ``tokens``: the call's token count (the rows of TOKENS groups).  With
    ``objects``: only the objects at those indices, ``saved`` holding only
    their :func:`stage_slots` (``num_inputs`` is then unused)."""
    paths, steps = _rebuild_plan(key)
    if objects is None:
        if num_inputs != len(paths):
            raise RuntimeError(f"lpmoe: {num_inputs} saved inputs, the layout has {len(paths)}; please report this")
        at = None
    else:
        at = {slot: pos for pos, slot in enumerate(stage_slots(key, objects))}
        if len(at) != len(saved):
            raise RuntimeError(f"lpmoe: {len(saved)} tensors for a stage that reads {len(at)}; please report this")
        steps = [steps[i] for i in objects]

    def get(i):
        if isinstance(i, int):
            return saved[i if at is None else at[i]]
        whole = saved[i[0] if at is None else at[i[0]]]
        return whole.as_strided(i[1], i[2], whole.storage_offset() + i[3])

    out = []
    for kind, ref, static in steps:
        if kind == "none":
            out.append(None)
        elif kind == "c":
            out.append(resolve(*ref))
        elif kind == "t":
            out.append(get(ref))
        elif kind == "l":
            out.append([get(i) for i in ref])
        else:
            n, (rows, cols), dtype, q, swz = static
            static = (n, (tokens if rows == TOKENS else rows, cols), dtype, q, swz)
            out.append(GroupedTensor._rebuild(static, {f: get(i) for f, i in ref}))
    return out
