"""Mixtral-up bf16 fprop (8 x 2048 rows, K 4096, N 14336): lpmoe's grouped
kernel and torch._grouped_mm, the one shape whose device time trails torch's
with the same CUTLASS tile (docs/gemm-notes.md).  --time: interleaved
medians; --names: the full kernel symbols of one call each (the template
arguments: stages, epilogue policy).

    PYTHONPATH=python python3 tools/probe_bf16_mixtral.py --time --names   (GPU machine)
"""
import sys

import torch

sys.path.insert(0, "benchmarks")
import lpmoe  # noqa: E402
from _common import median_ms, splits_for  # noqa: E402
from bench_grouped_gemm import grouped  # noqa: E402

g, tokens, k, n = 8, 16384, 4096, 14336
splits = splits_for(g, tokens, False)
offs = torch.cumsum(torch.tensor(splits, device="cuda"), 0).to(torch.int32)
x = torch.randn(tokens, k, device="cuda").bfloat16()
w = (torch.randn(g, n, k, device="cuda") * 0.02).bfloat16()
xg = grouped(x, splits)
ours = lambda: lpmoe.grouped_gemm(xg, w, kind="fprop", backend="grouped")  # noqa: E731
theirs = lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)  # noqa: E731
for _ in range(6):
    ours(), theirs()
torch.cuda.synchronize()
if "--time" in sys.argv:
    for r in range(3):
        a, b = median_ms(ours, warmup=2, iters=7, reps=5), median_ms(theirs, warmup=2, iters=7, reps=5)
        print(f"round {r}: lpmoe {a:.3f} ms torch {b:.3f} ms ratio {b / a:.3f}")
if "--names" in sys.argv:
    for tag, fn in (("lpmoe", ours), ("torch", theirs)):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA and "device_kernel" in e.name:
                print(f"{tag} {e.device_time:.1f} us {e.name}")
