"""Device buffers that outlive the call that makes them, made outside any
CUDA-graph memory pool.

lpmoe keeps a few buffers across calls and makes them on first use: a
layer's cached FP8 weights and their skip flag, the GEMM workspaces and the
address tables of weight lists.  ``torch.compile(mode="reduce-overhead")``
runs a function's first calls (its warm-up) with the calling thread's
allocations routed into the CUDA-graph tree's private pool.  A buffer made
there and kept after the call is a live allocation the tree does not track
as an output, and the tree refuses to record the next graph ("tensors in the
cudagraph pool not tracked as outputs"): a user's first reduce-overhead step
with ``is_first_microbatch`` True or False failed that way.

PyTorch's caching allocator routes allocations to a pool by thread (and by
stream in older releases), so :func:`persistent` runs the allocating
function on a short-lived helper thread, whose current stream is the
device's default stream: the memory comes from the ordinary pool whatever
pool the caller is allocating into (a ``torch.cuda.use_mem_pool`` block
included).  The buffers then belong to the default stream; when the caller
runs on another stream, that stream waits for the default one (the block
may have been freed there by work still queued) and the buffers are
recorded on it (so freeing them later waits for the caller's work).  Both
are stream-ordered, no host sync.

Inside CUDA graph capture the function runs on the calling thread (an
allocation there belongs to the graph's pool; lpmoe's callers make these
buffers before capture).  Meant for rare allocations: a thread start costs
~0.1 ms."""
from __future__ import annotations

import threading
from typing import Callable, List, TypeVar

import torch

__all__ = ["persistent"]

T = TypeVar("T")

#: allocations made through :func:`persistent` on a helper thread (tests)
CALLS = {"helper_thread": 0}


def _tensors_of(obj) -> List[torch.Tensor]:
    from lpmoe.grouped_tensor import GroupedTensor
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, GroupedTensor):
        return obj.flatten()[0]
    raise TypeError(f"persistent: the function must return a tensor or a GroupedTensor, got {type(obj).__name__}")


def persistent(make: Callable[[], T], device: torch.device) -> T:
    """``make()`` (which allocates and returns a tensor or GroupedTensor on
    ``device``) with its memory taken outside any CUDA-graph pool.  CPU
    devices, fake tensors (tracing) and CUDA graph capture call it
    directly."""
    from lpmoe.library.routing import tracing
    if device.type != "cuda" or tracing() or torch.cuda.is_current_stream_capturing():
        return make()
    index = device.index if device.index is not None else torch.cuda.current_device()
    result, error = [], []

    def run():
        try:
            with torch.cuda.device(index):
                result.append(make())
        except BaseException as e:  # re-raised on the calling thread
            error.append(e)

    helper = threading.Thread(target=run, name="lpmoe-persistent-alloc")
    helper.start()
    helper.join()
    if error:
        raise error[0]
    CALLS["helper_thread"] += 1
    out = result[0]
    caller, default = torch.cuda.current_stream(index), torch.cuda.default_stream(index)
    if caller != default:
        caller.wait_stream(default)
        for t in _tensors_of(out):
            t.record_stream(caller)
    return out
