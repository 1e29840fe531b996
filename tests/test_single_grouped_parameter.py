"""``single_grouped_parameter=True``: one (G, N, K) weight (and (G, N) bias)
per layer instead of G.  Same bits as the per-expert layout in every mode
(eager, compiled, CPU and GPU, host and device splits), the stacked
parameter's gradient is the wgrad GEMM's (G, N, K) output, checkpoints keep
the per-expert keys and load across both layouts, main_grad fusion works,
and bad stacked arguments get clear errors."""
import pytest
import torch
import torch._dynamo
import torch._dynamo.testing

import lpmoe
from conftest import requires_cuda
from lpmoe.library import layer_ops
from lpmoe.recipe import Float8BlockScaling, MXFP8BlockScaling

G, H, F = 4, 256, 128
RECIPES = [None, Float8BlockScaling(), Float8BlockScaling(backward_override="high_precision"), MXFP8BlockScaling()]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _pair(cls, device="cpu", bias=True, **kw):
    """(per-expert module, stacked module) with the same weights."""
    torch.manual_seed(0)
    a = cls(G, H, F, bias=bias, params_dtype=torch.bfloat16, device=device, **kw)
    b = cls(G, H, F, bias=bias, params_dtype=torch.bfloat16, device=device, single_grouped_parameter=True, **kw)
    with torch.no_grad():  # non-zero biases, so a misplaced bias gradient or row shows
        for p in a.parameters():
            if p.dim() == 1:
                p.normal_()
    b.load_state_dict(a.state_dict())
    return a, b


def _step(module, x, splits, recipe, probs=None):
    module.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    kw = {} if probs is None else {"probs": probs}
    with lpmoe.autocast(enabled=recipe is not None, recipe=recipe):
        y = module(x, splits, **kw)
    y.float().square().sum().backward()
    return y.detach(), x.grad


def _stacked_grads(per_expert_module, stacked_module):
    """Per-expert module's gradients stacked like the stacked module's parameters."""
    named = dict(per_expert_module.named_parameters())
    out = {}
    for name, p in stacked_module.named_parameters():
        head, _, stem = name.rpartition(".")
        prefix = head + "." if head else ""
        out[name] = (torch.stack([named[f"{prefix}{stem}{i}"].grad for i in range(G)]), p.grad)
    return out


def _check_same(a, b, x, splits, recipe):
    ya, dxa = _step(a, x, splits, recipe)
    yb, dxb = _step(b, x, splits, recipe)
    assert torch.equal(ya, yb) and torch.equal(dxa, dxb)
    for name, (want, got) in _stacked_grads(a, b).items():
        assert got is not None and got.shape == want.shape and torch.equal(got, want), name


# ------------------------------------------------------------------- CPU
@pytest.mark.parametrize("recipe", RECIPES, ids=repr)
@pytest.mark.parametrize("cls", [lpmoe.GroupedLinear, lpmoe.GroupedMLP], ids=lambda c: c.__name__)
@pytest.mark.parametrize("host", [True, False], ids=["list_splits", "tensor_splits"])
def test_stacked_equals_per_expert_cpu(cls, recipe, host):
    a, b = _pair(cls)
    assert len(list(b.parameters())) == (2 if cls is lpmoe.GroupedLinear else 4)
    x = torch.randn(100, H, dtype=torch.bfloat16)   # 4 capacity-tail rows
    splits = [32, 0, 48, 16] if host else torch.tensor([32, 0, 48, 16])
    _check_same(a, b, x, splits, recipe)


def test_state_dict_keeps_per_expert_keys_and_loads_both_ways():
    a, b = _pair(lpmoe.GroupedMLP)
    assert sorted(a.state_dict()) == sorted(b.state_dict())
    assert "linear_fc1.weight3" in b.state_dict() and "linear_fc1.weight" not in b.state_dict()
    c = lpmoe.GroupedMLP(G, H, F, bias=True, params_dtype=torch.bfloat16, device="cpu")
    c.load_state_dict(b.state_dict())                      # stacked -> per expert
    for i in range(G):
        assert torch.equal(c.linear_fc2.get_parameter(f"weight{i}"), b.linear_fc2.weight[i])
        assert torch.equal(c.linear_fc1.get_parameter(f"bias{i}"), b.linear_fc1.bias[i])
    d = lpmoe.GroupedLinear(G, H, F, bias=True, params_dtype=torch.bfloat16, device="cpu",
                            single_grouped_parameter=True)
    d.load_state_dict({"weight": b.linear_fc1.weight.detach()[:, :F] * 0 + 1, "bias": torch.zeros(G, F)})
    assert bool((d.weight == 1).all())                     # the stacked key itself loads too
    with pytest.raises(RuntimeError, match="missing weight2"):     # a missing expert is reported by name
        sd = a.linear_fc1.state_dict()
        del sd["weight2"]
        lpmoe.GroupedLinear(G, H, 2 * F, bias=True, params_dtype=torch.bfloat16, device="cpu",
                            single_grouped_parameter=True).load_state_dict(sd)


