#!/usr/bin/env bash
# Nsight Compute summary of the FP8-block kernels on one large case (GPU machine).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/lpmoe_out}"; mkdir -p "$OUT"
cat > /tmp/lpmoe_prof.py <<'PY'
import torch, lpmoe
from lpmoe import Float8BlockQuantizer
x = torch.randn(65536, 7168, device="cuda", dtype=torch.bfloat16)
fd = torch.tensor([1024] * 64, device="cuda")
for bd in (1, 2):
    g = lpmoe.group_quantize(x, Float8BlockQuantizer(block_dim=bd), 64, first_dims=fd)
r = lpmoe.group_quantize(x, Float8BlockQuantizer(columnwise=False), 64, first_dims=fd)
lpmoe.group_dequantize(r, torch.bfloat16)
torch.cuda.synchronize()
PY
PYTHONPATH=python ncu --section SpeedOfLight --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis \
  -k regex:"quantize_kernel|dequantize_kernel" python3 /tmp/lpmoe_prof.py > "$OUT/ncu.txt" 2>&1
grep -E "quantize_kernel|DRAM Throughput|Memory Throughput|Achieved Occupancy|Theoretical Occupancy|Duration|Stall|Warp Cycles Per Issued|L2 Hit|Block Limit" "$OUT/ncu.txt" | head -80
