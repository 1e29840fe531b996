"""lpmoe.moe.TopKRouter and MoELayer: router formulas against loops, the
layer against a per-token loop, aux-loss training, capacity drops, the
global expert numbering, expert parallelism (EP=2 vs EP=1) and DDP / FSDP2
over gloo in two processes on the CPU; on the GPU: CUDA graphs with new
routing per replay, no host syncs, FP8; on two GPUs the same distributed
tests over NCCL, the capacity path under set_sync_debug_mode("error"),
and FP8 experts."""
import math
import socket

import pytest
import torch
import torch.nn.functional as F

import lpmoe
from conftest import requires_cuda
from lpmoe.moe import MoELayer, TopKRouter, kernels, router_scores


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
@pytest.mark.parametrize("normalize", [True, False])
def test_router_scores_match_formulas(score, normalize):
    torch.manual_seed(0)
    t, e, k = 40, 8, 3
    logits = torch.randn(t, e, dtype=torch.float64)
    out = router_scores(logits, k, score, normalize, aux_loss_coeff=0.1, z_loss_coeff=0.01)
    s = torch.softmax(logits, -1) if score == "softmax" else torch.sigmoid(logits)
    counts = torch.zeros(e)
    for ti in range(t):
        order = sorted(range(e), key=lambda i: -float(s[ti, i]))[:k]
        assert sorted(out.indices[ti].tolist()) == sorted(order)
        v = s[ti, order]
        want = v / v.sum() if normalize else v
        assert torch.allclose(out.probs[ti].double(), want.sort(descending=True).values, atol=1e-6)
        for i in order:
            counts[i] += 1
    assert out.tokens_per_expert.tolist() == counts.long().tolist()
    aff = s if score == "softmax" else s / s.sum(-1, keepdim=True)
    aux = 0.1 * e / (t * k) * sum(float(counts[i]) * float(aff[:, i].mean()) for i in range(e))
    z = 0.01 * float((torch.logsumexp(logits, -1) ** 2).mean())
    assert abs(float(out.aux_loss) - (aux + z)) < 1e-5


def test_router_rejects_bad_arguments():
    with pytest.raises(ValueError, match="top_k"):
        TopKRouter(8, 4, 5, device="cpu")
    with pytest.raises(ValueError, match="score"):
        TopKRouter(8, 4, 2, score="relu", device="cpu")
    with pytest.raises(ValueError, match="aux_loss_coeff"):
        TopKRouter(8, 4, 2, aux_loss_coeff=-1.0, device="cpu")
    with pytest.raises(ValueError, match="x must be"):
        TopKRouter(8, 4, 2, device="cpu")(torch.randn(3, 9))
    with pytest.raises(ValueError, match="capacity_factor"):
        MoELayer(8, 8, 4, 2, capacity_factor=0, device="cpu")
    with pytest.raises(ValueError, match="dispatch_fp8"):
        MoELayer(8, 8, 4, 2, dispatch_fp8=True, device="cpu")


def _loop_layer(layer, x):
    """y_t = sum_j p_tj * fc2_e(swiglu(fc1_e(x_t))) token by token, fp32."""
    r = layer.router(x)
    f = layer.experts.ffn_hidden_size
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for j in range(layer.top_k):
            e = int(r.indices[t, j])
            h = x[t].float() @ layer.experts.linear_fc1.get_parameter(f"weight{e}").float().t()
            a = F.silu(h[:f]) * h[f:]
            out[t] += r.probs[t, j] * (a @ layer.experts.linear_fc2.get_parameter(f"weight{e}").float().t())
    return out


