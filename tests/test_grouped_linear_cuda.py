"""GroupedLinear on the GPU: grouped kernels against separate Linears, FP8
against bf16, graph-safe vs host paths bitwise, no syncs, CUDA graphs with new
routing per replay, and errors raised before GPU work."""
import copy

import pytest
import torch

import lpmoe
from lpmoe.gemm import CALLS
from lpmoe.recipe import Float8BlockScaling, Format, MXFP8BlockScaling, NVFP4BlockScaling
from conftest import requires_cuda
from _grouped_linear_common import cuda_layer, linear_loop, make_layer, rel, run, run_loop


# ===================================================================== GPU
@requires_cuda
@pytest.mark.parametrize("splits", [[256, 0, 384, 128], [0, 0, 0, 0], [1, 17, 300, 100]])
def test_cuda_bf16_matches_separate_linears(splits):
    layer = cuda_layer()
    rows = 800
    x = torch.randn(rows, 256, dtype=torch.bfloat16, device="cuda")
    dy = torch.randn(rows, 512, dtype=torch.bfloat16, device="cuda")
    before = CALLS["grouped"]
    y, dx, dw, db = run(layer, x, torch.tensor(splits, device="cuda"), dy)
    assert CALLS["grouped"] - before == 4  # fprop, dgrad, wgrad, bias grad: all sync-free kernels
    ry, rdx, rdw, rdb = run_loop(linear_loop(layer), x, splits, dy)
    used = sum(splits)
    if used:
        assert rel(y[:used], ry) < 1e-2 and rel(dx[:used], rdx[:used]) < 1e-2
    assert torch.all(y[used:] == 0) and torch.all(dx[used:] == 0)
    for t, m in enumerate(splits):
        if m:
            assert rel(dw[t], rdw[t]) < 1e-2 and rel(db[t], rdb[t]) < 1e-2
        else:
            assert torch.all(dw[t] == 0) and torch.all(db[t] == 0)


@requires_cuda
@pytest.mark.parametrize("recipe", [Float8BlockScaling(), Float8BlockScaling(backward_override="dequantized"),
                                    MXFP8BlockScaling(), NVFP4BlockScaling()], ids=repr)
def test_cuda_low_precision_close_to_bf16(recipe):
    layer = cuda_layer()
    splits = torch.tensor([256, 0, 384, 128], device="cuda")
    x = torch.randn(800, 256, dtype=torch.bfloat16, device="cuda")
    dy = torch.randn(800, 512, dtype=torch.bfloat16, device="cuda")
    ref = run(layer, x, splits, dy)
    got = run(layer, x, splits, dy, recipe=recipe)
    tol = 0.2 if isinstance(recipe, NVFP4BlockScaling) else 0.05
    assert rel(got[0], ref[0]) < tol and rel(got[1], ref[1]) < tol
    for t in (0, 2, 3):
        assert rel(got[2][t], ref[2][t]) < tol and rel(got[3][t], ref[3][t]) < 0.02
    assert torch.all(got[0][768:] == 0) and torch.all(got[1][768:] == 0)


@requires_cuda
@pytest.mark.parametrize("recipe", [None, Float8BlockScaling()], ids=repr)
def test_cuda_graph_safe_and_host_paths_agree_bitwise(recipe):
    # Small groups: grouped_gemm's auto backend runs the grouped kernels on
    # both paths (with host splits it picks cuBLASLt for FP8 groups averaging
    # >= 2048 tokens, which rounds differently).
    layer = cuda_layer()
    splits = [256, 0, 384, 128]
    x = torch.randn(800, 256, dtype=torch.bfloat16, device="cuda")
    dy = torch.randn(800, 512, dtype=torch.bfloat16, device="cuda")
    a = run(layer, x, torch.tensor(splits, device="cuda"), dy, recipe=recipe)
    b = run(layer, x, splits, dy, recipe=recipe)
    for u, v in zip(a[:2] + tuple(a[2] + a[3]), b[:2] + tuple(b[2] + b[3])):
        assert torch.equal(u, v)


