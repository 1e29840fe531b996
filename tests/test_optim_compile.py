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


def _run(a, steps, device, mode=None, first=None):
    """``steps`` training steps of compiled ``a`` (calls with
    ``is_first_microbatch=first``, default None) and of an eager twin whose
    layers quantize every call, each with lpmoe.optim.AdamW;
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
            kw = {} if fresh or first is None else {"is_first_microbatch": first}
            with torch.autocast(device, dtype=BF16), lpmoe.autocast(recipe=FP8):
                y = model(x, splits, **kw)
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
    from lpmoe.functional.weights import _optimizer_caches, optimizer_cache_of
    a = _mlp("cpu")
    opt = lpmoe.optim.AdamW(a.parameters(), fp8_weights_of=a)
    w = list(a.linear_fc1.weights)
    assert optimizer_cache_of(w) is a.linear_fc1.weight_cache
    assert optimizer_cache_of([t.view(t.shape) for t in w]) is a.linear_fc1.weight_cache  # views: same tensors
    assert optimizer_cache_of(w[:-1]) is None
    assert optimizer_cache_of([t.clone() for t in w]) is None
    assert optimizer_cache_of(list(a.linear_fc2.weights)) is a.linear_fc2.weight_cache
    sq = lpmoe.GroupedLinear(G, K, K, params_dtype=torch.float32, device="cpu")  # square: a transpose has its shape
    opt_sq = lpmoe.optim.AdamW(sq.parameters(), fp8_weights_of=sq)
    assert optimizer_cache_of(list(sq.weights)) is sq.weight_cache
    assert optimizer_cache_of([t.t() for t in sq.weights]) is None  # same address and shape, other elements
    addr = sq.weights[0].data_ptr()
    del opt_sq, sq
    import gc
    gc.collect()
    assert addr not in _optimizer_caches  # the entry went with the cache
    del opt


@pytest.mark.parametrize("device", devices())
def test_compiled_default_calls_see_weights_written_elsewhere(device):
    """A weight changed in place after the optimizer's step (as a model
    load_state_dict would) is not read from the cache by the compiled call
    (its version moved): it quantizes, equal to the twin; a functional call
    without a weight cache never reads the optimizer's."""
    torch._dynamo.reset()
    a = _mlp(device)
    b = copy.deepcopy(a)
    opt = lpmoe.optim.AdamW(a.parameters(), lr=1e-3, fp8_weights_of=a)
    _run_once = _one_step(a, opt, device)
    hits = a.linear_fc1.weight_cache.hits
    with torch.no_grad():
        for p, q in zip(a.parameters(), b.parameters()):
            q.copy_(p)
        for mod in (a, b):
            mod.linear_fc1.weight1.mul_(0.5)
    compiled = torch.compile(a, fullgraph=True)
    x, splits = _run_once
    with torch.no_grad(), torch.autocast(device, dtype=BF16), lpmoe.autocast(recipe=FP8):
        u, w = compiled(x, splits), b(x, splits)
    assert torch.equal(u, w)
    assert a.linear_fc1.weight_cache.hits == hits  # fc1 missed ...
    assert a.linear_fc2.weight_cache.hits == hits + 1  # ... fc2 read its copies
    fc2 = a.linear_fc2
    fn = torch.compile(lambda x, s: lpmoe.functional.grouped_linear(x, s, list(fc2.weights), list(fc2.biases)),
                       fullgraph=True)
    with torch.no_grad(), torch.autocast(device, dtype=BF16), lpmoe.autocast(recipe=FP8):
        fn(torch.randn(x.shape[0], N, device=device), splits)
    assert fc2.weight_cache.hits == hits + 1


def _one_step(a, opt, device):
    """One eager training step of ``a`` (default calls); returns (x, splits)."""
    splits = torch.tensor(SPLITS, device=device) if device == "cuda" else torch.tensor(SPLITS)
    x = torch.randn(sum(SPLITS), K, device=device)
    with torch.autocast(device, dtype=BF16), lpmoe.autocast(recipe=FP8):
        a(x, splits).float().sum().backward()
    opt.step()
    return x, splits


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_step_between_forward_and_backward_is_an_error(device, compiled):
    """A forward that read the optimizer's FP8 copies saved them for its
    backward; an optimizer step before that backward rewrites them in
    place: autograd's version check refuses the backward (the CUDA kernel
    bumps the buffers' versions as the CPU path's copy_ does), instead of a
    silently wrong input gradient."""
    torch._dynamo.reset()
    a = _mlp(device)
    opt = lpmoe.optim.AdamW(a.parameters(), lr=1e-3, fp8_weights_of=a)
    x, splits = _one_step(a, opt, device)
    model = torch.compile(a, fullgraph=True) if compiled else a
    x = x.clone().requires_grad_(True)
    with torch.autocast(device, dtype=BF16), lpmoe.autocast(recipe=FP8):
        y = model(x, splits)
    assert a.linear_fc1.weight_cache.hits >= 1
    for p in a.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.float().sum().backward()
