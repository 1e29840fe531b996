"""Compiled layer calls with is_first_microbatch True / False: the saved FP8
weights go to the backward as a reference to the layer's weight cache
(lpmoe.library.cached_weights), not as op outputs (a custom op's outputs
must be its own memory; CUDA-graph trees refuse others, see
test_persistent_buffers.py).  Compiled equals eager bitwise, the backward
takes the weights from the cache (counted), and a cache rewritten between
a forward and its backward is refused, as eager autograd refuses it."""
import copy

import pytest
import torch

import lpmoe
from lpmoe.library import cached_weights
from conftest import requires_cuda

FP8 = lpmoe.recipe.Float8BlockScaling()
RECIPES = [FP8, lpmoe.recipe.Float8BlockScaling(backward_override="dequantized")]


def _devices():
    return ["cpu", pytest.param("cuda", id="gpu", marks=requires_cuda)]


def _model(kind, device, stacked=False):
    torch.manual_seed(0)
    cls = lpmoe.GroupedMLP if kind == "mlp" else lpmoe.GroupedLinear
    return cls(4, 256, 128, params_dtype=torch.bfloat16, device=device, single_grouped_parameter=stacked)


def _splits(gen, device):
    s = torch.randperm(4, generator=gen) * 40 + 10
    return s.to(device) if device.startswith("cuda") else s  # CPU: a tensor read when the op runs


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("recipe", RECIPES, ids=["fp8", "fp8_dequantized_bwd"])
@pytest.mark.parametrize("kind", ["mlp", "mlp_staged", "linear"])
def test_compiled_microbatches_equal_eager(monkeypatch, device, recipe, kind):
    """``mlp_staged``: the large-layer backward, one op per GEMM (fc2's
    dgrad op reads W2 from the cache)."""
    from lpmoe.library import mlp_ops
    monkeypatch.setattr(mlp_ops, "SPLIT_BACKWARD_BYTES", 0 if kind == "mlp_staged" else 1 << 60)
    # (a constant in production: no compiled artifact traced under the other setting may be reused)
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        _microbatches(device, recipe, kind.split("_")[0])


def _microbatches(device, recipe, kind):
    torch._dynamo.reset()
    m = _model(kind, device)
    e = copy.deepcopy(m)
    c = torch.compile(m, fullgraph=True)
    gen = torch.Generator().manual_seed(1)
    before = cached_weights.CALLS["resolved"]
    for step in range(3):
        for mb in range(2):
            s = _splits(gen, device)
            x = torch.randn(int(s.sum()), 256, generator=gen).to(device, torch.bfloat16)
            res = []
            for module, params in ((c, m), (e, e)):
                xi = x.clone().requires_grad_(True)
                with lpmoe.autocast(recipe=recipe):
                    y = module(xi, s, is_first_microbatch=mb == 0)
                y.float().square().sum().backward()
                res.append((y.detach(), xi.grad, [p.grad.clone() for p in params.parameters()]))
                params.zero_grad(set_to_none=True)
            (yc, dxc, gc), (ye, dxe, ge) = res
            assert torch.equal(yc, ye) and torch.equal(dxc, dxe), (step, mb)
            assert all(torch.equal(a, b) for a, b in zip(gc, ge)), (step, mb)
        with torch.no_grad():
            for p, q in zip(m.parameters(), e.parameters()):
                p.add_(0.01 * torch.sign(p))
                q.copy_(p)
    layers = 2 if kind == "mlp" else 1
    assert cached_weights.CALLS["resolved"] - before == 6 * layers  # every compiled backward, every layer


@pytest.mark.parametrize("device", _devices())
def test_cache_rewritten_between_compiled_forward_and_backward_is_an_error(device):
    torch._dynamo.reset()
    m = lpmoe.GroupedMLP(4, 256, 128, params_dtype=torch.float32, device=device)
    opt = lpmoe.optim.AdamW(m.parameters(), lr=1e-3, fp8_weights_of=m)
    c = torch.compile(m, fullgraph=True)
    s = torch.tensor([10, 50, 0, 40], device=device)
    x = torch.randn(100, 256, device=device)
    with torch.autocast(device, dtype=torch.bfloat16), lpmoe.autocast(recipe=FP8):
        c(x, s, is_first_microbatch=False).sum().backward()  # makes the cache; the optimizer then writes it
    opt.step()
    with torch.autocast(device, dtype=torch.bfloat16), lpmoe.autocast(recipe=FP8):
        y = c(x, s, is_first_microbatch=False)
    opt.step()  # rewrites the cached FP8 weights the forward read
    with pytest.raises(RuntimeError, match="rewritten before its backward"):
        y.sum().backward()


def test_a_cleared_cache_is_an_error_in_the_backward():
    torch._dynamo.reset()
    m = _model("linear", "cpu")
    c = torch.compile(m, fullgraph=True)
    s = torch.tensor([10, 50, 0, 40])
    x = torch.randn(100, 256, dtype=torch.bfloat16, requires_grad=True)  # dgrad reads the weights
    with lpmoe.autocast(recipe=FP8):
        y = c(x, s, is_first_microbatch=True)
    m.weight_cache.clear()
    with pytest.raises(RuntimeError, match="found no weight cache"):
        y.float().sum().backward()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_compiled_staged_backward_on_a_second_gpu(monkeypatch):
    """A model on cuda:1 while cuda:0 is current: the traced backward's view
    of the cached weights is made on the weights' own device (the staged
    fc2 dgrad op reads it while tracing), and compiled equals eager."""
    from lpmoe.library import mlp_ops
    monkeypatch.setattr(mlp_ops, "SPLIT_BACKWARD_BYTES", 0)
    with torch.cuda.device(0), torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        _microbatches("cuda:1", FP8, "mlp")
