# Times DeepGEMM's anchor fprop from LPMOE_DEEPGEMM_DIR (no correctness check: ablations are wrong on purpose).
import sys, os, torch
sys.path.insert(0, "benchmarks")
import _deepgemm_peer as dgp
from _common import median_ms
assert dgp.load() is not None, dgp.reason()
splits, k, n = [4096] * 8, 7168, 4096
x = torch.randn(sum(splits), k, device="cuda").bfloat16()
w = (torch.randn(len(splits), n, k, device="cuda") * 0.02).bfloat16()
fn, flops = dgp.fprop(splits, x, w)
fn(); torch.cuda.synchronize()
for r in range(3):
    ms = median_ms(fn, warmup=3, iters=10, reps=7)
    print(f"{sys.argv[1]} {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s")
