"""FP8 expert rows quantized straight from the tokens (lpmoe.moe.routed_tokens):
the inverse routing map, ``permute_quantize`` bit-exact against quantizing
``permute_rows``' output, and the expert MLP / MoE layer reading
``RoutedTokens`` bit-identically to the unfused composition, with counters
proving which path ran."""
import pytest
import torch

import lpmoe
from conftest import capture_graph, poison_allocator, requires_cuda
from lpmoe.functional import LayerParams, grouped_mlp
from lpmoe.moe import RoutedTokens, kernels, permute_probs, permute_quantize, permute_rows, routing_map
from lpmoe.moe import routed_tokens
from lpmoe.recipe import Float8BlockScaling
from lpmoe.reference import permute as ref

BUFS = ("rowwise_data", "scale_inv", "columnwise_data", "columnwise_scale_inv")


def _indices(tokens, k, experts, drop=0.1, seed=0, skew=0.0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    if tokens == 0:
        return torch.empty(0, k, dtype=torch.int64, device=device)
    idx = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    if skew:  # most tokens' first slot on expert 0 (kept unique per token)
        hot = torch.rand(tokens, generator=g) < skew
        swap = (idx == 0) & hot.unsqueeze(1)
        idx[swap] = idx[hot, :1].expand(-1, k)[swap[hot]]
        idx[hot, 0] = 0
    idx[torch.rand(idx.shape, generator=g) < drop] = -1
    return idx.to(device)


def _tokens(t, h, dtype, device, seed=1, edges=True):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(t, h, generator=g) * 3).to(dtype)
    if edges and t >= 4 and h >= 8:  # zeros, signed zero, inf, NaN, subnormal-sized values
        x[0] = 0
        x[1, :4] = torch.tensor([-0.0, float("inf"), float("nan"), 1e-40]).to(dtype)
        x[2] = torch.finfo(dtype).tiny / 4
        x[3, 5] = -float("inf")
    return x.to(device)


def _member_bytes(g):
    return [{n: (None if v[n] is None else v[n].view(torch.uint8).cpu()) for n in BUFS} for v in g.split()]


def _assert_same_members(a, b):
    for va, vb in zip(_member_bytes(a), _member_bytes(b)):
        for n in BUFS:
            assert (va[n] is None) == (vb[n] is None), n
            if va[n] is not None:
                assert torch.equal(va[n], vb[n]), n


# ---------------------------------------------------------------- inverse map
@pytest.mark.parametrize("capacity", [None, 3])
def test_row_sources_reference_inverts_the_map(capacity):
    idx = _indices(41, 3, 5, drop=0.2)
    rm = routing_map(idx, 5, capacity)
    src = kernels.row_sources(rm.row_map, rm.num_rows)
    assert src.dtype == torch.int32 and src.shape == (rm.num_rows,)
    for t in range(41):
        for j in range(3):
            r = int(rm.row_map[t, j])
            if r >= 0:
                assert int(src[r]) == t
    named = set(int(r) for r in rm.row_map.flatten() if r >= 0)
    assert all(int(src[r]) == -1 for r in range(rm.num_rows) if r not in named)


def test_errors_name_the_argument():
    x = torch.randn(10, 128, dtype=torch.bfloat16)
    idx = _indices(10, 2, 4)
    rm = routing_map(idx, 4)
    q = lpmoe.Float8BlockQuantizer(torch.float8_e4m3fn, block_dim=1)
    with pytest.raises(ValueError, match="packed layout"):
        RoutedTokens(x, routing_map(idx, 4, 3, layout="padded"))
    with pytest.raises(ValueError, match="tokens"):
        RoutedTokens(x[:9], rm)
    with pytest.raises(TypeError, match="Float8BlockQuantizer"):
        permute_quantize(x, rm, lpmoe.MXFP8Quantizer())
    with pytest.raises(TypeError, match="RoutingMap"):
        permute_quantize(x, rm.row_map, q)
    fc1 = LayerParams([torch.randn(64, 128) for _ in range(4)])
    fc2 = LayerParams([torch.randn(128, 32) for _ in range(4)])
    with pytest.raises(ValueError, match="m_splits must be None"):
        grouped_mlp(RoutedTokens(x.float(), rm), rm.m_splits, fc1, fc2)
    with pytest.raises(ValueError, match="num_rows"):
        kernels.row_sources(rm.row_map, -1)


