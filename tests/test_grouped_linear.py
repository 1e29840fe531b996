"""lpmoe.GroupedLinear / lpmoe.functional.grouped_linear.

CPU tests run lpmoe's reference GEMMs (the same quantized operands as the
GPU); the requires_cuda tests run the grouped kernels, CUDA graphs and the
sync-free path.
"""
import copy

import pytest
import torch

import lpmoe
import lpmoe.functional as LF
from lpmoe.gemm import CALLS
from lpmoe.recipe import Float8BlockScaling, Format, MXFP8BlockScaling, NVFP4BlockScaling, Recipe
from lpmoe.reference import dequantize_fp8_block, quantize_fp8_block
from conftest import requires_cuda

G, K, N = 3, 128, 256  # experts, in_features, out_features (multiples of 128: every format's blocks)


def rel(a, b):
    """Norm-wise relative error of a against b."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def make_layer(dtype=torch.bfloat16, bias=True, device="cpu", seed=0, g=G, k=K, n=N):
    torch.manual_seed(seed)
    layer = lpmoe.GroupedLinear(g, k, n, bias=bias, params_dtype=dtype, device=device)
    if bias:  # non-zero biases so their contribution is checked
        with torch.no_grad():
            for b in layer.biases:
                b.normal_()
    return layer


def linear_loop(layer):
    """N separate torch.nn.Linear with the layer's parameters (copies)."""
    out = []
    for i in range(layer.num_gemms):
        lin = torch.nn.Linear(layer.in_features, layer.out_features, bias=layer.use_bias,
                              dtype=layer.params_dtype, device=layer.weight0.device)
        with torch.no_grad():
            lin.weight.copy_(layer.weights[i])
            if layer.use_bias:
                lin.bias.copy_(layer.biases[i])
        out.append(lin)
    return out


def run(layer, x, splits, dy, recipe=None, **kw):
    """Forward + backward; returns (y, dx, [dW], [db])."""
    x = x.detach().clone().requires_grad_(True)
    for p in layer.parameters():
        p.grad = None
    with lpmoe.autocast(enabled=recipe is not None, recipe=recipe):
        y = layer(x, splits, **kw)
    y.backward(dy)
    return (y.detach(), x.grad, [w.grad for w in layer.weights],
            [b.grad for b in layer.biases] if layer.use_bias else [])


def run_loop(lins, x, splits, dy):
    x = x.detach().clone().requires_grad_(True)
    rows, ys = 0, []
    for lin, m in zip(lins, splits):
        ys.append(lin(x[rows:rows + m]))
        rows += m
    y = torch.cat(ys)
    y.backward(dy[:rows])
    return y.detach(), x.grad, [l.weight.grad for l in lins], [l.bias.grad for l in lins if l.bias is not None]


SPLITS = [
    [40, 70, 18],   # uneven, no tail
    [0, 100, 20],   # an empty expert first, 8-row tail
    [64, 0, 0],     # two empty experts, 64-row tail
    [0, 0, 0],      # nothing routed: all tail
]


# ------------------------------------------------------- high precision (CPU)
@pytest.mark.parametrize("splits", SPLITS)
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_matches_separate_linears(splits, dtype, tol):
    layer = make_layer(dtype)
    rows = 128
    x = torch.randn(rows, K, dtype=dtype)
    dy = torch.randn(rows, N, dtype=dtype)  # non-zero on the tail too: those rows must not leak
    y, dx, dw, db = run(layer, x, splits, dy)
    ry, rdx, rdw, rdb = run_loop(linear_loop(layer), x, splits, dy)
    used = sum(splits)
    assert y.shape == (rows, N) and y.dtype == dtype
    if used:
        assert rel(y[:used], ry) < tol
        assert rel(dx[:used], rdx[:used]) < tol
    assert torch.all(y[used:] == 0) and torch.all(dx[used:] == 0)  # capacity tail
    for t, m in enumerate(splits):
        assert dw[t].dtype == dtype and db[t].dtype == dtype
        if m == 0:
            assert torch.all(dw[t] == 0) and torch.all(db[t] == 0)
        else:
            assert rel(dw[t], rdw[t]) < tol and rel(db[t], rdb[t]) < tol


def test_fp32_matches_linears_tightly_with_leading_dims():
    layer = make_layer(torch.float32)
    x = torch.randn(4, 32, K)  # (..., in): 128 token rows
    splits = [30, 50, 48]
    y, dx, dw, db = run(layer, x, splits, torch.ones(4, 32, N))
    ry, rdx, rdw, rdb = run_loop(linear_loop(layer), x.view(-1, K), splits, torch.ones(128, N))
    assert y.shape == (4, 32, N) and dx.shape == x.shape
    torch.testing.assert_close(y.view(-1, N), ry, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx.view(-1, K), rdx, rtol=1e-5, atol=1e-5)
    for a, b in zip(dw + db, rdw + rdb):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4)


def test_without_bias_and_with_frozen_parts():
    layer = make_layer(torch.float32, bias=False)
    assert layer.biases is None
    x = torch.randn(64, K)
    splits = [10, 20, 34]
    ry = run_loop(linear_loop(layer), x, splits, torch.zeros(64, N))[0]
    # input without grad: only weight grads
    y = layer(x, splits)
    y.sum().backward()  # .sum() hands backward an expanded (stride-0) gradient
    torch.testing.assert_close(y, ry, rtol=1e-5, atol=1e-5)
    assert all(w.grad is not None for w in layer.weights)
    # frozen weights: only the input grad
    for w in layer.weights:
        w.requires_grad_(False)
        w.grad = None
    xg = x.clone().requires_grad_(True)
    layer(xg, splits).sum().backward()
    assert xg.grad is not None and all(w.grad is None for w in layer.weights)


