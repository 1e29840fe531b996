"""Buffers lpmoe keeps across calls (weight caches and their skip flags, GEMM
workspaces, weight address tables) are made outside any CUDA-graph memory
pool (lpmoe._persistent): torch.compile(mode="reduce-overhead") may make
them in its warm-up, whose allocations go to the graph tree's pool, and the
tree refuses to record when a live allocation there is not an output.

CPU: the buffers group_quantize_buffers makes give group_quantize's bits.
GPU: the helper thread's memory escapes a pool the caller allocates into;
a user's first steps under reduce-overhead with is_first_microbatch True /
False (and with the GEMM workspaces made inside the warm-up) run and equal
eager; lpmoe.optim.AdamW's FP8 weights reach captured False calls."""
import copy

import pytest
import torch

import lpmoe
from lpmoe import _persistent
from lpmoe.quantize import group_quantize, group_quantize_buffers
from conftest import requires_cuda, poison_

FORMATS = [lpmoe.Float8BlockQuantizer(block_dim=2), lpmoe.Float8BlockQuantizer(block_dim=1),
           lpmoe.MXFP8Quantizer(), lpmoe.NVFP4Quantizer()]


def _devices():
    return ["cpu", pytest.param("cuda", id="gpu", marks=requires_cuda)]


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("q", FORMATS, ids=lambda q: type(q).__name__ + str(getattr(q, "block_dim", "")))
@pytest.mark.parametrize("n", [128, 208])  # whole and partial 128-row blocks per member (NVFP4: 16s)
def test_group_quantize_buffers_give_group_quantize_bits(device, q, n):
    g, k = 3, 256
    x = torch.randn(g * n, k, generator=torch.Generator().manual_seed(n)).to(device, torch.bfloat16)
    x[5, :7] = 0
    ref = group_quantize(x, q, num_tensors=g)
    out = group_quantize_buffers(x, q, g)
    for t in out.flatten()[0]:
        if t.is_floating_point() or t.dtype == torch.uint8:
            poison_(t)
    got = group_quantize(x, q, num_tensors=g, output=out)
    assert got is out
    (rt, rmeta), (gt, gmeta) = ref.flatten(), got.flatten()
    assert rmeta[0] == gmeta[0]  # the same buffers exist
    for name, a, b in zip(rmeta[0], rt, gt):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                           b.view(torch.uint8) if b.element_size() == 1 else b), name


def test_persistent_runs_make_directly_on_the_cpu():
    before = _persistent.CALLS["helper_thread"]
    t = _persistent.persistent(lambda: torch.zeros(3), torch.device("cpu"))
    assert torch.equal(t, torch.zeros(3)) and _persistent.CALLS["helper_thread"] == before


def _pool_of(ptr: int):
    for seg in torch.cuda.memory._snapshot()["segments"]:
        if seg["address"] <= ptr < seg["address"] + seg["total_size"]:
            return tuple(seg["segment_pool_id"])
    raise AssertionError("address not in any segment")


@requires_cuda
def test_persistent_memory_escapes_a_pool_the_caller_allocates_into():
    pool = torch.cuda.MemPool()
    before = _persistent.CALLS["helper_thread"]
    side = torch.cuda.Stream()
    with torch.cuda.use_mem_pool(pool), torch.cuda.stream(side):
        routed = torch.empty(1 << 22, dtype=torch.uint8, device="cuda")
        kept = _persistent.persistent(lambda: torch.empty(1 << 22, dtype=torch.uint8, device="cuda"),
                                      torch.device("cuda"))
        kept.fill_(7)  # on the side stream: ordered after the default stream's earlier work
    torch.cuda.synchronize()
    assert _persistent.CALLS["helper_thread"] == before + 1
    assert _pool_of(routed.data_ptr()) == tuple(pool.id)
    assert _pool_of(kept.data_ptr()) != tuple(pool.id)
    assert int(kept[-1]) == 7
    del routed


@requires_cuda
def test_persistent_errors_on_the_helper_thread_reach_the_caller():
    with pytest.raises(RuntimeError):
        _persistent.persistent(lambda: torch.empty(-1, device="cuda"), torch.device("cuda"))


def _fresh_persistent_buffers(monkeypatch):
    """Forget the GEMM workspaces and address tables made so far (the old
    ones stay alive in the dicts restored after the test), so the compiled
    calls below make theirs inside the reduce-overhead warm-up."""
    from lpmoe.gemm import weight_operands, workspaces
    monkeypatch.setattr(workspaces, "_workspaces", {})
    monkeypatch.setattr(workspaces, "_setups", {})
    monkeypatch.setattr(weight_operands, "_ptr_tables", {})


