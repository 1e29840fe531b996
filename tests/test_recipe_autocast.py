"""Recipes (lpmoe.recipe) and the autocast context (lpmoe.autocast)."""
import threading

import pytest
import torch

import lpmoe
from lpmoe.recipe import Float8BlockScaling, Format, MXFP8BlockScaling, NVFP4BlockScaling, Recipe
from lpmoe.quantizers import Float8BlockQuantizer, MXFP8Quantizer, NVFP4Quantizer


# ------------------------------------------------------------------ recipes
def test_float8_block_defaults_make_the_gemm_layouts():
    r = Float8BlockScaling()
    qx, qw, qg = (r.quantizer(role) for role in ("input", "weight", "grad"))
    assert all(isinstance(q, Float8BlockQuantizer) for q in (qx, qw, qg))
    assert (qx.block_dim, qw.block_dim, qg.block_dim) == (1, 2, 1)
    assert {q.fp8_dtype for q in (qx, qw, qg)} == {torch.float8_e4m3fn}
    assert qx.pow2_scales and qx.amax_epsilon == 0.0
    assert r.is_default_layout and r.backward_override is None and r.native_on_hopper


def test_hybrid_format_uses_e5m2_for_grads_only():
    r = Float8BlockScaling(fp8_format=Format.HYBRID)
    assert r.quantizer("grad").fp8_dtype == torch.float8_e5m2
    assert r.quantizer("input").fp8_dtype == torch.float8_e4m3fn
    assert r.quantizer("weight").fp8_dtype == torch.float8_e4m3fn
    assert MXFP8BlockScaling(Format.HYBRID).quantizer("grad").fp8_dtype == torch.float8_e5m2


def test_quantizer_directions_and_options_pass_through():
    r = Float8BlockScaling(power_2_scale=False, amax_epsilon=1e-6)
    q = r.quantizer("grad", rowwise=False, columnwise=True)
    assert (q.rowwise, q.columnwise, q.pow2_scales, q.amax_epsilon) == (False, True, False, 1e-6)


@pytest.mark.parametrize("dims", [(2, 2, 1), (1, 2, 2), (2, 1, 2)])
def test_two_128x128_operands_in_one_gemm_are_rejected(dims):
    x, w, g = dims
    with pytest.raises(ValueError, match="128x128"):
        Float8BlockScaling(x_block_dim=x, w_block_dim=w, grad_block_dim=g)


def test_legal_non_default_layout_is_accepted_but_flagged():
    r = Float8BlockScaling(x_block_dim=2, w_block_dim=1, grad_block_dim=1)
    assert not r.is_default_layout
    assert r.quantizer("input").block_dim == 2


@pytest.mark.parametrize("kwargs, exc, msg", [
    (dict(x_block_dim=3), ValueError, "x_block_dim"),
    (dict(grad_block_dim=0), ValueError, "grad_block_dim"),
    (dict(w_block_dim=True), ValueError, "w_block_dim"),
    (dict(backward_override="fp32"), ValueError, "backward_override"),
    (dict(fp8_format="E4M3"), TypeError, "fp8_format"),
    (dict(amax_epsilon=-1.0), ValueError, "amax_epsilon"),
    (dict(amax_epsilon=float("nan")), ValueError, "amax_epsilon"),
])
def test_float8_block_validation(kwargs, exc, msg):
    with pytest.raises(exc, match=msg):
        Float8BlockScaling(**kwargs)


@pytest.mark.parametrize("override", [None, "high_precision", "dequantized"])
def test_every_recipe_takes_the_backward_overrides(override):
    for cls in (Float8BlockScaling, MXFP8BlockScaling, NVFP4BlockScaling):
        assert cls(backward_override=override).backward_override == override
    with pytest.raises(ValueError, match="backward_override"):
        NVFP4BlockScaling(backward_override="bf16")


def test_emulated_recipes_make_their_formats():
    assert isinstance(MXFP8BlockScaling().quantizer("input"), MXFP8Quantizer)
    q = NVFP4BlockScaling().quantizer("weight", columnwise=False)
    assert isinstance(q, NVFP4Quantizer) and not q.columnwise
    assert not MXFP8BlockScaling.native_on_hopper and not NVFP4BlockScaling.native_on_hopper
    with pytest.raises(ValueError, match="role"):
        MXFP8BlockScaling().quantizer("output")


def test_recipes_compare_by_value():
    assert Float8BlockScaling() == Float8BlockScaling()
    assert Float8BlockScaling() != Float8BlockScaling(fp8_format=Format.HYBRID)
    assert Float8BlockScaling() != MXFP8BlockScaling()
    assert len({Float8BlockScaling(), Float8BlockScaling(), NVFP4BlockScaling()}) == 2
    assert "HYBRID" in repr(Float8BlockScaling(fp8_format=Format.HYBRID))


# ----------------------------------------------------------------- autocast
def test_no_recipe_outside_autocast():
    assert lpmoe.get_autocast_recipe() is None


def test_enabled_without_recipe_means_default_fp8_block():
    with lpmoe.autocast():
        assert lpmoe.get_autocast_recipe() == Float8BlockScaling()
    assert lpmoe.get_autocast_recipe() is None


def test_nesting_overrides_and_restores():
    outer, inner = Float8BlockScaling(), MXFP8BlockScaling()
    with lpmoe.autocast(recipe=outer):
        assert lpmoe.get_autocast_recipe() is outer
        with lpmoe.autocast(recipe=inner):
            assert lpmoe.get_autocast_recipe() is inner
            with lpmoe.autocast(enabled=False):
                assert lpmoe.get_autocast_recipe() is None
            assert lpmoe.get_autocast_recipe() is inner
        assert lpmoe.get_autocast_recipe() is outer
        with lpmoe.autocast(enabled=False, recipe=inner):  # disabled wins over a recipe
            assert lpmoe.get_autocast_recipe() is None
    assert lpmoe.get_autocast_recipe() is None


def test_exception_inside_restores_outer_state():
    r = NVFP4BlockScaling()
    with lpmoe.autocast(recipe=r):
        with pytest.raises(RuntimeError):
            with lpmoe.autocast(enabled=False):
                raise RuntimeError("boom")
        assert lpmoe.get_autocast_recipe() is r
    assert lpmoe.get_autocast_recipe() is None


def test_state_is_per_thread():
    seen = []
    with lpmoe.autocast(recipe=Float8BlockScaling()):
        t = threading.Thread(target=lambda: seen.append(lpmoe.get_autocast_recipe()))
        t.start()
        t.join()
    assert seen == [None]


def test_autocast_works_as_decorator():
    r = MXFP8BlockScaling()

    @lpmoe.autocast(recipe=r)
    def f():
        return lpmoe.get_autocast_recipe()

    assert f() is r and lpmoe.get_autocast_recipe() is None


def test_autocast_argument_errors():
    with pytest.raises(TypeError, match="recipe"):
        with lpmoe.autocast(recipe="fp8"):
            pass
    with pytest.raises(TypeError, match="enabled"):
        with lpmoe.autocast(enabled=1):
            pass
    assert lpmoe.get_autocast_recipe() is None


def test_custom_recipe_subclass_is_accepted_by_autocast():
    class MyRecipe(Recipe):
        pass

    with lpmoe.autocast(recipe=MyRecipe()):
        assert isinstance(lpmoe.get_autocast_recipe(), MyRecipe)
