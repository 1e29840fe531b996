"""lpmoe.optim.AdamW: AdamW that writes the expert layers' FP8 weights in its
step (csrc/optim, lpmoe/optim).  The fused kernel is checked bit for bit
against the reference (lpmoe.reference.optim) and lpmoe's quantizer; the
optimizer against torch.optim.AdamW, on the CPU through the reference and on
the GPU through the kernel, with call counters proving which path ran."""
import copy

import pytest
import torch
from torch.library import opcheck

import lpmoe
from conftest import poison_, requires_cuda
from lpmoe.library import specs
from lpmoe.optim.kernels import QUANTIZED_BUFFERS
from lpmoe.reference.optim import adamw_scalars, adamw_step_

BF16 = torch.bfloat16
FP8 = lpmoe.recipe.Float8BlockScaling()
Q2D = lpmoe.Float8BlockQuantizer(block_dim=2)
G, K, N = 4, 256, 128
SPLITS = [100, 0, 150, 50]


def devices():
    return ["cpu", pytest.param("cuda", id="gpu", marks=requires_cuda)]


# ------------------------------------------------------------ reference math
def test_reference_follows_torch_adamw():
    """Our fixed op order is torch.optim.AdamW up to rounding (torch's own
    single-tensor, foreach and fused implementations differ as much)."""
    torch.manual_seed(0)
    p = torch.randn(64, 48)
    q = p.clone().requires_grad_(True)
    opt = torch.optim.AdamW([q], lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1, foreach=False)
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    for step in range(1, 6):
        g = torch.randn_like(p)
        q.grad = g.clone()
        opt.step()
        adamw_step_(p, g, m, v, adamw_scalars(1e-2, 0.8, 0.95, 1e-6, 0.1, step))
    torch.testing.assert_close(p, q.detach(), rtol=2e-6, atol=1e-7)
    torch.testing.assert_close(v, opt.state[q]["exp_avg_sq"], rtol=1e-6, atol=0)


def test_scalars_are_fp32_values():
    s = adamw_scalars(3e-4, 0.9, 0.95, 1e-8, 0.1, 7)
    for x in s:
        assert torch.tensor(x, dtype=torch.float32).item() == x
    assert s.step_size == pytest.approx(3e-4 / (1 - 0.9 ** 7), rel=1e-7)


