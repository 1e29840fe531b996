"""lpmoe.GroupedLinear / lpmoe.functional.grouped_linear on the CPU: against
separate torch.nn.Linear, the recipes against the reference composition,
split forms, which path ran, weight caching, state dicts, recipe switching.

CPU tests run lpmoe's reference GEMMs (the same quantized operands as the
GPU).  Bad-input errors: test_grouped_linear_errors.py; the GPU kernels,
CUDA graphs and the sync-free path: test_grouped_linear_cuda.py; main_grad
accumulation: test_grouped_linear_main_grad.py.
"""
import pytest
import torch

import lpmoe
import lpmoe.functional as LF
from lpmoe.gemm import CALLS
from lpmoe.recipe import Float8BlockScaling, Format, MXFP8BlockScaling, NVFP4BlockScaling
from lpmoe.reference import dequantize_fp8_block, quantize_fp8_block
from _grouped_linear_common import G, K, N, SPLITS, linear_loop, make_layer, rel, run, run_loop
from _grouped_linear_common import spies  # noqa: F401  (a fixture)


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



@pytest.mark.parametrize("splits", [[480, 0, 544], [60, 0, 68]])
def test_fp8_path_runs_quantized_gemms(spies, splits):
    layer = make_layer(torch.bfloat16)
    before = dict(CALLS)
    rows = sum(splits)
    run(layer, torch.randn(rows, K, dtype=torch.bfloat16), splits, torch.randn(rows, N, dtype=torch.bfloat16),
        recipe=Float8BlockScaling())
    for a, kw in spies["grouped_gemm"].calls:
        assert a[0].is_quantized and a[1].is_quantized, kw["kind"]
    # x (1x128, both copies), W (128x128), then dy one direction at a time, just
    # before its GEMM, the first pass with the bias gradient: wgrad first with
    # more rows than G*N (1024 > 768), else dgrad first (linear_steps.dgrad_first)
    steps = [(name, kw["kind"]) if name == "grouped_gemm" else (name, a[1].block_dim, a[1].rowwise, a[1].columnwise)
             for name, a, kw in spies["log"]]
    fwd = [("group_quantize", 1, True, True), ("group_quantize", 2, True, True), ("grouped_gemm", "fprop")]
    if rows > G * N:
        assert steps == fwd + [("group_quantize_dbias", 1, False, True), ("grouped_gemm", "wgrad"),
                               ("group_quantize", 1, True, False), ("grouped_gemm", "dgrad")]
    else:
        assert steps == fwd + [("group_quantize_dbias", 1, True, False), ("grouped_gemm", "dgrad"),
                               ("group_quantize", 1, False, True), ("grouped_gemm", "wgrad")]
    assert CALLS["reference"] - before["reference"] == 3


def test_fp8_dy_copies_die_with_their_gemm(monkeypatch):
    """The backward never holds both FP8 copies of dy: the transposed one is
    gone when the rowwise one is made."""
    import weakref

    import lpmoe.policy.fp8_block as fp8_policy
    made, alive_at_second = [], []
    real = fp8_policy.group_quantize_dbias, fp8_policy.group_quantize

    def watch(fn):
        def wrapped(x, q, *a, **kw):
            out = fn(x, q, *a, **kw)
            if q.block_dim == 1 and x.shape[-1] == N:  # dy (x has K columns, W is 128x128)
                if made:
                    alive_at_second.append(made[0]() is not None)
                gt = out[0] if isinstance(out, tuple) else out
                made.append(weakref.ref(gt.columnwise_data if gt.columnwise_data is not None else gt.rowwise_data))
            return out
        return wrapped
    monkeypatch.setattr(fp8_policy, "group_quantize_dbias", watch(real[0]))
    monkeypatch.setattr(fp8_policy, "group_quantize", watch(real[1]))
    layer = make_layer(torch.bfloat16)
    run(layer, torch.randn(128, K, dtype=torch.bfloat16), [60, 0, 68], torch.randn(128, N, dtype=torch.bfloat16),
        recipe=Float8BlockScaling())
    assert len(made) == 2 and alive_at_second == [False]


def test_hp_path_counts_and_bias_grad_gemm(spies):
    layer = make_layer(torch.bfloat16)
    before = dict(CALLS)
    run(layer, torch.randn(128, K, dtype=torch.bfloat16), [60, 0, 68], torch.randn(128, N, dtype=torch.bfloat16))
    kinds = [kw["kind"] for _, kw in spies["grouped_gemm"].calls]
    assert kinds == ["fprop", "wgrad", "dgrad", "wgrad"]  # the last one: bias grad against ones
    assert not spies["group_quantize"].calls and not spies["group_quantize_dbias"].calls
    assert all(not a[0].is_quantized for a, _ in spies["grouped_gemm"].calls)
    assert CALLS["reference"] - before["reference"] == 4


def test_fp8_bias_grad_without_dgrad_is_fused_into_the_wgrad_quantization(spies):
    layer = make_layer(torch.bfloat16)
    x = torch.randn(128, K, dtype=torch.bfloat16)  # no requires_grad: no dgrad
    with lpmoe.autocast(recipe=Float8BlockScaling()):
        y = layer(x, [60, 0, 68])
    y.backward(torch.randn_like(y))
    kinds = [kw["kind"] for _, kw in spies["grouped_gemm"].calls]
    assert kinds == ["fprop", "wgrad"]
    (a, _), = spies["group_quantize_dbias"].calls
    assert (a[1].rowwise, a[1].columnwise) == (False, True)
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