# ------------------------------------------------------------- MLP, CPU path
def _mlp_params(g, hidden, ffn, dtype, device, seed=3):
    gen = torch.Generator().manual_seed(seed)
    w1 = [(torch.randn(2 * ffn, hidden, generator=gen) * 0.05).to(device, dtype).requires_grad_() for _ in range(g)]
    w2 = [(torch.randn(hidden, ffn, generator=gen) * 0.05).to(device, dtype).requires_grad_() for _ in range(g)]
    return w1, w2


def _run_mlp(routed: bool, x, rm, probs, w1, w2, recipe):
    """Output rows and gradients (tokens, probs, weights) of one fwd+bwd."""
    for t in [x, probs] + w1 + w2:
        t.grad = None
    pg = permute_probs(probs, rm)
    if routed:
        y = grouped_mlp(RoutedTokens(x, rm), None, LayerParams(w1), LayerParams(w2), probs=pg, recipe=recipe)
    else:
        y = grouped_mlp(permute_rows(x, rm), rm.m_splits, LayerParams(w1), LayerParams(w2), probs=pg, recipe=recipe)
    gen = torch.Generator().manual_seed(9)
    dy = torch.randn(y.shape, generator=gen).to(y.device, y.dtype)
    y.backward(dy)
    return [y.detach().clone(), x.grad.clone(), probs.grad.clone()] + [w.grad.clone() for w in w1 + w2]


def _assert_runs_equal(a, b, used):
    assert torch.equal(a[0][:used], b[0][:used]), "output rows"
    assert torch.equal(a[0][used:], b[0][used:]) and not a[0][used:].any(), "capacity-tail rows (zeros)"
    for i, (p, q) in enumerate(zip(a[1:], b[1:])):
        assert torch.equal(p, q), f"gradient {i}"


@pytest.mark.parametrize("recipe_name", ["fp8", "fp8_dequantized", "fp8_high_precision", "none"])
def test_mlp_reads_routed_tokens_like_permuted_rows_cpu(recipe_name):
    recipe = {"fp8": Float8BlockScaling(), "fp8_dequantized": Float8BlockScaling(backward_override="dequantized"),
              "fp8_high_precision": Float8BlockScaling(backward_override="high_precision"), "none": None}[recipe_name]
    t, k, e, h, f = 70, 2, 4, 128, 128
    x = _tokens(t, h, torch.bfloat16, "cpu", edges=False).requires_grad_()
    rm = routing_map(_indices(t, k, e, drop=0.1, seed=4), e, capacity=30)
    probs = torch.rand(t, k).requires_grad_()
    w1, w2 = _mlp_params(e, h, f, torch.bfloat16, "cpu")
    before = dict(routed_tokens.CALLS)
    got = _run_mlp(True, x, rm, probs, w1, w2, recipe)
    gathered = routed_tokens.CALLS["reference_permute_quantize"] - before["reference_permute_quantize"]
    # only the recipes whose backward needs just the FP8 input gather it
    assert gathered == (1 if recipe_name in ("fp8", "fp8_dequantized") else 0)
    want = _run_mlp(False, x, rm, probs, w1, w2, recipe)
    _assert_runs_equal(got, want, int(rm.used_rows))


def _run_summed(routed: bool, x, rm, probs, w1, w2, recipe, b2=None):
    """Tokens' outputs and every gradient of the MLP summed back to the
    tokens: RoutedTokens(sum_to_tokens=True) vs unpermute of the rows path."""
    for t in [x, probs] + w1 + w2 + (b2 or []):
        t.grad = None
    pg = permute_probs(probs, rm)
    fc2 = LayerParams(w2, b2)
    if routed:
        y = grouped_mlp(RoutedTokens(x, rm, sum_to_tokens=True), None, LayerParams(w1), fc2, probs=pg,
                        recipe=recipe)
    else:
        y = lpmoe.moe.unpermute(grouped_mlp(permute_rows(x, rm), rm.m_splits, LayerParams(w1), fc2, probs=pg,
                                            recipe=recipe), rm)
    gen = torch.Generator().manual_seed(11)
    y.backward(torch.randn(y.shape, generator=gen).to(y.device, y.dtype))
    return [y.detach().clone(), x.grad.clone(), probs.grad.clone()] + [w.grad.clone() for w in w1 + w2 + (b2 or [])]