# --------------------------------------------------------------- the op
def _members(g, n, k, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    mk = lambda scale: [(torch.randn(n, k, generator=gen) * scale).to(device) for _ in range(g)]  # noqa: E731
    params, grads, m = mk(0.05), mk(1e-3), mk(1e-4)
    v = [(t * t * 10).to(device) for t in mk(1e-3)]
    return params, grads, m, v


def _out_buffers(params, q):
    g = len(params)
    n, k = params[0].shape
    made = lpmoe.group_quantize(torch.stack(params).view(g * n, k), q, num_tensors=g)
    return made, [poison_(getattr(made, b)) for b in QUANTIZED_BUFFERS]


def _expected(params, grads, m, v, s, q):
    """Reference step on copies, then lpmoe's quantizer on the result."""
    params, m, v = ([t.clone() for t in ts] for ts in (params, m, v))
    for p, g, a, b in zip(params, grads, m, v):
        adamw_step_(p, g, a, b, s)
    g = len(params)
    n, k = params[0].shape
    return params, m, v, lpmoe.group_quantize(torch.stack(params).view(g * n, k), q, num_tensors=g)


def _run_op(params, grads, m, v, s, q):
    made, out = _out_buffers(params, q)
    lpmoe.library.routing.OPS["adamw_fp8_block_step"](params, grads, m, v, s, q, out)
    return made


def _assert_step_exact(shape, device, edit=None, q=Q2D):
    params, grads, m, v = _members(*shape, device)
    if edit is not None:
        edit(params, grads, m, v)
    s = adamw_scalars(1e-3, 0.9, 0.95, 1e-8, 0.1, 3)
    want_p, want_m, want_v, want_q = _expected(params, grads, m, v, s, q)
    got_q = _run_op(params, grads, m, v, s, q)
    for got, want in ((params, want_p), (m, want_m), (v, want_v)):
        for a, b in zip(got, want):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    for b in QUANTIZED_BUFFERS:
        assert torch.equal(getattr(got_q, b).view(torch.uint8), getattr(want_q, b).view(torch.uint8)), b


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("shape", [(1, 128, 128), (3, 200, 336), (2, 1, 16)], ids=str)
def test_fused_step_is_reference_then_quantize(device, shape):
    _assert_step_exact(shape, device)


@requires_cuda
@pytest.mark.parametrize("shape", [(70, 16, 32), (130, 129, 144)], ids=str)
def test_fused_step_gpu_many_members(shape):
    """More members than one launch's pointer tables (64) hold."""
    before = lpmoe.optim.kernels.fused_launches()
    _assert_step_exact(shape, "cuda")
    assert lpmoe.optim.kernels.fused_launches() - before == -(-shape[0] // 64)


def _special_values(params, grads, m, v):
    grads[0][0, :16] = 0.0
    grads[0][1, 0] = float("nan")
    grads[0][2, 5] = float("inf")
    grads[0][3, :] = 1e30
    params[0][4, :] = 0.0
    params[0][5, 7] = 1e-41  # subnormal
    v[0][6, :] = 0.0
    m[0][6, :] = 0.0


@pytest.mark.parametrize("device", devices())
def test_fused_step_special_values(device):
    _assert_step_exact((2, 160, 128), device, edit=_special_values)


@requires_cuda
@pytest.mark.parametrize("q", [lpmoe.Float8BlockQuantizer(block_dim=2, fp8_dtype=torch.float8_e5m2),
                               lpmoe.Float8BlockQuantizer(block_dim=2, pow2_scales=False, amax_epsilon=1e-3)],
                         ids=["e5m2", "fp32_scales"])
def test_fused_step_gpu_formats(q):
    _assert_step_exact((2, 256, 384), "cuda", q=q)


def test_fused_step_rejects_bad_input():
    params, grads, m, v = _members(2, 32, 32, "cpu")
    s = adamw_scalars(1e-3, 0.9, 0.95, 1e-8, 0.1, 1)
    _, out = _out_buffers(params, Q2D)
    step = lpmoe.library.routing.OPS["adamw_fp8_block_step"]
    with pytest.raises(TypeError, match=r"grads\[1\] must be a float32"):
        step(params, [grads[0], grads[1].to(BF16)], m, v, s, Q2D, out)
    with pytest.raises(ValueError, match="exp_avgs has 1 tensors"):
        step(params, grads, m[:1], v, s, Q2D, out)
    with pytest.raises(ValueError, match="multiple of 16"):
        bad = [t[:, :24].contiguous() for t in params]
        step(bad, bad, bad, bad, s, Q2D, out)
    with pytest.raises(ValueError, match="128x128"):
        step(params, grads, m, v, s, lpmoe.Float8BlockQuantizer(), out)


def test_opcheck_adamw_fp8_block_step():
    from lpmoe.library.optim_ops import _step
    params, grads, m, v = _members(2, 32, 32, "cpu")
    _, out = _out_buffers(params, Q2D)
    s = adamw_scalars(1e-3, 0.9, 0.95, 1e-8, 0.1, 1)
    opcheck(_step, (params, grads, m, v, list(s), specs.encode(Q2D), out),
            test_utils=("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic"))


# ------------------------------------------------------------- the optimizer
def _mlp(device, seed=1, dtype=torch.float32, **kw):
    torch.manual_seed(seed)
    return lpmoe.GroupedMLP(G, K, N, bias=True, params_dtype=dtype, device=device, **kw)


def _train(model, opt, steps, device, seed=5, fresh_quantize=False, first=None):
    """``steps`` of fwd + bwd + opt.step under bf16 autocast and the FP8
    recipe; returns the outputs.  fresh_quantize: empty the weight caches
    before each forward (the layers quantize their weights themselves)."""
    gen = torch.Generator().manual_seed(seed)
    splits = torch.tensor(SPLITS, device=device) if device == "cuda" else SPLITS
    outs = []
    for _ in range(steps):
        x = torch.randn(sum(SPLITS), K, generator=gen).to(device)
        dy = torch.randn(sum(SPLITS), K, generator=gen).to(device, BF16)
        if fresh_quantize:
            for lin in (model.linear_fc1, model.linear_fc2):
                lin.weight_cache.source = None
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=BF16), lpmoe.autocast(recipe=FP8):
            kw = {} if first is None else {"is_first_microbatch": first}
            y = model(x, splits, **kw)
        y.backward(dy)
        opt.step()
        outs.append(y.detach())
    return outs


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


def test_step_hooks_run_once():
    """torch wraps each optimizer class's step with the step hooks; the
    part of the step lpmoe hands to torch's AdamW must not run them again
    (also once a plain torch.optim.AdamW exists, whose step is wrapped)."""
    m = _mlp("cpu")
    torch.optim.AdamW(copy.deepcopy(m).parameters())
    opt = lpmoe.optim.AdamW(m.parameters(), lr=1e-3, fp8_weights_of=m)
    calls = []
    opt.register_step_pre_hook(lambda *a: calls.append("pre"))
    opt.register_step_post_hook(lambda *a: calls.append("post"))
    _train(m, opt, 2, "cpu")
    assert calls == ["pre", "post"] * 2
    assert torch.optim.AdamW.step.hooked


def test_expert_step_counts_differing_go_to_torch():
    """A state whose experts were stepped a different number of times (one
    AdamW step count per layer in the kernel) is stepped by torch."""
    m = _mlp("cpu")
    opt = lpmoe.optim.AdamW(m.parameters(), lr=1e-3, fp8_weights_of=m)
    _train(m, opt, 1, "cpu")
    opt.state[m.linear_fc1.weight0]["step"] = torch.tensor(7.0)
    before = lpmoe.optim.stats()
    _train(m, opt, 1, "cpu")
    after = lpmoe.optim.stats()
    assert after["fused"] - before["fused"] == 1 and after["torch"] - before["torch"] == 1


def test_steps_by_torch_in_between_are_counted(monkeypatch):
    """A layer torch stepped for a while (steps where its cache asked for no
    FP8 format) continues on the fused path with the right AdamW step
    count (the bias corrections of step 4)."""
    m = _mlp("cpu")
    opt = lpmoe.optim.AdamW(m.parameters(), lr=1e-3, fp8_weights_of=m)
    _train(m, opt, 1, "cpu")
    wanted = m.linear_fc1.weight_cache.wanted
    x = torch.randn(sum(SPLITS), K)
    for _ in range(2):  # bf16 autocast without the FP8 recipe: torch steps both layers
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=BF16):
            m.linear_fc1.weight_cache.wanted = None
            m.linear_fc2.weight_cache.wanted = None
            m(x, SPLITS).float().sum().backward()
        opt.step()
    assert all(opt.state[p]["step"].item() == 3 for p in m.parameters())
    m.linear_fc1.weight_cache.wanted = wanted
    seen = []
    real = lpmoe.optim.adamw.adamw_scalars
    monkeypatch.setattr(lpmoe.optim.adamw, "adamw_scalars", lambda *a: seen.append(a[-1]) or real(*a))
    before = lpmoe.optim.stats()["fused"]
    _train(m, opt, 1, "cpu")
    assert lpmoe.optim.stats()["fused"] - before == 2 and seen == [4, 4]
    assert all(opt.state[p]["step"].item() == 4 for p in m.parameters())


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


