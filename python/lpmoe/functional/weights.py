"""Where a layer's weight operand comes from: the parameters (cast to the
compute dtype under torch.autocast), quantized per call or cached across
micro-batches (``is_first_microbatch``).  A recipe quantizes the parameters
in their own dtype: an fp32 weight goes to FP8 in one rounding."""
from __future__ import annotations

import itertools
import weakref
from typing import Dict, Optional, Sequence, Tuple

import torch

from lpmoe._persistent import persistent
from lpmoe.functional.params import shape_of
from lpmoe.grouped_tensor import GroupedTensor
from lpmoe.library.routing import tracing
from lpmoe.quantize import group_quantize, group_quantize_buffers

__all__ = ["WeightCache", "WeightSource", "stack_weights", "cache_in_use", "register_optimizer_cache",
           "optimizer_cache_of", "quantize_new_cache"]


_cache_counter = itertools.count(1)
_caches_by_key: "weakref.WeakValueDictionary[int, WeightCache]" = weakref.WeakValueDictionary()


def cache_by_key(key: int) -> Optional["WeightCache"]:
    """The live WeightCache named ``key`` (None if it was freed or key < 0)."""
    return _caches_by_key.get(key) if key >= 0 else None


# The caches lpmoe.optim.AdamW writes, by the address of their layer's first
# weight: a compiled layer op called with is_first_microbatch=None carries
# no cache key (identical layers share one graph), so it finds the cache of
# the weights it was given when it runs, as an eager call reads its layer's.
_optimizer_caches: Dict[int, tuple] = {}


def register_optimizer_cache(cache: "WeightCache", params) -> None:
    """``cache`` is written by an optimizer for the weights ``params`` (the
    layer's list, or its stacked tensor).  The entry goes when the cache
    does (or when a lookup finds a weight gone)."""
    ps = [params] if isinstance(params, torch.Tensor) else list(params)
    addr = ps[0].data_ptr()

    def gone(ref, addr=addr):
        entry = _optimizer_caches.get(addr)
        if entry is not None and entry[0] is ref:
            _optimizer_caches.pop(addr, None)
    _optimizer_caches[addr] = (weakref.ref(cache, gone), tuple(weakref.ref(p) for p in ps))


def optimizer_cache_of(weights: Sequence[torch.Tensor]) -> Optional["WeightCache"]:
    """The optimizer-written cache of exactly these weights (the layer's own
    tensors, or views of them at the same addresses, as a compiled graph may
    pass them), or None: while tracing, inside CUDA graph capture (a
    captured read could not be checked at replay), or for other tensors."""
    if tracing() or not weights:
        return None
    w0 = weights[0]
    if w0.is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    entry = _optimizer_caches.get(w0.data_ptr())
    if entry is None:
        return None
    cache, ps = entry[0](), [r() for r in entry[1]]
    if cache is None or any(p is None for p in ps):
        if _optimizer_caches.get(w0.data_ptr()) is entry:
            _optimizer_caches.pop(w0.data_ptr(), None)  # a freed layer; its address may be reused
        return None
    # the same elements in the same order: address, shape, strides (not a
    # transposed view of a square weight), dtype
    if len(ps) != len(weights) or any(p.data_ptr() != w.data_ptr() or p.shape != w.shape or p.stride() != w.stride()
                                      or p.dtype != w.dtype for p, w in zip(ps, weights)):
        return None
    return cache