def test_no_grad_forward_saves_nothing_and_matches():
    layer = make_layer(torch.float32)
    x = torch.randn(64, K, requires_grad=True)
    with torch.no_grad():
        y = layer(x, [32, 0, 32])
    assert not y.requires_grad
    torch.testing.assert_close(y, layer(x, [32, 0, 32]).detach())


def test_in_place_weight_change_before_backward_is_caught():
    layer = make_layer(torch.float32)
    x = torch.randn(16, K, requires_grad=True)
    y = layer(x, [16, 0, 0])
    with torch.no_grad():
        layer.weight0.add_(1.0)  # e.g. an optimizer step between forward and backward
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


# ------------------------------------------------------------- FP8 on CPU
RECIPES = [
    Float8BlockScaling(),
    Float8BlockScaling(backward_override="dequantized"),
    Float8BlockScaling(backward_override="high_precision"),
    Float8BlockScaling(fp8_format=Format.HYBRID),
    MXFP8BlockScaling(),
    NVFP4BlockScaling(),
]


@pytest.mark.parametrize("recipe", RECIPES, ids=repr)
def test_low_precision_close_to_high_precision(recipe):
    layer = make_layer(torch.bfloat16)
    splits = [48, 0, 64]  # multiples of 16 (NVFP4)
    x = torch.randn(128, K, dtype=torch.bfloat16)
    dy = torch.randn(128, N, dtype=torch.bfloat16)
    ref = run(layer, x, splits, dy)
    got = run(layer, x, splits, dy, recipe=recipe)
    tol = 0.2 if isinstance(recipe, NVFP4BlockScaling) else 0.05  # 4-bit data: ~10% error per operand
    # E5M2 gradients keep 2 mantissa bits: about twice E4M3's error
    grad_tol = 0.1 if getattr(recipe, "fp8_format", None) is Format.HYBRID else tol
    used = sum(splits)
    assert rel(got[0][:used], ref[0][:used]) < tol
    assert rel(got[1][:used], ref[1][:used]) < grad_tol
    assert torch.all(got[0][used:] == 0) and torch.all(got[1][used:] == 0)
    for t in (0, 2):
        assert rel(got[2][t], ref[2][t]) < grad_tol
        assert rel(got[3][t], ref[3][t]) < 0.02  # bias grads come from the unquantized dy
    assert torch.all(got[2][1] == 0) and torch.all(got[3][1] == 0)
    assert rel(got[0][:used], ref[0][:used]) > 1e-4  # it did quantize


def _fake_fp8(t, block_dim, columnwise=False, fp8_dtype=torch.float8_e4m3fn):
    """Independent per-member quantize -> dequantize with lpmoe.reference (fp32 values)."""
    q = quantize_fp8_block(t, fp8_dtype=fp8_dtype, block_dim=block_dim, rowwise=not columnwise,
                           columnwise=columnwise)
    return dequantize_fp8_block(q, torch.float32).double()


def test_fp8_block_matches_composition_of_reference_calls():
    """The module's FP8 numerics, rebuilt member by member from the
    single-tensor reference: x 1x128, W 128x128, dy 1x128 rowwise for
    fprop/dgrad, the 128x1 (columnwise) copies of dy and x for wgrad."""
    layer = make_layer(torch.bfloat16)
    splits = [50, 0, 70]
    x = torch.randn(128, K, dtype=torch.bfloat16)
    dy = torch.randn(128, N, dtype=torch.bfloat16)
    y, dx, dw, db = run(layer, x, splits, dy, recipe=Float8BlockScaling())
    rows = 0
    for t, m in enumerate(splits):
        w, b = layer.weights[t].detach(), layer.biases[t].detach()
        if m == 0:
            assert torch.all(dw[t] == 0) and torch.all(db[t] == 0)
            continue
        xt, dyt = x[rows:rows + m], dy[rows:rows + m]
        w_hat = _fake_fp8(w, 2)
        y_ref = (_fake_fp8(xt, 1) @ w_hat.T + b.double()).to(torch.bfloat16)
        dx_ref = (_fake_fp8(dyt, 1) @ w_hat).to(torch.bfloat16)
        dw_ref = (_fake_fp8(dyt, 1, columnwise=True).T @ _fake_fp8(xt, 1, columnwise=True)).float().bfloat16()
        db_ref = dyt.float().sum(0).bfloat16()
        assert torch.equal(y[rows:rows + m], y_ref)
        assert torch.equal(dx[rows:rows + m], dx_ref)
        assert torch.equal(dw[t], dw_ref)
        torch.testing.assert_close(db[t], db_ref, rtol=0, atol=0)
        rows += m


