"""The kernels of the ncu pipe survey in docs/perf-notes.md (issue 13, stop 59):
one launch each of the fused SwiGLU activation forward and backward with FP8
outputs (8 experts x 64k tokens, F 2048) and of the FP8 block 1D / 2D /
1D+dbias and MXFP8 grouped quantizers (64k x 7168, 64 members).  Run under
Nsight Compute on the GPU machine, e.g.

  M=gpu__time_duration.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,\\
sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active,\\
sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active,\\
dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active
  PYTHONPATH=python ncu --kernel-name-base demangled \\
    -k regex:"activation::.*(forward|backward)_kernel|fp8_block::.*quantize|mxfp8::.*quantize" \\
    --metrics "$M" python3 tools/probe_pipes.py
"""
import torch, lpmoe
from lpmoe.activation import Activation, kernels
from lpmoe.quantizers import Float8BlockQuantizer
from lpmoe import MXFP8Quantizer
g, t, f = 8, 65536, 2048
spec = Activation("swiglu")
splits = torch.full((g,), t // g, device="cuda", dtype=torch.int64)
h = torch.randn(t, 2 * f, device="cuda", dtype=torch.bfloat16)
da = torch.randn(t, f, device="cuda", dtype=torch.bfloat16)
p = torch.rand(t, device="cuda")
Q = Float8BlockQuantizer(torch.float8_e4m3fn, block_dim=1)
kernels.forward(h, spec, p, splits, write_hp=False, quantizer=Q)
kernels.backward(da, h, spec, p, splits, dh_quantizer=Q, dbias=True)
x = torch.randn(65536, 7168, device="cuda", dtype=torch.bfloat16)
fd = torch.full((64,), 1024, device="cuda", dtype=torch.int64)
lpmoe.group_quantize(x, Float8BlockQuantizer(block_dim=1), 64, first_dims=fd)
lpmoe.group_quantize(x, Float8BlockQuantizer(block_dim=2), 64, first_dims=fd)
lpmoe.group_quantize_dbias(x, Float8BlockQuantizer(block_dim=1), 64, first_dims=fd)
lpmoe.group_quantize(x, MXFP8Quantizer(swizzled_scales=True), 64, first_dims=fd)
torch.cuda.synchronize()
