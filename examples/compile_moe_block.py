"""A MoE block compiled whole with torch.compile: plain torch ops (router
softmax and top-k, token sort by expert, weighted un-sort) around
lpmoe.GroupedMLP, which runs as one opaque op per direction.

    python examples/compile_moe_block.py [--device cpu|cuda] [--fp8]
"""
from __future__ import annotations

import argparse

import torch

import lpmoe
from lpmoe.recipe import Float8BlockScaling


class MoEBlock(torch.nn.Module):
    def __init__(self, hidden=128, ffn=64, experts=4, top_k=2, device="cpu", single_grouped_parameter=False):
        super().__init__()
        self.router = torch.nn.Linear(hidden, experts, bias=False, device=device, dtype=torch.bfloat16)
        self.experts = lpmoe.GroupedMLP(experts, hidden, ffn, params_dtype=torch.bfloat16, device=device,
                                        single_grouped_parameter=single_grouped_parameter)
        self.e, self.k = experts, top_k

    def forward(self, x, _splits=None):
        probs, idx = torch.topk(torch.softmax(self.router(x).float(), -1), self.k, dim=-1)
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.nn.functional.one_hot(flat, self.e).sum(0)  # tokens per expert, on x's device
        rows = x.repeat_interleave(self.k, 0)[order]
        y = self.experts(rows, counts, probs=probs.reshape(-1)[order].to(x.dtype))
        out = torch.zeros(flat.numel(), x.shape[1], dtype=y.dtype, device=y.device).index_copy(0, order, y)
        return out.view(-1, self.k, x.shape[1]).sum(1)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--fp8", action="store_true", help="Float8BlockScaling (GPU: Hopper)")
    args = p.parse_args(argv)
    block = MoEBlock(device=args.device)
    compiled = torch.compile(block, fullgraph=True)
    x = torch.randn(256, 128, device=args.device, dtype=torch.bfloat16, requires_grad=True)
    with lpmoe.autocast(enabled=args.fp8, recipe=Float8BlockScaling()):
        y = compiled(x)
    y.float().pow(2).mean().backward()
    print(f"compiled MoE block: out {tuple(y.shape)}, |dx| {x.grad.float().norm():.4f}")
    return y


if __name__ == "__main__":
    main()
