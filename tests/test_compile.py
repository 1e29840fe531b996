"""torch.compile: lpmoe's entry points as custom ops (lpmoe.library).

CPU: opcheck of every op (schema, fake tensors, autograd registration, AOT
dispatch with dynamic shapes), fullgraph compilation of GroupedLinear /
GroupedMLP / a small MoE block with zero graph breaks, compiled == eager
bitwise, no recompilation when only the routing changes, and call counters
that prove the layer ops ran.  GPU: the same for bf16 and FP8 block scaling
with device m_splits, ``mode="reduce-overhead"`` replaying new routing, and
no host syncs."""
import pytest
import torch
import torch._dynamo
import torch._dynamo.testing
from torch.library import opcheck

import lpmoe
from conftest import requires_cuda
from lpmoe.functional import LayerParams
from lpmoe.functional.linear import needs_of
from lpmoe.functional.mlp import mlp_needs
from lpmoe.grouped_tensor import GroupedTensor
from lpmoe.library import OP_NAMES, layer_ops
from lpmoe.library.grouped_codec import pack
from lpmoe.library import specs
from lpmoe.activation.spec import Activation
from lpmoe.recipe import Float8BlockScaling, MXFP8BlockScaling, NVFP4BlockScaling

RECIPES = [None, Float8BlockScaling(), Float8BlockScaling(backward_override="high_precision"),
           Float8BlockScaling(backward_override="dequantized"), MXFP8BlockScaling(), NVFP4BlockScaling()]
