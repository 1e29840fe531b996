"""Where the GPU time of one expert-MLP training step goes: the kernels of one
forward+backward step of lpmoe.GroupedMLP (DeepSeek-V3 expert shapes, as
benchmarks/bench_grouped_mlp.py, router probabilities applied), FP8 block
scaling and bf16, by total CUDA time (torch.profiler), with the share of the
step spent outside the GEMMs.

    PYTHONPATH=python:benchmarks python3 tools/profile_mlp_step.py [experts] [tokens] [--cached]
        [--skewed] [--hidden H] [--ffn F] [--top K]

(--skewed: the benchmark's skewed routing, half of the tokens to expert 0;
--hidden / --ffn: other expert shapes, e.g. the launch-bound 2048 / 768 of
bench_compile.py; --top: how many kernels to list, 16 by default.)
"""
import argparse

import torch
from torch.profiler import ProfilerActivity, profile

import lpmoe
from _common import splits_for
from bench_grouped_mlp import FFN, HIDDEN
from lpmoe.recipe import Float8BlockScaling

_p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
_p.add_argument("experts", type=int, nargs="?", default=8)
_p.add_argument("tokens", type=int, nargs="?", default=65536)
_p.add_argument("--cached", action="store_true", help="FP8 weights cached across steps (is_first_microbatch)")
_p.add_argument("--skewed", action="store_true", help="half of the tokens to expert 0 (bench_grouped_mlp's skew)")
_p.add_argument("--hidden", type=int, default=HIDDEN)
_p.add_argument("--ffn", type=int, default=FFN)
_p.add_argument("--top", type=int, default=16, help="kernels to list")
_a = _p.parse_args()
HIDDEN, FFN, TOP, cached, g, tokens = _a.hidden, _a.ffn, _a.top, _a.cached, _a.experts, _a.tokens
m = torch.tensor(splits_for(g, tokens, _a.skewed), device="cuda")
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
    print(f"== {name}{' cachedW' if fmb is False else ''}: {g} experts x {tokens} tokens"
          f"{' skewed' if _a.skewed else ''}, GPU kernel time "
          f"{total:.2f} ms: GEMMs {gemm:.2f} ms, outside the GEMMs {total - gemm:.2f} ms "
          f"({100 * (total - gemm) / total:.1f} %)")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:TOP]:
        tag = "gemm" if is_gemm(e.key) else "    "
        print(f"  {e.self_device_time_total / 1e3:7.3f} ms  x{e.count:<3d} {tag} {e.key[:100]}")
    del mlp
    torch.cuda.empty_cache()
