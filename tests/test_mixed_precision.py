"""Parameters in another dtype than the compute dtype, under torch.autocast
(lpmoe.functional.precision): fp32 parameters with bf16 compute, the usual
PyTorch mixed precision.

Each test states the exact semantics as an explicit composition of public
lpmoe calls (the bf16 layer on cast weights, or grouped_gemm on quantized
operands) and checks the layer against it bit for bit; CPU runs the
reference kernels, GPU (``*_gpu``) the graph-safe kernels."""
import pytest
import torch

import lpmoe
import lpmoe.functional.linear as LIN
from conftest import requires_cuda
from lpmoe.functional.precision import autocast_dtype
from lpmoe.functional.mlp import CALLS
from lpmoe.policy.base import grouped_rows
from lpmoe.recipe import Float8BlockScaling, MXFP8BlockScaling

G, K, N = 4, 256, 128
SPLITS = [100, 0, 150, 50]
BF16 = torch.bfloat16


def devices():
    return ["cpu", pytest.param("cuda", id="gpu", marks=requires_cuda)]


def fp32_layer(device, stacked=False, bias=True, seed=0):
    torch.manual_seed(seed)
    m = lpmoe.GroupedLinear(G, K, N, bias=bias, params_dtype=torch.float32, device=device,
                            single_grouped_parameter=stacked)
    with torch.no_grad():
        for b in m.biases or []:
            b.normal_()
    return m


def splits_on(device):
    return torch.tensor(SPLITS, device=device) if device == "cuda" else SPLITS


def run(m, x, dy, splits, recipe, **kw):
    x = x.detach().clone().requires_grad_(True)
    m.zero_grad(set_to_none=True)
    with torch.autocast(x.device.type, dtype=BF16), lpmoe.autocast(enabled=recipe is not None, recipe=recipe):
        y = m(x, splits, **kw)
    y.backward(dy)
    return y, x.grad


def grads(m):
    """(weight grads, bias grads), one per expert in either layout."""
    if m.single_grouped_parameter:
        return list(m.weight.grad.unbind(0)), list(m.bias.grad.unbind(0))
    return [t.grad for t in m.weights], [t.grad for t in m.biases]


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


def mlp_pair(device, bias=True):
    torch.manual_seed(1)
    m = lpmoe.GroupedMLP(G, K, N, bias=bias, params_dtype=torch.float32, device=device)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(p.to(BF16))  # representable in bf16: the bf16 MLP holds the same values
            if p.dim() == 1:
                p.normal_().copy_(p.to(BF16))
    ref = lpmoe.GroupedMLP(G, K, N, bias=bias, params_dtype=BF16, device=device)
    ref.load_state_dict({k: v.to(BF16) for k, v in m.state_dict().items()})
    return m, ref


def mlp_step(m, x, dy, probs, splits, recipe, amp, fn=None):
    x = x.detach().clone().requires_grad_(True)
    p = probs.detach().clone().requires_grad_(True)
    m.zero_grad(set_to_none=True)
    with torch.autocast(x.device.type, dtype=BF16, enabled=amp), lpmoe.autocast(enabled=recipe is not None,
                                                                                 recipe=recipe):
        y = (m if fn is None else fn)(x, splits, probs=p)
    y.backward(dy)
    return [y, x.grad, p.grad], [q.grad for q in m.parameters()]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("recipe", [None, Float8BlockScaling()], ids=["bf16", "fp8"])
