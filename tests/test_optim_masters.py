"""lpmoe.optim.AdamW(master_weights=True): bf16 parameters trained through
fp32 master weights.  The fused expert-layer step against a twin that
quantizes its bf16 weights itself (bit for bit), every parameter against
torch.optim.AdamW run on fp32 copies and rounded (bit for bit where torch
steps the masters), state dicts keeping the masters fp32, and which path
ran (counters)."""
import copy

import pytest
import torch

import lpmoe
from _optim_common import BF16, _mlp, _train, devices, fused_step_without_sync
from conftest import requires_cuda

HP = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)


def _masters(opt, model):
    return [opt.state[p]["master_param"] for p in model.parameters()]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("stacked", [False, True], ids=["per_expert", "stacked"])
def test_master_weights_write_the_weights_the_forward_would_make(device, stacked):
    """bf16 parameters, fp32 masters: the fused path runs (counted), each
    forward after the first reads the optimizer's FP8 weights, and every
    output equals a twin that quantizes its bf16 weights itself, bit for bit
    (so the FP8 copies are those of the rounded weights; the parameters,
    masters and moments then agree too); every parameter is its master
    rounded."""
    a = _mlp(device, dtype=BF16, single_grouped_parameter=stacked)
    b = copy.deepcopy(a)
    opt_a = lpmoe.optim.AdamW(a.parameters(), master_weights=True, fp8_weights_of=a, **HP)
    opt_b = lpmoe.optim.AdamW(b.parameters(), master_weights=True, fp8_weights_of=b, **HP)
    before = lpmoe.optim.stats()
    launches = lpmoe.optim.kernels.fused_launches() if device == "cuda" else None
    ya = _train(a, opt_a, 3, device)
    yb = _train(b, opt_b, 3, device, fresh_quantize=True)
    after = lpmoe.optim.stats()
    assert after["fused"] - before["fused"] == 2 * 2 * 3 and after["torch"] == before["torch"]
    if device == "cuda":
        assert lpmoe.optim.kernels.fused_launches() - launches == 12
    assert a.linear_fc1.weight_cache.hits == 2 and a.linear_fc2.weight_cache.hits == 2
    for u, w in zip(ya, yb):
        assert torch.equal(u, w)
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert p.dtype == BF16 and torch.equal(p, q), name
        st_a, st_b = opt_a.state[p], opt_b.state[q]
        for key in ("master_param", "exp_avg", "exp_avg_sq"):
            assert st_a[key].dtype == torch.float32, (name, key)
            assert torch.equal(st_a[key], st_b[key]), (name, key)
        assert torch.equal(p, st_a["master_param"].to(BF16)), name


@pytest.mark.parametrize("device", devices())
def test_master_weights_follow_torch_adamw_on_fp32_copies(device):
    """The same training with torch.optim.AdamW on fp32 copies of the
    parameters, whose values are rounded into bf16 twins after each step:
    the biases (torch steps their masters) bitwise after the first step,
    the expert weights' masters up to AdamW's rounding order, and each bf16
    parameter its master rounded."""
    a = _mlp(device, dtype=BF16)
    b = copy.deepcopy(a)
    fp32 = [p.detach().float().requires_grad_(True) for p in b.parameters()]
    opt_a = lpmoe.optim.AdamW(a.parameters(), master_weights=True, fp8_weights_of=a, **HP)
    opt_ref = torch.optim.AdamW(fp32, **HP)

    class Rounding:  # torch's AdamW on the fp32 copies, then round them into b
        def zero_grad(self, set_to_none=True):
            for p in b.parameters():
                p.grad = None

        def step(self):
            for p, w in zip(b.parameters(), fp32):
                w.grad = p.grad.float()
            opt_ref.step()
            with torch.no_grad():
                for p, w in zip(b.parameters(), fp32):
                    p.copy_(w)
    for steps in (1, 2):  # the first step from equal weights: equal gradients
        _train(a, opt_a, 1, device, seed=steps)
        _train(b, Rounding(), 1, device, seed=steps)
        for (name, p), w, m in zip(a.named_parameters(), fp32, _masters(opt_a, a)):
            if "bias" in name and steps == 1:
                assert torch.equal(m, w.detach()), name
            else:
                torch.testing.assert_close(m, w.detach(), rtol=1e-4, atol=1e-6)
            assert torch.equal(p, m.to(BF16)), name


