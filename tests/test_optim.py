"""lpmoe.optim.AdamW: AdamW that writes the expert layers' FP8 weights in its
step.  Against a twin whose layers quantize their weights themselves (bit
for bit) and against torch.optim.AdamW; the WeightCache contract (default
calls read only caches the optimizer wrote, while current); no host sync;
CUDA graphs reading the optimizer's weights.  Call counters prove which
path ran.  Fallbacks to torch: test_optim_fallbacks.py."""
import copy

import pytest
import torch

import lpmoe
from _optim_common import BF16, FP8, K, SPLITS, _mlp, _train, devices, fused_step_without_sync
from conftest import requires_cuda


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("stacked", [False, True], ids=["per_expert", "stacked"])
def test_optimizer_writes_the_weights_the_forward_would_make(device, stacked):
    """Three steps with lpmoe.optim.AdamW: every forward after the first
    reads the optimizer's FP8 weights (cache hits, the fused path counted),
    and every output, parameter and moment equals a twin whose layers
    quantize their weights themselves, bit for bit."""
    a = _mlp(device, single_grouped_parameter=stacked)
    b = copy.deepcopy(a)
    opt_a = lpmoe.optim.AdamW(a.parameters(), lr=1e-3, weight_decay=0.1, fp8_weights_of=a)
    opt_b = lpmoe.optim.AdamW(b.parameters(), lr=1e-3, weight_decay=0.1, fp8_weights_of=b)
    before = lpmoe.optim.stats()
    launches = lpmoe.optim.kernels.fused_launches() if device == "cuda" else None
    ya = _train(a, opt_a, 3, device)
    yb = _train(b, opt_b, 3, device, fresh_quantize=True)
    after = lpmoe.optim.stats()
    assert after["fused"] - before["fused"] == 2 * 2 * 3  # two layers, two models, three steps
    assert after["torch"] == before["torch"]
    if device == "cuda":
        assert lpmoe.optim.kernels.fused_launches() - launches == 12
    assert a.linear_fc1.weight_cache.hits == 2 and a.linear_fc2.weight_cache.hits == 2
    assert b.linear_fc1.weight_cache.hits == 0
    for u, w in zip(ya, yb):
        assert torch.equal(u, w)
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt_a.state[p][key], opt_b.state[q][key]), (name, key)


@pytest.mark.parametrize("device", devices())
def test_optimizer_matches_torch_adamw(device):
    """The same training as torch.optim.AdamW: the biases (stepped by torch)
    bitwise, the expert weights up to AdamW's rounding order; the state
    dict loads into torch's optimizer and back."""
    a = _mlp(device)
    b = copy.deepcopy(a)
    opt_a = lpmoe.optim.AdamW(a.parameters(), lr=1e-3, fp8_weights_of=a)
    opt_b = torch.optim.AdamW(b.parameters(), lr=1e-3)
    _train(a, opt_a, 2, device)
    _train(b, opt_b, 2, device)
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        if "bias" in name:
            assert torch.equal(p, q), name
        else:
            torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6)
    c = copy.deepcopy(b)
    opt_c = torch.optim.AdamW(c.parameters(), lr=1e-3)
    opt_c.load_state_dict(opt_a.state_dict())
    opt_a.load_state_dict(opt_c.state_dict())
    assert opt_a.state_dict()["state"][0]["step"].item() == 2
    before = lpmoe.optim.stats()["fused"]
    _train(a, opt_a, 1, device)  # the loaded state is taken over: still the fused path
    assert lpmoe.optim.stats()["fused"] - before == 2
    assert all(opt_a.state[p]["step"].item() == 3 for p in a.parameters())


def test_optimizer_hands_unfusable_layers_to_torch():
    """bf16 parameters (no fp32 master to update) and a layer without a
    recipe: torch steps them, counted, and the forward quantizes again."""
    m = _mlp("cpu", dtype=BF16)
    opt = lpmoe.optim.AdamW(m.parameters(), lr=1e-3, fp8_weights_of=m)
    before = lpmoe.optim.stats()
    _train(m, opt, 2, "cpu")
    after = lpmoe.optim.stats()
    assert after["fused"] == before["fused"] and after["torch"] - before["torch"] == 4
    assert m.linear_fc1.weight_cache.hits == 0


