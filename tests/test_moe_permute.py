"""Token permutation (lpmoe.moe.permute / unpermute / routing_map): CPU
against plain-PyTorch loops; GPU kernels bit-exact against the reference,
graph capture with new routing per replay, no host syncs."""
import pytest
import torch
from torch.library import opcheck

from conftest import poison_allocator, requires_cuda
from lpmoe.moe import kernels, permute, permute_fp8, permute_probs, permute_rows, routing_map, unpermute
from lpmoe.reference import permute as ref

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _indices(tokens, k, experts, drop=0.1, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)]) if tokens else \
        torch.empty(0, k, dtype=torch.int64)
    idx[torch.rand(idx.shape, generator=g) < drop] = -1
    return idx.to(device)


def _loop_map(idx, experts, capacity=None, padded=False):
    """Row of each slot by the definition: experts in order, slots in token
    order within an expert, the first `capacity` kept."""
    t, k = idx.shape
    per_expert = [[] for _ in range(experts)]
    for ti in range(t):
        for j in range(k):
            e = int(idx[ti, j])
            if 0 <= e < experts:
                per_expert[e].append((ti, j))
    row_map = torch.full((t, k), -1, dtype=torch.int32)
    kept, row, dropped = [], 0, 0
    for e, slots in enumerate(per_expert):
        keep = slots if capacity is None else slots[:capacity]
        dropped += len(slots) - len(keep)
        for r, (ti, j) in enumerate(keep):
            row_map[ti, j] = (e * capacity + r) if padded else row + r
        row += len(keep)
        kept.append(len(keep))
    return row_map, kept, dropped


@pytest.mark.parametrize("capacity,padded", [(None, False), (3, False), (2, True), (0, False)])
def test_routing_map_matches_loop(capacity, padded):
    idx = _indices(37, 3, 6, drop=0.15)
    rm = routing_map(idx, 6, capacity, "padded" if padded else "packed")
    want, kept, dropped = _loop_map(idx, 6, capacity, padded)
    assert torch.equal(rm.row_map, want)
    assert rm.m_splits.tolist() == kept and int(rm.dropped) == dropped
    assert rm.num_rows == (6 * capacity if padded else min(37 * 3, 6 * capacity if capacity is not None else 10 ** 9))
    assert (rm.used_rows is None) == padded
    if not padded:
        assert int(rm.used_rows) == sum(kept)


def test_routing_map_edge_cases():
    rm = routing_map(torch.empty(0, 2, dtype=torch.int64), 4)
    assert rm.row_map.shape == (0, 2) and rm.m_splits.tolist() == [0] * 4
    rm = routing_map(torch.full((5, 2), -1), 4)                      # everything dropped
    assert (rm.row_map == -1).all() and int(rm.used_rows) == 0
    rm = routing_map(torch.tensor([3, 0, 3, 9]), 4)                   # (T,) = k 1; 9 is out of range
    assert rm.row_map.view(-1).tolist() == [1, 0, 2, -1]


def test_routing_map_rejects_bad_input():
    with pytest.raises(TypeError, match="topk_indices"):
        routing_map(torch.zeros(3, 2), 4)
    with pytest.raises(ValueError, match="num_experts"):
        routing_map(torch.zeros(3, 2, dtype=torch.int64), 0)
    with pytest.raises(ValueError, match="capacity"):
        routing_map(torch.zeros(3, 2, dtype=torch.int64), 4, capacity=-1)
    with pytest.raises(ValueError, match="layout"):
        routing_map(torch.zeros(3, 2, dtype=torch.int64), 4, layout="padded")


def _loop_permute(x, row_map, rows):
    out = torch.zeros(rows, x.shape[1], dtype=x.dtype)
    for t in range(row_map.shape[0]):
        for j in range(row_map.shape[1]):
            if row_map[t, j] >= 0:
                out[row_map[t, j]] = x[t]
    return out