def test_grouped_mlp_with_fp32_params(device, recipe):
    """The fused MLP with fp32 parameters under autocast gives the bf16
    MLP's y, dx and dprobs on parameters holding the same values, and fp32
    parameter gradients at most one bf16 rounding from the bf16 MLP's (the
    CPU reference rounds its fp64 products once per output dtype); the op
    counters show the fused MLP ran in both."""
    m, ref = mlp_pair(device)
    x = torch.randn(sum(SPLITS), K, device=device)  # fp32: the MLP casts it
    dy = torch.randn(x.shape[0], K, device=device, dtype=BF16)
    probs = torch.rand(x.shape[0], device=device)
    before = CALLS["grouped_mlp"]
    out, gs = mlp_step(m, x, dy, probs, splits_on(device), recipe, amp=True)
    ref_out, ref_gs = mlp_step(ref, x.to(BF16), dy, probs, splits_on(device), recipe, amp=False)
    assert CALLS["grouped_mlp"] == before + 2
    assert out[0].dtype == BF16 and out[1].dtype == torch.float32
    assert torch.equal(out[0], ref_out[0]) and torch.equal(out[1], ref_out[1].float())
    assert torch.equal(out[2], ref_out[2])
    for a, b in zip(gs, ref_gs):
        assert a.dtype == torch.float32
        if device == "cuda":  # the kernels' fp32 accumulator, rounded to bf16 for the bf16 MLP
            assert torch.equal(a.to(BF16), b)
        else:
            torch.testing.assert_close(a.to(BF16), b, atol=0, rtol=2 ** -7)


@pytest.mark.parametrize("device", devices())
def test_compiled_mlp_with_fp32_params_matches_eager(device):
    """torch.compile(fullgraph=True) under autocast: the same bits as eager
    (the compute dtype is read while tracing; the ops carry both dtypes)."""
    m, _ = mlp_pair(device)
    x = torch.randn(sum(SPLITS), K, device=device)
    dy = torch.randn(x.shape[0], K, device=device, dtype=BF16)
    probs = torch.rand(x.shape[0], device=device)
    splits = torch.tensor(SPLITS, device=device)
    for recipe in (None, Float8BlockScaling()):
        torch._dynamo.reset()
        eager, eg = mlp_step(m, x, dy, probs, splits, recipe, amp=True)
        comp, cg = mlp_step(m, x, dy, probs, splits, recipe, amp=True, fn=torch.compile(m, fullgraph=True))
        assert all(torch.equal(a, b) for a, b in zip(eager + eg, comp + cg))
        assert all(g.dtype == torch.float32 for g in cg)


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
def test_moe_layer_with_fp32_params(device):
    """lpmoe's MoE layer with fp32 parameters in an autocast region with an
    fp32 residual stream: the tokens are cast once, FP8 block scaling
    still gathers fc1's input from them (counted), and the compiled layer
    (fullgraph) gives eager's bits; every gradient is fp32."""
    import torch._inductor.config as inductor_config
    from lpmoe.moe import MoELayer
    from lpmoe.moe.routed_tokens import CALLS as ROUTED
    torch.manual_seed(0)
    moe = MoELayer(K, N, num_experts=8, top_k=2, params_dtype=torch.float32, device=device)
    x = torch.randn(2, 96, K, device=device)
    dy = torch.randn(2, 96, K, device=device, dtype=BF16)
    # aot_eager on the CPU: Inductor's CPU code for the router's plain torch
    # ops rounds differently from eager's.  The GPU compiles with Inductor,
    # told to round where eager does (emulate_precision_casts): it would
    # otherwise add the router's and the experts' bf16 gradients of the cast
    # tokens in fp32 ahead of the cast back to fp32, skipping eager's
    # bf16 rounding of the sum.
    backend = "inductor" if device == "cuda" else "aot_eager"
    torch._dynamo.reset()
    results = []
    with inductor_config.patch(emulate_precision_casts=True):
        for fn in (moe, torch.compile(moe, fullgraph=True, backend=backend)):
            xx = x.clone().requires_grad_(True)
            moe.zero_grad(set_to_none=True)
            before = sum(ROUTED.values())
            with torch.autocast(device, dtype=BF16), lpmoe.autocast(recipe=Float8BlockScaling()):
                y = fn(xx)
            y.backward(dy)
            assert sum(ROUTED.values()) > before  # fc1's input quantized as it was gathered
            assert y.dtype == BF16 and xx.grad.dtype == torch.float32
            assert all(p.grad.dtype == torch.float32 for p in moe.parameters())
            results.append([y, xx.grad] + [p.grad for p in moe.parameters()])
    names = ["y", "dx"] + [n for n, _ in moe.named_parameters()]
    assert [n for n, a, b in zip(names, *results) if not torch.equal(a, b)] == []


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