@pytest.mark.parametrize("recipe_name", ["fp8", "none"])
def test_mlp_sums_rows_to_tokens_like_unpermute_cpu(recipe_name):
    recipe = Float8BlockScaling() if recipe_name == "fp8" else None
    t, k, e, h, f = 70, 2, 4, 128, 128
    x = _tokens(t, h, torch.bfloat16, "cpu", edges=False).requires_grad_()
    rm = routing_map(_indices(t, k, e, drop=0.1, seed=4), e, capacity=30)
    probs = torch.rand(t, k).requires_grad_()
    w1, w2 = _mlp_params(e, h, f, torch.bfloat16, "cpu")
    before = routed_tokens.CALLS["reference_permute_quantize"]
    got = _run_summed(True, x, rm, probs, w1, w2, recipe)
    assert got[0].shape == (t, h)
    # FP8: fc1's input, then fc2's output gradient in two passes; bf16: none
    assert routed_tokens.CALLS["reference_permute_quantize"] - before == (3 if recipe is not None else 0)
    want = _run_summed(False, x, rm, probs, w1, w2, recipe)
    for i, (u, v) in enumerate(zip(got, want)):
        assert torch.equal(u, v), i


def test_moe_layer_gathers_fp8_expert_input_cpu():
    torch.manual_seed(0)
    layer = lpmoe.moe.MoELayer(128, 64, num_experts=4, top_k=2, device="cpu", params_dtype=torch.bfloat16)
    x = torch.randn(33, 128, dtype=torch.bfloat16, requires_grad=True)
    before = dict(routed_tokens.CALLS)
    with lpmoe.autocast(recipe=Float8BlockScaling()):
        y = layer(x)
    y.float().sum().backward()
    # fc1's input in the forward, fc2's output gradient (one pass per direction) in the backward
    assert routed_tokens.CALLS["reference_permute_quantize"] == before["reference_permute_quantize"] + 3
    assert x.grad is not None and torch.isfinite(x.grad.float()).all()
    y_bf16 = layer(x)  # no recipe: the rows are permuted first, as before
    assert routed_tokens.CALLS["reference_permute_quantize"] == before["reference_permute_quantize"] + 3
    assert y_bf16.shape == y.shape


# ----------------------------------------------------------------------- GPU
@requires_cuda
@pytest.mark.parametrize("tokens,k,experts,capacity,layout", [
    (0, 2, 4, None, "packed"), (1, 1, 3, None, "packed"), (300, 2, 8, None, "packed"), (1000, 8, 64, None, "packed"),
    (777, 4, 16, 150, "packed"), (129, 3, 5, 2, "packed"), (129, 3, 5, 0, "packed"), (200, 2, 6, 90, "padded")])
def test_gpu_row_sources_kernel_matches_reference(tokens, k, experts, capacity, layout):
    # (padded: more rows than kept slots, many rows no slot names)
    rm = routing_map(_indices(tokens, k, experts, drop=0.1, seed=tokens, device="cuda"), experts, capacity, layout)
    poison_allocator()
    before = kernels.CALLS["kernel_row_sources"]
    got = kernels.row_sources(rm.row_map, rm.num_rows)
    assert kernels.CALLS["kernel_row_sources"] == before + 1
    assert torch.equal(got.cpu(), ref.row_sources(rm.row_map.cpu(), rm.num_rows))


def _launches():
    return lpmoe._ext.ext().fp8_block_quantize_kernel_launches()


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", ["uniform", "skewed", "capacity", "tiny", "empty", "partial_cols"])
@pytest.mark.parametrize("block_dim,columnwise", [(1, True), (1, False), (2, True)])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2_exact_scales"])
def test_gpu_permute_quantize_bit_exact(dtype, case, block_dim, columnwise, fmt):
    t, k, e, h, cap, skew = {"uniform": (512, 4, 8, 384, None, 0.0), "skewed": (700, 2, 16, 256, None, 0.9),
                             "capacity": (300, 3, 6, 128, 97, 0.5), "tiny": (5, 2, 3, 128, None, 0.0),
                             "empty": (0, 2, 4, 256, None, 0.0),
                             "partial_cols": (260, 2, 4, 208, None, 0.3)}[case]  # H 208: a partial column tile
    x = _tokens(t, h, dtype, "cuda", seed=t + k)
    rm = routing_map(_indices(t, k, e, drop=0.1, seed=7, skew=skew, device="cuda"), e, cap)
    q = lpmoe.Float8BlockQuantizer(torch.float8_e4m3fn if fmt == "e4m3" else torch.float8_e5m2, block_dim=block_dim,
                                   rowwise=True, columnwise=columnwise, pow2_scales=fmt == "e4m3")
    want = lpmoe.group_quantize(permute_rows(x, rm), q, num_tensors=e, first_dims=rm.m_splits)
    poison_allocator()
    before, calls = _launches(), routed_tokens.CALLS["kernel_permute_quantize"]
    got = permute_quantize(x, rm, q)
    after = _launches()
    assert routed_tokens.CALLS["kernel_permute_quantize"] == calls + 1
    assert after[0] == before[0], "the persistent kernel (which cannot gather) ran"
    assert sum(after) == sum(before) + (1 if rm.num_rows else 0)  # (no rows: nothing to launch)
    assert got.logical_shape == (rm.num_rows, h) and torch.equal(got.first_dims.cpu(), rm.m_splits.cpu())
    _assert_same_members(got, want)
    # and against the CPU reference of the same composition
    ref_q = permute_quantize(x.cpu(), routing_map(_indices(t, k, e, drop=0.1, seed=7, skew=skew), e, cap), q)
    _assert_same_members(got, ref_q)