def test_moe_layer_matches_token_loop_and_trains_aux_loss():
    torch.manual_seed(1)
    layer = MoELayer(32, 16, 6, 2, device="cpu", params_dtype=torch.float32, aux_loss_coeff=0.05,
                     z_loss_coeff=0.001)
    x = torch.randn(2, 13, 32, requires_grad=True)
    before = dict(kernels.CALLS)
    y = layer(x)
    assert kernels.CALLS["reference_scatter"] > before["reference_scatter"]
    assert torch.allclose(y.detach().reshape(-1, 32), _loop_layer(layer, x.detach().reshape(-1, 32)), atol=1e-5)
    w = torch.randn_like(y)
    (y * w).sum().backward()
    g_attached = layer.router.weight.grad.clone()
    # the same gradient with the aux loss switched off, plus the aux loss's own
    layer.zero_grad()
    layer.router.aux_loss_coeff = layer.router.z_loss_coeff = 0.0
    (layer(x.detach()) * w).sum().backward()
    g_main = layer.router.weight.grad.clone()
    layer.zero_grad()
    layer.router.aux_loss_coeff, layer.router.z_loss_coeff = 0.05, 0.001
    r = layer.router(x.detach().reshape(-1, 32))
    r.aux_loss.backward()
    assert float(r.aux_loss) > 0
    assert torch.allclose(g_attached, g_main + layer.router.weight.grad, atol=1e-6)
    layer(x.detach())
    assert float(layer.aux_loss) == pytest.approx(float(r.aux_loss.detach()), rel=1e-6)


def test_moe_layer_capacity_drops_are_counted_and_zero():
    torch.manual_seed(2)
    layer = MoELayer(16, 8, 4, 1, device="cpu", params_dtype=torch.float32, capacity_factor=0.5)
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[0] = 1.0            # every token prefers expert 0
    x = torch.rand(20, 16) + 0.1
    y = layer(x)
    cap = layer.capacity(20)                    # ceil(0.5 * 20 / 4) = 3
    assert cap == 3 and int(layer.tokens_dropped) == 20 - cap
    assert torch.count_nonzero(y.abs().sum(1)) == cap   # only the first `cap` tokens got an output


def test_moe_layer_compiles_fullgraph_cpu():
    torch.manual_seed(3)
    layer = MoELayer(32, 16, 4, 2, device="cpu", params_dtype=torch.float32, aux_loss_coeff=0.01)
    x = torch.randn(24, 32)
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    xc, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
    yc = compiled(xc)
    yc.sum().backward()
    gc = layer.router.weight.grad.clone()
    layer.zero_grad()
    ye = layer(xe)
    ye.sum().backward()
    assert torch.allclose(yc, ye, atol=1e-6) and torch.allclose(xc.grad, xe.grad, atol=1e-6)
    assert torch.allclose(gc, layer.router.weight.grad, atol=1e-6)


def test_compiled_moe_layer_does_not_recompile_as_routing_changes_cpu():
    """Steps with new tokens (so new routing) run the first compiled graph:
    no guard on lpmoe's call counters or the autocast state (both once made
    every call, or the second, recompile; fullgraph then fails at the limit)."""
    import torch._dynamo.testing
    torch.manual_seed(4)
    layer = MoELayer(32, 16, 4, 2, device="cpu", params_dtype=torch.float32, aux_loss_coeff=0.01)
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(layer, fullgraph=True, backend=counter)
    for step in range(4):
        x = torch.randn(24, 32, requires_grad=True)
        compiled(x).sum().backward()
        layer.zero_grad(set_to_none=True)
    assert counter.frame_count == 1


def test_capacity_takes_the_factor_as_written():
    """ceil(c * T * k / E) with c as the decimal says (0.1 is 1/10, not its
    binary neighbour, which gives one slot more where c*T*k/E is whole),
    in integer arithmetic; setting capacity_factor later takes effect and
    is checked."""
    import fractions
    layer = MoELayer(16, 8, 4, 1, device="cpu", params_dtype=torch.float32, capacity_factor=0.1)
    assert layer.capacity(120) == 3                      # 0.1 * 120 / 4 = 3 exactly
    assert float(fractions.Fraction(0.1)) * 120 / 4 == 3.0 and fractions.Fraction(0.1) * 120 / 4 > 3
    for c in (0.5, 0.6, 1.0, 1.1, 1.25, 2, 1 / 3):
        layer.capacity_factor = c
        for t, k, e in ((1, 1, 4), (7, 2, 6), (20, 1, 4), (4000, 8, 64), (10 ** 6, 8, 256)):
            layer.top_k, layer.num_experts = k, e
            want = max(1, math.ceil(fractions.Fraction(str(c)) * t * k / e)) if c != 1 / 3 else \
                max(1, math.ceil(fractions.Fraction(1, 3) * t * k / e))
            assert layer.capacity(t) == want, (c, t, k, e)
    layer.capacity_factor = None
    assert layer.capacity(120) is None
    with pytest.raises(ValueError, match="capacity_factor"):
        layer.capacity_factor = 0


