"""lpmoe.optim.AdamW where torch's AdamW steps a layer instead of the fused
kernel (GradScaler with fused=True, an expert without a gradient, a fused
group's device step counts, coupled weight decay, main_grad, step counts
that part or come from torch), and what survives it: the step hooks run
once, the counts stay right, the layer comes back to the fused path."""
import copy

import torch

import lpmoe
from _optim_common import BF16, FP8, G, K, SPLITS, _mlp, _train
from conftest import requires_cuda


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


def test_tied_layers_step_their_weights_once():
    """Two layers sharing their weight tensors: one update per step (the
    first layer's unit; the second layer quantizes in its forward), as
    torch's AdamW gives the shared parameters."""
    torch.manual_seed(4)
    a = lpmoe.GroupedLinear(G, K, K, params_dtype=torch.float32, device="cpu")
    b = lpmoe.GroupedLinear(G, K, K, params_dtype=torch.float32, device="cpu")
    for i in range(G):
        setattr(b, f"weight{i}", getattr(a, f"weight{i}"))
    model = torch.nn.ModuleList([a, b])
    ref = copy.deepcopy(model)
    opt = lpmoe.optim.AdamW(model.parameters(), lr=1e-2, fp8_weights_of=model)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    assert len(opt._layers) == 1
    x = torch.randn(sum(SPLITS), K)
    for mod, o in ((model, opt), (ref, opt_ref)):
        with torch.autocast("cpu", dtype=BF16), lpmoe.autocast(recipe=FP8):
            y = mod[1](mod[0](x, SPLITS), SPLITS)
        y.float().sum().backward()
        o.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6)
