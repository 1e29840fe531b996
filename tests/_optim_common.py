"""Shared pieces of the lpmoe.optim tests (test_optim*.py): a small fp32
GroupedMLP and a training loop under bf16 autocast and the FP8 recipe."""
import pytest
import torch

import lpmoe
from conftest import requires_cuda

BF16 = torch.bfloat16
FP8 = lpmoe.recipe.Float8BlockScaling()
Q2D = lpmoe.Float8BlockQuantizer(block_dim=2)
G, K, N = 4, 256, 128
SPLITS = [100, 0, 150, 50]


def devices():
    return ["cpu", pytest.param("cuda", id="gpu", marks=requires_cuda)]


def _mlp(device, seed=1, dtype=torch.float32, **kw):
    torch.manual_seed(seed)
    return lpmoe.GroupedMLP(G, K, N, bias=True, params_dtype=dtype, device=device, **kw)


def _train(model, opt, steps, device, seed=5, fresh_quantize=False, first=None):
    """``steps`` of fwd + bwd + opt.step under bf16 autocast and the FP8
    recipe; returns the outputs.  fresh_quantize: empty the weight caches
    before each forward (the layers quantize their weights themselves)."""
    gen = torch.Generator().manual_seed(seed)
    splits = torch.tensor(SPLITS, device=device) if device == "cuda" else SPLITS
    outs = []
    for _ in range(steps):
        x = torch.randn(sum(SPLITS), K, generator=gen).to(device)
        dy = torch.randn(sum(SPLITS), K, generator=gen).to(device, BF16)
        if fresh_quantize:
            for lin in (model.linear_fc1, model.linear_fc2):
                lin.weight_cache.source = None
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=BF16), lpmoe.autocast(recipe=FP8):
            kw = {} if first is None else {"is_first_microbatch": first}
            y = model(x, splits, **kw)
        y.backward(dy)
        opt.step()
        outs.append(y.detach())
    return outs


def fused_step_without_sync(opt) -> int:
    """``opt.step()`` under ``set_sync_debug_mode("error")`` (a host sync
    raises); returns how many layer steps took the fused path."""
    before = lpmoe.optim.stats()["fused"]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        opt.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return lpmoe.optim.stats()["fused"] - before
