"""GroupedLinear rejects bad input with a clear error before any GPU work."""
import pytest
import torch

import lpmoe
import lpmoe.functional as LF
from lpmoe.recipe import Float8BlockScaling, NVFP4BlockScaling, Recipe
from _grouped_linear_common import G, K, N, make_layer
from _grouped_linear_common import spies  # noqa: F401  (a fixture)


# ---------------------------------------------------------------- errors
def _layer_and_input(dtype=torch.bfloat16):
    return make_layer(dtype), torch.randn(64, K, dtype=dtype)


@pytest.mark.parametrize("splits, exc, msg", [
    ([32, 32], ValueError, "per expert"),
    (torch.tensor([32, 32]), ValueError, "per expert"),
    (torch.tensor([[32, 32, 0]]), ValueError, "per expert"),
    (torch.tensor([32.0, 32.0, 0.0]), TypeError, "int32/int64"),
    ([32.0, 32, 0], TypeError, "ints"),
    ([True, 32, 0], TypeError, "ints"),
    ("32,32,0", TypeError, "list of ints"),
    ([40, -8, 32], ValueError, "non-negative"),
    (torch.tensor([40, -8, 32]), ValueError, "non-negative"),
    ([40, 20, 8], ValueError, "exceeds"),
])
def test_bad_splits_raise_before_any_work(spies, splits, exc, msg):
    layer, x = _layer_and_input()
    with pytest.raises(exc, match=msg):
        layer(x, splits)
    assert not spies["grouped_gemm"].calls and not spies["group_quantize"].calls


@pytest.mark.parametrize("recipe", [None, Float8BlockScaling()], ids=repr)
def test_bad_inputs_raise(spies, recipe):
    layer, x = _layer_and_input()
    qx = lpmoe.group_quantize(x, lpmoe.Float8BlockQuantizer(), num_tensors=G,
                              first_dims=torch.tensor([64, 0, 0]))
    spies["group_quantize"].calls.clear()
    with lpmoe.autocast(enabled=recipe is not None, recipe=recipe):
        with pytest.raises(ValueError, match="in_features"):
            layer(torch.randn(64, K + 16, dtype=torch.bfloat16), [64, 0, 0])
        with pytest.raises(TypeError, match="GroupedTensor"):
            layer(qx, [64, 0, 0])
        with pytest.raises(TypeError, match="quantized"):
            layer(x.to(torch.float8_e4m3fn), [64, 0, 0])
        with pytest.raises(TypeError, match="quantized"):
            layer(qx.rowwise_data, [64, 0, 0])  # raw FP8 bytes
        with pytest.raises(ValueError, match="in_features"):
            layer(torch.randn(K, dtype=torch.bfloat16), [1, 0, 0])
        with pytest.raises(TypeError, match="float32"):
            layer(x.float(), [64, 0, 0])  # params are bf16
    assert not spies["grouped_gemm"].calls and not spies["group_quantize"].calls


def test_fp32_params_with_fp8_block_raise():
    layer, x = _layer_and_input(torch.float32)
    with lpmoe.autocast(recipe=Float8BlockScaling()):
        with pytest.raises(TypeError, match="bf16"):
            layer(x, [64, 0, 0])
    layer(x, [64, 0, 0])  # fine without the recipe


def test_unsupported_recipes_raise():
    class MyRecipe(Recipe):
        pass

    layer, x = _layer_and_input()
    with lpmoe.autocast(recipe=MyRecipe()):
        with pytest.raises(TypeError, match="unsupported recipe"):
            layer(x, [64, 0, 0])
    with lpmoe.autocast(recipe=Float8BlockScaling(x_block_dim=2, w_block_dim=1)):
        with pytest.raises(NotImplementedError, match="1x128"):
            layer(x, [64, 0, 0])
    with lpmoe.autocast(recipe=NVFP4BlockScaling()):
        with pytest.raises(ValueError, match="multiple of 16"):
            layer(x, [60, 4, 0])
    odd = lpmoe.GroupedLinear(G, 40, N, params_dtype=torch.bfloat16, device="cpu")
    with lpmoe.autocast(recipe=Float8BlockScaling()):
        with pytest.raises(ValueError, match="multiples of 16"):
            odd(torch.randn(8, 40, dtype=torch.bfloat16), [8, 0, 0])


def test_bad_params_raise():
    x = torch.randn(8, K)
    w = [torch.randn(N, K) for _ in range(G)]
    with pytest.raises(TypeError, match="weights"):
        LF.grouped_linear(x, [8, 0, 0], [])
    with pytest.raises(ValueError, match="weights\\[1\\]"):
        LF.grouped_linear(x, [8, 0, 0], [w[0], w[1][:, :64], w[2]])
    with pytest.raises(ValueError, match="biases\\[0\\]"):
        LF.grouped_linear(x, [8, 0, 0], w, [torch.zeros(N + 1)] * G)
    with pytest.raises(TypeError, match="biases"):
        LF.grouped_linear(x, [8, 0, 0], w, [torch.zeros(N)] * 2)


def test_functional_reads_autocast_when_recipe_is_none(spies):
    w = [torch.randn(N, K, dtype=torch.bfloat16) for _ in range(G)]
    x = torch.randn(16, K, dtype=torch.bfloat16)
    with lpmoe.autocast(recipe=Float8BlockScaling()):
        LF.grouped_linear(x, [16, 0, 0], w)
    assert spies["grouped_gemm"].calls[-1][0][0].is_quantized
