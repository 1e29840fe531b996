"""lpmoe.GroupedMLP / lpmoe.functional.grouped_mlp: the fused expert MLP.

CPU tests run the reference path (the same code as the GPU with the
reference kernels); GPU tests check the fused kernels bit for bit against
the unfused composition, CUDA graphs with new routing, and host syncs."""
import copy

import pytest
import torch
import torch.nn.functional as F

import lpmoe
import lpmoe.functional.mlp as GM
from conftest import requires_cuda, saved_storages
from lpmoe.activation import activation, kernels
from lpmoe.recipe import Float8BlockScaling, MXFP8BlockScaling, NVFP4BlockScaling

G, H, FFN = 3, 128, 128
RECIPES = [None, Float8BlockScaling(), Float8BlockScaling(backward_override="high_precision"),
           Float8BlockScaling(backward_override="dequantized"), MXFP8BlockScaling(), NVFP4BlockScaling()]


def make_mlp(kind="swiglu", bias=False, dtype=torch.bfloat16, device="cpu", g=G, h=H, f=FFN, seed=0):
    torch.manual_seed(seed)
    mlp = lpmoe.GroupedMLP(g, h, f, activation=kind, bias=bias, params_dtype=dtype, device=device)
    if bias:
        with torch.no_grad():
            for b in mlp.linear_fc1.biases + mlp.linear_fc2.biases:
                b.normal_()
    return mlp


def unfused(mlp, x, splits, probs):
    """The same computation from the unfused pieces: two GroupedLinear layers
    and the standalone activation op."""
    h = mlp.linear_fc1(x, splits)
    return mlp.linear_fc2(activation(h, mlp.activation, probs), splits)


def step(mlp, x, splits, dy, probs=None, recipe=None, fused=True, **kw):
    """Forward + backward; returns [y, dx, dprobs, *param grads]."""
    x = x.detach().clone().requires_grad_(True)
    p = None if probs is None else probs.detach().clone().requires_grad_(True)
    mlp.zero_grad(set_to_none=True)
    with lpmoe.autocast(enabled=recipe is not None, recipe=recipe):
        y = mlp(x, splits, probs=p, **kw) if fused else unfused(mlp, x, splits, p)
    y.backward(dy)
    return [y.detach(), x.grad, None if p is None else p.grad] + [t.grad for t in mlp.parameters()]


def assert_bitwise(a, b):
    for i, (u, v) in enumerate(zip(a, b)):
        if u is None or v is None:
            assert u is None and v is None, i
        else:
            assert torch.equal(u, v), f"result {i} differs"


# ------------------------------------------------------- CPU: fused == unfused
@pytest.mark.parametrize("recipe", RECIPES, ids=repr)
@pytest.mark.parametrize("kind", ["swiglu", "geglu", "gelu", "relu", "clamped_swiglu"])
def test_fused_equals_unfused_bitwise(recipe, kind):
    mlp = make_mlp(kind, bias=True)
    splits = [48, 0, 64]  # an empty expert and a 16-row capacity tail
    x = torch.randn(128, H, dtype=torch.bfloat16)
    dy = torch.randn(128, H, dtype=torch.bfloat16)
    p = torch.rand(128)
    assert_bitwise(step(mlp, x, splits, dy, p, recipe), step(mlp, x, splits, dy, p, recipe, fused=False))


@pytest.mark.parametrize("recipe", [None, Float8BlockScaling()], ids=repr)
def test_fused_without_probs_and_tail_rows(recipe):
    mlp = make_mlp("swiglu")
    splits = [0, 37, 50]
    x = torch.randn(100, H, dtype=torch.bfloat16)
    dy = torch.randn(100, H, dtype=torch.bfloat16)
    got = step(mlp, x, splits, dy, None, recipe)
    assert_bitwise(got, step(mlp, x, splits, dy, None, recipe, fused=False))
    used = sum(splits)
    assert torch.all(got[0][used:] == 0) and torch.all(got[1][used:] == 0)  # capacity tail
    assert torch.all(mlp.linear_fc1.weight0.grad == 0)  # empty expert


