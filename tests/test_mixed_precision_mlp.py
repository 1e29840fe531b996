"""fp32 parameters under torch.autocast through the fused MLP and the MoE
layer: eager against the bf16 MLP on the same values, compiled (default
and reduce-overhead) against eager, what the layers save
(test_mixed_precision.py has the semantics and GroupedLinear)."""
import pytest
import torch

import lpmoe
from _mixed_precision_common import BF16, G, K, N, SPLITS, devices, mlp_pair, mlp_step, saved_shapes, splits_on
from conftest import requires_cuda
from lpmoe.functional.mlp import CALLS
from lpmoe.recipe import Float8BlockScaling, MXFP8BlockScaling


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
            kept[(keep, x.dtype)] = saved_shapes(fwd)
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
    seen = saved_shapes(fwd)
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


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("options", [dict(fuse_wgrad_accumulation=True), dict(single_grouped_parameter=True),
                                     dict(cached=True)], ids=["main_grad", "stacked", "weight_cache"])
def test_mlp_options_with_fp32_params(device, options):
    """FP8 with fp32 parameters under autocast, with the layer options that
    touch the weights: Megatron's fp32 main_grad (the same fp32 sums as the
    bf16 MLP's, bit for bit), stacked parameters, and the FP8 weight cache
    (is_first_microbatch True then False: the second micro-batch reads the
    fp32-source quantization kept by the first)."""
    opts = dict(options)
    cached = opts.pop("cached", False)
    m, ref = mlp_pair(device, **opts)
    fused = opts.get("fuse_wgrad_accumulation", False)
    if fused:
        for model in (m, ref):
            for p in model.parameters():
                p.main_grad = torch.zeros(p.shape, device=device)
    recipe = Float8BlockScaling()
    x = torch.randn(sum(SPLITS), K, device=device)
    dy = torch.randn(x.shape[0], K, device=device, dtype=BF16)
    probs = torch.rand(x.shape[0], device=device)
    for first in ((True, False) if cached else (None,)):
        kw = {} if first is None else {"is_first_microbatch": first}
        out, gs = _step_kw(m, x, dy, probs, splits_on(device), recipe, True, kw)
        ref_out, ref_gs = _step_kw(ref, x.to(BF16), dy, probs, splits_on(device), recipe, False, kw)
        assert torch.equal(out[0], ref_out[0]) and torch.equal(out[1], ref_out[1].float())
        if cached:
            assert m.linear_fc1.weight_cache.quantized.dtype == torch.float32
    if fused:
        for p, q in zip(m.parameters(), ref.parameters()):
            if p.dim() >= 2:  # weights: their fp32 products, added into main_grad by both
                assert torch.equal(p.main_grad, q.main_grad)
    else:
        for a, b in zip(gs, ref_gs):
            assert a.dtype == torch.float32
            if device == "cuda":
                assert torch.equal(a.to(BF16), b)
            else:
                torch.testing.assert_close(a.to(BF16), b, atol=0, rtol=2 ** -7)


def _step_kw(m, x, dy, probs, splits, recipe, amp, kw):
    x = x.detach().clone().requires_grad_(True)
    p = probs.detach().clone().requires_grad_(True)
    m.zero_grad(set_to_none=True)
    with torch.autocast(x.device.type, dtype=BF16, enabled=amp), lpmoe.autocast(recipe=recipe):
        y = m(x, splits, probs=p, **kw)
    y.backward(dy)
    return [y, x.grad, p.grad], [q.grad for q in m.parameters()]
