"""MXFP8 and NVFP4 kernels on Hopper: effective bandwidth vs device copy.

Bytes counted = input read once + every output written once (data + scales);
NVFP4 quantize also reads its input a second time for the per-member amax,
which is NOT counted (its ratio is therefore against the 1-pass floor).
Kernels are timed as CUDA graphs of 10 calls (device time, as in
bench_fp8_block.py), the copy eagerly.

    PYTHONPATH=python:benchmarks python benchmarks/bench_mx_formats.py
"""
from __future__ import annotations

import torch

import lpmoe
from _common import copy_bandwidth_gbs, graph_median_ms, parser, write_summary
from lpmoe import MXFP8Quantizer, NVFP4Quantizer


def main():
    args = parser(__doc__).parse_args()
    torch.manual_seed(0)
    copy_bw = copy_bandwidth_gbs()
    print(f"device copy bandwidth: {copy_bw:.0f} GB/s (read+write)")
    cases = [(65536, 7168, 8), (65536, 7168, 64), (131072, 2048, 32)]
    if args.quick:
        cases = cases[:1]
    print(f"{'case':30s} {'op':28s} {'MB':>8s} {'ms':>8s} {'GB/s':>8s} {'vs copy':>8s}")
    worst = {}
    for tokens, k, n in cases:
        x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
        fd = torch.full((n,), tokens // n, device="cuda", dtype=torch.int64)
        e = tokens * k
        name = f"{tokens // 1024}k x {k}, {n} members"
        qm = MXFP8Quantizer(swizzled_scales=True)
        om = lpmoe.group_quantize(x, qm, n, first_dims=fd)
        qmr = MXFP8Quantizer(columnwise=False)
        omr = lpmoe.group_quantize(x, qmr, n, first_dims=fd)
        qmc = MXFP8Quantizer(rowwise=False, swizzled_scales=True)
        omc = lpmoe.group_quantize(x, qmc, n, first_dims=fd)
        qn = NVFP4Quantizer(swizzled_scales=True)
        on = lpmoe.group_quantize(x, qn, n, first_dims=fd)
        ops = {
            "mxfp8 quant row+col swz": (lambda: lpmoe.group_quantize(x, qm, n, first_dims=fd, output=om),
                                        2 * e + 2 * e + 2 * e // 32),
            "mxfp8 dequant row": (lambda: lpmoe.group_dequantize(omr, torch.bfloat16), e + e // 32 + 2 * e),
            "mxfp8 dequant col swz": (lambda: lpmoe.group_dequantize(omc, torch.bfloat16), e + e // 32 + 2 * e),
            "nvfp4 quant row+col swz": (lambda: lpmoe.group_quantize(x, qn, n, first_dims=fd, output=on),
                                        2 * e + e // 2 + e // 2 + 2 * e // 16),
            "nvfp4 dequant row": (lambda: lpmoe.group_dequantize(on, torch.bfloat16), e // 2 + e // 16 + 2 * e),
        }
        for op, (fn, nbytes) in ops.items():
            ms = graph_median_ms(fn)  # device time (see bench_fp8_block.py)
            bw = nbytes / ms / 1e6
            r = bw / copy_bw
            worst[op] = min(worst.get(op, 9.9), r)
            print(f"{name:30s} {op:28s} {nbytes / 1e6:8.0f} {ms:8.3f} {bw:8.0f} {r:8.2f}")
        del x, om, omr, omc, on
        torch.cuda.empty_cache()
    write_summary(args.summary, [(f"{op} (min vs copy)", f"{r:.2f}") for op, r in worst.items()])


if __name__ == "__main__":
    main()
