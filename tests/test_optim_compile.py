"""Compiled layers with default calls (is_first_microbatch=None) read the FP8
weights lpmoe.optim.AdamW wrote, as eager calls do: the compiled op finds
the cache by its weights when it runs (functional.weights.optimizer_cache_of),
so identical layers still share one graph.  Bitwise against an eager twin
that quantizes; cache hits and the fused path counted; no recompilation;
captured calls (reduce-overhead) quantize instead."""
import copy

import pytest
import torch

import lpmoe
from _optim_common import BF16, FP8, G, K, N, SPLITS, _mlp, devices
from conftest import requires_cuda


def _linear(device, stacked):
    torch.manual_seed(2)
    return lpmoe.GroupedLinear(G, K, N, bias=True, params_dtype=torch.float32, device=device,
                               single_grouped_parameter=stacked)


def _layers(model):
    return [model] if isinstance(model, lpmoe.GroupedLinear) else [model.linear_fc1, model.linear_fc2]


def _run(a, steps, device, mode=None):
    """``steps`` training steps of compiled ``a`` (default calls) and of an
    eager twin whose layers quantize every call, each with lpmoe.optim.AdamW;
    asserts equal outputs and parameters each step; returns (a, compiled
    frames after the first step and at the end)."""
    b = copy.deepcopy(a)
    opt_a = lpmoe.optim.AdamW(a.parameters(), lr=1e-3, weight_decay=0.1, fp8_weights_of=a)
    opt_b = lpmoe.optim.AdamW(b.parameters(), lr=1e-3, weight_decay=0.1, fp8_weights_of=b)
    compiled = torch.compile(a, fullgraph=True, mode=mode)
    gen = torch.Generator().manual_seed(0)
    frames = []
    for _ in range(steps):
        splits = torch.randperm(4, generator=gen).to(device) * 40 + 10  # new routing per step
        rows = int(splits.sum())
        x = torch.randn(rows, K, generator=gen).to(device)
        dy = torch.randn(rows, a.out_features if isinstance(a, lpmoe.GroupedLinear) else K,
                         generator=gen).to(device, BF16)
        ys = []
        for model, opt, fresh in ((compiled, opt_a, False), (b, opt_b, True)):
            if fresh:
                for lin in _layers(b):
                    lin.weight_cache.source = None
            opt.zero_grad(set_to_none=True)
            with torch.autocast(device, dtype=BF16), lpmoe.autocast(recipe=FP8):
                y = model(x, splits)
            y.backward(dy)
            opt.step()
            ys.append(y.detach().clone())
        assert torch.equal(ys[0], ys[1])
        frames.append(torch._dynamo.utils.counters["frames"]["ok"])
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    return frames


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("stacked", [False, True], ids=["per_expert", "stacked"])
@pytest.mark.parametrize("kind", ["mlp", "linear"])
def test_compiled_default_calls_read_the_optimizer_weights(device, stacked, kind):
    torch._dynamo.reset()
    a = _mlp(device, single_grouped_parameter=stacked) if kind == "mlp" else _linear(device, stacked)
    before = lpmoe.optim.stats()
    frames = _run(a, 3, device)
    after = lpmoe.optim.stats()
    layers = len(_layers(a))
    assert after["fused"] - before["fused"] == 2 * layers * 3 and after["torch"] == before["torch"]
    for lin in _layers(a):
        assert lin.weight_cache.hits == 2  # steps 2 and 3 read the optimizer's copies
    assert frames[-1] == frames[0]  # new routing, new weights: no recompilation


@requires_cuda
def test_captured_default_calls_quantize():
    """mode="reduce-overhead": a captured call cannot check the weights at
    replay, so it quantizes (equal to the twin, the optimizer still fused);
    only cudagraph trees' eager warm-up calls read the cache."""
    torch._dynamo.reset()
    a = _mlp("cuda")
    before = lpmoe.optim.stats()["fused"]
    _run(a, 4, "cuda", mode="reduce-overhead")
    assert lpmoe.optim.stats()["fused"] - before == 2 * 2 * 4
    assert a.linear_fc1.weight_cache.hits <= 2


def test_the_cache_is_found_only_for_its_own_weights():
    from lpmoe.functional.weights import optimizer_cache_of
    a = _mlp("cpu")
    opt = lpmoe.optim.AdamW(a.parameters(), fp8_weights_of=a)
    w = list(a.linear_fc1.weights)
    assert optimizer_cache_of(w) is a.linear_fc1.weight_cache
    assert optimizer_cache_of([t.view(t.shape) for t in w]) is a.linear_fc1.weight_cache  # views: same tensors
    assert optimizer_cache_of(w[:-1]) is None
    assert optimizer_cache_of([t.clone() for t in w]) is None
    assert optimizer_cache_of(list(a.linear_fc2.weights)) is a.linear_fc2.weight_cache
    del opt
