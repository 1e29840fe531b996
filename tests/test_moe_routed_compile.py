"""Routed tokens under torch.compile: the gathering quantize and the inverse
map as custom ops, the MLP op reading RoutedTokens (fc1's input and, with
sum_to_tokens, fc2's output gradient gathered through the map; fc1 keeping
the tokens with save_original_input), compiled == eager bitwise, with
counters and the saved layout proving which path ran."""
import pytest
import torch
from torch.library import opcheck

import lpmoe
from conftest import requires_cuda
from lpmoe.activation.spec import Activation
from lpmoe.functional import LayerParams
from lpmoe.functional.mlp import mlp_needs
from lpmoe.grouped_tensor import GroupedTensor
from lpmoe import fp8_block_ops
from lpmoe.library import layer_ops, mlp_ops, saved_layout, specs
from lpmoe.moe import RoutedTokens, permute_probs, permute_quantize, routed_tokens, routing_map
from lpmoe.policy import Needs, policy_for
from lpmoe.recipe import Float8BlockScaling
from test_moe_routed_tokens import _assert_same_members, _indices, _mlp_params, _tokens
from _compile_common import RECIPES

OPS = torch.ops.lpmoe
FP8_OPCHECK = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
FP8_LAYER = ("test_faketensor", "test_autograd_registration")


def _detached(args):
    import torch.utils._pytree as pytree
    return pytree.tree_map_only(torch.Tensor, lambda t: t.detach(), args)


@pytest.mark.parametrize("recipe", RECIPES, ids=repr)
def test_policies_say_whether_they_gather_without_making_a_quantizer(recipe):
    """Traced code asks gathers_input; eager code input_quantizer: they agree."""
    pol = policy_for(recipe)
    for need in (Needs(True, True, False), Needs(True, False, False), Needs(False, True, True)):
        assert pol.gathers_input(need) == (pol.input_quantizer(need) is not None)


# ------------------------------------------------------------------ the ops
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_cuda)])
def test_opcheck_row_sources_and_gather_quantize(device):
    t, k, e, h = 40, 2, 4, 256
    rm = routing_map(_indices(t, k, e, drop=0.1, seed=3, device=device), e, capacity=12)
    opcheck(OPS.permute_row_sources, (rm.row_map, rm.num_rows))
    src = OPS.permute_row_sources(rm.row_map, rm.num_rows)
    # the inverse of the map: each routed slot's row names its token, every other row -1
    want = torch.full((rm.num_rows,), -1, dtype=torch.int32)
    for tok, slot in (rm.row_map.cpu() >= 0).nonzero().tolist():
        want[rm.row_map[tok, slot]] = tok
    assert torch.equal(src.cpu(), want)
    q = lpmoe.Float8BlockQuantizer()
    layout = fp8_block_ops.gather_layout(_tokens(t, h, torch.bfloat16, device), rm.num_rows, rm.m_splits)

    def args(x):
        return (x, src, layout.first_dims, layout.padded_row_offsets, specs.encode(q))
    # (opcheck compares outputs with ==: no NaN among these tokens; on the
    # GPU the buffers' capacity padding past the members is never written,
    # so the output comparison of test_aot_dispatch_dynamic does not apply)
    opcheck(OPS.gather_quantize, args(_tokens(t, h, torch.bfloat16, device, edges=False)),
            test_utils=FP8_OPCHECK if device == "cpu" else FP8_LAYER)
    # the op's members are permute_quantize's, edge values included
    x = _tokens(t, h, torch.bfloat16, device)
    bufs = dict(zip(fp8_block_ops.produced(q), OPS.gather_quantize(*args(x))))
    got = GroupedTensor._rebuild((layout.num_tensors, layout.logical_shape, layout.dtype, q, False), dict(
        bufs, first_dims=layout.first_dims, tensor_offsets=layout.tensor_offsets,
        padded_row_offsets=layout.padded_row_offsets, offsets_status=layout.offsets_status))
    _assert_same_members(got, permute_quantize(x, rm, q))