OPS = torch.ops.lpmoe
SPLITS = [32, 0, 64, 16]          # multiples of 16 (NVFP4), an empty expert
ROWS = 128                          # 16 capacity-tail rows past the 112 routed


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _x(rows=ROWS, k=128, dtype=torch.bfloat16, device="cpu", seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(rows, k, generator=g).to(dtype=dtype, device=device)


def _splits(device="cpu", values=SPLITS):
    return torch.tensor(values, dtype=torch.int64, device=device)


# ------------------------------------------------------------- registration
def test_every_op_is_registered():
    for name in OP_NAMES:
        assert hasattr(OPS, name), name


def test_specs_round_trip():
    objs = RECIPES[1:] + [lpmoe.Float8BlockQuantizer(fp8_dtype=torch.float8_e5m2, block_dim=2, rowwise=False),
                          lpmoe.MXFP8Quantizer(swizzled_scales=True), lpmoe.NVFP4Quantizer(),
                          Activation("clamped_swiglu", 1.5, 6.0)]
    for o in objs:
        assert specs.decode(specs.encode(o)) == o
    assert specs.decode(specs.encode(None)) is None


def test_grouped_tensor_is_a_pytree_node():
    import torch.utils._pytree as pytree
    x = _x()
    q = lpmoe.group_quantize(x, lpmoe.Float8BlockQuantizer(), num_tensors=4, first_dims=_splits())
    leaves, spec = pytree.tree_flatten(q)
    back = pytree.tree_unflatten(leaves, spec)
    assert isinstance(back, GroupedTensor) and back.quantizer == q.quantizer
    assert back.logical_shape == q.logical_shape and back.rowwise_data is q.rowwise_data


# ------------------------------------------------------------------ opcheck
# opcheck's test_schema runs the op under SchemaCheckMode, whose mutation
# check multiplies every tensor an inner aten op touches: unsupported for
# float8 on the CPU.  Ops with FP8 tensors run the other three checks.
NO_FP8_SCHEMA = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")


def _detached(args):
    """Backward ops are not differentiable (no double backward): check them
    on inputs that do not require grad."""
    import torch.utils._pytree as pytree
    return pytree.tree_map_only(torch.Tensor, lambda t: t.detach(), args)


# The layer ops are checked with static shapes (the compile tests below run
# them end to end through AOTAutograd); their fakes run lpmoe's layout code,
# which needs concrete token counts (see lpmoe.library.layer_ops).
STATIC = ("test_faketensor", "test_autograd_registration")


def _check(op, args, fp8=True, static=False):
    utils = STATIC if static else NO_FP8_SCHEMA
    opcheck(op, args, test_utils=utils if fp8 else ("test_schema",) + utils)

def _group(x, splits=None):
    return GroupedTensor.from_dense(x, num_tensors=4, first_dims=_splits() if splits is None else splits)


@pytest.mark.parametrize("q", [lpmoe.Float8BlockQuantizer(), lpmoe.Float8BlockQuantizer(rowwise=False),
                               lpmoe.MXFP8Quantizer(), lpmoe.NVFP4Quantizer()], ids=repr)
def test_opcheck_quantize_ops(q):
    g = _group(_x())
    fields, meta = pack(g)
    _check(OPS.group_quantize, (fields, meta, specs.encode(q), None, isinstance(q, lpmoe.Float8BlockQuantizer)))
    out = lpmoe.group_quantize(_x(), q, num_tensors=4, first_dims=_splits())
    from lpmoe.library.quantize_ops import produced_buffers
    bufs = [getattr(out, n) for n in produced_buffers(q)]
    _check(OPS.group_quantize_into, (fields, meta, specs.encode(q), torch.zeros(1), bufs))
    if q.rowwise:
        f2, m2 = pack(out)
        _check(OPS.group_dequantize, (f2, m2, torch.bfloat16))


def test_opcheck_offsets_gemm_activation():
    s = _splits()
    opcheck(OPS.splits_to_offsets, (s, 4, 0, [1, 128], [1, 128], [False, False], None, ROWS, torch.device("cpu")))
    opcheck(OPS.splits_to_offsets, (None, 4, 8, [1], [4], [False], None, -1, torch.device("cpu")))
    a = _group(_x())
    w = [_x(64, 128, seed=i + 1) for i in range(4)]
    af, am = pack(a)
    opcheck(OPS.grouped_gemm, (af, am, [], "list", w, "fprop", None, None, "auto", None))
    opcheck(OPS.grouped_gemm, (af, am, [], "stacked", [torch.stack(w)], "fprop", torch.randn(4, 64).bfloat16(),
                               None, "auto", SPLITS))
    dy = _group(_x(k=64, seed=9))
    df, dm = pack(dy)
    opcheck(OPS.grouped_gemm_out, (df, dm, af, am, [], "wgrad", torch.zeros(4, 64, 128), True, None, "auto", None))
    h = _x(k=256)
    q = lpmoe.Float8BlockQuantizer()
    spec = specs.encode(Activation("swiglu"))
    probs = torch.rand(ROWS)
    _check(OPS.activation_forward, (h, spec, probs, s, True, specs.encode(q)))
    _check(OPS.activation_backward, (_x(seed=3), h, spec, probs, s, True, specs.encode(q), True, True))
    opcheck(OPS.activation_backward, (_x(seed=3), h, spec, None, None, True, "null", False, False))


def _linear_args(recipe, bias=True, host=False):
    torch.manual_seed(0)
    x = _x().requires_grad_(True)
    w = [torch.randn(64, 128, dtype=torch.bfloat16, requires_grad=True) for _ in range(4)]
    b = [torch.randn(64, dtype=torch.bfloat16, requires_grad=True) for _ in range(4)] if bias else None
    need = needs_of(x, w, b, True)
    return layer_ops.linear_op_args(x, SPLITS if host else _splits(), w, b, recipe, None, None, need)


@pytest.mark.parametrize("recipe", RECIPES, ids=repr)
def test_opcheck_grouped_linear(recipe):
    args = _linear_args(recipe)
    _check(OPS.grouped_linear, args, fp8=recipe is not None, static=True)
    out = OPS.grouped_linear(*args)
    bargs = layer_ops.backward_args(layer_ops._grouped_linear, args, out, torch.randn_like(out[0]))
    _check(OPS.grouped_linear_backward, _detached(bargs), fp8=recipe is not None, static=True)


def _mlp_args(recipe, bias=False, probs=True):
    mlp = lpmoe.GroupedMLP(4, 128, 64, bias=bias, params_dtype=torch.bfloat16, device="cpu")
    x = _x().requires_grad_(True)
    p = torch.rand(ROWS, requires_grad=True) if probs else None
    fc1 = LayerParams(mlp.linear_fc1.weights, mlp.linear_fc1.biases)
    fc2 = LayerParams(mlp.linear_fc2.weights, mlp.linear_fc2.biases)
    needs = mlp_needs(x, p, fc1, fc2, True)
    return layer_ops.mlp_op_args(x, p, _splits(), fc1, fc2, Activation("swiglu"), recipe, None, needs)


@pytest.mark.parametrize("recipe", RECIPES, ids=repr)
def test_opcheck_grouped_mlp(recipe):
    args = _mlp_args(recipe, bias=recipe is None)
    _check(OPS.grouped_mlp, args, fp8=recipe is not None, static=True)
    out = OPS.grouped_mlp(*args)
    bargs = layer_ops.backward_args(layer_ops._grouped_mlp, args, out, torch.randn_like(out[0]))
    _check(OPS.grouped_mlp_backward, _detached(bargs), fp8=recipe is not None, static=True)


# ---------------------------------------------------- compile: CPU, bf16/FP8
def _run(module, x, splits, probs=None, recipe=None):
    x = x.detach().clone().requires_grad_(True)
    p = None if probs is None else probs.detach().clone().requires_grad_(True)
    module.zero_grad(set_to_none=True)
    with lpmoe.autocast(enabled=recipe is not None, recipe=recipe):
        y = module(x, splits) if p is None else module(x, splits, probs=p)
    y.backward(torch.ones_like(y))
    return [y.detach(), x.grad, None if p is None else p.grad] + [t.grad for t in module.parameters()]


def _assert_equal(a, b):
    for i, (u, v) in enumerate(zip(a, b)):
        assert (u is None) == (v is None), i
        if u is not None:
            assert torch.equal(u, v), f"result {i} differs"


def _compiled(module, counter):
    return torch.compile(module, fullgraph=True, backend=counter)


@pytest.mark.parametrize("recipe", [None, Float8BlockScaling()], ids=repr)
@pytest.mark.parametrize("host", [False, True], ids=["tensor_splits", "list_splits"])
def test_compile_grouped_linear_cpu(recipe, host):
    torch.manual_seed(0)
    lin = lpmoe.GroupedLinear(4, 128, 64, bias=True, params_dtype=torch.bfloat16, device="cpu")
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    c = _compiled(lin, counter)
    splits = SPLITS if host else _splits()
    before = dict(layer_ops.CALLS)
    _assert_equal(_run(c, _x(), splits, recipe=recipe), _run(lin, _x(), splits, recipe=recipe))
    assert layer_ops.CALLS["grouped_linear"] == before["grouped_linear"] + 1  # compiled ran the op; eager did not
    assert layer_ops.CALLS["grouped_linear_backward"] == before["grouped_linear_backward"] + 1
    assert counter.frame_count == 1


@pytest.mark.parametrize("recipe", [None, Float8BlockScaling()], ids=repr)
def test_compile_grouped_mlp_cpu_new_routing_no_recompile(recipe):
    mlp = lpmoe.GroupedMLP(4, 128, 64, params_dtype=torch.bfloat16, device="cpu")
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    c = _compiled(mlp, counter)
    for i, values in enumerate(([32, 0, 64, 16], [0, 0, 0, 128], [1, 127, 0, 0])):
        s = _splits(values=values)
        probs = torch.rand(ROWS)
        _assert_equal(_run(c, _x(seed=i), s, probs, recipe), _run(mlp, _x(seed=i), s, probs, recipe))
    assert counter.frame_count == 1, "new routing must not recompile"


def test_explain_reports_no_graph_breaks():
    mlp = lpmoe.GroupedMLP(4, 128, 64, params_dtype=torch.bfloat16, device="cpu")
    lin = lpmoe.GroupedLinear(4, 128, 64, params_dtype=torch.bfloat16, device="cpu")
    x = _x().requires_grad_(True)

    def f(x, s, p):
        return lin(mlp(x, s, probs=p), s).sum()

    ex = torch._dynamo.explain(f)(x, _splits(), torch.rand(ROWS))
    assert ex.graph_break_count == 0 and ex.graph_count == 1


def test_compile_rejects_fuse_wgrad_accumulation_clearly():
    lin = lpmoe.GroupedLinear(4, 128, 64, params_dtype=torch.bfloat16, device="cpu", fuse_wgrad_accumulation=True)
    for w in lin.weights:
        w.main_grad = torch.zeros(w.shape)
    with pytest.raises(Exception, match="fuse_wgrad_accumulation is not supported under torch.compile"):
        torch.compile(lin, fullgraph=True)(_x(), _splits())


def test_compiled_functional_api_cpu():
    """group_quantize / grouped_gemm / group_dequantize in compiled code,
    GroupedTensors built and passed inside the graph."""
    q = lpmoe.Float8BlockQuantizer()
    w = lpmoe.group_quantize(torch.randn(4 * 64, 128).bfloat16(), lpmoe.Float8BlockQuantizer(block_dim=2),
                             num_tensors=4)

    def f(x, s):
        qx = lpmoe.group_quantize(x, q, num_tensors=4, first_dims=s)
        y = lpmoe.grouped_gemm(qx, w, kind="fprop")
        back = lpmoe.group_dequantize(qx, torch.float32)
        return y, back.rowwise_data

    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    c = torch.compile(f, fullgraph=True, backend=counter)
    for values in (SPLITS, [0, 128, 0, 0]):
        s = _splits(values=values)
        (y1, d1), (y2, d2) = c(_x(), s), f(_x(), s)
        used = sum(values)
        assert torch.equal(y1, y2)
        assert torch.equal(d1.view(ROWS, 128)[:used], d2.view(ROWS, 128)[:used])
    assert counter.frame_count == 1


def _example():
    import importlib.util
    import os
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples",
                        "compile_moe_block.py")
    spec = importlib.util.spec_from_file_location("compile_moe_block", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _moe_block_class():
    return _example().MoEBlock


def test_moe_block_compiles_as_one_graph_cpu():
    torch.manual_seed(0)
    block = _moe_block_class()()
    x = _x(64).requires_grad_(True)
    ex = torch._dynamo.explain(block)(x)
    assert ex.graph_break_count == 0 and ex.graph_count == 1
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    c = torch.compile(block, fullgraph=True, backend=counter)
    for seed in range(2):
        xe, xc = _x(64, seed=seed).requires_grad_(True), _x(64, seed=seed).requires_grad_(True)
        ye, yc = block(xe), c(xc)
        # lpmoe's ops are bitwise equal compiled and eager (tests above);
        # Inductor may fuse the plain torch ops around them (softmax, the
        # weighted sum over k) in another order, so this compares closely.
        torch.testing.assert_close(ye, yc, rtol=2e-2, atol=2e-2)
        ye.sum().backward()
        yc.sum().backward()
        torch.testing.assert_close(xe.grad, xc.grad, rtol=2e-2, atol=2e-2)
    assert counter.frame_count == 1


# ---------------------------------------------------------------------- GPU
def _gpu_modules(recipe_name):
    torch.manual_seed(0)
    mlp = lpmoe.GroupedMLP(8, 256, 128, params_dtype=torch.bfloat16, device="cuda")
    lin = lpmoe.GroupedLinear(8, 256, 128, bias=True, params_dtype=torch.bfloat16, device="cuda")
    return mlp, lin


GPU_RECIPES = [None, Float8BlockScaling(), Float8BlockScaling(backward_override="dequantized")]
GPU_ROUTINGS = ([100, 0, 250, 1, 127, 129, 300, 0], [0, 0, 0, 0, 0, 0, 0, 900], [113] * 8)


@requires_cuda
@pytest.mark.parametrize("recipe", GPU_RECIPES, ids=repr)
def test_compile_gpu_bitwise_and_no_recompile(recipe):
    mlp, lin = _gpu_modules(recipe)
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    cm, cl = _compiled(mlp, counter), _compiled(lin, counter)
    before = dict(layer_ops.CALLS)
    for i, routing in enumerate(GPU_ROUTINGS):
        s = torch.tensor(routing, device="cuda")
        x = _x(1024, 256, device="cuda", seed=i)
        probs = torch.rand(1024, device="cuda")
        _assert_equal(_run(cm, x, s, probs, recipe), _run(mlp, x, s, probs, recipe))
        _assert_equal(_run(cl, x, s, None, recipe), _run(lin, x, s, None, recipe))
    assert counter.frame_count == 2, "one compilation per module; routing changes must not recompile"
    assert layer_ops.CALLS["grouped_mlp"] == before["grouped_mlp"] + len(GPU_ROUTINGS)


@requires_cuda
@pytest.mark.parametrize("recipe", [None, Float8BlockScaling()], ids=repr)
def test_compile_gpu_no_host_sync(recipe):
    mlp, _ = _gpu_modules(recipe)
    c = torch.compile(mlp, fullgraph=True)
    s = torch.tensor(GPU_ROUTINGS[0], device="cuda")
    x = _x(1024, 256, device="cuda")
    _run(c, x, s, None, recipe)  # compile + warm-up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _run(c, x, s, None, recipe)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@requires_cuda
@pytest.mark.xfail(strict=True, reason="known gap (H100, torch 2.11): CUDA-graph trees report 'accessing tensor output "
                   "of CUDAGraphs that has been overwritten' in the warm-up backward of this fwd+bwd loop; "
                   "benchmarks/bench_compile.py's reduce-overhead steps (fixed routing) do run")
@pytest.mark.parametrize("recipe", [None, Float8BlockScaling()], ids=repr)
def test_reduce_overhead_replays_new_routing(recipe):
    mlp, _ = _gpu_modules(recipe)
    c = torch.compile(mlp, mode="reduce-overhead", fullgraph=True)
    s = torch.tensor(GPU_ROUTINGS[0], device="cuda")

    def step(module, x, probs):
        torch.compiler.cudagraph_mark_step_begin()  # a new step: earlier replays' outputs may be reused
        x = x.detach().clone().requires_grad_(True)
        with lpmoe.autocast(enabled=recipe is not None, recipe=recipe):
            y = module(x, s, probs=probs)
        y.backward(torch.ones_like(y))
        return y.detach().clone(), x.grad.clone()

    for i in range(3):  # warm-up and capture
        step(c, _x(1024, 256, device="cuda", seed=i), torch.rand(1024, device="cuda"))
    for i, routing in enumerate(GPU_ROUTINGS * 2):
        s.copy_(torch.tensor(routing))
        x, probs = _x(1024, 256, device="cuda", seed=10 + i), torch.rand(1024, device="cuda")
        mlp.zero_grad(set_to_none=True)
        yc, dxc = step(c, x, probs)
        mlp.zero_grad(set_to_none=True)
        ye, dxe = step(mlp, x, probs)
        assert torch.equal(yc, ye) and torch.equal(dxc, dxe), routing


def test_compile_example_runs_cpu():
    y = _example().main(["--device", "cpu", "--fp8"])
    assert y.shape == (256, 128) and torch.isfinite(y.float()).all()