def test_dequantized_override_backward_uses_forward_values():
    """backward_override='dequantized': dgrad = dy (unquantized) . W_hat."""
    layer = make_layer(torch.bfloat16)
    splits = [128, 0, 0]
    x = torch.randn(128, K, dtype=torch.bfloat16)
    dy = torch.randn(128, N, dtype=torch.bfloat16)
    _, dx, dw, _ = run(layer, x, splits, dy, recipe=Float8BlockScaling(backward_override="dequantized"))
    w_hat = _fake_fp8(layer.weight0.detach(), 2)
    assert torch.equal(dx, (dy.double() @ w_hat).bfloat16())
    assert torch.equal(dw[0], (dy.double().T @ _fake_fp8(x, 1)).float().bfloat16())


def test_high_precision_override_backward_equals_hp_backward():
    layer = make_layer(torch.bfloat16)
    splits = [30, 60, 38]
    x = torch.randn(128, K, dtype=torch.bfloat16)
    dy = torch.randn(128, N, dtype=torch.bfloat16)
    hp = run(layer, x, splits, dy)
    lp = run(layer, x, splits, dy, recipe=Float8BlockScaling(backward_override="high_precision"))
    assert not torch.equal(lp[0], hp[0])
    assert torch.equal(lp[1], hp[1])
    assert all(torch.equal(a, b) for a, b in zip(lp[2] + lp[3], hp[2] + hp[3]))


# ------------------------------------------------------------ split forms
@pytest.mark.parametrize("recipe", [None, Float8BlockScaling()], ids=repr)
def test_list_and_tensor_splits_agree_bitwise(recipe):
    layer = make_layer(torch.bfloat16)
    x = torch.randn(128, K, dtype=torch.bfloat16)
    dy = torch.randn(128, N, dtype=torch.bfloat16)
    splits = [20, 0, 90]
    results = [run(layer, x, s, dy, recipe=recipe)
               for s in (splits, tuple(splits), torch.tensor(splits), torch.tensor(splits, dtype=torch.int32))]
    for other in results[1:]:
        for a, b in zip(results[0][:2] + tuple(results[0][2] + results[0][3]),
                        other[:2] + tuple(other[2] + other[3])):
            assert torch.equal(a, b)


# ------------------------------------------------------- path proofs
class _Spy:
    """Wrap a function, recording each call's arguments."""

    def __init__(self, fn):
        self.fn, self.calls = fn, []

    def __call__(self, *a, **kw):
        self.calls.append((a, kw))
        return self.fn(*a, **kw)


# Where each function is called from (one spy per function, patched into
# every module that calls it).
SPY_SITES = {
    "grouped_gemm": ("lpmoe.functional.linear_steps",),
    "group_quantize": ("lpmoe.policy.fp8_block", "lpmoe.policy.emulated", "lpmoe.functional.weights",
                       "lpmoe.activation.kernels"),
    "group_quantize_dbias": ("lpmoe.policy.fp8_block", "lpmoe.activation.kernels"),
}


@pytest.fixture
def spies(monkeypatch):
    import importlib

    s = {}
    for name, modules in SPY_SITES.items():
        mods = [importlib.import_module(m) for m in modules]
        s[name] = _Spy(getattr(mods[0], name))
        for mod in mods:
            monkeypatch.setattr(mod, name, s[name])
    return s


def test_fp8_path_runs_quantized_gemms(spies):
    layer = make_layer(torch.bfloat16)
    before = dict(CALLS)
    run(layer, torch.randn(128, K, dtype=torch.bfloat16), [60, 0, 68], torch.randn(128, N, dtype=torch.bfloat16),
        recipe=Float8BlockScaling())
    kinds = [kw["kind"] for _, kw in spies["grouped_gemm"].calls]
    assert kinds == ["fprop", "dgrad", "wgrad"]  # bias grad fused into the dy quantization
    for a, kw in spies["grouped_gemm"].calls:
        assert a[0].is_quantized and a[1].is_quantized, kw["kind"]
    quantizers = [a[1] for a, _ in spies["group_quantize"].calls]
    assert [(q.block_dim, q.rowwise, q.columnwise) for q in quantizers] == [(1, True, True), (2, True, True)]
    assert len(spies["group_quantize_dbias"].calls) == 1
    assert CALLS["reference"] - before["reference"] == 3


def test_hp_path_counts_and_bias_grad_gemm(spies):
    layer = make_layer(torch.bfloat16)
    before = dict(CALLS)
    run(layer, torch.randn(128, K, dtype=torch.bfloat16), [60, 0, 68], torch.randn(128, N, dtype=torch.bfloat16))
    kinds = [kw["kind"] for _, kw in spies["grouped_gemm"].calls]
    assert kinds == ["fprop", "dgrad", "wgrad", "wgrad"]  # the last one: bias grad against ones
    assert not spies["group_quantize"].calls and not spies["group_quantize_dbias"].calls
    assert all(not a[0].is_quantized for a, _ in spies["grouped_gemm"].calls)
    assert CALLS["reference"] - before["reference"] == 4


def test_fp8_bias_grad_without_dgrad_uses_the_gemm_method(spies):
    layer = make_layer(torch.bfloat16)
    x = torch.randn(128, K, dtype=torch.bfloat16)  # no requires_grad: no dgrad
    with lpmoe.autocast(recipe=Float8BlockScaling()):
        y = layer(x, [60, 0, 68])
    y.backward(torch.randn_like(y))
    kinds = [kw["kind"] for _, kw in spies["grouped_gemm"].calls]
    assert kinds == ["fprop", "wgrad", "wgrad"] and not spies["group_quantize_dbias"].calls
    assert torch.all(layer.bias1.grad == 0)