@requires_cuda
@pytest.mark.parametrize("kind", ["mlp", "linear"])
@pytest.mark.parametrize("stacked", [False, True], ids=["per_expert", "stacked"])
def test_reduce_overhead_with_is_first_microbatch_from_the_first_step(monkeypatch, kind, stacked):
    """Micro-batches with is_first_microbatch True then False under
    reduce-overhead, as a process's first compiled calls: the weight
    caches, skip flags and workspaces are made in the warm-up, outside the
    tree's pool; every micro-batch equals an eager twin bitwise, new routing
    each time, and the weights change between steps."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    cls = lpmoe.GroupedMLP if kind == "mlp" else lpmoe.GroupedLinear
    m = cls(4, 256, 128, params_dtype=torch.bfloat16, device="cuda", single_grouped_parameter=stacked)
    e = copy.deepcopy(m)
    _fresh_persistent_buffers(monkeypatch)
    c = torch.compile(m, mode="reduce-overhead", fullgraph=True)
    recipe = lpmoe.recipe.Float8BlockScaling()
    before = _persistent.CALLS["helper_thread"]
    gen = torch.Generator().manual_seed(1)
    splits = torch.zeros(4, dtype=torch.int64, device="cuda")
    for step in range(4):
        for mb in range(2):
            splits.copy_(torch.randperm(4, generator=gen) * 40 + 10)  # new routing, same graph
            x = torch.randn(300, 256, generator=gen).to("cuda", torch.bfloat16)
            outs = []
            for module in (c, e):
                torch.compiler.cudagraph_mark_step_begin()
                xi = x.clone().requires_grad_(True)
                with lpmoe.autocast(recipe=recipe):
                    y = module(xi, splits, is_first_microbatch=mb == 0)
                y.float().square().sum().backward()
                outs.append((y.detach().clone(), xi.grad.clone(),
                             [p.grad.clone() for p in (m if module is c else e).parameters()]))
                (m if module is c else e).zero_grad(set_to_none=True)  # no .grad accumulation across replays
            (yc, dxc, gc), (ye, dxe, ge) = outs
            assert torch.equal(yc, ye) and torch.equal(dxc, dxe), (step, mb)
            assert all(torch.equal(a, b) for a, b in zip(gc, ge)), (step, mb)
        with torch.no_grad():  # new weights: the next step's True call must requantize
            for p, q in zip(m.parameters(), e.parameters()):
                p.add_(0.01 * torch.sign(p))
                q.copy_(p)
    assert _persistent.CALLS["helper_thread"] > before  # the warm-up made its buffers through the helper


@requires_cuda
def test_reduce_overhead_false_calls_read_the_optimizers_weights():
    """Captured is_first_microbatch=False calls read the weight cache, which
    lpmoe.optim.AdamW rewrites in place each step: every step equals a twin
    that quantizes its weights in the forward."""
    from test_optim_compile import _run
    from _optim_common import _mlp
    torch._dynamo.reset()
    a = _mlp("cuda")
    before = lpmoe.optim.stats()["fused"]
    _run(a, 4, "cuda", mode="reduce-overhead", first=False)
    assert lpmoe.optim.stats()["fused"] - before == 2 * 2 * 4


@pytest.mark.parametrize("device", _devices())
def test_a_refreshed_cache_keeps_its_own_buffers_and_offsets(device):
    """is_first_microbatch=True quantizes into the cache in place: the data,
    the scales and the offsets stay the cache's own objects (a refresh that
    took the call's offsets would keep memory of the call, in a CUDA-graph
    pool when the call is a reduce-overhead warm-up or a capture)."""
    torch.manual_seed(0)
    lin = lpmoe.GroupedLinear(4, 256, 128, params_dtype=torch.bfloat16, device=device)
    s = torch.tensor([10, 50, 0, 40], device=device)
    x = torch.randn(100, 256, device=device, dtype=torch.bfloat16)
    names = ("rowwise_data", "columnwise_data", "scale_inv", "columnwise_scale_inv", "tensor_offsets",
             "padded_row_offsets", "offsets_status")
    with lpmoe.autocast(recipe=lpmoe.recipe.Float8BlockScaling()):
        lin(x, s, is_first_microbatch=True)
        q = lin.weight_cache.quantized
        before = {n: getattr(q, n) for n in names}
        with torch.no_grad():
            lin.weight0.mul_(2)
        lin(x, s, is_first_microbatch=True)
    assert lin.weight_cache.quantized is q
    for n in names:
        assert getattr(q, n) is before[n], n
    fresh = group_quantize(torch.cat([w.detach() for w in lin.weights]), q.quantizer, num_tensors=4)
    assert torch.equal(fresh.rowwise_data.view(torch.uint8), q.rowwise_data.view(torch.uint8))  # refreshed