def test_optimizer_checks_its_layers():
    m = _mlp("cpu")
    with pytest.raises(ValueError, match="only some of the weights"):
        lpmoe.optim.AdamW([m.linear_fc1.weight0], fp8_weights_of=m)
    with pytest.raises(ValueError, match="none of its lpmoe GroupedLinear layers"):
        lpmoe.optim.AdamW([m.linear_fc1.bias0], fp8_weights_of=m)
    opt = lpmoe.optim.AdamW(m.linear_fc1.parameters(), fp8_weights_of=m)  # fc2: another optimizer's
    assert [u.name for u in opt._layers] == ["linear_fc1"]
    groups = [{"params": [m.linear_fc1.weight0]}, {"params": [p for n, p in m.named_parameters()
                                                              if n != "linear_fc1.weight0"]}]
    with pytest.raises(ValueError, match="split across parameter groups"):
        lpmoe.optim.AdamW(groups, fp8_weights_of=m)
    with pytest.raises(TypeError, match="torch.nn.Modules"):
        lpmoe.optim.AdamW(m.parameters(), fp8_weights_of=[m.parameters()])


@pytest.mark.parametrize("device", devices())
def test_default_calls_read_only_a_current_optimizer_cache(device):
    """Default calls read a cache only after lpmoe.optim.AdamW wrote it, and
    only while the weights are unchanged (an in-place op bumps their
    version); a cache filled by is_first_microbatch=True is not read (its
    writers need not be seen by version counters).  Outputs always equal a
    twin that quantizes every call."""
    a = _mlp(device)
    b = copy.deepcopy(a)
    opt = lpmoe.optim.AdamW(a.parameters(), lr=1e-2, fp8_weights_of=a)
    splits = torch.tensor(SPLITS, device=device) if device == "cuda" else SPLITS
    x = torch.randn(sum(SPLITS), K, device=device)
    cache = a.linear_fc1.weight_cache

    def both():
        with torch.no_grad(), torch.autocast(device, dtype=BF16), lpmoe.autocast(recipe=FP8):
            return a(x, splits), b(x, splits)
    with torch.no_grad(), torch.autocast(device, dtype=BF16), lpmoe.autocast(recipe=FP8):
        a(x, splits, is_first_microbatch=True)
    u, w = both()
    assert cache.hits == 0 and torch.equal(u, w)
    _train(a, opt, 1, device)
    for p, q in zip(a.parameters(), b.parameters()):
        with torch.no_grad():
            q.copy_(p)
    u, w = both()
    assert cache.hits == 1 and torch.equal(u, w)
    with torch.no_grad():
        for mod in (a, b):
            mod.linear_fc1.weight1.mul_(0.5)
    u, w = both()
    assert cache.hits == 1 and torch.equal(u, w)


def test_inference_tensors_are_never_trusted():
    """Parameters made under torch.inference_mode have no version counter:
    caching still works, and nothing is read by default calls."""
    with torch.inference_mode():
        m = _mlp("cpu", dtype=BF16)
        x = torch.randn(sum(SPLITS), K, dtype=BF16)
        with lpmoe.autocast(recipe=FP8):
            y1 = m(x, SPLITS, is_first_microbatch=True)
            y2 = m(x, SPLITS)
            m.linear_fc1.weight_cache.record(m.linear_fc1.weights)
            y3 = m(x, SPLITS)
    assert torch.equal(y1, y2) and torch.equal(y2, y3) and m.linear_fc1.weight_cache.hits == 0


@requires_cuda
def test_optimizer_step_has_no_host_sync():
    m = _mlp("cuda")
    opt = lpmoe.optim.AdamW(m.parameters(), lr=1e-3, fp8_weights_of=m)
    _train(m, opt, 1, "cuda")  # the first step makes the state and the cache buffers
    splits = torch.tensor(SPLITS, device="cuda")
    x = torch.randn(sum(SPLITS), K, device="cuda")
    with torch.autocast("cuda", dtype=BF16), lpmoe.autocast(recipe=FP8):
        y = m(x, splits)
    y.float().sum().backward()
    assert fused_step_without_sync(opt) == 2


