"""torch.compile of layers that accumulate their weight gradients into
fp32 ``main_grad`` buffers (``fuse_wgrad_accumulation``): compiled ==
eager bitwise over micro-batches with new routing, in every parameter
layout, Megatron's marker, the op running when autograd takes none of its
outputs, and ``mode="reduce-overhead"`` replays (GPU)."""
import copy

import pytest
import torch

import lpmoe
from _compile_common import (TOKEN_COUNTS, _fresh_dynamo, _layer, _no_compile_caches,  # noqa: F401 (fixtures)
                             _splits, _undo_config_patches, _x)
from conftest import requires_cuda
from lpmoe.library import layer_ops, mlp_ops
from lpmoe.recipe import Float8BlockScaling


def _with_main_grads(module, flat: bool, marker: bool, seed: int = 0):
    """fp32 main_grads with non-zero contents on every expert weight: pieces
    of one flat buffer per layer (a framework's gradient buffer) or separate
    tensors (one (G, out, in) tensor for a stacked weight); ``marker``:
    Megatron's grad_added_to_main_grad attribute."""
    layers = [module] if isinstance(module, lpmoe.GroupedLinear) else [module.linear_fc1, module.linear_fc2]
    g = torch.Generator().manual_seed(seed)
    for layer in layers:
        layer.fuse_wgrad_accumulation = True
        ws = [layer.weight] if layer.single_grouped_parameter else layer.weights
        init = torch.randn(len(ws), *ws[0].shape, generator=g).to(ws[0].device)
        for i, w in enumerate(ws):
            w.main_grad = init[i] if flat else init[i].clone()
            if marker:
                w.grad_added_to_main_grad = False
    return [w for layer in layers for w in ([layer.weight] if layer.single_grouped_parameter else layer.weights)]


@pytest.mark.parametrize("recipe", [None, Float8BlockScaling()], ids=repr)
@pytest.mark.parametrize("layout", ["one-buffer", "separate", "stacked"])
@pytest.mark.parametrize("kind", ["mlp", "linear"])
def test_compile_fuse_wgrad_accumulation_cpu(kind, layout, recipe):
    _fused_main_grads_case(kind, layout, recipe, "cpu")


def _fused_main_grads_case(kind, layout, recipe, device):
    """fuse_wgrad_accumulation compiles: the backward op adds the weight
    gradients into the weights' main_grads as eager does (bitwise), over
    two micro-batches with new routing; Megatron's marker is set and the
    placeholder gradient returned as in eager.  Per-expert main_grads that
    are views of one buffer (a framework's gradient buffer) are the case
    torch 2.11 got wrong as a declared mutation (fused_main_grads)."""
    flat = layout == "one-buffer"
    m = _layer(kind, device, stacked=layout == "stacked")
    e = copy.deepcopy(m)
    mw, ew = _with_main_grads(m, flat, marker=True), _with_main_grads(e, flat, marker=True)
    c = torch.compile(m, fullgraph=True)
    for i, (rows, values) in enumerate(TOKEN_COUNTS[:2]):
        for w in mw + ew:
            w.grad_added_to_main_grad = False
        p = torch.rand(rows, device=device) if kind == "mlp" else None
        s = _splits(device, values=values)
        for module, ws in ((c, mw), (e, ew)):
            x = _x(rows, device=device, seed=rows).requires_grad_(True)
            with lpmoe.autocast(enabled=recipe is not None, recipe=recipe):
                y = module(x, s) if p is None else module(x, s, probs=p)
            y.backward(torch.ones_like(y))
        for a, b in zip(mw, ew):
            assert torch.equal(a.main_grad, b.main_grad), f"micro-batch {i}"
            assert a.grad_added_to_main_grad and b.grad_added_to_main_grad
            assert a.grad is not None and a.grad.shape == a.shape  # the placeholder, as eager returns it
    without = _layer(kind, device, stacked=layout == "stacked")
    ws = _with_main_grads(without, flat, marker=False)
    x = _x(96, device=device).requires_grad_(True)
    y = torch.compile(without, fullgraph=True)(x, _splits(device, values=TOKEN_COUNTS[0][1]))
    y.sum().backward()
    assert all(w.grad is None for w in ws)  # no marker: autograd gets None, as in eager
    assert x.grad is not None


