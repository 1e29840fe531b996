"""FP8 block scaling kernels: effective bandwidth vs device copy bandwidth.

Bytes counted = input read once + every output written once (data, scales,
dbias partials).  Printed beside the device copy bandwidth of the same run:
a 1 GiB copy (the device's streaming rate) and a copy of the case's own
input (same bytes as a row+col quantize, same launch and tail effects: the
fair floor for the smaller cases).

    PYTHONPATH=python python benchmarks/bench_fp8_block.py [--quick]
"""
from __future__ import annotations

import torch

import lpmoe
from _common import copy_bandwidth_gbs, median_ms, parser, write_summary
from lpmoe import Float8BlockQuantizer


def splits_for(tokens: int, n: int, skewed: bool):
    if not skewed:
        base = [tokens // n] * n
        base[-1] += tokens - sum(base)
        return base
    big = int(tokens * 0.9)
    rest = tokens - big
    s = [big] + [rest // (n - 1)] * (n - 1)
    s[-1] += tokens - sum(s)
    return s


def main():
    args = parser(__doc__).parse_args()
    torch.manual_seed(0)
    copy_bw = copy_bandwidth_gbs()
    print(f"device copy bandwidth: {copy_bw:.0f} GB/s (read+write)")
    cases = [(16384, 7168, 8, False), (65536, 7168, 64, False), (65536, 7168, 64, True),
             (131072, 2048, 32, False), (65536, 2048, 8, True), (131072, 7168, 8, False)]
    if args.quick:
        cases = cases[:2]
    rows = []
    hdr = f"{'case':38s} {'op':24s} {'MB':>8s} {'ms':>8s} {'GB/s':>8s} {'vs copy':>8s} {'vs same-size copy':>18s}"
    print(hdr)
    worst, worst_same = {}, {}
    for tokens, k, n, skewed in cases:
        same_bw = copy_bandwidth_gbs(2 * tokens * k)
        x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
        fd = torch.tensor(splits_for(tokens, n, skewed), device="cuda")
        name = f"{tokens // 1024}k x {k}, {n} members{' skewed' if skewed else ''}"
        elems = tokens * k
        bx = -(-k // 128)
        ops = {}
        q1 = Float8BlockQuantizer(block_dim=1)
        q2 = Float8BlockQuantizer(block_dim=2)
        out1 = lpmoe.group_quantize(x, q1, n, first_dims=fd)
        out2 = lpmoe.group_quantize(x, q2, n, first_dims=fd)
        scale1 = 4 * (tokens * bx + (tokens // 128 + n) * k)
        ops["quant 1D row+col"] = (lambda: lpmoe.group_quantize(x, q1, n, first_dims=fd, output=out1),
                                   2 * elems + 2 * elems + scale1)
        ops["quant 2D row+col"] = (lambda: lpmoe.group_quantize(x, q2, n, first_dims=fd, output=out2),
                                   2 * elems + 2 * elems)
        ops["quant 1D + dbias"] = (lambda: lpmoe.group_quantize_dbias(x, q1, n, first_dims=fd, output=out1),
                                   2 * elems + 2 * elems + scale1 + 2 * 4 * (tokens // 128 + n) * k)
        qr = Float8BlockQuantizer(block_dim=1, columnwise=False)
        outr = lpmoe.group_quantize(x, qr, n, first_dims=fd)
        ops["quant 1D row only"] = (lambda: lpmoe.group_quantize(x, qr, n, first_dims=fd, output=outr),
                                    2 * elems + elems + 4 * tokens * bx)
        ops["dequant 1D row"] = (lambda: lpmoe.group_dequantize(outr, torch.bfloat16), elems + 2 * elems + 4 * tokens * bx)
        qc = Float8BlockQuantizer(block_dim=1, rowwise=False)
        outc = lpmoe.group_quantize(x, qc, n, first_dims=fd)
        ops["dequant 1D col"] = (lambda: lpmoe.group_dequantize(outc, torch.bfloat16), elems + 2 * elems)
        ops["quant 1D col only"] = (lambda: lpmoe.group_quantize(x, qc, n, first_dims=fd, output=outc),
                                    2 * elems + elems + scale1 - 4 * tokens * bx)

        def two_passes():  # how the FP8 backward quantizes dy: one direction per GEMM
            lpmoe.group_quantize_dbias(x, qc, n, first_dims=fd, output=outc)
            lpmoe.group_quantize(x, qr, n, first_dims=fd, output=outr)
        # bytes of the one-pass equivalent, so the ratio compares with "quant 1D + dbias"
        ops["quant 1D 2 passes+dbias"] = (two_passes, 2 * elems + 2 * elems + scale1 + 2 * 4 * (tokens // 128 + n) * k)
        for op, (fn, nbytes) in ops.items():
            ms = median_ms(fn)
            bw = nbytes / ms / 1e6
            ratio, same = bw / copy_bw, bw / same_bw
            print(f"{name:38s} {op:24s} {nbytes / 1e6:8.0f} {ms:8.3f} {bw:8.0f} {ratio:8.2f} {same:18.2f}")
            worst[op] = min(worst.get(op, 9.9), ratio)
            worst_same[op] = min(worst_same.get(op, 9.9), same)
        del x, out1, out2, outr, outc
        torch.cuda.empty_cache()
    rows.append(("copy bandwidth GB/s", f"{copy_bw:.0f}"))
    for op, r in worst.items():
        rows.append((f"fp8blk {op} (min vs copy)", f"{r:.2f} (same-size copy {worst_same[op]:.2f})"))
    write_summary(args.summary, rows)


if __name__ == "__main__":
    main()