@pytest.mark.parametrize("device", devices())
def test_master_weights_state_dict_keeps_fp32(device):
    """The state dict carries the fp32 masters and moments; loading it into
    a fresh optimizer over bf16 parameters keeps them fp32 (torch would cast
    them to bf16) and training goes on on the fused path, equal to the
    original optimizer's next step."""
    a = _mlp(device, dtype=BF16)
    opt = lpmoe.optim.AdamW(a.parameters(), master_weights=True, fp8_weights_of=a, **HP)
    _train(a, opt, 2, device)
    sd = opt.state_dict()
    assert all(sd["state"][i]["master_param"].dtype == torch.float32 for i in sd["state"])
    b = copy.deepcopy(a)
    opt_b = lpmoe.optim.AdamW(b.parameters(), master_weights=True, fp8_weights_of=b, **HP)
    opt_b.load_state_dict(copy.deepcopy(sd))
    for p, q in zip(a.parameters(), b.parameters()):
        for key in ("master_param", "exp_avg", "exp_avg_sq"):
            assert opt_b.state[q][key].dtype == torch.float32 and opt_b.state[q][key].device == q.device
            assert torch.equal(opt_b.state[q][key], opt.state[p][key])
    before = lpmoe.optim.stats()["fused"]
    ya = _train(a, opt, 1, device, seed=9)
    yb = _train(b, opt_b, 1, device, seed=9)
    assert lpmoe.optim.stats()["fused"] - before == 4
    assert torch.equal(ya[0], yb[0])
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q) and torch.equal(opt.state[p]["master_param"], opt_b.state[q]["master_param"])


def _fp32_twin_step(model, opt_state_of, grads):
    """torch.optim.AdamW on fp32 copies of ``model``'s parameters, resumed
    from the states ``opt_state_of(p)`` (masters as the values), one step
    with ``grads``: the fp32 results."""
    ws, states = [], []
    for p in model.parameters():
        st = opt_state_of(p)
        ws.append(st["master_param"].clone().requires_grad_(True))
        states.append({k: (v.clone().float() if k != "step" else v.clone()) for k, v in st.items()
                       if k != "master_param"})
    ref = torch.optim.AdamW(ws, **HP)
    for w, st, g in zip(ws, states, grads):
        ref.state[w] = st
        w.grad = g.float()
    ref.step()
    return [w.detach() for w in ws]


def test_master_weights_take_over_a_bf16_state():
    """A state saved by torch's AdamW on bf16 parameters (bf16 moments, no
    masters): the next step makes the masters from the parameters, widens
    the moments and takes the fused path, equal to torch's AdamW resumed on
    fp32 copies of the parameters (biases bitwise, weights up to rounding
    order)."""
    a = _mlp("cpu", dtype=BF16)
    torch_opt = torch.optim.AdamW(a.parameters(), **HP)
    _train(a, torch_opt, 1, "cpu")
    opt = lpmoe.optim.AdamW(a.parameters(), master_weights=True, fp8_weights_of=a, **HP)
    opt.load_state_dict(torch_opt.state_dict())
    # torch's state as loaded (the loaded state shares its step tensors, which the step bumps)
    snap = {id(p): {**{k: v.clone() for k, v in torch_opt.state[p].items()}, "master_param": p.detach().float()}
            for p in a.parameters()}

    def resumed(p):
        return snap[id(p)]
    before = lpmoe.optim.stats()["fused"]
    grads = []

    class Recording:  # lpmoe's step, with the gradients kept for the reference
        def zero_grad(self, set_to_none=True):
            opt.zero_grad(set_to_none)

        def step(self):
            grads.extend(p.grad.clone() for p in a.parameters())
            opt.step()
    _train(a, Recording(), 1, "cpu")
    assert lpmoe.optim.stats()["fused"] - before == 2
    want = _fp32_twin_step(a, resumed, grads)
    for (name, p), w in zip(a.named_parameters(), want):
        st = opt.state[p]
        assert st["step"].item() == 2
        assert all(st[k].dtype == torch.float32 for k in ("master_param", "exp_avg", "exp_avg_sq"))
        if "bias" in name:
            assert torch.equal(st["master_param"], w), name
        else:
            torch.testing.assert_close(st["master_param"], w, rtol=1e-4, atol=1e-6)
        assert torch.equal(p, st["master_param"].to(BF16))