@requires_cuda
@pytest.mark.parametrize("recipe", [None, Float8BlockScaling()], ids=repr)
@pytest.mark.parametrize("layout", ["one-buffer", "separate", "stacked"])
def test_compile_fuse_wgrad_accumulation_gpu(layout, recipe):
    """The same on the GPU, every layout bitwise equal to eager."""
    _fused_main_grads_case("mlp", layout, recipe, "cuda")


@pytest.mark.parametrize("kind,split", [("mlp", False), ("mlp", True), ("linear", False)])
def test_compile_fused_main_grads_when_autograd_uses_no_output_cpu(kind, split, monkeypatch):
    """A fused layer whose backward op hands autograd nothing (input needs
    no gradient, no bias, no probs, no Megatron marker): the accumulation is
    the op's only effect, and the op still runs (registered as
    side-effecting; a dead-code pass would drop it otherwise)."""
    _no_compile_caches()
    monkeypatch.setattr(mlp_ops, "SPLIT_BACKWARD_BYTES", 0 if split else 1 << 60)
    m = _layer(kind, bias=False)
    e = copy.deepcopy(m)
    mw, ew = _with_main_grads(m, flat=True, marker=False), _with_main_grads(e, flat=True, marker=False)
    before = [w.main_grad.clone() for w in mw]
    c = torch.compile(m, fullgraph=True)
    s = _splits(values=TOKEN_COUNTS[0][1])
    x = _x(TOKEN_COUNTS[0][0])
    calls = dict(layer_ops.CALLS)
    for module in (c, e):
        module(x, s).sum().backward()
    ops = {"grouped_linear_backward": 1} if kind == "linear" else \
        {"grouped_mlp_backward": 2 if split else 1, "grouped_mlp_backward_act": int(split),
         "grouped_mlp_backward_fc1": 1 if split else 0}  # fc1: its wgrad op only
    for op, n in ops.items():  # the MLP's fc1 op returns nothing here: main_grad is its only effect
        assert layer_ops.CALLS[op] == calls[op] + n, f"the compiled backward op {op} must run (eager does not count)"
    for a, b, b0 in zip(mw, ew, before):
        assert torch.equal(a.main_grad, b.main_grad)
        assert a.grad is None and b.grad is None
    assert any(not torch.equal(a.main_grad, b0) for a, b0 in zip(mw, before))


@requires_cuda
@pytest.mark.parametrize("recipe", [None, Float8BlockScaling()], ids=repr)
def test_compile_fuse_wgrad_accumulation_reduce_overhead_gpu(recipe):
    """mode="reduce-overhead" replays the backward as a CUDA graph, where the
    op's Python does not run: the persistent main_grads still receive every
    micro-batch's gradient (new routing per replay) and the marker is set
    (by the replayed forward)."""
    m = _layer("mlp", "cuda")
    e = copy.deepcopy(m)
    mw, ew = _with_main_grads(m, flat=True, marker=True), _with_main_grads(e, flat=True, marker=True)
    c = torch.compile(m, mode="reduce-overhead", fullgraph=True)
    rows = 192
    for i, values in enumerate(([16, 0, 160, 16], [48, 48, 48, 48], [0, 0, 0, 192], [100, 2, 30, 60])):
        for w in mw + ew:
            w.grad_added_to_main_grad = False
        s = _splits("cuda", values=values)
        p = torch.rand(rows, device="cuda")
        # a new step: a replay may overwrite earlier outputs, the placeholder
        # .grads among them (Megatron's hook drops them after each backward)
        torch.compiler.cudagraph_mark_step_begin()
        m.zero_grad(set_to_none=True)
        for module in (c, e):
            x = _x(rows, device="cuda", seed=i).requires_grad_(True)
            with lpmoe.autocast(enabled=recipe is not None, recipe=recipe):
                y = module(x, s, probs=p)
            y.backward(torch.ones_like(y))
        torch.cuda.synchronize()
        for a, b in zip(mw, ew):
            assert torch.equal(a.main_grad, b.main_grad), f"micro-batch {i}"
            assert a.grad_added_to_main_grad
