"""Shared pieces of the mixed-precision tests (test_mixed_precision*.py):
fp32 parameters under torch.autocast, lpmoe.functional.precision."""
import pytest
import torch

import lpmoe
from conftest import requires_cuda

G, K, N = 4, 256, 128
SPLITS = [100, 0, 150, 50]
BF16 = torch.bfloat16


def devices():
    return ["cpu", pytest.param("cuda", id="gpu", marks=requires_cuda)]


def fp32_layer(device, stacked=False, bias=True, seed=0):
    torch.manual_seed(seed)
    m = lpmoe.GroupedLinear(G, K, N, bias=bias, params_dtype=torch.float32, device=device,
                            single_grouped_parameter=stacked)
    with torch.no_grad():
        for b in m.biases or []:
            b.normal_()
    return m


def splits_on(device):
    return torch.tensor(SPLITS, device=device) if device == "cuda" else SPLITS


def run(m, x, dy, splits, recipe, **kw):
    x = x.detach().clone().requires_grad_(True)
    m.zero_grad(set_to_none=True)
    with torch.autocast(x.device.type, dtype=BF16), lpmoe.autocast(enabled=recipe is not None, recipe=recipe):
        y = m(x, splits, **kw)
    y.backward(dy)
    return y, x.grad


def grads(m):
    """(weight grads, bias grads), one per expert in either layout."""
    if m.single_grouped_parameter:
        return list(m.weight.grad.unbind(0)), list(m.bias.grad.unbind(0))
    return [t.grad for t in m.weights], [t.grad for t in m.biases]


def mlp_pair(device, bias=True, **options):
    """(an MLP with fp32 parameters, the bf16 MLP holding the same values);
    ``options``: GroupedMLP's keyword options, for both."""
    torch.manual_seed(1)
    m = lpmoe.GroupedMLP(G, K, N, bias=bias, params_dtype=torch.float32, device=device, **options)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "bias" in name:
                p.normal_()
            p.copy_(p.to(BF16))  # representable in bf16: the bf16 MLP holds the same values
    ref = lpmoe.GroupedMLP(G, K, N, bias=bias, params_dtype=BF16, device=device, **options)
    ref.load_state_dict({k: v.to(BF16) for k, v in m.state_dict().items()})
    return m, ref


def mlp_step(m, x, dy, probs, splits, recipe, amp, fn=None):
    x = x.detach().clone().requires_grad_(True)
    p = probs.detach().clone().requires_grad_(True)
    m.zero_grad(set_to_none=True)
    with torch.autocast(x.device.type, dtype=BF16, enabled=amp), lpmoe.autocast(enabled=recipe is not None,
                                                                                 recipe=recipe):
        y = (m if fn is None else fn)(x, splits, probs=p)
    y.backward(dy)
    return [y, x.grad, p.grad], [q.grad for q in m.parameters()]


def saved_shapes(fn):
    """(dtype, shape) of every tensor autograd saves while fn runs."""
    seen = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: (seen.append((t.dtype, tuple(t.shape))), t)[1],
                                                  lambda t: t):
        fn()
    return seen
