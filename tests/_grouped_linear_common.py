"""Shared helpers of the GroupedLinear tests (tests/test_grouped_linear*.py):
a layer factory, forward+backward runners for the layer and for separate
torch.nn.Linear, the routing cases, and spies that prove which path ran."""
import pytest
import torch

import lpmoe


G, K, N = 3, 128, 256  # experts, in_features, out_features (multiples of 128: every format's blocks)


def rel(a, b):
    """Norm-wise relative error of a against b."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def make_layer(dtype=torch.bfloat16, bias=True, device="cpu", seed=0, g=G, k=K, n=N):
    torch.manual_seed(seed)
    layer = lpmoe.GroupedLinear(g, k, n, bias=bias, params_dtype=dtype, device=device)
    if bias:  # non-zero biases so their contribution is checked
        with torch.no_grad():
            for b in layer.biases:
                b.normal_()
    return layer


def linear_loop(layer):
    """N separate torch.nn.Linear with the layer's parameters (copies)."""
    out = []
    for i in range(layer.num_gemms):
        lin = torch.nn.Linear(layer.in_features, layer.out_features, bias=layer.use_bias,
                              dtype=layer.params_dtype, device=layer.weight0.device)
        with torch.no_grad():
            lin.weight.copy_(layer.weights[i])
            if layer.use_bias:
                lin.bias.copy_(layer.biases[i])
        out.append(lin)
    return out


def run(layer, x, splits, dy, recipe=None, **kw):
    """Forward + backward; returns (y, dx, [dW], [db])."""
    x = x.detach().clone().requires_grad_(True)
    for p in layer.parameters():
        p.grad = None
    with lpmoe.autocast(enabled=recipe is not None, recipe=recipe):
        y = layer(x, splits, **kw)
    y.backward(dy)
    return (y.detach(), x.grad, [w.grad for w in layer.weights],
            [b.grad for b in layer.biases] if layer.use_bias else [])


def run_loop(lins, x, splits, dy):
    x = x.detach().clone().requires_grad_(True)
    rows, ys = 0, []
    for lin, m in zip(lins, splits):
        ys.append(lin(x[rows:rows + m]))
        rows += m
    y = torch.cat(ys)
    y.backward(dy[:rows])
    return y.detach(), x.grad, [l.weight.grad for l in lins], [l.bias.grad for l in lins if l.bias is not None]


SPLITS = [
    [40, 70, 18],   # uneven, no tail
    [0, 100, 20],   # an empty expert first, 8-row tail
    [64, 0, 0],     # two empty experts, 64-row tail
    [0, 0, 0],      # nothing routed: all tail
]



# ------------------------------------------------------- path proofs
class _Spy:
    """Wrap a function, recording each call's arguments (and, in ``log``
    shared by the spies of one test, the order of all calls by name)."""

    def __init__(self, fn, name, log):
        self.fn, self.calls, self.name, self.log = fn, [], name, log

    def __call__(self, *a, **kw):
        self.calls.append((a, kw))
        self.log.append((self.name, a, kw))
        return self.fn(*a, **kw)


# Where each function is called from (one spy per function, patched into
# every module that calls it).
SPY_SITES = {
    "grouped_gemm": ("lpmoe.functional.linear_steps",),
    "group_quantize": ("lpmoe.policy.fp8_block", "lpmoe.policy.emulated", "lpmoe.functional.weights",
                       "lpmoe.activation.kernels"),
    "group_quantize_dbias": ("lpmoe.policy.fp8_block", "lpmoe.activation.kernels"),
}


@pytest.fixture
def spies(monkeypatch):
    import importlib

    s = {"log": []}
    for name, modules in SPY_SITES.items():
        mods = [importlib.import_module(m) for m in modules]
        s[name] = _Spy(getattr(mods[0], name), name, s["log"])
        for mod in mods:
            monkeypatch.setattr(mod, name, s[name])
    return s


def cuda_layer(dtype=torch.bfloat16, g=4, k=256, n=512):
    return make_layer(dtype, device="cuda", g=g, k=k, n=n)
