"""Parameters in another dtype than the compute dtype, under torch.autocast
(lpmoe.functional.precision): fp32 parameters with bf16 compute, the usual
PyTorch mixed precision; GroupedLinear (the MLP and the MoE layer:
test_mixed_precision_mlp.py).

Each test states the exact semantics as an explicit composition of public
lpmoe calls (the bf16 layer on cast weights, or grouped_gemm on quantized
operands) and checks the layer against it bit for bit; CPU runs the
reference kernels, GPU (``*_gpu``) the graph-safe kernels."""
import pytest
import torch

import lpmoe
from _mixed_precision_common import BF16, G, K, N, SPLITS, devices, fp32_layer, grads, run, splits_on
from conftest import requires_cuda
from lpmoe.functional.precision import autocast_dtype
from lpmoe.policy.base import grouped_rows
from lpmoe.recipe import Float8BlockScaling, MXFP8BlockScaling


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("stacked", [False, True], ids=["per_expert", "stacked"])
def test_bf16_compute_of_fp32_params_equals_cast_layer(device, stacked):
    """No recipe: y and dx are the bf16 layer's on the cast parameters; the
    weight gradient is the wgrad GEMM's fp32 result itself (not rounded to
    bf16); the bias gradient the fp32 column sums."""
    m = fp32_layer(device, stacked)
    x = torch.randn(sum(SPLITS) + 7, K, device=device)  # fp32 input: cast to bf16 by the layer
    dy = torch.randn(x.shape[0], N, device=device, dtype=BF16)
    y, dx = run(m, x, dy, splits_on(device), None)
    dw, db = grads(m)
    assert y.dtype == BF16 and dx.dtype == torch.float32
    assert all(g.dtype == torch.float32 for g in dw + db)

    ref = lpmoe.GroupedLinear(G, K, N, bias=True, params_dtype=BF16, device=device)
    with torch.no_grad():
        for a, b in zip(ref.weights + ref.biases, m.weights + m.biases):
            a.copy_(b)  # rounded to bf16 once, as the layer casts them
    xb = x.to(BF16).requires_grad_(True)
    y_ref = ref(xb, splits_on(device))
    y_ref.backward(dy)
    assert torch.equal(y, y_ref)
    assert torch.equal(dx, xb.grad.float())
    sd = torch.tensor(SPLITS, device=device)
    dw_ref = lpmoe.grouped_gemm(grouped_rows(dy, sd), grouped_rows(xb.detach(), sd), kind="wgrad",
                                out_dtype=torch.float32)
    assert torch.equal(torch.stack(dw), dw_ref)
    assert not torch.equal(torch.stack(dw), dw_ref.to(BF16).float())  # fp32 bits, not bf16 ones
    ones = torch.ones(x.shape[0], 16, device=device, dtype=BF16)
    db_ref = lpmoe.grouped_gemm(grouped_rows(dy, sd), grouped_rows(ones, sd), kind="wgrad",
                                out_dtype=torch.float32)[:, :, 0]
    assert torch.equal(torch.stack(db), db_ref)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("stacked", [False, True], ids=["per_expert", "stacked"])
def test_fp8_of_fp32_params_quantizes_them_directly(device, stacked):
    """Float8BlockScaling: the weights go to FP8 from fp32 in one rounding
    (no bf16 copy in between); every GEMM is the grouped_gemm of the
    recipe's quantized operands; weight gradients come out of the FP8 wgrad
    GEMM in fp32; the bias gradient is the one the dy quantization fuses."""
    recipe = Float8BlockScaling()
    m = fp32_layer(device, stacked)
    x = torch.randn(sum(SPLITS), K, device=device, dtype=BF16)
    dy = torch.randn(x.shape[0], N, device=device, dtype=BF16)
    y, dx = run(m, x, dy, splits_on(device), recipe)
    dw, db = grads(m)
    assert dx.dtype == BF16 and all(g.dtype == torch.float32 for g in dw + db)

    sd = torch.tensor(SPLITS, device=device)
    q = lambda role, row: recipe.quantizer(role, rowwise=row, columnwise=not row)
    w32 = torch.stack([w.detach() for w in m.weights]).view(G * N, K)
    biases = torch.stack([b.detach() for b in m.biases])
    qx = lambda row: lpmoe.group_quantize(x, q("input", row), num_tensors=G, first_dims=sd)
    qw = lambda row: lpmoe.group_quantize(w32, q("weight", row), num_tensors=G)
    qdy = lambda row: lpmoe.group_quantize(dy, q("grad", row), num_tensors=G, first_dims=sd)
    assert qw(True).dtype == torch.float32  # quantized from the fp32 parameters
    y_ref = lpmoe.grouped_gemm(qx(True), qw(True), kind="fprop", bias=biases)
    dx_ref = lpmoe.grouped_gemm(qdy(True), qw(False), kind="dgrad")
    dw_ref = lpmoe.grouped_gemm(qdy(False), qx(False), kind="wgrad", out_dtype=torch.float32)
    _, db_ref = lpmoe.group_quantize_dbias(dy, q("grad", False), num_tensors=G, first_dims=sd)
    assert torch.equal(y, y_ref)
    assert torch.equal(dx, dx_ref)
    assert torch.equal(torch.stack(dw), dw_ref)
    assert torch.equal(torch.stack(db), db_ref.float())
    # ... and not what quantizing a bf16 copy of the weights would give
    w16 = lpmoe.group_quantize(w32.to(BF16), q("weight", True), num_tensors=G)
    assert not torch.equal(y, lpmoe.grouped_gemm(qx(True), w16, kind="fprop", bias=biases))