def _gpu_mlp_case(seed=0, t=1024, k=4, e=8, h=256, f=128, misaligned=False):
    x = _tokens(t, h, torch.bfloat16, "cuda", seed=seed, edges=False)
    if misaligned:  # the same values one element into a buffer: data_ptr % 16 == 2
        buf = torch.empty(t * h + 1, dtype=x.dtype, device="cuda")
        buf[1:].copy_(x.view(-1))
        x = buf[1:].view(t, h)
        assert x.data_ptr() % 16
    x = x.detach().requires_grad_()
    rm = routing_map(_indices(t, k, e, drop=0.05, seed=seed, skew=0.3, device="cuda"), e, capacity=600)
    probs = torch.rand(t, k, device="cuda").requires_grad_()
    w1, w2 = _mlp_params(e, h, f, torch.bfloat16, "cuda", seed=seed)
    return x, rm, probs, w1, w2


@requires_cuda
@pytest.mark.parametrize("override,misaligned,gathers", [(None, False, True), ("dequantized", False, True),
                                                        ("high_precision", False, False), (None, True, True)])
def test_gpu_mlp_routed_tokens_bit_identical_to_permuted_rows(override, misaligned, gathers):
    """The recipes the gathering kernels take, and the one that falls back
    to permuted rows (a high-precision backward); tokens not 16-byte
    aligned are copied first (the kernels read 16-byte vectors)."""
    x, rm, probs, w1, w2 = _gpu_mlp_case(misaligned=misaligned)
    recipe = Float8BlockScaling(backward_override=override)
    want = _run_mlp(False, x, rm, probs, w1, w2, recipe)
    poison_allocator()
    before = routed_tokens.CALLS["kernel_permute_quantize"]
    got = _run_mlp(True, x, rm, probs, w1, w2, recipe)
    assert routed_tokens.CALLS["kernel_permute_quantize"] == before + (1 if gathers else 0)
    _assert_runs_equal(got, want, int(rm.used_rows))


@requires_cuda
@pytest.mark.parametrize("fc2_bias", [False, True])
def test_gpu_mlp_sums_rows_to_tokens_bit_identical(fc2_bias):
    """sum_to_tokens on the GPU: the tokens' outputs and every gradient equal
    unpermute of the rows path; fc2's output gradient is gathered (two
    passes) unless fc2 has a bias, whose gradient needs the rows."""
    x, rm, probs, w1, w2 = _gpu_mlp_case()
    b2 = [torch.randn(w.shape[0], device="cuda", dtype=torch.bfloat16).requires_grad_() for w in w2] \
        if fc2_bias else None
    recipe = Float8BlockScaling()
    want = _run_summed(False, x, rm, probs, w1, w2, recipe, b2)
    poison_allocator()
    before = routed_tokens.CALLS["kernel_permute_quantize"]
    got = _run_summed(True, x, rm, probs, w1, w2, recipe, b2)
    assert routed_tokens.CALLS["kernel_permute_quantize"] - before == (1 if fc2_bias else 3)
    for i, (u, v) in enumerate(zip(got, want)):
        assert torch.equal(u, v), i


@requires_cuda
def test_gpu_routed_tokens_graph_replays_with_new_routing_and_no_sync():
    t, k, e, h, f = 512, 2, 8, 256, 128
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    idx = torch.zeros(t, k, dtype=torch.int64, device="cuda")
    probs = torch.rand(t, k, device="cuda", requires_grad=True)
    w1, w2 = _mlp_params(e, h, f, torch.bfloat16, "cuda")
    recipe = Float8BlockScaling()

    def step(routed=True):
        for p in [x, probs] + w1 + w2:
            p.grad = None
        rm = routing_map(idx, e)
        pg = permute_probs(probs, rm)
        src = RoutedTokens(x, rm) if routed else permute_rows(x, rm)
        y = grouped_mlp(src, None if routed else rm.m_splits, LayerParams(w1), LayerParams(w2), probs=pg,
                        recipe=recipe)
        out = lpmoe.moe.unpermute(y, rm)
        out.backward(torch.ones_like(out))
        return out, x.grad, probs.grad, w1[0].grad, w2[-1].grad

    idx.copy_(_indices(t, k, e, drop=0.0, seed=1, device="cuda"))
    torch.cuda.set_sync_debug_mode("error")
    try:
        graph, static = capture_graph(step)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for seed in (2, 3, 4):
        idx.copy_(_indices(t, k, e, drop=0.05, seed=seed, skew=0.5, device="cuda"))
        x.data.copy_(torch.randn_like(x))
        graph.replay()
        eager = step(routed=False)
        for got, want in zip(static, eager):
            assert torch.equal(got, want)


