"""Quantizers the layers ask for at every step come from a cache, one shared,
frozen object per configuration (lpmoe.quantizers.shared_copy,
lpmoe.policy.base.recipe_quantizer): building one writes its JSON
description, ~10 us of host time, and an FP8 MLP step built 13."""
import pytest
import torch

import lpmoe
from lpmoe.library import specs
from lpmoe.policy.base import recipe_quantizer
from lpmoe.quantizers import Float8BlockQuantizer, MXFP8Quantizer, NVFP4Quantizer, shared_copy
from lpmoe.recipe import Float8BlockScaling, MXFP8BlockScaling


def test_shared_copy_is_one_frozen_object_per_configuration():
    q = Float8BlockQuantizer(block_dim=1)
    a = shared_copy(q, rowwise=False)
    assert a is shared_copy(Float8BlockQuantizer(block_dim=1), rowwise=False)
    assert a == q.copy(rowwise=False) and not a.rowwise and a.columnwise
    assert q.rowwise  # the source is untouched
    with pytest.raises(AttributeError, match=r"q.copy\(rowwise=\.\.\.\)"):
        a.rowwise = True
    b = a.copy(rowwise=True)  # an ordinary copy, free to change
    b.columnwise = False
    assert b == Float8BlockQuantizer(block_dim=1, columnwise=False)
    assert shared_copy(q, columnwise=False) is not a


@pytest.mark.parametrize("q", [
    Float8BlockQuantizer(block_dim=2, pow2_scales=True, amax_epsilon=0.5, fp8_dtype="float8_e5m2"),
    MXFP8Quantizer(swizzled_scales=True, fp8_dtype="float8_e5m2"),
    NVFP4Quantizer(swizzled_scales=True),
], ids=["fp8_block", "mxfp8", "nvfp4"])
def test_shared_copy_keeps_every_field(q):
    for changes in ({"rowwise": False}, {"columnwise": False}, {}):
        got = shared_copy(q, **changes)
        assert type(got) is type(q) and got._fields() == q.copy(**changes)._fields()


def test_recipe_quantizer_is_shared_per_recipe_configuration():
    a = recipe_quantizer(Float8BlockScaling(), "input", True, False)
    assert a is recipe_quantizer(Float8BlockScaling(), "input", True, False)
    assert a == Float8BlockScaling().quantizer("input", rowwise=True, columnwise=False)
    other = Float8BlockScaling(amax_epsilon=1e-3)
    b = recipe_quantizer(other, "input", True, False)
    assert b is not a and b.amax_epsilon == 1e-3
    assert recipe_quantizer(Float8BlockScaling(), "grad", True, True).block_dim == 1
    with pytest.raises(AttributeError):
        a.amax_epsilon = 0.0
    # what a recipe hands to its user stays an ordinary object
    mine = Float8BlockScaling().quantizer("input")
    mine.rowwise = False


def _describe_calls(monkeypatch):
    calls = []
    real = specs.describe

    def counting(obj):
        calls.append(type(obj).__name__)
        return real(obj)
    monkeypatch.setattr(specs, "describe", counting)
    return calls


def test_layer_steps_build_no_quantizer_after_the_first(monkeypatch):
    """Counted on CPU (the reference GEMMs take direction views as the GPU
    kernels do): the second step of an FP8 GroupedMLP and of an MXFP8
    GroupedLinear describes no new quantizer; before the cache the MLP step
    built 13 on the GPU path and more on this one."""
    torch.manual_seed(0)
    mlp = lpmoe.GroupedMLP(3, 128, 128, params_dtype=torch.bfloat16, device="cpu", single_grouped_parameter=True)
    lin = lpmoe.GroupedLinear(3, 64, 32, bias=False, params_dtype=torch.bfloat16, device="cpu")
    x = torch.randn(200, 128, dtype=torch.bfloat16, requires_grad=True)
    x2 = torch.randn(96, 64, dtype=torch.bfloat16, requires_grad=True)
    splits = torch.tensor([70, 0, 130])
    fp8, mxfp8 = Float8BlockScaling(), MXFP8BlockScaling()

    def steps():
        with lpmoe.autocast(recipe=fp8):
            mlp(x, splits).float().sum().backward()
        with lpmoe.autocast(recipe=mxfp8):
            lin(x2, [32, 32, 32]).float().sum().backward()
    steps()
    calls = _describe_calls(monkeypatch)
    steps()
    assert calls == []


def test_recipe_subclasses_still_work():
    """The cache builds from the recipe object itself on a miss, so a user's
    subclass of a recipe (not known to lpmoe's spec decoder) still runs."""
    class MyFP8(Float8BlockScaling):
        pass

    q = recipe_quantizer(MyFP8(), "input", True, False)
    assert q == Float8BlockScaling().quantizer("input", rowwise=True, columnwise=False)
    assert q is recipe_quantizer(MyFP8(), "input", True, False)
    assert q is not recipe_quantizer(Float8BlockScaling(), "input", True, False)  # keyed by class too
    torch.manual_seed(0)
    lin = lpmoe.GroupedLinear(2, 128, 64, bias=False, params_dtype=torch.bfloat16, device="cpu")
    x = torch.randn(64, 128, dtype=torch.bfloat16, requires_grad=True)
    with lpmoe.autocast(recipe=MyFP8()):
        y = lin(x, [32, 32])
    with lpmoe.autocast(recipe=Float8BlockScaling()):
        ref = lin(x, [32, 32])
    assert torch.equal(y, ref)
