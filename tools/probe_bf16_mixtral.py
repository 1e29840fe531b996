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
from _common import median_ms  # noqa: E402
from bench_grouped_gemm import bf16_fprop_pair  # noqa: E402

ours, theirs, _, _ = bf16_fprop_pair(8, 16384, 4096, 14336)
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