@pytest.mark.parametrize("recipe", [MXFP8BlockScaling(), NVFP4BlockScaling()], ids=repr)
def test_emulated_recipes_quantize_x_w_and_dy(spies, recipe):
    layer = make_layer(torch.bfloat16)
    run(layer, torch.randn(128, K, dtype=torch.bfloat16), [64, 0, 64], torch.randn(128, N, dtype=torch.bfloat16),
        recipe=recipe)
    fmts = [type(a[1]).__name__ for a, _ in spies["group_quantize"].calls]
    assert len(fmts) == 3 and len(set(fmts)) == 1  # x, W in forward; dy in backward
    assert all(not a[0].is_quantized for a, _ in spies["grouped_gemm"].calls)  # emulation: hp GEMMs


# --------------------------------------------------------- weight caching
def test_is_first_microbatch_caches_fp8_weights(spies):
    layer = make_layer(torch.bfloat16)
    x = torch.randn(64, K, dtype=torch.bfloat16)
    splits = [64, 0, 0]
    n_weight_quant = lambda: sum(1 for a, _ in spies["group_quantize"].calls if a[1].block_dim == 2)  # noqa: E731
    with lpmoe.autocast(recipe=Float8BlockScaling()):
        y1 = layer(x, splits, is_first_microbatch=True)
        cached = layer.weight_cache.quantized
        assert cached is not None and n_weight_quant() == 1
        with torch.no_grad():
            layer.weight0.mul_(2)
        y2 = layer(x, splits, is_first_microbatch=False)  # reuses the stale cache on purpose
        assert n_weight_quant() == 1 and torch.equal(y1, y2)
        y3 = layer(x, splits, is_first_microbatch=True)  # refreshed in place
        assert n_weight_quant() == 2 and layer.weight_cache.quantized is cached
        assert spies["group_quantize"].calls[-1][1]["output"] is cached
        assert rel(y3, 2 * y1 - layer.bias0.detach()) < 0.02
        y4 = layer(x, splits)  # None: quantize now, cache untouched
        assert n_weight_quant() == 3 and torch.equal(y3, y4) and layer.weight_cache.quantized is cached


def test_cache_is_dropped_on_load_and_move():
    layer = make_layer(torch.bfloat16)
    x = torch.randn(64, K, dtype=torch.bfloat16)
    with lpmoe.autocast(recipe=Float8BlockScaling()):
        layer(x, [64, 0, 0], is_first_microbatch=True)
    assert layer.weight_cache.quantized is not None
    layer.load_state_dict(make_layer(torch.bfloat16, seed=1).state_dict())
    assert layer.weight_cache.quantized is None
    with lpmoe.autocast(recipe=Float8BlockScaling()):
        layer(x, [64, 0, 0], is_first_microbatch=False)  # no cache yet: quantizes
    assert layer.weight_cache.quantized is not None
    layer.to(torch.bfloat16)
    assert layer.weight_cache.quantized is None


def test_functional_caching_needs_a_cache():
    w = [torch.randn(N, K, dtype=torch.bfloat16) for _ in range(G)]
    with pytest.raises(ValueError, match="weight_cache"):
        LF.grouped_linear(torch.randn(8, K, dtype=torch.bfloat16), [8, 0, 0], w, is_first_microbatch=True)


# ----------------------------------------------------------- state dicts
def test_state_dict_uses_te_keys_and_round_trips():
    layer = make_layer(torch.float32)
    sd = layer.state_dict()
    assert list(sd) == [f"{p}{i}" for i in range(G) for p in ("weight", "bias")]
    fresh = lpmoe.GroupedLinear(G, K, N, params_dtype=torch.float32, device="cpu")
    fresh.load_state_dict(sd)
    x = torch.randn(32, K)
    assert torch.equal(fresh(x, [10, 12, 10]), layer(x, [10, 12, 10]))
    no_bias = lpmoe.GroupedLinear(G, K, N, bias=False, device="cpu")
    assert list(no_bias.state_dict()) == [f"weight{i}" for i in range(G)]


def test_te_checkpoint_extra_state_is_accepted():
    sd = dict(make_layer(torch.float32).state_dict())
    sd["_extra_state"] = torch.empty(0)  # what TE modules add
    lpmoe.GroupedLinear(G, K, N, params_dtype=torch.float32, device="cpu").load_state_dict(sd, strict=True)


def test_init():
    layer = lpmoe.GroupedLinear(2, 128, 64, device="cpu")
    assert layer.params_dtype == torch.get_default_dtype()
    bound = 1 / 128 ** 0.5  # kaiming_uniform(a=sqrt(5)) on fan_in 128, as nn.Linear
    assert all(w.abs().max() <= bound and w.std() > bound / 4 for w in layer.weights)
    assert all(torch.all(b == 0) for b in layer.biases)
    assert not torch.equal(layer.weight0, layer.weight1)
    custom = lpmoe.GroupedLinear(2, 128, 64, device="cpu", init_method=torch.nn.init.ones_)
    assert all(torch.all(w == 1) for w in custom.weights)
    with pytest.raises(ValueError, match="num_gemms"):
        lpmoe.GroupedLinear(0, 128, 64, device="cpu")