def test_grad_scaler_steps_go_to_torch():
    """A fused torch AdamW applies GradScaler's scale and inf flag itself;
    the fused layer step does not, so with a scaler those layers go to
    torch: the same parameters as torch.optim.AdamW(fused=True)."""
    a = _mlp("cpu")
    b = copy.deepcopy(a)
    opt_a = lpmoe.optim.AdamW(a.parameters(), lr=1e-3, fused=True, fp8_weights_of=a)
    opt_b = torch.optim.AdamW(b.parameters(), lr=1e-3, fused=True)
    before = lpmoe.optim.stats()
    for model, opt in ((a, opt_a), (b, opt_b)):
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
        gen = torch.Generator().manual_seed(3)
        for _ in range(2):
            x = torch.randn(sum(SPLITS), K, generator=gen)
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=BF16), lpmoe.autocast(recipe=FP8):
                loss = model(x, SPLITS).float().square().mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    after = lpmoe.optim.stats()
    assert after["fused"] == before["fused"] and after["torch"] - before["torch"] == 4
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


def test_an_expert_without_gradient_sends_its_layer_to_torch():
    """torch's AdamW skips an expert whose gradient is None, so the
    experts' step counts part; the fused step (one count per layer) then
    leaves that layer to torch for good, the other layer stays fused."""
    m = _mlp("cpu")
    opt = lpmoe.optim.AdamW(m.parameters(), lr=1e-3, fp8_weights_of=m)
    _train(m, opt, 1, "cpu")
    x = torch.randn(sum(SPLITS), K)
    for drop in (True, False):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=BF16), lpmoe.autocast(recipe=FP8):
            m(x, SPLITS).float().sum().backward()
        if drop:
            m.linear_fc1.weight0.grad = None
        before = lpmoe.optim.stats()
        opt.step()
        after = lpmoe.optim.stats()
        assert after["fused"] - before["fused"] == 1 and after["torch"] - before["torch"] == 1
    steps = [opt.state[w]["step"].item() for w in m.linear_fc1.weights]
    assert steps == [2.0, 3.0, 3.0, 3.0]
    assert all(opt.state[w]["step"].item() == 3.0 for w in m.linear_fc2.weights)