@pytest.mark.parametrize("device", devices())
def test_master_weights_through_torch_adamw_and_back(device):
    """lpmoe -> torch.optim.AdamW (which casts the masters to bf16 and then
    trains the bf16 weights without them) -> lpmoe: the masters are remade
    from the weights torch left, not taken from the stale, cast copies."""
    a = _mlp(device, dtype=BF16)
    opt = lpmoe.optim.AdamW(a.parameters(), master_weights=True, fp8_weights_of=a, **HP)
    _train(a, opt, 1, device)
    torch_opt = torch.optim.AdamW(a.parameters(), **HP)
    torch_opt.load_state_dict(opt.state_dict())
    _train(a, torch_opt, 2, device, seed=7)
    trained = [p.detach().clone() for p in a.parameters()]
    back = lpmoe.optim.AdamW(a.parameters(), master_weights=True, fp8_weights_of=a, **HP)
    back.load_state_dict(torch_opt.state_dict())
    before = lpmoe.optim.stats()["fused"]
    _train(a, back, 1, device, seed=8)
    assert lpmoe.optim.stats()["fused"] - before == 2
    for p, t in zip(a.parameters(), trained):
        m = back.state[p]["master_param"]
        assert m.dtype == torch.float32 and torch.equal(p, m.to(BF16))
        # one small step from where torch left the weights (a stale master would be a step behind)
        torch.testing.assert_close(p.float(), t.float(), rtol=0, atol=5e-3)


@pytest.mark.parametrize("device", devices())
def test_weights_written_outside_the_optimizer_remake_their_masters(device):
    """An in-place write to a weight between steps (copy_, as a model
    load_state_dict does) is seen by its version counter: the next step
    starts from the written value, not from the old master; weights the
    optimizer wrote itself keep their masters (sub-ulp updates survive)."""
    a = _mlp(device, dtype=BF16)
    opt = lpmoe.optim.AdamW(a.parameters(), master_weights=True, fp8_weights_of=a, **HP)
    _train(a, opt, 1, device)
    kept = opt.state[a.linear_fc2.weight0]["master_param"].clone()
    assert not torch.equal(kept, a.linear_fc2.weight0.float())  # the master holds more than the weight
    with torch.no_grad():
        a.linear_fc1.weight0.fill_(0.5)
        a.linear_fc1.bias1.fill_(-0.25)
    m = opt._masters
    assert torch.equal(m.master(a.linear_fc1.weight0), torch.full(a.linear_fc1.weight0.shape, 0.5, device=device))
    assert torch.equal(m.master(a.linear_fc1.bias1), torch.full(a.linear_fc1.bias1.shape, -0.25, device=device))
    assert torch.equal(m.master(a.linear_fc2.weight0), kept)
    _train(a, opt, 1, device)
    for p in a.parameters():
        assert torch.equal(p, opt.state[p]["master_param"].to(BF16))


