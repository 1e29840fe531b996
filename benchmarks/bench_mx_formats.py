"""MXFP8 and NVFP4 kernels on Hopper: effective bandwidth vs device copy.

Bytes counted = input read once + every output written once (data + scales);
NVFP4 quantize also reads its input a second time for the per-member amax,
which is NOT counted (its ratio is therefore against the 1-pass floor).
Kernels are timed as CUDA graphs of 10 calls (device time, as in
bench_fp8_block.py), the copy eagerly; all cases are swept --rounds times,
interleaved, and medians are reported with their spread.

    PYTHONPATH=python:benchmarks python benchmarks/bench_mx_formats.py [--quick] [--rounds 3] [--ops nvfp4]
"""
from __future__ import annotations

import statistics

import torch

import lpmoe
from _common import copy_bandwidth_gbs, graph_median_ms, quantizer_splits, parser, write_summary
from lpmoe import MXFP8Quantizer, NVFP4Quantizer


def case_ops(tokens, k, n, skewed):
    """(name, {op: (fn, bytes)}) of one case; its tensors stay alive in the closures."""
    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
    fd = torch.tensor(quantizer_splits(tokens, n, skewed), device="cuda", dtype=torch.int64)
    fd16 = torch.tensor(quantizer_splits(tokens, n, skewed, align=16), device="cuda", dtype=torch.int64)
    e = tokens * k
    name = f"{tokens // 1024}k x {k}, {n} members{' skewed' if skewed else ''}"
    qm = MXFP8Quantizer(swizzled_scales=True)
    om = lpmoe.group_quantize(x, qm, n, first_dims=fd)
    qmr = MXFP8Quantizer(columnwise=False)
    omr = lpmoe.group_quantize(x, qmr, n, first_dims=fd)
    qmc = MXFP8Quantizer(rowwise=False, swizzled_scales=True)
    omc = lpmoe.group_quantize(x, qmc, n, first_dims=fd)
    qn = NVFP4Quantizer(swizzled_scales=True)
    on = lpmoe.group_quantize(x, qn, n, first_dims=fd16)
    return name, {
        "mxfp8 quant row+col swz": (lambda: lpmoe.group_quantize(x, qm, n, first_dims=fd, output=om),
                                    2 * e + 2 * e + 2 * e // 32),
        "mxfp8 dequant row": (lambda: lpmoe.group_dequantize(omr, torch.bfloat16), e + e // 32 + 2 * e),
        "mxfp8 dequant col swz": (lambda: lpmoe.group_dequantize(omc, torch.bfloat16), e + e // 32 + 2 * e),
        "nvfp4 quant row+col swz": (lambda: lpmoe.group_quantize(x, qn, n, first_dims=fd16, output=on),
                                    2 * e + e // 2 + e // 2 + 2 * e // 16),
        "nvfp4 dequant row": (lambda: lpmoe.group_dequantize(on, torch.bfloat16), e // 2 + e // 16 + 2 * e),
    }


def main():
    p = parser(__doc__)
    p.add_argument("--rounds", type=int, default=3, help="sweeps over all cases, interleaved; medians reported")
    p.add_argument("--ops", default="", help="time only the ops whose name contains this text (e.g. nvfp4); "
                   "every op's buffers are still made, and --summary lists only the timed ops")
    args = p.parse_args()
    torch.manual_seed(0)
    cases = [(65536, 7168, 8, False), (65536, 7168, 64, False), (65536, 7168, 64, True),
             (131072, 2048, 32, False), (65536, 2048, 8, True)]
    if args.quick:
        cases = cases[:1]
    built = [case_ops(*case) for case in cases]
    ratios, copies = {}, []  # ratios[(case, op)] -> one (vs copy, ms) per round
    for _ in range(args.rounds):
        copy_bw = copy_bandwidth_gbs()  # re-measured every round: a slow phase shows as spread
        copies.append(copy_bw)
        for name, ops in built:
            for op, (fn, nbytes) in ops.items():
                if args.ops not in op:
                    continue
                ms = graph_median_ms(fn)  # device time (see bench_fp8_block.py)
                ratios.setdefault((name, op), []).append((nbytes / ms / 1e6 / copy_bw, ms))
    print(f"device copy bandwidth: {statistics.median(copies):.0f} GB/s (read+write), {args.rounds} interleaved "
          "rounds, CUDA graphs of 10 calls: medians, [min, max] of the ratio to the copy")
    print(f"{'case':34s} {'op':26s} {'ms':>8s} {'vs copy':>8s} {'spread':>13s}")
    worst = {}
    for (name, op), rs in ratios.items():
        vs = [r[0] for r in rs]
        med, ms = statistics.median(vs), statistics.median(r[1] for r in rs)
        worst[op] = min(worst.get(op, 9.9), med)
        print(f"{name:34s} {op:26s} {ms:8.3f} {med:8.2f} {f'[{min(vs):.2f}, {max(vs):.2f}]':>13s}")
    write_summary(args.summary, [(f"{op} (min vs copy)", f"{r:.2f}") for op, r in worst.items()])


if __name__ == "__main__":
    main()
