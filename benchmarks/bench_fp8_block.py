"""FP8 block scaling kernels: effective bandwidth vs device copy bandwidth.

Bytes counted = input read once + every output written once (data, scales,
dbias partials).  Printed beside the device copy bandwidth of the same run:
a 1 GiB copy (the device's streaming rate) and a copy of the case's own
input (same bytes as a row+col quantize, same launch and tail effects: the
fair floor for the smaller cases).  Kernels are timed as CUDA graphs of 10
calls (device time: at the smaller cases one eager call's Python takes about
as long as its kernel, so eager timing measured the host); --eager times the
calls as launched from Python instead.  The copies are timed eagerly (they are
device-bound, and a captured copy is a slower memcpy node).

    PYTHONPATH=python python benchmarks/bench_fp8_block.py [--quick] [--rounds 3]
"""
from __future__ import annotations

import statistics

import torch

import lpmoe
from _common import copy_bandwidth_gbs, graph_median_ms, quantizer_splits, median_ms, parser, write_summary
from lpmoe import Float8BlockQuantizer


def case_ops(tokens, k, n, skewed):
    """(name, {op: (fn, bytes)}) of one case; its tensors stay alive in the closures."""
    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
    fd = torch.tensor(quantizer_splits(tokens, n, skewed), device="cuda")
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
    # fp32 weights quantized straight from fp32 (fp32 parameters under torch.autocast)
    x32 = x.float()
    out2f = lpmoe.group_quantize(x32, q2, n, first_dims=fd)
    ops["quant 2D row+col fp32 in"] = (lambda: lpmoe.group_quantize(x32, q2, n, first_dims=fd, output=out2f),
                                       4 * elems + 2 * elems)
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
    q2c = Float8BlockQuantizer(block_dim=2, rowwise=False)
    out2c = lpmoe.group_quantize(x, q2c, n, first_dims=fd)
    ops["dequant 2D col"] = (lambda: lpmoe.group_dequantize(out2c, torch.bfloat16), elems + 2 * elems)
    # the dequantize's traffic mix (1 byte read, 2 written) without its math:
    # PyTorch's own FP8 -> bf16 cast of the same bytes, a floor for "dequant"
    fp8_rows = outr.rowwise_data.view(torch.float8_e4m3fn)
    ops["torch fp8->bf16 cast"] = (lambda: fp8_rows.to(torch.bfloat16), elems + 2 * elems)
    ops["quant 1D col only"] = (lambda: lpmoe.group_quantize(x, qc, n, first_dims=fd, output=outc),
                                2 * elems + elems + scale1 - 4 * tokens * bx)

    def two_passes():  # how the FP8 backward quantizes dy: one direction per GEMM
        lpmoe.group_quantize_dbias(x, qc, n, first_dims=fd, output=outc)
        lpmoe.group_quantize(x, qr, n, first_dims=fd, output=outr)
    # bytes of the one-pass equivalent, so the ratio compares with "quant 1D + dbias"
    ops["quant 1D 2 passes+dbias"] = (two_passes, 2 * elems + 2 * elems + scale1 + 2 * 4 * (tokens // 128 + n) * k)
    return name, ops


def main():
    p = parser(__doc__)
    p.add_argument("--rounds", type=int, default=3, help="sweeps over all cases, interleaved; medians reported")
    p.add_argument("--eager", action="store_true", help="time eager calls (host included) instead of CUDA graphs")
    args = p.parse_args()
    timer = median_ms if args.eager else graph_median_ms
    torch.manual_seed(0)
    cases = [(16384, 7168, 8, False), (65536, 7168, 64, False), (65536, 7168, 64, True),
             (131072, 2048, 32, False), (65536, 2048, 8, True), (131072, 7168, 8, False)]
    if args.quick:
        cases = cases[:2]
    built = [(case, *case_ops(*case)) for case in cases]
    # ratios[(case name, op)] -> one (vs copy, vs same-size copy, ms) per round;
    # every round re-measures both copies, and all cases run in each round, so
    # a slow phase of the machine shows up as spread, not as one case's figure.
    ratios = {}
    copies = []
    for _ in range(args.rounds):
        copy_bw = copy_bandwidth_gbs()
        copies.append(copy_bw)
        for (tokens, k, _n, _s), name, ops in built:
            same_bw = copy_bandwidth_gbs(2 * tokens * k)
            for op, (fn, nbytes) in ops.items():
                ms = timer(fn)
                bw = nbytes / ms / 1e6
                ratios.setdefault((name, op), []).append((bw / copy_bw, bw / same_bw, ms))
    print(f"device copy bandwidth: {statistics.median(copies):.0f} GB/s (read+write), "
          f"{args.rounds} interleaved rounds, {'eager calls' if args.eager else 'CUDA graphs of 10 calls'}: "
          "medians, [min, max] of the ratio to the 1 GiB copy")
    print(f"{'case':38s} {'op':24s} {'ms':>8s} {'vs copy':>8s} {'spread':>13s} {'vs same-size copy':>18s}")
    worst, worst_same = {}, {}
    for (name, op), rs in ratios.items():
        vs = [r[0] for r in rs]
        med, same = statistics.median(vs), statistics.median(r[1] for r in rs)
        ms = statistics.median(r[2] for r in rs)
        print(f"{name:38s} {op:24s} {ms:8.3f} {med:8.2f} {f'[{min(vs):.2f}, {max(vs):.2f}]':>13s} {same:18.2f}")
        worst[op] = min(worst.get(op, 9.9), med)
        worst_same[op] = min(worst_same.get(op, 9.9), same)
    rows = [("copy bandwidth GB/s", f"{statistics.median(copies):.0f}")]
    for op, r in worst.items():
        rows.append((f"fp8blk {op} (min vs copy)", f"{r:.2f} (same-size copy {worst_same[op]:.2f})"))
    write_summary(args.summary, rows)


if __name__ == "__main__":
    main()
