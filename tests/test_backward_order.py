"""The order of each layer's backward GEMMs (lpmoe.functional.linear_steps):
dgrad before wgrad where the weights have more rows than the input, so the
transposed FP8 weight copy dies before the weight gradient is made, else
wgrad first; which copies are alive at each GEMM in both orders, the rule
itself, and the same bits either way."""
import pytest
import torch

import lpmoe
from conftest import requires_cuda
from lpmoe.activation import kernels
from lpmoe.recipe import Float8BlockScaling
from test_grouped_mlp import FFN, G, H, make_mlp


def _drop_order(splits=(40, 0, 56)):
    """(GEMM kind, copies still alive) at each backward GEMM of one FP8 MLP step."""
    import weakref

    import lpmoe.functional.linear_steps as steps
    mlp = make_mlp("swiglu")
    rows = sum(splits)
    x = torch.randn(rows, H, dtype=torch.bfloat16, requires_grad=True)
    with lpmoe.autocast(recipe=Float8BlockScaling()):
        y = mlp(x, list(splits), probs=torch.rand(rows, requires_grad=True))
    node = y.grad_fn
    while not hasattr(node, "held"):
        node = node.next_functions[0][0]
    held = node.held
    refs = {k: weakref.ref(v if isinstance(v, torch.Tensor) else v.columnwise_data)
            for k, v in held.items() if k in ("x1", "w1", "w2", "x2", "h")}
    del held, node
    seen, real, real_act = [], steps.grouped_gemm, kernels.backward

    def spy(*a, **kw):
        seen.append((kw["kind"], sorted(k for k, r in refs.items() if r() is not None)))
        return real(*a, **kw)

    def spy_act(*a, **kw):  # dh's transposed FP8 copy, made by the activation backward
        res = real_act(*a, **kw)
        refs["dh_col"] = weakref.ref(res.dh_quantized.columnwise_data)
        return res
    steps.grouped_gemm, kernels.backward = spy, spy_act
    try:
        y.backward(torch.randn_like(y))
    finally:
        steps.grouped_gemm, kernels.backward = real, real_act
    return len(refs) - 1, seen


@pytest.mark.parametrize("splits", [(400, 0, 624), (40, 0, 56)])
def test_fp8_backward_drops_each_copy_after_its_last_reader(splits):
    """The FP8 MLP backward lets every copy the forward made die right after
    its last reader, in the GEMM order that holds less (docs/grouped-mlp-notes.md,
    linear_steps.dgrad_first).  More rows than the layers' G*N (1024 > 768,
    384): wgrad first in each layer, so fc2's transposed input dies before
    fc2's dgrad, x's and dh's transposed copies before fc1's dgrad (the
    memory peak of a large step).  Fewer (96): dgrad first, so each
    layer's transposed weight dies before its weight gradient is made.
    fc2's weights and h die before fc1's GEMMs either way.  Runs in a fresh
    interpreter: after a torch.compile that failed earlier in the process
    (test_compile checks one), PyTorch keeps finished frames of the backward
    alive until the layer's backward returns, which would hide the order
    under test."""
    import json
    import subprocess
    import sys
    code = ("import json, sys; sys.path.insert(0, 'tests'); import test_backward_order as t; "
            f"print(json.dumps(t._drop_order({splits!r})))")
    root = __file__.rsplit("/tests/", 1)[0]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, check=True)
    count, seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert count == 5   # every copy the forward made is held, none saved
    if sum(splits) > G * 2 * FFN:
        assert [tuple(s) for s in seen] == [("wgrad", ["h", "w1", "w2", "x1", "x2"]),   # fc2
                                            ("dgrad", ["h", "w1", "w2", "x1"]),
                                            ("wgrad", ["dh_col", "w1", "x1"]),          # fc1
                                            ("dgrad", ["w1"])]
    else:
        assert [tuple(s) for s in seen] == [("dgrad", ["h", "w1", "w2", "x1", "x2"]),   # fc2
                                            ("wgrad", ["h", "w1", "x1", "x2"]),
                                            ("dgrad", ["dh_col", "w1", "x1"]),          # fc1
                                            ("wgrad", ["dh_col", "x1"])]