@pytest.mark.parametrize("fp8", [False, True])
def test_compiled_moe_layer_with_capacity_and_dynamic_token_counts_cpu(fp8):
    """capacity_factor under torch.compile(dynamic=True): the capacity and
    the grouped row count are symbolic in the token count (integer
    arithmetic: the float capacity factor once made them unliftable, and
    the compile failed), and every token count gives eager's bits."""
    import torch._dynamo.testing
    torch.manual_seed(6)
    layer = MoELayer(128, 64, 4, 2, device="cpu", params_dtype=torch.bfloat16, capacity_factor=0.6)
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(layer, fullgraph=True, backend=counter, dynamic=True)
    frames = []
    for t in (24, 40, 56):
        x = torch.randn(t, 128, dtype=torch.bfloat16)
        outs = []
        for fn in (compiled, layer):
            xi = x.clone().requires_grad_()
            layer.zero_grad(set_to_none=True)
            with lpmoe.autocast(enabled=fp8):
                y = fn(xi)
            y.float().square().sum().backward()
            outs.append([y.detach(), xi.grad] + [p.grad.clone() for p in layer.parameters()])
        for i, (u, v) in enumerate(zip(*outs)):
            assert torch.equal(u, v), (t, i)
        frames.append(counter.frame_count)
    assert frames[0] == frames[-1]  # (new token counts reuse the first compile)


@requires_cuda
@pytest.mark.parametrize("fp8", [False, True])
def test_gpu_compiled_moe_layer_does_not_recompile(fp8):
    """The GPU path (fused router and its backward kernel, routing map and
    permutation ops) through one compiled frame for steps with new tokens."""
    import torch._dynamo.testing
    from lpmoe.moe import router_kernel
    torch.manual_seed(5)
    layer = MoELayer(256, 128, 8, 2, params_dtype=torch.bfloat16, aux_loss_coeff=0.01, z_loss_coeff=0.001)
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(layer, fullgraph=True, backend=counter)
    before = dict(router_kernel.CALLS)
    for step in range(4):
        x = torch.randn(96, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        with lpmoe.autocast(enabled=fp8):
            compiled(x).float().square().sum().backward()
        layer.zero_grad(set_to_none=True)
    assert counter.frame_count == 1
    assert router_kernel.CALLS["fused_router"] - before["fused_router"] >= 4
    assert router_kernel.CALLS["fused_router_backward"] - before["fused_router_backward"] >= 4


def _spawn(fn, *args, nprocs=2):
    import torch.multiprocessing as mp
    mp.spawn(fn, args=(nprocs, _free_port()) + args, nprocs=nprocs, join=True)


@pytest.mark.parametrize("mode", ["host", "capacity", "fp8", "fp8_capacity"])
def test_expert_parallel_two_ranks_equals_one(mode):
    import _moe_dist_worker
    _spawn(_moe_dist_worker.expert_parallel, mode)


def test_expert_parallel_fp32_params_under_autocast():
    import _moe_dist_worker
    _spawn(_moe_dist_worker.expert_parallel_amp)


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_data_parallel_grads_equal_single_process(mode):
    import _moe_dist_worker
    _spawn(_moe_dist_worker.data_parallel, mode)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_cuda)])