def test_model_loaded_after_the_optimizer_state():
    """Resuming with the optimizer's state loaded before the model's weights
    (or the other way round): the first step compares each master with its
    weight once and keeps those that agree, bit for bit."""
    a = _mlp("cpu", dtype=BF16)
    opt = lpmoe.optim.AdamW(a.parameters(), master_weights=True, fp8_weights_of=a, **HP)
    _train(a, opt, 2, "cpu")
    ckpt = {"model": copy.deepcopy(a.state_dict()), "opt": copy.deepcopy(opt.state_dict())}
    for order in ("opt_first", "model_first"):
        b = _mlp("cpu", dtype=BF16, seed=3)
        opt_b = lpmoe.optim.AdamW(b.parameters(), master_weights=True, fp8_weights_of=b, **HP)
        if order == "opt_first":
            opt_b.load_state_dict(copy.deepcopy(ckpt["opt"]))
            b.load_state_dict(ckpt["model"])
        else:
            b.load_state_dict(ckpt["model"])
            opt_b.load_state_dict(copy.deepcopy(ckpt["opt"]))
        opt_b._masters.verify(list(b.parameters()))
        for p, q in zip(a.parameters(), b.parameters()):
            assert torch.equal(opt_b._masters.master(q), opt.state[p]["master_param"]), order
    # weights from elsewhere (another checkpoint) under this optimizer state: masters remade from them
    c = _mlp("cpu", dtype=BF16, seed=4)
    opt_c = lpmoe.optim.AdamW(c.parameters(), master_weights=True, fp8_weights_of=c, **HP)
    opt_c.load_state_dict(copy.deepcopy(ckpt["opt"]))
    _train(c, opt_c, 1, "cpu")
    d = _mlp("cpu", dtype=BF16, seed=4)
    opt_d = lpmoe.optim.AdamW(d.parameters(), master_weights=True, fp8_weights_of=d, **HP)
    _train(d, opt_d, 1, "cpu")  # fresh masters from the same weights, same first update direction
    for p, q in zip(c.parameters(), d.parameters()):
        assert torch.equal(p, opt_c.state[p]["master_param"].to(BF16))
        torch.testing.assert_close(p.float(), q.float(), rtol=0, atol=2e-2)


def test_a_failed_swap_leaves_the_optimizer_as_it_was(monkeypatch):
    """An error while the masters are put in the parameters' place (here:
    making one) leaves the parameter groups and the state untouched."""
    from lpmoe.optim import masters as masters_mod
    a = _mlp("cpu", dtype=BF16)
    opt = lpmoe.optim.AdamW(a.parameters(), master_weights=True, **HP)
    _train(a, opt, 1, "cpu")
    groups = [[id(p) for p in g["params"]] for g in opt.param_groups]
    keys = {id(p) for p in opt.state}
    calls = {"n": 0}
    real = masters_mod.Masters.master

    def failing(self, p):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("out of memory (simulated)")
        return real(self, p)
    monkeypatch.setattr(masters_mod.Masters, "master", failing)
    for p in a.parameters():
        p.grad = torch.ones_like(p)
    with pytest.raises(RuntimeError, match="simulated"):
        opt.step()
    assert [[id(p) for p in g["params"]] for g in opt.param_groups] == groups
    assert {id(p) for p in opt.state} == keys
    assert all(opt.state[p]["master_param"].grad is None for p in a.parameters())
    opt.state_dict()  # still consistent


def test_without_master_weights_bf16_layers_go_to_torch():
    """master_weights=False (the default): bf16 parameters stay torch's
    bf16 AdamW (no masters), counted as torch steps."""
    a = _mlp("cpu", dtype=BF16)
    opt = lpmoe.optim.AdamW(a.parameters(), fp8_weights_of=a, **HP)
    before = lpmoe.optim.stats()
    _train(a, opt, 1, "cpu")
    after = lpmoe.optim.stats()
    assert after["fused"] == before["fused"] and after["torch"] - before["torch"] == 2
    assert all("master_param" not in opt.state[p] for p in a.parameters())


@requires_cuda
def test_master_weights_step_has_no_host_sync():
    a = _mlp("cuda", dtype=BF16)
    opt = lpmoe.optim.AdamW(a.parameters(), master_weights=True, fp8_weights_of=a, foreach=True, **HP)
    _train(a, opt, 1, "cuda")
    _train(a, opt, 1, "cuda")  # the step counts adopted
    for p in a.parameters():
        p.grad = torch.randn_like(p)
    assert fused_step_without_sync(opt) == 2