# ------------------------------------------------------- recipe switching
def test_recipe_switching_between_calls():
    layer = make_layer(torch.bfloat16)
    x = torch.randn(96, K, dtype=torch.bfloat16)
    splits = [32, 32, 32]
    hp = layer(x, splits)
    with lpmoe.autocast(recipe=Float8BlockScaling()):
        fp8 = layer(x, splits)
        with lpmoe.autocast(enabled=False):
            assert torch.equal(layer(x, splits), hp)
        with lpmoe.autocast(recipe=MXFP8BlockScaling()):
            mx = layer(x, splits)
    assert torch.equal(layer(x, splits), hp)
    with lpmoe.autocast(recipe=Float8BlockScaling()):
        assert torch.equal(layer(x, splits), fp8)
    assert not torch.equal(fp8, hp) and rel(fp8, hp) < 0.05 and rel(mx, hp) < 0.05


def test_backward_uses_the_forward_recipe(spies):
    layer = make_layer(torch.bfloat16)
    x = torch.randn(64, K, dtype=torch.bfloat16, requires_grad=True)
    with lpmoe.autocast(recipe=Float8BlockScaling()):
        y = layer(x, [64, 0, 0])
    y.backward(torch.randn_like(y))  # outside the autocast block
    assert [a[0].is_quantized for a, _ in spies["grouped_gemm"].calls] == [True, True, True]


# ---------------------------------------------------------------- errors
def _layer_and_input(dtype=torch.bfloat16):
    return make_layer(dtype), torch.randn(64, K, dtype=dtype)


@pytest.mark.parametrize("splits, exc, msg", [
    ([32, 32], ValueError, "per expert"),
    (torch.tensor([32, 32]), ValueError, "per expert"),
    (torch.tensor([[32, 32, 0]]), ValueError, "per expert"),
    (torch.tensor([32.0, 32.0, 0.0]), TypeError, "int32/int64"),
    ([32.0, 32, 0], TypeError, "ints"),
    ([True, 32, 0], TypeError, "ints"),
    ("32,32,0", TypeError, "list of ints"),
    ([40, -8, 32], ValueError, "non-negative"),
    (torch.tensor([40, -8, 32]), ValueError, "non-negative"),
    ([40, 20, 8], ValueError, "exceeds"),
])
def test_bad_splits_raise_before_any_work(spies, splits, exc, msg):
    layer, x = _layer_and_input()
    with pytest.raises(exc, match=msg):
        layer(x, splits)
    assert not spies["grouped_gemm"].calls and not spies["group_quantize"].calls


@pytest.mark.parametrize("recipe", [None, Float8BlockScaling()], ids=repr)
def test_bad_inputs_raise(spies, recipe):
    layer, x = _layer_and_input()
    qx = lpmoe.group_quantize(x, lpmoe.Float8BlockQuantizer(), num_tensors=G,
                              first_dims=torch.tensor([64, 0, 0]))
    spies["group_quantize"].calls.clear()
    with lpmoe.autocast(enabled=recipe is not None, recipe=recipe):
        with pytest.raises(ValueError, match="in_features"):
            layer(torch.randn(64, K + 16, dtype=torch.bfloat16), [64, 0, 0])
        with pytest.raises(TypeError, match="GroupedTensor"):
            layer(qx, [64, 0, 0])
        with pytest.raises(TypeError, match="quantized"):
            layer(x.to(torch.float8_e4m3fn), [64, 0, 0])
        with pytest.raises(TypeError, match="quantized"):
            layer(qx.rowwise_data, [64, 0, 0])  # raw FP8 bytes
        with pytest.raises(ValueError, match="in_features"):
            layer(torch.randn(K, dtype=torch.bfloat16), [1, 0, 0])
        with pytest.raises(TypeError, match="float32"):
            layer(x.float(), [64, 0, 0])  # params are bf16
    assert not spies["grouped_gemm"].calls and not spies["group_quantize"].calls


def test_fp32_params_with_fp8_block_raise():
    layer, x = _layer_and_input(torch.float32)
    with lpmoe.autocast(recipe=Float8BlockScaling()):
        with pytest.raises(TypeError, match="bf16"):
            layer(x, [64, 0, 0])
    layer(x, [64, 0, 0])  # fine without the recipe


def test_unsupported_recipes_raise():
    class MyRecipe(Recipe):
        pass

    layer, x = _layer_and_input()
    with lpmoe.autocast(recipe=MyRecipe()):
        with pytest.raises(TypeError, match="unsupported recipe"):
            layer(x, [64, 0, 0])
    with lpmoe.autocast(recipe=Float8BlockScaling(x_block_dim=2, w_block_dim=1)):
        with pytest.raises(NotImplementedError, match="1x128"):
            layer(x, [64, 0, 0])
    with lpmoe.autocast(recipe=NVFP4BlockScaling()):
        with pytest.raises(ValueError, match="multiple of 16"):
            layer(x, [60, 4, 0])
    odd = lpmoe.GroupedLinear(G, 40, N, params_dtype=torch.bfloat16, device="cpu")
    with lpmoe.autocast(recipe=Float8BlockScaling()):
        with pytest.raises(ValueError, match="multiples of 16"):
            odd(torch.randn(8, 40, dtype=torch.bfloat16), [8, 0, 0])


