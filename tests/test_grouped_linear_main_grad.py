"""GroupedLinear's fused wgrad accumulation into fp32 main_grad
(Megatron-style), one flat buffer or separate tensors, CPU and GPU."""
import pytest
import torch

import lpmoe
from lpmoe.recipe import Float8BlockScaling
from conftest import requires_cuda
from _grouped_linear_common import G, K, N, cuda_layer, make_layer, rel, run
from _grouped_linear_common import spies  # noqa: F401  (a fixture)


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
    layer = cuda_layer()
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