def _routed_mlp_args(sum_to_tokens, keep, device="cpu", t=24, k=2, e=4, h=128, f=64):
    x = _tokens(t, h, torch.bfloat16, device, edges=False).requires_grad_()
    rm = routing_map(_indices(t, k, e, drop=0.1, seed=5, device=device), e)
    w1, w2 = _mlp_params(e, h, f, torch.bfloat16, device)
    probs = permute_probs(torch.rand(t, k, device=device), rm).detach().requires_grad_()
    fc1, fc2 = LayerParams(w1), LayerParams(w2)
    needs = mlp_needs(x, probs, fc1, fc2, True)
    src = RoutedTokens(x, rm, sum_to_tokens=sum_to_tokens)
    return layer_ops.mlp_op_args(x, probs, rm.m_splits, fc1, fc2, Activation("swiglu"), Float8BlockScaling(), None,
                                 needs, src, keep)


@pytest.mark.parametrize("sum_to_tokens,keep", [(False, False), (True, False), (True, True)])
def test_opcheck_routed_grouped_mlp_cpu(sum_to_tokens, keep):
    args = _routed_mlp_args(sum_to_tokens, keep)
    opcheck(OPS.grouped_mlp, args, test_utils=FP8_LAYER)
    out = OPS.grouped_mlp(*args)
    t, rows = args[0].shape[0], args[-1]
    assert out[0].shape == ((t if sum_to_tokens else rows), args[0].shape[1])
    grad = torch.randn_like(out[0])
    fc2_args, act_args, fc1_args = layer_ops.mlp_backward_args(args, out, grad)
    for part, a in fc2_args.items():
        opcheck(OPS.grouped_mlp_backward, _detached(a), test_utils=FP8_LAYER)
    (da,) = OPS.grouped_mlp_backward(*fc2_args["dgrad"])
    act = _detached((da,) + act_args)
    opcheck(OPS.grouped_mlp_backward_act, act, test_utils=FP8_LAYER)
    dh = OPS.grouped_mlp_backward_act(*act)[1:]  # past d probs (probs need a gradient here)
    for part, rest in fc1_args.items():
        fc1 = _detached((layer_ops.fc1_dh(dh, fc2_args["dgrad"][7], part),) + rest)
        opcheck(OPS.grouped_mlp_backward_fc1, fc1, test_utils=FP8_LAYER)
        if part == "dgrad":  # the input gradient is the tokens'
            assert OPS.grouped_mlp_backward_fc1(*fc1)[0].shape == args[0].shape
    whole = _detached(layer_ops.whole_backward_args(args, out, grad))
    opcheck(OPS.grouped_mlp_backward, whole, test_utils=FP8_LAYER)
    assert OPS.grouped_mlp_backward(*whole)[0].shape == args[0].shape


# ------------------------------------------------------- the compiled layer
def _step(layer, x, gy, recipe):
    x = x.detach().clone().requires_grad_()
    layer.zero_grad(set_to_none=True)
    with lpmoe.autocast(recipe=recipe):
        y = layer(x)
    y.backward(gy)
    return [y.detach().clone(), x.grad.clone()] + [p.grad.clone() for p in layer.parameters() if p.requires_grad]


def saved_x_entries(monkeypatch, fn):
    """Runs fn(); returns, for each layer op run that saved tensors during
    it (traces not counted), what that op saved as (fc1's) input for its wgrad (saved object 0 of
    both layer ops): ("t", ("in", "x")) is the op's input x by reference,
    ("g", ...) a quantized copy."""
    keys, real = [], saved_layout.flatten

    def spy(key, objs, inputs, fake=False, *a, **kw):
        if not fake:  # (a real call, not a trace's)
            keys.append(key)
        return real(key, objs, inputs, fake, *a, **kw)
    monkeypatch.setattr(saved_layout, "flatten", spy)
    fn()
    monkeypatch.setattr(saved_layout, "flatten", real)
    assert mlp_ops.SAVED_FOR["wgrad"][0] == 0
    return [saved_layout.LAYOUTS[k][0] for k in keys if not k.endswith("|dh")]


CASES = {  # MoELayer options, and fc2 reading the rows (its bias gradient needs them)
    "plain": {}, "keep": {"save_original_input": True}, "capacity": {"capacity_factor": 0.6},
    "bias": {"bias": True}, "capacity_keep": {"capacity_factor": 0.6, "save_original_input": True},
    "frozen_fc1_weights": {"bias": True}, "frozen_fc1_keep": {"save_original_input": True}}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("split", [False, True])
