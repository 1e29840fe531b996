"""What a compiled layer op keeps for its backward (lpmoe.library.saved_layout):
the recorded plan that later calls follow, the packed index arrays, the
fallback to the generic walk when a call deviates, and the trusted
GroupedTensor rebuild.  CPU (the logic is device-independent; the GPU
compile tests run the same code on the H100)."""
import pytest
import torch
import torch._dynamo

import lpmoe
from lpmoe.grouped_tensor import GroupedTensor
from lpmoe.library import saved_layout
from lpmoe.recipe import Float8BlockScaling

_KEY = "test_saved_layout|{}"


def _objects(x, w, seed):
    """(saved objects, op inputs): an input, a fresh tensor, a list of
    inputs, and two index arrays cut from one small buffer (like a group's
    offsets, which must not go out as two aliasing outputs), one repeated."""
    g = torch.Generator().manual_seed(seed)
    fresh = torch.randn(3, 5, generator=g)
    bulk = torch.randint(0, 100, (12,), generator=g)
    a, b = bulk.narrow(0, 0, 4), bulk.narrow(0, 6, 6).view(2, 3)
    return [x, fresh, [w], None, a, b, a], {"x": x, "w0": w}


def _check_round_trip(key, objs, inputs):
    fresh = saved_layout.flatten(key, objs, inputs)
    saved, k = saved_layout.inputs_to_save(key, inputs)
    back = saved_layout.rebuild(key, saved + fresh, k, inputs["x"].shape[0])
    assert back[0] is objs[0] and back[2][0] is objs[2][0] and back[3] is None
    for i in (1, 4, 5, 6):
        assert torch.equal(back[i], objs[i]), i
    storages = {t.untyped_storage().data_ptr() for t in fresh}
    assert len(storages) == len(fresh), "outputs must not alias each other"
    return fresh


def test_plan_is_recorded_and_followed():
    key = _KEY.format("follow")
    x, w = torch.randn(4, 5), torch.randn(5, 5)
    before = dict(saved_layout.CALLS)
    objs, inputs = _objects(x, w, 0)
    fresh = _check_round_trip(key, objs, inputs)
    # the fresh tensor, then a and b's buffer once, whole and not copied; a's repeat is a reference
    assert len(fresh) == 2 and fresh[1].dtype == torch.int64 and fresh[1].numel() == 12
    assert fresh[1].data_ptr() == objs[4].untyped_storage().data_ptr()
    assert saved_layout.CALLS["walked"] == before["walked"] + 1
    for seed in (1, 2):  # new tensors, same structure: the recorded plan
        _check_round_trip(key, *_objects(x, w, seed))
    assert saved_layout.CALLS["planned"] == before["planned"] + 2
    assert saved_layout.CALLS["walked"] == before["walked"] + 1


def test_deviation_walks_again_and_raises():
    key = _KEY.format("deviate")
    x, w = torch.randn(4, 5), torch.randn(5, 5)
    _check_round_trip(key, *_objects(x, w, 0))
    objs, inputs = _objects(x, w, 1)
    objs[0] = x.clone()  # was the input x: now a fresh tensor, so the layout differs
    walked = saved_layout.CALLS["walked"]
    with pytest.raises(RuntimeError, match="differ from the traced ones"):
        saved_layout.flatten(key, objs, inputs)
    assert saved_layout.CALLS["walked"] == walked + 1
    # an index array that is no longer a view of that buffer: walked, and the layout differs
    objs, inputs = _objects(x, w, 2)
    objs[5] = objs[5].clone()
    with pytest.raises(RuntimeError, match="differ from the traced ones"):
        saved_layout.flatten(key, objs, inputs)


def test_grouped_rebuild_is_the_flattened_group():
    x = torch.randn(40, 32, dtype=torch.bfloat16)
    splits = torch.tensor([0, 17, 23], dtype=torch.int64)
    q = lpmoe.group_quantize(x, lpmoe.Float8BlockQuantizer(rowwise=True, columnwise=True), 3, first_dims=splits)
    parts, meta = q.flatten()
    r = GroupedTensor._rebuild(meta[1:], dict(zip(meta[0], parts)))
    for f in ("rowwise_data", "columnwise_data", "scale_inv", "columnwise_scale_inv", "first_dims",
              "tensor_offsets", "padded_row_offsets"):
        assert getattr(r, f) is getattr(q, f), f
    assert (r.num_tensors, r.logical_shape, r.dtype, r.quantizer, r.with_gemm_swizzled_scales) == \
        (q.num_tensors, q.logical_shape, q.dtype, q.quantizer, q.with_gemm_swizzled_scales)
    assert torch.equal(lpmoe.group_dequantize(r, torch.float32).rowwise_data,
                       lpmoe.group_dequantize(q, torch.float32).rowwise_data)


def test_compiled_mlp_takes_the_planned_path_and_matches_eager():
    torch._dynamo.reset()
    torch.manual_seed(0)
    mlp = lpmoe.GroupedMLP(4, 128, 64, device="cpu", params_dtype=torch.bfloat16, single_grouped_parameter=True)
    compiled = torch.compile(mlp, fullgraph=True)
    x0 = torch.randn(96, 128, dtype=torch.bfloat16)
    recipe = Float8BlockScaling()

    def step(module, splits):
        x = x0.clone().requires_grad_(True)
        mlp.zero_grad(set_to_none=True)
        with lpmoe.autocast(recipe=recipe):
            y = module(x, splits)
        y.backward(torch.ones_like(y))
        return [y, x.grad] + [p.grad for p in mlp.parameters()]

    planned = saved_layout.CALLS["planned"]
    for splits in ([30, 0, 50, 16], [1, 95, 0, 0], [24, 24, 24, 24]):
        s = torch.tensor(splits)
        for a, b in zip(step(compiled, s), step(mlp, s)):
            assert torch.equal(a, b)
    assert saved_layout.CALLS["planned"] >= planned + 2  # the first real call records, the later ones follow
    torch._dynamo.reset()