def test_matches_per_expert_torch_mlp_in_fp32():
    """Semantics: y_t = (silu(x W1g^T) * (x W1v^T) * p) W2^T per expert."""
    mlp = make_mlp("swiglu", bias=True, dtype=torch.float32)
    splits = [40, 0, 88]
    x = torch.randn(128, H, requires_grad=True)
    p = torch.rand(128, requires_grad=True)
    y = mlp(x, splits, probs=p)
    y.square().sum().backward()
    x2, p2 = x.detach().clone().requires_grad_(True), p.detach().clone().requires_grad_(True)
    rows, outs = 0, []
    fc1, fc2 = mlp.linear_fc1, mlp.linear_fc2
    for t, m in enumerate(splits):
        h = F.linear(x2[rows:rows + m], fc1.weights[t], fc1.biases[t])
        g, v = h.chunk(2, dim=-1)
        outs.append(F.linear(F.silu(g) * v * p2[rows:rows + m, None], fc2.weights[t], fc2.biases[t]))
        rows += m
    ref = torch.cat(outs)
    ref.square().sum().backward()
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(p.grad, p2.grad, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("recipe", [None, Float8BlockScaling()], ids=repr)
def test_partial_gradients(recipe):
    """Only what is asked for: a frozen fc1 with an input without grad gives
    fc2's gradients alone, bit-identical to a full step's; with only probs
    trainable, d probs alone."""
    mlp = make_mlp("swiglu")
    splits = [64, 0, 64]
    x = torch.randn(128, H, dtype=torch.bfloat16)
    dy = torch.randn(128, H, dtype=torch.bfloat16)
    p = torch.rand(128)
    full = step(mlp, x, splits, dy, p, recipe)
    for prm in mlp.linear_fc1.parameters():
        prm.requires_grad_(False)
    mlp.zero_grad(set_to_none=True)
    with lpmoe.autocast(enabled=recipe is not None, recipe=recipe):
        mlp(x, splits, probs=p).backward(dy)
    assert all(w.grad is None for w in mlp.linear_fc1.parameters())
    assert_bitwise([w.grad for w in mlp.linear_fc2.parameters()], full[3 + G:])
    for prm in mlp.linear_fc2.parameters():
        prm.requires_grad_(False)
    pg = p.clone().requires_grad_(True)
    with lpmoe.autocast(enabled=recipe is not None, recipe=recipe):
        mlp(x, splits, probs=pg).backward(dy)
    assert torch.equal(pg.grad, full[2])


def test_backward_twice_is_a_clear_error():
    mlp = make_mlp("swiglu")
    x = torch.randn(64, H, dtype=torch.bfloat16, requires_grad=True)
    y = mlp(x, [32, 0, 32]).sum()
    y.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="retain_graph"):
        y.backward()


def test_no_grad_forward_matches():
    mlp = make_mlp("geglu", bias=True)
    x = torch.randn(64, H, dtype=torch.bfloat16)
    with torch.no_grad():
        y = mlp(x, [32, 0, 32])
    assert not y.requires_grad
    assert torch.equal(y, mlp(x, [32, 0, 32]).detach())


# --------------------------------------------------------------- module API
def test_state_dict_keys_round_trip_and_glu_width():
    mlp = make_mlp("swiglu", bias=True, dtype=torch.float32)
    keys = list(mlp.state_dict())
    assert keys == ([f"linear_fc1.{p}{i}" for i in range(G) for p in ("weight", "bias")]
                    + [f"linear_fc2.{p}{i}" for i in range(G) for p in ("weight", "bias")])
    assert mlp.linear_fc1.weight0.shape == (2 * FFN, H) and mlp.linear_fc2.weight0.shape == (H, FFN)
    fresh = lpmoe.GroupedMLP(G, H, FFN, bias=True, params_dtype=torch.float32, device="cpu")
    fresh.load_state_dict(mlp.state_dict())
    x = torch.randn(32, H)
    assert torch.equal(fresh(x, [10, 12, 10]), mlp(x, [10, 12, 10]))
    assert lpmoe.GroupedMLP(G, H, FFN, activation="gelu", device="cpu").linear_fc1.weight0.shape == (FFN, H)


def test_init_methods():
    calls = []
    lpmoe.GroupedMLP(2, 32, 16, device="cpu", init_method=lambda w: calls.append(("fc1", w.shape)),
                     output_layer_init_method=lambda w: calls.append(("fc2", w.shape)))
    assert calls == [("fc1", (32, 32))] * 2 + [("fc2", (32, 16))] * 2


