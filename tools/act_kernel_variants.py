"""Times the fused activation kernels with parts switched on and off (GPU
machine), to see what each output costs: FP8 vs high-precision dh, the fused
bias partials, the probs reduction; and the plain quantize kernel on the same
bytes for comparison.  Ratios are to a device copy measured in the same run.

    PYTHONPATH=python:benchmarks python3 tools/act_kernel_variants.py [tokens] [ffn]
"""
import sys

import torch

import lpmoe
from _common import copy_bandwidth_gbs, median_ms
from lpmoe.activation import Activation, kernels
from lpmoe.quantizers import Float8BlockQuantizer

t = int(sys.argv[1]) if len(sys.argv) > 1 else 65536
f = int(sys.argv[2]) if len(sys.argv) > 2 else 2048
g = 8
q = Float8BlockQuantizer(torch.float8_e4m3fn, block_dim=1)
qrow = q.copy(columnwise=False)
spec = Activation("swiglu")
h = torch.randn(t, 2 * f, device="cuda", dtype=torch.bfloat16)
da = torch.randn(t, f, device="cuda", dtype=torch.bfloat16)
p = torch.rand(t, device="cuda")
sp = torch.full((g,), t // g, device="cuda")
copy = copy_bandwidth_gbs()
fp8 = lambda c: 2 * t * c + 2 * t * (c // 128) * 4  # noqa: E731  row + col data and scales
cases = {
    "fwd fp8 row+col, probs": (lambda: kernels.forward(h, spec, p, sp, write_hp=False, quantizer=q),
                               t * 4 * f + fp8(f)),
    "fwd fp8 row, no probs": (lambda: kernels.forward(h, spec, None, sp, write_hp=False, quantizer=qrow),
                              t * 4 * f + t * f),
    "fwd bf16, no probs": (lambda: kernels.forward(h, spec, None, None, write_hp=True), t * 4 * f + t * 2 * f),
    "bwd fp8 dh, dbias, probs": (lambda: kernels.backward(da, h, spec, p, sp, dh_quantizer=q, dbias=True),
                                 t * 6 * f + fp8(2 * f)),
    "bwd fp8 dh, probs": (lambda: kernels.backward(da, h, spec, p, sp, dh_quantizer=q), t * 6 * f + fp8(2 * f)),
    "bwd fp8 dh": (lambda: kernels.backward(da, h, spec, None, sp, dh_quantizer=q), t * 6 * f + fp8(2 * f)),
    "bwd fp8 dh rowwise only": (lambda: kernels.backward(da, h, spec, None, sp, dh_quantizer=qrow),
                                t * 6 * f + t * 2 * f),
    "bwd bf16 dh, probs": (lambda: kernels.backward(da, h, spec, p, None, dh_hp=True), t * 10 * f),
    "bwd bf16 dh": (lambda: kernels.backward(da, h, spec, None, None, dh_hp=True), t * 10 * f),
    "quantize (T, 2F) row+col + dbias": (lambda: lpmoe.group_quantize_dbias(h, q, g, first_dims=sp),
                                         t * 4 * f + fp8(2 * f)),
    "quantize (T, 2F) row+col": (lambda: lpmoe.group_quantize(h, q, g, first_dims=sp), t * 4 * f + fp8(2 * f)),
}
print(f"{torch.cuda.get_device_name()}  T={t} F={f}  copy {copy:.0f} GB/s")
for name, (fn, nbytes) in cases.items():
    ms = median_ms(fn, warmup=3, iters=9, reps=5)
    print(f"  {name:36s} {ms * 1e3:8.1f} us  {nbytes / ms / 1e6 / copy:5.2f} of copy", flush=True)
