#!/usr/bin/env bash
# ncu summary of the fused activation kernels (GPU machine): one FP8 forward
# and one FP8 backward launch at DeepSeek-V3 expert shapes (8 experts x 64k
# tokens, F = 2048, SwiGLU, probs), speed of light, occupancy, launch
# configuration and warp stall reasons.
#
#   bash tools/profile_activation.sh        (after a build; needs ncu)
set -uo pipefail
cd "$(dirname "$0")/.."
NCU=${NCU:-$(command -v ncu || echo /opt/nvidia/nsight-compute/2025.3.1/ncu)}
cat > /tmp/lpmoe_act_once.py <<'PY'
import torch
from lpmoe.activation import Activation, kernels
from lpmoe.quantizers import Float8BlockQuantizer
q = Float8BlockQuantizer(torch.float8_e4m3fn, block_dim=1)
t, f, g = 65536, 2048, 8
h = torch.randn(t, 2 * f, device="cuda", dtype=torch.bfloat16)
da = torch.randn(t, f, device="cuda", dtype=torch.bfloat16)
p = torch.rand(t, device="cuda")
sp = torch.full((g,), t // g, device="cuda")
kernels.forward(h, Activation("swiglu"), p, sp, write_hp=False, quantizer=q)
kernels.backward(da, h, Activation("swiglu"), p, sp, dh_quantizer=q, dbias=True)
torch.cuda.synchronize()
PY
PYTHONPATH=python "$NCU" --clock-control none -k regex:"(forward|backward)_kernel" -c 2 \
  --section SpeedOfLight --section Occupancy --section WarpStateStats --section SourceCounters \
  --section MemoryWorkloadAnalysis \
  python3 /tmp/lpmoe_act_once.py 2>&1 | grep -vE "^==PROF==|^\s*$|----" | cut -c1-160