@pytest.mark.parametrize("rows", [0, 1, 37, 130])
def test_fp8_wire_rows_round_trip(device, rows):
    """FP8 dispatch rows: 1x128 E4M3 data + fp32 scales per row; the receiver's
    dequantize is data * scale in fp32 rounded once to the rows' dtype."""
    from lpmoe.moe.wire import dequantize_rows, quantize_rows
    torch.manual_seed(rows)
    x = torch.randn(rows, 384, dtype=torch.bfloat16) * 10
    if rows > 3:
        x[3] = 0
        x[2, :128] = 1e-30
    data, scale = quantize_rows(x.to(device))
    assert data.dtype == torch.float8_e4m3fn and scale.shape == (rows, 3)
    got = dequantize_rows(data, scale, torch.bfloat16).cpu()
    want = (data.cpu().float() * scale.cpu().repeat_interleave(128, dim=1)).to(torch.bfloat16)
    assert torch.equal(got, want)
    assert (got.float() - x.float()).norm() <= 0.07 * x.float().norm()


requires_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (NCCL)")


@requires_two_gpus
@pytest.mark.parametrize("mode", ["host", "capacity", "fp8", "fp8_capacity", "sync"])
def test_gpu_expert_parallel_nccl_equals_one(mode):
    import _moe_dist_worker
    _spawn(_moe_dist_worker.expert_parallel, mode, "cuda")


@requires_two_gpus
def test_gpu_expert_parallel_nccl_fp32_params_under_autocast():
    import _moe_dist_worker
    _spawn(_moe_dist_worker.expert_parallel_amp, "cuda")


@requires_two_gpus
def test_gpu_expert_parallel_nccl_fp8_experts():
    import _moe_dist_worker
    _spawn(_moe_dist_worker.expert_parallel_fp8_experts)


@requires_two_gpus
@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_gpu_data_parallel_nccl_grads_equal_single_process(mode):
    import _moe_dist_worker
    _spawn(_moe_dist_worker.data_parallel, mode, "cuda")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_cuda)])
def test_pending_collective_results_are_waited_before_kernels(device):
    import _moe_dist_worker
    _spawn(_moe_dist_worker.pending_collective_inputs, device, nprocs=1)


def test_state_dict_global_numbering_single_process():
    from lpmoe.moe.expert_numbering import register_global_expert_numbering
    full = MoELayer(16, 8, 4, 1, device="cpu", params_dtype=torch.float32)
    part = MoELayer(16, 8, 2, 1, device="cpu", params_dtype=torch.float32)
    part.router = TopKRouter(16, 4, 1, device="cpu", params_dtype=torch.float32)
    register_global_expert_numbering(part, "experts.", 2, 2)      # as EP rank 1 of 2
    part.load_state_dict(full.state_dict())
    assert torch.equal(part.experts.linear_fc1.weight0, full.experts.linear_fc1.weight2)
    assert sorted(k for k in part.state_dict() if "experts" in k) == sorted(
        k for k in full.state_dict() if k.endswith(("weight2", "weight3")) and "experts" in k)


# ---------------------------------------------------------------------- GPU
@requires_cuda
@pytest.mark.parametrize("fp8", [False, True])
def test_gpu_moe_layer_graphed_new_routing_no_sync(fp8):
    from lpmoe.activation import kernels as act_kernels
    from lpmoe.recipe import Float8BlockScaling
    torch.manual_seed(4)
    layer = MoELayer(256, 128, 8, 2, params_dtype=torch.bfloat16, aux_loss_coeff=0.01)
    eager = MoELayer(256, 128, 8, 2, params_dtype=torch.bfloat16, aux_loss_coeff=0.01)
    eager.load_state_dict(layer.state_dict())   # make_graphed_callables replaces layer.forward
    x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with lpmoe.autocast(enabled=fp8, recipe=Float8BlockScaling()):
        graphed = torch.cuda.make_graphed_callables(layer, (x,))
        before = dict(kernels.CALLS)
        fused = act_kernels.CALLS["fused_forward"]
        for seed in range(3):
            torch.manual_seed(10 + seed)
            xi = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            xe = xi.detach().clone().requires_grad_()
            torch.cuda.set_sync_debug_mode("error")
            try:
                y = graphed(xi)
                y.float().square().sum().backward()
            finally:
                torch.cuda.set_sync_debug_mode("default")
            ye = eager(xe)
            ye.float().square().sum().backward()
            assert torch.equal(y, ye) and torch.equal(xi.grad, xe.grad)
            for p, q in zip(layer.parameters(), eager.parameters()):
                assert torch.equal(p.grad, q.grad)
            layer.zero_grad()
            eager.zero_grad()
        assert kernels.CALLS["kernel_scatter"] > before["kernel_scatter"]
        if fp8:
            assert act_kernels.CALLS["fused_forward"] > fused


