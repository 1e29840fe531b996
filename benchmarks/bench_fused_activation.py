"""Fused activation kernels (lpmoe.activation.kernels) beside the device copy
and beside the unfused sequences they replace, in one run.

Bytes count each input read once and each output written once (FP8 data,
fp32 scales, bf16 values); the bandwidth ratio is to a device-to-device copy
measured in the same run (bytes read + written).

  fwd fp8           h (T, 2F) bf16 -> a as fc2's FP8 operands (1x128 rowwise for
                    fprop + transposed for wgrad: what group_quantize writes)
  bwd fp8           da (T, F), h -> dh as fc1's FP8 dgrad + wgrad operands (rowwise
                    + transposed, fused bias partials) and d probs
  fwd/bwd bf16      the same with high-precision outputs (BF16 GroupedMLP)

Unfused baselines: "torch" = chunk/silu/mul (autograd for the backward) then
lpmoe.group_quantize(_dbias); "lpmoe hp" = the high-precision kernel then
group_quantize.  Probs (router weights) are applied in every variant.

Each variant is timed as a CUDA graph of 10 calls (device time of the whole
call: its offsets, the kernel, the d probs / dbias reductions), since at the
smaller cases one eager call's Python takes longer than its kernels; --eager
times calls as launched from Python instead (host included).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import lpmoe
from lpmoe.activation import Activation, kernels
from lpmoe.quantizers import Float8BlockQuantizer

from _common import copy_bandwidth_gbs, graph_median_ms, median_ms, parser, routed_splits, write_summary

Q_BOTH = Float8BlockQuantizer(torch.float8_e4m3fn, block_dim=1)


def fp8_bytes(t: int, c: int, row: bool, col: bool) -> int:
    """FP8 data + fp32 1x128 scales of a (t, c) operand."""
    n = 0
    if row:
        n += t * c + t * (-(-c // 128)) * 4
    if col:
        n += t * c + (-(-t // 128)) * c * 4
    return n


def run_case(g, tokens, f, skewed, copy_gbs, eager):
    spec = Activation("swiglu")
    splits = torch.tensor(routed_splits(g, tokens, skewed), device="cuda")
    h = torch.randn(tokens, 2 * f, device="cuda", dtype=torch.bfloat16)
    da = torch.randn(tokens, f, device="cuda", dtype=torch.bfloat16)
    p = torch.rand(tokens, device="cuda")
    t = tokens
    rows = []

    def add(name, fn, nbytes, base=None):
        ms = median_ms(fn, warmup=3, iters=9, reps=5) if eager else graph_median_ms(fn, reps=10)
        gbs = nbytes / ms / 1e6
        rows.append((name, ms, gbs / copy_gbs, base))
        return ms

    # -- forward: a as fc2's FP8 operands (rowwise + transposed)
    fwd_in = t * 2 * f * 2 + t * 4
    fwd_fp8 = fwd_in + fp8_bytes(t, f, True, True)
    ms_fwd = add("fwd fp8 row+col (fused)", lambda: kernels.forward(h, spec, p, splits, write_hp=False,
                                                                    quantizer=Q_BOTH), fwd_fp8)

    def torch_fwd():
        g_, v_ = h.chunk(2, dim=-1)
        a = F.silu(g_) * v_ * p[:, None].to(h.dtype)
        return lpmoe.group_quantize(a, Q_BOTH, g, first_dims=splits)

    def hp_fwd():
        a = kernels.forward(h, spec, p, None, write_hp=True).hp
        return lpmoe.group_quantize(a, Q_BOTH, g, first_dims=splits)
    add("  unfused: torch + quantize", torch_fwd, fwd_fp8, ms_fwd)
    add("  unfused: lpmoe bf16 + quantize", hp_fwd, fwd_fp8, ms_fwd)
    add("fwd bf16 (fused)", lambda: kernels.forward(h, spec, p, None, write_hp=True), fwd_in + t * f * 2)

    # -- backward: dh as fc1's FP8 operands, fc1's bias partials, d probs
    bwd_in = t * f * 2 + t * 2 * f * 2 + t * 4
    bwd_fp8 = bwd_in + fp8_bytes(t, 2 * f, True, True) + t * 4
    ms_bwd = add("bwd fp8 dh row+col, dbias (fused)",
                 lambda: kernels.backward(da, h, spec, p, splits, dh_quantizer=Q_BOTH, dbias=True), bwd_fp8)
    hr = h.detach().requires_grad_(True)
    pr = p.detach().requires_grad_(True)

    def torch_bwd():
        g_, v_ = hr.chunk(2, dim=-1)
        a = F.silu(g_) * v_ * pr[:, None].to(h.dtype)
        dh, dp = torch.autograd.grad(a, (hr, pr), da)
        return lpmoe.group_quantize_dbias(dh, Q_BOTH, g, first_dims=splits), dp

    def hp_bwd():
        r = kernels.backward(da, h, spec, p, None, dh_hp=True)
        return lpmoe.group_quantize_dbias(r.dh, Q_BOTH, g, first_dims=splits), r.dprobs
    add("  unfused: torch autograd + quantize", torch_bwd, bwd_fp8, ms_bwd)
    add("  unfused: lpmoe bf16 + quantize", hp_bwd, bwd_fp8, ms_bwd)
    add("bwd bf16 dh (fused)", lambda: kernels.backward(da, h, spec, p, None, dh_hp=True),
        bwd_in + t * 2 * f * 2 + t * 4)
    return rows


def main():
    p = parser(__doc__)
    p.add_argument("--eager", action="store_true", help="time eager calls (host included) instead of CUDA graphs")
    args = p.parse_args()
    torch.manual_seed(0)
    copy_gbs = copy_bandwidth_gbs()
    cases = [(8, 65536, 2048, False), (8, 65536, 2048, True), (32, 16384, 2048, False), (64, 65536, 768, True)]
    if args.quick:
        cases = cases[:1]
    print(f"device {torch.cuda.get_device_name()}  copy {copy_gbs:.0f} GB/s (read+write); "
          f"{'eager calls' if args.eager else 'CUDA graphs of 10 calls'}")
    summary = []
    for g, t, f, skew in cases:
        tag = f"g={g} T={t} F={f} {'skew' if skew else 'unif'}"
        print(f"== {tag}")
        worst = {}
        for name, ms, ratio, base in run_case(g, t, f, skew, copy_gbs, args.eager):
            extra = f"  fused is {ms / base:4.2f}x faster" if base else ""
            print(f"  {name:44s} {ms * 1e3:8.1f} us  {ratio:5.2f} of copy{extra}", flush=True)
            if "(fused)" in name:
                worst[name] = ratio
        for name, r in worst.items():
            summary.append((f"act {tag} {name}", f"{r:.2f} of copy"))
    write_summary(args.summary, summary)


if __name__ == "__main__":
    main()