class WeightCache:
    """FP8 weights of one layer, quantized once and reused across micro-batches.

    ``is_first_microbatch`` (see :func:`grouped_linear`) decides when the
    cache is refreshed.  Inside CUDA graph capture the refresh is recorded as
    an in-place quantization into the cached buffers, gated by
    :attr:`skip_flag`: set it with :meth:`set_skip_update` between replays
    to reuse the cached weights (e.g. later micro-batches of a step).
    """

    def __init__(self):
        #: integer name of this cache (the compiled layer ops carry it; lookup with cache_by_key)
        self.key = next(_cache_counter)
        _caches_by_key[self.key] = self
        self.quantized: Optional[GroupedTensor] = None
        #: float32 device tensor read by the quantize kernel (1.0 = skip writing)
        self.skip_flag: Optional[torch.Tensor] = None
        #: the weights :attr:`quantized` was made from: (address, version
        #: counter) of each parameter when it was written (see :meth:`holds`)
        self.source: Optional[tuple] = None
        #: the quantizer the layer's last eager call asked for: what an
        #: optimizer that writes this cache (lpmoe.optim.AdamW) produces
        self.wanted = None
        #: eager calls that read :attr:`quantized` without quantizing
        self.hits = 0
        #: versions of :attr:`quantized`'s buffers when a compiled layer's
        #: forward last read it (lpmoe.library.cached_weights)
        self.forward_versions: Optional[tuple] = None

    def __deepcopy__(self, memo) -> "WeightCache":
        # A copied layer gets its own, empty cache (and its own key): the
        # cached FP8 weights are derived data, refreshed on the next
        # is_first_microbatch=True call.
        return WeightCache()

    def __reduce__(self):
        return (WeightCache, ())

    def clear(self) -> None:
        self.quantized = None
        self.skip_flag = None
        self.source = None
        self.wanted = None
        self.forward_versions = None

    def record(self, params) -> None:
        """:attr:`quantized` now holds ``params`` as they are: what
        lpmoe.optim.AdamW calls after writing it.  Until the weights change,
        default calls (``is_first_microbatch=None``) read it, eager or
        compiled (:func:`optimizer_cache_of`)."""
        self.source = None if tracing() else _source_key(params)
        if self.source is not None:
            register_optimizer_cache(self, params)

    def holds(self, params) -> bool:
        """:attr:`record` was called for ``params`` and no in-place change
        reached them since, as far as PyTorch's version counters tell (every
        in-place op through PyTorch bumps them: an optimizer step,
        ``load_state_dict``, ``copy_``; writes through ``.data`` or by a
        foreign kernel do not: call :meth:`clear` after such a change).  A
        host check, no sync."""
        return self.source is not None and not tracing() and self.source == _source_key(params)

    def set_skip_update(self, skip: bool) -> None:
        """Make captured graphs keep (True) or refresh (False) the cached
        weights on their next replays.  Call outside capture."""
        if self.skip_flag is None:
            raise RuntimeError("the weight cache has no skip flag yet: run one eager forward with "
                               "is_first_microbatch True or False first")
        self.skip_flag.fill_(1.0 if skip else 0.0)

    def usable_for(self, quantizer, num: int, shape: Tuple[int, int], dtype, device) -> bool:
        """The cached tensor holds this format, shape and (at least) these directions."""
        q = self.quantized
        if q is None:
            return False
        cq = q.quantizer
        same_format = cq.copy(rowwise=True, columnwise=True) == quantizer.copy(rowwise=True, columnwise=True)
        directions = (cq.rowwise or not quantizer.rowwise) and (cq.columnwise or not quantizer.columnwise)
        return (same_format and directions and q.num_tensors == num and q.logical_shape == shape
                and q.dtype == dtype and q.device == device)

    def _flag(self, device: torch.device) -> Optional[torch.Tensor]:
        # Made eagerly (never inside capture, where the zero fill would be
        # recorded and undo set_skip_update on every replay), outside any
        # CUDA-graph pool (a reduce-overhead warm-up's, lpmoe._persistent).
        if self.skip_flag is None or self.skip_flag.device != device:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                return None
            self.skip_flag = persistent(lambda: torch.zeros(1, dtype=torch.float32, device=device), device)
        return self.skip_flag


def _source_key(params) -> Optional[tuple]:
    """(address, version) of each parameter; None for tensors without a
    version counter (inference tensors), which are never trusted."""
    try:
        if isinstance(params, torch.Tensor):
            return ((params.data_ptr(), params._version),)
        return tuple((p.data_ptr(), p._version) for p in params)
    except RuntimeError:
        return None


def cache_in_use(cache: Optional["WeightCache"], is_first_microbatch: Optional[bool]) -> bool:
    """Whether a call's quantized weights come from (and stay in) ``cache``:
    only ``is_first_microbatch`` True or False uses one (:func:`_quantized_weights`)."""
    return cache is not None and is_first_microbatch is not None


