"""lpmoe's custom ops (lpmoe.library): registration, specs, the GroupedTensor
pytree node, and torch.library.opcheck of every op on the CPU (schema, fake
tensors, autograd registration, AOT dispatch)."""
import pytest
import torch
from torch.library import opcheck

import lpmoe
from _compile_common import OPS, RECIPES, ROWS, SPLITS, _splits, _x
from lpmoe.activation.spec import Activation
from lpmoe.functional import LayerParams
from lpmoe.functional.linear import needs_of
from lpmoe.functional.mlp import mlp_needs
from lpmoe.grouped_tensor import GroupedTensor
from lpmoe.library import OP_NAMES, layer_ops, specs
from lpmoe.library.grouped_codec import pack


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


# A layer op that returns FP8 saved tensors skips test_aot_dispatch_dynamic:
# its autograd check sums every output, and float8 has no CPU sum.  The
# compile tests run those layers with dynamic token counts end to end.
FP8_LAYER = ("test_faketensor", "test_autograd_registration")


def _check(op, args, fp8=True, layer=False):
    utils = FP8_LAYER if (fp8 and layer) else NO_FP8_SCHEMA
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


SINGLE_QUANTIZERS = [lpmoe.Float8BlockQuantizer(), lpmoe.Float8BlockQuantizer(block_dim=2, rowwise=False),
                     lpmoe.MXFP8Quantizer(), lpmoe.MXFP8Quantizer(swizzled_scales=True), lpmoe.NVFP4Quantizer(),
                     lpmoe.NVFP4Quantizer(rowwise=False)]


@pytest.mark.parametrize("q", SINGLE_QUANTIZERS, ids=repr)
def test_opcheck_single_tensor_ops(q):
    from lpmoe.library import single_ops
    x = _x(128, 64)
    _check(OPS.quantize, (x, specs.encode(q)))
    t = lpmoe.quantize(x, q)
    if t.data is not None or not isinstance(q, lpmoe.NVFP4Quantizer):  # NVFP4 dequantizes its rowwise copy
        q2 = single_ops.quantizer_of(t)
        _check(OPS.dequantize, ([getattr(t, f) for f in single_ops._fields(q2)], *single_ops.describe(t),
                                torch.float32))


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
    _check(OPS.grouped_linear, args, fp8=recipe is not None, layer=True)
    out = OPS.grouped_linear(*args)
    bargs = layer_ops.backward_args(layer_ops._grouped_linear, args, out, torch.randn_like(out[0]))
    _check(OPS.grouped_linear_backward, _detached(bargs), fp8=recipe is not None, layer=True)


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
    _check(OPS.grouped_mlp, args, fp8=recipe is not None, layer=True)
    out = OPS.grouped_mlp(*args)
    fc2_args, act_args, fc1_args = layer_ops.backward_args(layer_ops._grouped_mlp, args, out,
                                                           torch.randn_like(out[0]))
    # fc2's GEMMs, one op each (their order: tests/test_backward_order.py)
    assert sorted(fc2_args) == ["dgrad", "wgrad"]
    for part, a in fc2_args.items():
        _check(OPS.grouped_mlp_backward, _detached(a), fp8=recipe is not None, layer=True)
    w2_out, da_out = (OPS.grouped_mlp_backward(*fc2_args[p]) for p in ("wgrad", "dgrad"))
    bias = recipe is None  # (bf16 only; the bias gradient comes with the first op, wgrad here)
    assert [t.shape for t in w2_out] == [(4, 128, 64)] + ([(4, 128)] if bias else [])
    assert [t.shape for t in da_out] == [(ROWS, 64)]  # fc2's input gradient
    # the activation op reads da; the fc1 ops (weight, then input gradients)
    # read the activation op's flattened fc1 output gradient
    act = _detached((da_out[0],) + act_args)
    _check(OPS.grouped_mlp_backward_act, act, fp8=recipe is not None, layer=True)
    dh = OPS.grouped_mlp_backward_act(*act)[1:]  # past d probs
    key = fc2_args["dgrad"][7]
    assert sorted(fc1_args) == ["dgrad", "wgrad"]
    for part, rest in fc1_args.items():
        _check(OPS.grouped_mlp_backward_fc1, _detached((layer_ops.fc1_dh(dh, key, part),) + rest),
               fp8=recipe is not None, layer=True)
    # the one-op form (small layers)
    _check(OPS.grouped_mlp_backward, _detached(layer_ops.whole_backward_args(args, out, torch.randn_like(out[0]))),
           fp8=recipe is not None, layer=True)
