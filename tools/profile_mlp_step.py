"""Where the GPU time of one expert-MLP training step goes: the kernels of one
forward+backward step of lpmoe.GroupedMLP (DeepSeek-V3 expert shapes, as
benchmarks/bench_grouped_mlp.py, router probabilities applied), FP8 block
scaling and bf16, by total CUDA time (torch.profiler), with the share of the
step spent outside the GEMMs.

    PYTHONPATH=python:benchmarks python3 tools/profile_mlp_step.py [experts] [tokens] [--cached]
        [--hidden H] [--ffn F] [--top K]

(--hidden / --ffn: other expert shapes, e.g. the launch-bound 2048 / 768 of
bench_compile.py; --top: how many kernels to list, 16 by default.)
"""
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import lpmoe
from bench_grouped_mlp import FFN, HIDDEN
from lpmoe.recipe import Float8BlockScaling

def _option(name, default):
    """--name VALUE from the command line (removed from argv), as an int."""
    if name in sys.argv:
        i = sys.argv.index(name)
        value = int(sys.argv[i + 1])
        del sys.argv[i:i + 2]
        return value
    return default


HIDDEN, FFN = _option("--hidden", HIDDEN), _option("--ffn", FFN)
TOP = _option("--top", 16)
args = [a for a in sys.argv[1:] if not a.startswith("--")]
cached = "--cached" in sys.argv
g = int(args[0]) if len(args) > 0 else 8
tokens = int(args[1]) if len(args) > 1 else 65536
m = torch.tensor([tokens // g] * g, device="cuda")
x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
p = torch.rand(tokens, device="cuda", requires_grad=True)
dy = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)


def is_gemm(name: str) -> bool:
    """The GEMM kernels themselves (CUTLASS device kernels, cuBLAS, lpmoe's
    own FP8 block kernels in lpmoe::fp8_gemm); lpmoe's small GEMM helpers
    (argument setup, row epilogue) count as outside."""
    n = name.lower()
    if "lpmoe::fp8_gemm::" in n or "cutlass13device_kernel" in n:  # mangled names carry lpmoe's types
        return True
    return any(k in n for k in ("cutlass", "xmma", "cublas", "sm90_")) and "lpmoe" not in n


for name, recipe in (("fp8", Float8BlockScaling()), ("bf16", None)):
    mlp = lpmoe.GroupedMLP(g, HIDDEN, FFN, params_dtype=torch.bfloat16, device="cuda")
    first = True if cached and recipe is not None else None

    def step(fmb):
        x.grad = p.grad = None
        mlp.zero_grad(set_to_none=True)
        with lpmoe.autocast(enabled=recipe is not None, recipe=recipe):
            mlp(x, m, probs=p, is_first_microbatch=fmb).backward(dy)

    step(first)
    fmb = False if first else None
    for _ in range(2):
        step(fmb)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step(fmb)
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.self_device_time_total for e in events) / 1e3
    gemm = sum(e.self_device_time_total for e in events if is_gemm(e.key)) / 1e3
    print(f"== {name}{' cachedW' if fmb is False else ''}: {g} experts x {tokens} tokens, GPU kernel time "
          f"{total:.2f} ms: GEMMs {gemm:.2f} ms, outside the GEMMs {total - gemm:.2f} ms "
          f"({100 * (total - gemm) / total:.1f} %)")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:TOP]:
        tag = "gemm" if is_gemm(e.key) else "    "
        print(f"  {e.self_device_time_total / 1e3:7.3f} ms  x{e.count:<3d} {tag} {e.key[:100]}")
    del mlp
    torch.cuda.empty_cache()