@requires_cuda
def test_captured_forward_reads_the_optimizer_weights():
    """A CUDA graph of the forward + backward with is_first_microbatch=False
    reads the cache buffers the eager optimizer rewrites in place between
    replays: each replay equals an eager step of a twin that quantizes."""
    from conftest import capture_graph
    a = _mlp("cuda")
    b = copy.deepcopy(a)
    opt_a = lpmoe.optim.AdamW(a.parameters(), lr=1e-3, fp8_weights_of=a)
    opt_b = lpmoe.optim.AdamW(b.parameters(), lr=1e-3, fp8_weights_of=b)
    _train(a, opt_a, 1, "cuda", seed=9)
    _train(b, opt_b, 1, "cuda", seed=9, fresh_quantize=True)
    splits = torch.tensor(SPLITS, device="cuda")
    x = torch.randn(sum(SPLITS), K, device="cuda")
    dy = torch.randn(sum(SPLITS), K, device="cuda", dtype=BF16)
    for p in a.parameters():
        p.grad = torch.zeros_like(p)

    def step():
        with torch.autocast("cuda", dtype=BF16), lpmoe.autocast(recipe=FP8):
            y = a(x, splits, is_first_microbatch=False)
        torch.autograd.backward(y, dy)
        return (y,)
    graph, (y_static,) = capture_graph(step)
    for i in range(3):
        new = torch.randn(sum(SPLITS), K, device="cuda")
        x.copy_(new)
        for p in a.parameters():
            p.grad.zero_()
        graph.replay()
        opt_a.step()
        for lin in (b.linear_fc1, b.linear_fc2):
            lin.weight_cache.source = None
        opt_b.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=BF16), lpmoe.autocast(recipe=FP8):
            y = b(new, splits)
        y.backward(dy)
        opt_b.step()
        assert torch.equal(y_static, y)
        for p, q in zip(a.parameters(), b.parameters()):
            assert torch.equal(p, q)


@requires_cuda
def test_weights_quantized_in_a_capture_are_not_trusted_eagerly():
    """A cache refreshed inside CUDA graph capture is written only when the
    graph replays: an eager default call after the capture must quantize
    (here the cache still holds the weights from before an in-place change)
    until something eager writes the cache again."""
    m = _mlp("cuda")
    twin = copy.deepcopy(m)
    splits = torch.tensor(SPLITS, device="cuda")
    x = torch.randn(sum(SPLITS), K, device="cuda")
    with torch.no_grad(), torch.autocast("cuda", dtype=BF16), lpmoe.autocast(recipe=FP8):
        m(x, splits, is_first_microbatch=True)
        for mod in (m, twin):
            for p in mod.parameters():
                p.mul_(1.5)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            m(x, splits, is_first_microbatch=True)
        hits = m.linear_fc1.weight_cache.hits
        y = m(x, splits)
        want = twin(x, splits)
    assert m.linear_fc1.weight_cache.hits == hits
    assert torch.equal(y, want)


@pytest.mark.parametrize("device", devices())
def test_compiled_model_reads_the_optimizer_weights(device):
    """torch.compile(fullgraph=True) of the MLP with is_first_microbatch=False
    (default calls: test_optim_compile.py): the first call fills the cache,
    the optimizer rewrites it every step, and every output and parameter
    equals an eager twin that quantizes."""
    a = _mlp(device)
    b = copy.deepcopy(a)
    opt_a = lpmoe.optim.AdamW(a.parameters(), lr=1e-3, fp8_weights_of=a)
    opt_b = lpmoe.optim.AdamW(b.parameters(), lr=1e-3, fp8_weights_of=b)
    compiled = torch.compile(a, fullgraph=True)
    splits = torch.tensor(SPLITS, device=device)
    gen = torch.Generator().manual_seed(0)
    before = lpmoe.optim.stats()["fused"]
    for _ in range(3):
        x = torch.randn(sum(SPLITS), K, generator=gen).to(device)
        dy = torch.randn(sum(SPLITS), K, generator=gen).to(device, BF16)
        ys = []
        for model, opt, first in ((compiled, opt_a, False), (b, opt_b, None)):
            if first is None:
                for lin in (b.linear_fc1, b.linear_fc2):
                    lin.weight_cache.source = None
            opt.zero_grad(set_to_none=True)
            with torch.autocast(device, dtype=BF16), lpmoe.autocast(recipe=FP8):
                y = model(x, splits, is_first_microbatch=first)
            y.backward(dy)
            opt.step()
            ys.append(y.detach())
        assert torch.equal(ys[0], ys[1])
    assert lpmoe.optim.stats()["fused"] - before == 12
    assert a.linear_fc1.weight_cache.hits == 2
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