def _loop_unpermute(y, row_map, probs):
    out = torch.zeros(row_map.shape[0], y.shape[1], dtype=torch.float32)
    for t in range(row_map.shape[0]):
        for j in range(row_map.shape[1]):
            if row_map[t, j] >= 0:
                out[t] += probs[t, j] * y[row_map[t, j]].float()
    return out.to(y.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("capacity", [None, 2])
def test_permute_unpermute_cpu_values_and_grads(dtype, capacity):
    idx = _indices(23, 3, 5, drop=0.2, seed=1)
    x = torch.randn(23, 24, dtype=dtype, requires_grad=True)
    probs = torch.rand(23, 3, requires_grad=True)
    before = dict(kernels.CALLS)
    xg, m, rm = permute(x, idx, 5, capacity)
    assert torch.equal(xg, _loop_permute(x.detach(), rm.row_map, rm.num_rows))
    y = unpermute(xg, rm, probs)
    assert torch.equal(y, _loop_unpermute(xg.detach(), rm.row_map, probs.detach()))
    assert kernels.CALLS["reference_scatter"] > before["reference_scatter"]
    gy = torch.randn_like(y)
    y.backward(gy)
    # d x[t] = sum_j probs[t, j] * gy[t] over kept slots; d probs[t, j] = <gy[t], x[t]> if kept
    kept = (rm.row_map >= 0).float()
    gxg = torch.zeros(rm.num_rows, 24)
    for t in range(23):
        for j in range(3):
            if rm.row_map[t, j] >= 0:
                gxg[rm.row_map[t, j]] = (gy[t].float() * probs[t, j].detach()).to(dtype).float()
    want_dx = torch.zeros(23, 24)
    for j in range(3):
        want_dx += torch.where(rm.row_map[:, j:j + 1] >= 0, gxg[rm.row_map[:, j].long().clamp(0)], 0.0)
    assert torch.allclose(x.grad.float(), want_dx, rtol=1e-2, atol=1e-2)
    want_dp = (gy.float().unsqueeze(1) * x.detach().float().unsqueeze(1)).sum(-1) * kept
    assert torch.allclose(probs.grad, want_dp, rtol=1e-3, atol=1e-3)


def test_unpermute_accepts_a_bare_row_map():
    idx = _indices(9, 2, 4, seed=2)
    x = torch.randn(9, 8, requires_grad=True)
    xg, _, rm = permute(x, idx, 4)
    y1 = unpermute(xg, rm.row_map)
    y2 = unpermute(xg, rm)
    assert torch.equal(y1, y2)
    (g,) = torch.autograd.grad(y1.sum(), xg)
    assert torch.equal(g[int(rm.used_rows):], torch.zeros_like(g[int(rm.used_rows):]))


def _loop_probs(probs, rm):
    want = torch.zeros(rm.num_rows)
    for t in range(probs.shape[0]):
        for j in range(probs.shape[1]):
            if rm.row_map[t, j] >= 0:
                want[rm.row_map[t, j]] = probs[t, j].float()
    return want


def _check_permute_probs(idx, experts, capacity, layout, device):
    rm = routing_map(idx.to(device), experts, capacity, layout)
    probs = torch.rand(idx.shape, device=device).requires_grad_()
    pg = permute_probs(probs, rm)
    rm_cpu = routing_map(idx.cpu(), experts, capacity, layout)
    assert torch.equal(pg.detach().cpu(), _loop_probs(probs.detach().cpu(), rm_cpu))
    g = torch.randn(rm.num_rows, device=device)
    pg.backward(g)
    want = torch.where(rm_cpu.row_map >= 0, g.cpu()[rm_cpu.row_map.clamp(min=0).long()], 0.0)
    assert torch.equal(probs.grad.cpu(), want)


def test_permute_probs_and_fp8_rows():
    idx = _indices(11, 2, 4, drop=0.2, seed=3)
    rm = routing_map(idx, 4)
    for capacity, layout in ((None, "packed"), (2, "packed"), (3, "padded")):
        _check_permute_probs(idx, 4, capacity, layout, "cpu")
    data = torch.randn(11, 256).to(torch.float8_e4m3fn)
    scale = torch.rand(11, 2)
    d, s = permute_fp8(data, scale, rm)
    assert torch.equal(d.view(torch.uint8), _loop_permute(data.view(torch.uint8), rm.row_map, rm.num_rows))
    assert torch.equal(s, _loop_permute(scale, rm.row_map, rm.num_rows))


def test_permute_rejects_bad_input():
    idx = _indices(4, 2, 4)
    rm = routing_map(idx, 4)
    with pytest.raises(ValueError, match="tokens"):
        permute_rows(torch.randn(5, 8), rm)
    with pytest.raises(TypeError, match="x must be"):
        permute_rows(torch.zeros(4, 8, dtype=torch.int32), rm)
    with pytest.raises(ValueError, match="probs"):
        unpermute(torch.randn(8, 8), rm, torch.rand(4, 3))
    with pytest.raises(ValueError, match="row_map"):
        kernels.gather(torch.randn(8, 8), rm.row_map.long())
    with pytest.raises(TypeError, match="1-byte"):
        permute_fp8(torch.randn(4, 8), torch.rand(4, 1), rm)


def test_permute_ops_opcheck_and_compile():
    idx = _indices(7, 2, 4, drop=0.2, seed=4)
    rm = routing_map(idx, 4)
    x = torch.randn(7, 16)
    scale = torch.rand(7, 2)
    opcheck(torch.ops.lpmoe.permute_scatter, (x, rm.row_map, rm.num_rows, scale, rm.used_rows, None))
    opcheck(torch.ops.lpmoe.permute_scatter,
            (x, rm.row_map, rm.num_rows, scale, None, torch.randn(rm.num_rows, 16)))
    opcheck(torch.ops.lpmoe.permute_gather, (torch.randn(rm.num_rows, 16), rm.row_map, scale))

    def step(x, idx, probs):
        xg, _, rm = permute(x, idx, 4)
        return unpermute(xg * 2, rm, probs)

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    xr = x.clone().requires_grad_()
    pr = scale.clone().requires_grad_()
    y = compiled(xr, idx, pr)
    y.sum().backward()
    xe, pe = x.clone().requires_grad_(), scale.clone().requires_grad_()
    ye = step(xe, idx, pe)
    ye.sum().backward()
    assert torch.equal(y, ye) and torch.equal(xr.grad, xe.grad) and torch.equal(pr.grad, pe.grad)


# ---------------------------------------------------------------------- GPU
def _same_bits(got, want):
    """Bitwise equal, except that a NaN only has to be a NaN (its payload
    after an fp32 multiply is the hardware's)."""
    got = got.cpu()
    nan_g, nan_w = torch.isnan(got.float()), torch.isnan(want.float())
    assert torch.equal(nan_g, nan_w)
    g8, w8 = got.view(torch.uint8), want.view(torch.uint8)
    bytes_nan = nan_g.repeat_interleave(got.element_size(), dim=-1)
    diff = (g8 != w8) & ~bytes_nan
    assert not diff.any(), f"{int(diff.sum())} bytes differ, first at {diff.nonzero()[0].tolist()}"


def _poison_allocator(nbytes):
    poison_allocator(max(nbytes, 1 << 21))


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cols", [7168, 136, 13, 1])  # 1: the one-column kernels (a value per slot)
def test_gpu_kernels_bit_exact(dtype, cols):
    idx = _indices(300, 4, 16, drop=0.1, seed=5)
    x = torch.randn(300, cols, dtype=dtype)
    x[:5, 0] = torch.tensor([0.0, -0.0, float("inf"), float("nan"), 1e-40]).to(dtype)  # (a column: cols may be 1)
    probs = torch.rand(300, 4)
    for capacity, layout in ((None, "packed"), (50, "packed"), (40, "padded")):
        rm_c = routing_map(idx, 16, capacity, layout)
        rm_g = routing_map(idx.cuda(), 16, capacity, layout)
        assert torch.equal(rm_g.row_map.cpu(), rm_c.row_map)
        before = dict(kernels.CALLS)
        _poison_allocator(rm_c.num_rows * cols * 4 + (1 << 20))
        for scale in (None, probs):
            want, _ = ref.scatter(x, rm_c.row_map, rm_c.num_rows, scale)
            got, _ = kernels.scatter(x.cuda(), rm_g.row_map, rm_g.num_rows, scale=None if scale is None else
                                     scale.cuda(), zero_from=rm_g.used_rows)
            _same_bits(got, want)
            y = torch.randn(rm_c.num_rows, cols, dtype=dtype)
            want_g = ref.gather(y, rm_c.row_map, scale)
            got_g = kernels.gather(y.cuda(), rm_g.row_map, scale=None if scale is None else scale.cuda())
            _same_bits(got_g, want_g)
        assert kernels.CALLS["kernel_scatter"] == before["kernel_scatter"] + 2
        assert kernels.CALLS["kernel_gather"] == before["kernel_gather"] + 2


@requires_cuda
def test_gpu_permute_probs_runs_the_row_scatter():
    idx = _indices(500, 8, 64, drop=0.1, seed=11)
    for capacity, layout in ((None, "packed"), (40, "packed"), (50, "padded")):
        _poison_allocator(1 << 22)
        before = dict(kernels.CALLS)
        _check_permute_probs(idx, 64, capacity, layout, "cuda")
        assert kernels.CALLS["kernel_scatter"] == before["kernel_scatter"] + 1
        assert kernels.CALLS["kernel_gather"] == before["kernel_gather"] + 1


@requires_cuda
def test_gpu_dot_products_and_determinism():
    idx = _indices(200, 8, 32, drop=0.05, seed=6).cuda()
    rm = routing_map(idx, 32)
    dy = torch.randn(200, 7168, dtype=torch.bfloat16, device="cuda")
    yg = torch.randn(rm.num_rows, 7168, dtype=torch.bfloat16, device="cuda")
    p = torch.rand(200, 8, device="cuda")
    g1, d1 = kernels.scatter(dy, rm.row_map, rm.num_rows, scale=p, zero_from=rm.used_rows, dot_with=yg)
    g2, d2 = kernels.scatter(dy, rm.row_map, rm.num_rows, scale=p, zero_from=rm.used_rows, dot_with=yg)
    assert torch.equal(g1, g2) and torch.equal(d1, d2)
    _, want = ref.scatter(dy.cpu(), rm.row_map.cpu(), rm.num_rows, p.cpu(), yg.cpu())
    assert torch.allclose(d1.cpu(), want, rtol=1e-4, atol=1e-2)


@requires_cuda
def test_gpu_fp8_rows_and_empty():
    idx = _indices(64, 2, 8, seed=7).cuda()
    rm = routing_map(idx, 8)
    data = torch.randn(64, 7168, device="cuda").to(torch.float8_e4m3fn)
    scale = torch.rand(64, 56, device="cuda")
    d, s = permute_fp8(data, scale, rm)
    rmc = routing_map(idx.cpu(), 8)
    assert torch.equal(d.cpu().view(torch.uint8), _loop_permute(data.cpu().view(torch.uint8), rmc.row_map,
                                                                 rmc.num_rows))
    assert torch.equal(s.cpu(), _loop_permute(scale.cpu(), rmc.row_map, rmc.num_rows))
    e = routing_map(torch.empty(0, 2, dtype=torch.int64, device="cuda"), 8)
    xg = permute_rows(torch.empty(0, 128, device="cuda", dtype=torch.bfloat16), e)
    assert xg.shape == (0, 128)
    assert unpermute(xg, e).shape == (0, 128)


@requires_cuda
def test_gpu_permute_graph_replays_new_routing_without_sync():
    t, k, e, h = 256, 4, 16, 512
    idx = torch.zeros(t, k, dtype=torch.int64, device="cuda")
    x = torch.randn(t, h, dtype=torch.bfloat16, device="cuda")
    probs = torch.rand(t, k, device="cuda")

    def step():
        xg, m, rm = permute(x, idx, e, capacity=80)
        return unpermute(xg * 3, rm, probs), m, rm.dropped

    idx.copy_(_indices(t, k, e, seed=8).cuda())
    torch.cuda.set_sync_debug_mode("error")
    try:
        from conftest import capture_graph
        graph, static = capture_graph(step)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for seed in range(3):
        idx.copy_(_indices(t, k, e, drop=0.1 * seed, seed=10 + seed).cuda())
        x.copy_(torch.randn_like(x))
        graph.replay()
        want = step()
        for got, w in zip(static, want):
            assert torch.equal(got, w)
