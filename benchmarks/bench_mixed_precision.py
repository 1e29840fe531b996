"""The expert MLP with fp32 parameters under torch.autocast(bf16), PyTorch's
usual mixed precision, at DeepSeek-V3 expert shapes (7168 -> 2x2048 SwiGLU
-> 7168, router probabilities applied), side by side in one run:

  fp8 amp    lpmoe.GroupedMLP, fp32 parameters, Float8BlockScaling: weights
             quantized straight from fp32 every step, fp32 weight gradients
             from the FP8 wgrad GEMM
  bf16 amp   the same module without a recipe: weights cast to bf16 every
             step, bf16 grouped GEMMs, fp32 weight gradients
  torch amp  torch._grouped_mm on the fp32 parameters cast to bf16 (what
             autocast does for a linear layer; autograd casts the bf16
             weight gradients back to fp32)
  fp8 bf16   lpmoe.GroupedMLP with bf16 parameters and FP8 (the baseline
             of bench_grouped_mlp.py), for the cost of fp32 parameters

Graph-safe device m_splits (lpmoe), device offsets (torch).  ms per
fwd+bwd step (median of 7 samples of 3 steps; --sustained S: after S
seconds of back-to-back steps) and peak GiB above what was allocated before
the step (parameters, x, dy); weight gradients allocated in the step
(zero_grad(set_to_none=True)): fp32 ones for the fp32 parameters.
"""
from __future__ import annotations

import gc

import torch
import torch.nn.functional as F

import lpmoe
from lpmoe.recipe import Float8BlockScaling

from _common import mlp_cases, splits_for, time_and_peak, write_summary

HIDDEN, FFN = 7168, 2048
BF16 = torch.bfloat16


class TorchAmpMLP(torch.nn.Module):
    """torch._grouped_mm on fp32 parameters cast to bf16 in the forward."""

    def __init__(self, experts):
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(experts, 2 * FFN, HIDDEN, device="cuda") * 0.01)
        self.w2 = torch.nn.Parameter(torch.randn(experts, HIDDEN, FFN, device="cuda") * 0.01)

    def forward(self, x, offs, probs):
        h = torch._grouped_mm(x, self.w1.to(BF16).transpose(-2, -1), offs=offs)
        g, v = h.chunk(2, dim=-1)
        a = F.silu(g) * v * probs[:, None].to(h.dtype)
        return torch._grouped_mm(a, self.w2.to(BF16).transpose(-2, -1), offs=offs)


def run_case(g, tokens, skewed, sustained):
    splits = splits_for(g, tokens, skewed)
    m = torch.tensor(splits, device="cuda")
    offs = torch.cumsum(m, 0).to(torch.int32)
    x = torch.randn(tokens, HIDDEN, device="cuda", dtype=BF16, requires_grad=True)
    p = torch.rand(tokens, device="cuda", requires_grad=True)
    dy = torch.randn(tokens, HIDDEN, device="cuda", dtype=BF16)
    res = {}
    cases = (("fp8 amp", Float8BlockScaling(), torch.float32), ("bf16 amp", None, torch.float32),
             ("fp8 bf16", Float8BlockScaling(), BF16), ("torch amp", None, None))
    for name, recipe, dtype in cases:
        mod = TorchAmpMLP(g) if dtype is None else lpmoe.GroupedMLP(g, HIDDEN, FFN, params_dtype=dtype,
                                                                      device="cuda")

        def reset():
            x.grad = p.grad = None
            mod.zero_grad(set_to_none=True)

        def step():
            reset()
            with torch.autocast("cuda", dtype=BF16), lpmoe.autocast(enabled=recipe is not None, recipe=recipe):
                y = mod(x, offs, p) if dtype is None else mod(x, m, probs=p)
            y.backward(dy)
        try:
            res[name] = time_and_peak(step, reset, sustained)
        except RuntimeError as exc:  # e.g. no grouped-mm backward in this torch
            print(f"  {name} unavailable: {str(exc)[:100]}")
        del mod
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return res


def main():
    args, cases = mlp_cases(__doc__)
    rows = []
    for g, tokens, skewed in cases:
        r = run_case(g, tokens, skewed, args.sustained)
        tag = f"g={g} tok={tokens} {'skew' if skewed else 'unif'}"
        cells = "  ".join(f"{k} {v[0]:7.2f} ms {v[1]:5.2f} GiB" for k, v in r.items())
        fp8, bf16 = r["fp8 amp"], r["bf16 amp"]
        line = (f"{tag:22s} | {cells} | fp8/bf16 (amp) {bf16[0] / fp8[0]:4.2f}x, peak {fp8[1] / bf16[1]:4.2f}"
                f" | fp8 amp / fp8 bf16 params: time {fp8[0] / r['fp8 bf16'][0]:4.2f}x")
        if "torch amp" in r:
            line += f" | fp8 amp / torch amp {r['torch amp'][0] / fp8[0]:4.2f}x, peak {fp8[1] / r['torch amp'][1]:4.2f}"
        print(line, flush=True)
        rows.append((f"mlp amp {tag} fp8/bf16 speed | peak fp8/bf16",
                     f"{bf16[0] / fp8[0]:.2f}x | {fp8[1] / bf16[1]:.2f}"))
    write_summary(args.summary, rows)


if __name__ == "__main__":
    main()