@requires_cuda
@pytest.mark.parametrize("recipe", [None, Float8BlockScaling()], ids=repr)
def test_cuda_graph_safe_path_never_syncs(recipe):
    layer = cuda_layer()
    splits = torch.tensor([256, 0, 384, 128], device="cuda")
    x = torch.randn(800, 256, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    dy = torch.randn(800, 512, dtype=torch.bfloat16, device="cuda")
    with lpmoe.autocast(enabled=recipe is not None, recipe=recipe):
        layer(x, splits).backward(dy)  # warm-up: workspaces, pointer tables
        torch.cuda.synchronize()
        old = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for first in (None, True, False):
                layer(x, splits, is_first_microbatch=first).backward(dy)
        finally:
            torch.cuda.set_sync_debug_mode(old)
    torch.cuda.synchronize()


@requires_cuda
@pytest.mark.parametrize("recipe", [None, Float8BlockScaling()], ids=repr)
def test_cuda_graphed_layer_replays_new_data_and_routing(recipe):
    layer = cuda_layer()
    eager = copy.deepcopy(layer)
    rows = 1024
    x0 = torch.randn(rows, 256, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    s0 = torch.tensor([256, 256, 256, 256], device="cuda")
    with lpmoe.autocast(enabled=recipe is not None, recipe=recipe):
        graphed = torch.cuda.make_graphed_callables(layer, (x0, s0))

    def step(mod, x, s, dy):
        for p in mod.parameters():
            p.grad = None
        x = x.detach().clone().requires_grad_(True)
        with lpmoe.autocast(enabled=recipe is not None, recipe=recipe):
            y = mod(x, s)
        y.backward(dy)
        return [y.detach().clone(), x.grad.clone()] + [p.grad.clone() for p in mod.parameters()]

    gen = torch.Generator(device="cuda").manual_seed(1)
    first = None
    for i in range(1000):
        # same total, new routing each step (an empty expert included)
        cuts = torch.sort(torch.randint(0, rows + 1, (3,), device="cuda", generator=gen)).values
        bounds = torch.cat([torch.zeros(1, dtype=torch.int64, device="cuda"), cuts,
                            torch.full((1,), rows, dtype=torch.int64, device="cuda")])
        s = (bounds[1:] - bounds[:-1]) if i % 2 else torch.tensor([0, 512, 0, 512], device="cuda")
        x = torch.randn(rows, 256, dtype=torch.bfloat16, device="cuda", generator=gen)
        dy = torch.randn(rows, 512, dtype=torch.bfloat16, device="cuda", generator=gen)
        got = step(graphed, x, s, dy)
        if i < 5 or i % 250 == 0:
            want = step(eager, x, s, dy)
            for a, b in zip(got, want):
                assert torch.equal(a, b), f"replay {i}"
        if i == 0:
            first = (x, s, dy, got)
    x, s, dy, got0 = first
    for a, b in zip(step(graphed, x, s, dy), got0):  # stable after 1000 replays
        assert torch.equal(a, b)


@requires_cuda
def test_cuda_hybrid_runs_on_the_host_path():
    layer = cuda_layer()
    splits = [256, 0, 384, 128]  # multiples of 4: cuBLASLt's FP8 block scaling
    x = torch.randn(800, 256, dtype=torch.bfloat16, device="cuda")
    dy = torch.randn(800, 512, dtype=torch.bfloat16, device="cuda")
    ref = run(layer, x, splits, dy)
    before = CALLS["cublas"]
    got = run(layer, x, splits, dy, recipe=Float8BlockScaling(fp8_format=Format.HYBRID))
    assert CALLS["cublas"] - before >= 2  # E5M2 dgrad and wgrad
    assert rel(got[0], ref[0]) < 0.05 and rel(got[1], ref[1]) < 0.1
    assert all(rel(got[2][t], ref[2][t]) < 0.1 for t in (0, 2, 3))


@requires_cuda
def test_cuda_errors_before_gpu_work():
    layer = cuda_layer()
    x = torch.randn(64, 256, dtype=torch.bfloat16, device="cuda")
    dev_splits = torch.tensor([64, 0, 0, 0], device="cuda")
    with lpmoe.autocast(recipe=Float8BlockScaling(fp8_format=Format.HYBRID)):
        with pytest.raises(ValueError, match="E5M2"):
            layer(x, dev_splits)
    cpu_layer = make_layer(torch.bfloat16, g=4, k=256, n=512)
    with pytest.raises(ValueError, match="m_splits is on cuda"):
        cpu_layer(x.cpu(), dev_splits)
    f32 = cuda_layer(torch.float32)
    with pytest.raises(TypeError, match="fp32"):
        f32(x.float(), dev_splits)
    f32(x.float(), [64, 0, 0, 0])  # host path: cuBLASLt


def test_fp8_block_on_a_non_hopper_gpu_names_the_alternative(monkeypatch):
    import lpmoe.functional.checks as checks
    from lpmoe.functional.splits import Splits

    monkeypatch.setattr(checks, "cuda_major", lambda device: 10)
    splits = Splits(torch.zeros(2, dtype=torch.int64), [0, 0])
    with pytest.raises(RuntimeError, match="Hopper.*MXFP8BlockScaling"):
        checks.check_recipe(Float8BlockScaling(), torch.bfloat16, 128, 128, splits, True, torch.device("cuda", 0))
    checks.check_recipe(None, torch.bfloat16, 128, 128, splits, True, torch.device("cuda", 0))  # bf16 is fine