def test_weight_cache_holds_the_fp32_quantization_cpu():
    m = fp32_layer("cpu")
    x = torch.randn(sum(SPLITS), K, dtype=BF16)
    run(m, x, torch.randn(x.shape[0], N, dtype=BF16), SPLITS, Float8BlockScaling(), is_first_microbatch=True)
    assert m.weight_cache.quantized is not None and m.weight_cache.quantized.dtype == torch.float32


@pytest.mark.parametrize("recipe", [MXFP8BlockScaling(), Float8BlockScaling(backward_override="high_precision"),
                                    Float8BlockScaling(backward_override="dequantized")],
                         ids=["mxfp8", "fp8_hp_backward", "fp8_dequantized_backward"])
def test_other_recipes_take_fp32_params_cpu(recipe):
    """The emulated and backward_override paths compute in bf16 from fp32
    parameters: the same results as the layer with bf16 parameters holding
    the same (bf16-representable) values, gradients widened to fp32."""
    m = fp32_layer("cpu")
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(p.to(BF16))
    ref = lpmoe.GroupedLinear(G, K, N, bias=True, params_dtype=BF16, device="cpu")
    ref.load_state_dict({k: v.to(BF16) for k, v in m.state_dict().items()})
    x = torch.randn(sum(SPLITS), K, dtype=BF16)
    dy = torch.randn(x.shape[0], N, dtype=BF16)
    y, dx = run(m, x, dy, SPLITS, recipe)
    y_ref, dx_ref = run(ref, x, dy, SPLITS, recipe)
    assert torch.equal(y, y_ref) and torch.equal(dx, dx_ref)
    for a, b in zip(grads(m)[0] + grads(m)[1], grads(ref)[0] + grads(ref)[1]):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a.to(BF16), b, atol=0, rtol=2 ** -7)  # one rounding apart at most


def test_layers_run_without_autocast_inside_cpu():
    """bf16 parameters and input: the same bits with and without an active
    autocast (the layer's own torch calls never run autocast's casts)."""
    m = lpmoe.GroupedLinear(G, K, N, bias=True, params_dtype=BF16, device="cpu")
    x = torch.randn(sum(SPLITS), K, dtype=BF16)
    dy = torch.randn(x.shape[0], N, dtype=BF16)
    for recipe in (None, Float8BlockScaling()):
        y, dx = run(m, x, dy, SPLITS, recipe)
        g = [p.grad for p in m.parameters()]
        xx = x.clone().requires_grad_(True)
        m.zero_grad(set_to_none=True)
        with lpmoe.autocast(enabled=recipe is not None, recipe=recipe):
            y2 = m(xx, SPLITS)
        y2.backward(dy)
        assert torch.equal(y, y2) and torch.equal(dx, xx.grad)
        assert all(torch.equal(a, p.grad) for a, p in zip(g, m.parameters()))