def test_stacked_expert_parallel_state_dict_numbering_single_process():
    from lpmoe.moe import MoELayer, TopKRouter
    from lpmoe.moe.expert_numbering import register_global_expert_numbering
    full = MoELayer(16, 8, 4, 1, device="cpu", params_dtype=torch.float32)
    part = MoELayer(16, 8, 2, 1, device="cpu", params_dtype=torch.float32, single_grouped_parameter=True)
    part.router = TopKRouter(16, 4, 1, device="cpu", params_dtype=torch.float32)
    register_global_expert_numbering(part, "experts.", 2, 2)      # as EP rank 1 of 2
    part.load_state_dict(full.state_dict())
    assert torch.equal(part.experts.linear_fc1.weight[0], full.experts.linear_fc1.weight2)
    assert torch.equal(part.experts.linear_fc2.weight[1], full.experts.linear_fc2.weight3)
    assert sorted(k for k in part.state_dict() if "experts" in k) == sorted(
        k for k in full.state_dict() if k.endswith(("weight2", "weight3")) and "experts" in k)


def test_stacked_main_grad_accumulates_in_the_gemm():
    a, b = _pair(lpmoe.GroupedLinear, fuse_wgrad_accumulation=True)
    flat = torch.full(b.weight.shape, 0.5)   # one buffer: both layouts take the fused epilogue
    for i in range(G):
        a.get_parameter(f"weight{i}").main_grad = flat[i]
    b.weight.main_grad = torch.full(b.weight.shape, 0.5)
    b.weight.grad_added_to_main_grad = False
    x = torch.randn(64, H, dtype=torch.bfloat16)
    for m in (a, b):
        _step(m, x, [16, 16, 0, 32], Float8BlockScaling())
    want = torch.stack([a.get_parameter(f"weight{i}").main_grad for i in range(G)])
    assert torch.equal(b.weight.main_grad, want) and not torch.equal(want, torch.full_like(want, 0.5))
    assert b.weight.grad_added_to_main_grad and b.weight.grad is not None   # TE's placeholder convention


