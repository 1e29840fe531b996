"""bf16 grouped GEMM beside torch._grouped_mm, per shape and kind: TFLOP/s
timed eagerly (as bench_grouped_gemm.py) and as CUDA-graph replays (device
time), host microseconds per call (measured while the GPU sleeps, so no call
waits on the device), and, for the Qwen3 shapes, the kernels of one call.

    PYTHONPATH=python python3 tools/profile_16bit_gemm.py   (GPU machine)
"""
import sys

import torch

sys.path.insert(0, "benchmarks")
import lpmoe  # noqa: E402
from _common import graph_median_ms, host_us, median_ms, splits_for  # noqa: E402
from bench_grouped_gemm import SHAPES, grouped  # noqa: E402


def kernels(fn):
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
    out = []
    for e in prof.key_averages():
        if e.device_time_total > 0:
            out.append((e.device_time_total / 5, e.count // 5, e.key[:90]))
    return sorted(out, reverse=True)


cases = [("qwen3-up", 32, 16384), ("qwen3-up", 64, 4096), ("qwen3-down", 64, 65536), ("mixtral-up", 8, 16384),
         ("dsv3-down", 8, 32768)]
for name, g, tokens in cases:
    k, n = next((k, n) for s, k, n in SHAPES if s == name)
    splits = splits_for(g, tokens, False)
    offs = torch.cumsum(torch.tensor(splits, device="cuda"), 0).to(torch.int32)
    x = torch.randn(tokens, k, device="cuda").bfloat16()
    dy = torch.randn(tokens, n, device="cuda").bfloat16()
    w = (torch.randn(g, n, k, device="cuda") * 0.02).bfloat16()
    xg, dyg = grouped(x, splits), grouped(dy, splits)
    flops = 2.0 * tokens * n * k
    fns = {
        "fprop": (lambda: lpmoe.grouped_gemm(xg, w, kind="fprop", backend="grouped"),
                  lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)),
        "dgrad": (lambda: lpmoe.grouped_gemm(dyg, w, kind="dgrad", backend="grouped"),
                  lambda: torch._grouped_mm(dy, w, offs=offs)),
        "wgrad": (lambda: lpmoe.grouped_gemm(dyg, xg, kind="wgrad", backend="grouped", out_dtype=torch.bfloat16),
                  lambda: torch._grouped_mm(dy.t(), x, offs=offs)),
    }
    for kind, (ours, theirs) in fns.items():
        r = {}
        for tag, fn in (("lpmoe", ours), ("torch", theirs)):
            r[tag] = (median_ms(fn, warmup=3, iters=7, reps=5), graph_median_ms(fn, iters=7, reps=5), host_us(fn))
        (le, lg, lh), (te, tg, th) = r["lpmoe"], r["torch"]
        print(f"{name} g{g} {tokens} {kind}: eager TF lpmoe {flops/le/1e9:.0f} torch {flops/te/1e9:.0f} "
              f"({te/le:.2f}) | graph TF lpmoe {flops/lg/1e9:.0f} torch {flops/tg/1e9:.0f} ({tg/lg:.2f}) | "
              f"host us lpmoe {lh:.0f} torch {th:.0f}", flush=True)
        if name == "qwen3-up":
            for tag, fn in (("lpmoe", ours), ("torch", theirs)):
                for us, cnt, key in kernels(fn):
                    print(f"    {tag}: {us:8.1f} us x{cnt} {key}")