def test_bad_params_raise():
    x = torch.randn(8, K)
    w = [torch.randn(N, K) for _ in range(G)]
    with pytest.raises(TypeError, match="weights"):
        LF.grouped_linear(x, [8, 0, 0], [])
    with pytest.raises(ValueError, match="weights\\[1\\]"):
        LF.grouped_linear(x, [8, 0, 0], [w[0], w[1][:, :64], w[2]])
    with pytest.raises(ValueError, match="biases\\[0\\]"):
        LF.grouped_linear(x, [8, 0, 0], w, [torch.zeros(N + 1)] * G)
    with pytest.raises(TypeError, match="biases"):
        LF.grouped_linear(x, [8, 0, 0], w, [torch.zeros(N)] * 2)


def test_functional_reads_autocast_when_recipe_is_none(spies):
    w = [torch.randn(N, K, dtype=torch.bfloat16) for _ in range(G)]
    x = torch.randn(16, K, dtype=torch.bfloat16)
    with lpmoe.autocast(recipe=Float8BlockScaling()):
        LF.grouped_linear(x, [16, 0, 0], w)
    assert spies["grouped_gemm"].calls[-1][0][0].is_quantized


# ===================================================================== GPU
def _cuda_layer(dtype=torch.bfloat16, g=4, k=256, n=512):
    return make_layer(dtype, device="cuda", g=g, k=k, n=n)


@requires_cuda
@pytest.mark.parametrize("splits", [[256, 0, 384, 128], [0, 0, 0, 0], [1, 17, 300, 100]])
def test_cuda_bf16_matches_separate_linears(splits):
    layer = _cuda_layer()
    rows = 800
    x = torch.randn(rows, 256, dtype=torch.bfloat16, device="cuda")
    dy = torch.randn(rows, 512, dtype=torch.bfloat16, device="cuda")
    before = CALLS["grouped"]
    y, dx, dw, db = run(layer, x, torch.tensor(splits, device="cuda"), dy)
    assert CALLS["grouped"] - before == 4  # fprop, dgrad, wgrad, bias grad: all sync-free kernels
    ry, rdx, rdw, rdb = run_loop(linear_loop(layer), x, splits, dy)
    used = sum(splits)
    if used:
        assert rel(y[:used], ry) < 1e-2 and rel(dx[:used], rdx[:used]) < 1e-2
    assert torch.all(y[used:] == 0) and torch.all(dx[used:] == 0)
    for t, m in enumerate(splits):
        if m:
            assert rel(dw[t], rdw[t]) < 1e-2 and rel(db[t], rdb[t]) < 1e-2
        else:
            assert torch.all(dw[t] == 0) and torch.all(db[t] == 0)


@requires_cuda
@pytest.mark.parametrize("recipe", [Float8BlockScaling(), Float8BlockScaling(backward_override="dequantized"),
                                    MXFP8BlockScaling(), NVFP4BlockScaling()], ids=repr)
def test_cuda_low_precision_close_to_bf16(recipe):
    layer = _cuda_layer()
    splits = torch.tensor([256, 0, 384, 128], device="cuda")
    x = torch.randn(800, 256, dtype=torch.bfloat16, device="cuda")
    dy = torch.randn(800, 512, dtype=torch.bfloat16, device="cuda")
    ref = run(layer, x, splits, dy)
    got = run(layer, x, splits, dy, recipe=recipe)
    tol = 0.2 if isinstance(recipe, NVFP4BlockScaling) else 0.05
    assert rel(got[0], ref[0]) < tol and rel(got[1], ref[1]) < tol
    for t in (0, 2, 3):
        assert rel(got[2][t], ref[2][t]) < tol and rel(got[3][t], ref[3][t]) < 0.02
    assert torch.all(got[0][768:] == 0) and torch.all(got[1][768:] == 0)


@requires_cuda
@pytest.mark.parametrize("recipe", [None, Float8BlockScaling()], ids=repr)
def test_cuda_graph_safe_and_host_paths_agree_bitwise(recipe):
    # Small groups: grouped_gemm's auto backend runs the grouped kernels on
    # both paths (with host splits it picks cuBLASLt for FP8 groups averaging
    # >= 2048 tokens, which rounds differently).
    layer = _cuda_layer()
    splits = [256, 0, 384, 128]
    x = torch.randn(800, 256, dtype=torch.bfloat16, device="cuda")
    dy = torch.randn(800, 512, dtype=torch.bfloat16, device="cuda")
    a = run(layer, x, torch.tensor(splits, device="cuda"), dy, recipe=recipe)
    b = run(layer, x, splits, dy, recipe=recipe)
    for u, v in zip(a[:2] + tuple(a[2] + a[3]), b[:2] + tuple(b[2] + b[3])):
        assert torch.equal(u, v)