def test_mixed_dtypes_need_autocast_cpu():
    m = fp32_layer("cpu")
    x = torch.randn(8, K, dtype=BF16)
    with pytest.raises(TypeError, match="torch.autocast"):
        m(x, [8, 0, 0, 0])
    with pytest.raises(TypeError, match="needs bf16 activations"):
        with torch.autocast("cpu", dtype=torch.float16), lpmoe.autocast(recipe=Float8BlockScaling()):
            m(x, [8, 0, 0, 0])
    with torch.autocast("cpu", dtype=BF16):  # biases must have the weights' dtype
        with pytest.raises(TypeError, match=r"biases\[0\] is torch.bfloat16 .* expected the weights' torch.float32"):
            lpmoe.functional.grouped_linear(x, [8, 0, 0, 0], m.weights, [b.to(BF16) for b in m.biases])
    assert autocast_dtype(x.device) is None


def test_compiled_linear_with_fp32_params_cpu():
    m = fp32_layer("cpu", stacked=True)
    x = torch.randn(sum(SPLITS), K)
    dy = torch.randn(x.shape[0], N, dtype=BF16)
    splits = torch.tensor(SPLITS)
    torch._dynamo.reset()
    for recipe in (None, Float8BlockScaling()):
        y, dx = run(m, x, dy, splits, recipe)
        g = [p.grad for p in m.parameters()]
        y2, dx2 = run(torch.compile(m, fullgraph=True), x, dy, splits, recipe)
        assert torch.equal(y, y2) and torch.equal(dx, dx2)
        assert all(torch.equal(a, p.grad) and a.dtype == torch.float32 for a, p in zip(g, m.parameters()))


@requires_cuda
def test_fp32_params_graph_safe_without_syncs_gpu():
    """Device splits, FP8, fp32 parameters: no host sync in forward or
    backward, and a CUDA graph of the step replays with new routing."""
    m = fp32_layer("cuda")
    recipe = Float8BlockScaling()
    x = torch.randn(512, K, device="cuda", dtype=BF16)
    dy = torch.randn(512, N, device="cuda", dtype=BF16)
    splits = torch.tensor(SPLITS, device="cuda")
    run(m, x, dy, splits, recipe)  # warm-up (workspaces)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run(m, x, dy, splits, recipe)
    finally:
        torch.cuda.set_sync_debug_mode(0)

    class Step(torch.nn.Module):  # (a module, so that the graph knows the parameters)
        def __init__(self):
            super().__init__()
            self.m = m

        def forward(self, xx):
            # cache_enabled=False: make_graphed_callables' rule for autocast
            with torch.autocast("cuda", dtype=BF16, cache_enabled=False), lpmoe.autocast(recipe=recipe):
                return self.m(xx, splits)
    xs = x.clone().requires_grad_(True)
    graphed = torch.cuda.make_graphed_callables(Step(), (xs,))
    for new in ([10, 300, 0, 200], [128, 128, 128, 128]):
        splits.copy_(torch.tensor(new))
        xg = x.clone().requires_grad_(True)
        m.zero_grad(set_to_none=True)
        graphed(xg).backward(dy)
        got = [xg.grad] + [p.grad.clone() for p in m.parameters()]
        y_ref, dx_ref = run(m, x, dy, splits, recipe)
        assert torch.equal(got[0], dx_ref)
        assert all(torch.equal(a, p.grad) for a, p in zip(got[1:], m.parameters()))


@pytest.mark.parametrize("device", devices())
def test_fp16_autocast_computes_in_fp16(device):
    """torch.autocast(float16) with fp32 parameters (GradScaler's setting),
    no recipe: the fp16 layer's y and dx on the cast parameters, fp32
    weight gradients from the GEMM's fp32 accumulator."""
    m = fp32_layer(device)
    x = torch.randn(sum(SPLITS), K, device=device)
    dy = torch.randn(x.shape[0], N, device=device, dtype=torch.float16)
    xx = x.clone().requires_grad_(True)
    with torch.autocast(device, dtype=torch.float16):
        y = m(xx, splits_on(device))
    y.backward(dy)
    ref = lpmoe.GroupedLinear(G, K, N, bias=True, params_dtype=torch.float16, device=device)
    ref.load_state_dict({k: v.half() for k, v in m.state_dict().items()})
    xh = x.half().requires_grad_(True)
    y_ref = ref(xh, splits_on(device))
    y_ref.backward(dy)
    assert y.dtype == torch.float16 and torch.equal(y, y_ref)
    assert torch.equal(xx.grad, xh.grad.float())
    sd = torch.tensor(SPLITS, device=device)
    dw_ref = lpmoe.grouped_gemm(grouped_rows(dy, sd), grouped_rows(xh.detach(), sd), kind="wgrad",
                                out_dtype=torch.float32)
    assert torch.equal(torch.stack(grads(m)[0]), dw_ref)
