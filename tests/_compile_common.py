"""Shared inputs of the torch.compile / custom-op tests."""
import torch

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
