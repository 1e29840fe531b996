"""lpmoe.ops: composable expert-MLP operations and their recipe gating."""
import pytest
import torch
import torch.nn.functional as F

import lpmoe
from lpmoe.recipe import Float8BlockScaling, MXFP8BlockScaling
from conftest import requires_cuda

G, H, FFN = 3, 128, 128  # experts, hidden, ffn


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


def make_mlp(dtype=torch.float32, device="cpu", seed=0):
    torch.manual_seed(seed)
    return lpmoe.ops.Sequential(
        lpmoe.ops.GroupedLinear(G, H, 2 * FFN, params_dtype=dtype, device=device),
        lpmoe.ops.SwiGLU(),
        lpmoe.ops.GroupedLinear(G, FFN, H, params_dtype=dtype, device=device),
    )


def manual_mlp(mlp, x, splits):
    """The same MLP written with torch ops, expert by expert."""
    fc1, _, fc2 = mlp
    rows, outs = 0, []
    for t, m in enumerate(splits):
        h = F.linear(x[rows:rows + m], fc1.weights[t], fc1.biases[t])
        a, b = h.chunk(2, dim=-1)
        outs.append(F.linear(F.silu(a) * b, fc2.weights[t], fc2.biases[t]))
        rows += m
    return torch.cat(outs)


def test_expert_mlp_matches_manual_composition():
    mlp = make_mlp()
    splits = [40, 0, 88]
    x = torch.randn(128, H, requires_grad=True)
    y = mlp(x, splits)
    y.square().sum().backward()
    grads = [x.grad.clone()] + [p.grad.clone() for p in mlp.parameters()]
    for p in mlp.parameters():
        p.grad = None
    x2 = x.detach().clone().requires_grad_(True)
    ref = manual_mlp(mlp, x2, splits)
    ref.square().sum().backward()
    ref_grads = [x2.grad] + [p.grad for p in mlp.parameters()]
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(grads, ref_grads):
        if b is None:  # torch leaves the empty expert's parameters without a grad
            assert torch.all(a == 0)
        else:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_expert_mlp_under_fp8_block_close_to_high_precision():
    mlp = make_mlp(torch.bfloat16)
    splits = [64, 0, 64]
    x = torch.randn(128, H, dtype=torch.bfloat16)
    hp = mlp(x, splits)
    with lpmoe.autocast(recipe=Float8BlockScaling()):
        lp = mlp(x, splits)
    # two quantized GEMMs (and SwiGLU's product of two quantized branches): ~2x one layer's error
    assert 1e-4 < rel(lp, hp) < 0.1


def test_sequential_passes_m_splits_only_where_taken():
    seen = []

    class Probe(lpmoe.ops.BasicOperation):
        supports_float8_block_scaling = True

        def forward(self, x):
            seen.append(x.shape)
            return x * 2

    seq = lpmoe.ops.Sequential(Probe(), lpmoe.ops.GroupedLinear(G, H, H, device="cpu"), Probe())
    y = seq(torch.randn(8, H), [8, 0, 0])
    assert y.shape == (8, H) and seen == [(8, H), (8, H)]
    with pytest.raises(TypeError, match="BasicOperation"):
        lpmoe.ops.Sequential(torch.nn.ReLU())


def test_ops_without_fp8_block_support_refuse_it():
    class Scale(lpmoe.ops.BasicOperation):  # supports_float8_block_scaling stays False
        def forward(self, x):
            self.active_recipe()
            return x * 3

    op = Scale()
    x = torch.randn(4, H)
    with lpmoe.autocast(recipe=Float8BlockScaling()):
        with pytest.raises(NotImplementedError, match="Scale does not support the Float8BlockScaling recipe"):
            op(x)
        with lpmoe.autocast(enabled=False):
            assert torch.equal(op(x), x * 3)
    with lpmoe.autocast(recipe=MXFP8BlockScaling()):  # only FP8 block scaling is gated
        assert torch.equal(op(x), x * 3)
    assert torch.equal(op(x), x * 3)


def test_op_flags():
    assert lpmoe.ops.BasicOperation.supports_float8_block_scaling is False
    for cls in (lpmoe.ops.GroupedLinear, lpmoe.ops.SwiGLU, lpmoe.ops.GELU):
        assert issubclass(cls, lpmoe.ops.BasicOperation) and cls.supports_float8_block_scaling
    assert lpmoe.ops.GroupedLinear.takes_m_splits and not lpmoe.ops.SwiGLU.takes_m_splits


def test_activations():
    x = torch.randn(6, 2 * H)
    a, b = x.chunk(2, dim=-1)
    torch.testing.assert_close(lpmoe.ops.SwiGLU()(x), F.silu(a) * b)
    torch.testing.assert_close(lpmoe.ops.GELU()(x), F.gelu(x, approximate="tanh"))
    torch.testing.assert_close(lpmoe.ops.GELU("none")(x), F.gelu(x))
    with pytest.raises(ValueError, match="even"):
        lpmoe.ops.SwiGLU()(torch.randn(2, 3))
    with pytest.raises(ValueError, match="approximate"):
        lpmoe.ops.GELU("erf")
    with lpmoe.autocast(recipe=Float8BlockScaling()):  # elementwise, high precision: allowed
        torch.testing.assert_close(lpmoe.ops.SwiGLU()(x), F.silu(a) * b)


def test_grouped_linear_op_shares_module_state_dict():
    op = lpmoe.ops.GroupedLinear(G, H, FFN, device="cpu")
    mod = lpmoe.GroupedLinear(G, H, FFN, device="cpu")
    assert list(op.state_dict()) == list(mod.state_dict())
    mod.load_state_dict(op.state_dict())
    x = torch.randn(16, H)
    assert torch.equal(op(x, [4, 4, 8]), mod(x, [4, 4, 8]))
    mlp = make_mlp()
    assert [k for k in mlp.state_dict() if k.startswith("0.")][:2] == ["0.weight0", "0.bias0"]


@requires_cuda
def test_cuda_expert_mlp_fp8_close_to_bf16():
    mlp = make_mlp(torch.bfloat16, device="cuda")
    splits = torch.tensor([256, 0, 256], device="cuda")
    x = torch.randn(512, H, dtype=torch.bfloat16, device="cuda")
    hp = mlp(x, splits)
    with lpmoe.autocast(recipe=Float8BlockScaling()):
        lp = mlp(x, splits)
    assert rel(lp, hp) < 0.1  # two quantized GEMMs


def test_gating_does_not_depend_on_the_subclass_forward():
    class Doubler(lpmoe.ops.BasicOperation):  # forward never asks for the recipe
        def forward(self, x):
            return 2 * x

    x = torch.ones(4, 8)
    assert torch.equal(Doubler()(x), 2 * x)
    with lpmoe.autocast(recipe=Float8BlockScaling()):
        with pytest.raises(NotImplementedError, match="Doubler.*Float8BlockScaling"):
            Doubler()(x)