@requires_cuda
def test_fused_group_hands_layers_back_to_torch_on_the_device():
    """With fused=True torch keeps step counts on the parameters' device;
    a layer that leaves the fused path for a step gets them back there
    (torch's fused kernel takes no CPU counts) and returns afterwards."""
    m = _mlp("cuda")
    opt = lpmoe.optim.AdamW(m.parameters(), lr=1e-3, fused=True, fp8_weights_of=m)
    _train(m, opt, 1, "cuda")
    wanted = m.linear_fc1.weight_cache.wanted
    x = torch.randn(sum(SPLITS), K, device="cuda")
    splits = torch.tensor(SPLITS, device="cuda")
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=BF16), lpmoe.autocast(recipe=FP8):
        m(x, splits).float().sum().backward()
    m.linear_fc1.weight_cache.wanted = None  # as after a forward without the FP8 recipe
    before = lpmoe.optim.stats()
    opt.step()
    assert lpmoe.optim.stats()["torch"] - before["torch"] == 1
    assert all(opt.state[w]["step"].device.type == "cuda" for w in m.linear_fc1.weights)
    m.linear_fc1.weight_cache.wanted = wanted
    before = lpmoe.optim.stats()
    _train(m, opt, 1, "cuda")
    assert lpmoe.optim.stats()["fused"] - before["fused"] == 2
    assert all(opt.state[p]["step"].item() == 3 for p in m.parameters())


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
    before = lpmoe.optim.stats()["fused"]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        opt.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert lpmoe.optim.stats()["fused"] - before == 2


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


def test_other_groups_and_formats():
    """Layers stay fused across add_param_group; another FP8 format asked
    for remakes the cache's buffers in it; a group asking for coupled
    weight decay goes to torch."""
    m = _mlp("cpu")
    experts = [p for n, p in m.named_parameters() if "weight" in n]
    opt = lpmoe.optim.AdamW(experts, lr=1e-3, fp8_weights_of=m)
    opt.add_param_group({"params": [p for n, p in m.named_parameters() if "bias" in n]})
    before = lpmoe.optim.stats()
    _train(m, opt, 1, "cpu")
    assert lpmoe.optim.stats()["fused"] - before["fused"] == 2
    e5m2 = lpmoe.Float8BlockQuantizer(block_dim=2, fp8_dtype=torch.float8_e5m2)
    x = torch.randn(sum(SPLITS), K)
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=BF16), lpmoe.autocast(recipe=FP8):
        m(x, SPLITS).float().sum().backward()
    m.linear_fc1.weight_cache.wanted = e5m2
    opt.step()
    q = m.linear_fc1.weight_cache.quantized
    assert q.quantizer.fp8_dtype == torch.float8_e5m2
    want = lpmoe.group_quantize(torch.stack(m.linear_fc1.weights).view(-1, K), e5m2.copy(), num_tensors=G)
    assert torch.equal(q.rowwise_data.view(torch.uint8), want.rowwise_data.view(torch.uint8))
    opt.param_groups[0]["decoupled_weight_decay"] = False
    before = lpmoe.optim.stats()
    _train(m, opt, 1, "cpu")
    after = lpmoe.optim.stats()
    assert after["fused"] == before["fused"] and after["torch"] - before["torch"] == 2


def test_main_grad_layers_go_to_torch():
    """With fuse_wgrad_accumulation the gradient goes to main_grad and
    .grad is a placeholder: the fused step must not read it."""
    m = _mlp("cpu", fuse_wgrad_accumulation=True)
    for lin in (m.linear_fc1, m.linear_fc2):
        for w in lin.weights:
            w.main_grad = torch.zeros_like(w)
            w.grad_added_to_main_grad = False
    opt = lpmoe.optim.AdamW(m.parameters(), lr=1e-3, fp8_weights_of=m)
    before = lpmoe.optim.stats()
    _train(m, opt, 1, "cpu")
    after = lpmoe.optim.stats()
    assert after["fused"] == before["fused"] and after["torch"] - before["torch"] == 2