@requires_cuda
@pytest.mark.parametrize("capacity_factor", [None, 0.6])
def test_gpu_moe_layer_gathers_and_matches_the_unfused_composition(capacity_factor):
    """The layer's FP8 step (tokens handed over) against the same layer
    composed by hand with the rows permuted first: output, input gradient
    and every parameter's gradient bitwise (with a capacity: dropped slots
    and a capacity tail)."""
    torch.manual_seed(0)
    layer = lpmoe.moe.MoELayer(256, 128, num_experts=8, top_k=2, device="cuda", params_dtype=torch.bfloat16,
                               capacity_factor=capacity_factor)
    x = torch.randn(300, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn(300, 256, device="cuda", dtype=torch.bfloat16)
    recipe = Float8BlockScaling()

    def grads():
        return [x.grad.clone()] + [p.grad.clone() for p in layer.parameters()]

    before = routed_tokens.CALLS["kernel_permute_quantize"]
    with lpmoe.autocast(recipe=recipe):
        y = layer(x)
    assert routed_tokens.CALLS["kernel_permute_quantize"] == before + 1
    y.backward(gy)
    assert routed_tokens.CALLS["kernel_permute_quantize"] == before + 3  # + fc2's output gradient, two passes
    got_y, got = y.detach(), grads()
    x.grad = None
    layer.zero_grad(set_to_none=True)
    # the same layer, composed by hand with the rows permuted first
    routed = layer.router(x)
    rm = routing_map(routed.indices, 8, layer.capacity(300))
    with lpmoe.autocast(recipe=recipe):
        yg = layer.experts(permute_rows(x, rm), rm.m_splits, probs=permute_probs(routed.probs, rm))
    want_y = lpmoe.moe.attach_aux_loss(lpmoe.moe.unpermute(yg, rm), routed.aux_loss, layer.aux_loss_scale)
    want_y.backward(gy)
    assert torch.equal(got_y, want_y.detach())
    for i, (u, v) in enumerate(zip(got, grads())):
        assert torch.equal(u, v), i


def test_moe_layer_hands_tokens_only_under_fp8_cpu():
    """Hooks on the experts see permuted rows under bf16 and RoutedTokens
    under FP8 block scaling; a replaced experts module always gets rows."""
    torch.manual_seed(0)
    layer = lpmoe.moe.MoELayer(128, 64, num_experts=4, top_k=2, device="cpu", params_dtype=torch.bfloat16)
    seen = []
    layer.experts.register_forward_pre_hook(lambda mod, args: seen.append(type(args[0]).__name__))
    x = torch.randn(20, 128, dtype=torch.bfloat16)
    layer(x)
    with lpmoe.autocast(recipe=Float8BlockScaling()):
        layer(x)
    assert seen == ["Tensor", "RoutedTokens"]

    class Wrapped(torch.nn.Module):  # a user's expert module
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, rows, m_splits, probs=None, is_first_microbatch=None):
            assert isinstance(rows, torch.Tensor)
            return self.inner(rows, m_splits, probs=probs)
    layer.experts = Wrapped(layer.experts)
    with lpmoe.autocast(recipe=Float8BlockScaling()):
        layer(x)


def test_compiled_fp8_moe_layer_with_an_empty_quantizer_cache_cpu():
    """torch.compile(fullgraph) of the FP8 layer in a state where no shared
    quantizer exists yet: the traced call must not build one (json inside
    the traced region is not traceable)."""
    from lpmoe import _value_fields
    torch.manual_seed(0)
    layer = lpmoe.moe.MoELayer(128, 64, num_experts=4, top_k=2, device="cpu", params_dtype=torch.bfloat16)
    x = torch.randn(24, 128, dtype=torch.bfloat16)
    want = None
    with lpmoe.autocast(recipe=Float8BlockScaling()):
        want = layer(x)
    _value_fields._SHARED.clear()
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    with lpmoe.autocast(recipe=Float8BlockScaling()):
        got = compiled(x)
    assert torch.equal(got, want)