def test_ops_sequential_takes_the_fused_path():
    torch.manual_seed(0)
    seq = lpmoe.ops.Sequential(lpmoe.ops.GroupedLinear(G, H, 2 * FFN, params_dtype=torch.bfloat16, device="cpu"),
                               lpmoe.ops.SwiGLU(),
                               lpmoe.ops.GroupedLinear(G, FFN, H, params_dtype=torch.bfloat16, device="cpu"))
    mlp = make_mlp("swiglu", bias=True)
    mlp.linear_fc1.load_state_dict(seq[0].state_dict())
    mlp.linear_fc2.load_state_dict(seq[2].state_dict())
    x = torch.randn(128, H, dtype=torch.bfloat16)
    p = torch.rand(128)
    before = GM.CALLS["grouped_mlp"]
    with lpmoe.autocast(recipe=Float8BlockScaling()):
        y = seq(x, [64, 0, 64], probs=p)
        assert GM.CALLS["grouped_mlp"] == before + 1
        assert torch.equal(y, mlp(x, [64, 0, 64], probs=p))
    with pytest.raises(ValueError, match="exactly one activation"):
        lpmoe.ops.Sequential(lpmoe.ops.GroupedLinear(G, H, H, device="cpu"))(x.float(), [64, 0, 64], probs=p)


@pytest.mark.parametrize("bad, exc, match", [
    (dict(activation="silu"), ValueError, "activation must be one of"),
    (dict(probs=torch.ones(7)), ValueError, "one value per token row"),
    (dict(probs=torch.ones(128, dtype=torch.int32)), TypeError, "fp32/bf16/fp16"),
    (dict(m_splits=[1, 2]), ValueError, "one per expert"),
    (dict(is_first_microbatch=True), ValueError, "weight caches"),
])
def test_errors_before_any_work(bad, exc, match):
    mlp = make_mlp("swiglu")
    fc1 = lpmoe.functional.LayerParams(mlp.linear_fc1.weights)
    fc2 = lpmoe.functional.LayerParams(mlp.linear_fc2.weights)
    kw = dict(m_splits=[64, 0, 64], activation="swiglu")
    kw.update(bad)
    before = GM.CALLS["grouped_mlp"]
    with pytest.raises(exc, match=match):
        lpmoe.functional.grouped_mlp(torch.randn(128, H, dtype=torch.bfloat16), kw.pop("m_splits"), fc1, fc2, **kw)
    assert GM.CALLS["grouped_mlp"] == before


def test_shape_errors():
    mlp = make_mlp("swiglu")
    w1, w2 = mlp.linear_fc1.weights, mlp.linear_fc2.weights
    LP = lpmoe.functional.LayerParams
    x = torch.randn(16, H, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="fc2.weights must be"):
        lpmoe.functional.grouped_mlp(x, [16, 0, 0], LP(w1), LP([w.t() for w in w1]))
    with pytest.raises(ValueError, match="list of 3"):
        lpmoe.functional.grouped_mlp(x, [16, 0, 0], LP(w1), LP(w2[:2]))
    odd = [torch.randn(2 * FFN + 1, H, dtype=torch.bfloat16) for _ in range(G)]
    with pytest.raises(ValueError, match="even"):
        lpmoe.functional.grouped_mlp(x, [16, 0, 0], LP(odd), LP(w2))


def test_weight_cache_and_main_grad():
    mlp = make_mlp("swiglu")
    x = torch.randn(128, H, dtype=torch.bfloat16, requires_grad=True)
    with lpmoe.autocast(recipe=Float8BlockScaling()):
        y1 = mlp(x, [64, 0, 64], is_first_microbatch=True)
        assert mlp.linear_fc1.weight_cache.quantized is not None and mlp.linear_fc2.weight_cache.quantized is not None
        with torch.no_grad():
            mlp.linear_fc2.weight0.mul_(2)
        y2 = mlp(x, [64, 0, 64], is_first_microbatch=False)  # the cached (stale) FP8 weights on purpose
    assert torch.equal(y1, y2)
    acc = lpmoe.GroupedMLP(G, H, FFN, params_dtype=torch.bfloat16, device="cpu", fuse_wgrad_accumulation=True)
    acc.load_state_dict(mlp.state_dict())
    for lin in (acc.linear_fc1, acc.linear_fc2):
        for w in lin.weights:
            w.main_grad = torch.zeros(w.shape)
    dy = torch.randn(128, H, dtype=torch.bfloat16)
    with lpmoe.autocast(recipe=Float8BlockScaling()):
        acc(x, [64, 0, 64]).backward(dy)
    step(mlp, x, [64, 0, 64], dy, None, Float8BlockScaling())
    for a, b in ((acc.linear_fc1, mlp.linear_fc1), (acc.linear_fc2, mlp.linear_fc2)):
        for t in (0, 2):
            assert rel_close(a.weights[t].main_grad, b.weights[t].grad)
        assert torch.all(a.weight1.main_grad == 0)  # the empty expert is untouched
    assert all(w.grad is None for w in acc.parameters())