def stack_weights(weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """(G*N, K) weights: the same-shape group layout quantizers take.  A view
    when the weights already sit back to back in one buffer (GroupedLinear's
    parameters do), else a copy."""
    w0 = weights[0]
    n, k = w0.shape
    step = n * k * w0.element_size()
    if tracing():  # fake tensors have no addresses (shape propagation of the compiled layer ops)
        return torch.stack(list(weights)).view(len(weights) * n, k)
    ptr0 = w0.data_ptr()
    if all(w.is_contiguous() and w.data_ptr() == ptr0 + i * step for i, w in enumerate(weights)):
        # Back to back from w0 on and all inside w0's storage (one storage
        # query instead of one per weight): the view reads exactly them.
        if w0.storage_offset() * w0.element_size() + len(weights) * step <= w0.untyped_storage().nbytes():
            return w0.detach().as_strided((len(weights) * n, k), (k, 1))
    return torch.stack(list(weights)).view(len(weights) * n, k)


def _quantized_weights(src: "WeightSource", quantizer, capturing: bool) -> GroupedTensor:
    """Quantize ``src``'s weights per ``is_first_microbatch`` semantics:
    None = quantize now, no caching, except that an eager call reads a
    cache lpmoe.optim.AdamW wrote for exactly these weights in this format
    (:meth:`WeightCache.holds`), the same bits without quantizing; True =
    quantize into the cache; False = reuse the cache as it is
    (TransformerEngine's meaning: nothing is checked, so weights
    re-gathered into the same buffers every micro-batch keep their cache),
    quantizing into it if it is missing or unfit.  Caches written by True /
    False calls are not read by None calls (their writers need not be
    seen by version counters).  Inside CUDA graph capture nothing is
    checked on the host: False reads the cache as it is at replay, anything
    else quantizes (into the cache, with a skip flag for replays).
    The (G*N, K) operand is made only when something is quantized: reusing
    the cache stacks nothing (a copy, for weights not back to back)."""
    cache, first = src.cache, src.is_first_microbatch
    g, n, k = src.shape
    if cache is None:
        return group_quantize(src.stacked(), quantizer, num_tensors=g)
    fit = cache.usable_for(quantizer, g, (g * n, k), src.dtype, src.device)
    if capturing:
        if first is False and fit:
            return cache.quantized  # the graph reads whatever the cache holds at replay
        if fit:  # refresh in place (fixed pointers), skippable at replay time
            _quantize_into(cache.quantized, src.stacked(), g, noop_flag=cache._flag(src.device))
            cache.source = None  # written at replay time, from whatever the weights are then
            return cache.quantized
        cache.quantized = group_quantize(src.stacked(), quantizer, num_tensors=g)
        cache.source = None
        return cache.quantized
    if first is not None:
        # exists before any capture.  (Not for default calls, which never
        # use it: a compiled one may run in a CUDA-graph tree's warm-up, whose
        # pool must hold nothing but the outputs.)
        cache._flag(src.device)
    if not tracing():
        cache.wanted = quantizer
    if fit and (first is False or (first is None and cache.holds(src.params))):
        cache.hits += 1
        return cache.quantized
    if first is None:
        return group_quantize(src.stacked(), quantizer, num_tensors=g)
    if fit:  # in place: pointers stay stable for graphs captured later
        out = _quantize_into(cache.quantized, src.stacked(), g)
    else:
        out = cache.quantized = quantize_new_cache(src.stacked(), quantizer, g)
    cache.source = None  # only the optimizer's writes serve default calls
    return out


def quantize_new_cache(x: torch.Tensor, quantizer, g: int) -> GroupedTensor:
    """A cache's first quantization, into buffers that outlive the call and
    so are made outside any CUDA-graph pool: this call may be a
    reduce-overhead warm-up (lpmoe._persistent).  ``x``: the (G*N, K)
    stacked weights."""
    out = persistent(lambda: group_quantize_buffers(x, quantizer, g), x.device)
    return _quantize_into(out, x, g)


_METADATA = ("first_dims", "last_dims", "tensor_offsets", "padded_row_offsets", "offsets_status")


def _quantize_into(cached: GroupedTensor, x: torch.Tensor, g: int, noop_flag=None) -> GroupedTensor:
    """``x`` quantized into a cache's buffers in place, the cache keeping
    its own offsets: ``output=`` would hand it the input group's, which
    this call makes (in a reduce-overhead warm-up or a captured graph, in
    the graph's pool) and which would then outlive the call.  Equal members:
    the values are the same."""
    kept = [getattr(cached, f) for f in _METADATA]
    group_quantize(x, cached.quantizer, num_tensors=g, output=cached, noop_flag=noop_flag)
    for f, t in zip(_METADATA, kept):
        setattr(cached, f, t)
    return cached


class WeightSource:
    """The weights of one layer call (G tensors (N, K) or one stacked
    (G, N, K) tensor, see lpmoe.functional.params) and how to quantize them
    (:func:`_quantized_weights` semantics for ``is_first_microbatch``)."""

    def __init__(self, params, cache: Optional[WeightCache], is_first_microbatch: Optional[bool],
                 grad_enabled: bool, compute_dtype: Optional[torch.dtype] = None):
        #: what the backward saves: the list, or the stacked tensor
        self.params = params if isinstance(params, torch.Tensor) else list(params)
        #: the dtype a high-precision GEMM reads them in (default: theirs;
        #: another under torch.autocast, lpmoe.functional.precision)
        self.compute_dtype = self._first.dtype if compute_dtype is None else compute_dtype
        self.cache = cache
        self.is_first_microbatch = is_first_microbatch
        self.grad_enabled = grad_enabled

    @property
    def shape(self) -> Tuple[int, int, int]:
        return shape_of(self.params)

    @property
    def _first(self) -> torch.Tensor:
        return self.params if isinstance(self.params, torch.Tensor) else self.params[0]

    @property
    def dtype(self) -> torch.dtype:
        return self._first.dtype

    @property
    def device(self) -> torch.device:
        return self._first.device

    def operand(self):
        """The weights as a high-precision GEMM reads them: the parameters,
        or one stacked cast to :attr:`compute_dtype` (made per call; never
        cached across calls)."""
        from lpmoe.functional.precision import as_compute
        return as_compute(self.params, self.compute_dtype)

    def quantized(self, quantizer) -> GroupedTensor:
        capturing = self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        return _quantized_weights(self, quantizer, capturing)

    def stacked(self) -> torch.Tensor:
        """(G*N, K): a view of a stacked weight, else :func:`stack_weights`."""
        if isinstance(self.params, torch.Tensor):
            g, n, k = self.params.shape
            return self.params.detach().view(g * n, k)
        return stack_weights(self.params)
