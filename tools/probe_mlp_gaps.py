"""GPU idle time inside an expert-MLP training step (DeepSeek-V3 shapes, as
bench_grouped_mlp.py): three back-to-back steps under torch.profiler; lists
the gaps between consecutive kernels longer than a threshold, with the
kernels on both sides, and the host time per step.  Also runs one step under
set_sync_debug_mode("warn") to name any host sync.

    PYTHONPATH=python:benchmarks python3 tools/probe_mlp_gaps.py [fp8|bf16] [experts] [tokens]
"""
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

import lpmoe
from bench_grouped_mlp import FFN, HIDDEN
from lpmoe.recipe import Float8BlockScaling

kind = sys.argv[1] if len(sys.argv) > 1 else "fp8"
g = int(sys.argv[2]) if len(sys.argv) > 2 else 8
tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 65536
recipe = Float8BlockScaling() if kind == "fp8" else None
m = torch.tensor([tokens // g] * g, device="cuda")
x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
p = torch.rand(tokens, device="cuda", requires_grad=True)
dy = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
mlp = lpmoe.GroupedMLP(g, HIDDEN, FFN, params_dtype=torch.bfloat16, device="cuda")


def step():
    x.grad = p.grad = None
    mlp.zero_grad(set_to_none=True)
    with lpmoe.autocast(enabled=recipe is not None, recipe=recipe):
        mlp(x, m, probs=p).backward(dy)


for _ in range(3):
    step()
torch.cuda.synchronize()
torch.cuda.set_sync_debug_mode("warn")
step()
torch.cuda.set_sync_debug_mode(0)
torch.cuda.synchronize()
t0 = time.perf_counter()
for _ in range(3):
    step()
host = (time.perf_counter() - t0) / 3 * 1e3
torch.cuda.synchronize()
a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
a.record()
for _ in range(3):
    step()
b.record()
b.synchronize()
print(f"{kind}: host {host:.2f} ms per step (enqueue), wall {a.elapsed_time(b) / 3:.2f} ms per step")
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(3):
        step()
    torch.cuda.synchronize()
ev = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0),
            key=lambda e: e.time_range.start)
busy = sum(e.time_range.end - e.time_range.start for e in ev)
span = ev[-1].time_range.end - ev[0].time_range.start
print(f"kernels {len(ev)}: span {span / 3e3:.2f} ms per step, busy {busy / 3e3:.2f}, idle {(span - busy) / 3e3:.2f}")
gaps = []
for e0, e1 in zip(ev, ev[1:]):
    gap = e1.time_range.start - e0.time_range.end
    if gap > 20:
        gaps.append((gap, e0.name[:60], e1.name[:60]))
for gap, n0, n1 in sorted(gaps, reverse=True)[:25]:
    print(f"  gap {gap:8.1f} us  after {n0}  before {n1}")