def test_router_topk_op_opcheck_cpu():
    from torch.library import opcheck
    opcheck(torch.ops.lpmoe.router_topk, (torch.randn(12, 8), 3, False, True))
    opcheck(torch.ops.lpmoe.router_topk, (torch.randn(12, 8), 2, True, False))


@requires_cuda
@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
@pytest.mark.parametrize("e,k,dtype", [(64, 8, torch.float32), (256, 8, torch.bfloat16), (8, 2, torch.float32),
                                       (512, 32, torch.float32), (33, 3, torch.float16)])
def test_gpu_fused_router_matches_torch(score, e, k, dtype):
    from lpmoe.moe import router_kernel
    torch.manual_seed(5)
    # distinct logits per token (multiples of 1/64, exact in bf16/fp16): no ties, so the
    # selection is unique (tie order is the kernel's own: see the edge-case test)
    ranks = torch.stack([torch.randperm(e) for _ in range(1000)]).float()
    logits = (ranks / 64 - e / 128).to(dtype).cuda().requires_grad_()
    w = torch.randn(1000, k, device="cuda")
    before = dict(router_kernel.CALLS)
    out = router_scores(logits, k, score, True, aux_loss_coeff=0.01, z_loss_coeff=0.001)
    assert router_kernel.CALLS["fused_router"] == before["fused_router"] + 1
    assert router_kernel.CALLS["torch_router"] == before["torch_router"]
    ref_logits = logits.detach().cpu().float().requires_grad_()
    ref = router_scores(ref_logits, k, score, True, aux_loss_coeff=0.01, z_loss_coeff=0.001)
    assert torch.equal(out.indices.cpu(), ref.indices)
    assert torch.equal(out.tokens_per_expert.cpu(), ref.tokens_per_expert)
    assert torch.allclose(out.probs.cpu(), ref.probs, rtol=1e-5, atol=1e-6)
    assert torch.allclose(out.aux_loss.cpu(), ref.aux_loss, rtol=1e-5)
    ((out.probs * w).sum() + out.aux_loss).backward()
    ((ref.probs * w.cpu()).sum() + ref.aux_loss).backward()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert torch.allclose(logits.grad.float().cpu(), ref_logits.grad, rtol=tol, atol=tol)
    again = router_scores(logits.detach(), k, score, True, aux_loss_coeff=0.01, z_loss_coeff=0.001)
    assert torch.equal(again.aux_loss, out.aux_loss.detach()) and torch.equal(again.probs, out.probs.detach())


@requires_cuda
def test_gpu_fused_router_edge_cases():
    empty = router_scores(torch.empty(0, 16, device="cuda"), 2, aux_loss_coeff=0.1, z_loss_coeff=0.1)
    assert empty.probs.shape == (0, 2) and float(empty.aux_loss) == 0.0
    tie = router_scores(torch.zeros(4, 16, device="cuda"), 3)          # all equal: lowest indices
    assert tie.indices.tolist() == [[0, 1, 2]] * 4
    assert torch.allclose(tie.probs, torch.full((4, 3), 1 / 3, device="cuda"))
