"""Shared inputs and fixtures of the torch.compile / custom-op tests (a
test module that imports a fixture below gets it)."""
import pytest
import torch
import torch._dynamo

import lpmoe
from lpmoe.recipe import Float8BlockScaling, MXFP8BlockScaling, NVFP4BlockScaling

RECIPES = [None, Float8BlockScaling(), Float8BlockScaling(backward_override="high_precision"),
           Float8BlockScaling(backward_override="dequantized"), MXFP8BlockScaling(), NVFP4BlockScaling()]
OPS = torch.ops.lpmoe
SPLITS = [32, 0, 64, 16]          # multiples of 16 (NVFP4), an empty expert
ROWS = 128                          # 16 capacity-tail rows past the 112 routed


def _x(rows=ROWS, k=128, dtype=torch.bfloat16, device="cpu", seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(rows, k, generator=g).to(dtype=dtype, device=device)


def _splits(device="cpu", values=SPLITS):
    return torch.tensor(values, dtype=torch.int64, device=device)


# token counts (rows, device splits): capacity tails, an empty expert, one expert with everything
TOKEN_COUNTS = ((96, [16, 0, 48, 16]), (160, [0, 0, 0, 160]), (64, [16, 16, 16, 16]), (200, [50, 50, 50, 33]))


def _layer(kind, device="cpu", k=128, n=64, stacked=False, bias=True):
    torch.manual_seed(0)
    if kind == "mlp":
        return lpmoe.GroupedMLP(4, k, n, bias=bias, params_dtype=torch.bfloat16, device=device,
                                single_grouped_parameter=stacked)
    return lpmoe.GroupedLinear(4, k, n, bias=bias, params_dtype=torch.bfloat16, device=device,
                               single_grouped_parameter=stacked)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _no_compile_caches():
    """Compiled-graph caches off for this test: a test that changes
    mlp_ops.SPLIT_BACKWARD_BYTES (a constant in production) must not be
    handed a backward traced under another setting."""
    for cfg, name in ((torch._inductor.config, "fx_graph_cache"), (torch._functorch.config, "enable_autograd_cache")):
        patch = cfg.patch(**{name: False})
        patch.__enter__()
        _UNDO.append(patch)


_UNDO: list = []


@pytest.fixture(autouse=True)
def _undo_config_patches():
    yield
    while _UNDO:
        _UNDO.pop().__exit__(None, None, None)
