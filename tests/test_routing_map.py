"""The routing map op (lpmoe::routing_map): on the GPU three kernels
(csrc/routing_map), elsewhere PyTorch ops.  The GPU kernels are compared
exactly with the PyTorch formulation (routing_map_torch) on the same
inputs; the CPU tests check the op's registration, compile and fallback."""
import importlib

import pytest
import torch
import torch._dynamo.testing
from torch.library import opcheck

from conftest import capture_graph, poison_allocator, requires_cuda
from lpmoe.moe import routing_map

# the module (lpmoe.moe's attribute of that name is the function)
rm_mod = importlib.import_module("lpmoe.moe.routing_map")


def _indices(tokens, k, experts, drop=0.1, seed=0, hot=None, dtype=torch.int64):
    """Random expert ids, some -1 (dropped) and some >= experts (out of
    range); ``hot`` sends that share of the slots to expert 0."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, experts, (tokens, k), generator=g)
    if hot:
        idx[torch.rand(idx.shape, generator=g) < hot] = 0
    r = torch.rand(idx.shape, generator=g)
    idx[r < drop] = -1
    idx[(r >= drop) & (r < drop * 1.2)] = experts + 3
    return idx.to(dtype)


def _torch_map(idx, experts, capacity, layout):
    return rm_mod.routing_map_torch(idx.reshape(-1), experts, capacity, layout == "padded")


def _check_same(idx, experts, capacity, layout):
    poison_allocator()  # before every call: an output element left unwritten shows up
    before = dict(rm_mod.CALLS)
    got = routing_map(idx, experts, capacity, layout)
    row_map, kept, used, dropped = _torch_map(idx, experts, capacity, layout)
    assert rm_mod.CALLS["kernel_routing_map"] == before["kernel_routing_map"] + 1
    assert torch.equal(got.row_map.view(-1), row_map), (idx.shape, experts, capacity, layout)
    assert torch.equal(got.m_splits, kept)
    assert torch.equal(got.dropped, dropped)
    if layout == "packed":
        assert torch.equal(got.used_rows, used)
    return got


def test_cpu_uses_pytorch_ops_and_the_op_is_registered():
    idx = _indices(40, 3, 6)
    before = dict(rm_mod.CALLS)
    rm = routing_map(idx, 6, 4)
    assert rm_mod.CALLS["torch_routing_map"] == before["torch_routing_map"] + 1
    assert rm_mod.CALLS["kernel_routing_map"] == before["kernel_routing_map"]
    assert rm.row_map.dtype == torch.int32 and rm.row_map.shape == (40, 3)
    for args in ((idx.reshape(-1), 6, -1, False), (idx.reshape(-1), 6, 5, True), (idx.reshape(-1).int(), 6, 0, False)):
        opcheck(torch.ops.lpmoe.routing_map, args)


def test_cpu_compiles_in_one_graph():
    idx = _indices(50, 2, 5)

    def f(i):
        rm = routing_map(i, 5, 7)
        return rm.row_map, rm.m_splits, rm.used_rows, rm.dropped

    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    got = torch.compile(f, fullgraph=True, backend=counter)(idx)
    for a, b in zip(got, f(idx)):
        assert torch.equal(a, b)
    assert counter.frame_count == 1


def test_padded_rows_must_fit_the_int32_map():
    with pytest.raises(ValueError, match="capacity"):
        routing_map(torch.zeros(3, 2, dtype=torch.int64), 1024, capacity=2 ** 22, layout="padded")


@requires_cuda
@pytest.mark.parametrize("tokens,k", [(0, 2), (1, 1), (31, 1), (33, 2), (255, 2), (257, 8), (4097, 8), (70001, 6)])
@pytest.mark.parametrize("experts", [1, 3, 64, 257, 1024])
def test_gpu_kernels_equal_pytorch_ops(tokens, k, experts):
    idx = _indices(tokens, k, experts, seed=tokens + experts).cuda()
    for capacity, layout in ((None, "packed"), (0, "packed"), (max(1, tokens * k // (2 * experts)), "packed"),
                             (tokens * k + 5, "packed"), (3, "padded"), (max(1, tokens * k // experts), "padded")):
        _check_same(idx, experts, capacity, layout)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_gpu_skewed_routing_and_index_dtypes(dtype):
    # 90 % of the slots on one expert: one hot bin per chunk, long runs of equal keys in a warp
    for tokens, experts in ((20000, 8), (3000, 512)):
        idx = _indices(tokens, 4, experts, hot=0.9, seed=1, dtype=dtype).cuda()
        for capacity, layout in ((None, "packed"), (100, "packed"), (50, "padded")):
            _check_same(idx, experts, capacity, layout)
    idx = torch.full((5, 3), -1, dtype=dtype, device="cuda")  # nothing routed
    rm = _check_same(idx, 4, None, "packed")
    assert (rm.row_map == -1).all() and int(rm.used_rows) == 0 and int(rm.dropped) == 0


@requires_cuda
def test_gpu_more_experts_than_the_kernel_takes_use_pytorch_ops():
    idx = _indices(100, 2, 2000).cuda()
    before = dict(rm_mod.CALLS)
    rm = routing_map(idx, 2000)
    assert rm_mod.CALLS["torch_routing_map"] == before["torch_routing_map"] + 1
    assert torch.equal(rm.row_map.view(-1), _torch_map(idx, 2000, None, "packed")[0])


@requires_cuda
def test_gpu_graph_replays_new_routing_without_sync():
    idx = torch.zeros(3000, 8, dtype=torch.int64, device="cuda")

    def step():
        rm = routing_map(idx, 64, 300)
        return rm.row_map, rm.m_splits, rm.used_rows, rm.dropped

    idx.copy_(_indices(3000, 8, 64, seed=1).cuda())
    before = dict(rm_mod.CALLS)
    torch.cuda.set_sync_debug_mode("error")
    try:
        graph, static = capture_graph(step)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert rm_mod.CALLS["kernel_routing_map"] == before["kernel_routing_map"] + 2  # warm-up and capture
    for seed in range(3):
        idx.copy_(_indices(3000, 8, 64, hot=0.3 * seed, seed=10 + seed).cuda())
        graph.replay()
        want = _torch_map(idx, 64, 300, "packed")
        for got, w in zip(static, want):
            assert torch.equal(got.view(-1), w.view(-1))


@requires_cuda
def test_gpu_compiled_routing_map_runs_the_kernel():
    idx = _indices(5000, 8, 64).cuda()

    def f(i):
        rm = routing_map(i, 64)
        return rm.row_map, rm.m_splits

    before = dict(rm_mod.CALLS)
    got = torch.compile(f, fullgraph=True)(idx)
    assert rm_mod.CALLS["kernel_routing_map"] > before["kernel_routing_map"]
    assert rm_mod.CALLS["torch_routing_map"] == before["torch_routing_map"]
    want = _torch_map(idx, 64, None, "packed")
    assert torch.equal(got[0].view(-1), want[0]) and torch.equal(got[1], want[1])