@requires_cuda
@pytest.mark.parametrize("recipe", [None, Float8BlockScaling()], ids=repr)
def test_cuda_graph_safe_path_never_syncs(recipe):
    layer = _cuda_layer()
    splits = torch.tensor([256, 0, 384, 128], device="cuda")
    x = torch.randn(800, 256, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    dy = torch.randn(800, 512, dtype=torch.bfloat16, device="cuda")
    with lpmoe.autocast(enabled=recipe is not None, recipe=recipe):
        layer(x, splits).backward(dy)  # warm-up: workspaces, pointer tables
        torch.cuda.synchronize()
        old = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for first in (None, True, False):
                layer(x, splits, is_first_microbatch=first).backward(dy)
        finally:
            torch.cuda.set_sync_debug_mode(old)
    torch.cuda.synchronize()


@requires_cuda
@pytest.mark.parametrize("recipe", [None, Float8BlockScaling()], ids=repr)
def test_cuda_graphed_layer_replays_new_data_and_routing(recipe):
    layer = _cuda_layer()
    eager = copy.deepcopy(layer)
    rows = 1024
    x0 = torch.randn(rows, 256, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    s0 = torch.tensor([256, 256, 256, 256], device="cuda")
    with lpmoe.autocast(enabled=recipe is not None, recipe=recipe):
        graphed = torch.cuda.make_graphed_callables(layer, (x0, s0))

    def step(mod, x, s, dy):
        for p in mod.parameters():
            p.grad = None
        x = x.detach().clone().requires_grad_(True)
        with lpmoe.autocast(enabled=recipe is not None, recipe=recipe):
            y = mod(x, s)
        y.backward(dy)
        return [y.detach().clone(), x.grad.clone()] + [p.grad.clone() for p in mod.parameters()]

    gen = torch.Generator(device="cuda").manual_seed(1)
    first = None
    for i in range(1000):
        # same total, new routing each step (an empty expert included)
        cuts = torch.sort(torch.randint(0, rows + 1, (3,), device="cuda", generator=gen)).values
        bounds = torch.cat([torch.zeros(1, dtype=torch.int64, device="cuda"), cuts,
                            torch.full((1,), rows, dtype=torch.int64, device="cuda")])
        s = (bounds[1:] - bounds[:-1]) if i % 2 else torch.tensor([0, 512, 0, 512], device="cuda")
        x = torch.randn(rows, 256, dtype=torch.bfloat16, device="cuda", generator=gen)
        dy = torch.randn(rows, 512, dtype=torch.bfloat16, device="cuda", generator=gen)
        got = step(graphed, x, s, dy)
        if i < 5 or i % 250 == 0:
            want = step(eager, x, s, dy)
            for a, b in zip(got, want):
                assert torch.equal(a, b), f"replay {i}"
        if i == 0:
            first = (x, s, dy, got)
    x, s, dy, got0 = first
    for a, b in zip(step(graphed, x, s, dy), got0):  # stable after 1000 replays
        assert torch.equal(a, b)


@requires_cuda
def test_cuda_hybrid_runs_on_the_host_path():
    layer = _cuda_layer()
    splits = [256, 0, 384, 128]  # multiples of 4: cuBLASLt's FP8 block scaling
    x = torch.randn(800, 256, dtype=torch.bfloat16, device="cuda")
    dy = torch.randn(800, 512, dtype=torch.bfloat16, device="cuda")
    ref = run(layer, x, splits, dy)
    before = CALLS["cublas"]
    got = run(layer, x, splits, dy, recipe=Float8BlockScaling(fp8_format=Format.HYBRID))
    assert CALLS["cublas"] - before >= 2  # E5M2 dgrad and wgrad
    assert rel(got[0], ref[0]) < 0.05 and rel(got[1], ref[1]) < 0.1
    assert all(rel(got[2][t], ref[2][t]) < 0.1 for t in (0, 2, 3))


@requires_cuda
def test_cuda_errors_before_gpu_work():
    layer = _cuda_layer()
    x = torch.randn(64, 256, dtype=torch.bfloat16, device="cuda")
    dev_splits = torch.tensor([64, 0, 0, 0], device="cuda")
    with lpmoe.autocast(recipe=Float8BlockScaling(fp8_format=Format.HYBRID)):
        with pytest.raises(ValueError, match="E5M2"):
            layer(x, dev_splits)
    cpu_layer = make_layer(torch.bfloat16, g=4, k=256, n=512)
    with pytest.raises(ValueError, match="m_splits is on cuda"):
        cpu_layer(x.cpu(), dev_splits)
    f32 = _cuda_layer(torch.float32)
    with pytest.raises(TypeError, match="fp32"):
        f32(x.float(), dev_splits)
    f32(x.float(), [64, 0, 0, 0])  # host path: cuBLASLt


def test_fp8_block_on_a_non_hopper_gpu_names_the_alternative(monkeypatch):
    import lpmoe.functional.checks as checks
    from lpmoe.functional.splits import Splits

    monkeypatch.setattr(checks, "_cuda_major", lambda device: 10)
    splits = Splits(torch.zeros(2, dtype=torch.int64), [0, 0])
    with pytest.raises(RuntimeError, match="Hopper.*MXFP8BlockScaling"):
        checks.check_recipe(Float8BlockScaling(), torch.bfloat16, 128, 128, splits, True, torch.device("cuda", 0))
    checks.check_recipe(None, torch.bfloat16, 128, 128, splits, True, torch.device("cuda", 0))  # bf16 is fine


# ------------------------------------------- fused wgrad accumulation (main_grad)
def _set_main_grads(layer, flat: bool, marker: bool):
    """fp32 main_grads with non-zero contents: one (G, out, in) buffer
    (a framework's flat gradient buffer) or separate tensors."""
    g, n, k = layer.num_gemms, layer.out_features, layer.in_features
    dev = layer.weight0.device
    init = torch.randn(g, n, k, device=dev)
    buf = init.clone() if flat else None
    for i, w in enumerate(layer.weights):
        w.main_grad = buf[i] if flat else init[i].clone()
        if marker:
            w.grad_added_to_main_grad = False
    return init


@pytest.mark.parametrize("flat", [True, False], ids=["one-buffer", "separate"])
@pytest.mark.parametrize("recipe", [None, Float8BlockScaling()], ids=repr)
def test_fused_wgrad_accumulation_adds_into_main_grad(flat, recipe):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ref_layer = make_layer(device=device)
    layer = make_layer(device=device)
    layer.fuse_wgrad_accumulation = True
    splits = [40, 0, 88]
    x = torch.randn(128, K, dtype=torch.bfloat16, device=device)
    dy = torch.randn(128, N, dtype=torch.bfloat16, device=device)
    init = _set_main_grads(layer, flat, marker=False)
    y, dx, _, db = run(layer, x, splits, dy, recipe=recipe)
    ry, rdx, rdw, rdb = run(ref_layer, x, splits, dy, recipe=recipe)  # the usual (bf16) weight gradients
    assert torch.equal(y, ry) and torch.equal(dx, rdx)
    assert all(w.grad is None for w in layer.weights)  # no marker attribute: autograd gets None
    assert all(torch.equal(u, v) for u, v in zip(db, rdb))  # biases keep their usual gradients
    for i in range(G):
        gained = layer.weights[i].main_grad - init[i]
        if splits[i] == 0:
            assert torch.equal(layer.weights[i].main_grad, init[i])  # empty expert: untouched
        else:
            assert rel(gained, rdw[i].float()) < 1e-2  # the reference is rounded to bf16


def test_fused_wgrad_accumulation_one_buffer_and_separate_agree():
    # GPU: the epilogue adds the fp32 product exactly as the separate add
    # does (bitwise).  CPU: the fp64 reference rounds the fused sum once.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = []
    for flat in (True, False):
        layer = make_layer(device=device)
        layer.fuse_wgrad_accumulation = True
        _set_main_grads(layer, flat, marker=False)
        torch.manual_seed(3)
        x = torch.randn(100, K, dtype=torch.bfloat16, device=device)
        dy = torch.randn(100, N, dtype=torch.bfloat16, device=device)
        with lpmoe.autocast(recipe=Float8BlockScaling()):
            layer(x.requires_grad_(True), torch.tensor([30, 50, 20], device=device)).backward(dy)
        out.append(torch.stack([w.main_grad for w in layer.weights]))
    if device == "cuda":
        assert torch.equal(out[0], out[1])
    else:
        assert rel(out[0], out[1]) < 1e-6


def test_fused_wgrad_accumulation_placeholder_and_marker():
    # TE's convention, which Megatron's gradient hooks rely on: weights with a
    # grad_added_to_main_grad attribute get a placeholder gradient and the flag.
    layer = make_layer(bias=False)
    layer.fuse_wgrad_accumulation = True
    _set_main_grads(layer, flat=True, marker=True)
    layer.weight1.zero_out_wgrad = True
    x = torch.randn(64, K, dtype=torch.bfloat16, requires_grad=True)
    layer(x, [32, 16, 16]).backward(torch.randn(64, N, dtype=torch.bfloat16))
    assert all(w.grad_added_to_main_grad for w in layer.weights)
    assert all(w.grad is not None and w.grad.shape == w.shape for w in layer.weights)
    assert torch.all(layer.weight1.grad == 0)


def test_fused_wgrad_accumulation_needs_main_grads(spies):
    layer = lpmoe.GroupedLinear(G, K, N, params_dtype=torch.bfloat16, device="cpu", fuse_wgrad_accumulation=True)
    assert "fuse_wgrad_accumulation=True" in repr(layer)
    x = torch.randn(64, K, dtype=torch.bfloat16)
    with pytest.raises(AttributeError, match=r"weights\[0\]\.main_grad"):
        layer(x, [64, 0, 0])
    _set_main_grads(layer, flat=True, marker=False)
    layer.weight2.main_grad = torch.zeros(N, K, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"weights\[2\]\.main_grad must be fp32"):
        layer(x, [64, 0, 0])
    assert not spies["grouped_gemm"].calls and not spies["group_quantize"].calls
    with torch.no_grad():  # inference needs no main_grad
        layer(x, [64, 0, 0])
    with pytest.raises(TypeError, match="fuse_wgrad_accumulation must be a bool"):
        lpmoe.GroupedLinear(G, K, N, device="cpu", fuse_wgrad_accumulation=1)


@requires_cuda
@pytest.mark.parametrize("flat", [True, False], ids=["one-buffer", "separate"])
def test_cuda_fused_wgrad_accumulation_never_syncs(flat):
    layer = _cuda_layer()
    layer.fuse_wgrad_accumulation = True
    _set_main_grads(layer, flat, marker=True)
    splits = torch.tensor([256, 0, 384, 128], device="cuda")
    x = torch.randn(800, 256, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    dy = torch.randn(800, 512, dtype=torch.bfloat16, device="cuda")
    with lpmoe.autocast(recipe=Float8BlockScaling()):
        layer(x, splits).backward(dy)  # warm-up
        torch.cuda.synchronize()
        before = torch.stack([w.main_grad for w in layer.weights]).clone()
        old = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            layer(x, splits).backward(dy)
        finally:
            torch.cuda.set_sync_debug_mode(old)
    gained = torch.stack([w.main_grad for w in layer.weights]) - before
    assert torch.all(gained[1] == 0) and all(gained[t].abs().sum() > 0 for t in (0, 2, 3))
