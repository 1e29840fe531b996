"""Where the time of one expert-MLP training step goes (GPU machine): the
kernels of one fp8 and one bf16 forward+backward step of the benchmark's
DeepSeek-V3-like MLP, by total CUDA time (torch.profiler).

    PYTHONPATH=python:benchmarks python3 tools/profile_mlp_step.py [experts] [tokens]
"""
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import lpmoe
from bench_grouped_linear import HIDDEN, ExpertMLP
from lpmoe.recipe import Float8BlockScaling

g = int(sys.argv[1]) if len(sys.argv) > 1 else 8
tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 65536
m = torch.tensor([tokens // g] * g, device="cuda")
x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
dy = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
for name, recipe in (("fp8", Float8BlockScaling()), ("bf16", None)):
    mlp = ExpertMLP(g)

    def step():
        mlp.zero_grad(set_to_none=True)
        with lpmoe.autocast(enabled=recipe is not None, recipe=recipe):
            mlp(x, m).backward(dy)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.self_device_time_total for e in events) / 1e3
    print(f"== {name}: {g} experts x {tokens} tokens, GPU kernel time {total:.2f} ms")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:18]:
        print(f"  {e.self_device_time_total / 1e3:7.3f} ms  x{e.count:<3d} {e.key[:110]}")