def test_compiled_fp8_moe_layer_reads_tokens_through_the_map_cpu(case, split, monkeypatch):
    """torch.compile(fullgraph) of the FP8 layer hands the MLP op the tokens
    and the map: the same bits as eager (output, every gradient) for
    steps with new tokens, two token counts, the gathering quantize ran
    inside the op (fc1's input, and fc2's output gradient in two directions
    unless fc2's bias gradient needs the rows, then in the staged backward
    in the direction whose op does not return it; once more for fc1's wgrad
    with save_original_input), and with save_original_input the op saved the
    tokens, not a copy."""
    monkeypatch.setattr(mlp_ops, "SPLIT_BACKWARD_BYTES", 0 if split else 1 << 60)
    opts = CASES[case]
    keep = opts.get("save_original_input", False)
    torch.manual_seed(0)
    layer = lpmoe.moe.MoELayer(128, 64, num_experts=4, top_k=2, device="cpu", params_dtype=torch.bfloat16, **opts)
    frozen = case.startswith("frozen")
    if frozen:  # fc1's weights frozen (its bias, if any, still trains): no fc1 wgrad
        for w in layer.experts.linear_fc1.weights:
            w.requires_grad_(False)
    recipe = Float8BlockScaling()
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    for t in (24, 24, 40):
        g = torch.Generator().manual_seed(t)
        x, gy = (torch.randn(t, 128, generator=g).to(torch.bfloat16) for _ in range(2))
        want = _step(layer, x, gy, recipe)
        before, ops_before = dict(routed_tokens.CALLS), dict(layer_ops.CALLS)
        got = []
        entries = saved_x_entries(monkeypatch, lambda: got.extend(_step(compiled, x, gy, recipe)))
        # fc2's output gradient: both directions from the tokens, or from
        # rows made once where its bias gradient reads them; split, only the
        # op that returns the bias gradient makes the rows
        fc2_gathers = (1 if split else 0) if opts.get("bias") else 2
        gathers = 1 + fc2_gathers + (keep and not frozen)
        assert routed_tokens.CALLS["reference_permute_quantize"] - before["reference_permute_quantize"] == gathers
        assert layer_ops.CALLS["grouped_mlp"] - ops_before["grouped_mlp"] == 1
        fc1_ops = (1 if frozen and not opts.get("bias") else 2) if split else 0
        assert layer_ops.CALLS["grouped_mlp_backward_fc1"] - ops_before["grouped_mlp_backward_fc1"] == fc1_ops
        for i, (u, v) in enumerate(zip(got, want)):
            assert torch.equal(u, v), (t, i)
        assert len(entries) == 1
        assert entries[0] == (("none",) if frozen else ("t", ("in", "x")) if keep else entries[0])
        assert keep or frozen or entries[0][0] == "g"


# ---------------------------------------------------------------------- GPU
@requires_cuda
@pytest.mark.parametrize("keep,split,mode", [(False, False, "default"), (True, True, "default"),
                                             (False, True, "default"), (True, False, "reduce-overhead")])
def test_gpu_compiled_fp8_moe_layer_gathers_bit_identical_to_eager(keep, split, mode, monkeypatch):
    """The compiled FP8 layer on the GPU (Inductor): the gathering kernels
    ran inside the MLP op, and the output and every gradient equal eager's
    for steps with new tokens (new routing) on one compiled graph."""
    import torch._dynamo.testing
    monkeypatch.setattr(mlp_ops, "SPLIT_BACKWARD_BYTES", 0 if split else 1 << 60)
    torch.manual_seed(0)
    layer = lpmoe.moe.MoELayer(256, 128, num_experts=8, top_k=2, device="cuda", params_dtype=torch.bfloat16,
                               save_original_input=keep)
    recipe = Float8BlockScaling()
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    if mode == "default":
        compiled = torch.compile(layer, fullgraph=True, backend=counter)
    else:
        compiled = torch.compile(layer, fullgraph=True, mode=mode)
    gathers = 0
    for step in range(4):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(300, 256, generator=g).to("cuda", torch.bfloat16)
        gy = torch.randn(300, 256, generator=g).to("cuda", torch.bfloat16)
        want = _step(layer, x, gy, recipe)
        before = routed_tokens.CALLS["kernel_permute_quantize"]
        got = _step(compiled, x, gy, recipe)
        gathers += routed_tokens.CALLS["kernel_permute_quantize"] - before
        for i, (u, v) in enumerate(zip(got, want)):
            assert torch.equal(u, v), (step, i)
    if mode == "default":
        assert counter.frame_count == 1 and gathers == 4 * (3 + keep)
    else:  # (CUDA graph replays run no Python: only the warm-up and recording steps count)
        assert gathers >= 3 + keep
