import os
import sys

import pytest
import torch

# Running from a source checkout without installing: use python/ directly.
_HERE = os.path.dirname(os.path.abspath(__file__))
_SRC = os.path.join(os.path.dirname(_HERE), "python")
try:
    import lpmoe  # noqa: F401
except ImportError:
    sys.path.insert(0, _SRC)

HAS_CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


# Member sizes of the FP8 GEMM kernel tests: empty members, single rows and
# 128 +- 1 around the tile height, a skewed set, trailing empties, one member.
FP8_GEMM_SPLITS = {
    "edges": [0, 1, 127, 129, 0, 256, 3],
    "skewed": [1000, 1, 0, 23, 130],
    "empty_last": [64, 0, 0, 0],
    "single": [77],
}


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill a buffer with a recognisable byte pattern (0xA5 / NaN-ish) so
    elements a kernel failed to write show up in bitwise comparisons."""
    t.view(torch.uint8).fill_(0xA5)
    return t


def poison_allocator(large_bytes: int = 1 << 24) -> None:
    """Leave 0xFF bytes in the CUDA caching allocator's free blocks, so an
    output element a kernel fails to write shows up in a comparison.  Both
    pools: requests of 1 MiB or less are served from a separate small-block
    pool, which one large poisoned block never reaches."""
    held = [torch.empty(large_bytes, dtype=torch.uint8, device="cuda")]
    held += [torch.empty(n, dtype=torch.uint8, device="cuda")
             for n in (1 << 20, 1 << 18, 1 << 16, 1 << 14, 1 << 12, 1 << 10) for _ in range(4)]
    for t in held:
        t.fill_(0xFF)


def saved_storages(fn):
    """(fn(), {storage data_ptr: nbytes}): the distinct storages autograd
    saves for the backward while fn runs (a saved-tensor hook sees each)."""
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, seen


def capture_graph(step):
    """Warm ``step`` up on a side stream, then capture it in a CUDA graph;
    returns (graph, the outputs of the captured call)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out


def assert_replays_match_eager(step, m, routings, inputs):
    """Capture ``step`` (returning a tuple of tensors), then for each routing:
    write it into the device splits ``m``, refill ``inputs`` with new random
    values, replay, and require the captured outputs to equal an eager call
    bitwise (token-grouped 2-D outputs on their used rows, others whole).
    Returns (graph, captured outputs)."""
    graph, static = capture_graph(step)
    for splits in routings:
        m.copy_(torch.tensor(splits))
        for t in inputs:
            t.copy_(torch.randn_like(t))
        graph.replay()
        eager = step()
        used = sum(splits)
        for got, want in zip(static, eager):
            if got.dim() == 2:
                assert torch.equal(got[:used], want[:used])
            else:
                assert torch.equal(got, want)
    return graph, static


def load_example(name: str):
    """Import examples/<name>.py as a module (examples are scripts, not a package)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, os.path.join(os.path.dirname(_HERE), "examples",
                                                                     f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal (dtype included), except that any NaN equals any NaN:
    NaN payloads are not specified by the formats."""
    a, b = a.cpu(), b.cpu()
    nan = a.isnan()
    if a.dtype != b.dtype or not torch.equal(nan, b.isnan()):
        return False
    bits = {4: torch.int32, 2: torch.int16, 1: torch.uint8}[a.element_size()]
    return torch.equal(a[~nan].view(bits), b[~nan].view(bits))


def assert_written_then_poisoned(want: torch.Tensor, out: torch.Tensor, n: int) -> None:
    """out[:n] holds want's bits (same_bits; 0xA5A5 poison is a finite value,
    so an unwritten element differs) and out[n:], the capacity tail, still
    holds poison_'s 0xA5 bytes."""
    assert same_bits(want, out[:n])
    assert bool((out[n:].view(torch.uint8) == 0xA5).all())


def launches_since(before, after) -> tuple:
    """Per-kernel launch counts between two readings of a counter tuple."""
    return tuple(a - b for a, b in zip(after, before))


def only(kernel: int, kinds: int) -> tuple:
    """The launch-count delta of one launch of `kernel` among `kinds` kernels."""
    return tuple(int(i == kernel) for i in range(kinds))
