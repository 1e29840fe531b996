"""FP8 block-scaled wgrad (dW_t = dy_t^T x_t, both operands 1x128-scaled
along the tokens): every configuration of lpmoe's wgrad kernel beside the
CUTLASS kernel and the cuBLASLt per-expert loop, interleaved and repeated
(read ratios, medians and the spread).  These measurements set
choose_wgrad_config in csrc/fp8_gemm/heuristics.h.

Columns: lpmoe's kernel at each tile width and cluster (n192c2: 192 output
columns per tile, clusters of 2 CTAs sharing the x^T tile by multicast), the
CUTLASS kernel, "auto" (what the heuristic picks) and the cuBLASLt loop; fp32
output (fresh), and the heuristic's kernel accumulating into fp32
(main_grad) and writing bf16 as extra columns.  TFLOP/s = 2 * tokens * N * K.
"""
from __future__ import annotations

import statistics

import torch

import lpmoe
from lpmoe import Float8BlockQuantizer
from lpmoe.gemm import fp8_wgrad_kernel_config

from _common import add_sustained, parser, splits_for, write_summary
from bench_fp8_kernel_configs import CASES, SHAPES, measure

# The wgrad's own cases beside the shared ones: DeepSeek-V3 at 32 experts x
# 512 tokens (issue 11's 32 x 16k MLP), where a tile holds 4 K-blocks and
# the epilogue weighs most (docs/fp8-wgrad-kernel-notes.md, stop 52).
SHORT_MEMBERS = [("dsv3-up", 32, 16384, False), ("dsv3-down", 32, 16384, False)]
CONFIGS = {f"n{w}c{c}": (w, c) for w in (128, 192) for c in (1, 2)}
CONFIGS.update({"cutlass": (-1, 0), "auto": (0, 0)})


def operands(k, n, g, splits):
    q1 = Float8BlockQuantizer(block_dim=1)
    rows = sum(splits)
    first = torch.tensor(splits, dtype=torch.int64, device="cuda")
    x = torch.randn(rows, k, device="cuda").bfloat16()
    dy = torch.randn(rows, n, device="cuda").bfloat16()
    return (lpmoe.group_quantize(dy, q1, num_tensors=g, first_dims=first),
            lpmoe.group_quantize(x, q1, num_tensors=g, first_dims=first))


def candidates(dyg, xg, splits, g, n, k):
    out32 = torch.empty(g, n, k, device="cuda")
    out16 = torch.empty(g, n, k, device="cuda", dtype=torch.bfloat16)

    def grouped(config, out=out32, accumulate=False):
        def run():
            with fp8_wgrad_kernel_config(*config):
                lpmoe.grouped_gemm(dyg, xg, kind="wgrad", out=out, accumulate=accumulate, backend="grouped")
        return run
    fns = {name: grouped(cfg) for name, cfg in CONFIGS.items()}
    fns["auto_acc"] = grouped((0, 0), accumulate=True)
    fns["auto_bf16"] = grouped((0, 0), out=out16)
    fns["cublas"] = lambda: lpmoe.grouped_gemm(dyg, xg, kind="wgrad", out=out32, backend="cublas", m_splits=splits)
    return fns


def main():
    p = parser(__doc__)
    p.add_argument("--rounds", type=int, default=3)
    add_sustained(p)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("needs CUDA")
        return
    cases = (CASES[:3] + SHORT_MEMBERS[:1]) if args.quick else (CASES + SHORT_MEMBERS)
    summary = []
    print("TFLOP/s median over rounds [min-max]; ratio = auto / cublas loop, auto / cutlass")
    names = None
    for shape, g, tokens, skewed in cases:
        k, n = SHAPES[shape]
        splits = splits_for(g, tokens, skewed)
        dyg, xg = operands(k, n, g, splits)
        fns = candidates(dyg, xg, splits, g, n, k)
        if names is None:
            names = list(fns)
            print(f"{'case':28s} | " + " | ".join(f"{x:>16s}" for x in names) + " | auto/cublas auto/cutlass")
        got = measure(fns, args.rounds, args.sustained)
        flops = 2.0 * tokens * n * k
        tf = {name: [flops / ms / 1e9 for ms in v] for name, v in got.items()}
        med = {name: statistics.median(v) for name, v in tf.items()}
        cells = " | ".join(f"{med[x]:4.0f} [{min(tf[x]):4.0f}-{max(tf[x]):4.0f}]".rjust(16) for x in names)
        label = f"{shape} g{g} {tokens} {'skew' if skewed else 'unif'}"
        r_loop, r_cutlass = med["auto"] / med["cublas"], med["auto"] / med["cutlass"]
        print(f"{label:28s} | {cells} | {r_loop:5.2f} {r_cutlass:5.2f}", flush=True)
        summary.append((f"wgrad {label} auto/cublas", f"{r_loop:.2f}"))
        summary.append((f"wgrad {label} auto/cutlass", f"{r_cutlass:.2f}"))
        del dyg, xg, fns
        torch.cuda.empty_cache()
    write_summary(args.summary, summary)


if __name__ == "__main__":
    main()