def test_dgrad_first_rule():
    """linear_steps.dgrad_first: dgrad first only where it frees something
    before the weight gradient is made: a quantized weight copy that dies
    with dgrad, weights with more rows than the input (G*N > rows), the
    weight gradient allocated (not added into main_grad)."""
    from lpmoe.functional.linear_steps import dgrad_first
    w_hp = torch.randn(G * 256, 128, dtype=torch.bfloat16)
    w_copy = lpmoe.group_quantize(w_hp, lpmoe.Float8BlockQuantizer(block_dim=2), num_tensors=G)
    shape = (G, 256, 128)
    x = lambda rows: torch.empty(rows, 128, dtype=torch.bfloat16)  # noqa: E731
    assert dgrad_first(x(G * 256 - 1), w_copy, shape, None)
    assert not dgrad_first(x(G * 256), w_copy, shape, None)
    assert not dgrad_first(x(16), w_copy, shape, [torch.empty(0)])              # main_grad: no dW allocated
    assert not dgrad_first(x(16), w_copy, shape, None, weights_cached=True)      # the cache keeps the copy
    assert not dgrad_first(x(16), list(w_hp.split(256)), shape, None)           # the weights themselves


@pytest.mark.parametrize("recipe", [Float8BlockScaling(), Float8BlockScaling(backward_override="dequantized"),
                                    Float8BlockScaling(backward_override="high_precision"), None], ids=repr)
@pytest.mark.parametrize("bias,keep", [(False, False), (True, True)])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_cuda)])
def test_backward_order_changes_no_bits(recipe, bias, keep, device, monkeypatch):
    """Both GEMM orders give the same bits (GroupedMLP and GroupedLinear:
    every gradient, with the bias gradient fused into whichever dy pass
    runs first, and with save_original_input)."""
    import lpmoe.functional.linear_steps as steps
    x = torch.randn(96, H, dtype=torch.bfloat16, device=device)
    dy = torch.randn(96, H, dtype=torch.bfloat16, device=device)
    results = []
    for first in (True, False):
        monkeypatch.setattr(steps, "dgrad_first", lambda *a, _f=first, **k: _f)
        out = []
        for layer in (make_mlp("swiglu", bias=bias, device=device),
                      lpmoe.GroupedLinear(G, H, H, bias=bias, params_dtype=torch.bfloat16, device=device,
                                          save_original_input=keep)):
            if isinstance(layer, lpmoe.GroupedMLP):
                layer.linear_fc1.save_original_input = keep
            torch.manual_seed(0)
            xi = x.clone().requires_grad_()
            with lpmoe.autocast(enabled=recipe is not None, recipe=recipe):
                y = layer(xi, torch.tensor([40, 0, 56], device=device))
            y.backward(dy)
            out += [y.detach(), xi.grad] + [p.grad for p in layer.parameters()]
        results.append(out)
    for i, (u, v) in enumerate(zip(*results)):
        assert torch.equal(u, v), i


@pytest.mark.parametrize("rows", [1024, 96])
def test_compiled_staged_backward_runs_fc1_in_the_eager_order(rows, monkeypatch, request):
    """The compiled large-layer backward calls fc1's wgrad and dgrad ops in
    the order eager runs the GEMMs (wgrad first with more rows than G*N,
    else dgrad first); aot_eager keeps the program order (Inductor orders
    independent ops by its own peak-memory pass)."""
    import lpmoe.library.mlp_backward_ops as bops
    from lpmoe.library import mlp_ops
    monkeypatch.setattr(mlp_ops, "SPLIT_BACKWARD_BYTES", 0)  # the staged form at any size
    # (no compiled-graph caches: a graph cached under other code would decide the order)
    for cfg, name in ((torch._inductor.config, "fx_graph_cache"), (torch._functorch.config, "enable_autograd_cache")):
        patch = cfg.patch(**{name: False})
        patch.__enter__()
        request.addfinalizer(lambda p=patch: p.__exit__(None, None, None))
    seen, real = [], bops.fc1_run

    def spy(*a):
        if not a[-1]:  # (real runs, not the fakes)
            seen.append(a[-2])
        return real(*a)
    monkeypatch.setattr(bops, "fc1_run", spy)
    mlp = make_mlp("swiglu")
    torch._dynamo.reset()
    compiled = torch.compile(mlp, fullgraph=True, backend="aot_eager")
    x = torch.randn(rows, H, dtype=torch.bfloat16, requires_grad=True)
    with lpmoe.autocast(recipe=Float8BlockScaling()):
        y = compiled(x, torch.tensor([rows // 2, 0, rows - rows // 2]))
    y.backward(torch.randn_like(y))
    assert seen == (["wgrad", "dgrad"] if rows > G * 2 * FFN else ["dgrad", "wgrad"])