def _saved_shapes(fn):
    """(dtype, shape) of every tensor autograd saves while fn runs."""
    seen = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: (seen.append((t.dtype, tuple(t.shape))), t)[1],
                                                  lambda t: t):
        fn()
    return seen


@pytest.mark.parametrize("mlp", [False, True], ids=["linear", "mlp"])
def test_save_original_input_never_keeps_the_cast_copy_cpu(mlp):
    """save_original_input keeps the caller's input; under autocast an fp32
    input is cast first, and that copy (the layer's own) is not kept: the
    layer keeps x's FP8 copy, as without the option."""
    torch.manual_seed(0)
    make = (lambda s: lpmoe.GroupedMLP(G, K, N, params_dtype=torch.float32, device="cpu", save_original_input=s)) \
        if mlp else (lambda s: lpmoe.GroupedLinear(G, K, N, params_dtype=torch.float32, device="cpu",
                                                  save_original_input=s))
    kept = {}
    for keep in (False, True):
        m = make(keep)
        for x in (torch.randn(sum(SPLITS), K), torch.randn(sum(SPLITS), K, dtype=BF16)):
            x.requires_grad_(True)

            def fwd():
                with torch.autocast("cpu", dtype=BF16), lpmoe.autocast(recipe=Float8BlockScaling()):
                    m(x, SPLITS)
            kept[(keep, x.dtype)] = _saved_shapes(fwd)
    rows_bf16 = (BF16, (sum(SPLITS), K))
    assert rows_bf16 not in kept[(True, torch.float32)] and kept[(True, torch.float32)] == kept[(False, torch.float32)]
    assert rows_bf16 in kept[(True, BF16)]  # (a bf16 input is the caller's own: kept by reference)


def test_emulated_mlp_saves_its_dequantized_weights_as_before_cpu():
    """Without autocast, the emulated recipes' dequantized weights still go
    through save_for_backward (saved-tensor hooks see them); only copies in
    another dtype than the parameters' are held outside it."""
    torch.manual_seed(0)
    m = lpmoe.GroupedMLP(G, 128, 128, params_dtype=BF16, device="cpu")
    x = torch.randn(128, 128, dtype=BF16, requires_grad=True)

    def fwd():
        with lpmoe.autocast(recipe=MXFP8BlockScaling()):
            m(x, [32] * G)
    seen = _saved_shapes(fwd)
    assert (BF16, (G, 256, 128)) in seen and (BF16, (G, 128, 128)) in seen


@requires_cuda
@pytest.mark.parametrize("recipe", [None, Float8BlockScaling()], ids=["bf16", "fp8"])
def test_reduce_overhead_with_fp32_params_gpu(recipe):
    """torch.compile(mode="reduce-overhead") of the MLP with fp32 parameters
    under autocast: the CUDA graphs replay new routing with eager's bits,
    fp32 parameter gradients included."""
    m, _ = mlp_pair("cuda")
    c = torch.compile(m, mode="reduce-overhead", fullgraph=True)
    s = torch.tensor(SPLITS, device="cuda")
    rows = 512

    def step(fn, x, probs, dy):
        torch.compiler.cudagraph_mark_step_begin()
        m.zero_grad(set_to_none=True)
        x = x.detach().clone().requires_grad_(True)
        with torch.autocast("cuda", dtype=BF16), lpmoe.autocast(enabled=recipe is not None, recipe=recipe):
            y = fn(x, s, probs=probs)
        y.backward(dy)
        return [y.detach().clone(), x.grad.clone()] + [p.grad.clone() for p in m.parameters()]

    g = torch.Generator().manual_seed(0)
    new = lambda *shape: torch.randn(*shape, generator=g).cuda()  # noqa: E731
    for _ in range(3):  # warm-up and capture
        step(c, new(rows, K), torch.rand(rows, device="cuda"), new(rows, K).to(BF16))
    for routing in ([10, 300, 0, 200], [128, 128, 128, 128], [0, 0, 512, 0]):
        s.copy_(torch.tensor(routing))
        x, probs, dy = new(rows, K), torch.rand(rows, device="cuda"), new(rows, K).to(BF16)
        got, want = step(c, x, probs, dy), step(m, x, probs, dy)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), routing
        assert all(t.dtype == torch.float32 for t in got[2:])