def test_stacked_argument_errors():
    x = torch.randn(8, H, dtype=torch.bfloat16)
    w = torch.randn(G, F, H, dtype=torch.bfloat16)
    gl = lpmoe.functional.grouped_linear
    with pytest.raises(ValueError, match=r"biases with a stacked weight must be one \(4, 128\)"):
        gl(x, [8, 0, 0, 0], w, [torch.zeros(F, dtype=torch.bfloat16)] * G)
    with pytest.raises(ValueError, match="must be contiguous"):
        gl(x, [8, 0, 0, 0], torch.randn(G, H, F, dtype=torch.bfloat16).transpose(1, 2))
    with pytest.raises(ValueError, match=r"\(num_gemms, out_features, in_features\)"):
        gl(x, [8, 0, 0, 0], torch.randn(F, H, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="weights is torch.float32"):
        gl(x, [8, 0, 0, 0], w.float())
    with pytest.raises(ValueError, match=r"m_splits has 3 entries, expected one per expert \(4\)"):
        gl(x, [8, 0, 0], w)
    with pytest.raises(TypeError, match="single_grouped_parameter must be a bool"):
        lpmoe.GroupedLinear(G, H, F, device="cpu", single_grouped_parameter=1)
    LP = lpmoe.functional.LayerParams
    with pytest.raises(ValueError, match=r"fc2.weights as one tensor must be \(G=4, hidden=256, ffn=64\)"):
        lpmoe.functional.grouped_mlp(x, [8, 0, 0, 0], LP(w), LP(torch.randn(G, H, F, dtype=torch.bfloat16)))


@pytest.mark.parametrize("recipe", [None, Float8BlockScaling()], ids=repr)
def test_stacked_compiles_fullgraph_cpu(recipe):
    a, b = _pair(lpmoe.GroupedMLP)
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    c = torch.compile(b, fullgraph=True, backend=counter)
    before = dict(layer_ops.CALLS)
    for seed, splits in enumerate(([32, 0, 48, 16], [0, 0, 100, 0], [25, 25, 25, 25])):
        torch.manual_seed(seed)
        x = torch.randn(100, H, dtype=torch.bfloat16)
        s = torch.tensor(splits)
        yc, dxc = _step(c, x, s, recipe)
        gc = [p.grad for p in b.parameters()]
        ye, dxe = _step(b, x, s, recipe)
        assert torch.equal(yc, ye) and torch.equal(dxc, dxe)
        assert all(torch.equal(u, p.grad) for u, p in zip(gc, b.parameters()))
    assert counter.frame_count == 1
    assert layer_ops.CALLS["grouped_mlp"] == before["grouped_mlp"] + 3
    assert layer_ops.CALLS["grouped_mlp_backward"] == before["grouped_mlp_backward"] + 3
    assert torch._dynamo.explain(b)(torch.randn(100, H, dtype=torch.bfloat16), torch.tensor([1, 2, 3, 4])
                                    ).graph_break_count == 0


# ------------------------------------------------------------------- GPU
GPU_RECIPES = [None, Float8BlockScaling()]


@requires_cuda
@pytest.mark.parametrize("recipe", GPU_RECIPES, ids=repr)
@pytest.mark.parametrize("cls", [lpmoe.GroupedLinear, lpmoe.GroupedMLP], ids=lambda c: c.__name__)
def test_gpu_stacked_equals_per_expert_no_sync(cls, recipe):
    a, b = _pair(cls, device="cuda")
    for i, routing in enumerate(([100, 0, 250, 1], [0, 0, 0, 400], [127, 129, 0, 144])):
        torch.manual_seed(i)
        x = torch.randn(420, H, dtype=torch.bfloat16, device="cuda")
        s = torch.tensor(routing, device="cuda")
        _check_same(a, b, x, s, recipe)
    _step(b, x, s, recipe)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _step(b, x, s, recipe)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@requires_cuda
@pytest.mark.parametrize("recipe", GPU_RECIPES, ids=repr)
def test_gpu_stacked_compiled_equals_eager(recipe):
    _, b = _pair(lpmoe.GroupedMLP, device="cuda")
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    c = torch.compile(b, fullgraph=True, backend=counter)
    for i, routing in enumerate(([100, 0, 250, 1], [0, 0, 0, 400], [127, 129, 0, 144])):
        torch.manual_seed(i)
        x = torch.randn(420, H, dtype=torch.bfloat16, device="cuda")
        probs = torch.rand(420, device="cuda")
        s = torch.tensor(routing, device="cuda")
        yc, dxc = _step(c, x, s, recipe, probs)
        gc = [p.grad.clone() for p in b.parameters()]
        ye, dxe = _step(b, x, s, recipe, probs)
        assert torch.equal(yc, ye) and torch.equal(dxc, dxe)
        assert all(torch.equal(u, p.grad) for u, p in zip(gc, b.parameters()))
    assert counter.frame_count == 1


def test_ops_sequential_stacked_takes_the_fused_path_and_matches():
    from lpmoe.functional import mlp as fmlp
    from lpmoe.ops import GroupedLinear, Sequential, SwiGLU
    outs = []
    for stacked in (False, True):
        torch.manual_seed(0)
        kw = dict(bias=True, device="cpu", params_dtype=torch.bfloat16, single_grouped_parameter=stacked)
        seq = Sequential(GroupedLinear(G, H, 2 * F, **kw), SwiGLU(), GroupedLinear(G, F, H, **kw))
        x = torch.randn(64, H, dtype=torch.bfloat16, requires_grad=True)
        before = fmlp.CALLS["grouped_mlp"]
        with lpmoe.autocast(recipe=Float8BlockScaling()):
            y = seq(x, [16, 0, 40, 8])
        y.float().square().sum().backward()
        assert fmlp.CALLS["grouped_mlp"] == before + 1
        outs.append((y, x.grad, torch.cat([p.grad.reshape(-1) for p in seq.parameters()])))
    (ya, da, ga), (yb, db, gb) = outs
    assert torch.equal(ya, yb) and torch.equal(da, db) and torch.equal(ga.sort().values, gb.sort().values)