def rel_close(a, b, tol=1e-2):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30)) < tol


# ------------------------------------------------------- lean saved tensors
def _saved_bytes(fn):
    """Bytes of the distinct storages autograd keeps for the backward."""
    out, seen = saved_storages(fn)
    return sum(seen.values()), out


def _held_bytes(y):
    """Bytes the fused MLP node behind y holds outside save_for_backward."""
    from lpmoe.functional.saved import held_bytes
    node = y.grad_fn
    while not hasattr(node, "held"):
        node = node.next_functions[0][0]
    return held_bytes(node)


@pytest.mark.parametrize("recipe", [None, Float8BlockScaling()], ids=repr)
def test_saved_bytes_per_token(recipe):
    """Per token row the fused MLP keeps: FP8 -> the transposed FP8 copies of
    x and a (1 byte per value + 1/32 byte of fp32 scale), h once (2F bf16
    values) and probs (4 bytes); BF16 -> x, a and h in bf16, and probs.  No
    rowwise FP8 copies and no activation intermediates; the same bytes as the
    unfused composition.  Measured as the difference between two token
    counts, so the per-call weight copies and the capacity slack cancel."""
    mlp = make_mlp("swiglu")

    def saved(tokens, fused=True):
        x = torch.randn(tokens, H, dtype=torch.bfloat16, requires_grad=True)
        p = torch.rand(tokens, requires_grad=True)
        splits = [tokens // 2, 0, tokens // 2]

        def run():
            with lpmoe.autocast(enabled=recipe is not None, recipe=recipe):
                return mlp(x, splits, probs=p) if fused else unfused(mlp, x, splits, p)
        hooked, y = _saved_bytes(run)
        return hooked + (_held_bytes(y) if fused else 0)  # + what the MLP holds to release early

    per_token = (saved(512) - saved(256)) / 256
    if recipe is None:
        assert per_token == 2 * H + 2 * FFN + 2 * (2 * FFN) + 4
    else:
        assert per_token == (H + H / 32) + (FFN + FFN / 32) + 2 * (2 * FFN) + 4
    assert (saved(512, False) - saved(256, False)) / 256 == per_token


# ------------------------------------------------------------------- GPU
def _cuda_mlp(kind="swiglu", bias=False, g=8, h=512, f=256):
    return make_mlp(kind, bias=bias, device="cuda", g=g, h=h, f=f)


@requires_cuda
@pytest.mark.parametrize("kind", ["swiglu", "geglu", "gelu", "relu", "clamped_swiglu"])
@pytest.mark.parametrize("bias", [False, True])
def test_cuda_fused_equals_unfused_bitwise(kind, bias):
    mlp = _cuda_mlp(kind, bias)
    splits = torch.tensor([0, 1, 127, 129, 300, 0, 5, 200], device="cuda")
    rows = int(splits.sum()) + 40
    x = torch.randn(rows, 512, dtype=torch.bfloat16, device="cuda")
    dy = torch.randn(rows, 512, dtype=torch.bfloat16, device="cuda")
    p = torch.rand(rows, device="cuda")
    before = dict(kernels.CALLS)
    fused = step(mlp, x, splits, dy, p, Float8BlockScaling())
    assert kernels.CALLS["fused_forward"] == before["fused_forward"] + 1
    assert kernels.CALLS["fused_backward"] == before["fused_backward"] + 1
    assert kernels.CALLS["split_backward"] == before["split_backward"]
    assert_bitwise(fused, step(mlp, x, splits, dy, p, Float8BlockScaling(), fused=False))
    assert_bitwise(step(mlp, x, splits, dy, p), step(mlp, x, splits, dy, p, fused=False))  # bf16


@requires_cuda
def test_cuda_fp8_close_to_bf16_and_host_path_agrees():
    mlp = _cuda_mlp("swiglu")
    splits = [256, 0, 128, 100, 28, 300, 12, 200]
    rows = sum(splits)
    x = torch.randn(rows, 512, dtype=torch.bfloat16, device="cuda")
    dy = torch.randn(rows, 512, dtype=torch.bfloat16, device="cuda")
    hp = step(mlp, x, splits, dy)
    lp = step(mlp, x, torch.tensor(splits, device="cuda"), dy, None, Float8BlockScaling())
    for a, b in zip(lp, hp):
        if a is not None:
            assert rel_close(a, b, 0.08)


@requires_cuda
@pytest.mark.parametrize("recipe", [None, Float8BlockScaling()], ids=repr)
def test_cuda_graph_safe_path_never_syncs(recipe):
    mlp = _cuda_mlp("swiglu", bias=True)
    splits = torch.tensor([64, 0, 100, 28, 300, 12, 200, 0], device="cuda")
    x = torch.randn(800, 512, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    p = torch.rand(800, device="cuda", requires_grad=True)
    mlp(x, splits, probs=p)  # warm-up (workspaces, handles)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with lpmoe.autocast(enabled=recipe is not None, recipe=recipe):
            y = mlp(x, splits, probs=p)
        y.backward(torch.ones_like(y))
    finally:
        torch.cuda.set_sync_debug_mode(0)


@requires_cuda
@pytest.mark.parametrize("recipe", [None, Float8BlockScaling()], ids=repr)
def test_cuda_graphed_mlp_replays_new_routing_bitwise(recipe):
    mlp = _cuda_mlp("swiglu", bias=True)
    eager = copy.deepcopy(mlp)
    rows, g = 1024, 8
    x = torch.randn(rows, 512, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    p = torch.rand(rows, device="cuda", requires_grad=True)
    sp = torch.full((g,), rows // g, dtype=torch.int64, device="cuda")
    with lpmoe.autocast(enabled=recipe is not None, recipe=recipe):
        graphed = torch.cuda.make_graphed_callables(mlp, (x, sp, p), num_warmup_iters=3)
    for trial in range(4):
        gen = torch.Generator().manual_seed(trial)
        cuts = torch.sort(torch.randint(0, rows - 64, (g - 1,), generator=gen)).values
        splits = torch.diff(torch.cat([torch.tensor([0]), cuts, torch.tensor([rows - 64])])).cuda()
        xi = torch.randn(rows, 512, generator=gen).to(torch.bfloat16).cuda().requires_grad_(True)
        pi = torch.rand(rows, generator=gen).cuda().requires_grad_(True)
        dy = torch.randn(rows, 512, generator=gen).to(torch.bfloat16).cuda()
        mlp.zero_grad(set_to_none=True)
        with lpmoe.autocast(enabled=recipe is not None, recipe=recipe):
            y = graphed(xi, splits, pi)
        y.backward(dy)
        got = [y.detach(), xi.grad, pi.grad] + [t.grad for t in mlp.parameters()]
        ref = step(eager, xi.detach(), splits, dy, pi.detach(), recipe)
        assert_bitwise(got, ref)


@requires_cuda
def test_cuda_saved_memory_per_token():
    """Device memory the forward leaves alive per token row (saved tensors +
    the bf16 output), the CPU accounting above measured on the GPU.  x is a
    caller-held leaf, so BF16's copy of it costs nothing here while FP8 keeps
    its transposed FP8 copy (H + H/32 bytes); for a (made inside) FP8 keeps
    F + F/32 bytes where BF16 keeps 2F."""
    h_, f_ = 1024, 512
    mlp = _cuda_mlp("swiglu", g=8, h=h_, f=f_)
    res = {}
    for name, recipe in (("bf16", None), ("fp8", Float8BlockScaling())):
        alive = []
        for tokens in (4096, 8192):
            x = torch.randn(tokens, h_, dtype=torch.bfloat16, device="cuda", requires_grad=True)
            splits = torch.full((8,), tokens // 8, device="cuda")
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            with lpmoe.autocast(enabled=recipe is not None, recipe=recipe):
                y = mlp(x, splits)
            torch.cuda.synchronize()
            alive.append(torch.cuda.memory_allocated() - base)
            del y
        res[name] = (alive[1] - alive[0]) / 4096
    out_row, h_row = 2 * h_, 2 * 2 * f_
    assert res["bf16"] == pytest.approx(out_row + h_row + 2 * f_, rel=0.01)
    assert res["fp8"] == pytest.approx(out_row + h_row + (h_ + h_ / 32) + (f_ + f_ / 32), rel=0.01)
